"""Sharing bookkeeping above the ``SharingControl`` seam: time-slice intervals and MPS control daemons.

Time-slicing is a GPU-wide setting, so several claims on one GPU (shared slots) must agree on it: the first
claim sets it, later claims with the same interval join, a different interval is refused cleanly, and the
setting returns to what it was only when the last claim leaves.

MPS daemons are children of the plugin, one per claim and device set, with pipe, log and shm directories
under ``<state dir>/mps/<daemon id>/``. A whole GPU the claim owns alone is switched to EXCLUSIVE_PROCESS
while its daemon runs (one MPS server per GPU, as NVIDIA recommends); shared GPUs (slots) stay in DEFAULT so
each claim's daemon — and its memory and thread limits — can coexist. ``supervise`` restarts daemons that
died; daemons of claims prepared before a plugin restart are re-adopted from the checkpoint with ``adopt``
(a daemon dies with the plugin's container, so supervise then starts it again).
"""
from __future__ import annotations

import hashlib
import logging
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from dra.node.checkpoint import MpsUndo, TimeSliceUndo
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
class MpsDevice:
    """A device an MPS daemon serves. ``exclusive``: a whole GPU only this claim uses (→ EXCLUSIVE_PROCESS)."""

    uuid: str
    exclusive: bool = False


@dataclass(frozen=True)
class MpsDaemon:
    """A supervised MPS control daemon (goes into the checkpoint as undo information)."""

    daemon_id: str
    claim_uid: str
    gpu_uuids: tuple[str, ...]
    pipe_dir: str
    log_dir: str
    shm_dir: str | None
    compute_mode_set: tuple[str, ...] = ()
    active_thread_percentage: int | None = None
    pinned_memory_limit_mib: Mapping[str, int] = field(default_factory=dict)

    def undo(self) -> MpsUndo:
        """The checkpoint's record of this daemon."""
        return MpsUndo(daemon_id=self.daemon_id, gpu_uuids=self.gpu_uuids, pipe_dir=self.pipe_dir,
                       log_dir=self.log_dir, shm_dir=self.shm_dir, compute_mode_set=self.compute_mode_set,
                       active_thread_percentage=self.active_thread_percentage,
                       pinned_memory_limit_mib=dict(self.pinned_memory_limit_mib))

    @classmethod
    def from_undo(cls, claim_uid: str, u: MpsUndo) -> MpsDaemon:
        return cls(daemon_id=u.daemon_id, claim_uid=claim_uid, gpu_uuids=tuple(u.gpu_uuids), pipe_dir=u.pipe_dir,
                   log_dir=u.log_dir, shm_dir=u.shm_dir, compute_mode_set=tuple(u.compute_mode_set),
                   active_thread_percentage=u.active_thread_percentage,
                   pinned_memory_limit_mib=dict(u.pinned_memory_limit_mib))

    @property
    def spec(self) -> MpsDaemonSpec:
        return MpsDaemonSpec(pipe_dir=self.pipe_dir, log_dir=self.log_dir, visible_devices=self.gpu_uuids,
                             shm_dir=self.shm_dir)


def mps_daemon_id(claim_uid: str, uuids: Sequence[str]) -> str:
    digest = hashlib.sha256(",".join(sorted(uuids)).encode()).hexdigest()[:8]
    return f"{claim_uid}-{digest}"


