"""Discovery: read a node's GPUs through NVML into dra/model/gpu.py records.

``discover(nvml)`` takes the NVML library as a parameter: the real ``pynvml`` module in production (after
``nvmlInit``), a ``dra.sim.fakenvml.FakeNvml`` for simulated GPUs. Both are driven through the same pynvml calls,
so the simulated path exercises the production code. Constants and error classes are read from the library
object too.

One GPU that fails is reported with ``healthy=False`` and the failing call in ``health_reason``; discovery
only raises when the node-wide calls (driver version, device count) fail.

NVML does not report SM or engine counts for a whole GPU (``nvmlDeviceGetAttributes`` serves MIG devices only),
so those come from the built-in catalog by product name, or else from the full-GPU MIG profile.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pynvml

from dra.model.catalog import model_for_product_name, profile_name_from_memory
from dra.model.gpu import GpuInfo, MigInstance, MigProfile, NodeInventory
from dra.node.pcie import pcie_root_of

ARCHITECTURES = {  # NVML spelling, as go-nvlib's GetArchitectureAsString
    pynvml.NVML_DEVICE_ARCH_KEPLER: "Kepler",
    pynvml.NVML_DEVICE_ARCH_MAXWELL: "Maxwell",
    pynvml.NVML_DEVICE_ARCH_PASCAL: "Pascal",
    pynvml.NVML_DEVICE_ARCH_VOLTA: "Volta",
    pynvml.NVML_DEVICE_ARCH_TURING: "Turing",
    pynvml.NVML_DEVICE_ARCH_AMPERE: "Ampere",
    pynvml.NVML_DEVICE_ARCH_ADA: "Ada Lovelace",
    pynvml.NVML_DEVICE_ARCH_HOPPER: "Hopper",
    pynvml.NVML_DEVICE_ARCH_BLACKWELL: "Blackwell",
    pynvml.NVML_DEVICE_ARCH_RUBIN: "Rubin",
}

BRANDS = {  # as go-nvlib's GetBrandAsString
    pynvml.NVML_BRAND_UNKNOWN: "Unknown",
    pynvml.NVML_BRAND_QUADRO: "Quadro",
    pynvml.NVML_BRAND_TESLA: "Tesla",
    pynvml.NVML_BRAND_NVS: "NVS",
    pynvml.NVML_BRAND_GRID: "Grid",
    pynvml.NVML_BRAND_GEFORCE: "GeForce",
    pynvml.NVML_BRAND_TITAN: "Titan",
    pynvml.NVML_BRAND_NVIDIA_VAPPS: "NvidiaVApps",
    pynvml.NVML_BRAND_NVIDIA_VPC: "NvidiaVPC",
    pynvml.NVML_BRAND_NVIDIA_VCS: "NvidiaVCS",
    pynvml.NVML_BRAND_NVIDIA_VWS: "NvidiaVWS",
    pynvml.NVML_BRAND_NVIDIA_CLOUD_GAMING: "NvidiaCloudGaming",
    pynvml.NVML_BRAND_QUADRO_RTX: "QuadroRTX",
    pynvml.NVML_BRAND_NVIDIA_RTX: "NvidiaRTX",
    pynvml.NVML_BRAND_NVIDIA: "Nvidia",
    pynvml.NVML_BRAND_GEFORCE_RTX: "GeForceRTX",
    pynvml.NVML_BRAND_TITAN_RTX: "TitanRTX",
}

COMPUTE_MODES = {
    pynvml.NVML_COMPUTEMODE_DEFAULT: "Default",
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD: "ExclusiveThread",
    pynvml.NVML_COMPUTEMODE_PROHIBITED: "Prohibited",
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "ExclusiveProcess",
}

# Name suffix of GPU-instance profiles with attributes, used only when NVML gives no profile name (info v1).
_PROFILE_SUFFIX = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: "+me",
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1: "+me",
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME: "+me.all",
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME: "+me.all",
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX: "+gfx",
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX: "+gfx",
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX: "+gfx",
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX: "+gfx",
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME: "-me",
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME: "-me",
}

_NUMA_NODE_SET_WORDS = 4  # 256 NUMA nodes


def format_cuda_version(version: int) -> str:
    """NVML's CUDA driver version integer as "major.minor": 13000 -> "13.0", 12080 -> "12.8"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def normalise_pci_bus_id(bus_id: str) -> str:
    """NVML's "00000000:3B:00.0" as the lower-case extended BDF "0000:3b:00.0"."""
    domain, bus, devfn = bus_id.strip().lower().split(":")
    dev, _, fn = devfn.partition(".")
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn or '0', 16):x}"


