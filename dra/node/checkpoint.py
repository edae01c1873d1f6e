"""The plugin's crash-safe record of prepared claims.

Prepare is not a pure function of the claim: it creates MIG devices, starts MPS daemons and changes GPU
settings. Everything needed to answer a repeated Prepare identically, and to undo a claim later (also after a
crash halfway through), is stored here:

* ``PrepareStarted`` is written *before* any side effect on the hardware, with the undo information filled in
  as actions complete, so a crash leaves enough to roll back; ``PrepareCompleted`` holds the result returned to
  the kubelet.
* On disk: a snapshot (``checkpoint.json``: schema version, node boot ID, every record) and a journal beside it
  (``checkpoint.json.journal``: one JSON line per change, appended before the change counts). A change costs
  one small append, not a rewrite of every record. The append is not fsync'd while the node's boot ID can be
  read: anything that loses the page cache (a kernel crash, a power cut) is a reboot, after which every record
  of the earlier boot is dropped anyway (below), and the plugin's own crash loses nothing ``write()`` handed to
  the kernel. Without a boot ID appends are fsync'd, and appends of different claims share their fsyncs (group
  commit), so claims never wait for each other's writes. Replaying the journal over the snapshot
  is idempotent; a torn last line (a crash during the append) is a change that never returned, and is ignored.
  The journal is folded into the snapshot (written atomically) at start-up, at close and when it grows large.
* Reads (``get``, ``claims``, ``holders``) never wait for a write.
* The two files are one state, tied together by journal IDs. The snapshot names the journal that continues it
  (``journalId``) and the one it already holds (``foldedJournalId``); the journal's first line is its header
  (``{"schemaVersion": n, "journalId": id}``). Compaction writes the next journal complete (header, fsync) under
  a temporary name, then the snapshot, then renames the journal into place, and before the very first snapshot
  a header-only journal marked ``initial`` is put in place. So every state the plugin can leave behind is one
  of: nothing; an ``initial`` journal with no changes and no snapshot (a crash during the first start); a
  snapshot with its own journal; a snapshot with the journal it folded in (a crash during compaction: that
  journal is skipped). Anything else is damage: a missing, empty or header-less journal beside a snapshot, a
  journal of another snapshot, a journal with changes but no snapshot.
* The files are opened without following links, without blocking (a FIFO in their place cannot hang the
  start) and only as regular files owned by the plugin's UID, at most ``MAX_FILE_BYTES`` (dra.node.safefiles);
  anything else in their place is damage too. Writes never follow a link: new files are created with
  O_EXCL|O_NOFOLLOW and renamed over the name, in a directory only the plugin can write.
* Read tolerantly: unknown fields are ignored. A snapshot that cannot be read at all (bad JSON, bad shape, a
  directory, link, FIFO or device in its place, another owner, no permission) is moved aside as
  ``<name>.corrupt-<timestamp>`` with one log line and the store starts without it. A damaged journal makes the
  snapshot stale by an unknown number of changes, so both are moved aside (one log line) and the store starts
  empty, exactly as after a lost snapshot. A record stored under a key that is not the UID it holds is skipped
  as unreadable. ``LoadResult.state_lost`` then tells the caller that prepared claims may exist that it no
  longer knows (the driver destroys nothing at that start and adopts claims from their CDI specs).
* Two records that hold one exclusive device (only a damaged or edited checkpoint has them: ``put`` refuses
  it, so one of them may be a planted phantom) are not resolved here: neither record says which is true, and a
  rule such as "the newer wins" lets whoever plants the last line win. ``load`` reports them
  (``LoadResult.conflicts``) and keeps both bookings, so no third claim gets the device; the caller resolves
  each from what the API server says is allocated (``resolve``: the other records lose the device and a MIG
  device made for it) or leaves it standing, and ``conflict_of`` tells the prepare of either claim about it.
* A checkpoint written by a newer plugin (a higher ``schemaVersion``) is never rewritten: ``load`` raises
  ``CheckpointTooNew`` and the plugin refuses to start, because dropping the newer fields would lose undo
  information.
* The node boot ID is stored: after a reboot, MIG devices, MPS daemons, time-slice settings and the CDI files
  under /var/run are gone, so state from an earlier boot is dropped and the caller is told which claims.
* Devices are booked here: ``put`` with ``exclusive`` refuses a device another claim holds, in the same step
  that records the claim, so two claims can never both be told they hold one device.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from api.config.errors import printable
from dra.node.atomicfile import TEMP_SUFFIX, fsync_dir, remove_leftover_temp_files, set_aside, temp_prefix
from dra.node.bootid import DEFAULT_BOOT_ID_PATH, read_boot_id
from dra.node.safefiles import UnsafeFile, check_owned_dir, open_regular, read_regular_file, write_regular_file

log = logging.getLogger(__name__)

# 2: the journal beside the snapshot (a plugin that reads only the snapshot would miss its changes).
SCHEMA_VERSION = 2
FIRST_SCHEMA_WITH_JOURNAL = 2

ClaimState = Literal["PrepareStarted", "PrepareCompleted"]
PREPARE_STARTED: ClaimState = "PrepareStarted"
PREPARE_COMPLETED: ClaimState = "PrepareCompleted"


class _Record(BaseModel):
    """camelCase on disk, snake_case in Python; unknown fields ignored (forward compatibility); immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        extra="ignore",
        frozen=True,
    )


