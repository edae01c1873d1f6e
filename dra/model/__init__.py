"""The pure device model: GPU records and catalog, MIG placement rule, devices with shared counters,
ResourceSlice packing and limits, node policy, quantities. No I/O, no NVML calls, no Kubernetes client."""