def describe_nvml_error(exc: BaseException) -> str:
    """Readable text for an NVMLError without asking the NVML library (which may be absent)."""
    code = getattr(exc, "value", None)
    text = pynvml.NVMLError._errcode_to_string.get(code)
    if text is None:
        name = next((n for n in dir(pynvml) if n.startswith("NVML_ERROR_") and getattr(pynvml, n) == code), None)
        text = name.removeprefix("NVML_ERROR_").replace("_", " ").capitalize() if name else f"NVML error {code}"
    return f"{text} (NVML error {code})"


def discover_once(nvml: Any) -> NodeInventory:
    """``discover`` on an NVML library nothing else uses: initialised for it and shut down after."""
    nvml.nvmlInit()
    try:
        return discover(nvml)
    finally:
        nvml.nvmlShutdown()


def discover(nvml: Any, sysfs_root: str | Path = "/sys") -> NodeInventory:
    """Everything NVML reports about this node's GPUs, plus the PCIe root from sysfs. ``nvml`` must be
    initialised."""
    driver = nvml.nvmlSystemGetDriverVersion()
    cuda = nvml.nvmlSystemGetCudaDriverVersion()
    count = nvml.nvmlDeviceGetCount()
    return NodeInventory(
        driver_version=driver.decode() if isinstance(driver, bytes) else str(driver),
        cuda_driver_version=format_cuda_version(int(cuda)),
        gpus=tuple(_with_pcie_root(discover_gpu(nvml, i), sysfs_root) for i in range(count)),
    )


def _with_pcie_root(gpu: GpuInfo, sysfs_root: str | Path) -> GpuInfo:
    root = pcie_root_of(gpu.pci_bus_id, sysfs_root) if gpu.pci_bus_id else None
    return replace(gpu, pcie_root=root) if root else gpu


@dataclass
class _Fields:
    """GpuInfo fields as far as discovery got; defaults describe "not known"."""

    index: int
    minor: int = -1
    uuid: str = ""
    product_name: str = ""
    brand: str = "Unknown"
    architecture: str = "Unknown"
    cuda_compute_capability: tuple[int, int] = (0, 0)
    memory_mib: int = 0
    multiprocessors: int = 0
    pci_bus_id: str = ""
    numa_node: int | None = None
    pci_device_id: int = 0
    compute_mode: str = "Unknown"
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_pending: bool = False
    memory_slices: int = 0
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0
    mig_profiles: tuple[MigProfile, ...] = ()
    mig_instances: tuple[MigInstance, ...] = ()
    healthy: bool = True
    health_reason: str = ""
    step: str = field(default="", repr=False)

    def info(self) -> GpuInfo:
        values = {k: v for k, v in self.__dict__.items() if k != "step"}
        return GpuInfo(**values)


def discover_gpu(nvml: Any, index: int) -> GpuInfo:
    """One GPU; never raises for NVML errors: a failing GPU comes back with healthy=False."""
    f = _Fields(index=index)
    try:
        _read(nvml, index, f)
    except nvml.NVMLError as exc:
        f.healthy = False
        f.health_reason = f"{f.step}: {describe_nvml_error(exc)}"
    except (ValueError, TypeError) as exc:  # malformed answers (e.g. a PCI bus id) must not stop discovery
        f.healthy = False
        f.health_reason = f"{f.step}: {exc}"
    return f.info()