class PreparedDevice(_Record):
    """One device returned to the kubelet for a claim (the kubeletplugin ``Device`` message)."""

    device: str                              # device name in the ResourceSlice
    pool: str
    requests: tuple[str, ...] = ()
    cdi_device_ids: tuple[str, ...] = ()
    share_id: str | None = None
    uuid: str | None = None                  # GPU-/MIG- UUID actually used (for a dynamic MIG device: the new one)
    admin_access: bool = False               # watched, not held: never blocks the claim that uses the device


class MigUndo(_Record):
    """A MIG device this claim created (dynamic MIG): destroy it on unprepare."""

    device: str                              # the abstract device name it realises
    parent_uuid: str
    gi_id: int
    ci_id: int
    mig_uuid: str | None = None              # None when the crash came between GI/CI creation and reading the UUID
    profile_id: int
    start: int
    share_id: str | None = None              # the share it is an instance of (one-profile MIG device as capacity)


class TimeSliceUndo(_Record):
    """A time-slice interval this claim set on whole GPUs; restore ``previous`` on unprepare."""

    gpu_uuids: tuple[str, ...]
    interval: str                            # Default | Short | Medium | Long
    previous: str = "Default"


class MpsUse(_Record):
    """This claim's clients use the MPS daemon serving ``device``; the daemon goes when no claim uses it."""

    device: str                              # GPU or MIG UUID the daemon serves
    gpu: str                                 # its physical GPU (locked while the daemon starts or stops)


class ReservedPod(_Record):
    """A pod a claim was reserved for (``status.reservedFor``); its namespace is the claim's."""

    name: str
    uid: str


class UndoInfo(_Record):
    mig_devices: tuple[MigUndo, ...] = ()
    time_slices: tuple[TimeSliceUndo, ...] = ()
    mps_devices: tuple[MpsUse, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.mig_devices or self.time_slices or self.mps_devices)


class ClaimRecord(_Record):
    uid: str
    namespace: str = ""
    name: str = ""
    state: ClaimState
    devices: tuple[PreparedDevice, ...] = ()
    undo: UndoInfo = Field(default_factory=UndoInfo)
    # The pods the claim was reserved for when it was prepared, for the per-claim metrics (pod UID → pod). Pods
    # that share the claim later are not here (the kubelet prepares a claim once); empty in records of older
    # plugins and of recovered claims.
    reserved_for: tuple[ReservedPod, ...] = ()
    updated: float = 0.0                     # unix time of the last write of this record
    # Rebuilt from the claim's CDI spec after the checkpoint was lost: request names, namespace and name are
    # unknown until the claim is prepared again (kubeletplugin.recovery).
    recovered: bool = False
    # Its MPS-served devices' allocation tolerates the MPS tenancy taint of its namespace (dra.model.tenancy):
    # only then may its GPU carry that taint, which would otherwise evict its own pods.
    mps_tenancy_tolerated: bool = False

    @property
    def completed(self) -> bool:
        return self.state == PREPARE_COMPLETED

    def exclusive_devices(self) -> list[tuple[str, str]]:
        """(pool, device) this claim holds alone: not watched (admin access) and not a share (a share of a
        device that allows multiple allocations always carries its share ID)."""
        return [(d.pool, d.device) for d in self.devices if not d.admin_access and d.share_id is None]

    def without_device(self, pool: str, device: str) -> "ClaimRecord":
        """This record minus its booking of one device and any MIG device it created for it."""
        return self.model_copy(update={
            "devices": tuple(d for d in self.devices if (d.pool, d.device) != (pool, device) or d.admin_access),
            "undo": self.undo.model_copy(update={
                "mig_devices": tuple(m for m in self.undo.mig_devices if m.device != device)})})


_Stored = TypeVar("_Stored", ClaimRecord, None)   # what a journal change stores, and returns


class CheckpointFile(_Record):
    schema_version: int
    node_boot_id: str = ""
    journal_id: str = ""                     # the journal that continues this snapshot ("" before journal IDs)
    folded_journal_id: str = ""              # the journal whose changes this snapshot already holds
    # Validated one by one on load, so one record this version cannot read does not cost the others.
    claims: dict[str, dict[str, Any]] = Field(default_factory=dict)


