"""Warning Events for pending claims that MPS tenancy keeps off every device that would fit.

A GPU whose MPS daemon serves one namespace has its MPS slots and shares tainted
``<driver>/mps-namespace=<namespace>:NoExecute`` (dra.model.tenancy), so the scheduler never allocates them to a
claim of another namespace. When nothing else fits, the pod stays Pending and the scheduler says only
"cannot allocate all claims". This loop says why: an Event (``events.k8s.io/v1``, type Warning, reason
``MPSTenancy``) on each such claim and on the Pod that owns it (a template's claim), naming the namespace the GPUs
serve, e.g. ``claim team-b/train-x7 cannot be allocated: the MPS slots and shares of 2 GPUs on node-a serve
namespace team-a (...)``.

Each pass (every ``interval`` seconds, default 5: a pending pod is a person waiting) reads the controller's
watch caches (controller.clusterstate) and makes no request of its own but the Events:

- the unallocated claims that ask for one of this driver's DeviceClasses, grouped by the Pod that owns them (a
  pod's claims are allocated together, so they are judged together); a group is due once its oldest claim is
  ``min_age_s`` old (the scheduler has had its try) and then again every ``recheck_s``;
- bounded work: at most ``max_per_pass`` groups are evaluated per pass (those never judged first, longest-waiting
  first, then those judged longest ago); the rest wait for the next pass. Each group is judged by ``gpu-dra
  explain``'s model (ops.explain.verdict), which decides as kube-scheduler does, node by node; a node's report is
  kept for claims of the same namespace and spec until anything that node's verdict reads changes (its slices,
  the allocations of its devices, classes, taint rules, Nodes), so pods of one template waiting together cost
  one evaluation per node, not one each;
- a verdict "not allocatable" with matching devices kept for another namespace's MPS daemon posts one Event per
  object; it is posted again only when its message changes. What was posted is remembered per group and
  forgotten once the group's claims are allocated or gone, so memory follows the pending claims.

An Event is a courtesy: one that is refused or fails is logged and tried again at the group's next evaluation.

RBAC (deploy/helm, rbac-controller.yaml): ``list`` and ``watch`` on what the caches hold and ``create`` on
``events`` in ``events.k8s.io``.
"""
from __future__ import annotations

import json
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from controller.clusterstate import ClusterState, asks_for
from controller.metrics import PENDING_PASSES
from controller.passloop import PassLoop
from dra.model.tenancy import tenancy_reason
from dra.scheduling.devicecel import SelectorResults
from kube.backoff import Backoff
from kube.client import ApiError, ApiUnavailable
from kube.events import EventWriter, KubernetesEventWriter, ObjectRef, claim_ref, event_body
from ops.explain.verdict import NOT_ALLOCATABLE, Explainer, Explanation, NodeReport, Target

log = logging.getLogger(__name__)

MPS_TENANCY = "MPSTenancy"
ACTION_ALLOCATE = "Allocate"
MAX_OTHER_LINES = 3        # lines about devices that are unusable for other reasons, in one Event
REPORTS_KEPT = 8_000       # node reports kept between passes (a few KiB each): several claim kinds at 1000 nodes


@dataclass
class PendingGroup:
    """Unallocated claims judged together: those owned by one Pod, or one claim without an owning Pod."""

    key: str                                    # the pod's UID, else the claim's
    pod: ObjectRef | None
    claims: list[dict[str, Any]] = field(default_factory=list)
    since: float = 0.0                          # creation time of the oldest claim (wall clock)

    @property
    def names(self) -> list[str]:
        return [f"{c['metadata'].get('namespace', '')}/{c['metadata'].get('name', '')}" for c in self.claims]


def owning_pod(claim: dict[str, Any]) -> ObjectRef | None:
    """The Pod a claim was generated for (its controller ownerReference), if any."""
    meta = claim.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1" and ref.get("name"):
            return ObjectRef("v1", "Pod", str(meta.get("namespace", "")), str(ref["name"]), str(ref.get("uid", "")))
    return None


def created_at(claim: dict[str, Any]) -> float | None:
    stamp = (claim.get("metadata") or {}).get("creationTimestamp")
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp() if stamp else None
    except ValueError:
        return None


