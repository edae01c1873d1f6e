"""Prepare and unprepare ResourceClaims on this node.

One claim, end to end (``Driver._prepare_claim``):

1. A claim already ``PrepareCompleted`` in the checkpoint gets the stored answer (no API read, no work).
2. Read the ResourceClaim (``ClaimSource``), check its UID and allocation, and plan it (``kubeletplugin.plan``:
   this driver's results in this node's pool, effective opaque config per request, decoded strictly).
3. A ``PrepareStarted`` record from an earlier attempt is rolled back first.
4. Book the devices: check that no other prepared claim holds them (the last line of defence against double
   allocation) and write ``PrepareStarted`` — both under one short lock.
5. Under the claim's GPU locks: create dynamic MIG devices at the allocated placement, apply time-slice
   intervals, start MPS daemons; each undo step is checkpointed as soon as it is done (time-slices and MPS:
   before).
6. Write the claim's CDI spec, then ``PrepareCompleted`` with the devices returned to the kubelet.
7. Report the prepared devices in the claim's ``status.devices`` (``ClaimStatusWriter``): Ready, and which GPU
   or MIG device is used. A failed status write is logged and counted; the prepare still succeeds.

A failure fails that claim only (its error names the problem) and undoes what was done. Claims of one call
prepare in parallel; unrelated claims never wait for each other except on a GPU they both touch.

Unprepare works from the checkpoint alone (the claim may be deleted): stop MPS daemons, destroy MIG devices,
release time-slice settings, delete the CDI spec, forget the claim, then remove our ``status.devices`` entries
(best effort, as above). Unknown claims are a success.

Test hook: ``GPU_DRA_FAULT=crash-after:<step>`` in the environment makes the process exit at once with status
137 (as if SIGKILLed) at that point of a prepare, so tests can prove recovery. Steps: ``checkpoint-started``
(PrepareStarted written, nothing done), ``mig-created`` (a dynamic MIG device exists that the checkpoint does
not know yet), ``timeslice-applied`` (a GPU's time-slice interval was changed; only the write-ahead record knows
it), ``mps-started`` (an MPS daemon runs), ``cdi-written`` (the CDI spec exists, the claim is not yet
PrepareCompleted). An unknown value stops the driver from starting. Never set it outside tests.
"""
from __future__ import annotations

import fcntl
import os
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import structlog

from dra.node import migdevices as mig
from dra.node.cdi import CdiSpecWriter, ClaimDevice, MpsMounts
from dra.node.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    CheckpointStore,
    ClaimRecord,
    LoadResult,
    MigUndo,
    MpsUndo,
    TimeSliceUndo,
    UndoInfo,
)
from dra.node.checkpoint import PreparedDevice as CheckpointDevice
from dra.model.devices import KIND_GPU, KIND_MIG, Device
from dra.node.sharing import MpsDaemon, MpsDevice, MpsSupervisor, TimeSliceApplied, TimeSlicing, mps_daemon_id
from dra.node.sharingtools import SharingError
from dra.model.quantity import MIB
from kubeletplugin.claims import ClaimError, ClaimRef, ClaimSource
from kubeletplugin.claimstatus import ClaimStatusWriter, DeviceStatus
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.plan import DevicePlan, PlanError, plan_claim
from kubeletplugin.results import PreparedDevice, PrepareResult, UnprepareResult

DeviceCatalog = Callable[[], Mapping[str, Device]]

FAULT_ENV = "GPU_DRA_FAULT"
CRASH_STEPS = ("checkpoint-started", "mig-created", "timeslice-applied", "mps-started", "cdi-written")


def crash_step_from_env() -> str | None:
    """The test hook's step (see the module docstring), or None when it is not set."""
    value = os.environ.get(FAULT_ENV, "").strip()
    if not value:
        return None
    step = value.removeprefix("crash-after:")
    if not value.startswith("crash-after:") or step not in CRASH_STEPS:
        raise ValueError(f"{FAULT_ENV}={value!r}: expected crash-after:<step>, step one of {', '.join(CRASH_STEPS)}")
    return step


class MigListener(Protocol):
    """Told when a dynamic MIG device comes into existence or goes away (the health monitor routes its
    events by GPU-instance id)."""

    def bind_mig(self, name: str, gpu_uuid: str, gi_id: int, ci_id: int) -> None: ...

    def unbind_mig(self, name: str) -> None: ...


class PrepareError(Exception):
    """Preparing a claim failed; the message is what the kubelet shows in the pod's events."""


@dataclass(frozen=True)
class StartupReport:
    checkpoint: LoadResult
    rolled_back: tuple[str, ...]          # claims whose half-done prepare was undone
    rollback_failed: tuple[str, ...]      # claims whose rollback failed (retried on their next prepare/unprepare)
    mig_destroyed: tuple[str, ...]        # "<parent uuid>/gi<g>/ci<c>" of MIG devices nobody owned
    cdi_removed: tuple[str, ...]          # claim UIDs whose orphaned CDI specs were removed
    mps_adopted: int
    adopted_from_cdi: tuple[str, ...] = ()   # claims rebuilt from their CDI specs (the checkpoint was lost)
    conservative: bool = False            # state was lost: nothing was destroyed or deleted at this start


def _pods(claim: Mapping[str, Any]) -> list[str]:
    """Names of the pods the claim is reserved for, for log context."""
    out = []
    for r in (claim.get("status") or {}).get("reservedFor") or []:
        if r.get("resource", "pods") == "pods" and r.get("name"):
            out.append(r["name"])
    return out


