"""The plugin's crash-safe record of prepared claims.

Prepare is not a pure function of the claim: it creates MIG devices, starts MPS daemons and changes GPU
settings. Everything needed to answer a repeated Prepare identically, and to undo a claim later (also after a
crash halfway through), is stored here:

* ``PrepareStarted`` is written *before* any side effect, with the undo information filled in as actions
  complete, so a crash leaves enough to roll back; ``PrepareCompleted`` holds the result returned to the kubelet.
* The file is versioned (``schemaVersion``), written atomically, and read tolerantly: unknown fields (from a
  newer plugin) are ignored, so an upgrade or downgrade never turns into a crash loop. A file that cannot be read
  at all is moved aside as ``<name>.corrupt-<timestamp>`` with one log line and the store starts empty;
  ``LoadResult.state_lost`` tells the caller that prepared claims may exist that it no longer knows (the driver
  then destroys nothing at that start and adopts claims from their CDI specs).
* The node boot ID is stored: after a reboot, MIG devices, MPS daemons, time-slice settings and the CDI files
  under /var/run are gone, so state from an earlier boot is dropped and the caller is told which claims.

All methods are thread-safe; prepares of different claims run in parallel.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from dra.node.atomicfile import write_atomic
from dra.node.bootid import DEFAULT_BOOT_ID_PATH, read_boot_id

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

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


class MpsUndo(_Record):
    """An MPS control daemon this claim runs."""

    daemon_id: str
    gpu_uuids: tuple[str, ...]               # CUDA_VISIBLE_DEVICES of the daemon (GPU or MIG UUIDs)
    pipe_dir: str
    log_dir: str
    shm_dir: str | None = None
    compute_mode_set: tuple[str, ...] = ()   # whole GPUs switched to EXCLUSIVE_PROCESS for it
    active_thread_percentage: int | None = None
    pinned_memory_limit_mib: dict[str, int] = Field(default_factory=dict)


class UndoInfo(_Record):
    mig_devices: tuple[MigUndo, ...] = ()
    time_slices: tuple[TimeSliceUndo, ...] = ()
    mps_daemons: tuple[MpsUndo, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.mig_devices or self.time_slices or self.mps_daemons)


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


class CheckpointStore:
    """The checkpoint file and its in-memory copy. Every change is written through before it returns."""

    def __init__(
        self,
        path: Path | str,
        *,
        boot_id_path: Path | str = DEFAULT_BOOT_ID_PATH,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.boot_id_path = Path(boot_id_path)
        self._clock = clock
        self._lock = threading.RLock()
        self._boot_id = ""
        self._claims: dict[str, ClaimRecord] = {}
        self._loaded = False

    # ----- load ----------------------------------------------------------------------------------------------
    def load(self) -> LoadResult:
        """Read the file (once at start-up). Never raises for a bad file: it is set aside instead."""
        with self._lock:
            self._boot_id = read_boot_id(self.boot_id_path)
            if not self._boot_id:
                log.warning("cannot read boot ID from %s; state from before a reboot will not be detected",
                            self.boot_id_path)
            self._claims = {}
            self._loaded = True
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                self._write()
                return LoadResult(claims=0)
            try:
                data = CheckpointFile.model_validate(json.loads(raw))
            except (ValueError, ValidationError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                moved = self._quarantine(err)
                self._write()
                return LoadResult(claims=0, corrupt_file=moved, corrupt=True)
            if data.schema_version > SCHEMA_VERSION:
                log.info("checkpoint %s has schema version %d (this plugin writes %d); reading known fields only",
                         self.path, data.schema_version, SCHEMA_VERSION)
            records, unreadable = self._parse_claims(data.claims)
            if data.node_boot_id and self._boot_id and data.node_boot_id != self._boot_id:
                dropped = tuple(records[uid] for uid in sorted(records))
                log.warning("node rebooted since checkpoint %s was written (boot ID %s, now %s): dropping %d "
                            "prepared claim(s): %s", self.path, data.node_boot_id, self._boot_id, len(dropped),
                            ", ".join(c.uid for c in dropped) or "none")
                self._write()
                return LoadResult(claims=0, dropped_claims=dropped, unreadable_claims=unreadable)
            self._claims = records
            stamped = not data.node_boot_id and bool(self._boot_id)
            if stamped or unreadable or data.schema_version != SCHEMA_VERSION:
                self._write()  # stamp the boot ID (legacy file) / rewrite in this version's schema
            return LoadResult(claims=len(self._claims), boot_id_stamped=stamped, unreadable_claims=unreadable)

    def _parse_claims(self, raw: dict[str, dict[str, Any]]) -> tuple[dict[str, ClaimRecord], tuple[str, ...]]:
        records: dict[str, ClaimRecord] = {}
        unreadable: list[str] = []
        for key in sorted(raw):
            try:
                record = ClaimRecord.model_validate(raw[key])
            except ValidationError as err:
                problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
                log.error("checkpoint %s: skipping claim %s, its record cannot be read (%s); its devices may "
                          "need manual cleanup", self.path, key, problems)
                unreadable.append(key)
                continue
            records[record.uid] = record
        return records, tuple(unreadable)

    def _quarantine(self, err: Exception) -> Path | None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self._clock()))
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        try:
            self.path.rename(target)
        except OSError as move_err:
            log.error("checkpoint %s is unreadable (%s) and could not be moved aside (%s); starting without "
                      "its records", self.path, reason, move_err)
            return None
        log.error("checkpoint %s is unreadable (%s); moved it to %s and starting without its records",
                  self.path, reason, target)
        return target

    # ----- reads ---------------------------------------------------------------------------------------------
    @property
    def boot_id(self) -> str:
        return self._boot_id

    def get(self, claim_uid: str) -> ClaimRecord | None:
        with self._lock:
            return self._claims.get(claim_uid)

    def claims(self) -> dict[str, ClaimRecord]:
        """A snapshot (records are immutable)."""
        with self._lock:
            return dict(self._claims)

    # ----- writes --------------------------------------------------------------------------------------------
    def put(self, record: ClaimRecord) -> ClaimRecord:
        """Insert or replace a claim's record and persist it. Returns the stored record (timestamped)."""
        with self._lock:
            self._require_loaded()
            stored = record.model_copy(update={"updated": self._clock()})
            previous = self._claims.get(record.uid)
            self._claims[record.uid] = stored
            try:
                self._write()
            except BaseException:
                # Keep memory equal to disk: a failed write must not look like a success later.
                if previous is None:
                    del self._claims[record.uid]
                else:
                    self._claims[record.uid] = previous
                raise
            return stored

    def update(self, claim_uid: str, change: Callable[[ClaimRecord], ClaimRecord]) -> ClaimRecord:
        """Read-modify-write one claim atomically with respect to other threads."""
        with self._lock:
            current = self._claims.get(claim_uid)
            if current is None:
                raise KeyError(f"claim {claim_uid} is not in the checkpoint")
            return self.put(change(current))

    def remove(self, claim_uid: str) -> bool:
        """Forget a claim; an unknown claim is fine. Returns whether it was present."""
        with self._lock:
            self._require_loaded()
            previous = self._claims.pop(claim_uid, None)
            if previous is None:
                return False
            try:
                self._write()
            except BaseException:
                self._claims[claim_uid] = previous
                raise
            return True

    def _require_loaded(self) -> None:
        if not self._loaded:
            raise RuntimeError(f"checkpoint {self.path}: call load() before changing it")

    def _write(self) -> None:
        doc = {
            "schemaVersion": SCHEMA_VERSION,
            "nodeBootId": self._boot_id,
            "claims": {uid: self._claims[uid].model_dump(mode="json", by_alias=True) for uid in sorted(self._claims)},
        }
        data = json.dumps(doc, indent=2).encode() + b"\n"
        write_atomic(self.path, data, mode=0o600)
