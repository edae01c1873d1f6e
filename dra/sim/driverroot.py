"""What a simulated node (``--fleet``) uses in place of a real NVIDIA installation.

A simulated node has GPUs only in its fake NVML, so the driver root may lack the driver's libraries,
``/dev/nvidia*`` nodes and the MIG capability files. ``SimulatedDriverRoot`` reads whatever exists under the
given roots (tests build fake trees) and describes anything missing by major/minor number, so the CDI specs
are complete and valid: a runtime would create the nodes itself. It is never used for a real node.

A driver root with the CUDA stand-in installed (hack/cuda-standin, laid out by ``dra.sim.driverlayout``) is
discovered like a real installation. With a ``GpuListing`` every container also gets the node's GPU listing
(``dra.sim.standin``), rewritten whenever the files are asked for, i.e. before each CDI spec is built, and the
node's GPU process directory read-write, where the stand-in registers the processes that use a GPU
(``dra.sim.gpuprocesses``).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from dra.node.driverroot import CdiHookError, DeviceNodeInfo, DriverFiles, DriverRoot, DriverRootError, RootedPath
from dra.sim.gpuprocesses import PROCESS_CONTAINER_DIR
from dra.sim.standin import LISTING_CONTAINER_DIR, GpuListing

NVIDIA_MAJOR = 195          # /dev/nvidia<minor> and /dev/nvidiactl (minor 255)
NVIDIACTL_MINOR = 255
SIMULATED_CAPS_MAJOR = 234  # stand-in for the dynamic nvidia-caps major when /proc has none


class SimulatedDriverRoot(DriverRoot):
    """A DriverRoot that falls back to synthetic device descriptions for simulated GPUs."""

    def __init__(self, root: Path | str = "/", *, driver_version: str, listing: GpuListing | None = None,
                 process_dir: Path | None = None, **kwargs: object) -> None:
        super().__init__(root, driver_version=driver_version, **kwargs)  # type: ignore[arg-type]
        self.listing = listing
        self.process_dir = process_dir

    def files(self, refresh: bool = False) -> DriverFiles:
        try:
            files = super().files(refresh)
        except CdiHookError:
            raise   # a given hook that cannot run is an error on any node
        except DriverRootError:
            # No driver installed here: containers of a simulated node get the control node (and the hook) only.
            if self._files is None or refresh:
                self._files = DriverFiles(version=self.driver_version or "", libraries=(), soname_links=(),
                                          lib_folders=(), binaries=(), firmware=(), hook=self._find_hook(),
                                          control_nodes=(self._nvidiactl(),))
            files = self._files
        if self.listing is None:
            return files
        # Every call: the GPUs (dynamic MIG devices above all) are those of now, not of the first spec.
        self.listing.refresh(self, self._nvidiactl())
        writable = (RootedPath(PROCESS_CONTAINER_DIR, str(self.process_dir)),) if self.process_dir else ()
        return dataclasses.replace(files, data_dirs=(RootedPath(LISTING_CONTAINER_DIR, str(self.listing.directory)),),
                                   writable_dirs=writable)

    def _nvidiactl(self) -> DeviceNodeInfo:
        return (self.device_node("/dev/nvidiactl", required=False)
                or DeviceNodeInfo(path="/dev/nvidiactl", major=NVIDIA_MAJOR, minor=NVIDIACTL_MINOR))

    def _control_nodes(self) -> tuple[DeviceNodeInfo, ...]:
        try:
            return super()._control_nodes()
        except DriverRootError:
            # The driver's files are installed (the CUDA stand-in) but there is no /dev/nvidiactl: described by
            # its numbers, the runtime creates it.
            return (self._nvidiactl(),)

    def gpu_node(self, minor: int) -> DeviceNodeInfo:
        try:
            return super().gpu_node(minor)
        except DriverRootError:
            return DeviceNodeInfo(path=f"/dev/nvidia{minor}", major=NVIDIA_MAJOR, minor=minor)

    def mig_cap_nodes(self, gpu_minor: int, gi_id: int, ci_id: int) -> tuple[DeviceNodeInfo, DeviceNodeInfo]:
        try:
            return super().mig_cap_nodes(gpu_minor, gi_id, ci_id)
        except DriverRootError:
            major = self.char_major("nvidia-caps") or SIMULATED_CAPS_MAJOR
            # Distinct, stable minors per (GPU, GI, CI); the real driver lists its own in /proc.
            gi_minor = 1000 + gpu_minor * 256 + gi_id * 16
            ci_minor = gi_minor + 1 + ci_id
            return (DeviceNodeInfo(path=f"/dev/nvidia-caps/nvidia-cap{gi_minor}", major=major, minor=gi_minor),
                    DeviceNodeInfo(path=f"/dev/nvidia-caps/nvidia-cap{ci_minor}", major=major, minor=ci_minor))
