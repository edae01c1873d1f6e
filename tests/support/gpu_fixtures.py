"""Hand-built GpuInfo records for device-model tests (MIG geometry from NVIDIA's published tables).

``slots8`` is the A100/H100/H200/B200 geometry (8 memory slices, 7 compute slices); ``slots4`` is A30's.
"""
from __future__ import annotations

from dataclasses import replace

from dra.model.gpu import GpuInfo, MigInstance, MigProfile, NodeInventory


def _p(pid, nvml_index, name, c, size, starts, max_i, mib, sms, ce=1, dec=0, enc=0, jpg=0, ofa=0) -> MigProfile:
    return MigProfile(
        profile_id=pid, nvml_index=nvml_index, name=name, compute_slices=c, memory_slices=size,
        max_instances=max_i, memory_mib=mib, multiprocessors=sms, copy_engines=ce, decoders=dec,
        encoders=enc, jpeg_engines=jpg, ofa_engines=ofa, starts=tuple(starts),
    )


def h100_profiles() -> tuple[MigProfile, ...]:
    return (
        _p(19, 0, "1g.10gb", 1, 1, range(7), 7, 9984, 16, ce=1, dec=1, jpg=1),
        _p(20, 7, "1g.10gb+me", 1, 1, range(7), 1, 9984, 16, ce=1, dec=1, jpg=1, ofa=1),
        _p(15, 9, "1g.20gb", 1, 2, (0, 2, 4, 6), 4, 20096, 26, ce=1, dec=1, jpg=1),
        _p(14, 1, "2g.20gb", 2, 2, (0, 2, 4), 3, 20096, 32, ce=2, dec=2, jpg=2),
        _p(9, 2, "3g.40gb", 3, 4, (0, 4), 2, 40448, 60, ce=3, dec=3, jpg=3),
        _p(5, 3, "4g.40gb", 4, 4, (0,), 1, 40448, 64, ce=4, dec=4, jpg=4),
        _p(0, 4, "7g.80gb", 7, 8, (0,), 1, 81152, 132, ce=8, dec=7, jpg=7, ofa=1),
    )


def a30_profiles() -> tuple[MigProfile, ...]:
    return (
        _p(14, 0, "1g.6gb", 1, 1, range(4), 4, 5952, 14, ce=1, dec=0),
        _p(21, 7, "1g.6gb+me", 1, 1, range(4), 1, 5952, 14, ce=1, dec=1, jpg=1, ofa=1),
        _p(5, 1, "2g.12gb", 2, 2, (0, 2), 2, 11968, 28, ce=2, dec=2),
        _p(6, 8, "2g.12gb+me", 2, 2, (0, 2), 1, 11968, 28, ce=2, dec=2, jpg=1, ofa=1),
        _p(0, 3, "4g.24gb", 4, 4, (0,), 1, 24000, 56, ce=4, dec=4, jpg=1, ofa=1),
    )


def h100(index: int = 0, minor: int | None = None, **kw) -> GpuInfo:
    minor = index if minor is None else minor
    gpu = GpuInfo(
        index=index, minor=minor, uuid=f"GPU-00000000-0000-0000-0000-0000000000{index:02d}",
        product_name="NVIDIA H100 80GB HBM3", brand="Nvidia", architecture="Hopper",
        cuda_compute_capability=(9, 0), memory_mib=81559, multiprocessors=132,
        pci_bus_id=f"0000:{0x18 + index * 0x10:02x}:00.0", numa_node=index // 4,
        pci_device_id=0x233010DE, compute_mode="Default", mig_capable=True, mig_enabled=False,
        mig_pending=False, memory_slices=8, copy_engines=8, decoders=7, encoders=0, jpeg_engines=7,
        ofa_engines=1, mig_profiles=h100_profiles(),
    )
    return replace(gpu, **kw)


def a30(index: int = 0, minor: int | None = None, **kw) -> GpuInfo:
    minor = index if minor is None else minor
    gpu = GpuInfo(
        index=index, minor=minor, uuid=f"GPU-a3000000-0000-0000-0000-0000000000{index:02d}",
        product_name="NVIDIA A30", brand="Nvidia", architecture="Ampere",
        cuda_compute_capability=(8, 0), memory_mib=24576, multiprocessors=56,
        pci_bus_id=f"0000:{0x81 + index:02x}:00.0", numa_node=None,
        pci_device_id=0x20B710DE, compute_mode="Default", mig_capable=True, mig_enabled=True,
        mig_pending=True, memory_slices=4, copy_engines=4, decoders=4, encoders=0, jpeg_engines=1,
        ofa_engines=1, mig_profiles=a30_profiles(),
    )
    return replace(gpu, **kw)


