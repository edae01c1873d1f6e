"""A simulated node's objects (``--fleet FILE --node NAME``): the same methods as ``dra.node.nodeobjects``, with
the node's GPUs in a fake NVML, a driver root that describes missing device nodes by major/minor, and simulated
sharing tools."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from dra.node.cdi import CdiSpecWriter
from dra.node.driverroot import DriverRoot
from dra.node.nodeobjects import NodeObjects, NodePaths, NodeSetupError
from dra.node.sharingtools import NvidiaSmiSharingControl, SharingControl
from dra.sim.driverroot import SimulatedDriverRoot
from dra.sim.fleet import FleetError, NodeSpec, load_fleet, nvml_for_node
from dra.sim.gpuprocesses import PROCESS_STATE_DIR, ProcessRegistry
from dra.sim.mpscontrol import STATE_ENV as MPS_STATE_ENV
from dra.sim.mpscontrol import write_simulated_mps_control
from dra.sim.sharingtools import SimulatedSharingControl
from dra.sim.standin import LISTING_STATE_DIR, GpuListing
from dra.sim.state import SimulatedStateError


class SimulatedNodeObjects(NodeObjects):
    """node:        the fleet node whose GPUs are simulated
    state_file:  where the GPUs' state outlives the process (None: in memory only); the GPU listing for the
                 CUDA stand-in (dra.sim.standin) is kept beside it, in ``sim-gpus/``"""

    simulated = True

    def __init__(self, node: NodeSpec, paths: NodePaths | None = None, *, state_file: Path | None = None) -> None:
        super().__init__(paths)
        self.node = node
        self.state_file = state_file
        self.listing: GpuListing | None = None     # set when NVML is opened
        self.process_dir: Path | None = None       # likewise: where the stand-in registers GPU processes

    @classmethod
    def from_fleet(cls, fleet_file: str, node_name: str, paths: NodePaths | None = None, *,
                   state_file: Path | None = None) -> SimulatedNodeObjects:
        """The objects of one node of a fleet file; NodeSetupError names the file and the problem."""
        try:
            node = load_fleet(fleet_file).node(node_name)
        except FleetError as err:
            raise NodeSetupError(f"--fleet: {err}") from None
        return cls(node, paths, state_file=state_file)

    def driver_root(self, driver_version: str | None = None) -> DriverRoot:
        p = self.paths
        return SimulatedDriverRoot(p.driver_root, driver_version=driver_version or self.node.driver_version,
                                   host_root=p.host_driver_root, dev_root=p.dev_root, proc_root=p.proc_root,
                                   hook_path=p.cdi_hook_path, listing=self.listing, process_dir=self.process_dir)

    def preload_nvml(self) -> str | None:
        return None   # the simulated library is Python

    def open_nvml(self) -> Any:
        try:
            nvml = nvml_for_node(self.node, state_file=self.state_file)
        except SimulatedStateError as err:
            raise NodeSetupError(f"--sim-state: {err}") from None
        nvml.nvmlInit()
        if self.state_file is not None:
            # Beside the state file: in the plugin's state directory, which the host sees at the same path.
            self.listing = GpuListing(nvml, self.state_file.parent / LISTING_STATE_DIR)
            self.process_dir = self._process_dir(self.state_file.parent / PROCESS_STATE_DIR)
            nvml.processes = ProcessRegistry(self.process_dir)
        return nvml

    @staticmethod
    def _process_dir(path: Path) -> Path:
        """The directory every GPU container writes its registrations into: sticky and world-writable like /tmp,
        so containers of any user register and none removes another's file (simulated nodes only)."""
        try:
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o1777)
        except OSError as err:
            raise NodeSetupError(f"cannot make the simulated GPU process directory {path}: {err.strerror or err}") \
                from None
        return path

    def sharing_control(self, driver_root: DriverRoot, *, nvml: Any = None, state_dir: Path | None = None,
                        mps_options: Mapping[str, Any] | None = None) -> SharingControl:
        if self.state_file is None or state_dir is None:
            return SimulatedSharingControl(nvml=nvml)
        # With a state file the simulated GPUs outlive the plugin, and so do their MPS daemons: real processes
        # of the simulated nvidia-cuda-mps-control, driven like the real one.
        program = write_simulated_mps_control(state_dir / "sim-tools")
        # The daemons are real processes of this machine: found in its own /proc, not the driver root's.
        options = {**(mps_options or {}), "proc_root": "/proc"}
        mps = NvidiaSmiSharingControl(mps_control=str(program), env={MPS_STATE_ENV: str(self.state_file)},
                                      **options)
        return SimulatedSharingControl(nvml=nvml, mps=mps)

    def cdi_writer(self, cdi_root: Path | str, driver_root: DriverRoot, *, vendor: str,
                   mps_tools: bool = False) -> CdiSpecWriter:
        # No toolkit specs name simulated GPUs.
        return CdiSpecWriter(cdi_root, driver_root, vendor=vendor, mps_tools=mps_tools)
