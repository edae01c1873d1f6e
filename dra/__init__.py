"""The driver's core: ``model`` (pure: what the driver publishes and the rules it keeps), ``node`` (actions over
the NVML and tool seams), ``sim`` (the simulated GPU behind those seams), and beside them ``scheduling`` (pure:
the scheduler's allocator inputs replicated for the operator tools of ops/)."""
