"""One node's objects, built from where this process sees the node: NVML opened from the driver root, the driver
root with its device and /proc roots, the sharing control (the driver's nvidia-smi and MPS programs) and the CDI
spec writer.

``gpu-dra kubelet-plugin``, ``gpu-dra inventory`` and ``gpu-dra doctor`` all take theirs from here, so a flag such
as ``--dev-root`` means the same everywhere. A simulated node's objects come from ``dra.sim.nodeobjects`` (the
simulator sits above this layer), a subclass with the same methods.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from dra.node.cdi import TOOLKIT_SPEC_DIRS, CdiSpecWriter, ToolkitSpecs
from dra.node.driverroot import DriverRoot, DriverRootError
from dra.node.sharingtools import NvidiaSmiSharingControl, SharingControl, SharingError

# The fix for a machine without a GPU or a usable driver, as the plugin's exit and `gpu-dra doctor` give it: the
# chart value that places the plugin (docs/operations.md).
GPU_NODES_ONLY = "run the plugin on GPU nodes only (the chart places it by kubeletPlugin.gpuNodeLabels)"


class NodeSetupError(ValueError):
    """A path the node's objects cannot be built from; the message starts with the flag that names it."""


@dataclass(frozen=True)
class NodePaths:
    """Where this process sees the node (the plugin's and the node commands' flags of the same names)."""

    driver_root: str = "/"                 # --driver-root: the driver's files as this process sees them
    host_driver_root: str | None = None    # --host-driver-root: the same tree as the host sees it (CDI hostPaths)
    dev_root: str = "/"                    # --dev-root: where this process sees /dev
    proc_root: str = "/proc"               # --proc-root: where this process sees /proc
    cdi_hook_path: str | None = None       # host path of nvidia-cdi-hook when not in the driver root


class NodeObjects:
    """A real node's objects: pynvml and the driver's own files and programs."""

    simulated = False

    def __init__(self, paths: NodePaths | None = None) -> None:
        self.paths = paths or NodePaths()

    def driver_root(self, driver_version: str | None = None) -> DriverRoot:
        """The driver root with its device and /proc roots (``driver_version``: skip detecting it)."""
        p = self.paths
        return DriverRoot(p.driver_root, host_root=p.host_driver_root, dev_root=p.dev_root, proc_root=p.proc_root,
                          hook_path=p.cdi_hook_path, driver_version=driver_version)

    def preload_nvml(self) -> str | None:
        """Open NVML by its path under the driver root, so pynvml's dlopen by soname finds it (None: the
        system's own loader finds it). NodeSetupError names the driver root and what is missing."""
        from dra.node.nvmlloader import NvmlLoadError, preload_nvml

        try:
            return preload_nvml(self.driver_root())
        except (NvmlLoadError, DriverRootError) as err:
            raise NodeSetupError(f"--driver-root: {err}") from None

    def open_nvml(self) -> Any:
        """The NVML library, loaded from the driver root and initialised. NVML's own errors (no driver, no
        permission) come as pynvml.NVMLError."""
        self.preload_nvml()
        import pynvml

        pynvml.nvmlInit()
        return pynvml

    def sharing_control(self, driver_root: DriverRoot, *, nvml: Any = None, state_dir: Path | None = None,
                        mps_options: Mapping[str, Any] | None = None) -> SharingControl:
        """The driver's nvidia-smi and MPS control program. ``mps_options``: the cgroup placement of MPS daemons
        (``NvidiaSmiSharingControl``'s cgroup, cgroup_root, cgroup_procs, proc_root). SharingError names what is
        missing (sharing is optional: callers fall back to refusing sharing claims with the reason)."""
        options = {"proc_root": self.paths.proc_root, **(mps_options or {})}
        try:
            return NvidiaSmiSharingControl.from_driver_root(driver_root, **options)
        except SharingError:
            raise
        except (DriverRootError, OSError) as err:
            raise SharingError(str(err)) from None

    def cdi_writer(self, cdi_root: Path | str, driver_root: DriverRoot, *, vendor: str,
                   mps_tools: bool = False) -> CdiSpecWriter:
        """Writes claim specs into ``cdi_root``; devices the NVIDIA Container Toolkit's own specs describe (in
        /etc/cdi or ``cdi_root``) are named by those too. ``mps_tools``: containers get the MPS programs."""
        toolkit = ToolkitSpecs(dirs=(TOOLKIT_SPEC_DIRS[0], cdi_root), ignore_vendor=vendor)
        return CdiSpecWriter(cdi_root, driver_root, vendor=vendor, toolkit=toolkit, mps_tools=mps_tools)
