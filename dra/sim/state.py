"""Persistent state of simulated GPUs: what would survive a plugin restart on real hardware.

A simulated node's GPUs live inside ``FakeNvml``. Real GPUs keep their MIG mode, GPU and compute instances,
compute mode and fallen-off-the-bus state when the process that changed them exits; with a state file the
simulated ones do too. ``SimulatedHardwareState`` owns that file:

* one JSON document (``schemaVersion``, then one entry per GPU by UUID), written with ``write_atomic`` so a
  reader never sees half of it;
* a cross-process lock (``fcntl.flock`` on ``<file>.lock``): every simulated NVML call holds it, so two
  processes over the same file (a plugin and a test reading the hardware, or two plugin processes during a
  rolling update) never interleave, and each call starts from the other's latest write;
* change detection by the file's identity (inode, size, mtime), so an unchanged file is not re-read.

Fault injection from outside the plugin (``gpu-dra simulate``) goes through the same file: a lost GPU is
state (``lost``); XIDs and operator recoveries are appended to a short event log (``events``, numbered by
``eventSerial``, the newest ``MAX_EVENTS`` kept). Every simulator over the file delivers the events numbered
after the ones it has seen, as new NVML events, to its own event sets; events from before it started are
history, as on hardware. Event sets and events not yet delivered stay in the process.
"""
from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from dra.node.atomicfile import write_atomic

SCHEMA_VERSION = 1
MAX_EVENTS = 256                 # events kept in the file; a simulator that falls further behind misses some
EVENT_XID = "xid"
EVENT_RECOVER = "recover"        # an operator confirmed the GPU healthy again (clears its health taints)
MAX_XID = 0xFFFF


class SimulatedStateError(ValueError):
    """A simulated-GPU state file that cannot be used; the message names the file and the problem."""


class _Doc(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True,
                              extra="forbid", strict=True, frozen=True)


class ComputeInstanceState(_Doc):
    id: int = Field(ge=0)
    profile_index: int = Field(ge=0)        # NVML_COMPUTE_INSTANCE_PROFILE_* index
    slices: int = Field(ge=1)
    start: int = Field(ge=0)
    uuid: str = Field(pattern=r"^MIG-")


class GpuInstanceState(_Doc):
    id: int = Field(ge=0)
    profile_id: int = Field(ge=0)           # GPU-instance profile id (nvmlGpuInstanceGetInfo().profileId)
    start: int = Field(ge=0)
    compute_instances: tuple[ComputeInstanceState, ...] = ()


class GpuState(_Doc):
    uuid: str
    model: str                              # catalog model name: guards against a changed fleet file
    mig_current: int = Field(ge=0, le=1)
    mig_pending: int = Field(ge=0, le=1)
    compute_mode: int = Field(ge=0)
    lost: str | None = None
    mig_serial: int = Field(default=0, ge=0)   # keeps new MIG UUIDs unique across restarts
    gpu_instances: tuple[GpuInstanceState, ...] = ()


class SimulatedEvent(_Doc):
    """One injected event: an XID (optionally naming a GPU/compute instance) or a recovery."""

    seq: int = Field(ge=1)
    gpu_uuid: str
    kind: Literal["xid", "recover"]
    xid: int | None = Field(default=None, ge=1, le=MAX_XID)
    gpu_instance_id: int | None = Field(default=None, ge=0)
    compute_instance_id: int | None = Field(default=None, ge=0)


class HardwareDoc(_Doc):
    schema_version: int
    gpus: tuple[GpuState, ...]
    event_serial: int = Field(default=0, ge=0)         # number of the newest event ever recorded
    events: tuple[SimulatedEvent, ...] = ()            # the newest MAX_EVENTS events, oldest first

    def with_event(self, gpu_uuid: str, kind: str, **fields: int | None) -> HardwareDoc:
        """This document with one more event (numbered ``event_serial + 1``), older ones trimmed."""
        event = SimulatedEvent(seq=self.event_serial + 1, gpu_uuid=gpu_uuid, kind=kind, **fields)  # type: ignore[arg-type]
        return self.model_copy(update={"event_serial": event.seq,
                                       "events": (*self.events, event)[-MAX_EVENTS:]})

    def with_gpu(self, gpu: GpuState) -> HardwareDoc:
        return self.model_copy(update={"gpus": tuple(gpu if g.uuid == gpu.uuid else g for g in self.gpus)})


def _field_path(loc: tuple[object, ...]) -> str:
    out = ""
    for item in loc:
        out += f"[{item}]" if isinstance(item, int) else (("." if out else "") + str(item))
    return out


class SimulatedHardwareState:
    """The state file of one simulated node's GPUs and its cross-process lock.

    ``locked()`` nests for its holder; threads of one process must take turns through a lock of their own (as
    FakeNvml's calls do). ``read()`` and ``write()`` are meant to be called while it is held.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._fd: int | None = None
        self._depth = 0
        self._seen: tuple[int, int, int] | None = None    # identity of the file we last read or wrote
        self._guard = threading.Lock()

    def __repr__(self) -> str:
        return f"SimulatedHardwareState({str(self.path)!r})"

    # ----- lock ------------------------------------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the file lock (exclusive) against other processes; re-entrant for the holder. The lock file is
        open only while held, so an object that is dropped leaks no descriptor."""
        with self._guard:
            if self._depth == 0:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
            self._depth += 1
        try:
            yield
        finally:
            with self._guard:
                self._depth -= 1
                if self._depth == 0 and self._fd is not None:
                    os.close(self._fd)     # closing releases the lock
                    self._fd = None

    # ----- file ------------------------------------------------------------------------------------------------
    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def exists(self) -> bool:
        return self._identity() is not None

    def changed(self) -> bool:
        """Whether the file differs from what this object last read or wrote (a missing file never counts)."""
        now = self._identity()
        return now is not None and now != self._seen

    def read(self) -> HardwareDoc | None:
        """The document, or None when there is no file yet. SimulatedStateError names the file and the fault."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise SimulatedStateError(f"simulated GPU state {self.path}: cannot read: {err.strerror or err}") from None
        hint = "; delete it to start again from the fleet's initial state"
        try:
            json.loads(raw)
        except ValueError as err:   # JSONDecodeError and UnicodeDecodeError
            raise SimulatedStateError(f"simulated GPU state {self.path}: not valid JSON ({err}){hint}") from None
        try:
            doc = HardwareDoc.model_validate_json(raw)
        except ValidationError as err:
            problems = "; ".join(f"{_field_path(tuple(e['loc'])) or '<document>'}: {e['msg']}"
                                 for e in err.errors(include_url=False))
            raise SimulatedStateError(f"simulated GPU state {self.path}: {problems}{hint}") from None
        if doc.schema_version != SCHEMA_VERSION:
            raise SimulatedStateError(f"simulated GPU state {self.path}: schemaVersion {doc.schema_version} is not "
                                      f"{SCHEMA_VERSION}{hint}")
        self._seen = self._identity()
        return doc

    def write(self, doc: HardwareDoc) -> None:
        data = json.dumps(doc.model_dump(mode="json", by_alias=True), indent=1).encode() + b"\n"
        write_atomic(self.path, data, mode=0o600)
        self._seen = self._identity()


__all__ = [
    "SCHEMA_VERSION", "ComputeInstanceState", "GpuInstanceState", "GpuState", "HardwareDoc",
    "SimulatedHardwareState", "SimulatedStateError",
]