def pending_groups(claims: Sequence[dict[str, Any]], class_names: Iterable[str]) -> list[PendingGroup]:
    """The unallocated claims, not being deleted, grouped by owning Pod; only groups with a claim that asks for
    one of ``class_names``. Oldest first."""
    names = set(class_names)
    groups: dict[str, PendingGroup] = {}
    for claim in claims:
        meta = claim.get("metadata") or {}
        if (claim.get("status") or {}).get("allocation") or meta.get("deletionTimestamp"):
            continue
        pod = owning_pod(claim)
        key = pod.uid if pod is not None and pod.uid else str(meta.get("uid", ""))
        group = groups.setdefault(key, PendingGroup(key, pod, since=float("inf")))
        group.claims.append(claim)
        group.since = min(group.since, created_at(claim) or 0.0)
    wanted = [g for g in groups.values() if any(asks_for(c, names) for c in g.claims)]
    return sorted(wanted, key=lambda g: (g.since, g.key))


def tenancy_note(names: Sequence[str], exp: Explanation) -> str | None:
    """The Event's message when the claims are not allocatable and matching devices are kept for another
    namespace's MPS daemon; None otherwise."""
    if exp.verdict != NOT_ALLOCATABLE:
        return None
    held: dict[tuple[str, str], set[str]] = {}          # (node, namespace) -> GPUs
    others: list[str] = []
    for node in exp.nodes:
        for rep in node.requests:
            for ns, gpus in rep.tenancy.items():
                held.setdefault((node.node, ns), set()).update(gpus)
            others += [f"{node.node}: {line}" for line in rep.why_not
                       if not any(tenancy_reason(ns) in line for ns in rep.tenancy)]
    if not held:
        return None
    who = f"claim {names[0]}" if len(names) == 1 else f"claims {', '.join(names)} (allocated together)"
    serve = ", ".join(f"{len(gpus)} GPU{'s' * (len(gpus) != 1)} on {node} serve namespace {ns}"
                      for (node, ns), gpus in sorted(held.items()))
    note = (f"{who} cannot be allocated: the MPS slots and shares of {serve} (an MPS daemon serves one namespace; "
            f"node policy mps.shareAcrossNamespaces)")
    if others:
        more = len(others) - MAX_OTHER_LINES
        note += "; other devices: " + "; ".join(others[:MAX_OTHER_LINES]) + (f"; and {more} more" if more > 0 else "")
    return note


@dataclass
class _Seen:
    checked: float                 # monotonic time of the last evaluation
    note: str | None = None        # what was posted, None if nothing


class NodeReports:
    """Node reports of earlier evaluations, by (namespace, the claims' specs) and node, each valid while the
    node's stamp (dra.scheduling.clusterview) is unchanged; the least recently used go first."""

    def __init__(self, limit: int = REPORTS_KEPT) -> None:
        self._kept: OrderedDict[tuple[str, str], tuple[tuple[int, ...], NodeReport]] = OrderedDict()
        self._limit = limit
        self.hits = self.misses = 0

    def get(self, key: tuple[str, str], stamp: tuple[int, ...]) -> NodeReport | None:
        kept = self._kept.get(key)
        if kept is None or kept[0] != stamp:
            self.misses += 1
            return None
        self._kept.move_to_end(key)
        self.hits += 1
        return kept[1]

    def put(self, key: tuple[str, str], stamp: tuple[int, ...], report: NodeReport) -> None:
        self._kept[key] = (stamp, report)
        self._kept.move_to_end(key)
        while len(self._kept) > self._limit:
            self._kept.popitem(last=False)


def _placeholder(i: int) -> str:
    """How the i-th claim of a group is named while it is judged: reports are shared between groups of one
    spec, so they must not carry a group's own names (the Event's text gets them back)."""
    return f"<claim#{i}>"


