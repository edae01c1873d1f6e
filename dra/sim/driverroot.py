"""What a simulated node (``--fleet``) uses in place of a real NVIDIA installation.

A simulated node has GPUs only in its fake NVML, so the driver root may lack the driver's libraries,
``/dev/nvidia*`` nodes and the MIG capability files. ``SimulatedDriverRoot`` reads whatever exists under the
given roots (tests build fake trees) and describes anything missing by major/minor number, so the CDI specs
are complete and valid: a runtime would create the nodes itself. It is never used for a real node.
"""
from __future__ import annotations

from pathlib import Path

from dra.node.driverroot import CdiHookError, DeviceNodeInfo, DriverFiles, DriverRoot, DriverRootError

NVIDIA_MAJOR = 195          # /dev/nvidia<minor> and /dev/nvidiactl (minor 255)
NVIDIACTL_MINOR = 255
SIMULATED_CAPS_MAJOR = 234  # stand-in for the dynamic nvidia-caps major when /proc has none


class SimulatedDriverRoot(DriverRoot):
    """A DriverRoot that falls back to synthetic device descriptions for simulated GPUs."""

    def __init__(self, root: Path | str = "/", *, driver_version: str, **kwargs: object) -> None:
        super().__init__(root, driver_version=driver_version, **kwargs)  # type: ignore[arg-type]

    def files(self, refresh: bool = False) -> DriverFiles:
        try:
            return super().files(refresh)
        except CdiHookError:
            raise   # a given hook that cannot run is an error on any node
        except DriverRootError:
            # No driver installed here: containers of a simulated node get the control node (and the hook) only.
            if self._files is None or refresh:
                ctl = DeviceNodeInfo(path="/dev/nvidiactl", major=NVIDIA_MAJOR, minor=NVIDIACTL_MINOR)
                self._files = DriverFiles(version=self.driver_version or "", libraries=(), soname_links=(),
                                          lib_folders=(), binaries=(), firmware=(), hook=self._find_hook(),
                                          control_nodes=(ctl,))
            return self._files

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
