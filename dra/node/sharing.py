"""Sharing bookkeeping above the ``SharingControl`` seam: time-slice intervals and MPS control daemons.

Time-slicing is a GPU-wide setting, so several claims on one GPU (shared slots) must agree on it: the first
claim sets it, later claims with the same interval join, a different interval is refused cleanly, and the
setting returns to what it was only when the last claim leaves.

MPS: one control daemon per device (a whole GPU, or a MIG device) that has MPS claims, serving every MPS
claim on it, so their work runs side by side as MPS intends (separate daemons on one GPU would be time-sliced
against each other). Each claim's limits reach only its own clients, through the CUDA client environment
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) in that claim's CDI edits; the
daemon itself carries no per-claim settings. A whole GPU is switched to EXCLUSIVE_PROCESS while its daemon runs
(only the MPS server may hold it) and back to its previous mode after.

Daemons live apart from the plugin: each is started in its own session by a helper program (and, with
``cgroup_procs``, outside the plugin container's cgroup), and described on disk (``<root>/<hash of the device UUID>/daemon.json``,
written before anything is changed), so a plugin restart or upgrade leaves them and their clients running and
the next plugin process takes them over. Which claims use a daemon is in the checkpoint; the daemon goes when
its last claim does.

Directories per daemon: ``pipe`` and ``shm`` are mounted into workload containers (what CUDA clients need);
``log`` is the plugin's own and never mounted. Nothing in a container-writable directory is opened, followed
or parsed by this module; they are removed with a symlink-safe ``rmtree``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from dra.node.atomicfile import remove_file, write_atomic
from dra.node.checkpoint import TimeSliceUndo
from dra.node.sharingtools import (
    MpsDaemonSpec,
    SharingControl,
    SharingError,
    SharingNotSupported,
    check_interval,
    is_mig_uuid,
)

log = logging.getLogger(__name__)


# ----- time-slicing -----------------------------------------------------------------------------------------------
class TimeSlicing:
    """Applies time-slice intervals per claim and resets them when the last claim on a GPU leaves."""

    def __init__(self, control: SharingControl) -> None:
        self.control = control
        self._lock = threading.Lock()
        self._holders: dict[str, dict[str, str]] = {}   # gpu uuid -> {claim uid: interval}
        self._previous: dict[str, str] = {}             # gpu uuid -> interval before the first holder

    def _check(self, claim_uid: str, uuids: Sequence[str], interval: str) -> None:
        for uuid in uuids:
            if is_mig_uuid(uuid):
                raise SharingNotSupported(f"claim {claim_uid}: time-slicing applies to whole GPUs, not {uuid}")
            others = {c: i for c, i in self._holders.get(uuid, {}).items() if c != claim_uid}
            conflict = next(((c, i) for c, i in others.items() if i != interval), None)
            if conflict:
                raise SharingError(f"claim {claim_uid}: GPU {uuid} is time-sliced with interval {conflict[1]} "
                                   f"for claim {conflict[0]}; cannot set {interval}")

    def intent(self, claim_uid: str, gpu_uuids: Sequence[str], interval: str) -> TimeSliceUndo:
        """What ``apply`` would do, without doing it: the undo record to write ahead of the change, so that a
        crash between applying and recording can still be rolled back. Raises what ``apply`` raises for a
        conflict; the caller must hold the GPUs (no other claim may change them in between)."""
        check_interval(interval)
        uuids = tuple(dict.fromkeys(gpu_uuids))
        with self._lock:
            self._check(claim_uid, uuids, interval)
            previous = "Default"
            for uuid in uuids:
                if self._holders.get(uuid):
                    previous = self._previous.get(uuid, previous)
                else:
                    previous = self.control.get_time_slice(uuid) or "Default"
            return TimeSliceUndo(gpu_uuids=uuids, interval=interval, previous=previous)

    def apply(self, claim_uid: str, gpu_uuids: Sequence[str], interval: str) -> TimeSliceUndo:
        """Set ``interval`` on whole GPUs for a claim. Raises SharingNotSupported / SharingError cleanly."""
        check_interval(interval)
        uuids = tuple(dict.fromkeys(gpu_uuids))
        with self._lock:
            self._check(claim_uid, uuids, interval)
            done: list[str] = []
            previous = "Default"
            try:
                for uuid in uuids:
                    if not self._holders.get(uuid):
                        before = self.control.get_time_slice(uuid) or "Default"
                        self.control.set_time_slice(uuid, interval)
                        self._previous[uuid] = before
                        done.append(uuid)
                    previous = self._previous.get(uuid, previous)
                    self._holders.setdefault(uuid, {})[claim_uid] = interval
            except SharingError:
                for uuid in done:
                    self._holders.get(uuid, {}).pop(claim_uid, None)
                    self._reset(uuid, self._previous.pop(uuid, "Default"))
                for uuid in uuids:
                    if uuid not in done:
                        self._holders.get(uuid, {}).pop(claim_uid, None)
                raise
            return TimeSliceUndo(gpu_uuids=uuids, interval=interval, previous=previous)

    def release(self, claim_uid: str, applied: TimeSliceUndo) -> None:
        """Undo a claim's setting; the GPU goes back to its previous interval when no claim holds it any more."""
        with self._lock:
            for uuid in applied.gpu_uuids:
                holders = self._holders.get(uuid, {})
                holders.pop(claim_uid, None)
                if holders:
                    continue
                self._holders.pop(uuid, None)
                self._reset(uuid, self._previous.pop(uuid, applied.previous))

    def adopt(self, claim_uid: str, applied: TimeSliceUndo) -> None:
        """Re-register a claim prepared before a plugin restart (the GPU setting is still in place)."""
        with self._lock:
            for uuid in applied.gpu_uuids:
                self._holders.setdefault(uuid, {})[claim_uid] = applied.interval
                self._previous.setdefault(uuid, applied.previous)

    def holders(self, gpu_uuid: str) -> dict[str, str]:
        with self._lock:
            return dict(self._holders.get(gpu_uuid, {}))

    def _reset(self, uuid: str, interval: str) -> None:
        try:
            self.control.set_time_slice(uuid, interval)
        except SharingNotSupported:
            pass  # nothing was applied on a GPU that does not support it
        except SharingError as err:
            log.error("could not reset the time-slice of GPU %s to %s: %s", uuid, interval, err)