def _from_checkpoint(d: CheckpointDevice) -> PreparedDevice:
    return PreparedDevice(request_names=tuple(d.requests), pool_name=d.pool, device_name=d.device,
                          cdi_device_ids=tuple(d.cdi_device_ids), share_id=d.share_id)


def _mps_undo(d: MpsDaemon) -> MpsUndo:
    return MpsUndo(daemon_id=d.daemon_id, gpu_uuids=d.gpu_uuids, pipe_dir=d.pipe_dir, log_dir=d.log_dir,
                   shm_dir=d.shm_dir, compute_mode_set=d.compute_mode_set,
                   active_thread_percentage=d.active_thread_percentage,
                   pinned_memory_limit_mib=dict(d.pinned_memory_limit_mib))


def _mps_daemon(claim_uid: str, u: MpsUndo) -> MpsDaemon:
    return MpsDaemon(daemon_id=u.daemon_id, claim_uid=claim_uid, gpu_uuids=tuple(u.gpu_uuids), pipe_dir=u.pipe_dir,
                     log_dir=u.log_dir, shm_dir=u.shm_dir, compute_mode_set=tuple(u.compute_mode_set),
                     active_thread_percentage=u.active_thread_percentage,
                     pinned_memory_limit_mib=dict(u.pinned_memory_limit_mib))


def _time_slice(u: TimeSliceUndo) -> TimeSliceApplied:
    return TimeSliceApplied(gpu_uuids=tuple(u.gpu_uuids), interval=u.interval, previous=u.previous)


@dataclass
class _MpsGroup:
    """One MPS daemon of a claim: the devices of one physical GPU."""

    parent_uuid: str
    devices: dict[str, bool]              # device uuid -> exclusive (whole GPU)
    threads: int | None
    limits_mib: dict[str, int]
    unlimited_threads: bool = False


