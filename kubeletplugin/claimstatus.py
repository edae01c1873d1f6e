"""This driver's entries in ``ResourceClaim.status.devices``: what was prepared, and how it can be found.

After a claim is prepared, each of its devices from this node's pool gets an entry keyed by (driver, pool,
device, shareID) with a ``Ready`` condition and ``data`` that says which GPU or MIG device was actually used
(a dynamic MIG device's UUID exists only from the prepare on, so dashboards could not attribute it before).
An unprepare writes nothing: the API server itself drops the status entries of devices a claim no longer has
allocated (at deallocation, and with the claim when it is deleted), which follows every unprepare of a pod's
last use of the claim within moments; a write per pod to remove them first would double the status traffic.

Writes use server-side apply on the ``status`` subresource with a field manager of this driver and pool: the
apply body lists exactly our entries, so the API server merges them with other drivers' entries (the list is
a map keyed by driver, pool, device and shareID).
The body names the claim's UID, so a claim deleted and re-created under the same name is never written.

RBAC (deploy/helm, rbac-kubelet-plugin.yaml): ``patch`` on ``resourceclaims/status``, plus
``associated-node:patch`` on ``resourceclaims/driver`` for the driver name, which the API server checks for
status.devices writes by a plugin whose token names the claim's node (Kubernetes 1.36+).

Failures are the caller's to log: the kubelet's contract is the gRPC answer, which never waits on them.
"""
from __future__ import annotations

import hashlib
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from dra.model.devices import KIND_MIG
from kubeletplugin.transport.nodedriver import ClaimRef

READY = "Ready"
MAX_FIELD_MANAGER = 128


class ClaimStatusError(Exception):
    """A status write the API server refused or did not answer; the message names the claim."""


@dataclass(frozen=True)
class DeviceStatus:
    """One prepared device of a claim, as its status entry reports it."""

    pool: str
    device: str
    share_id: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)


class ClaimStatusWriter(Protocol):
    def publish(self, ref: ClaimRef, devices: Sequence[DeviceStatus], ready_since: float) -> None:
        """Make ``devices`` this plugin's entries of the claim (Ready since ``ready_since``, unix seconds)."""
        ...


def field_manager(driver: str, pool: str) -> str:
    """The apply field manager of one plugin: per pool, so plugins of other pools never undo each other."""
    name = f"{driver}/{pool}"
    if len(name) <= MAX_FIELD_MANAGER:
        return name
    return f"{driver}/{hashlib.sha256(pool.encode()).hexdigest()[:16]}"


def _rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def status_entry(driver: str, node: str, device: DeviceStatus, ready_since: float) -> dict[str, Any]:
    """The wire-format ``status.devices[]`` entry of one prepared device."""
    entry: dict[str, Any] = {"driver": driver, "pool": device.pool, "device": device.device}
    if device.share_id:
        entry["shareID"] = device.share_id
    entry["conditions"] = [{
        "type": READY, "status": "True", "reason": "Prepared",
        "message": f"prepared on node {node}", "lastTransitionTime": _rfc3339(ready_since),
    }]
    if device.data:
        entry["data"] = dict(device.data)
    return entry


class KubernetesClaimStatusWriter:
    """Writes this plugin's ``status.devices`` entries through the API server (server-side apply)."""

    def __init__(self, api_client: Any, driver_name: str, pool_name: str, *, node_name: str | None = None,
                 timeout_s: float = 5.0) -> None:
        from kube.client import KubeApi

        self.kube = KubeApi(api_client, timeout=timeout_s)
        self.driver = driver_name
        self.pool = pool_name
        self.node = node_name or pool_name
        self.manager = field_manager(driver_name, pool_name)

    def publish(self, ref: ClaimRef, devices: Sequence[DeviceStatus], ready_since: float) -> None:
        self._apply(ref, [status_entry(self.driver, self.node, d, ready_since) for d in devices])

    def _apply(self, ref: ClaimRef, entries: list[dict[str, Any]]) -> None:
        from kube.client import RESOURCE_V1, ApiError, ApiUnavailable

        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
                "status": {"devices": entries}}
        path = f"{RESOURCE_V1}/namespaces/{ref.namespace}/resourceclaims/{ref.name}/status"
        try:
            self.kube.request("PATCH", path, query={"fieldManager": self.manager, "force": True}, body=body,
                              content_type="application/apply-patch+yaml")
        except (ApiError, ApiUnavailable) as err:
            raise ClaimStatusError(f"writing status.devices of ResourceClaim {ref.describe()}: {err}") from err


