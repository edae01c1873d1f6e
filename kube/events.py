"""Kubernetes Events about claims: a prepare that failed becomes a Warning Event (``events.k8s.io/v1``) on the
ResourceClaim and on each pod it is reserved for, with the plugin's one-line reason, so ``kubectl describe pod``
shows why the pod does not start without anyone reading the plugin's log.

The kubelet retries a failed prepare every few seconds, so events are deduplicated per claim and reason: the first
failure creates one Event per object; later ones only count, and at most once per ``min_interval_s`` the Events'
``series`` (count, last seen) and note are patched. A claim's Events never multiply, however often it fails. What
is tracked is bounded (``max_tracked`` claims, least recently failed forgotten first).

Nothing here blocks the caller: ``warn`` decides under a short lock and queues the write; one worker thread does
the API calls (finding the reserving pods with one read of the claim, then the Events). A full queue drops the
write; a refused or failed write is logged by the caller's logger and never retried: an Event is a courtesy.

RBAC: ``create`` and ``patch`` on ``events`` in ``events.k8s.io`` (deploy/helm, rbac-kubelet-plugin.yaml); the
claim read uses the ``get`` on resourceclaims the plugin has anyway.
"""
from __future__ import annotations

import queue
import secrets
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

from api.config.errors import printable

EVENTS_V1 = "/apis/events.k8s.io/v1"
WARNING = "Warning"
PREPARE_FAILED = "PrepareFailed"
ACTION_PREPARE = "PrepareResources"
MAX_NOTE = 1024            # the API server refuses a longer note
MAX_FIELD = 128            # reportingController, reportingInstance, action, reason


@dataclass(frozen=True)
class ObjectRef:
    """The object an Event is about."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str

    def to_wire(self) -> dict[str, str]:
        return {"apiVersion": self.api_version, "kind": self.kind, "namespace": self.namespace, "name": self.name,
                "uid": self.uid}


def claim_ref(namespace: str, name: str, uid: str) -> ObjectRef:
    return ObjectRef("resource.k8s.io/v1", "ResourceClaim", namespace, name, uid)


def reserving_pods(claim: dict[str, Any]) -> list[ObjectRef]:
    """The pods a claim (wire format) is reserved for."""
    ns = (claim.get("metadata") or {}).get("namespace", "")
    reserved = (claim.get("status") or {}).get("reservedFor") or []
    return [ObjectRef("v1", "Pod", ns, str(r["name"]), str(r.get("uid", ""))) for r in reserved
            if isinstance(r, dict) and r.get("resource", "pods") == "pods" and r.get("name") and not r.get("apiGroup")]


def one_line(text: str) -> str:
    """The note: one printable line (control characters escaped) within the API's limit."""
    line = printable(" ".join(str(text).split()))
    return line if len(line) <= MAX_NOTE else line[:MAX_NOTE - 1] + "…"