class MpsSupervisor:
    """Starts, watches, restarts and stops the plugin's MPS control daemons."""

    def __init__(self, control: SharingControl, state_dir: Path | str) -> None:
        self.control = control
        self.root = Path(state_dir) / "mps"
        self._lock = threading.RLock()
        self._daemons: dict[str, MpsDaemon] = {}
        self.restarts: dict[str, int] = {}

    def daemons(self) -> dict[str, MpsDaemon]:
        with self._lock:
            return dict(self._daemons)

    def start(
        self,
        claim_uid: str,
        devices: Sequence[MpsDevice],
        *,
        active_thread_percentage: int | None = None,
        pinned_memory_limit_mib: Mapping[str, int] | None = None,
    ) -> MpsDaemon:
        """Start the claim's daemon for ``devices`` (idempotent for the same claim and devices).

        On failure everything done so far is undone and SharingError is raised.
        """
        if not devices:
            raise SharingError(f"claim {claim_uid}: MPS needs at least one device")
        uuids = tuple(d.uuid for d in devices)
        limits = dict(pinned_memory_limit_mib or {})
        unknown = sorted(set(limits) - set(uuids))
        if unknown:
            raise SharingError(f"claim {claim_uid}: pinned memory limit for {', '.join(unknown)}, which the daemon "
                               "does not serve")
        if active_thread_percentage is not None and not 1 <= active_thread_percentage <= 100:
            raise SharingError(f"claim {claim_uid}: active thread percentage {active_thread_percentage} is not 1..100")
        daemon_id = mps_daemon_id(claim_uid, uuids)
        with self._lock:
            existing = self._daemons.get(daemon_id)
            if existing is not None and self.control.mps_daemon_running(existing.pipe_dir):
                return existing
            base = self.root / daemon_id
            daemon = MpsDaemon(
                daemon_id=daemon_id, claim_uid=claim_uid, gpu_uuids=uuids, pipe_dir=str(base / "pipe"),
                log_dir=str(base / "log"), shm_dir=str(base / "shm"),
                compute_mode_set=tuple(d.uuid for d in devices if d.exclusive and not is_mig_uuid(d.uuid)),
                active_thread_percentage=active_thread_percentage, pinned_memory_limit_mib=limits,
            )
            moded: list[str] = []
            try:
                for directory in (daemon.pipe_dir, daemon.log_dir, daemon.shm_dir):
                    Path(directory).mkdir(parents=True, exist_ok=True)
                for uuid in daemon.compute_mode_set:
                    self.control.set_compute_mode(uuid, "EXCLUSIVE_PROCESS")
                    moded.append(uuid)
                self._launch(daemon)
            except (SharingError, OSError) as err:
                self._teardown(daemon, moded)
                if isinstance(err, OSError):
                    raise SharingError(
                        f"claim {claim_uid}: preparing MPS directories under {base} failed: {err}") from err
                raise
            self._daemons[daemon_id] = daemon
            self.restarts.setdefault(daemon_id, 0)
            log.info("started MPS daemon %s for claim %s on %s", daemon_id, claim_uid, ", ".join(uuids))
            return daemon

    def _launch(self, daemon: MpsDaemon) -> None:
        self.control.start_mps_daemon(daemon.spec)
        try:
            if daemon.active_thread_percentage is not None:
                self.control.mps_command(daemon.pipe_dir,
                                         f"set_default_active_thread_percentage {daemon.active_thread_percentage}")
            for uuid, mib in sorted(daemon.pinned_memory_limit_mib.items()):
                self.control.mps_command(daemon.pipe_dir, f"set_default_device_pinned_mem_limit {uuid} {mib}M")
        except SharingError:
            self.control.stop_mps_daemon(daemon.pipe_dir)
            raise

    def adopt(self, daemon: MpsDaemon) -> None:
        """Take over a daemon recorded before a plugin restart; ``supervise`` restarts it if it is gone."""
        with self._lock:
            self._daemons[daemon.daemon_id] = daemon
            self.restarts.setdefault(daemon.daemon_id, 0)

    def supervise(self) -> list[str]:
        """Restart every supervised daemon that is not running. Returns the ids restarted."""
        restarted = []
        with self._lock:
            for daemon in list(self._daemons.values()):
                if self.control.mps_daemon_running(daemon.pipe_dir):
                    continue
                log.warning("MPS daemon %s of claim %s is not running; restarting it", daemon.daemon_id,
                            daemon.claim_uid)
                try:
                    for directory in (daemon.pipe_dir, daemon.log_dir, daemon.shm_dir):
                        if directory:
                            Path(directory).mkdir(parents=True, exist_ok=True)
                    self._launch(daemon)
                except (SharingError, OSError) as err:
                    log.error("restarting MPS daemon %s failed (will retry): %s", daemon.daemon_id, err)
                    continue
                self.restarts[daemon.daemon_id] = self.restarts.get(daemon.daemon_id, 0) + 1
                restarted.append(daemon.daemon_id)
        return restarted

    def run(self, stop: threading.Event, interval_s: float = 5.0) -> None:
        """Supervise until ``stop`` is set (run it in a thread)."""
        while not stop.wait(interval_s):
            try:
                self.supervise()
            except Exception:  # noqa: BLE001 - the supervisor must outlive one bad round
                log.exception("MPS supervision round failed")

    def stop(self, daemon: MpsDaemon | str) -> None:
        """Stop a daemon, reset compute modes and remove its directories. Idempotent."""
        with self._lock:
            if isinstance(daemon, str):
                known = self._daemons.get(daemon)
                if known is None:
                    return
                daemon = known
            self._teardown(daemon, list(daemon.compute_mode_set), strict=True)
            self._daemons.pop(daemon.daemon_id, None)
            log.info("stopped MPS daemon %s of claim %s", daemon.daemon_id, daemon.claim_uid)

    def _teardown(self, daemon: MpsDaemon, moded: Sequence[str], strict: bool = False) -> None:
        # Stop first: the compute mode of a GPU must not change under a running daemon.
        try:
            self.control.stop_mps_daemon(daemon.pipe_dir)
        except SharingError as err:
            if strict:
                raise
            log.error("stopping MPS daemon %s failed: %s", daemon.daemon_id, err)
        for uuid in moded:
            try:
                self.control.set_compute_mode(uuid, "DEFAULT")
            except SharingError as err:
                if strict:
                    raise
                log.error("resetting the compute mode of GPU %s failed: %s", uuid, err)
        base = Path(daemon.pipe_dir).parent
        if base.parent == self.root:
            shutil.rmtree(base, ignore_errors=True)
