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
``cgroup_procs``, outside the plugin container's cgroup), and described on disk (``<root>/<hash of the device
UUID>/daemon.json``, written before anything is changed), so a plugin restart or upgrade leaves them and their
clients running and the next plugin process takes them over. Which claims use a daemon is in the checkpoint;
the daemon goes when its last claim does. A daemon is known by the identity of its process (PID and start time,
``dra.node.processidentity``) recorded when it started, and by nothing else: a record that is missing, damaged, names
another device or names no process (a start that did not finish, an older release's record) is never trusted,
and its daemon is stopped through its control socket and started again, never looked for by its PID file or its
looks (a process that merely looks like the daemon could be anyone's).

Directories per daemon: ``pipe`` (mounted read-only into client containers: NVIDIA's clients need only to
connect to its sockets, while the root daemon writes its PID file and log there following links), ``shm`` (the
clients' ``/dev/shm``, read-write, a size-limited tmpfs) and ``log`` (the plugin's own, never mounted). Before
every daemon start, pipe and shm are emptied without following links; they are removed with a symlink-safe
``rmtree``. Nothing in them is opened or parsed here except the daemon's PID file, as a regular root-owned file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from api.config.errors import printable
from dra.model.policy import MpsNodePolicy
from dra.node import tmpfs
from dra.node.atomicfile import remove_file, remove_leftover_temp_files, write_atomic
from dra.node.checkpoint import TimeSliceUndo
from dra.node.processidentity import ProcessIdentity
from dra.node.safefiles import read_regular_file
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
MAX_RECORD_BYTES = 4096


@dataclass(frozen=True)
class MpsDaemonRecord:
    """What the node knows of one daemon, on disk beside it: enough to find it again, stop it and undo its
    compute mode. ``daemon`` is the process the plugin started (None until it runs, or for a record written
    before identities were recorded)."""

    device: str                  # the GPU or MIG UUID it serves
    gpu: str                     # the physical GPU
    compute_mode_set: bool       # the GPU was switched to EXCLUSIVE_PROCESS for it
    daemon: ProcessIdentity | None = None

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {"device": self.device, "gpu": self.gpu, "computeModeSet": self.compute_mode_set}
        if self.daemon is not None:
            doc["daemon"] = self.daemon.to_json()
        return json.dumps(doc).encode()

    @classmethod
    def derived(cls, device: str, gpu: str) -> MpsDaemonRecord:
        """The record the plugin writes for a daemon on ``device``: a whole GPU is switched to EXCLUSIVE_PROCESS
        while its daemon runs, a MIG device has no compute mode. Used to rebuild a record that is lost or
        damaged: it follows from the device alone."""
        return cls(device=device, gpu=gpu, compute_mode_set=device == gpu and not is_mig_uuid(device))


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
    """The node's MPS control daemons, one per device. The caller holds the device's GPU lock.

    policy:     the node policy's MPS settings (tenancy, shm size)
    mount_shm:  each daemon's shared-memory directory is a tmpfs of ``policy.shm_size`` (False: a plain
                directory, for tests without mount privileges)
    """

    def __init__(self, control: SharingControl, state_dir: Path | str, *, policy: MpsNodePolicy = MpsNodePolicy(),
                 mount_shm: bool = False) -> None:
        self.control = control
        self.root = Path(state_dir) / "mps"
        self.policy = policy
        self.mount_shm = mount_shm
        self._lock = threading.RLock()
        self.restarts: dict[str, int] = {}

    def paths(self, device: str) -> MpsPaths:
        """A short directory name per device: the control socket's path must fit a Unix socket address
        (108 bytes), which a state directory plus a 40-character UUID would not leave room for."""
        if not device or "/" in device or device in (".", ".."):
            raise SharingError(f"MPS: {device!r} is not a device UUID")
        return MpsPaths(self.root / _dir_name(device))

    def records(self) -> dict[str, MpsDaemonRecord]:
        """Every daemon described on disk by a record that checks out (running or not), by device."""
        out: dict[str, MpsDaemonRecord] = {}
        for entry in self._dirs():
            record, _ = read_record(MpsPaths(entry))
            if record is not None:
                out[record.device] = record
        return out

    def _dirs(self) -> list[Path]:
        try:
            return sorted(e for e in self.root.iterdir() if not e.is_symlink() and e.is_dir())
        except FileNotFoundError:
            return []

    def _read(self, device: str) -> MpsDaemonRecord | None:
        return read_record(self.paths(device))[0]

    def _current(self, device: str, gpu: str) -> tuple[MpsDaemonRecord, str | None]:
        """The record of ``device``'s daemon when it is a record of ours that agrees with ``gpu`` and names the
        daemon's process, with None; else the record the plugin writes for the device, with no process, and the
        start of the caller's one log line saying what was wrong (None where there is no daemon directory at
        all). A daemon whose process is not known is stopped through its control socket, never looked for by
        its PID file or its looks."""
        paths = self.paths(device)
        record, problem = read_record(paths)
        if record is not None and record.gpu != gpu:
            problem = f"names GPU {printable(record.gpu)}, not {gpu}"
            record = None
        elif record is not None and record.daemon is None:
            record, problem = None, ("names no daemon process (a daemon start that did not finish, or an older "
                                     "release's record)")
        if record is not None:
            return record, None
        if problem == RECORD_MISSING and not paths.base.is_dir():
            problem = None
        note = f"MPS daemon record {paths.record} {problem}: not trusted, no process is taken for its daemon"
        return MpsDaemonRecord.derived(device, gpu), note if problem else None

    def _alive(self, record: MpsDaemonRecord) -> bool:
        return record.daemon is not None and self.control.mps_daemon_running(self.paths(record.device).pipe_dir,
                                                                             record.daemon)

    def running(self, device: str, gpu: str | None = None) -> bool:
        return self._alive(self._current(device, gpu or device)[0])

    def ensure(self, device: str, gpu: str, step: Callable[[str], None] = lambda _: None) -> MpsPaths:
        """The daemon serving ``device`` on the physical GPU ``gpu``, started if it is not running (a whole GPU
        is switched to EXCLUSIVE_PROCESS while it runs: ``MpsDaemonRecord.derived``). On failure what this call
        changed is undone. ``step`` is called after each change (the driver's crash hook for tests)."""
        paths = self.paths(device)
        with self._lock:
            record, problem = self._current(device, gpu)
            if self._alive(record):
                return paths
            if problem:
                log.warning("%s; the daemon is started again", problem)
            record = MpsDaemonRecord.derived(device, gpu)
            self._stop_unidentified(paths)     # raises before anything is changed
            try:
                # Written before the GPU or any process changes: a crash after this line is found and undone.
                self._prepare_start(record, step)
                if record.compute_mode_set:
                    self.control.set_compute_mode(gpu, "EXCLUSIVE_PROCESS")
                    step("mps-compute-mode-set")
                record = self._launch(record)
            except (SharingError, OSError) as err:
                self._teardown(record, strict=False)
                if isinstance(err, OSError):
                    raise SharingError(f"MPS daemon for {device}: preparing {paths.base} failed: {err}") from err
                raise
            assert record.daemon is not None            # _launch records it
            log.info("started MPS daemon for %s (pid %d)", device, record.daemon.pid)
            return paths

    def _prepare_start(self, record: MpsDaemonRecord, step: Callable[[str], None] = lambda _: None) -> None:
        """The daemon's record on disk (before anything changes) and its directories, fresh."""
        paths = self.paths(record.device)
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        paths.base.mkdir(mode=0o711, exist_ok=True)
        write_atomic(paths.record, record.to_json(), mode=0o600,
                     before_replace=lambda: step("mps-record-temp-written"))
        self._fresh_directories(paths)

    def _launch(self, record: MpsDaemonRecord) -> MpsDaemonRecord:
        """Start the daemon of ``record`` and record its process identity."""
        started = replace(record, daemon=self.control.start_mps_daemon(self._spec(record)))
        write_atomic(self.paths(record.device).record, started.to_json(), mode=0o600)
        return started

    def _stop_unidentified(self, paths: MpsPaths) -> None:
        """Before a start: a daemon serving this pipe directory whose process is not known (a start cut short, an
        older release's daemon) is asked to quit through its control socket, which only a root daemon can have
        made there; no process is signalled. Raises SharingError when one answers and does not quit."""
        self.control.stop_mps_daemon(paths.pipe_dir, None)

    def _fresh_directories(self, paths: MpsPaths) -> None:
        """Before every daemon start: the pipe and shm directories exist and are empty. The daemon (root) writes
        its PID file and log into the pipe directory following links, so nothing left there by anyone may
        remain; the directories themselves are kept (never replaced), so containers that have them mounted see
        the new daemon. The log directory is the plugin's own."""
        for directory, mode in ((paths.pipe_dir, 0o755), (paths.shm_dir, 0o1777), (paths.log_dir, 0o700)):
            _own_directory(directory, mode)
        if self.mount_shm and not tmpfs.is_mountpoint(paths.shm_dir):
            tmpfs.mount_tmpfs(paths.shm_dir, self.policy.shm_size_bytes)
        for directory in (paths.pipe_dir, paths.shm_dir):
            _empty_directory(directory)

    def _spec(self, record: MpsDaemonRecord) -> MpsDaemonSpec:
        paths = self.paths(record.device)
        return MpsDaemonSpec(pipe_dir=paths.pipe_dir, log_dir=paths.log_dir, visible_devices=(record.device,),
                             shm_dir=paths.shm_dir)

    def release(self, device: str, gpu: str | None = None) -> None:
        """The last claim left: stop the daemon, restore the compute mode, remove its directories. Idempotent;
        raises SharingError when the daemon cannot be stopped (the claim's undo entry then stays for a retry)."""
        with self._lock:
            record, problem = self._current(device, gpu or self._gpu_of(device))
            if problem:
                log.warning("%s; the daemon is stopped through its control socket", problem)
            self._teardown(record, strict=True)
            log.info("stopped MPS daemon for %s", device)

    def _gpu_of(self, device: str) -> str:
        record = self._read(device)
        return record.gpu if record is not None else device

    def supervise(self, in_use: Mapping[str, str]) -> list[str]:
        """Restart the daemons of ``in_use`` devices (device -> GPU) that are not running, in emptied
        directories. Returns the devices restarted."""
        restarted = []
        with self._lock:
            for device, gpu in sorted(in_use.items()):
                record, problem = self._current(device, gpu)
                if self._alive(record):
                    continue
                paths = self.paths(device)
                others = self.control.lookalikes(paths.pipe_dir, record.daemon)
                ignored = (f" (ignoring process(es) {', '.join(map(str, others))} that only look like it)"
                           if others else "")
                if problem:
                    log.warning("%s; the daemon is started again%s", problem, ignored)
                else:
                    log.warning("MPS daemon for %s is not running; restarting it%s", device, ignored)
                try:
                    record = MpsDaemonRecord.derived(device, gpu)
                    self._stop_unidentified(paths)
                    self._prepare_start(record)
                    self._launch(record)
                except (SharingError, OSError) as err:
                    log.error("restarting MPS daemon for %s failed (will retry): %s", device, err)
                    continue
                self.restarts[device] = self.restarts.get(device, 0) + 1
                restarted.append(device)
        return restarted

    def remove_unknown(self, in_use: Mapping[str, str]) -> list[str]:
        """Directories under the MPS root that belong to no device in use and hold no record that checks out
        (a damaged record): their daemon is stopped through its control socket and they are removed. Returns
        the directories removed."""
        known = {_dir_name(d) for d in in_use} | {_dir_name(d) for d in self.records()}
        removed = []
        with self._lock:
            for entry in self._dirs():
                if entry.name in known:
                    continue
                paths = MpsPaths(entry)
                _, problem = read_record(paths)
                try:
                    self.control.stop_mps_daemon(paths.pipe_dir, None)
                except SharingError as err:
                    log.error("stopping the MPS daemon in %s failed: %s", entry, err)
                    continue
                if self._remove_directories(paths):
                    log.warning("removed MPS daemon directory %s: its record %s and no claim uses it (a daemon there "
                                "was stopped through its control socket); the compute mode of its GPU is left as it "
                                "is", entry, problem or "is not its own")
                    removed.append(entry.name)
        return removed

    def remove_leftover_temp_files(self) -> list[Path]:
        """Temporary files of daemon records that a crash left unrenamed, in every daemon directory: deleted, so
        that they neither keep a directory from being removed nor pile up. Returns them."""
        removed: list[Path] = []
        with self._lock:
            for entry in self._dirs():
                removed += remove_leftover_temp_files(entry, targets=(MpsPaths(entry).record.name,))
        return removed

    def _teardown(self, record: MpsDaemonRecord, strict: bool) -> None:
        paths = self.paths(record.device)
        # Stop first: the compute mode of a GPU must not change under a running daemon.
        try:
            self.control.stop_mps_daemon(paths.pipe_dir, record.daemon)
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
        self._remove_directories(paths)

    @staticmethod
    def _remove_directories(paths: MpsPaths) -> bool:
        """Remove the daemon's directory; False (and one error line naming what stays) when it cannot be."""
        # rmtree never follows a symlink planted in pipe/ or shm/; the record goes last (after the temporary
        # files of a record write a crash cut short), so an interrupted teardown is found again.
        if tmpfs.is_mountpoint(paths.shm_dir):
            try:
                tmpfs.unmount(paths.shm_dir)
            except OSError as err:
                log.error("%s", err)
        for directory in (paths.pipe_dir, paths.shm_dir, paths.log_dir):
            shutil.rmtree(directory, ignore_errors=True)
        remove_leftover_temp_files(paths.base, targets=(paths.record.name,))
        remove_file(paths.record)
        try:
            paths.base.rmdir()
        except FileNotFoundError:
            pass
        except OSError as err:
            try:
                left = ", ".join(sorted(printable(e.name) for e in paths.base.iterdir())) or "nothing"
            except OSError:
                left = "unknown"
            log.error("MPS daemon directory %s stays: %s (left in it: %s)", paths.base,
                      err.strerror or err, left)
            return False
        return True


RECORD_MISSING = "is missing"


def read_record(paths: MpsPaths) -> tuple[MpsDaemonRecord | None, str | None]:
    """(the record in ``paths``, None) if it is a regular file of ours that names the device this directory is
    for; (None, what is wrong: ``RECORD_MISSING``, "is damaged (...)", "names device ...") otherwise, and such a
    record is never acted on. Logs nothing: the caller says what it does about it, in one line."""
    try:
        doc = json.loads(read_regular_file(paths.record, MAX_RECORD_BYTES))
        device, gpu, mode_set = doc["device"], doc["gpu"], doc["computeModeSet"]
        if not isinstance(device, str) or not isinstance(gpu, str) or not isinstance(mode_set, bool):
            raise TypeError("device and gpu must be strings, computeModeSet a boolean")
    except FileNotFoundError:
        return None, RECORD_MISSING
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return None, f"is damaged ({printable(_one_line(err))})"
    if not device or "/" in device or _dir_name(device) != paths.base.name:
        return None, f"names device {printable(device)!r}, whose daemon directory is not {paths.base.name}"
    return MpsDaemonRecord(device=device, gpu=gpu, compute_mode_set=mode_set,
                           daemon=ProcessIdentity.from_json(doc.get("daemon"))), None


def _dir_name(device: str) -> str:
    return hashlib.sha256(device.encode()).hexdigest()[:12]


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _own_directory(path: str, mode: int) -> None:
    """``path`` is a directory (not a link) with ``mode``, owned by this process's user; a link or file in its
    place is removed first."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        st = None
    if st is None:
        os.mkdir(path, mode)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            os.fchown(fd, os.geteuid(), os.getegid())
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _empty_directory(path: str) -> None:
    """Remove everything in ``path`` without following a link: names are resolved relative to a descriptor
    of the directory opened with O_NOFOLLOW, and sub-directories removed by the fd-based ``rmtree``."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in os.listdir(fd):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
