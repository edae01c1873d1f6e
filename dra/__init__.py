"""The driver's core, in three layers: ``model`` (pure), ``node`` (actions over the NVML and tool seams) and
``sim`` (the simulated GPU behind those seams)."""
