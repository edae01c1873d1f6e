"""A simulated NVML with pynvml's interface: same function names, arguments, ctypes return structures and
``pynvml.NVMLError`` codes, backed by a state machine per simulated GPU.

Code that talks to GPUs takes "the NVML library" as a parameter: the real ``pynvml`` module in production, a
``FakeNvml`` in tests and simulated fleets. It must only use calls both offer, so this class implements a
subset of pynvml under the very same names.

Constants: callers read NVML constants, structures and error classes **from the library object they were
given** (``nvml.NVML_DEVICE_MIG_ENABLE``, ``nvml.NVMLError``, ``nvml.c_nvmlGpuInstancePlacement_t``). FakeNvml
forwards every non-function attribute of pynvml, so this works for both. pynvml *functions* that are not
simulated raise AttributeError rather than silently reaching the real library.

Handles are real ctypes pointers (``c_nvmlDevice_t``, ``c_nvmlGpuInstance_t``, ...) carrying unique addresses
that are never dereferenced, so they fit into pynvml structures such as ``c_nvmlEventData_t.device``. As with
real NVML, compare handles by UUID, not identity.

Hardware rules simulated (see dra/model/catalog.py for the geometry):

* MIG mode: on Ampere ``nvmlDeviceSetMigMode`` only sets the pending mode (activation status
  NVML_ERROR_RESET_REQUIRED) until ``reset_gpu``; Hopper and later switch at once. Disabling MIG while GPU
  instances exist fails with IN_USE.
* GPU instances: a start outside the profile's placements is INVALID_ARGUMENT; an overlap, a profile over its
  instance count or a second ``+me`` (the GPU's single OFA engine) is INSUFFICIENT_RESOURCES; creating one
  with MIG disabled is NOT_SUPPORTED. ``nvmlDeviceCreateGpuInstance`` places like NVML does (one-slice
  profiles lowest free start, larger ones highest), so the order of creation matters.
* GPU-instance ids follow the placement (7g 0, halves 1-2, quarters 3-6, eighths 7-14 on 8-slice GPUs).
* Destroying a GPU instance that still has compute instances is IN_USE.
* Each compute instance is a MIG device with a ``MIG-`` UUID and its own device handle;
  ``nvmlComputeInstanceGetInfo(ci).device`` is that MIG device handle.
* Profile information and possible placements are answered whether MIG is on or off (as NVML documents for
  placements); everything about existing instances needs MIG on.
* A lost GPU answers GPU_IS_LOST to every call except the identity ones NVML keeps from enumeration
  (handle lookup, UUID, minor number, index, PCI info), so a driver can still name the device it marks
  unhealthy.
* NUMA: ``nvmlDeviceGetNumaNodeId`` is NOT_SUPPORTED (it only applies where GPU memory is a NUMA node); the
  GPU's nearest node comes from ``nvmlDeviceGetMemoryAffinity(handle, n, NVML_AFFINITY_SCOPE_NODE)``.
* Events: XID events are delivered to event sets registered for ``nvmlEventTypeXidCriticalError`` on the GPU.
  Events raised while nobody listens are kept and delivered to the next set that registers, so a health
  monitor that starts later still sees XIDs a simulated fleet scripts at start. After ``lose_gpu`` the next
  ``nvmlEventSetWait`` of each set registered on that GPU raises GPU_IS_LOST once.
* Recoveries (simulation only, no NVML counterpart): ``recover_gpu`` also records that an operator declared
  the GPU healthy; ``take_recoveries`` hands those GPUs to a health monitor once.

Time-slice and MPS state is not NVML state and is not simulated here. All calls take one lock: prepares run
in parallel threads.

Persistence (``state_file``): real GPUs keep their MIG mode, GPU/compute instances, compute mode and lost
state when the process that changed them exits. Given a state file (dra/sim/state.py), the simulator
loads that state at construction, takes the file's cross-process lock for every call, picks up another
process's changes before the call (handles of unchanged instances stay valid) and writes the file atomically
after every change. Without one, the state lives and dies with the object. Events raised in the process
(``inject_xid``) stay in it; events other processes record in the file's event log (dra/sim/faults.py,
``gpu-dra simulate``) are delivered here as they appear, those from before this object existed are not.
``nvmlEventSetWait`` watches the file while it waits (dra.sim.filewatch: inotify), so such an event, a lost GPU or
a recovery reaches a waiting monitor at once; where the file cannot be watched, it looks every ``FILE_POLL_S``.
"""
from __future__ import annotations

import ctypes
import functools
import inspect
import itertools
import threading
import time
import uuid as uuidlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from dra.model.catalog import GpuModel, get_model
from dra.model.gpu import MigProfile
from dra.model.mig import PlacementProblem, interval, placement_problem
from dra.sim.filewatch import FileWatch
from dra.sim.state import (
    EVENT_RECOVER,
    EVENT_XID,
    SCHEMA_VERSION,
    ComputeInstanceState,
    GpuInstanceState,
    GpuState,
    HardwareDoc,
    SimulatedEvent,
    SimulatedHardwareState,
    SimulatedStateError,
)

_NO_ID = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId of an event that is not about a MIG device
FILE_POLL_S = 0.15   # how often a waiting nvmlEventSetWait looks for another process's change of the state file
                     # where it cannot watch it (dra.sim.filewatch)
_UUID_NAMESPACE = uuidlib.UUID("6f1c2a0e-3d7b-4f53-9a57-1b6a0e6ad0a1")
_SUPPORTED_EVENTS = (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError
                     | pynvml.nvmlEventTypeDoubleBitEccError)
# NVML_COMPUTE_INSTANCE_PROFILE_* index -> compute slices; only the plain ones are simulated.
_CI_PROFILE_SLICES = {
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE: 1,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE: 2,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE: 3,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE: 4,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE: 7,
}

# Handle addresses are unique across all simulators in the process, so a handle from one is never valid in
# another. They are never dereferenced.
_addresses = itertools.count(0x5F0000001000, 0x100)


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass(frozen=True)
class SimulatedGpu:
    """What one simulated GPU is, as the NVML simulator is built (see dra/sim/fleet.py for the file format)."""

    model: GpuModel | str
    uuid: str                               # "GPU-..."
    minor: int
    pci_bus_id: str                         # NVML form: "00000000:3B:00.0"
    numa_node: int | None = None
    mig_enabled: bool = False
    compute_mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT

    @property
    def gpu_model(self) -> GpuModel:
        return self.model if isinstance(self.model, GpuModel) else get_model(self.model)


# ---------------------------------------------------------------------------------------------------------------
# Internal state


@dataclass(eq=False)
class _Ci:
    gi: _Gi
    id: int
    slices: int
    start: int
    profile_index: int
    uuid: str
    addr: int = field(default_factory=lambda: next(_addresses))       # c_nvmlComputeInstance_t
    mig_addr: int = field(default_factory=lambda: next(_addresses))   # c_nvmlDevice_t of the MIG device

    @property
    def multiprocessors(self) -> int:
        return self.gi.profile.multiprocessors * self.slices // self.gi.profile.compute_slices