def _read(nvml: Any, index: int, f: _Fields) -> None:
    def call(name: str, *args: Any) -> Any:
        f.step = name
        return getattr(nvml, name)(*args)

    h = call("nvmlDeviceGetHandleByIndex", index)
    f.uuid = _text(call("nvmlDeviceGetUUID", h))
    f.minor = int(call("nvmlDeviceGetMinorNumber", h))
    pci = call("nvmlDeviceGetPciInfo", h)
    f.pci_bus_id = normalise_pci_bus_id(_text(pci.busId))
    f.pci_device_id = int(pci.pciDeviceId)
    f.product_name = _text(call("nvmlDeviceGetName", h))
    f.brand = BRANDS.get(call("nvmlDeviceGetBrand", h), "Unknown")
    f.architecture = ARCHITECTURES.get(call("nvmlDeviceGetArchitecture", h), "Unknown")
    major, minor = call("nvmlDeviceGetCudaComputeCapability", h)
    f.cuda_compute_capability = (int(major), int(minor))
    f.memory_mib = int(call("nvmlDeviceGetMemoryInfo", h).total) >> 20
    f.compute_mode = COMPUTE_MODES.get(call("nvmlDeviceGetComputeMode", h), "Unknown")
    f.numa_node = _numa_node(nvml, h, call)

    try:
        current, pending = call("nvmlDeviceGetMigMode", h)
    except nvml.NVMLError as exc:
        if exc.value != nvml.NVML_ERROR_NOT_SUPPORTED:
            raise
    else:
        f.mig_capable = True
        f.mig_enabled = current == nvml.NVML_DEVICE_MIG_ENABLE
        f.mig_pending = pending == nvml.NVML_DEVICE_MIG_ENABLE
        f.mig_profiles = _mig_profiles(nvml, h, f, call)
        f.memory_slices = max((s + p.memory_slices for p in f.mig_profiles for s in p.starts), default=0)
        if f.mig_enabled:
            f.mig_instances = _mig_instances(nvml, h, f.mig_profiles, call)

    _whole_gpu_engines(nvml, h, f, call)
    f.step = ""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(nvml: Any, call: Any, name: str, *args: Any) -> Any:
    """A call whose answer discovery can do without: None when NVML cannot give it (a lost GPU still raises)."""
    try:
        return call(name, *args)
    except nvml.NVMLError as exc:
        if exc.value == nvml.NVML_ERROR_GPU_IS_LOST:
            raise
        return None


def _numa_node(nvml: Any, h: Any, call: Any) -> int | None:
    """The NUMA node nearest the GPU: one bit set in its memory affinity, else unknown."""
    mask = _optional(nvml, call, "nvmlDeviceGetMemoryAffinity", h, _NUMA_NODE_SET_WORDS,
                     nvml.NVML_AFFINITY_SCOPE_NODE)
    if mask is None:
        return None
    nodes = [w * 64 + b for w, word in enumerate(mask) for b in range(64) if (int(word) >> b) & 1]
    return nodes[0] if len(nodes) == 1 else None


def _mig_profiles(nvml: Any, h: Any, f: _Fields, call: Any) -> tuple[MigProfile, ...]:
    """Every GPU-instance profile the GPU offers, each used with its full-size compute instance (C == G)."""
    out: list[MigProfile] = []
    for idx in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = call("nvmlDeviceGetGpuInstanceProfileInfo", h, idx)
        except nvml.NVMLError as exc:
            if exc.value in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_INVALID_ARGUMENT,
                             nvml.NVML_ERROR_NOT_FOUND):
                continue  # a profile this GPU does not offer
            raise
        placements = _possible_placements(nvml, h, int(info.id), call)
        name = _text(getattr(info, "name", b"")).removeprefix("MIG ").strip()
        if not name:
            name = profile_name_from_memory(int(info.sliceCount), int(info.memorySizeMB), f.memory_mib,
                                            _PROFILE_SUFFIX.get(idx, ""))
        out.append(MigProfile(
            profile_id=int(info.id),
            nvml_index=idx,
            name=name,
            compute_slices=int(info.sliceCount),
            memory_slices=placements[0][1] if placements else 0,
            max_instances=int(info.instanceCount),
            memory_mib=int(info.memorySizeMB),
            multiprocessors=int(info.multiprocessorCount),
            copy_engines=int(info.copyEngineCount),
            decoders=int(info.decoderCount),
            encoders=int(info.encoderCount),
            jpeg_engines=int(info.jpegCount),
            ofa_engines=int(info.ofaCount),
            starts=tuple(start for start, _ in placements),
        ))
    return tuple(out)