@dataclass(frozen=True)
class LoadResult:
    """What ``load`` found, for the caller's logs, events and cleanup."""

    claims: int                                     # claims kept
    dropped_claims: tuple[ClaimRecord, ...] = ()    # discarded because the node rebooted since they were written
    corrupt_file: Path | None = None                # where an unreadable file was moved
    unreadable_claims: tuple[str, ...] = ()         # UIDs of records that could not be parsed (skipped)
    boot_id_stamped: bool = False                   # a file without boot ID got the current one
    corrupt: bool = False                           # the file could not be read at all (moved aside if possible)
    damage: str = ""                                # what was wrong with the journal ("" when nothing was)
    conflicts: tuple[BookingConflict, ...] = ()     # exclusive devices more than one record holds
    temp_files_removed: tuple[Path, ...] = ()       # of snapshot or journal writes a crash cut short

    @property
    def state_lost(self) -> bool:
        """Claims prepared on this node may be missing from the checkpoint: their MIG devices and CDI specs
        must not be mistaken for leftovers."""
        return self.corrupt or bool(self.unreadable_claims)


@dataclass(frozen=True)
class BookingConflict:
    """One exclusive device that more than one record holds (a damaged or edited checkpoint)."""

    pool: str
    device: str
    claims: tuple[str, ...]                         # UIDs, sorted

    def describe(self) -> str:
        """One printable line: the UIDs and names come from the records, which may be planted."""
        return printable(f"claims {' and '.join(self.claims)} both hold exclusive device {self.device} "
                         f"(pool {self.pool})")


class CheckpointTooNew(RuntimeError):
    """The checkpoint was written by a newer plugin; it is left untouched (see the module docstring)."""


class CheckpointUnusable(RuntimeError):
    """The checkpoint location can be neither read nor set aside (the message says what to fix)."""


class DeviceHeld(Exception):
    """``put`` with ``exclusive``: the device is held by another claim."""

    def __init__(self, pool: str, device: str, holder: ClaimRecord) -> None:
        who = f"{holder.namespace}/{holder.name} ({holder.uid})" if holder.name else f"with UID {holder.uid}"
        super().__init__(f"device {device} is already prepared for claim {who}")
        self.pool, self.device, self.holder, self.who = pool, device, holder, who


JOURNAL_SUFFIX = ".journal"
COMPACT_BYTES = 4 << 20      # fold the journal into the snapshot beyond this size
# Neither file is ever near this (thousands of claims are a few MiB); beyond it a file is damage, not state.
MAX_FILE_BYTES = 256 << 20


@dataclass(frozen=True)
class _Journal:
    """What load found at the journal's name."""

    exists: bool = False                     # something is at the name
    ops: tuple[dict[str, Any], ...] = ()
    journal_id: str = ""
    initial: bool = False
    problem: str = ""                        # why it is damage ("" when it is not)