@dataclass(eq=False)
class _Gi:
    gpu: _Gpu
    id: int
    profile: MigProfile
    start: int
    addr: int = field(default_factory=lambda: next(_addresses))
    cis: dict[int, _Ci] = field(default_factory=dict)


@dataclass(eq=False)
class _Gpu:
    index: int
    spec: SimulatedGpu
    model: GpuModel
    mig_current: int
    mig_pending: int
    compute_mode: int
    addr: int = field(default_factory=lambda: next(_addresses))
    gis: dict[int, _Gi] = field(default_factory=dict)
    lost: str | None = None
    mig_serial: int = 0
    backlog: deque[tuple[int, int, int, int]] = field(default_factory=deque)  # events nobody listened to


@dataclass(eq=False)
class _EventSet:
    addr: int = field(default_factory=lambda: next(_addresses))
    registrations: dict[int, int] = field(default_factory=dict)   # gpu index -> event mask
    queue: deque[tuple[int, int, int, int, int]] = field(default_factory=deque)  # (gpu, type, data, gi, ci)
    lost_pending: set[int] = field(default_factory=set)            # gpu indexes lost since the last wait
    freed: bool = False


def _handle(ptr_type: Any, addr: int) -> Any:
    return ctypes.cast(ctypes.c_void_p(addr), ptr_type)


def _addr_of(handle: Any) -> int | None:
    if not isinstance(handle, ctypes._Pointer):
        return None
    return ctypes.cast(handle, ctypes.c_void_p).value


def _out_scalar(ref: Any) -> Any:
    """The ctypes object behind an out-parameter given as byref(x), pointer(x) or x."""
    if ref is None:
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if type(ref).__name__ == "CArgObject":
        return ref._obj
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    return ref


def _out_array(ref: Any) -> tuple[Any, int | None]:
    """(indexable buffer, its length if known) behind an array out-parameter; (None, 0) for NULL."""
    if ref is None:
        return None, 0
    if type(ref).__name__ == "CArgObject":
        return _out_array(ref._obj)
    if isinstance(ref, ctypes.Array):
        return ref, len(ref)
    if isinstance(ref, ctypes._Pointer):
        return ref, None
    raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)


def _set_item(buf: Any, i: int, value: Any) -> None:
    buf[i] = value


def _set_placement(buf: Any, i: int, placement: tuple[int, int]) -> None:
    buf[i].start = placement[0]
    buf[i].size = placement[1]


def _out_list(count_ref: Any, array_ref: Any, items: Sequence[Any],
              put: Callable[[Any, int, Any], None] = _set_item) -> int:
    """NVML's list out-parameters: ``*count_ref`` gets the number of items; a NULL array only asks for it, a
    smaller one fails with INSUFFICIENT_SIZE (the count still set), else ``put`` writes each item into it."""
    count = _out_scalar(count_ref)
    buf, capacity = _out_array(array_ref)
    if buf is not None:
        if capacity is not None and capacity < len(items):
            count.value = len(items)
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, item in enumerate(items):
            put(buf, i, item)
    count.value = len(items)
    return pynvml.NVML_SUCCESS


def _in_struct(ref: Any, struct_type: type) -> Any:
    """A structure passed by value, by byref() or by pointer."""
    if isinstance(ref, struct_type):
        return ref
    obj = _out_scalar(ref)
    if not isinstance(obj, struct_type):
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return obj


def place_problem(model: GpuModel, placed: Sequence[tuple[MigProfile, int]], profile: MigProfile,
                  start: int) -> PlacementProblem | None:
    """The model's placement rule (dra.model.mig) for GPU instances of a catalog model."""
    return placement_problem(model.mig_profiles, [(p.profile_id, s) for p, s in placed], profile.profile_id, start)


def auto_start(placed: Sequence[tuple[MigProfile, int]], profile: MigProfile) -> int | None:
    """The start NVML picks when asked to place ``profile`` itself (nvmlDeviceCreateGpuInstance), or None.

    Observed NVML behaviour: one-slice profiles take the lowest free start, larger ones the highest. This
    reproduces the MIG guide's example where creating 19,19,14,9 fails (the 2g lands on slot 4 and blocks the
    3g) while 9,19,14,19 succeeds. Only free-interval starts are considered; other limits are left to the
    placement rule.
    """
    used = {s for other, other_start in placed for s in interval(other, other_start)}
    free = [s for s in profile.starts if not used & set(interval(profile, s))]
    if not free:
        return None
    return min(free) if profile.memory_slices == 1 else max(free)


def _gi_id(model: GpuModel, profile: MigProfile, start: int) -> int:
    """GPU-instance id as NVML assigns it: the placement's position in a binary tree of memory slices."""
    m = model.mig_memory_slices
    return m // profile.memory_slices - 1 + start // profile.memory_slices


F = TypeVar("F", bound=Callable[..., Any])


