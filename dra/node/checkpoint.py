"""The plugin's crash-safe record of prepared claims.

Prepare is not a pure function of the claim: it creates MIG devices, starts MPS daemons and changes GPU
settings. Everything needed to answer a repeated Prepare identically, and to undo a claim later (also after a
crash halfway through), is stored here:

* ``PrepareStarted`` is written *before* any side effect on the hardware, with the undo information filled in
  as actions complete, so a crash leaves enough to roll back; ``PrepareCompleted`` holds the result returned to
  the kubelet.
* On disk: a snapshot (``checkpoint.json``: schema version, node boot ID, every record) and a journal beside it
  (``checkpoint.json.journal``: one JSON line per change, appended and fsync'd before the change counts). A
  change costs one small append, not a rewrite of every record, and appends of different claims share their
  fsyncs (group commit), so claims never wait for each other's writes. Replaying the journal over the snapshot
  is idempotent; a torn last line (a crash during the append) is a change that never returned, and is ignored.
  The journal is folded into the snapshot (written atomically) at start-up, at close and when it grows large.
* Reads (``get``, ``claims``, ``holders``) never wait for a write.
* Read tolerantly: unknown fields are ignored. A snapshot or journal that cannot be read at all (bad JSON, bad
  shape, a directory in its place, no permission) is moved aside as ``<name>.corrupt-<timestamp>`` with one
  log line and the store starts without it; a record stored under a key that is not the UID it holds is
  skipped as unreadable. ``LoadResult.state_lost`` then tells the caller that prepared claims may exist that it
  no longer knows (the driver destroys nothing at that start and adopts claims from their CDI specs).
* A checkpoint written by a newer plugin (a higher ``schemaVersion``) is never rewritten: ``load`` raises
  ``CheckpointTooNew`` and the plugin refuses to start, because dropping the newer fields would lose undo
  information.
* The node boot ID is stored: after a reboot, MIG devices, MPS daemons, time-slice settings and the CDI files
  under /var/run are gone, so state from an earlier boot is dropped and the caller is told which claims.
* Devices are booked here: ``put`` with ``exclusive`` refuses a device another claim holds, in the same step
  that records the claim, so two claims can never both be told they hold one device.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from dra.node.atomicfile import set_aside, write_atomic
from dra.node.bootid import DEFAULT_BOOT_ID_PATH, read_boot_id

log = logging.getLogger(__name__)

# 2: the journal beside the snapshot (a plugin that reads only the snapshot would miss its changes).
SCHEMA_VERSION = 2

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


class TimeSliceUndo(_Record):
    """A time-slice interval this claim set on whole GPUs; restore ``previous`` on unprepare."""

    gpu_uuids: tuple[str, ...]
    interval: str                            # Default | Short | Medium | Long
    previous: str = "Default"


class MpsUse(_Record):
    """This claim's clients use the MPS daemon serving ``device``; the daemon goes when no claim uses it."""

    device: str                              # GPU or MIG UUID the daemon serves
    gpu: str                                 # its physical GPU (locked while the daemon starts or stops)


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
    updated: float = 0.0                     # unix time of the last write of this record
    # Rebuilt from the claim's CDI spec after the checkpoint was lost: request names, namespace and name are
    # unknown until the claim is prepared again (kubeletplugin.recovery).
    recovered: bool = False

    @property
    def completed(self) -> bool:
        return self.state == PREPARE_COMPLETED