class PendingClaimEvents:
    """The loop of the module docstring. ``writer`` defaults to the API server's."""

    def __init__(self, state: ClusterState, driver: str, class_names: Iterable[str], *, interval: float = 5.0,
                 min_age_s: float = 5.0, recheck_s: float = 30.0, max_per_pass: int = 10,
                 writer: EventWriter | None = None, api_client: Any = None, instance: str | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.state = state
        self.writer = writer if writer is not None else KubernetesEventWriter(api_client)
        self.driver = driver
        self.class_names = frozenset(class_names)
        self.interval, self.min_age_s, self.recheck_s = interval, min_age_s, recheck_s
        self.max_per_pass = max_per_pass
        self.controller = f"{driver}/controller"
        self.instance = instance or socket.gethostname() or "gpu-dra-controller"
        self._clock, self._wall = clock, wall
        self._seen: dict[str, _Seen] = {}
        self._reports = NodeReports()
        self._results = SelectorResults()
        self._backoff = Backoff(initial=0.5, maximum=max(interval, 30.0))
        self._runner = PassLoop(f"pending-claims-{driver}", self._pass, interval, self._backoff)
        self.events_posted = 0
        self.last_error: str | None = None

    def pass_once(self) -> int:
        """One pass over the caches; returns the number of groups evaluated."""
        groups = pending_groups(self.state.claims.items(), self.class_names)
        pending = {g.key for g in groups}
        for key in [k for k in self._seen if k not in pending]:
            del self._seen[key]
        now, wall = self._clock(), self._wall()
        due = [g for g in groups if wall - g.since >= self.min_age_s and
               (g.key not in self._seen or now - self._seen[g.key].checked >= self.recheck_s)]
        # New claims are not starved by many long-pending ones: never judged first (sorted is stable).
        due = sorted(due, key=lambda g: self._seen[g.key].checked if g.key in self._seen else float("-inf"))
        due = due[:self.max_per_pass]
        for group in due:
            seen = self._seen.setdefault(group.key, _Seen(now))
            seen.checked = now
            try:
                exp = self.judge(group)
            except Exception as exc:  # noqa: BLE001 - one claim the model cannot judge must not stop the others
                log.warning("pending claims %s not evaluated: %s", ", ".join(group.names), exc)
                continue
            note = tenancy_note(group.names, exp)
            if note is not None:
                for i, name in enumerate(group.names):
                    note = note.replace(_placeholder(i), name)
            if note is not None and note != seen.note and self._post(group, note):
                seen.note = note
        return len(due)

    def judge(self, group: PendingGroup) -> Explanation:
        """The group's verdict, node reports reused where the node has not changed since they were made."""
        targets = [Target(_placeholder(i), c) for i, c in enumerate(group.claims)]
        namespace = str(group.claims[0]["metadata"].get("namespace", ""))
        spec = namespace + json.dumps([c.get("spec") or {} for c in group.claims], sort_keys=True)
        view = self.state.view
        with view.reading():
            ex = Explainer(targets, view, self._results)
            if ex.early is not None:
                return ex.early
            reports = {}
            for node in ex.node_names():
                stamp = view.node_stamp(node)
                report = self._reports.get((spec, node), stamp)
                if report is None:
                    report = ex.node(node)
                    self._reports.put((spec, node), stamp, report)
                reports[node] = report
            exp = ex.finish(reports)
        exp.claims = list(group.names)
        return exp

    def _post(self, group: PendingGroup, note: str) -> bool:
        at = self._wall()
        refs = [claim_ref(str(c["metadata"].get("namespace", "")), str(c["metadata"].get("name", "")),
                          str(c["metadata"].get("uid", ""))) for c in group.claims]
        targets: list[tuple[ObjectRef, ObjectRef | None]] = [(r, None) for r in refs]
        if group.pod is not None:
            targets.append((group.pod, refs[0] if len(refs) == 1 else None))
        try:
            for regarding, related in targets:
                self.writer.create(event_body(regarding, reason=MPS_TENANCY, note=note, controller=self.controller,
                                              instance=self.instance, now=at, related=related,
                                              action=ACTION_ALLOCATE))
                self.events_posted += 1
        except (ApiError, ApiUnavailable) as exc:
            log.warning("event about pending claims %s not written: %s", ", ".join(group.names), exc)
            return False
        log.info("pending claims: %s", note)
        return True

    # ---- the loop ---------------------------------------------------------------------------------

    def start(self) -> "PendingClaimEvents":
        self._runner.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._runner.stop(timeout)

    def _pass(self) -> bool:
        if not self.state.synced:
            PENDING_PASSES.labels(self.driver, "waiting").inc()
            return False                  # the caches' first LISTs are still to come (or retrying)
        self.pass_once()
        PENDING_PASSES.labels(self.driver, "ok").inc()
        self.last_error = None
        return True