def micro_time(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_body(regarding: ObjectRef, *, reason: str, note: str, controller: str, instance: str, now: float,
               related: ObjectRef | None = None, event_type: str = WARNING, action: str = ACTION_PREPARE
               ) -> dict[str, Any]:
    """A new ``events.k8s.io/v1`` Event (its name unique: the object's name and a random suffix)."""
    body: dict[str, Any] = {
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": f"{regarding.name[:230]}.{secrets.token_hex(8)}", "namespace": regarding.namespace},
        "eventTime": micro_time(now), "type": event_type, "reason": reason[:MAX_FIELD], "action": action[:MAX_FIELD],
        "note": one_line(note), "reportingController": controller[:MAX_FIELD],
        "reportingInstance": instance[:MAX_FIELD], "regarding": regarding.to_wire(),
    }
    if related is not None:
        body["related"] = related.to_wire()
    return body


class EventWriter(Protocol):
    def claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The claim as the API server has it now, or None when it is gone."""
        ...

    def create(self, event: dict[str, Any]) -> None:
        ...

    def patch(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        ...


class KubernetesEventWriter:
    """Events through the API server (``events.k8s.io/v1``)."""

    def __init__(self, api_client: Any, timeout_s: float = 5.0) -> None:
        from kube.client import KubeApi

        self.kube = KubeApi(api_client, timeout=timeout_s)

    def claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kube.client import RESOURCE_V1, ApiError

        path = f"{RESOURCE_V1}/namespaces/{_quote(namespace)}/resourceclaims/{_quote(name)}"
        try:
            return self.kube.get(path)
        except ApiError as err:
            if err.not_found:
                return None
            raise

    def create(self, event: dict[str, Any]) -> None:
        self.kube.create(f"{EVENTS_V1}/namespaces/{_quote(event['metadata']['namespace'])}/events", event)

    def patch(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.kube.request("PATCH", f"{EVENTS_V1}/namespaces/{_quote(namespace)}/events/{_quote(name)}", body=patch,
                          content_type="application/merge-patch+json")


def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")


@dataclass
class _Series:
    """What was written for one (claim, reason): the Events made, how often it happened, when last written."""

    count: int = 1
    written_at: float = 0.0
    events: list[tuple[str, str]] = field(default_factory=list)    # (namespace, name) of each Event made
    first_done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class _Write:
    kind: str                 # "create" (first occurrence) or "series"
    claim: ObjectRef
    reason: str
    note: str
    series: _Series
    count: int
    at: float                 # wall-clock time of the occurrence


class ClaimEventRecorder:
    """Warning Events for claims, deduplicated per claim and reason and written off the caller's path (see the
    module docstring). ``writer`` None: nothing is recorded."""

    def __init__(self, writer: EventWriter | None, controller: str, instance: str, *, min_interval_s: float = 60.0,
                 max_tracked: int = 1024, max_queued: int = 256, log: Any = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.writer = writer
        self.controller, self.instance = controller, instance
        self.min_interval_s = min_interval_s
        self.max_tracked = max_tracked
        self.log = log
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        self._series: OrderedDict[str, dict[str, _Series]] = OrderedDict()   # claim uid -> reason -> series
        self._queue: queue.Queue[_Write | None] = queue.Queue(max_queued)
        self._thread: threading.Thread | None = None
        self.dropped = 0          # writes not queued because the queue was full
        self.failed = 0           # writes the API server refused or did not answer

    def warn(self, namespace: str, name: str, uid: str, reason: str, note: str) -> None:
        """Record that ``reason`` happened to the claim now. Returns at once."""
        if self.writer is None:
            return
        now = self._clock()
        with self._lock:
            by_reason = self._series.get(uid)
            if by_reason is None:
                by_reason = self._series[uid] = {}
                while len(self._series) > self.max_tracked:
                    self._series.popitem(last=False)
            else:
                self._series.move_to_end(uid)
            series = by_reason.get(reason)
            if series is None:
                series = by_reason[reason] = _Series(written_at=now)
                kind = "create"
            else:
                series.count += 1
                if now - series.written_at < self.min_interval_s:
                    return
                series.written_at = now
                kind = "series"
            write = _Write(kind, claim_ref(namespace, name, uid), reason, note, series, series.count, self._wall())
        self._enqueue(write)

    def forget(self, uid: str) -> None:
        """A claim prepared after all (or unprepared): its next failure starts new Events."""
        with self._lock:
            self._series.pop(uid, None)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write is done. False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float = 5.0) -> None:
        self.flush(timeout)
        if self._thread is not None:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass
            self._thread.join(timeout=1.0)

    def _enqueue(self, write: _Write) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="claim-events", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait(write)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            write = self._queue.get()
            try:
                if write is None:
                    return
                self._write(write)
            except Exception as err:  # noqa: BLE001 - an Event is a courtesy; the caller's answer is given
                self.failed += 1
                if self.log is not None:
                    self.log.warning("event not written", reason=write.reason if write else "",
                                     claim=f"{write.claim.namespace}/{write.claim.name}" if write else "",
                                     error=str(err))
            finally:
                self._queue.task_done()

    def _write(self, write: _Write) -> None:
        writer = self.writer
        assert writer is not None
        if write.kind == "create":
            try:
                claim = writer.claim(write.claim.namespace, write.claim.name)
                pods = reserving_pods(claim) if claim and (claim.get("metadata") or {}).get("uid") == write.claim.uid \
                    else []
                targets: Sequence[tuple[ObjectRef, ObjectRef | None]] = [(write.claim, None),
                                                                         *((p, write.claim) for p in pods)]
                for regarding, related in targets:
                    # A pod may have several claims: its Event says which one failed.
                    note = write.note if related is None else f"claim {write.claim.name}: {write.note}"
                    body = event_body(regarding, reason=write.reason, note=note, controller=self.controller,
                                      instance=self.instance, now=write.at, related=related)
                    writer.create(body)
                    write.series.events.append((body["metadata"]["namespace"], body["metadata"]["name"]))
            finally:
                write.series.first_done.set()
            return
        write.series.first_done.wait(5.0)
        series = {"count": write.count, "lastObservedTime": micro_time(write.at)}
        for i, (namespace, name) in enumerate(list(write.series.events)):
            note = write.note if i == 0 else f"claim {write.claim.name}: {write.note}"
            writer.patch(namespace, name, {"series": series, "note": one_line(note)})