class CheckpointFile(_Record):
    schema_version: int
    node_boot_id: str = ""
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

    @property
    def state_lost(self) -> bool:
        """Claims prepared on this node may be missing from the checkpoint: their MIG devices and CDI specs
        must not be mistaken for leftovers."""
        return self.corrupt or bool(self.unreadable_claims)


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
        self._fd: int | None = None
        self._appended = 0                   # journal lines appended by this process
        self._synced = 0                     # ... of which fsync'd
        self._journal_bytes = 0
        self._seen: tuple[Any, ...] = ()     # file identities after our last write (see ``refresh``)
        self._loaded = False
        self._volatile: set[str] = set()     # records kept in memory only (see ``put``)

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
            self._claims, self._holders, self._volatile = {}, {}, set()
            result, records = self._read_all()
            self._claims = {} if result.dropped_claims else records
            self._loaded = True
            for record in self._claims.values():
                self._index(None, record)
            self._write_snapshot()
            return result

    def _read_all(self) -> tuple[LoadResult, dict[str, ClaimRecord]]:
        snapshot, corrupt_file = self._read_snapshot()
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
        if corrupt:
            self._set_aside(self.journal_path, "the snapshot beside it was unreadable")
        else:
            journal_moved = self._replay_journal(records, unreadable)
            if journal_moved is not None:
                corrupt, corrupt_file = True, journal_moved
        if snapshot is not None and snapshot.node_boot_id and self._boot_id and snapshot.node_boot_id != self._boot_id:
            dropped = tuple(records[uid] for uid in sorted(records))
            log.warning("node rebooted since checkpoint %s was written (boot ID %s, now %s): dropping %d "
                        "prepared claim(s): %s", self.path, snapshot.node_boot_id, self._boot_id, len(dropped),
                        ", ".join(c.uid for c in dropped) or "none")
            return LoadResult(claims=0, dropped_claims=dropped, unreadable_claims=tuple(unreadable)), records
        return LoadResult(claims=len(records), corrupt_file=corrupt_file, unreadable_claims=tuple(unreadable),
                          boot_id_stamped=stamped, corrupt=corrupt), records

    def _read_snapshot(self) -> tuple[CheckpointFile | None, Path | None]:
        """(snapshot, where a corrupt one was moved). Sets ``_unreadable_snapshot`` when it could not be read."""
        self._unreadable_snapshot = False
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None, None
        except OSError as err:             # a directory in its place, no permission, I/O error
            self._unreadable_snapshot = True
            return None, self._quarantine(self.path, err, required=True)
        try:
            data = CheckpointFile.model_validate(json.loads(raw))
        except (ValueError, ValidationError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            self._unreadable_snapshot = True
            return None, self._quarantine(self.path, err, required=True)
        self._refuse_newer(data.schema_version, self.path)
        return data, None

    def _replay_journal(self, records: dict[str, ClaimRecord], unreadable: list[str]) -> Path | None:
        """Apply the journal's changes in order. Returns where a corrupt journal was moved, else None."""
        try:
            raw = self.journal_path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            return self._quarantine(self.journal_path, err, required=True)
        try:
            ops = list(journal_ops(raw, self.journal_path))
        except ValueError as err:
            return self._quarantine(self.journal_path, err, required=True)
        for op in ops:
            if "schemaVersion" in op:
                self._refuse_newer(op["schemaVersion"], self.journal_path)
            elif "remove" in op:
                records.pop(op["remove"], None)
                if op["remove"] in unreadable:
                    unreadable.remove(op["remove"])
            else:
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
        return None

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

    def _set_aside(self, path: Path, why: str) -> None:
        """Move a journal away whose snapshot was lost: its changes alone are not the state. One that holds no
        change (a clean stop folds the journal in) is simply removed."""
        try:
            empty = all("schemaVersion" in op for op in journal_ops(path.read_bytes(), path))
        except FileNotFoundError:
            return
        except (OSError, ValueError):
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

    def _change(self, uid: str, new: ClaimRecord | None, op: dict[str, Any]) -> Any:
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
        fd = self._journal_fd()
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view):]
        self._appended += 1
        self._journal_bytes += len(line)
        return self._appended

    def _sync(self, seq: int) -> None:
        with self._sync_lock:
            if self._synced >= seq:
                return                      # another writer's fsync covered this append
            target = self._appended
            os.fsync(self._journal_fd())
            self._synced = target
            self._seen = self._identity()

    def _journal_fd(self) -> int:
        if self._fd is None:
            self.journal_path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return self._fd

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
        """Write every record as the new snapshot, then start an empty journal. A crash in between replays the
        old journal over the new snapshot, which changes nothing (the journal is idempotent)."""
        doc = {
            "schemaVersion": SCHEMA_VERSION,
            "nodeBootId": self._boot_id,
            "claims": {uid: self._claims[uid].model_dump(mode="json", by_alias=True) for uid in sorted(self._claims)
                       if uid not in self._volatile},
        }
        write_atomic(self.path, json.dumps(doc, indent=1).encode() + b"\n", mode=0o600)
        fd = self._journal_fd()
        os.ftruncate(fd, 0)
        header = json.dumps({"schemaVersion": SCHEMA_VERSION}).encode() + b"\n"
        os.write(fd, header)
        os.fsync(fd)
        self._journal_bytes = len(header)
        self._synced = self._appended
        self._seen = self._identity()

    def _identity(self) -> tuple[Any, ...]:
        """What the files look like after our own last write: another process's write changes it."""
        out: list[Any] = []
        for p in (self.path, self.journal_path):
            try:
                st = p.stat()
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
            before = snapshot.stat().st_ino
            claims = dict(json.loads(snapshot.read_bytes()).get("claims") or {})
        except FileNotFoundError:
            before, claims = None, {}
        try:
            raw = journal.read_bytes()
        except FileNotFoundError:
            raw = b""
        for op in journal_ops(raw, journal):
            if "remove" in op:
                claims.pop(op["remove"], None)
            elif "put" in op:
                claims[str(op["put"].get("uid"))] = op["put"]
        try:
            after = snapshot.stat().st_ino
        except FileNotFoundError:
            after = None
        if before == after:
            return claims
    return claims
