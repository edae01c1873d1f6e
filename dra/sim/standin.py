"""The GPU listing of a simulated node, for the CUDA stand-in (hack/cuda-standin).

A container on a simulated node gets ``libcuda.so.1`` and ``libnvidia-ml.so.1`` stand-ins from the driver
root. They answer from this listing, a small text file the plugin keeps in ``<state dir>/sim-gpus/gpus`` and
mounts read-only at ``/run/nvidia-sim`` into every GPU container of the node (``SimulatedDriverRoot``), and
list only the devices whose nodes the container can open: a GPU by its ``/dev/nvidia<minor>``, a MIG device
by its parent's node and its GI and CI capability nodes. The listing is rewritten from the simulated NVML
before every CDI spec is built, so a MIG device created for a claim is in it when the claim's container
starts.

Format (read by hack/cuda-standin/listing.c): one device a line, fields separated by one space, the name last::

    driver <driver version> <CUDA driver version, e.g. 13000>
    ctl <path> <major> <minor>
    gpu <index> <path> <major> <minor> <MIG mode 0|1> <uuid> <memory bytes> <name>
    mig <gpu index> <gi> <ci> <gi cap path> <major> <minor> <ci cap path> <major> <minor> <uuid> <bytes> <name>

It holds every GPU of the node (not only a container's), which real NVML would not show to a container: the
stand-in filters by device access, the file itself is readable by every GPU container of a simulated node.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import Any, Protocol

from dra.node import migdevices
from dra.node.atomicfile import write_atomic
from dra.node.driverroot import DeviceNodeInfo, DriverRootError

log = logging.getLogger(__name__)

LISTING_CONTAINER_DIR = "/run/nvidia-sim"
LISTING_FILE = "gpus"
LISTING_STATE_DIR = "sim-gpus"      # under the plugin's state directory


class NodeDescriber(Protocol):
    """What the listing needs from the driver root: the device nodes a container gets."""

    def gpu_node(self, minor: int) -> DeviceNodeInfo: ...

    def mig_cap_nodes(self, gpu_minor: int, gi_id: int, ci_id: int) -> tuple[DeviceNodeInfo, DeviceNodeInfo]: ...


def _node(info: DeviceNodeInfo) -> str | None:
    if info.major is None or info.minor is None:
        return None   # a plain file in a test tree: nothing a container could open as a device
    return f"{info.path} {info.major} {info.minor}"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def listing_text(nvml: Any, root: NodeDescriber, ctl: DeviceNodeInfo) -> str:
    """The listing for the GPUs `nvml` (pynvml's API) shows now; lost GPUs are left out."""
    lines = ["# simulated GPUs of this node, for the CUDA stand-in (see dra/sim/standin.py)",
             f"driver {_one_line(nvml.nvmlSystemGetDriverVersion())} {int(nvml.nvmlSystemGetCudaDriverVersion())}"]
    if (ctl_node := _node(ctl)) is not None:
        lines.append(f"ctl {ctl_node}")
    for index in range(nvml.nvmlDeviceGetCount()):
        try:
            lines += _gpu_lines(nvml, root, index)
        except nvml.NVMLError as err:
            log.info("GPU %d left out of the stand-in's listing: %s", index, err)
    return "\n".join(lines) + "\n"


def _gpu_lines(nvml: Any, root: NodeDescriber, index: int) -> list[str]:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    minor = nvml.nvmlDeviceGetMinorNumber(handle)
    uuid = nvml.nvmlDeviceGetUUID(handle)
    node = _node(root.gpu_node(minor))
    if node is None:
        return []
    mig = migdevices.mig_enabled(nvml, handle)
    lines = [f"gpu {index} {node} {int(mig)} {uuid} {nvml.nvmlDeviceGetMemoryInfo(handle).total} "
             f"{_one_line(nvml.nvmlDeviceGetName(handle))}"]
    for m in migdevices.list_mig_devices(nvml, uuid) if mig else []:
        if m.ci_id < 0 or not m.uuid:
            continue   # a GPU instance without a compute instance is no device
        try:
            caps = [_node(c) for c in root.mig_cap_nodes(minor, m.gi_id, m.ci_id)]
        except DriverRootError as err:
            log.info("MIG device %s left out of the stand-in's listing: %s", m.uuid, err)
            continue
        if None in caps:
            continue
        mig_handle = nvml.nvmlDeviceGetHandleByUUID(m.uuid)
        memory = nvml.nvmlDeviceGetMemoryInfo(mig_handle).total
        lines.append(f"mig {index} {m.gi_id} {m.ci_id} {caps[0]} {caps[1]} {m.uuid} {memory} "
                     f"{_one_line(nvml.nvmlDeviceGetName(mig_handle))}")
    return lines


class GpuListing:
    """Keeps ``<directory>/gpus`` equal to what the simulated NVML shows (written only when it changed)."""

    def __init__(self, nvml: Any, directory: Path) -> None:
        self.nvml = nvml
        self.directory = Path(directory)
        self._lock = threading.Lock()
        self._written: str | None = None
        self._generation: int | None = None     # the simulated hardware's generation the listing shows

    @property
    def path(self) -> Path:
        return self.directory / LISTING_FILE

    def refresh(self, root: NodeDescriber, ctl: DeviceNodeInfo) -> None:
        """Rewrites the listing if the GPUs changed; DriverRootError names the file when it cannot be written."""
        # One view of the hardware: no MIG device created or destroyed between the calls that list it.
        held = getattr(self.nvml, "hardware_locked", contextlib.nullcontext)
        with self._lock:
            with held():
                # Asked before every CDI spec: unchanged hardware is not listed again (the node files it names
                # do not change while the plugin runs).
                generation = getattr(self.nvml, "hardware_generation", None)
                if generation is not None and generation == self._generation and self.path.is_file():
                    return
                text = listing_text(self.nvml, root, ctl)
            if text != self._written or not self.path.is_file():
                try:
                    # Atomic: a container starting now reads either listing, never half of one.
                    write_atomic(self.path, text.encode(), mode=0o644, durable=False)
                except OSError as err:
                    raise DriverRootError(f"cannot write the simulated GPU listing {self.path}: "
                                          f"{err.strerror or err}") from None
                self._written = text
            self._generation = generation