class Driver:
    """The node's prepare/unprepare logic. Thread-safe; see the module docstring for the flow.

    devices:      the devices this node publishes, by name (called per claim, so a rebuilt model is seen)
    nvml:         the NVML library (pynvml or FakeNvml), initialised by the caller
    mps / time_slicing: sharing bookkeeping over the node's SharingControl
    """

    def __init__(
        self,
        *,
        driver_name: str,
        pool_name: str,
        devices: DeviceCatalog,
        claims: ClaimSource,
        checkpoint: CheckpointStore,
        cdi: CdiSpecWriter,
        nvml: Any,
        mps: MpsSupervisor,
        time_slicing: TimeSlicing,
        compat_nvidia: bool = False,
        metrics: PluginMetrics | None = None,
        max_parallel: int = 8,
        serialize_lock: Path | str | None = None,
        mig_listener: MigListener | None = None,
        on_change: Callable[[], None] | None = None,
        status: ClaimStatusWriter | None = None,
        log: Any = None,
    ) -> None:
        self.driver_name = driver_name
        self.pool_name = pool_name
        self._devices = devices
        self.claims = claims
        self.checkpoint = checkpoint
        self.cdi = cdi
        self.nvml = nvml
        self.mps = mps
        self.time_slicing = time_slicing
        self.compat_nvidia = compat_nvidia
        self.metrics = metrics
        # Rolling updates: two plugin processes share the state directory; each call then runs under a file
        # lock and starts from the checkpoint on disk.
        self.serialize_lock = Path(serialize_lock) if serialize_lock else None
        self.mig_listener = mig_listener
        self.on_change = on_change          # called after every prepare/unprepare call (e.g. device gauges)
        self.status = status                # status.devices of prepared claims; None: not reported
        self._status_published: set[str] = set()   # claims whose entries this process has written
        self.log = log or structlog.get_logger("driver")
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="claim")
        self._locks_guard = threading.Lock()
        self._claim_locks: dict[str, threading.Lock] = {}
        self._gpu_locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
        self._booking = threading.Lock()
        self._crash_after = crash_step_from_env()
        if self._crash_after:
            self.log.warning("test hook armed: the process exits during prepare",
                             fault=f"crash-after:{self._crash_after}")

    def _crash_point(self, step: str) -> None:
        """Test hook (module docstring): die here, leaving everything as a SIGKILL would."""
        if self._crash_after == step:
            self.log.warning("test hook: exiting now", fault=f"crash-after:{step}")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(137)

    # ----- start-up ------------------------------------------------------------------------------------------
    def start(self) -> StartupReport:
        """Load the checkpoint and bring the node in line with it. Call once before serving the kubelet."""
        with self._serialized(reload=False):
            return self._start()

    def _start(self) -> StartupReport:
        loaded = self.checkpoint.load()
        for record in loaded.dropped_claims:
            # State from before a reboot: the hardware state is gone; the CDI file may remain on a
            # persistent spec directory.
            self.cdi.delete_claim_spec(record.uid)
        adopted_from_cdi: list[str] = []
        if loaded.state_lost:
            adopted_from_cdi = self._adopt_from_cdi_specs(loaded)
        # Completed claims first: their time-slice settings and MPS daemons are registered before any
        # rollback releases a GPU setting they share.
        adopted = 0
        for uid, record in self.checkpoint.claims().items():
            if not record.completed:
                continue
            for ts in record.undo.time_slices:
                self.time_slicing.adopt(uid, _time_slice(ts))
            for daemon in record.undo.mps_daemons:
                self.mps.adopt(_mps_daemon(uid, daemon))
                adopted += 1
            if self.mig_listener is not None:
                for m in record.undo.mig_devices:
                    self.mig_listener.bind_mig(m.device, m.parent_uuid, m.gi_id, m.ci_id)
        rolled_back, failed = [], []
        for uid, record in sorted(self.checkpoint.claims().items()):
            if record.completed:
                continue
            try:
                self._rollback(record)
                rolled_back.append(uid)
            except Exception as err:  # noqa: BLE001 - keep starting; the record stays for a retry
                self.log.error("rolling back half-done prepare failed", claim_uid=uid, error=str(err))
                failed.append(uid)
        destroyed: list[mig.MigLive] = []
        cdi_removed: list[str] = []
        claims = self.checkpoint.claims()
        if loaded.state_lost:
            self._log_conservative_start(loaded, adopted_from_cdi)
        else:
            destroyed = self._destroy_unowned_mig()
            for uid in self.cdi.list_claim_specs():
                if uid not in claims:
                    self.cdi.delete_claim_spec(uid)
                    cdi_removed.append(uid)
        self.cdi.remove_leftover_temp_files()
        if adopted:
            self.mps.supervise()  # daemons die with the plugin's container: start them again now
        self._update_gauges()
        report = StartupReport(loaded, tuple(rolled_back), tuple(failed),
                               tuple(f"{d.parent_uuid}/gi{d.gi_id}/ci{d.ci_id}" for d in destroyed),
                               tuple(cdi_removed), adopted, tuple(adopted_from_cdi), loaded.state_lost)
        self.log.info("driver state recovered", prepared_claims=len(claims), rolled_back=list(rolled_back),
                      rollback_failed=list(failed), mig_destroyed=list(report.mig_destroyed),
                      cdi_removed=cdi_removed, mps_daemons=adopted,
                      dropped_after_reboot=[r.uid for r in loaded.dropped_claims], adopted_from_cdi=adopted_from_cdi,
                      corrupt_checkpoint=str(loaded.corrupt_file) if loaded.corrupt_file else None)
        return report

    def _adopt_from_cdi_specs(self, loaded: LoadResult) -> list[str]:
        """The checkpoint lost claims: take back every claim whose CDI spec is still here (module
        ``kubeletplugin.recovery``), so its devices stay booked and its unprepare undoes it. Claims whose own
        record could not be read are adopted the same way."""
        from kubeletplugin.recovery import recover_claims

        known = list(self.checkpoint.claims())
        try:
            found = recover_claims(self.cdi, self._devices(), self.nvml, self.pool_name, skip=known)
        except Exception as err:  # noqa: BLE001 - adopting is a bonus; the start stays conservative anyway
            self.log.error("adopting claims from their CDI specs failed", error=str(err))
            return []
        for problem in found.problems:
            self.log.warning("claim not adopted from its CDI spec", detail=problem)
        adopted = []
        for record in found.records:
            try:
                self.checkpoint.put(record)
            except OSError as err:
                self.log.error("recording an adopted claim failed", claim_uid=record.uid, error=str(err))
                continue
            adopted.append(record.uid)
        return adopted

    def _log_conservative_start(self, loaded: LoadResult, adopted: list[str]) -> None:
        """One line: why this start destroys nothing, and what it keeps that it would otherwise remove."""
        claims = self.checkpoint.claims()
        owned = {(m.parent_uuid, m.gi_id, m.ci_id) for r in claims.values() for m in r.undo.mig_devices}
        mig_kept: list[str] = []
        try:
            for gpu in sorted(self._dynamic_mig_gpus()):
                mig_kept += [f"{m.parent_uuid}/gi{m.gi_id}/ci{m.ci_id}" for m in mig.list_mig_devices(self.nvml, gpu)
                             if m.key not in owned]
        except (mig.MigError, self.nvml.NVMLError) as err:
            mig_kept.append(f"(listing failed: {err})")
        cdi_kept = sorted(uid for uid in self.cdi.list_claim_specs() if uid not in claims)
        if loaded.corrupt:
            reason = (f"the checkpoint could not be read and was moved to {loaded.corrupt_file}"
                      if loaded.corrupt_file else "the checkpoint could not be read")
        else:
            reason = f"the records of claims {', '.join(loaded.unreadable_claims)} could not be read"
        self.log.warning(
            f"prepared-claim state was lost ({reason}): this start destroys no MIG device and deletes no CDI spec; "
            f"{len(adopted)} claim(s) adopted from their CDI specs (their MPS daemons and time-slice settings are "
            "not known and stay as they are)",
            adopted_claims=adopted, unowned_mig_kept=mig_kept, cdi_specs_kept=cdi_kept)

    def _dynamic_mig_gpus(self) -> set[str]:
        return {d.gpu_uuid for d in self._devices().values() if d.kind == KIND_MIG and d.mig_dynamic}

    def _destroy_unowned_mig(self) -> list[mig.MigLive]:
        """MIG devices on dynamic-MIG GPUs that no prepared claim owns are leftovers of a crash (or made by
        hand, which dynamic MIG forbids): destroy them so the published placements are really free."""
        gpus = sorted(self._dynamic_mig_gpus())
        if not gpus:
            return []
        keep = {(m.parent_uuid, m.gi_id, m.ci_id) for r in self.checkpoint.claims().values()
                for m in r.undo.mig_devices}
        try:
            return mig.destroy_unknown_mig_devices(self.nvml, keep, gpus=gpus)
        except (mig.MigError, self.nvml.NVMLError) as err:
            self.log.error("cleaning up unowned MIG devices failed", error=str(err))
            return []

    def close(self) -> None:
        """Stop accepting work. Prepared claims, their MIG devices and MPS daemons stay as they are."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ----- gRPC entry points ---------------------------------------------------------------------------------
    def prepare(self, claims: list[ClaimRef]) -> dict[str, PrepareResult]:
        with self._serialized():
            futures = {c.uid: self._pool.submit(self._prepare_timed, c) for c in claims}
            results = {uid: f.result() for uid, f in futures.items()}
        self._changed()
        return results

    def unprepare(self, claims: list[ClaimRef]) -> dict[str, UnprepareResult]:
        with self._serialized():
            futures = {c.uid: self._pool.submit(self._unprepare_timed, c) for c in claims}
            results = {uid: f.result() for uid, f in futures.items()}
        self._changed()
        return results

    def _changed(self) -> None:
        self._update_gauges()
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # noqa: BLE001 - observers must not fail a kubelet call
                self.log.exception("state change callback failed")

    @contextmanager
    def _serialized(self, reload: bool = True) -> Iterator[None]:
        if self.serialize_lock is None:
            yield
            return
        self.serialize_lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.serialize_lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if reload:
                self._reload()
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _reload(self) -> None:
        """Take over what another plugin process (rolling update) did: re-read the checkpoint and rebuild the
        in-memory sharing bookkeeping from it."""
        self.checkpoint.load()
        control = self.time_slicing.control
        self.time_slicing = TimeSlicing(control)
        old = self.mps
        self.mps = MpsSupervisor(old.control, old.root.parent)
        for uid, record in self.checkpoint.claims().items():
            if not record.completed:
                continue
            for ts in record.undo.time_slices:
                self.time_slicing.adopt(uid, _time_slice(ts))
            for daemon in record.undo.mps_daemons:
                self.mps.adopt(_mps_daemon(uid, daemon))

    def supervise_mps(self) -> list[str]:
        """Restart MPS daemons of prepared claims that died (call periodically)."""
        with self._serialized():
            return self.mps.supervise()

    # ----- bookkeeping -----------------------------------------------------------------------------------------
    def prepared_device_names(self) -> set[str]:
        return {d.device for r in self.checkpoint.claims().values() if r.completed for d in r.devices}

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            records = self.checkpoint.claims().values()
            self.metrics.prepared_claims.set(sum(1 for r in records if r.completed))
            self.metrics.dynamic_mig_devices.set(sum(len(r.undo.mig_devices) for r in records))

    def _claim_lock(self, uid: str) -> threading.Lock:
        with self._locks_guard:
            return self._claim_locks.setdefault(uid, threading.Lock())

    @contextmanager
    def _gpus_locked(self, uuids: Sequence[str]) -> Iterator[None]:
        # A fixed order (sorted UUIDs) so two claims on the same GPUs cannot deadlock.
        with ExitStack() as stack:
            for uuid in sorted(set(uuids)):
                with self._locks_guard:
                    lock = self._gpu_locks[uuid]
                stack.enter_context(lock)
            yield

    # ----- prepare -------------------------------------------------------------------------------------------
    def _prepare_timed(self, ref: ClaimRef) -> PrepareResult:
        log = self.log.bind(claim_uid=ref.uid, claim_namespace=ref.namespace, claim_name=ref.name)
        ctx = self.metrics.timed("prepare") if self.metrics else _null()
        with ctx:
            try:
                devices = self._prepare_claim(ref, log)
            except (ClaimError, PrepareError) as err:
                if isinstance(err, PlanError):
                    reason = "plan"              # allocation or opaque config not usable
                elif isinstance(err, ClaimError):
                    reason = "claim"             # claim missing, replaced or not allocated
                else:
                    reason = "prepare_devices"   # hardware, sharing or CDI step failed
                if self.metrics:
                    self.metrics.error("prepare", reason)
                log.error("prepare failed", error=str(err), reason=reason)
                return PrepareResult(error=str(err))
            except Exception as err:  # noqa: BLE001 - one claim's bug must not fail the others
                if self.metrics:
                    self.metrics.error("prepare", "internal")
                log.exception("prepare failed unexpectedly")
                return PrepareResult(error=f"internal error preparing claim {ref.describe()}: {err}")
        return PrepareResult(devices=tuple(devices))

    def _prepare_claim(self, ref: ClaimRef, log: Any) -> list[PreparedDevice]:
        with self._claim_lock(ref.uid):
            devices = self._prepare_locked(ref, log)
            if devices:
                self._publish_status(ref, log)
            return devices

    def _prepare_locked(self, ref: ClaimRef, log: Any) -> list[PreparedDevice]:
        record = self.checkpoint.get(ref.uid)
        if record is not None and record.completed and not record.recovered:
            log.debug("claim already prepared; returning the stored devices")
            return [_from_checkpoint(d) for d in record.devices]
        claim = self.claims.get_claim(ref.namespace, ref.name, ref.uid)
        log = log.bind(pods=_pods(claim))
        plans = plan_claim(claim, driver_name=self.driver_name, pool_name=self.pool_name,
                           devices=self._devices(), compat_nvidia=self.compat_nvidia)
        if record is not None and record.completed:
            return self._complete_recovered(ref, record, plans, log)
        if record is not None:
            log.info("rolling back an earlier half-done prepare before retrying")
            try:
                self._rollback(record)
            except Exception as err:  # noqa: BLE001
                raise PrepareError(f"claim {ref.describe()}: rolling back an earlier incomplete prepare failed: "
                                   f"{err}") from err
        if not plans:
            log.info("claim has no devices of this driver in this node's pool")
            return []
        self._book(ref, plans)
        self._crash_point("checkpoint-started")
        started = time.monotonic()
        try:
            with self._gpus_locked([p.device.gpu_uuid for p in plans]):
                devices = self._apply(ref, plans, log)
        except BaseException as err:
            self._undo_after_failure(ref, log)
            if isinstance(err, (PrepareError, ClaimError)):
                raise
            if isinstance(err, (SharingError, mig.MigError, OSError, ValueError)):
                raise PrepareError(f"claim {ref.describe()}: {err}") from err
            if isinstance(err, Exception) and isinstance(err, getattr(self.nvml, "NVMLError", ())):
                raise PrepareError(f"claim {ref.describe()}: NVML: {err}") from err
            raise
        log.info("claim prepared", devices=[d.device_name for d in devices],
                 cdi_device_ids=[i for d in devices for i in d.cdi_device_ids],
                 seconds=round(time.monotonic() - started, 4))
        return devices

    def _complete_recovered(self, ref: ClaimRef, record: ClaimRecord, plans: list[DevicePlan],
                            log: Any) -> list[PreparedDevice]:
        """A claim adopted from its CDI spec is prepared already; its allocation supplies what the spec could
        not (request names, admin access). Nothing is done to the hardware."""
        stored = {(d.device, d.share_id): d for d in record.devices}
        wanted = {(p.device.name, p.result.share_id) for p in plans}
        if wanted != set(stored):
            raise PrepareError(f"claim {ref.describe()}: the devices adopted from its CDI spec after the checkpoint "
                               f"was lost ({', '.join(sorted(n for n, _ in stored))}) are not its allocation "
                               f"({', '.join(sorted(n for n, _ in wanted))}); unprepare it (delete its pods) and "
                               "prepare it again")
        admin = {p.device.name for p in plans if p.result.admin_access}
        devices = tuple(stored[(p.device.name, p.result.share_id)].model_copy(update={
            "requests": (p.result.base_request,), "admin_access": p.result.admin_access}) for p in plans)
        # Admin access only watches a device: the MIG device belongs to the claim that uses it.
        undo = record.undo.model_copy(update={
            "mig_devices": tuple(m for m in record.undo.mig_devices if m.device not in admin)})
        self.checkpoint.put(record.model_copy(update={
            "namespace": ref.namespace, "name": ref.name, "devices": devices, "undo": undo, "recovered": False}))
        log.info("claim adopted from its CDI spec is prepared; its record is complete again",
                 devices=[d.device for d in devices])
        return [_from_checkpoint(d) for d in devices]

    # ----- claim status --------------------------------------------------------------------------------------
    def _status_devices(self, record: ClaimRecord) -> list[DeviceStatus]:
        """The status entries of a prepared claim: which GPU or MIG device each of its devices is."""
        catalog = self._devices()
        dynamic = {m.device: m for m in record.undo.mig_devices}
        out = []
        for d in record.devices:
            if d.pool != self.pool_name:
                continue
            data: dict[str, Any] = {}
            if d.uuid:
                data["uuid"] = d.uuid
            dev = catalog.get(d.device)
            if dev is not None:
                data["type"] = dev.kind
                if dev.gpu_uuid != d.uuid:
                    data["parentUUID"] = dev.gpu_uuid
                data["pciBusID"] = dev.gpu_pci_bus_id
                if dev.kind == KIND_MIG:
                    data["migProfile"] = dev.mig_profile_name
                    m = dynamic.get(d.device)
                    gi, ci = (m.gi_id, m.ci_id) if m is not None else (dev.mig_gi_id, dev.mig_ci_id)
                    if gi is not None and ci is not None:
                        data["gpuInstanceID"], data["computeInstanceID"] = gi, ci
            if d.admin_access:
                data["adminAccess"] = True
            out.append(DeviceStatus(pool=d.pool, device=d.device, share_id=d.share_id, data=data))
        return out

    def _publish_status(self, ref: ClaimRef, log: Any) -> None:
        """Best effort: a status the API server does not take never fails the prepare."""
        if self.status is None or ref.uid in self._status_published:
            return
        record = self.checkpoint.get(ref.uid)
        if record is None or not record.completed:
            return
        try:
            self.status.publish(ref, self._status_devices(record), record.updated or time.time())
        except Exception as err:  # noqa: BLE001 - the kubelet's answer does not depend on it
            self._count_status("publish", "error")
            log.warning("claim status not written; the claim is prepared all the same", error=str(err))
            return
        self._count_status("publish", "ok")
        self._status_published.add(ref.uid)

    def _withdraw_status(self, ref: ClaimRef, log: Any) -> None:
        self._status_published.discard(ref.uid)
        if self.status is None:
            return
        try:
            self.status.withdraw(ref)
        except Exception as err:  # noqa: BLE001 - the unprepare itself succeeded
            self._count_status("withdraw", "error")
            log.warning("claim status entries not removed", error=str(err))
            return
        self._count_status("withdraw", "ok")

    def _count_status(self, operation: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.claim_status_writes.labels(operation=operation, result=result).inc()

    def _book(self, ref: ClaimRef, plans: list[DevicePlan]) -> None:
        """Refuse devices another prepared (or preparing) claim holds, then write PrepareStarted."""
        with self._booking:
            held: dict[str, str] = {}
            for uid, r in self.checkpoint.claims().items():
                if uid == ref.uid:
                    continue
                for d in r.devices:
                    if d.pool == self.pool_name and not d.admin_access:
                        who = f"{r.namespace}/{r.name} ({uid})" if r.name else f"with UID {uid}"
                        held.setdefault(d.device, who)
            for p in plans:
                if p.result.admin_access or p.device.allow_multiple_allocations:
                    continue
                other = held.get(p.device.name)
                if other is not None:
                    raise PrepareError(f"device {p.device.name} (request {p.result.base_request!r}) is already "
                                       f"prepared for claim {other}; refusing to hand it out twice")
            planned = tuple(CheckpointDevice(device=p.device.name, pool=p.result.pool,
                                             requests=(p.result.base_request,), share_id=p.result.share_id)
                            for p in plans if not p.result.admin_access)
            self.checkpoint.put(ClaimRecord(uid=ref.uid, namespace=ref.namespace, name=ref.name,
                                            state=PREPARE_STARTED, devices=planned))

    def _add_undo(self, uid: str, **items: Any) -> None:
        def change(r: ClaimRecord) -> ClaimRecord:
            u = r.undo
            undo = UndoInfo(mig_devices=u.mig_devices + tuple(items.get("mig_devices", ())),
                            time_slices=u.time_slices + tuple(items.get("time_slices", ())),
                            mps_daemons=u.mps_daemons + tuple(items.get("mps_daemons", ())))
            return r.model_copy(update={"undo": undo})
        self.checkpoint.update(uid, change)

    def _apply(self, ref: ClaimRef, plans: list[DevicePlan], log: Any) -> list[PreparedDevice]:
        mig_ids = self._realize_mig(ref.uid, plans, log)
        self._apply_time_slices(ref, plans, log)
        mounts = self._start_mps(ref.uid, plans, mig_ids, log)
        return self._write_cdi_and_complete(ref.uid, plans, mig_ids, mounts)

    def _realize_mig(self, uid: str, plans: list[DevicePlan], log: Any) -> dict[int, tuple[str, int, int]]:
        """Create dynamic MIG devices; returns (MIG uuid, GI id, CI id) per plan index of every MIG device."""
        dynamic_gpus = self._dynamic_mig_gpus()
        mig_ids: dict[int, tuple[str, int, int]] = {}
        for i, p in enumerate(plans):
            d = p.device
            if d.kind != KIND_MIG:
                if d.gpu_uuid in dynamic_gpus and not p.result.admin_access:
                    # Used whole (or by slots/shares): MIG mode must be off for CUDA to see all of the GPU.
                    self._ensure_whole_gpu(d)
                continue
            if d.mig_dynamic and p.result.admin_access:
                mig_ids[i] = self._existing_dynamic_mig(d)
            elif d.mig_dynamic:
                assert d.mig_profile_id is not None and d.mig_start is not None
                live = mig.create_mig_device(self.nvml, d.gpu_uuid, d.mig_profile_id, d.mig_start)
                self._crash_point("mig-created")
                self._add_undo(uid, mig_devices=[MigUndo(
                    device=d.name, parent_uuid=d.gpu_uuid, gi_id=live.gi_id, ci_id=live.ci_id,
                    mig_uuid=live.uuid, profile_id=d.mig_profile_id, start=d.mig_start)])
                log.info("created MIG device", device=d.name, mig_uuid=live.uuid, gi=live.gi_id, ci=live.ci_id)
                if self.mig_listener is not None:
                    self.mig_listener.bind_mig(d.name, d.gpu_uuid, live.gi_id, live.ci_id)
                mig_ids[i] = (live.uuid, live.gi_id, live.ci_id)
            elif d.mig_uuid is None or d.mig_gi_id is None or d.mig_ci_id is None:
                raise PrepareError(f"device {d.name}: static MIG device without GI/CI identity")
            else:
                mig_ids[i] = (d.mig_uuid, d.mig_gi_id, d.mig_ci_id)
        return mig_ids

    def _apply_time_slices(self, ref: ClaimRef, plans: list[DevicePlan], log: Any) -> None:
        """One interval per GPU for this claim; the GPU-wide setting is shared with other claims on it."""
        intervals: dict[str, str] = {}
        for p in plans:
            if p.timeslice is None:
                continue
            prev = intervals.setdefault(p.device.gpu_uuid, p.timeslice)
            if prev != p.timeslice:
                raise PrepareError(f"claim {ref.describe()}: GPU {p.device.gpu_uuid} would get time-slice intervals "
                                   f"{prev} and {p.timeslice} from different requests; use one interval per GPU")
        for gpu_uuid, interval in sorted(intervals.items()):
            # Write-ahead: the undo record (with the interval to go back to) is checkpointed before the GPU is
            # changed, so a crash right after the change is rolled back at the next start. Undoing an intent
            # that never reached the GPU only sets the interval it already has.
            intent = self.time_slicing.intent(ref.uid, [gpu_uuid], interval)
            self._add_undo(ref.uid, time_slices=[TimeSliceUndo(
                gpu_uuids=intent.gpu_uuids, interval=intent.interval, previous=intent.previous)])
            try:
                applied = self.time_slicing.apply(ref.uid, [gpu_uuid], interval)
            except BaseException:
                # apply() changes all or nothing: no intent is left for the rollback to undo.
                self._drop_undo(ref.uid, time_slice=intent.gpu_uuids)
                raise
            self._crash_point("timeslice-applied")
            if applied != intent:   # cannot happen while we hold the GPU; keep the record true if it does
                self._set_time_slice_undo(ref.uid, applied)
            log.info("time-slice applied", gpu=gpu_uuid, interval=interval)

    def _set_time_slice_undo(self, uid: str, applied: TimeSliceApplied) -> None:
        def change(r: ClaimRecord) -> ClaimRecord:
            kept = tuple(t for t in r.undo.time_slices if tuple(t.gpu_uuids) != tuple(applied.gpu_uuids))
            entry = TimeSliceUndo(gpu_uuids=applied.gpu_uuids, interval=applied.interval, previous=applied.previous)
            return r.model_copy(update={"undo": r.undo.model_copy(update={"time_slices": kept + (entry,)})})
        self.checkpoint.update(uid, change)

    def _start_mps(self, uid: str, plans: list[DevicePlan], mig_ids: dict[int, tuple[str, int, int]],
                   log: Any) -> dict[str, MpsMounts]:
        """One MPS daemon per physical GPU of the claim, serving the claim's devices there (a GPU UUID, or MIG
        UUIDs). Limits of several devices on one GPU add up. Returns the daemon directories per device UUID."""
        groups: dict[str, _MpsGroup] = {}
        for i, p in enumerate(plans):
            if p.mps is None:
                continue
            d = p.device
            uuid = mig_ids[i][0] if i in mig_ids else d.gpu_uuid
            g = groups.setdefault(d.gpu_uuid, _MpsGroup(d.gpu_uuid, {}, None, {}))
            g.devices[uuid] = g.devices.get(uuid, False) or d.kind == KIND_GPU
            if p.mps.thread_percentage is None:
                g.unlimited_threads = True
            else:
                g.threads = min(100, (g.threads or 0) + p.mps.thread_percentage)
            if p.mps.pinned_memory_limit_bytes is not None:
                mib = max(1, p.mps.pinned_memory_limit_bytes // MIB)
                g.limits_mib[uuid] = g.limits_mib.get(uuid, 0) + mib
        mounts: dict[str, MpsMounts] = {}
        for _parent, g in sorted(groups.items()):
            devices = [MpsDevice(uuid=u, exclusive=ex) for u, ex in g.devices.items()]
            threads = None if g.unlimited_threads else g.threads
            daemon_id = mps_daemon_id(uid, [d.uuid for d in devices])
            base = self.mps.root / daemon_id
            # Recorded before it starts: a crash right after the start must still find it to stop.
            intent = MpsDaemon(daemon_id=daemon_id, claim_uid=uid, gpu_uuids=tuple(d.uuid for d in devices),
                               pipe_dir=str(base / "pipe"), log_dir=str(base / "log"), shm_dir=str(base / "shm"),
                               compute_mode_set=tuple(d.uuid for d in devices
                                                      if d.exclusive and not d.uuid.startswith("MIG-")),
                               active_thread_percentage=threads, pinned_memory_limit_mib=dict(g.limits_mib))
            self._add_undo(uid, mps_daemons=[_mps_undo(intent)])
            daemon = self.mps.start(uid, devices, active_thread_percentage=threads,
                                    pinned_memory_limit_mib=g.limits_mib)
            self._crash_point("mps-started")
            if daemon.pipe_dir != intent.pipe_dir:
                raise PrepareError(f"MPS daemon {daemon.daemon_id}: started with unexpected directories")
            log.info("MPS daemon started", daemon_id=daemon.daemon_id, devices=list(daemon.gpu_uuids),
                     active_thread_percentage=threads, pinned_memory_limit_mib=dict(g.limits_mib))
            for u in daemon.gpu_uuids:
                mounts[u] = MpsMounts(pipe_dir=daemon.pipe_dir, log_dir=daemon.log_dir, shm_dir=daemon.shm_dir)
        return mounts

    def _write_cdi_and_complete(self, uid: str, plans: list[DevicePlan], mig_ids: dict[int, tuple[str, int, int]],
                                mounts: dict[str, MpsMounts]) -> list[PreparedDevice]:
        """Write the claim's CDI spec (one CDI device per allocated device, per share for shares), then record
        PrepareCompleted with the answer for the kubelet."""
        cdi_devices: list[ClaimDevice] = []
        for i, p in enumerate(plans):
            d = p.device
            uuid, gi_ci = (mig_ids[i][0], (mig_ids[i][1], mig_ids[i][2])) if i in mig_ids else (d.gpu_uuid, None)
            cdi_devices.append(ClaimDevice(
                name=d.name, uuid=uuid, gpu_minor=d.gpu_minor, gpu_index=d.gpu_index, mig=gi_ci,
                requests=(p.result.base_request,), share_id=p.result.share_id,
                mps=mounts.get(uuid) if p.mps is not None else None))
        ids = self.cdi.write_claim_spec(uid, cdi_devices)
        self._crash_point("cdi-written")
        prepared = [PreparedDevice(request_names=(p.result.base_request,), pool_name=p.result.pool,
                                   device_name=p.device.name, cdi_device_ids=tuple(ids[i]),
                                   share_id=p.result.share_id) for i, p in enumerate(plans)]
        # Admin-access devices are recorded as watched, not held: they must not block the claim they watch.
        stored = tuple(CheckpointDevice(device=x.device_name, pool=x.pool_name, requests=x.request_names,
                                        cdi_device_ids=x.cdi_device_ids, share_id=x.share_id,
                                        uuid=cdi_devices[i].uuid, admin_access=plans[i].result.admin_access)
                       for i, x in enumerate(prepared))
        self.checkpoint.update(uid, lambda r: r.model_copy(update={"state": PREPARE_COMPLETED, "devices": stored}))
        return prepared

    def _existing_dynamic_mig(self, d: Device) -> tuple[str, int, int]:
        """Admin access to a dynamic MIG placement: only meaningful while a claim has it created."""
        for r in self.checkpoint.claims().values():
            for m in r.undo.mig_devices:
                if m.device == d.name and m.mig_uuid:
                    return (m.mig_uuid, m.gi_id, m.ci_id)
        raise PrepareError(f"device {d.name}: admin access to a dynamic MIG placement needs a claim that has it "
                           "created; none has")

    def _ensure_whole_gpu(self, d: Device) -> None:
        try:
            mig.disable_mig_mode_if_unused(self.nvml, d.gpu_uuid)
            handle = self.nvml.nvmlDeviceGetHandleByUUID(d.gpu_uuid)
            enabled = mig.mig_enabled(self.nvml, handle)
        except self.nvml.NVMLError as err:
            raise PrepareError(f"device {d.name}: reading MIG mode of GPU {d.gpu_uuid} failed: {err}") from err
        if enabled:
            raise PrepareError(f"device {d.name}: GPU {d.gpu_uuid} is in MIG mode with MIG devices present, so it "
                               "cannot be used whole")

    # ----- undo ----------------------------------------------------------------------------------------------
    def _undo_after_failure(self, ref: ClaimRef, log: Any) -> None:
        record = self.checkpoint.get(ref.uid)
        if record is None:
            return
        try:
            self._rollback(record)
        except Exception as err:  # noqa: BLE001 - the record stays; the next attempt rolls back again
            log.error("undoing a failed prepare failed; will retry on the next attempt", error=str(err))

    def _rollback(self, record: ClaimRecord) -> None:
        """Undo everything a record says was done, then forget it."""
        with self._gpus_locked(self._record_gpus(record)):
            self._undo(record)
        self.cdi.delete_claim_spec(record.uid)
        self.checkpoint.remove(record.uid)

    def _record_gpus(self, record: ClaimRecord) -> list[str]:
        by_name = self._devices()
        uuids = {by_name[d.device].gpu_uuid for d in record.devices if d.device in by_name}
        uuids |= {m.parent_uuid for m in record.undo.mig_devices}
        uuids |= {u for t in record.undo.time_slices for u in t.gpu_uuids}
        return sorted(uuids)

    def _undo(self, record: ClaimRecord) -> None:
        """Stop MPS daemons (they use the MIG devices), destroy MIG devices, release time-slices; each step is
        checkpointed as it completes so a failure resumes where it stopped."""
        uid = record.uid
        for daemon in record.undo.mps_daemons:
            self.mps.stop(_mps_daemon(uid, daemon))
            self._drop_undo(uid, mps_daemon=daemon.daemon_id)
        parents = set()
        for m in record.undo.mig_devices:
            mig.destroy_mig_device(self.nvml, m.parent_uuid, m.gi_id, m.ci_id, m.mig_uuid)
            parents.add(m.parent_uuid)
            if self.mig_listener is not None:
                self.mig_listener.unbind_mig(m.device)
            self._drop_undo(uid, mig=(m.parent_uuid, m.gi_id, m.ci_id))
        for parent in sorted(parents):
            try:
                mig.disable_mig_mode_if_unused(self.nvml, parent)
            except mig.MigError as err:
                self.log.warning("could not switch MIG mode off after the last MIG device", gpu=parent,
                                 error=str(err))
        for ts in record.undo.time_slices:
            self.time_slicing.release(uid, _time_slice(ts))
            self._drop_undo(uid, time_slice=tuple(ts.gpu_uuids))

    def _drop_undo(self, uid: str, *, mps_daemon: str | None = None, mig: tuple[str, int, int] | None = None,
                   time_slice: tuple[str, ...] | None = None) -> None:
        if self.checkpoint.get(uid) is None:
            return

        def change(r: ClaimRecord) -> ClaimRecord:
            u = r.undo
            return r.model_copy(update={"undo": UndoInfo(
                mps_daemons=tuple(d for d in u.mps_daemons if d.daemon_id != mps_daemon),
                mig_devices=tuple(m for m in u.mig_devices if (m.parent_uuid, m.gi_id, m.ci_id) != mig),
                time_slices=tuple(t for t in u.time_slices if tuple(t.gpu_uuids) != time_slice),
            )})
        self.checkpoint.update(uid, change)

    # ----- unprepare -----------------------------------------------------------------------------------------
    def _unprepare_timed(self, ref: ClaimRef) -> UnprepareResult:
        log = self.log.bind(claim_uid=ref.uid, claim_namespace=ref.namespace, claim_name=ref.name)
        ctx = self.metrics.timed("unprepare") if self.metrics else _null()
        with ctx:
            try:
                with self._claim_lock(ref.uid):
                    record = self.checkpoint.get(ref.uid)
                    if record is None:
                        # Never prepared here, or already unprepared: success. A stray CDI file goes too.
                        self.cdi.delete_claim_spec(ref.uid)
                        log.debug("claim not prepared on this node; nothing to undo")
                        return UnprepareResult()
                    self._rollback(record)
                    if record.completed:   # only a completed prepare has status entries to remove
                        self._withdraw_status(ref, log)
                with self._locks_guard:
                    self._claim_locks.pop(ref.uid, None)
            except Exception as err:  # noqa: BLE001 - reported to the kubelet, which retries
                if self.metrics:
                    self.metrics.error("unprepare", type(err).__name__)
                log.error("unprepare failed", error=str(err))
                return UnprepareResult(error=f"unprepare of claim {ref.describe()}: {err}")
        log.info("claim unprepared", devices=[d.device for d in record.devices])
        return UnprepareResult()


@contextmanager
def _null() -> Iterator[None]:
    yield