def _api(func: F) -> F:
    """A simulated NVML call: serialised (also against other processes on the same state file), refused
    before nvmlInit."""

    @functools.wraps(func)
    def wrapper(self: FakeNvml, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._init_count == 0:
                raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
            with self._hw():
                return func(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _bytes_to_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class FakeNvml:
    """Simulated NVML library; see the module docstring."""

    def __init__(self, gpus: Sequence[SimulatedGpu], driver_version: str = "580.95.05",
                 cuda_driver_version: int = 13000, *, state_file: Path | str | None = None) -> None:
        """``state_file``: keep the GPUs' mutable state there (see the module docstring); an existing file is
        loaded now, and SimulatedStateError names it if it is unreadable or describes other GPUs."""
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._init_count = 0
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self._gpus: list[_Gpu] = []
        for i, spec in enumerate(gpus):
            model = spec.gpu_model
            mig = 1 if (spec.mig_enabled and model.mig_capable) else 0
            if spec.mig_enabled and not model.mig_capable:
                raise ValueError(f"GPU {spec.uuid}: {model.name} does not support MIG")
            self._gpus.append(_Gpu(index=i, spec=spec, model=model, mig_current=mig, mig_pending=mig,
                                   compute_mode=spec.compute_mode))
        uuids = [g.spec.uuid for g in self._gpus]
        if len(set(uuids)) != len(uuids):
            raise ValueError("simulated GPUs need distinct UUIDs")
        self._event_sets: dict[int, _EventSet] = {}
        self._state = SimulatedHardwareState(state_file) if state_file is not None else None
        self._hw_depth = 0
        self._dirty = False
        self.restored = False          # whether the state came from an existing state file
        self._event_serial = 0         # newest event of the state file's log that this object has taken over
        self._event_log: tuple[SimulatedEvent, ...] = ()   # the file's log as last read (written back unchanged)
        self._recoveries: list[str] = []   # GPUs declared healthy, not yet taken by take_recoveries
        self._recovery_count = 0       # recoveries ever offered: a new one ends a waiting nvmlEventSetWait early
        self._booted = False           # events in the file when this object is made are history
        self._generation = 0           # see hardware_generation
        with self._hw():
            pass
        self._booted = True

    # -- persistent hardware state -----------------------------------------------------------------------------

    @property
    def state_file(self) -> Path | None:
        return self._state.path if self._state is not None else None

    @contextmanager
    def _hw(self) -> Iterator[None]:
        """The simulated hardware, held: the thread lock, and with a state file its cross-process lock, the
        other processes' latest state on entry and this one's changes written on the outermost exit."""
        with self._lock:
            self._hw_depth += 1
            try:
                if self._state is None:
                    yield
                    return
                with self._state.locked():
                    if self._hw_depth == 1 and self._state.changed():
                        doc = self._state.read()
                        if doc is not None:
                            self._load_state(doc)
                            self.restored = True
                    try:
                        yield
                    finally:
                        if self._hw_depth == 1 and self._dirty:
                            self._dirty = False
                            self._state.write(self._snapshot())
            finally:
                self._hw_depth -= 1

    def _changed(self) -> None:
        self._dirty = True
        self._generation += 1

    @property
    def hardware_generation(self) -> int:
        """Simulation control: grows with every change of the hardware, made here or (read from the state file)
        by another process. Read it under ``hardware_locked`` for a value that matches what the calls show."""
        return self._generation

    @contextmanager
    def hardware_locked(self) -> Iterator[None]:
        """Simulation control: hold the hardware across several calls, against other threads and processes."""
        with self._hw():
            yield

    def has_saved_state(self) -> bool:
        """Whether the state file exists (call under ``hardware_locked`` for an answer that stays true)."""
        with self._hw():
            return self._state is not None and self._state.exists()

    def save_state(self) -> None:
        """Simulation control: write the state file now (also when nothing changed, e.g. a first boot)."""
        with self._hw():
            self._changed()

    def _snapshot(self) -> HardwareDoc:
        gpus = tuple(
            GpuState(uuid=g.spec.uuid, model=g.model.name, mig_current=g.mig_current, mig_pending=g.mig_pending,
                     compute_mode=g.compute_mode, lost=g.lost, mig_serial=g.mig_serial,
                     gpu_instances=tuple(
                         GpuInstanceState(id=gi.id, profile_id=gi.profile.profile_id, start=gi.start,
                                          compute_instances=tuple(
                                              ComputeInstanceState(id=ci.id, profile_index=ci.profile_index,
                                                                   slices=ci.slices, start=ci.start, uuid=ci.uuid)
                                              for ci in sorted(gi.cis.values(), key=lambda c: c.id)))
                         for gi in sorted(g.gis.values(), key=lambda x: x.id)))
            for g in self._gpus)
        # The event log is written back as last read: under the file lock, that is the latest.
        return HardwareDoc(schema_version=SCHEMA_VERSION, gpus=gpus, event_serial=self._event_serial,
                           events=self._event_log)

    def _load_state(self, doc: HardwareDoc) -> None:
        """Take over a state document: everything is checked first, so a bad file changes nothing. Objects of
        instances that did not change are kept, so their handles stay valid."""
        assert self._state is not None
        where = f"simulated GPU state {self._state.path}"
        by_uuid = {g.spec.uuid: g for g in self._gpus}
        listed = [gs.uuid for gs in doc.gpus]
        unknown = [u for u in listed if u not in by_uuid]
        missing = [u for u in by_uuid if u not in listed]
        if unknown or missing or len(set(listed)) != len(listed):
            raise SimulatedStateError(
                f"{where}: describes GPUs {listed}, but this node has {list(by_uuid)} (the fleet changed?); delete "
                "the file to start again from the fleet's initial state")
        updates = [(by_uuid[gs.uuid], gs, self._gis_from_state(by_uuid[gs.uuid], gs, f"{where}: gpus[{i}]"))
                   for i, gs in enumerate(doc.gpus)]
        for j, event in enumerate(doc.events):
            if event.gpu_uuid not in by_uuid:
                raise SimulatedStateError(f"{where}: events[{j}].gpuUuid: no GPU {event.gpu_uuid} on this node")
            if event.kind == EVENT_XID and event.xid is None:
                raise SimulatedStateError(f"{where}: events[{j}].xid: an XID event needs its XID")
        if doc.events and doc.event_serial < doc.events[-1].seq:
            raise SimulatedStateError(f"{where}: eventSerial {doc.event_serial} is older than the newest event "
                                      f"({doc.events[-1].seq})")
        self._generation += 1
        for gpu, gs, gis in updates:
            gpu.mig_current, gpu.mig_pending, gpu.compute_mode = gs.mig_current, gs.mig_pending, gs.compute_mode
            gpu.mig_serial = max(gpu.mig_serial, gs.mig_serial)
            if gs.lost is not None and gpu.lost is None:
                for es in self._event_sets.values():
                    if gpu.index in es.registrations:
                        es.lost_pending.add(gpu.index)
            gpu.lost = gs.lost
            for gi, cis in gis.values():
                gi.cis = cis
            gpu.gis = {gi_id: gi for gi_id, (gi, _cis) in gis.items()}
        # Events recorded since we last looked; those already there when this object was made are history.
        if self._booted:
            for event in doc.events:
                if event.seq > self._event_serial:
                    self._deliver(by_uuid[event.gpu_uuid], event)
        self._event_serial = max(self._event_serial, doc.event_serial)
        self._event_log = doc.events
        self._cond.notify_all()

    def _deliver(self, gpu: _Gpu, event: SimulatedEvent) -> None:
        if event.kind == EVENT_RECOVER:
            self._offer_recovery(gpu.spec.uuid)
        elif event.kind == EVENT_XID and event.xid is not None:
            gi = _NO_ID if event.gpu_instance_id is None else event.gpu_instance_id
            ci = _NO_ID if event.compute_instance_id is None else event.compute_instance_id
            self._emit(gpu, pynvml.nvmlEventTypeXidCriticalError, event.xid, gi, ci)

    def _gis_from_state(self, gpu: _Gpu, gs: GpuState, at: str) -> dict[int, tuple[_Gi, dict[int, _Ci]]]:
        model = gpu.model
        if gs.model != model.name:
            raise SimulatedStateError(f"{at}.model: {gs.model!r}, but GPU {gpu.spec.uuid} is a {model.name}; delete "
                                      "the file to start again from the fleet's initial state")
        if not model.mig_capable and (gs.mig_current or gs.mig_pending):
            raise SimulatedStateError(f"{at}: MIG mode on a {model.name}, which does not support MIG")
        if gs.compute_mode not in (pynvml.NVML_COMPUTEMODE_DEFAULT, pynvml.NVML_COMPUTEMODE_PROHIBITED,
                                   pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS):
            raise SimulatedStateError(f"{at}.computeMode: {gs.compute_mode} is not a compute mode NVML sets")
        if gs.gpu_instances and gs.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise SimulatedStateError(f"{at}.gpuInstances: GPU instances exist while MIG mode is off")
        out: dict[int, tuple[_Gi, dict[int, _Ci]]] = {}
        placed: list[tuple[MigProfile, int]] = []
        mig_uuids: set[str] = set()
        for j, gis in enumerate(gs.gpu_instances):
            here = f"{at}.gpuInstances[{j}]"
            spec = model.profile_by_id(gis.profile_id)
            if spec is None:
                raise SimulatedStateError(f"{here}.profileId: {model.name} has no GPU-instance profile "
                                          f"{gis.profile_id}")
            problem = place_problem(model, placed, spec, gis.start)
            if problem is not None:
                raise SimulatedStateError(f"{here}.start: {problem[1]}")
            if gis.id != _gi_id(model, spec, gis.start) or gis.id in out:
                raise SimulatedStateError(f"{here}.id: {gis.id} is not the id of {spec.name} at start {gis.start} "
                                          f"({_gi_id(model, spec, gis.start)})")
            placed.append((spec, gis.start))
            old = gpu.gis.get(gis.id)
            gi = old if old is not None and old.profile is spec and old.start == gis.start else \
                _Gi(gpu=gpu, id=gis.id, profile=spec, start=gis.start)
            cis: dict[int, _Ci] = {}
            used: set[int] = set()
            for k, cs in enumerate(gis.compute_instances):
                there = f"{here}.computeInstances[{k}]"
                slices = _CI_PROFILE_SLICES.get(cs.profile_index)
                if slices is None or slices != cs.slices or slices > spec.compute_slices:
                    raise SimulatedStateError(f"{there}: profile index {cs.profile_index} with {cs.slices} slices "
                                              f"does not fit a {spec.name} GPU instance")
                span = set(range(cs.start, cs.start + slices))
                if cs.start % slices or cs.start + slices > spec.compute_slices or span & used:
                    raise SimulatedStateError(f"{there}.start: {cs.start} is not a free placement")
                if cs.id in cis or cs.uuid in mig_uuids:
                    raise SimulatedStateError(f"{there}: id {cs.id} or UUID {cs.uuid} appears twice")
                used |= span
                mig_uuids.add(cs.uuid)
                prev = old.cis.get(cs.id) if gi is old else None
                same = prev is not None and (prev.uuid, prev.start, prev.slices) == (cs.uuid, cs.start, slices)
                cis[cs.id] = prev if same and prev is not None else \
                    _Ci(gi=gi, id=cs.id, slices=slices, start=cs.start, profile_index=cs.profile_index, uuid=cs.uuid)
            out[gis.id] = (gi, cis)
        return out

    # -- constants and structures come from pynvml ----------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name, None)
        if value is None and not hasattr(pynvml, name):
            raise AttributeError(f"pynvml has no attribute {name!r}")
        if inspect.isfunction(value):
            raise AttributeError(f"FakeNvml does not simulate pynvml.{name}")
        return value

    # -- lookup helpers ----------------------------------------------------------------------------------------

    def _lookup(self, handle: Any) -> _Gpu | _Ci:
        addr = _addr_of(handle)
        if addr is not None:
            for g in self._gpus:
                if g.addr == addr:
                    return g
                for gi in g.gis.values():
                    for ci in gi.cis.values():
                        if ci.mig_addr == addr:
                            return ci
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _device(self, handle: Any, *, allow_lost: bool = False, allow_mig: bool = False) -> _Gpu | _Ci:
        obj = self._lookup(handle)
        gpu = obj if isinstance(obj, _Gpu) else obj.gi.gpu
        if gpu.lost is not None and not allow_lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        if isinstance(obj, _Ci) and not allow_mig:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return obj

    def _gpu(self, handle: Any, *, allow_lost: bool = False) -> _Gpu:
        obj = self._device(handle, allow_lost=allow_lost, allow_mig=True)
        if isinstance(obj, _Ci):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return obj

    def _mig_gpu(self, handle: Any, *, need_enabled: bool) -> _Gpu:
        gpu = self._gpu(handle)
        if not gpu.model.mig_capable:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if need_enabled and gpu.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _gi(self, handle: Any) -> _Gi:
        addr = _addr_of(handle)
        for g in self._gpus:
            for gi in g.gis.values():
                if gi.addr == addr:
                    if g.lost is not None:
                        raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
                    return gi
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _ci(self, handle: Any) -> _Ci:
        addr = _addr_of(handle)
        for g in self._gpus:
            for gi in g.gis.values():
                for ci in gi.cis.values():
                    if ci.addr == addr:
                        if g.lost is not None:
                            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
                        return ci
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _gpu_by_uuid(self, uuid: str) -> _Gpu:
        for g in self._gpus:
            if g.spec.uuid == uuid:
                return g
        raise KeyError(f"no simulated GPU with UUID {uuid!r}")

    def _dev_handle(self, gpu: _Gpu) -> Any:
        return _handle(pynvml.c_nvmlDevice_t, gpu.addr)

    @staticmethod
    def _mig_devices(gpu: _Gpu) -> list[_Ci]:
        return [ci for gi in sorted(gpu.gis.values(), key=lambda x: x.id)
                for ci in sorted(gi.cis.values(), key=lambda x: x.id)]

    # -- system ------------------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        with self._lock:
            self._init_count += 1

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.nvmlInit()

    def nvmlShutdown(self) -> None:
        with self._lock:
            if self._init_count == 0:
                raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
            self._init_count -= 1

    @_api
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version

    @_api
    def nvmlSystemGetNVMLVersion(self) -> str:
        return f"{self.cuda_driver_version // 1000}.{self.driver_version}"

    @_api
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda_driver_version

    @_api
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.cuda_driver_version

    # -- device identity ---------------------------------------------------------------------------------------

    @_api
    def nvmlDeviceGetCount(self) -> int:
        return len(self._gpus)

    @_api
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not isinstance(index, int) or not 0 <= index < len(self._gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._dev_handle(self._gpus[index])

    @_api
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        want = _bytes_to_str(uuid)
        for g in self._gpus:
            if g.spec.uuid == want:
                return self._dev_handle(g)
        # MIG devices only after every GPU: a probe of N GPUs by UUID stays N² string compares, not N² MIG walks.
        for g in self._gpus:
            for ci in self._mig_devices(g):
                if ci.uuid == want:
                    if g.lost is not None:
                        raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
                    return _handle(pynvml.c_nvmlDevice_t, ci.mig_addr)
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    @_api
    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> Any:
        want = _normalise_bus_id(_bytes_to_str(pciBusId))
        for g in self._gpus:
            if _normalise_bus_id(g.spec.pci_bus_id) == want:
                return self._dev_handle(g)
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    @_api
    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._gpu(handle, allow_lost=True).index

    @_api
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        obj = self._device(handle, allow_lost=True, allow_mig=True)
        return obj.uuid if isinstance(obj, _Ci) else obj.spec.uuid

    @_api
    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        obj = self._device(handle, allow_lost=True)
        assert isinstance(obj, _Gpu)
        return obj.spec.minor

    @_api
    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> Any:
        obj = self._device(handle, allow_lost=True, allow_mig=True)
        gpu = obj if isinstance(obj, _Gpu) else obj.gi.gpu
        bus_id = gpu.spec.pci_bus_id.upper()
        domain, bus, devfn = bus_id.split(":")
        dev = devfn.split(".")[0]
        info = pynvml.nvmlPciInfo_t()
        info.busIdLegacy = ("%04X:%02X:%02X.0" % (int(domain, 16) & 0xFFFF, int(bus, 16), int(dev, 16))).encode()
        info.busId = bus_id.encode()
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(dev, 16)
        info.pciDeviceId = gpu.model.nvml_pci_device_id
        info.pciSubSystemId = (0x10DE << 16) | (gpu.model.pci_device_id & 0xFFF)
        return info

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        return self.nvmlDeviceGetPciInfo_v3(handle)

    # -- device properties -------------------------------------------------------------------------------------

    @_api
    def nvmlDeviceGetName(self, handle: Any) -> str:
        obj = self._device(handle, allow_mig=True)
        if isinstance(obj, _Ci):
            return f"{obj.gi.gpu.model.product_name} MIG {self._ci_name(obj)}"
        return obj.model.product_name

    @_api
    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        obj = self._device(handle, allow_mig=True)
        return (obj if isinstance(obj, _Gpu) else obj.gi.gpu).model.brand

    @_api
    def nvmlDeviceGetArchitecture(self, device: Any) -> int:
        obj = self._device(device, allow_mig=True)
        return (obj if isinstance(obj, _Gpu) else obj.gi.gpu).model.architecture

    @_api
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        gpu = self._device(handle)  # NOT_SUPPORTED for MIG devices, as in NVML
        assert isinstance(gpu, _Gpu)
        return tuple(gpu.model.compute_capability)  # type: ignore[return-value]

    @_api
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        obj = self._device(handle, allow_mig=True)
        mib = obj.gi.profile.memory_mib if isinstance(obj, _Ci) else obj.model.memory_mib
        total = mib << 20
        if version:
            mem = pynvml.c_nvmlMemory_v2_t()
            mem.version = version
            mem.reserved = 0
        else:
            mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.used, mem.free = total, 0, total
        return mem

    @_api
    def nvmlDeviceGetAttributes_v2(self, device: Any) -> Any:
        ci = self._device(device, allow_mig=True)
        if not isinstance(ci, _Ci):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # NVML: "only supports MIG device handles"
        p = ci.gi.profile
        attrs = pynvml.c_nvmlDeviceAttributes()
        attrs.multiprocessorCount = ci.multiprocessors
        attrs.sharedCopyEngineCount = p.copy_engines
        attrs.sharedDecoderCount = p.decoders
        attrs.sharedEncoderCount = p.encoders
        attrs.sharedJpegCount = p.jpeg_engines
        attrs.sharedOfaCount = p.ofa_engines
        attrs.gpuInstanceSliceCount = p.compute_slices
        attrs.computeInstanceSliceCount = ci.slices
        attrs.memorySizeMB = p.memory_mib
        return attrs

    def nvmlDeviceGetAttributes(self, device: Any) -> Any:
        return self.nvmlDeviceGetAttributes_v2(device)

    @_api
    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        self._device(handle)
        raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)

    @_api
    def nvmlDeviceGetMemoryAffinity(self, handle: Any, nodeSetSize: int, scope: int) -> Any:
        gpu = self._device(handle)
        assert isinstance(gpu, _Gpu)
        if scope not in (pynvml.NVML_AFFINITY_SCOPE_NODE, pynvml.NVML_AFFINITY_SCOPE_SOCKET) or nodeSetSize < 1:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        mask = (ctypes.c_ulonglong * nodeSetSize)()
        node = gpu.spec.numa_node
        if node is not None and node < nodeSetSize * 64:
            mask[node // 64] = 1 << (node % 64)
        return mask

    @_api
    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        gpu = self._device(handle)
        assert isinstance(gpu, _Gpu)
        return gpu.compute_mode

    @_api
    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> None:
        gpu = self._device(handle)
        assert isinstance(gpu, _Gpu)
        if mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if mode not in (pynvml.NVML_COMPUTEMODE_DEFAULT, pynvml.NVML_COMPUTEMODE_PROHIBITED,
                        pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu.compute_mode = mode
        self._changed()

    # -- MIG mode ----------------------------------------------------------------------------------------------

    @_api
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        gpu = self._mig_gpu(device, need_enabled=False)
        return [gpu.mig_current, gpu.mig_pending]

    @_api
    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int:
        """Returns the activation status: NVML_SUCCESS, or NVML_ERROR_RESET_REQUIRED on Ampere (pending)."""
        gpu = self._mig_gpu(device, need_enabled=False)
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if mode == pynvml.NVML_DEVICE_MIG_DISABLE and gpu.gis:
            raise _err(pynvml.NVML_ERROR_IN_USE)
        gpu.mig_pending = mode
        self._changed()
        if gpu.model.architecture == pynvml.NVML_DEVICE_ARCH_AMPERE:
            return pynvml.NVML_SUCCESS if mode == gpu.mig_current else pynvml.NVML_ERROR_RESET_REQUIRED
        gpu.mig_current = mode
        return pynvml.NVML_SUCCESS

    # -- GPU-instance profiles ---------------------------------------------------------------------------------

    def _profile_for_index(self, gpu: _Gpu, profile: int) -> MigProfile:
        if not isinstance(profile, int) or not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        spec = gpu.model.profile_by_index(profile)
        if spec is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return spec

    def _profile_for_id(self, gpu: _Gpu, profile_id: int) -> MigProfile:
        spec = gpu.model.profile_by_id(profile_id) if isinstance(profile_id, int) else None
        if spec is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return spec

    @staticmethod
    def _fill_gi_profile_info(spec: MigProfile, version: int) -> Any:
        if version == 2:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            info.name = f"MIG {spec.name}".encode()
        elif version == 1:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_t()
        else:
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id = spec.profile_id
        info.isP2pSupported = 0
        info.sliceCount = spec.compute_slices
        info.instanceCount = spec.max_instances
        info.multiprocessorCount = spec.multiprocessors
        info.copyEngineCount = spec.copy_engines
        info.decoderCount = spec.decoders
        info.encoderCount = spec.encoders
        info.jpegCount = spec.jpeg_engines
        info.ofaCount = spec.ofa_engines
        info.memorySizeMB = spec.memory_mib
        return info

    @_api
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        gpu = self._mig_gpu(device, need_enabled=False)
        return self._fill_gi_profile_info(self._profile_for_index(gpu, profile), version)

    def nvmlDeviceGetGpuInstanceProfileInfoV(self, device: Any, profile: int, version: int = 2) -> Any:
        return self.nvmlDeviceGetGpuInstanceProfileInfo(device, profile, version)

    @_api
    def nvmlDeviceGetGpuInstanceProfileInfoById(self, device: Any, profileId: int) -> Any:
        gpu = self._mig_gpu(device, need_enabled=False)
        return self._fill_gi_profile_info(self._profile_for_id(gpu, profileId), 2)

    def nvmlDeviceGetGpuInstanceProfileInfoByIdV(self, device: Any, profileId: int) -> Any:
        return self.nvmlDeviceGetGpuInstanceProfileInfoById(device, profileId)

    @_api
    def nvmlDeviceGetGpuInstancePossiblePlacements(self, device: Any, profileId: int, placementsRef: Any,
                                                   countRef: Any) -> int:
        gpu = self._mig_gpu(device, need_enabled=False)
        spec = self._profile_for_id(gpu, profileId)
        return _out_list(countRef, placementsRef, [(start, spec.memory_slices) for start in spec.starts],
                         _set_placement)

    def _placed(self, gpu: _Gpu) -> list[tuple[MigProfile, int]]:
        return [(gi.profile, gi.start) for gi in gpu.gis.values()]

    @_api
    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: Any, profileId: int) -> int:
        gpu = self._mig_gpu(device, need_enabled=True)
        spec = self._profile_for_id(gpu, profileId)
        placed = self._placed(gpu)
        n = 0
        while True:  # greedy is exact here: placements of one profile are aligned and equal-sized
            start = auto_start(placed, spec)
            if start is None or place_problem(gpu.model, placed, spec, start) is not None:
                return n
            placed.append((spec, start))
            n += 1

    # -- GPU instances -----------------------------------------------------------------------------------------

    def _create_gi(self, gpu: _Gpu, spec: MigProfile, start: int) -> Any:
        problem = place_problem(gpu.model, self._placed(gpu), spec, start)
        if problem is not None:
            kind, _reason = problem
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT if kind == "start"
                       else pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi = _Gi(gpu=gpu, id=_gi_id(gpu.model, spec, start), profile=spec, start=start)
        gpu.gis[gi.id] = gi
        self._changed()
        return _handle(pynvml.c_nvmlGpuInstance_t, gi.addr)

    @_api
    def nvmlDeviceCreateGpuInstance(self, device: Any, profileId: int) -> Any:
        gpu = self._mig_gpu(device, need_enabled=True)
        spec = self._profile_for_id(gpu, profileId)
        start = auto_start(self._placed(gpu), spec)
        if start is None:
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        return self._create_gi(gpu, spec, start)

    @_api
    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: Any, profileId: int, placement: Any) -> Any:
        gpu = self._mig_gpu(device, need_enabled=True)
        spec = self._profile_for_id(gpu, profileId)
        place = _in_struct(placement, pynvml.c_nvmlGpuInstancePlacement_t)
        if place.size != spec.memory_slices:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._create_gi(gpu, spec, place.start)

    @_api
    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        gi = self._gi(gpuInstance)
        if gi.cis:
            raise _err(pynvml.NVML_ERROR_IN_USE)
        del gi.gpu.gis[gi.id]
        self._changed()
        return pynvml.NVML_SUCCESS

    @_api
    def nvmlDeviceGetGpuInstances(self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any) -> int:
        gpu = self._mig_gpu(device, need_enabled=True)
        self._profile_for_id(gpu, profileId)
        found = sorted((gi for gi in gpu.gis.values() if gi.profile.profile_id == profileId), key=lambda g: g.id)
        return _out_list(countRef, gpuInstancesRef, [_handle(pynvml.c_nvmlGpuInstance_t, gi.addr) for gi in found])

    @_api
    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        gpu = self._mig_gpu(device, need_enabled=True)
        gi = gpu.gis.get(gpuInstanceId)
        if gi is None:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return _handle(pynvml.c_nvmlGpuInstance_t, gi.addr)

    @_api
    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        gi = self._gi(gpuInstance)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = self._dev_handle(gi.gpu)
        info.id = gi.id
        info.profileId = gi.profile.profile_id
        info.placement.start = gi.start
        info.placement.size = gi.profile.memory_slices
        return info

    # -- compute instances -------------------------------------------------------------------------------------

    @staticmethod
    def _ci_name(ci: _Ci) -> str:
        gi_name = ci.gi.profile.name
        return gi_name if ci.slices == ci.gi.profile.compute_slices else f"{ci.slices}c.{gi_name}"

    def _ci_slices(self, gi: _Gi, profile: int) -> int:
        if not isinstance(profile, int) or not 0 <= profile < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        slices = _CI_PROFILE_SLICES.get(profile)
        if slices is None or slices > gi.profile.compute_slices:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return slices

    def _ci_starts(self, gi: _Gi, slices: int) -> list[int]:
        return list(range(0, gi.profile.compute_slices - slices + 1, slices))

    def _ci_free_start(self, gi: _Gi, slices: int) -> int | None:
        used = {s for ci in gi.cis.values() for s in range(ci.start, ci.start + ci.slices)}
        for start in self._ci_starts(gi, slices):
            if not used & set(range(start, start + slices)):
                return start
        return None

    @_api
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, device: Any, profile: int, engProfile: int,
                                                     version: int = 2) -> Any:
        gi = self._gi(device)  # pynvml names the GPU-instance handle "device" here
        slices = self._ci_slices(gi, profile)
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        p = gi.profile
        if version == 2:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            name = p.name if slices == p.compute_slices else f"{slices}c.{p.name}"
            info.name = f"MIG {name}".encode()
        elif version == 1:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_t()
        else:
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id = profile
        info.sliceCount = slices
        info.instanceCount = p.compute_slices // slices
        info.multiprocessorCount = p.multiprocessors * slices // p.compute_slices
        info.sharedCopyEngineCount = p.copy_engines
        info.sharedDecoderCount = p.decoders
        info.sharedEncoderCount = p.encoders
        info.sharedJpegCount = p.jpeg_engines
        info.sharedOfaCount = p.ofa_engines
        return info

    def nvmlGpuInstanceGetComputeInstanceProfileInfoV(self, device: Any, profile: int, engProfile: int,
                                                      version: int = 2) -> Any:
        return self.nvmlGpuInstanceGetComputeInstanceProfileInfo(device, profile, engProfile, version)

    @_api
    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(self, gpuInstance: Any, profileId: int) -> int:
        gi = self._gi(gpuInstance)
        slices = self._ci_slices(gi, profileId)
        used = {s for ci in gi.cis.values() for s in range(ci.start, ci.start + ci.slices)}
        return sum(1 for s in self._ci_starts(gi, slices) if not used & set(range(s, s + slices)))

    @_api
    def nvmlGpuInstanceGetComputeInstancePossiblePlacements(self, gpuInstance: Any, profileId: int,
                                                            placementsRef: Any, countRef: Any) -> int:
        gi = self._gi(gpuInstance)
        slices = self._ci_slices(gi, profileId)
        starts = self._ci_starts(gi, slices)
        return _out_list(countRef, placementsRef, [(start, slices) for start in starts], _set_placement)

    def _create_ci(self, gi: _Gi, profile: int, start: int | None) -> Any:
        slices = self._ci_slices(gi, profile)
        if start is None:
            start = self._ci_free_start(gi, slices)
            if start is None:
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        elif start not in self._ci_starts(gi, slices):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        used = {s for ci in gi.cis.values() for s in range(ci.start, ci.start + ci.slices)}
        if used & set(range(start, start + slices)):
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci_id = next(i for i in itertools.count() if i not in gi.cis)
        gpu = gi.gpu
        gpu.mig_serial += 1
        mig_uuid = "MIG-" + str(uuidlib.uuid5(_UUID_NAMESPACE, f"{gpu.spec.uuid}/{gi.id}/{ci_id}/{gpu.mig_serial}"))
        ci = _Ci(gi=gi, id=ci_id, slices=slices, start=start, profile_index=profile, uuid=mig_uuid)
        gi.cis[ci_id] = ci
        self._changed()
        return _handle(pynvml.c_nvmlComputeInstance_t, ci.addr)

    @_api
    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        return self._create_ci(self._gi(gpuInstance), profileId, None)

    @_api
    def nvmlGpuInstanceCreateComputeInstanceWithPlacement(self, gpuInstance: Any, profileId: int,
                                                          placement: Any) -> Any:
        gi = self._gi(gpuInstance)
        place = _in_struct(placement, pynvml.c_nvmlComputeInstancePlacement_t)
        if place.size != self._ci_slices(gi, profileId):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._create_ci(gi, profileId, place.start)

    @_api
    def nvmlGpuInstanceGetComputeInstances(self, gpuInstance: Any, profileId: int, computeInstancesRef: Any,
                                           countRef: Any) -> int:
        gi = self._gi(gpuInstance)
        self._ci_slices(gi, profileId)
        found = sorted((ci for ci in gi.cis.values() if ci.profile_index == profileId), key=lambda c: c.id)
        return _out_list(countRef, computeInstancesRef,
                         [_handle(pynvml.c_nvmlComputeInstance_t, ci.addr) for ci in found])

    @_api
    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: Any, computeInstanceId: int) -> Any:
        gi = self._gi(gpuInstance)
        ci = gi.cis.get(computeInstanceId)
        if ci is None:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return _handle(pynvml.c_nvmlComputeInstance_t, ci.addr)

    @_api
    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: Any) -> Any:
        ci = self._ci(computeInstance)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        # The MIG device of this compute instance: NVIDIA's driver reads the new MIG UUID from it.
        info.device = _handle(pynvml.c_nvmlDevice_t, ci.mig_addr)
        info.gpuInstance = _handle(pynvml.c_nvmlGpuInstance_t, ci.gi.addr)
        info.id = ci.id
        info.profileId = ci.profile_index
        info.placement.start = ci.start
        info.placement.size = ci.slices
        return info

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any:
        return self.nvmlComputeInstanceGetInfo_v2(computeInstance)

    @_api
    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        ci = self._ci(computeInstance)
        del ci.gi.cis[ci.id]
        self._changed()
        return pynvml.NVML_SUCCESS

    # -- MIG devices -------------------------------------------------------------------------------------------

    @_api
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        gpu = self._mig_gpu(device, need_enabled=False)
        return gpu.model.mig_compute_slices

    @_api
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        gpu = self._mig_gpu(device, need_enabled=True)
        if not isinstance(index, int) or not 0 <= index < gpu.model.mig_compute_slices:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        devices = self._mig_devices(gpu)
        if index >= len(devices):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return _handle(pynvml.c_nvmlDevice_t, devices[index].mig_addr)

    @_api
    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> Any:
        obj = self._device(device, allow_lost=True, allow_mig=True)
        return ctypes.c_uint(1 if isinstance(obj, _Ci) else 0)  # pynvml returns the c_uint itself

    @_api
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        obj = self._device(migDevice, allow_mig=True)
        if not isinstance(obj, _Ci):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._dev_handle(obj.gi.gpu)

    @_api
    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        obj = self._device(device, allow_mig=True)
        if not isinstance(obj, _Ci):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return obj.gi.id

    @_api
    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        obj = self._device(device, allow_mig=True)
        if not isinstance(obj, _Ci):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return obj.id

    # -- processes ---------------------------------------------------------------------------------------------
    # Answered from the processes the CUDA stand-in registered (dra/sim/gpuprocesses.py), set as ``processes`` by
    # the simulated node's objects; without one no process uses a GPU. MPS clients are reported by the MPS
    # query, the others by the compute query, as the real driver separates them. A GPU in MIG mode reports the
    # processes of its MIG devices too, each with its GPU and compute instance.

    processes: Any = None    # a ProcessRegistry (dra.sim.gpuprocesses), or None

    def _processes(self, handle: Any, mps_client: bool) -> list[Any]:
        obj = self._device(handle, allow_mig=True)
        if self.processes is None:
            return []
        where: dict[str, tuple[int, int]] = {}
        if isinstance(obj, _Ci):
            where[obj.uuid] = (obj.gi.id, obj.id)
        else:
            where[obj.spec.uuid] = (0xFFFFFFFF, 0xFFFFFFFF)
            where.update({ci.uuid: (ci.gi.id, ci.id) for ci in self._mig_devices(obj)})
        out = []
        for proc in self.processes.processes():
            if proc.uuid in where and proc.mps_client == mps_client:
                info = pynvml.c_nvmlProcessInfo_t()
                info.pid, info.usedGpuMemory = proc.pid, proc.used_bytes
                info.gpuInstanceId, info.computeInstanceId = where[proc.uuid]
                out.append(info)
        return out

    @_api
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return self._processes(handle, mps_client=False)

    nvmlDeviceGetComputeRunningProcesses_v3 = nvmlDeviceGetComputeRunningProcesses

    @_api
    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return self._processes(handle, mps_client=True)

    nvmlDeviceGetMPSComputeRunningProcesses_v3 = nvmlDeviceGetMPSComputeRunningProcesses

    @_api
    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        """One sample now per registered process: the stand-in runs no kernels, so every utilisation is 0."""
        procs = self._processes(handle, mps_client=False) + self._processes(handle, mps_client=True)
        if not procs:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)   # what the driver answers when it has no samples
        now = int(time.time() * 1e6)
        samples = []
        for proc in procs:
            sample = pynvml.c_nvmlProcessUtilizationSample_t()
            sample.pid, sample.timeStamp = proc.pid, now
            samples.append(sample)
        return samples

    # -- events ------------------------------------------------------------------------------------------------

    def _event_set(self, handle: Any) -> _EventSet:
        es = self._event_sets.get(_addr_of(handle) or -1)
        if es is None or es.freed:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return es

    @_api
    def nvmlEventSetCreate(self) -> Any:
        es = _EventSet()
        self._event_sets[es.addr] = es
        return _handle(pynvml.c_nvmlEventSet_t, es.addr)

    @_api
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._device(handle)
        return _SUPPORTED_EVENTS

    @_api
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        gpu = self._device(handle)
        assert isinstance(gpu, _Gpu)
        es = self._event_set(eventSet)
        if eventTypes & ~_SUPPORTED_EVENTS:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        es.registrations[gpu.index] = es.registrations.get(gpu.index, 0) | eventTypes
        kept: deque[tuple[int, int, int, int]] = deque()
        while gpu.backlog:
            etype, data, gi, ci = gpu.backlog.popleft()
            if etype & eventTypes:
                es.queue.append((gpu.index, etype, data, gi, ci))
            else:
                kept.append((etype, data, gi, ci))
        gpu.backlog = kept
        self._cond.notify_all()

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        """Next event, or NVMLError TIMEOUT after ``timeoutms``; GPU_IS_LOST once after a registered GPU is lost.
        With a state file, other processes' events and lost GPUs are picked up while waiting. A recovery offered
        meanwhile (see take_recoveries) ends the wait early with TIMEOUT, so the monitor takes it at once."""
        deadline = time.monotonic() + max(timeoutms, 0) / 1000.0
        # Another process's change of the state file wakes the wait (inotify); without a watch, look on a timer.
        watch = FileWatch.start(self._state.path, self._wake_waiters) \
            if self._state is not None and timeoutms > 0 else None
        try:
            # No state file: only this process changes the GPUs, and it wakes the wait itself.
            poll_s = FILE_POLL_S if self._state is not None and watch is None else None
            return self._event_wait(eventSet, deadline, poll_s=poll_s)
        finally:
            if watch is not None:
                watch.stop()     # outside self._cond: the watch's thread may be waiting for it to wake us

    def _wake_waiters(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _event_wait(self, eventSet: Any, deadline: float, poll_s: float | None) -> Any:
        with self._cond:
            if self._init_count == 0:
                raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
            es = self._event_set(eventSet)
            recoveries = self._recovery_count
            while True:
                if self._state is not None and self._state.changed():
                    with self._hw():
                        pass  # entering takes over the file's changes, delivering its new events
                if es.lost_pending:
                    es.lost_pending.clear()
                    raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
                if es.queue:
                    index, etype, xid, gi, ci = es.queue.popleft()
                    data = pynvml.c_nvmlEventData_t()
                    data.device = self._dev_handle(self._gpus[index])
                    data.eventType = etype
                    data.eventData = xid
                    data.gpuInstanceId = gi
                    data.computeInstanceId = ci
                    return data
                remaining = deadline - time.monotonic()
                if remaining <= 0 or es.freed or self._recovery_count != recoveries:
                    raise _err(pynvml.NVML_ERROR_TIMEOUT)
                self._cond.wait(remaining if poll_s is None else min(remaining, poll_s))

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    @_api
    def nvmlEventSetFree(self, eventSet: Any) -> None:
        es = self._event_set(eventSet)
        es.freed = True
        del self._event_sets[es.addr]
        self._cond.notify_all()

    # ===========================================================================================================
    # Simulation controls: not part of NVML. They work whether or not nvmlInit was called.

    def _emit(self, gpu: _Gpu, etype: int, data: int, gi: int, ci: int) -> None:
        delivered = False
        for es in self._event_sets.values():
            if es.registrations.get(gpu.index, 0) & etype:
                es.queue.append((gpu.index, etype, data, gi, ci))
                delivered = True
        if not delivered:
            gpu.backlog.append((etype, data, gi, ci))
        self._cond.notify_all()

    def inject_xid(self, uuid: str, xid: int, gi: int | None = None, ci: int | None = None) -> None:
        """Raise an XID critical-error event on a GPU (optionally naming a GPU/compute instance)."""
        with self._hw():
            gpu = self._gpu_by_uuid(uuid)
            self._emit(gpu, pynvml.nvmlEventTypeXidCriticalError, xid,
                       _NO_ID if gi is None else gi, _NO_ID if ci is None else ci)

    def lose_gpu(self, uuid: str, reason: str = "GPU has fallen off the bus") -> None:
        """The GPU stops answering: its calls fail with GPU_IS_LOST until ``recover_gpu``."""
        with self._hw():
            gpu = self._gpu_by_uuid(uuid)
            gpu.lost = reason
            self._changed()
            for es in self._event_sets.values():
                if gpu.index in es.registrations:
                    es.lost_pending.add(gpu.index)
            self._cond.notify_all()

    def recover_gpu(self, uuid: str) -> None:
        """The GPU answers again (if it was lost), and an operator declared it healthy (see take_recoveries)."""
        with self._hw():
            self._gpu_by_uuid(uuid).lost = None
            self._offer_recovery(uuid)
            self._changed()

    def _offer_recovery(self, uuid: str) -> None:
        self._recoveries.append(uuid)
        self._recovery_count += 1
        self._cond.notify_all()

    def take_recoveries(self) -> list[str]:
        """GPUs declared healthy (``recover_gpu`` here, or recovery events in the state file) since the last
        call, each once, oldest first. A health monitor clears their taints."""
        with self._hw():
            taken, self._recoveries = self._recoveries, []
            return list(dict.fromkeys(taken))

    def reset_gpu(self, uuid: str) -> None:
        """A GPU reset: applies the pending MIG mode and clears all GPU and compute instances."""
        with self._hw():
            gpu = self._gpu_by_uuid(uuid)
            gpu.gis.clear()
            gpu.mig_current = gpu.mig_pending
            self._changed()

    def lost_reason(self, uuid: str) -> str | None:
        """Why a simulated GPU is lost (None when it is not)."""
        with self._hw():
            return self._gpu_by_uuid(uuid).lost

    @property
    def gpu_uuids(self) -> list[str]:
        return [g.spec.uuid for g in self._gpus]


def _normalise_bus_id(bus_id: str) -> str:
    """'00000000:3B:00.0' and '0000:3b:00.0' -> '0000:3b:00.0'."""
    domain, bus, devfn = bus_id.strip().lower().split(":")
    return f"{int(domain, 16):04x}:{bus}:{devfn}"
