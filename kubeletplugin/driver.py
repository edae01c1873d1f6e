"""Prepare and unprepare ResourceClaims on this node.

One claim, end to end (``Driver._prepare_claim``):

1. A claim already ``PrepareCompleted`` in the checkpoint gets the stored answer (no API read, no work).
2. Read the ResourceClaim (``ClaimSource``), check its UID and allocation, and plan it (``kubeletplugin.plan``:
   this driver's results in this node's pool, effective opaque config per request, decoded strictly).
3. A ``PrepareStarted`` record from an earlier attempt is rolled back first.
4. Book the devices: check that no other prepared claim holds them (the last line of defence against double
   allocation) and write ``PrepareStarted`` — both under one short lock.
5. Under the claim's GPU locks: the hardware steps of ``kubeletplugin.deviceactions`` (dynamic MIG devices,
   time-slice intervals, MPS daemons), each recorded in the checkpoint for its undo.
6. Write the claim's CDI spec (``dra.node.cdi``), then ``PrepareCompleted`` with the devices returned to the
   kubelet.
7. Report the prepared devices in the claim's ``status.devices`` (``kubeletplugin.claimstatus``): Ready, and
   which GPU or MIG device is used. A failed status write is logged and counted; the prepare still succeeds.

A failure fails that claim only (its error names the problem) and undoes what was done; the claim and its pods
get a Warning Event ``PrepareFailed`` with that line (``kube.events``: after the answer, deduplicated per
claim). Claims of one call prepare in parallel; unrelated claims never wait for each other except on a GPU they both touch.

Start-up recovery (crash, restart, lost checkpoint) is ``kubeletplugin.recovery``.

Unprepare works from the checkpoint alone (the claim may be deleted): stop MPS daemons, destroy MIG devices,
release time-slice settings, delete the CDI spec, forget the claim, then remove our ``status.devices`` entries
(best effort, as above). Unknown claims are a success.

Test hook: ``GPU_DRA_FAULT=crash-after:<step>`` in the environment makes the process exit at once with status
137 (as if SIGKILLed) at that point of a prepare, so tests can prove recovery. Steps: ``checkpoint-started``
(PrepareStarted written, nothing done), ``mig-created`` (a dynamic MIG device exists that the checkpoint does
not know yet), ``timeslice-applied`` (a GPU's time-slice interval was changed; only the write-ahead record knows
it), ``mps-use-recorded`` (the claim's use of an MPS daemon is recorded, no daemon yet),
``mps-record-temp-written`` (the daemon's record is in its temporary file, not yet renamed into place),
``mps-compute-mode-set`` (the GPU is in EXCLUSIVE_PROCESS for a daemon not yet started; only the daemon's record
on disk knows it), ``mps-started`` (an MPS daemon runs), ``cdi-written`` (the CDI spec exists, the claim is not yet
PrepareCompleted). An unknown value stops the driver from starting. Never set it outside tests.
"""
from __future__ import annotations

import fcntl
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import structlog

from dra.model.tenancy import GpuTenant, mps_served, tolerates_tenancy
from dra.node import migdevices as mig
from dra.node.cdi import CdiSpecWriter, ClaimDevice
from dra.node.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    CheckpointStore,
    ClaimRecord,
    DeviceHeld,
    ReservedPod,
)
from dra.node.checkpoint import PreparedDevice as CheckpointDevice
from dra.node.sharing import MpsDaemons, TimeSlicing
from dra.node.sharingtools import SharingError
from kubeletplugin.claims import ClaimError, ClaimSource, reserved_pods
from kubeletplugin.claimstatus import ClaimStatusReporter, ClaimStatusWriter
from kubeletplugin.deviceactions import Applied, ClaimActions, DeviceCatalog, MigListener, PrepareError
from kubeletplugin.keyedlocks import KeyedLocks
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.options import MAX_PARALLEL_CLAIMS
from kubeletplugin.plan import DevicePlan, plan_claim
from kubeletplugin.recovery import StartupReport, recover_at_start
from kubeletplugin.transport.nodedriver import ClaimRef, PreparedDevice, PrepareResult, UnprepareResult