def l4(index: int = 0, minor: int | None = None, **kw) -> GpuInfo:
    minor = index if minor is None else minor
    gpu = GpuInfo(
        index=index, minor=minor, uuid=f"GPU-14000000-0000-0000-0000-0000000000{index:02d}",
        product_name="NVIDIA L4", brand="Nvidia", architecture="Ada Lovelace",
        cuda_compute_capability=(8, 9), memory_mib=23034, multiprocessors=58,
        pci_bus_id=f"0000:{0xa1 + index:02x}:00.0", numa_node=1,
        pci_device_id=0x27B810DE, compute_mode="Default", mig_capable=False, mig_enabled=False,
        mig_pending=False, memory_slices=0, copy_engines=2, decoders=4, encoders=2, jpeg_engines=4,
        ofa_engines=1,
    )
    return replace(gpu, **kw)


def with_instances(gpu: GpuInfo, placements: list[tuple[int, int]]) -> GpuInfo:
    """The GPU in MIG mode with GPU instances at the given (profile_id, start) placements."""
    by_id = {p.profile_id: p for p in gpu.mig_profiles}
    instances = tuple(
        MigInstance(gi_id=i + 1, ci_id=0, profile_id=pid, start=start, size=by_id[pid].memory_slices,
                    uuid=f"MIG-{gpu.minor:02d}{i:02d}0000-0000-0000-0000-000000000000",
                    memory_mib=by_id[pid].memory_mib)
        for i, (pid, start) in enumerate(placements)
    )
    return replace(gpu, mig_enabled=True, mig_pending=True, mig_instances=instances)


def inventory(*gpus: GpuInfo) -> NodeInventory:
    return NodeInventory(driver_version="580.95.05", cuda_driver_version="13.0", gpus=tuple(gpus))


_ARCH_NAMES = {"AMPERE": "Ampere", "HOPPER": "Hopper", "BLACKWELL": "Blackwell", "ADA": "Ada Lovelace",
               "TURING": "Turing"}


def from_catalog(model_name: str, index: int = 0, minor: int | None = None, **kw) -> GpuInfo:
    """A GpuInfo for a catalog model, as discovery would report it (MIG disabled unless overridden)."""
    import pynvml

    from dra.model.catalog import get_model

    m = get_model(model_name)
    arch = next((v for k, v in _ARCH_NAMES.items() if getattr(pynvml, f"NVML_DEVICE_ARCH_{k}") == m.architecture),
                "Unknown")
    profiles = tuple(
        MigProfile(profile_id=p.profile_id, nvml_index=p.nvml_index, name=p.name, compute_slices=p.compute_slices,
                   memory_slices=p.memory_slices, max_instances=p.max_instances, memory_mib=p.memory_mib,
                   multiprocessors=p.multiprocessors, copy_engines=p.copy_engines, decoders=p.decoders,
                   encoders=p.encoders, jpeg_engines=p.jpeg_engines, ofa_engines=p.ofa_engines, starts=p.starts)
        for p in m.mig_profiles
    )
    minor = index if minor is None else minor
    gpu = GpuInfo(
        index=index, minor=minor, uuid=f"GPU-{index:08x}-1111-2222-3333-{m.pci_device_id:012x}",
        product_name=m.product_name, brand="Nvidia", architecture=arch, cuda_compute_capability=m.compute_capability,
        memory_mib=m.memory_mib, multiprocessors=m.multiprocessors, pci_bus_id=f"0000:{(0x10 + index * 8) % 256:02x}:00.0",
        numa_node=index // 4, pci_device_id=m.nvml_pci_device_id, compute_mode="Default", mig_capable=m.mig_capable,
        mig_enabled=False, mig_pending=False, memory_slices=m.mig_memory_slices, copy_engines=m.copy_engines,
        decoders=m.decoders, encoders=m.encoders, jpeg_engines=m.jpeg_engines, ofa_engines=m.ofa_engines,
        mig_profiles=profiles,
    )
    return replace(gpu, **kw)