class CheckpointStore:
    """The checkpoint files and their in-memory copy. A change is durable (fsync'd) before it returns."""

    def __init__(
        self,
        path: Path | str,
        *,
        boot_id_path: Path | str = DEFAULT_BOOT_ID_PATH,
        clock: Callable[[], float] = time.time,
        compact_bytes: int = COMPACT_BYTES,
    ) -> None:
        self.path = Path(path)
        self.journal_path = self.path.with_name(self.path.name + JOURNAL_SUFFIX)
        self.boot_id_path = Path(boot_id_path)
        self._clock = clock
        self._compact_bytes = compact_bytes
        self._lock = threading.Lock()        # memory and journal appends; held for microseconds
        self._sync_lock = threading.Lock()   # one fsync at a time; later writers ride along (group commit)
        self._boot_id = ""
        self._claims: dict[str, ClaimRecord] = {}
        self._holders: dict[tuple[str, str], set[str]] = {}   # (pool, device) -> claims holding it
        self._fd: int | None = None          # the journal, open for appends (None: none in place for us)
        self._journal_id = ""                # the ID of the journal at ``journal_path``
        self._journal_on_disk = False        # whether there is one
        self._appended = 0                   # journal lines appended by this process
        self._synced = 0                     # ... of which fsync'd
        self._journal_bytes = 0
        self._seen: tuple[Any, ...] = ()     # file identities after our last write (see ``refresh``)
        self._loaded = False
        self._volatile: set[str] = set()     # records kept in memory only (see ``put``)
        self._conflicts: tuple[BookingConflict, ...] = ()   # found at load, until resolved or gone

    # ----- load ----------------------------------------------------------------------------------------------
    def load(self) -> LoadResult:
        """Read snapshot and journal and fold them into a new snapshot. A bad file is set aside, never raised;
        raises CheckpointTooNew for a newer plugin's checkpoint and CheckpointUnusable when the location can be
        neither read nor set aside."""
        with self._lock, self._sync_lock:
            self._close_journal()
            self._boot_id = read_boot_id(self.boot_id_path)
            if not self._boot_id:
                log.warning("cannot read boot ID from %s; state from before a reboot will not be detected",
                            self.boot_id_path)
            self._claims, self._holders, self._volatile, self._conflicts = {}, {}, set(), ()
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Names resolved in the directory held open: it cannot be swapped between the reads.
            dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                result, records = self._read_all(dir_fd)
            finally:
                os.close(dir_fd)
            # Never read, only in the way. None is being written: this store's writes wait for its lock, a rolling
            # update's other plugin writes under the call lock a load runs under (a fold at its close does not, and
            # one cut short is what a crash leaves).
            removed = remove_leftover_temp_files(self.path.parent, targets=(self.path.name, self.journal_path.name))
            result = replace(result, temp_files_removed=tuple(removed))
            self._claims = {} if result.dropped_claims else records
            self._conflicts = result.conflicts
            self._loaded = True
            for record in self._claims.values():
                self._index(None, record)
            self._write_snapshot()
            return result

    def _read_all(self, dir_fd: int) -> tuple[LoadResult, dict[str, ClaimRecord]]:
        snapshot, corrupt_file = self._read_snapshot(dir_fd)
        stamped = snapshot is not None and not snapshot.node_boot_id and bool(self._boot_id)
        records: dict[str, ClaimRecord] = {}
        unreadable: list[str] = []
        if snapshot is not None:
            for key in sorted(snapshot.claims):
                record = self._parse_record(snapshot.claims[key], key)
                if record is None:
                    unreadable.append(key)
                else:
                    records[key] = record
        corrupt = corrupt_file is not None or (snapshot is None and self._unreadable_snapshot)
        rebooted = bool(snapshot is not None and snapshot.node_boot_id and self._boot_id
                        and snapshot.node_boot_id != self._boot_id)
        self._journal_id, self._journal_on_disk = "", False
        damage = ""
        if corrupt:
            self._set_aside(self.journal_path, "the snapshot beside it was unreadable", dir_fd)
        else:
            journal = self._read_journal(dir_fd)
            problem = journal.problem or self._mismatch(snapshot, journal)
            if problem and rebooted:
                # The state of an earlier boot is void anyway (dropped below): nothing to be careful about.
                if journal.exists:
                    self._quarantine(self.journal_path, ValueError(problem), required=True)
            elif problem:
                corrupt, corrupt_file = True, self._journal_damaged(problem, journal.exists, snapshot is not None)
                damage = f"checkpoint journal {self.journal_path} {problem}"
                records, unreadable, snapshot = {}, [], None
            elif journal.exists:
                self._journal_id, self._journal_on_disk = journal.journal_id, True
                if snapshot is not None and (not snapshot.journal_id or journal.journal_id == snapshot.journal_id):
                    self._replay(journal.ops, records, unreadable)
                # else: the journal this snapshot already holds (a crash during compaction): nothing to replay
        if rebooted and snapshot is not None:
            dropped = tuple(records[uid] for uid in sorted(records))
            log.warning("node rebooted since checkpoint %s was written (boot ID %s, now %s): dropping %d "
                        "prepared claim(s): %s", self.path, snapshot.node_boot_id, self._boot_id, len(dropped),
                        ", ".join(c.uid for c in dropped) or "none")
            return LoadResult(claims=0, dropped_claims=dropped, unreadable_claims=tuple(unreadable)), records
        return LoadResult(claims=len(records), corrupt_file=corrupt_file, unreadable_claims=tuple(unreadable),
                          boot_id_stamped=stamped, corrupt=corrupt, damage=damage,
                          conflicts=_conflicts(records.values())), records

    def _read_snapshot(self, dir_fd: int) -> tuple[CheckpointFile | None, Path | None]:
        """(snapshot, where a corrupt one was moved). Sets ``_unreadable_snapshot`` when it could not be read."""
        self._unreadable_snapshot = False
        try:
            raw = read_regular_file(self.path.name, MAX_FILE_BYTES, dir_fd=dir_fd)
        except FileNotFoundError:
            return None, None
        except OSError as err:             # a link, FIFO, device or directory in its place, no permission, I/O
            self._unreadable_snapshot = True
            return None, self._quarantine(self.path, err, required=True)
        try:
            data = CheckpointFile.model_validate(json.loads(raw))
        except (ValueError, ValidationError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            self._unreadable_snapshot = True
            return None, self._quarantine(self.path, err, required=True)
        self._refuse_newer(data.schema_version, self.path)
        return data, None

    def _read_journal(self, dir_fd: int) -> _Journal:
        """The journal's header and changes, or what makes it damage."""
        try:
            raw = read_regular_file(self.journal_path.name, MAX_FILE_BYTES, dir_fd=dir_fd)
        except FileNotFoundError:
            return _Journal()
        except OSError as err:
            return _Journal(exists=True, problem=_problem(err))
        if not raw:
            return _Journal(exists=True, problem="is empty (zero bytes; the plugin never leaves a journal "
                                                 "without its header)")
        try:
            ops = tuple(journal_ops(raw, self.journal_path))
        except ValueError as err:
            return _Journal(exists=True, problem=f"is not valid ({err})")
        for op in ops:
            if "schemaVersion" in op:
                self._refuse_newer(op["schemaVersion"], self.journal_path)
        if not ops or "schemaVersion" not in ops[0]:
            return _Journal(exists=True, problem="does not start with its header line (the plugin never "
                                                 "leaves a journal without one)")
        journal_id = ops[0].get("journalId")
        return _Journal(exists=True, ops=ops[1:], journal_id=journal_id if isinstance(journal_id, str) else "",
                        initial=ops[0].get("initial") is True)

    def _mismatch(self, snapshot: CheckpointFile | None, journal: _Journal) -> str:
        """Why a readable snapshot (or none) and journal (or none) are not a state the plugin leaves behind
        (module docstring); "" when they are."""
        if snapshot is None:
            if not journal.exists or (journal.initial and not journal.ops):
                return ""        # nothing yet, or a crash during the very first start
            return f"is there without the snapshot {self.path.name} it continues"
        if not journal.exists and snapshot.schema_version >= FIRST_SCHEMA_WITH_JOURNAL:
            return f"is missing beside the snapshot {self.path.name}"
        if not snapshot.journal_id:
            return ""            # a snapshot from before journal IDs: its journal carries none either
        if journal.journal_id in (snapshot.journal_id, snapshot.folded_journal_id):
            return ""
        return (f"is journal {journal.journal_id or '(without ID)'}, but the snapshot beside it is continued by "
                f"journal {snapshot.journal_id}")

    def _replay(self, ops: Iterable[dict[str, Any]], records: dict[str, ClaimRecord], unreadable: list[str]) -> None:
        """Apply the journal's changes in order."""
        for op in ops:
            if "schemaVersion" in op:
                continue
            if "remove" in op:
                records.pop(op["remove"], None)
                if op["remove"] in unreadable:
                    unreadable.remove(op["remove"])
                continue
            uid = op["put"].get("uid")
            record = self._parse_record(op["put"], uid if isinstance(uid, str) else "?")
            if record is None:
                records.pop(str(uid), None)
                if str(uid) not in unreadable:
                    unreadable.append(str(uid))
            else:
                records[record.uid] = record
                if record.uid in unreadable:
                    unreadable.remove(record.uid)

    def _parse_record(self, raw: Any, key: str) -> ClaimRecord | None:
        try:
            record = ClaimRecord.model_validate(raw)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
            log.error("checkpoint %s: skipping claim %s, its record cannot be read (%s); its devices may "
                      "need manual cleanup", self.path, key, problems)
            return None
        if record.uid != key:
            # Loading it under either UID would give one claim's devices and undo steps to another.
            log.error("checkpoint %s: skipping the record stored under claim %s, it holds claim %s", self.path,
                      key, record.uid)
            return None
        return record

    def _refuse_newer(self, version: int, where: Path) -> None:
        if version > SCHEMA_VERSION:
            raise CheckpointTooNew(
                f"checkpoint {where} has schema version {version}, written by a newer plugin; this plugin "
                f"understands up to {SCHEMA_VERSION} and will not rewrite it (that would drop undo information). "
                "Run the newer plugin again, or unprepare every claim on this node and delete the file")

    def _quarantine(self, path: Path, err: Exception, required: bool = False) -> Path | None:
        if isinstance(err, UnsafeFile):
            reason = err.problem
        else:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        try:
            target = set_aside(path, self._clock())
        except OSError as move_err:
            if required:
                raise CheckpointUnusable(f"checkpoint {path} is unreadable ({reason}) and cannot be moved aside "
                                         f"({move_err}); fix or remove it") from err
            return None
        log.error("checkpoint %s is unreadable (%s); moved it to %s and starting without its records",
                  path, reason, target)
        return target

    def _journal_damaged(self, problem: str, exists: bool, with_snapshot: bool) -> Path | None:
        """Move a damaged journal and the snapshot it continues aside, in one log line: the snapshot alone is
        stale by an unknown number of changes (prepares and unprepares since the last compaction), so its
        records would book devices nobody holds and roll back prepares that completed. Returns where the
        journal (else the snapshot) went."""
        moved: list[str] = []
        target: Path | None = None
        if exists:
            try:
                target = set_aside(self.journal_path, self._clock())
            except OSError as err:
                raise CheckpointUnusable(f"checkpoint journal {self.journal_path} {problem} and cannot be moved "
                                         f"aside ({err}); fix or remove it") from None
            moved.append(f"moved it to {target}")
        if with_snapshot:
            try:
                snapshot = set_aside(self.path, self._clock())
                target = target or snapshot
                moved.append(f"moved the snapshot to {snapshot}")
            except OSError as err:
                moved.append(f"could not move the snapshot aside ({err.strerror or err})")
        log.error("checkpoint journal %s %s; %s; starting as after a lost checkpoint (prepared claims are adopted "
                  "from their CDI specs, nothing is destroyed)", self.journal_path, problem,
                  " and ".join(moved) or "nothing to move aside")
        return target

    def _set_aside(self, path: Path, why: str, dir_fd: int) -> None:
        """Move a journal away whose snapshot was lost: its changes alone are not the state. One that holds no
        change (a clean stop folds the journal in) is simply removed."""
        try:
            empty = all("schemaVersion" in op
                        for op in journal_ops(read_regular_file(path.name, MAX_FILE_BYTES, dir_fd=dir_fd), path))
        except FileNotFoundError:
            return
        except (OSError, ValueError):          # also a link, FIFO or device in its place: moved, not read
            empty = False
        if empty:
            path.unlink(missing_ok=True)
        else:
            self._quarantine(path, ValueError(why), required=True)

    # ----- reads ---------------------------------------------------------------------------------------------
    @property
    def boot_id(self) -> str:
        return self._boot_id

    def get(self, claim_uid: str) -> ClaimRecord | None:
        return self._claims.get(claim_uid)

    def claims(self) -> dict[str, ClaimRecord]:
        """A snapshot (records are immutable)."""
        return dict(self._claims)

    def holders(self, pool: str, device: str) -> set[str]:
        """Claims that hold a device (admin-access watchers do not hold)."""
        return set(self._holders.get((pool, device), ()))

    def conflicts(self) -> tuple[BookingConflict, ...]:
        """The double bookings found at load that still stand (more than one of their records still holds the
        device)."""
        with self._lock:
            standing = _conflicts(self._claims[uid] for c in self._conflicts for uid in c.claims
                                  if uid in self._claims)
            keys = {(c.pool, c.device) for c in self._conflicts}
            return tuple(c for c in standing if (c.pool, c.device) in keys)

    def conflict_of(self, claim_uid: str) -> BookingConflict | None:
        """A standing double booking that involves ``claim_uid``, or None."""
        if not self._conflicts:
            return None
        return next((c for c in self.conflicts() if claim_uid in c.claims), None)

    def resolve(self, conflict: BookingConflict, keeper: str) -> None:
        """``keeper`` keeps the device; every other record of the conflict loses its booking of it and any MIG
        device made for it (so unpreparing that claim leaves them alone). Durable, like every change."""
        for uid in conflict.claims:
            if uid != keeper and uid in self._claims:
                self.update(uid, lambda r: r.without_device(conflict.pool, conflict.device))

    # ----- writes --------------------------------------------------------------------------------------------
    def put(self, record: ClaimRecord, *, exclusive: Iterable[tuple[str, str]] = (),
            durable: bool = True) -> ClaimRecord:
        """Insert or replace a claim's record durably. Returns the stored record (timestamped).

        ``exclusive``: (pool, device) pairs the claim must hold alone; DeviceHeld if another claim holds one,
        checked in the same step as the insert. ``durable=False`` keeps the record in memory only (it books
        the devices, but a crash forgets it): for a prepare that changes nothing a restart must undo; its next
        change or ``put`` writes it."""
        with self._lock:
            self._require_loaded()
            for pool, device in exclusive:
                others = self._holders.get((pool, device), set()) - {record.uid}
                if others:
                    raise DeviceHeld(pool, device, self._claims[min(others)])
            stored = record.model_copy(update={"updated": self._clock()})
            if not durable:
                self._apply(record.uid, self._claims.get(record.uid), stored)
                self._volatile.add(record.uid)
                return stored
            return self._change(record.uid, stored, {"put": stored.model_dump(mode="json", by_alias=True)})

    def update(self, claim_uid: str, change: Callable[[ClaimRecord], ClaimRecord]) -> ClaimRecord:
        """Read-modify-write one claim atomically with respect to other threads."""
        with self._lock:
            self._require_loaded()
            current = self._claims.get(claim_uid)
            if current is None:
                raise KeyError(f"claim {claim_uid} is not in the checkpoint")
            stored = change(current).model_copy(update={"updated": self._clock()})
            return self._change(claim_uid, stored, {"put": stored.model_dump(mode="json", by_alias=True)})

    def remove(self, claim_uid: str) -> bool:
        """Forget a claim; an unknown claim is fine. Returns whether it was present."""
        with self._lock:
            self._require_loaded()
            if claim_uid not in self._claims:
                return False
            if claim_uid in self._volatile:    # never written: nothing to remove on disk
                self._volatile.discard(claim_uid)
                self._apply(claim_uid, self._claims[claim_uid], None)
                return True
            self._change(claim_uid, None, {"remove": claim_uid})
            return True

    def _change(self, uid: str, new: _Stored, op: dict[str, Any]) -> _Stored:
        """Append ``op``, apply it to memory, and return ``new`` once it is durable. Called under ``_lock``,
        which it releases for the fsync and takes back, so other claims append meanwhile."""
        previous = self._claims.get(uid)
        seq = self._append(op)                 # raises before memory changes
        self._apply(uid, previous, new)
        was_volatile = uid in self._volatile
        self._volatile.discard(uid)
        self._lock.release()
        try:
            self._sync(seq)
        except BaseException:
            self._lock.acquire()
            if self._claims.get(uid) is new:   # undo in memory, and on disk as far as it goes
                self._apply(uid, new, previous)
                if was_volatile:
                    self._volatile.add(uid)
                try:
                    self._append({"put": previous.model_dump(mode="json", by_alias=True)}
                                 if previous is not None and not was_volatile else {"remove": uid})
                except OSError:
                    pass
            raise
        self._lock.acquire()             # the caller's ``with`` releases it
        if self._journal_bytes > self._compact_bytes:
            self._compact_locked()
        return new

    def _apply(self, uid: str, old: ClaimRecord | None, new: ClaimRecord | None) -> None:
        if new is None:
            self._claims.pop(uid, None)
        else:
            self._claims[uid] = new
        self._index(old, new)

    def _index(self, old: ClaimRecord | None, new: ClaimRecord | None) -> None:
        for record, add in ((old, False), (new, True)):
            if record is None:
                continue
            for d in record.devices:
                if d.admin_access:
                    continue
                key = (d.pool, d.device)
                if add:
                    self._holders.setdefault(key, set()).add(record.uid)
                else:
                    holders = self._holders.get(key, set())
                    holders.discard(record.uid)
                    if not holders:
                        self._holders.pop(key, None)

    def _append(self, op: dict[str, Any]) -> int:
        line = json.dumps(op, separators=(",", ":")).encode() + b"\n"
        fd = self._current_journal()
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view):]
        self._appended += 1
        self._journal_bytes += len(line)
        return self._appended

    def _current_journal(self) -> int:
        """The descriptor of the journal now at ``journal_path``. Another process (a rolling update's other
        plugin) may have put a new one in place since our last write: appends then go to that one, as they
        would to a journal both had open."""
        if self._fd is not None:
            mine = os.fstat(self._fd)
            try:
                there = os.stat(self.journal_path, follow_symlinks=False)
            except FileNotFoundError:
                there = None
            if there is not None and (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                return self._fd
            if there is not None:
                self._take_journal_in_place()
                assert self._fd is not None
                return self._fd
        # None in place, the store was closed, or a compaction failed after the snapshot may have named a new
        # journal: fold again, so the change lands in the journal the snapshot names.
        with self._sync_lock:
            self._write_snapshot()
        assert self._fd is not None
        return self._fd

    def _take_journal_in_place(self) -> None:
        fd = open_regular(self.journal_path, os.O_RDWR | os.O_APPEND)
        try:
            first = os.pread(fd, 4096, 0).split(b"\n", 1)
            try:
                header = next(iter(journal_ops(first[0] + b"\n", self.journal_path)), {}) if len(first) == 2 else {}
            except ValueError:
                header = {}
            journal_id = header.get("journalId")
            if "schemaVersion" not in header or not isinstance(journal_id, str):
                raise OSError(f"checkpoint journal {self.journal_path} was replaced by one without a header")
            self._refuse_newer(header["schemaVersion"], self.journal_path)
        except BaseException:
            os.close(fd)
            raise
        self._close_journal()
        self._fd, self._journal_id, self._journal_on_disk = fd, journal_id, True
        self._journal_bytes = os.fstat(fd).st_size

    def _sync(self, seq: int) -> None:
        with self._sync_lock:
            if self._synced >= seq:
                return                      # another writer's fsync covered this append
            target = self._appended
            if self._fd is None:
                raise OSError(f"checkpoint journal {self.journal_path} was closed before the change was synced")
            if not self._boot_id:              # see the module docstring: durable only where a reboot is unknown
                os.fsync(self._fd)
            self._synced = target
            self._seen = self._identity()

    def _close_journal(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _require_loaded(self) -> None:
        if not self._loaded:
            raise RuntimeError(f"checkpoint {self.path}: call load() before changing it")

    # ----- snapshot ------------------------------------------------------------------------------------------
    def compact(self) -> None:
        """Fold the journal into the snapshot now (also done at load, at close and when the journal is large)."""
        with self._lock:
            self._compact_locked()

    def _compact_locked(self) -> None:
        with self._sync_lock:
            self._write_snapshot()

    def _write_snapshot(self) -> None:
        """Write every record as the new snapshot, continued by a new empty journal: the journal complete under
        a temporary name, the snapshot naming it, then the journal renamed into place (module docstring: what
        each crash in between leaves, and why the next load recognises it)."""
        check_owned_dir(self.path.parent)
        if not self._journal_on_disk:
            # Before the first snapshot: a journal it can name as folded, so no snapshot is ever without one.
            initial_id = secrets.token_hex(8)
            self._put_journal_in_place(initial_id, *self._new_journal_file(initial_id, initial=True))
        journal_id = secrets.token_hex(8)
        fd, tmp_name, size = self._new_journal_file(journal_id)
        doc = {
            "schemaVersion": SCHEMA_VERSION,
            "nodeBootId": self._boot_id,
            "journalId": journal_id,
            "foldedJournalId": self._journal_id,
            "claims": {uid: self._claims[uid].model_dump(mode="json", by_alias=True) for uid in sorted(self._claims)
                       if uid not in self._volatile},
        }
        try:
            write_regular_file(self.path, json.dumps(doc, indent=1).encode() + b"\n", mode=0o600)
        except BaseException:
            _discard(fd, tmp_name)
            raise
        # From here appends to the old journal would be skipped by the next load: none may go there.
        self._close_journal()
        self._put_journal_in_place(journal_id, fd, tmp_name, size)
        self._synced = self._appended
        self._seen = self._identity()

    def _new_journal_file(self, journal_id: str, initial: bool = False) -> tuple[int, str, int]:
        """A journal holding only its header, fsync'd, under a new temporary name (O_EXCL|O_NOFOLLOW):
        (descriptor open for appends, name, size)."""
        header: dict[str, Any] = {"schemaVersion": SCHEMA_VERSION, "journalId": journal_id}
        if initial:
            header["initial"] = True
        data = json.dumps(header).encode() + b"\n"
        fd, tmp_name = tempfile.mkstemp(prefix=temp_prefix(self.journal_path), suffix=TEMP_SUFFIX,
                                        dir=self.path.parent)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        except BaseException:
            _discard(fd, tmp_name)
            raise
        return fd, tmp_name, len(data)

    def _put_journal_in_place(self, journal_id: str, fd: int, tmp_name: str, size: int) -> None:
        try:
            os.replace(tmp_name, self.journal_path)
        except BaseException:
            _discard(fd, tmp_name)
            raise
        fsync_dir(self.path.parent)
        self._close_journal()
        self._fd, self._journal_bytes = fd, size
        self._journal_id, self._journal_on_disk = journal_id, True

    def _identity(self) -> tuple[Any, ...]:
        """What the files look like after our own last write: another process's write changes it."""
        out: list[Any] = []
        for p in (self.path, self.journal_path):
            try:
                st = os.stat(p, follow_symlinks=False)
            except OSError:
                out.append(None)
                continue
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def refresh(self) -> bool:
        """Re-read the files if another process (a rolling update's other plugin) changed them since our last
        write. Returns whether it did."""
        with self._lock:
            if self._identity() == self._seen:
                return False
        self.load()
        return True

    def close(self) -> None:
        """Fold the journal into the snapshot (so a plugin that reads only the snapshot misses nothing) and
        release the file."""
        with self._lock:
            if self._fd is not None:
                try:
                    self._compact_locked()
                except OSError as err:
                    log.warning("checkpoint %s: could not fold the journal in at close (%s); the next start "
                                "replays it", self.path, err)
                self._close_journal()


def _conflicts(records: Iterable[ClaimRecord]) -> tuple[BookingConflict, ...]:
    holders: dict[tuple[str, str], set[str]] = {}
    for record in records:
        for key in record.exclusive_devices():
            holders.setdefault(key, set()).add(record.uid)
    return tuple(BookingConflict(pool, device, tuple(sorted(uids)))
                 for (pool, device), uids in sorted(holders.items()) if len(uids) > 1)


def _problem(err: OSError) -> str:
    """What is wrong with a file that could not be read, for a log line that names it already."""
    if isinstance(err, UnsafeFile):
        return err.problem
    return f"cannot be read ({err.strerror or err})"


def _discard(fd: int, tmp_name: str) -> None:
    os.close(fd)
    try:
        os.unlink(tmp_name)
    except FileNotFoundError:
        pass


def journal_ops(raw: bytes, where: Path | str = "journal") -> Iterator[dict[str, Any]]:
    """The changes of a journal, in order: ``{"schemaVersion": n}``, ``{"put": record}`` or ``{"remove": uid}``.
    Text after the last newline is an append a crash cut short: it is skipped (with a warning). A line that
    is not one of these raises ValueError naming it."""
    lines = raw.split(b"\n")
    torn = lines.pop() if lines else b""
    if torn.strip():
        log.warning("checkpoint journal %s ends in a partly written change (a crash during a write); the "
                    "change never completed and is ignored", where)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            op = json.loads(line)
        except (ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"line {number}: {err}") from None
        if not isinstance(op, dict):
            raise ValueError(f"line {number}: not a JSON object")
        if "schemaVersion" in op and isinstance(op["schemaVersion"], int):
            yield op
        elif isinstance(op.get("remove"), str) or isinstance(op.get("put"), dict):
            yield op
        else:
            raise ValueError(f"line {number}: neither put, remove nor a schema version")


def read_checkpoint(path: Path | str) -> dict[str, dict[str, Any]]:
    """The records on disk now, as raw camelCase dicts by claim UID: the snapshot with its journal replayed,
    read without changing anything (for diagnostics and tests; a running plugin may write meanwhile, so a
    snapshot replaced during the read is read again)."""
    snapshot = Path(path)
    journal = snapshot.with_name(snapshot.name + JOURNAL_SUFFIX)
    for _ in range(5):
        try:
            before = os.stat(snapshot, follow_symlinks=False).st_ino
            claims = dict(json.loads(read_regular_file(snapshot, MAX_FILE_BYTES)).get("claims") or {})
        except FileNotFoundError:
            before, claims = None, {}
        try:
            raw = read_regular_file(journal, MAX_FILE_BYTES)
        except FileNotFoundError:
            raw = b""
        for op in journal_ops(raw, journal):
            if "remove" in op:
                claims.pop(op["remove"], None)
            elif "put" in op:
                claims[str(op["put"].get("uid"))] = op["put"]
        try:
            after = os.stat(snapshot, follow_symlinks=False).st_ino
        except FileNotFoundError:
            after = None
        if before == after:
            return claims
    return claims