def status_devices(record: Any, catalog: Mapping[str, Any], pool_name: str) -> list[DeviceStatus]:
    """The status entries of a prepared claim (a checkpoint ``ClaimRecord``): which GPU or MIG device each of
    its devices in this pool is."""
    dynamic = {m.device: m for m in record.undo.mig_devices if m.share_id is None}
    out = []
    for d in record.devices:
        if d.pool != pool_name:
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
                instances = [m for m in record.undo.mig_devices
                             if m.share_id is not None and (m.device, m.share_id) == (d.device, d.share_id)]
                m = dynamic.get(d.device) or (instances[0] if instances else None)
                gi, ci = (m.gi_id, m.ci_id) if m is not None else (dev.mig_gi_id, dev.mig_ci_id)
                if gi is not None and ci is not None:
                    data["gpuInstanceID"], data["computeInstanceID"] = gi, ci
                if instances:   # a share of a MIG device shared by instances: every MIG device it got
                    data["migDevices"] = [{"uuid": x.mig_uuid or "", "gpuInstanceID": x.gi_id,
                                           "computeInstanceID": x.ci_id, "placementStart": x.start}
                                          for x in instances]
        if d.admin_access:
            data["adminAccess"] = True
        out.append(DeviceStatus(pool=d.pool, device=d.device, share_id=d.share_id, data=data))
    return out