def _possible_placements(nvml: Any, h: Any, profile_id: int, call: Any) -> list[tuple[int, int]]:
    count = ctypes.c_uint(0)
    call("nvmlDeviceGetGpuInstancePossiblePlacements", h, profile_id, None, ctypes.byref(count))
    buf = (nvml.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
    call("nvmlDeviceGetGpuInstancePossiblePlacements", h, profile_id, buf, ctypes.byref(count))
    return sorted((int(buf[i].start), int(buf[i].size)) for i in range(count.value))


def _mig_instances(nvml: Any, h: Any, profiles: tuple[MigProfile, ...], call: Any) -> tuple[MigInstance, ...]:
    """The GPU instances that exist, each with its full-size compute instance's MIG device (uuid "" and
    ci_id -1 when the GPU instance has none)."""
    # MIG devices (one per compute instance) by GPU-instance id, keeping only full-size compute instances.
    full_ci: dict[int, tuple[int, str]] = {}
    for i in range(int(call("nvmlDeviceGetMaxMigDeviceCount", h))):
        try:
            mig = call("nvmlDeviceGetMigDeviceHandleByIndex", h, i)
        except nvml.NVMLError as exc:
            if exc.value == nvml.NVML_ERROR_NOT_FOUND:
                continue
            raise
        attrs = call("nvmlDeviceGetAttributes", mig)
        if attrs.computeInstanceSliceCount != attrs.gpuInstanceSliceCount:
            continue
        gi_id = int(call("nvmlDeviceGetGpuInstanceId", mig))
        full_ci[gi_id] = (int(call("nvmlDeviceGetComputeInstanceId", mig)), _text(call("nvmlDeviceGetUUID", mig)))

    out: list[MigInstance] = []
    for p in profiles:
        count = ctypes.c_uint(0)
        buf = (nvml.c_nvmlGpuInstance_t * max(p.max_instances, 1))()
        call("nvmlDeviceGetGpuInstances", h, p.profile_id, buf, ctypes.byref(count))
        for i in range(count.value):
            info = call("nvmlGpuInstanceGetInfo", buf[i])
            ci_id, uuid = full_ci.get(int(info.id), (-1, ""))
            out.append(MigInstance(gi_id=int(info.id), ci_id=ci_id, profile_id=p.profile_id,
                                   start=int(info.placement.start), size=int(info.placement.size),
                                   uuid=uuid, memory_mib=p.memory_mib))
    return tuple(sorted(out, key=lambda m: (m.start, m.gi_id)))


def _whole_gpu_engines(nvml: Any, h: Any, f: _Fields, call: Any) -> None:
    """SM and engine counts of the whole GPU: NVML if it says, else the catalog, else the full MIG profile."""
    attrs = _optional(nvml, call, "nvmlDeviceGetAttributes", h)
    if attrs is not None:
        f.multiprocessors = int(attrs.multiprocessorCount)
        f.copy_engines = int(attrs.sharedCopyEngineCount)
        f.decoders = int(attrs.sharedDecoderCount)
        f.encoders = int(attrs.sharedEncoderCount)
        f.jpeg_engines = int(attrs.sharedJpegCount)
        f.ofa_engines = int(attrs.sharedOfaCount)
        return
    model = model_for_product_name(f.product_name)
    if model is not None:
        f.multiprocessors = model.multiprocessors
        f.copy_engines, f.decoders, f.encoders = model.copy_engines, model.decoders, model.encoders
        f.jpeg_engines, f.ofa_engines = model.jpeg_engines, model.ofa_engines
        return
    full = [p for p in f.mig_profiles if p.memory_slices == f.memory_slices and 0 in p.starts]
    if full:
        p = max(full, key=lambda x: x.compute_slices)
        f.multiprocessors = p.multiprocessors
        f.copy_engines, f.decoders, f.encoders = p.copy_engines, p.decoders, p.encoders
        f.jpeg_engines, f.ofa_engines = p.jpeg_engines, p.ofa_engines