# ----- MPS --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MpsDaemonRecord:
    """What the node knows of one daemon, on disk beside it: enough to stop it and undo its compute mode."""

    device: str                  # the GPU or MIG UUID it serves
    gpu: str                     # the physical GPU
    compute_mode_set: bool       # the GPU was switched to EXCLUSIVE_PROCESS for it

    def to_json(self) -> bytes:
        return json.dumps({"device": self.device, "gpu": self.gpu, "computeModeSet": self.compute_mode_set}).encode()


@dataclass(frozen=True)
class MpsPaths:
    """The host directories of the daemon serving one device."""

    base: Path

    @property
    def pipe_dir(self) -> str:
        return str(self.base / "pipe")

    @property
    def shm_dir(self) -> str:
        return str(self.base / "shm")

    @property
    def log_dir(self) -> str:
        return str(self.base / "log")

    @property
    def record(self) -> Path:
        return self.base / "daemon.json"


class MpsDaemons:
    """The node's MPS control daemons, one per device. The caller holds the device's GPU lock."""

    def __init__(self, control: SharingControl, state_dir: Path | str) -> None:
        self.control = control
        self.root = Path(state_dir) / "mps"
        self._lock = threading.RLock()
        self.restarts: dict[str, int] = {}

    def paths(self, device: str) -> MpsPaths:
        """A short directory name per device: the control socket's path must fit a Unix socket address
        (108 bytes), which a state directory plus a 40-character UUID would not leave room for."""
        if not device or "/" in device or device in (".", ".."):
            raise SharingError(f"MPS: {device!r} is not a device UUID")
        return MpsPaths(self.root / hashlib.sha256(device.encode()).hexdigest()[:12])

    def records(self) -> dict[str, MpsDaemonRecord]:
        """Every daemon described on disk (running or not), by device."""
        out: dict[str, MpsDaemonRecord] = {}
        try:
            entries = sorted(self.root.iterdir())
        except FileNotFoundError:
            return out
        for entry in entries:
            record = self._read_at(MpsPaths(entry))
            if record is not None:
                out[record.device] = record
        return out

    def _read(self, device: str) -> MpsDaemonRecord | None:
        return self._read_at(self.paths(device))

    @staticmethod
    def _read_at(paths: MpsPaths) -> MpsDaemonRecord | None:
        try:
            doc = json.loads(paths.record.read_bytes())
            return MpsDaemonRecord(device=str(doc["device"]), gpu=str(doc["gpu"]),
                                   compute_mode_set=bool(doc["computeModeSet"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def running(self, device: str) -> bool:
        return self.control.mps_daemon_running(self.paths(device).pipe_dir)

    def ensure(self, device: str, gpu: str, whole_gpu: bool,
               step: Callable[[str], None] = lambda _: None) -> MpsPaths:
        """The daemon serving ``device``, started if it is not running (``whole_gpu``: switch the GPU to
        EXCLUSIVE_PROCESS while it runs). On failure what this call changed is undone. ``step`` is called after
        each change (the driver's crash hook for tests)."""
        paths = self.paths(device)
        with self._lock:
            if self.running(device):
                return paths
            record = self._read(device) or MpsDaemonRecord(device=device, gpu=gpu,
                                                           compute_mode_set=whole_gpu and not is_mig_uuid(device))
            try:
                # Written before the GPU or any process changes: a crash after this line is found and undone.
                write_atomic(paths.record, record.to_json(), mode=0o600)
                for directory in (paths.pipe_dir, paths.shm_dir, paths.log_dir):
                    Path(directory).mkdir(parents=True, exist_ok=True)
                os.chmod(paths.log_dir, 0o700)
                if record.compute_mode_set:
                    self.control.set_compute_mode(gpu, "EXCLUSIVE_PROCESS")
                    step("mps-compute-mode-set")
                self.control.start_mps_daemon(self._spec(record))
            except (SharingError, OSError) as err:
                self._teardown(record, strict=False)
                if isinstance(err, OSError):
                    raise SharingError(f"MPS daemon for {device}: preparing {paths.base} failed: {err}") from err
                raise
            log.info("started MPS daemon for %s", device)
            return paths

    def _spec(self, record: MpsDaemonRecord) -> MpsDaemonSpec:
        paths = self.paths(record.device)
        return MpsDaemonSpec(pipe_dir=paths.pipe_dir, log_dir=paths.log_dir, visible_devices=(record.device,),
                             shm_dir=paths.shm_dir)

    def release(self, device: str) -> None:
        """The last claim left: stop the daemon, restore the compute mode, remove its directories. Idempotent;
        raises SharingError when the daemon cannot be stopped (the claim's undo entry then stays for a retry)."""
        with self._lock:
            record = self._read(device)
            if record is None:
                record = MpsDaemonRecord(device=device, gpu=device, compute_mode_set=False)
            self._teardown(record, strict=True)
            log.info("stopped MPS daemon for %s", device)

    def supervise(self, in_use: Sequence[str]) -> list[str]:
        """Restart the daemons of ``in_use`` devices that are not running. Returns the devices restarted."""
        restarted = []
        with self._lock:
            records = self.records()
            for device in in_use:
                record = records.get(device)
                if record is None or self.running(device):
                    continue
                log.warning("MPS daemon for %s is not running; restarting it", device)
                try:
                    for directory in (self.paths(device).pipe_dir, self.paths(device).shm_dir,
                                      self.paths(device).log_dir):
                        Path(directory).mkdir(parents=True, exist_ok=True)
                    self.control.start_mps_daemon(self._spec(record))
                except (SharingError, OSError) as err:
                    log.error("restarting MPS daemon for %s failed (will retry): %s", device, err)
                    continue
                self.restarts[device] = self.restarts.get(device, 0) + 1
                restarted.append(device)
        return restarted

    def _teardown(self, record: MpsDaemonRecord, strict: bool) -> None:
        paths = self.paths(record.device)
        # Stop first: the compute mode of a GPU must not change under a running daemon.
        try:
            self.control.stop_mps_daemon(paths.pipe_dir)
        except SharingError as err:
            if strict:
                raise
            log.error("stopping MPS daemon for %s failed: %s", record.device, err)
        if record.compute_mode_set:
            try:
                self.control.set_compute_mode(record.gpu, "DEFAULT")
            except SharingError as err:
                if strict:
                    raise
                log.error("resetting the compute mode of GPU %s failed: %s", record.gpu, err)
        # rmtree never follows a symlink a workload planted in pipe/ or shm/; the record goes last, so an
        # interrupted teardown is found again.
        for directory in (paths.pipe_dir, paths.shm_dir, paths.log_dir):
            shutil.rmtree(directory, ignore_errors=True)
        remove_file(paths.record)
        try:
            paths.base.rmdir()
        except OSError:
            pass