class ClaimStatusReporter:
    """``status.devices`` reporting for the driver, off the kubelet's call path: ``publish`` only queues the
    write and returns; worker threads write it, retrying failures with growing delays. A
    status the API server never takes is logged and counted, never an error of the prepare or unprepare.

    An unprepare (``forget``) drops a write still waiting: a claim unprepared right after its prepare is not
    written at all. Writes wait while kubelet calls are in flight
    (``busy``) and for ``quiet_s`` after, so they never compete with a prepare for the API server; a write
    waits at most ``max_delay_s`` for that. ``writer`` None: nothing is reported."""

    RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)

    def __init__(self, writer: ClaimStatusWriter | None, pool_name: str, devices: Callable[[], Mapping[str, Any]],
                 metrics: Any = None, *, workers: int = 4, retry_delays: Sequence[float] = RETRY_DELAYS,
                 quiet_s: float = 0.05, max_delay_s: float = 5.0) -> None:
        self.writer = writer
        self.pool_name = pool_name
        self._devices = devices
        self.metrics = metrics
        self.retry_delays = tuple(retry_delays)
        self._workers = workers
        self._published: set[str] = set()     # claims whose entries this process has written
        self._cv = threading.Condition()
        self._pending: dict[str, _StatusWrite] = {}
        self._inflight: set[str] = set()
        self._forgotten: set[str] = set()     # claims unprepared while their write was under way
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.quiet_s, self.max_delay_s = quiet_s, max_delay_s
        self._calls = 0                        # kubelet calls in flight
        self._last_call = 0.0                  # when the last one ended (monotonic)

    def publish(self, ref: ClaimRef, record: Any, log: Any) -> None:
        """Report a completed claim's devices (``record``: its checkpoint ``ClaimRecord``), once per process."""
        if self.writer is None or record is None or not record.completed:
            return
        with self._cv:
            if ref.uid in self._published:
                return
        entries = status_devices(record, self._devices(), self.pool_name)
        self._queue(_StatusWrite(ref, entries, record.updated or time.time(), log))

    def forget(self, ref: ClaimRef) -> None:
        """The claim was unprepared: a write still waiting is dropped, and a later prepare reports again."""
        with self._cv:
            self._published.discard(ref.uid)
            self._pending.pop(ref.uid, None)
            if ref.uid in self._inflight:
                self._forgotten.add(ref.uid)   # its write is under way: no retry, not marked published
            self._cv.notify_all()

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Around a kubelet call: status writes hold back meanwhile."""
        with self._cv:
            self._calls += 1
        try:
            yield
        finally:
            with self._cv:
                self._calls -= 1
                self._last_call = time.monotonic()
                self._cv.notify_all()

    def _quiet_in(self, now: float) -> float:
        """Seconds until no call has been in flight for ``quiet_s`` (0: quiet now)."""
        if self._calls:
            return self.quiet_s
        return max(0.0, self._last_call + self.quiet_s - now)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is done or given up. Returns False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._pending or self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Finish what is queued (up to ``timeout``), then stop the workers."""
        self.flush(timeout)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout=1.0)

    def _queue(self, write: _StatusWrite) -> None:
        with self._cv:
            self._pending[write.ref.uid] = write
            if len(self._threads) < self._workers and len(self._threads) < len(self._pending) + len(self._inflight):
                thread = threading.Thread(target=self._run, name="claim-status", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cv.notify()

    def _next(self) -> _StatusWrite | None:
        """The next due write of a claim not being written now; None when stopping."""
        with self._cv:
            while True:
                if self._stopping:
                    return None
                now = time.monotonic()
                quiet_in = self._quiet_in(now)
                due = [w for uid, w in self._pending.items() if uid not in self._inflight and w.not_before <= now
                       and (quiet_in == 0 or now - w.queued >= self.max_delay_s)]
                if due:
                    write = min(due, key=lambda w: w.not_before)
                    del self._pending[write.ref.uid]
                    self._inflight.add(write.ref.uid)
                    return write
                waits = [max(w.not_before - now, min(quiet_in, w.queued + self.max_delay_s - now))
                         for uid, w in self._pending.items() if uid not in self._inflight]
                # Queuing, a call ending and close() notify: with nothing pending, sleep until then.
                self._cv.wait(max(0.001, min(waits)) if waits else None)

    def _run(self) -> None:
        while (write := self._next()) is not None:
            try:
                self._attempt(write)
            finally:
                with self._cv:
                    self._inflight.discard(write.ref.uid)
                    self._forgotten.discard(write.ref.uid)
                    self._cv.notify_all()

    def _attempt(self, write: _StatusWrite) -> None:
        writer = self.writer
        if writer is None:
            return
        try:
            writer.publish(write.ref, write.entries, write.ready_since)
        except Exception as err:  # noqa: BLE001 - the kubelet's answer does not depend on it
            self._count("error")
            with self._cv:
                if write.ref.uid in self._pending or write.ref.uid in self._forgotten:
                    return                     # superseded by a newer request, or the claim was unprepared
                if _retryable(err) and write.attempt < len(self.retry_delays):
                    write.not_before = time.monotonic() + self.retry_delays[write.attempt]
                    write.attempt += 1
                    self._pending[write.ref.uid] = write
                    return
            write.log.warning("claim status not written; the claim is prepared all the same", error=str(err),
                              attempts=write.attempt + 1)
            return
        self._count("ok")
        with self._cv:
            if write.ref.uid not in self._pending and write.ref.uid not in self._forgotten:
                self._published.add(write.ref.uid)

    def _count(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.claim_status_writes.labels(operation="publish", result=result).inc()


def _retryable(err: Exception) -> bool:
    """An API server away, overloaded or in a conflict may take the write later; a refusal (RBAC, validation)
    will not, so it is reported at once instead of retried for a minute."""
    from kube.client import ApiError

    cause = err.__cause__
    if isinstance(cause, ApiError):
        return cause.status in (408, 409, 429) or cause.status >= 500
    return True


@dataclass
class _StatusWrite:
    ref: ClaimRef
    entries: Sequence[DeviceStatus]
    ready_since: float
    log: Any
    attempt: int = 0
    not_before: float = 0.0
    queued: float = field(default_factory=time.monotonic)
