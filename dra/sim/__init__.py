"""The simulated GPU: a fake NVML library with pynvml's functions and error codes, its persistent state and
injected faults, simulated sharing tools and driver root, and fleet files. Plugs into the seams of dra.node."""
