"""Simulated sharing tools: ``SharingControl`` (dra.node.sharingtools) in memory, with the rules of the real
``nvidia-smi`` and MPS control daemon, recording every action in order."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dra.node.processidentity import ProcessIdentity
from dra.node.sharingtools import (
    MpsDaemonSpec,
    SharingControl,
    SharingError,
    SharingNotSupported,
    check_compute_mode,
    check_interval,
    is_mig_uuid,
)

# Identities of in-memory daemons: above the kernel's largest PID (2**22), so never a real process.
_FIRST_SIMULATED_PID = 1 << 22


@dataclass
class SimulatedMpsDaemon:
    spec: MpsDaemonSpec
    identity: ProcessIdentity
    alive: bool = True
    active_thread_percentage: int | None = None
    pinned_memory_limits: dict[str, str] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)


class SimulatedSharingControl(SharingControl):
    """In-memory sharing state with the real rules; ``actions`` records what was done, in order.

    gpus:                     known whole-GPU UUIDs (None: any ``GPU-...`` UUID is accepted)
    time_slice_unsupported:   GPUs whose driver refuses time-slicing (e.g. older boards)
    nvml:                     a FakeNvml to keep compute modes in, so NVML readers (and later processes, with a
                              state file) see them
    mps:                      a control that runs real MPS daemon processes (``NvidiaSmiSharingControl`` over the
                              simulated ``nvidia-cuda-mps-control`` of ``dra.sim.mpscontrol``); None: in memory
    """

    def __init__(
        self,
        gpus: Sequence[str] | None = None,
        *,
        time_slice_unsupported: Sequence[str] = (),
        nvml: Any = None,
        mps: SharingControl | None = None,
    ) -> None:
        self._lock = threading.RLock()
        self.gpus = set(gpus) if gpus is not None else (set(nvml.gpu_uuids) if nvml is not None else None)
        self.time_slice_unsupported = set(time_slice_unsupported)
        self.nvml = nvml
        self.mps = mps
        self.time_slices: dict[str, str] = {}
        self.compute_modes: dict[str, str] = {}
        self.daemons: dict[str, SimulatedMpsDaemon] = {}
        self._started = 0
        self.actions: list[tuple[Any, ...]] = []

    def _check_gpu(self, uuid: str, what: str) -> None:
        if is_mig_uuid(uuid):
            raise SharingNotSupported(f"{what} on {uuid}: MIG devices have no such setting")
        if self.gpus is not None and uuid not in self.gpus:
            raise SharingError(f"{what}: no GPU with UUID {uuid} on this node")

    def _serves(self, uuid: str) -> bool:
        """Whether an MPS daemon runs on the GPU (the real daemons are asked through the simulated registry)."""
        if self.mps is not None:
            from dra.sim.mpscontrol import serving_pids
            return bool(serving_pids(uuid))
        return bool(self._live_daemons_on(uuid))

    def _live_daemons_on(self, uuid: str) -> list[SimulatedMpsDaemon]:
        return [d for d in self.daemons.values() if d.alive and uuid in d.spec.visible_devices]

    def set_time_slice(self, gpu_uuid: str, interval: str) -> None:
        with self._lock:
            check_interval(interval)
            self._check_gpu(gpu_uuid, "time-slice")
            if gpu_uuid in self.time_slice_unsupported:
                raise SharingNotSupported(f"setting time-slice {interval} on GPU {gpu_uuid}: not supported on this GPU")
            self.time_slices[gpu_uuid] = interval
            self.actions.append(("set_time_slice", gpu_uuid, interval))

    def get_time_slice(self, gpu_uuid: str) -> str | None:
        with self._lock:
            return self.time_slices.get(gpu_uuid, "Default")

    def compute_mode(self, gpu_uuid: str) -> str:
        with self._lock:
            if self.nvml is not None and gpu_uuid in getattr(self.nvml, "gpu_uuids", ()):
                mode = self.nvml.nvmlDeviceGetComputeMode(self.nvml.nvmlDeviceGetHandleByUUID(gpu_uuid))
                return {self.nvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "EXCLUSIVE_PROCESS",
                        self.nvml.NVML_COMPUTEMODE_PROHIBITED: "PROHIBITED"}.get(mode, "DEFAULT")
            return self.compute_modes.get(gpu_uuid, "DEFAULT")

    def set_compute_mode(self, gpu_uuid: str, mode: str) -> None:
        with self._lock:
            check_compute_mode(mode)
            self._check_gpu(gpu_uuid, "compute mode")
            if mode != self.compute_mode(gpu_uuid) and self._serves(gpu_uuid):
                raise SharingError(f"setting compute mode {mode} on GPU {gpu_uuid}: an MPS daemon is running on it")
            self.compute_modes[gpu_uuid] = mode
            if self.nvml is not None:
                handle = self.nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
                self.nvml.nvmlDeviceSetComputeMode(handle, getattr(self.nvml, f"NVML_COMPUTEMODE_{mode}"))
            self.actions.append(("set_compute_mode", gpu_uuid, mode))

    def start_mps_daemon(self, spec: MpsDaemonSpec) -> ProcessIdentity:
        if self.mps is not None:
            return self.mps.start_mps_daemon(spec)
        with self._lock:
            current = self.daemons.get(spec.pipe_dir)
            if current is not None and current.alive:
                raise SharingError(f"MPS daemon for {spec.pipe_dir}: already running")
            if not spec.visible_devices:
                raise SharingError(f"MPS daemon for {spec.pipe_dir}: no devices to serve")
            for uuid in spec.visible_devices:
                if not is_mig_uuid(uuid):
                    self._check_gpu(uuid, "MPS daemon")
                others = [d for d in self._live_daemons_on(uuid) if d.spec.pipe_dir != spec.pipe_dir]
                exclusive = not is_mig_uuid(uuid) and self.compute_mode(uuid) == "EXCLUSIVE_PROCESS"
                if others and (exclusive or is_mig_uuid(uuid)):
                    raise SharingError(f"MPS daemon for {spec.pipe_dir}: {uuid} is already served by the MPS daemon "
                                       f"of {others[0].spec.pipe_dir}")
            for directory in (spec.pipe_dir, spec.log_dir):
                if not Path(directory).is_dir():
                    raise SharingError(f"MPS daemon for {spec.pipe_dir}: directory {directory} does not exist")
            self._started += 1
            identity = ProcessIdentity(pid=_FIRST_SIMULATED_PID + self._started, start_time=self._started)
            self.daemons[spec.pipe_dir] = SimulatedMpsDaemon(spec=spec, identity=identity)
            self.actions.append(("start_mps_daemon", spec.pipe_dir, spec.visible_devices))
            return identity

    def mps_daemon(self, pipe_dir: str) -> ProcessIdentity | None:
        if self.mps is not None:
            return self.mps.mps_daemon(pipe_dir)
        with self._lock:
            daemon = self.daemons.get(pipe_dir)
            return daemon.identity if daemon is not None and daemon.alive else None

    def mps_daemon_running(self, pipe_dir: str, daemon: ProcessIdentity) -> bool:
        if self.mps is not None:
            return self.mps.mps_daemon_running(pipe_dir, daemon)
        with self._lock:
            current = self.daemons.get(pipe_dir)
            return current is not None and current.alive and current.identity == daemon

    def lookalikes(self, pipe_dir: str, daemon: ProcessIdentity | None) -> list[int]:
        return self.mps.lookalikes(pipe_dir, daemon) if self.mps is not None else []

    def mps_command(self, pipe_dir: str, command: str) -> str:
        if self.mps is not None:
            return self.mps.mps_command(pipe_dir, command)
        with self._lock:
            daemon = self.daemons.get(pipe_dir)
            if daemon is None or not daemon.alive:
                raise SharingError(f"MPS daemon for {pipe_dir}: command {command!r}: no daemon is running")
            words = command.split()
            daemon.commands.append(command)
            self.actions.append(("mps_command", pipe_dir, command))
            if words == ["quit"]:
                daemon.alive = False
                return ""
            if len(words) == 2 and words[0] == "set_default_active_thread_percentage":
                if not words[1].isdigit() or not 1 <= int(words[1]) <= 100:
                    raise SharingError(
                        f"MPS daemon for {pipe_dir}: active thread percentage {words[1]!r} is not 1..100")
                daemon.active_thread_percentage = int(words[1])
                return words[1]
            if len(words) == 3 and words[0] == "set_default_device_pinned_mem_limit":
                device, limit = words[1], words[2]
                if device not in daemon.spec.visible_devices:
                    raise SharingError(f"MPS daemon for {pipe_dir}: device {device} is not served by this daemon")
                if not (limit[:-1].isdigit() and limit[-1] in "MG"):
                    raise SharingError(f"MPS daemon for {pipe_dir}: pinned memory limit {limit!r} must look like 4096M")
                daemon.pinned_memory_limits[device] = limit
                return ""
            if words == ["get_server_list"]:
                return ""
            raise SharingError(f"MPS daemon for {pipe_dir}: unknown command {command!r}")

    def stop_mps_daemon(self, pipe_dir: str, daemon: ProcessIdentity | None) -> None:
        if self.mps is not None:
            return self.mps.stop_mps_daemon(pipe_dir, daemon)
        with self._lock:
            current = self.daemons.get(pipe_dir)
            # No identity: the pipe directory's daemon is reached through its control socket (here: its entry).
            if current is None or not current.alive or (daemon is not None and current.identity != daemon):
                return
            self.mps_command(pipe_dir, "quit")
            self.actions.append(("stop_mps_daemon", pipe_dir))

    # -- simulation controls --
    def kill_mps_daemon(self, pipe_dir: str) -> None:
        """The daemon dies without being asked (a crash)."""
        with self._lock:
            self.daemons[pipe_dir].alive = False
            self.actions.append(("killed_mps_daemon", pipe_dir))
