"""What discovery learns about a node's GPUs: plain, immutable records.

These records are the contract between inventory (which fills them from NVML, real or simulated)
and everything above it (device model, slices, prepare). Nothing here talks to NVML or Kubernetes.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MigProfile:
    """A GPU-instance profile as NVML reports it (nvmlDeviceGetGpuInstanceProfileInfo + placements)."""

    profile_id: int          # nvidia-smi GI profile id (info.id), e.g. 19 for 1g on A100/H100
    nvml_index: int          # NVML_GPU_INSTANCE_PROFILE_* constant the info was read with
    name: str                # canonical name, e.g. "1g.10gb", "1g.10gb+me", "1g.20gb"
    compute_slices: int      # info.sliceCount
    memory_slices: int       # placement size in memory slices
    max_instances: int       # info.instanceCount
    memory_mib: int          # info.memorySizeMB (really MiB)
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    starts: tuple[int, ...]  # valid placement starts (nvmlDeviceGetGpuInstancePossiblePlacements_v2)


@dataclass(frozen=True)
class MigInstance:
    """A GPU instance (with its single full-size compute instance) that exists on the GPU now."""

    gi_id: int
    ci_id: int
    profile_id: int
    start: int
    size: int
    uuid: str                # "MIG-..."
    memory_mib: int


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU."""

    index: int
    minor: int                            # /dev/nvidia<minor>; device names use it (stable across index shifts)
    uuid: str                             # "GPU-..."
    product_name: str                     # nvmlDeviceGetName, e.g. "NVIDIA H100 80GB HBM3"
    brand: str                            # e.g. "Nvidia", "Tesla"
    architecture: str                     # NVML spelling: "Ampere", "Ada Lovelace", "Hopper", "Blackwell", ...
    cuda_compute_capability: tuple[int, int]
    memory_mib: int                       # total framebuffer
    multiprocessors: int
    pci_bus_id: str                       # extended BDF, lower case: "0000:3b:00.0"
    numa_node: int | None
    pci_device_id: int                    # PCI device id << 16 | vendor (0x10de), as NVML reports it
    compute_mode: str                     # "Default", "ExclusiveProcess", "Prohibited"
    mig_capable: bool
    mig_enabled: bool                     # current MIG mode
    mig_pending: bool                     # pending MIG mode (differs from current until a reset on Ampere)
    memory_slices: int                    # MIG memory slices (8, or 4 on A30); 0 when not MIG-capable
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0
    mig_profiles: tuple[MigProfile, ...] = ()
    mig_instances: tuple[MigInstance, ...] = ()
    pcie_root: str | None = None          # "pci0000:17" from sysfs; None when unknown (e.g. simulated GPUs)
    healthy: bool = True
    health_reason: str = ""              # why unhealthy, e.g. "GPU is lost" or the NVML error


@dataclass(frozen=True)
class NodeInventory:
    """Everything discovery found on one node."""

    driver_version: str                   # "580.95.05"
    cuda_driver_version: str              # "13.0"
    gpus: tuple[GpuInfo, ...] = field(default_factory=tuple)


def mig_mode_switches_at_runtime(cuda_compute_capability: tuple[int, int]) -> bool:
    """Hopper (CUDA compute capability 9.0) and later switch MIG mode at once; Ampere needs a GPU reset, which
    the driver never does. The one copy of this rule: the device model and the MIG actions both ask it."""
    return tuple(cuda_compute_capability) >= (9, 0)
