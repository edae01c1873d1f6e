"""Node-side actions over the NVML and tool seams: discovery, MIG devices, time-slicing and MPS, CDI specs,
the driver root, the checkpoint, device health. Built on dra.model; never imports the simulation."""