FAULT_ENV = "GPU_DRA_FAULT"
CRASH_STEPS = ("checkpoint-started", "mig-created", "timeslice-applied", "mps-use-recorded", "mps-record-temp-written",
               "mps-compute-mode-set", "mps-started", "cdi-written")


def crash_step_from_env() -> str | None:
    """The test hook's step (see the module docstring), or None when it is not set."""
    value = os.environ.get(FAULT_ENV, "").strip()
    if not value:
        return None
    step = value.removeprefix("crash-after:")
    if not value.startswith("crash-after:") or step not in CRASH_STEPS:
        raise ValueError(f"{FAULT_ENV}={value!r}: expected crash-after:<step>, step one of {', '.join(CRASH_STEPS)}")
    return step


def _reserved_for(claim: Mapping[str, Any]) -> tuple[ReservedPod, ...]:
    """The pods the claim is reserved for: for the record (per-claim metrics) and log context."""
    return tuple(ReservedPod(name=name, uid=uid) for name, uid in reserved_pods(claim))


def _from_checkpoint(d: CheckpointDevice) -> PreparedDevice:
    return PreparedDevice(request_names=tuple(d.requests), pool_name=d.pool, device_name=d.device,
                          cdi_device_ids=tuple(d.cdi_device_ids), share_id=d.share_id)


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
        mps: MpsDaemons,
        time_slicing: TimeSlicing,
        compat_nvidia: bool = False,
        metrics: PluginMetrics | None = None,
        max_parallel: int = MAX_PARALLEL_CLAIMS,
        call_budget_s: float = 30.0,
        serialize_lock: Path | str | None = None,
        mig_listener: MigListener | None = None,
        on_change: Callable[[], None] | None = None,
        status: ClaimStatusWriter | None = None,
        events: Any = None,
        log: Any = None,
    ) -> None:
        self.driver_name = driver_name
        self.pool_name = pool_name
        self._devices = devices
        self.claims = claims
        self.checkpoint = checkpoint
        self.cdi = cdi
        self.nvml = nvml
        self.compat_nvidia = compat_nvidia
        self.metrics = metrics
        # Rolling updates: two plugin processes share the state directory; each call then runs under a file
        # lock and starts from the checkpoint on disk.
        self.serialize_lock = Path(serialize_lock) if serialize_lock else None
        self.call_budget_s = call_budget_s
        self.on_change = on_change          # called after every prepare/unprepare call (e.g. device gauges)
        self.log = log or structlog.get_logger("driver")
        self.actions = ClaimActions(checkpoint=checkpoint, nvml=nvml, mps=mps, time_slicing=time_slicing,
                                    devices=devices, mig_listener=mig_listener, crash_point=self._crash_point,
                                    log=self.log)
        self.reporter = ClaimStatusReporter(status, pool_name, devices, metrics)
        # kube.events.ClaimEventRecorder: a failed prepare becomes a Warning Event on the claim and its pods,
        # queued after the answer like the status (None: no Events).
        self.events = events
        # Claims are I/O-bound (API read, file writes, NVML calls): one call's claims run side by side, each
        # waiting only for the GPUs it shares with another claim.
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="claim")
        self._claim_locks = KeyedLocks()    # one claim at a time per UID (prepare and unprepare alike)
        self._gpu_locks = KeyedLocks()      # hardware steps of claims sharing a GPU, one at a time
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

    @property
    def mps(self) -> MpsDaemons:
        return self.actions.mps

    @property
    def status(self) -> ClaimStatusWriter | None:
        """Where status.devices of prepared claims go; None: not reported."""
        return self.reporter.writer

    @status.setter
    def status(self, writer: ClaimStatusWriter | None) -> None:
        self.reporter.writer = writer

    # ----- start-up ------------------------------------------------------------------------------------------
    def start(self) -> StartupReport:
        """Load the checkpoint and bring the node in line with it. Call once before serving the kubelet."""
        with self._serialized(reload=False):
            return self._start()

    def _start(self) -> StartupReport:
        report = recover_at_start(checkpoint=self.checkpoint, cdi=self.cdi, actions=self.actions,
                                  rollback=self._rollback, devices=self._devices(), nvml=self.nvml,
                                  pool_name=self.pool_name, log=self.log, claims=self.claims,
                                  driver_name=self.driver_name)
        self._update_gauges()
        return report

    def close(self) -> None:
        """Stop accepting work. Prepared claims, their MIG devices and MPS daemons stay as they are."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.reporter.close()
        if self.events is not None:
            self.events.close()
        self.checkpoint.close()      # the journal folded into the snapshot: a clean stop leaves one file

    # ----- gRPC entry points ---------------------------------------------------------------------------------
    def prepare(self, claims: list[ClaimRef], arrived: float | None = None) -> dict[str, PrepareResult]:
        return self._call(claims, self._prepare_timed, PrepareResult, arrived)

    def unprepare(self, claims: list[ClaimRef], arrived: float | None = None) -> dict[str, UnprepareResult]:
        return self._call(claims, self._unprepare_timed, UnprepareResult, arrived)

    def _call(self, claims: list[ClaimRef], work: Callable[[ClaimRef], Any], result: Callable[..., Any],
              arrived: float | None) -> dict[str, Any]:
        """One kubelet call: its claims side by side. A claim not started within ``call_budget_s`` of the call's
        arrival (``arrived``, monotonic; None: now) is not started at all and answered with an error the kubelet
        retries, so that a call of any size is answered before the kubelet's 45 s deadline (an answer that comes
        too late is lost, and its work with it). The budget counts from the arrival: the time the call took to
        reach this point (decoding it, waiting for the driver or for the other plugin process of a rolling
        update) is gone from the kubelet's deadline too."""
        deadline = (time.monotonic() if arrived is None else arrived) + self.call_budget_s

        def bounded(ref: ClaimRef) -> Any:
            if time.monotonic() > deadline:
                return result(error=f"claim {ref.describe()}: not started, this call of {len(claims)} claims used "
                                    f"its {self.call_budget_s:.0f} s budget; the kubelet retries it")
            return work(ref)

        with self._serialized(), self.reporter.busy():
            if len(claims) == 1:     # the common call: no hand-over to a pool thread and back
                results = {claims[0].uid: bounded(claims[0])}
            else:
                futures = {c.uid: self._pool.submit(bounded, c) for c in claims}
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
        """Take over what another plugin process (rolling update) did, if it did anything: re-read the
        checkpoint and rebuild the in-memory sharing bookkeeping from it."""
        if not self.checkpoint.refresh():
            return
        self.actions.time_slicing = TimeSlicing(self.actions.time_slicing.control)
        for record in self.checkpoint.claims().values():
            if record.completed:
                self.actions.adopt(record)

    def supervise_mps(self) -> list[str]:
        """Restart MPS daemons of prepared claims that died (call periodically). Each under its GPU's lock, so
        a daemon whose last claim is leaving right now is not started again."""
        restarted: list[str] = []
        with self._serialized():
            for device, gpu in sorted(self.actions.mps_devices_in_use().items()):
                with self._gpu_locks.hold(gpu):
                    if device in self.actions.mps_devices_in_use():
                        restarted += self.actions.mps.supervise({device: gpu})
        return restarted

    # ----- bookkeeping -----------------------------------------------------------------------------------------
    def mps_tenants(self) -> dict[str, GpuTenant]:
        """GPU UUID -> the one namespace its MPS daemon serves, from the claims recorded as its clients (started
        or completed: the tenancy is decided when a claim joins the daemon). A GPU whose daemon serves several
        namespaces (node policy mps.shareAcrossNamespaces) or a claim of unknown namespace (a record rebuilt after
        a lost checkpoint) has no one tenant."""
        if self.mps.policy.share_across_namespaces:
            return {}
        by_gpu: dict[str, list[ClaimRecord]] = {}
        for record in self.checkpoint.claims().values():
            for gpu in {u.gpu for u in record.undo.mps_devices if u.device == u.gpu}:
                by_gpu.setdefault(gpu, []).append(record)
        tenants = {}
        for gpu, records in by_gpu.items():
            namespaces = {r.namespace for r in records}
            if len(namespaces) == 1 and "" not in namespaces:
                tenants[gpu] = GpuTenant(namespace=records[0].namespace,
                                         tolerated=all(r.mps_tenancy_tolerated for r in records))
        return tenants

    def prepared_device_names(self) -> set[str]:
        return {d.device for r in self.checkpoint.claims().values() if r.completed for d in r.devices}

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            records = self.checkpoint.claims().values()
            self.metrics.prepared_claims.set(sum(1 for r in records if r.completed))
            self.metrics.dynamic_mig_devices.set(sum(len(r.undo.mig_devices) for r in records))

    # ----- prepare -------------------------------------------------------------------------------------------
    def _prepare_timed(self, ref: ClaimRef) -> PrepareResult:
        log = self.log.bind(claim_uid=ref.uid, claim_namespace=ref.namespace, claim_name=ref.name)
        ctx = self.metrics.timed("prepare") if self.metrics else _null()
        with ctx:
            try:
                devices = self._prepare_claim(ref, log)
            except (ClaimError, PrepareError) as err:
                # plan: allocation or opaque config not usable; claim: claim missing, replaced or
                # not allocated; unavailable / forbidden / api: the claim could not be read now;
                # prepare_devices: a hardware, sharing or CDI step failed.
                reason = err.reason if isinstance(err, ClaimError) else "prepare_devices"
                if self.metrics:
                    self.metrics.error("prepare", reason)
                log.error("prepare failed", error=str(err), reason=reason)
                self._prepare_failed(ref, str(err))
                return PrepareResult(error=str(err))
            except Exception as err:  # noqa: BLE001 - one claim's bug must not fail the others
                if self.metrics:
                    self.metrics.error("prepare", "internal")
                log.exception("prepare failed unexpectedly")
                self._prepare_failed(ref, f"internal error preparing claim {ref.describe()}: {err}")
                return PrepareResult(error=f"internal error preparing claim {ref.describe()}: {err}")
        if self.events is not None:
            self.events.forget(ref.uid)
        return PrepareResult(devices=tuple(devices))

    def _prepare_failed(self, ref: ClaimRef, message: str) -> None:
        if self.events is not None:
            from kube.events import PREPARE_FAILED

            self.events.warn(ref.namespace, ref.name, ref.uid, PREPARE_FAILED, message)

    def _prepare_claim(self, ref: ClaimRef, log: Any) -> list[PreparedDevice]:
        with self._claim_locks.hold(ref.uid):
            devices = self._prepare_locked(ref, log)
            if devices:
                self.reporter.publish(ref, self.checkpoint.get(ref.uid), log)
            return devices

    def _prepare_locked(self, ref: ClaimRef, log: Any) -> list[PreparedDevice]:
        conflict = self.checkpoint.conflict_of(ref.uid)
        if conflict is not None:
            raise PrepareError(f"claim {ref.describe()}: the checkpoint is damaged: {conflict.describe()}, and the "
                               "API server did not settle which one it is allocated to; the device stays out of use "
                               "until the next start of the plugin settles it or the other claim is unprepared")
        record = self.checkpoint.get(ref.uid)
        if record is not None and record.completed and not record.recovered:
            log.debug("claim already prepared; returning the stored devices")
            return [_from_checkpoint(d) for d in record.devices]
        claim = self.claims.get_claim(ref.namespace, ref.name, ref.uid)
        reserved = _reserved_for(claim)
        log = log.bind(pods=[p.name for p in reserved])
        plans = plan_claim(claim, driver_name=self.driver_name, pool_name=self.pool_name,
                           devices=self._devices(), compat_nvidia=self.compat_nvidia,
                           mps_limits_above_share=self.mps.policy.limits_above_share)
        if record is not None and record.completed:
            return self._complete_recovered(ref, record, plans, reserved, log)
        if record is not None:
            log.info("rolling back an earlier half-done prepare before retrying")
            try:
                self._rollback(record)
            except Exception as err:
                raise PrepareError(f"claim {ref.describe()}: rolling back an earlier incomplete prepare failed: "
                                   f"{err}") from err
        if not plans:
            log.info("claim has no devices of this driver in this node's pool")
            return []
        self._book(ref, plans, reserved)
        self._crash_point("checkpoint-started")
        started = time.monotonic()
        try:
            # GPU locks only around the hardware steps: the CDI spec and the record are the claim's own.
            with self._gpu_locks.hold_all(p.device.gpu_uuid for p in plans):
                applied = self.actions.apply(ref, plans, log)
            devices = self._write_cdi_and_complete(ref.uid, plans, applied)
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
                            reserved: tuple[ReservedPod, ...], log: Any) -> list[PreparedDevice]:
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
            "namespace": ref.namespace, "name": ref.name, "devices": devices, "undo": undo, "recovered": False,
            "reserved_for": reserved}))
        log.info("claim adopted from its CDI spec is prepared; its record is complete again",
                 devices=[d.device for d in devices])
        return [_from_checkpoint(d) for d in devices]

    def _book(self, ref: ClaimRef, plans: list[DevicePlan], reserved: tuple[ReservedPod, ...]) -> None:
        """Record PrepareStarted, refusing devices another prepared (or preparing) claim holds in the same step
        (the last line of defence against double allocation). Written ahead only when the prepare changes the
        hardware: otherwise a crash leaves at most a CDI spec, which the next start removes as an orphan."""
        planned = tuple(CheckpointDevice(device=p.device.name, pool=p.result.pool,
                                         requests=(p.result.base_request,), share_id=p.result.share_id)
                        for p in plans if not p.result.admin_access)
        exclusive = [(p.result.pool, p.device.name) for p in plans
                     if not p.result.admin_access and not p.device.allow_multiple_allocations]
        tolerated = all(tolerates_tenancy(p.result.tolerations, self.driver_name, ref.namespace)
                        for p in plans if mps_served(p.device))
        try:
            self.checkpoint.put(ClaimRecord(uid=ref.uid, namespace=ref.namespace, name=ref.name,
                                            state=PREPARE_STARTED, devices=planned, reserved_for=reserved,
                                            mps_tenancy_tolerated=tolerated),
                                exclusive=exclusive, durable=self.actions.changes_hardware(plans))
        except DeviceHeld as held:
            request = next(p.result.base_request for p in plans if p.device.name == held.device)
            raise PrepareError(f"device {held.device} (request {request!r}) is already prepared for claim "
                               f"{held.who}; refusing to hand it out twice") from None

    def _write_cdi_and_complete(self, uid: str, plans: list[DevicePlan], applied: Applied) -> list[PreparedDevice]:
        """Write the claim's CDI spec (one CDI device per allocated device, per share for shares), then record
        PrepareCompleted with the answer for the kubelet."""
        cdi_devices: list[ClaimDevice] = []
        for i, p in enumerate(plans):
            d = p.device
            mig_id = applied.mig_ids.get(i)
            uuid, gi_ci = (mig_id[0], (mig_id[1], mig_id[2])) if mig_id else (d.gpu_uuid, None)
            cdi_devices.append(ClaimDevice(
                name=d.name, uuid=uuid, gpu_minor=d.gpu_minor, gpu_index=d.gpu_index, mig=gi_ci,
                more_mig=applied.more_mig_ids.get(i, ()),
                requests=(p.result.base_request,), share_id=p.result.share_id,
                mps=applied.mps_mounts.get(uuid) if p.mps is not None else None,
                env=applied.mps_env if p.mps is not None else ()))
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
        with self._gpu_locks.hold_all(self.actions.gpus_of(record)):
            self.actions.undo(record)
        self.cdi.delete_claim_spec(record.uid)
        self.checkpoint.remove(record.uid)

    # ----- unprepare -----------------------------------------------------------------------------------------
    def _unprepare_timed(self, ref: ClaimRef) -> UnprepareResult:
        log = self.log.bind(claim_uid=ref.uid, claim_namespace=ref.namespace, claim_name=ref.name)
        ctx = self.metrics.timed("unprepare") if self.metrics else _null()
        with ctx:
            try:
                with self._claim_locks.hold(ref.uid):
                    record = self.checkpoint.get(ref.uid)
                    if record is None:
                        # Never prepared here, or already unprepared: success. A stray CDI file goes too.
                        self.cdi.delete_claim_spec(ref.uid)
                        log.debug("claim not prepared on this node; nothing to undo")
                        return UnprepareResult()
                    self._rollback(record)
                    self.reporter.forget(ref)
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

