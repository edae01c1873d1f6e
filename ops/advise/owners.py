"""Who a pod belongs to and which of its claims a series names. Pure: the objects are read elsewhere.

A running pod names its owner (ReplicaSet → Deployment, Job → CronJob, StatefulSet, DaemonSet) and, in
``status.resourceClaimStatuses``, the claim made for each of its claim entries. A pod that is gone (a finished
Job, a replaced replica) is found by the names the controllers give pods: ``<replicaset>-<5>``,
``<statefulset>-<ordinal>``, ``<job>-<5>`` (``<job>-<index>-<5>`` when indexed), ``<daemonset>-<5>``, and for
owners gone too ``<deployment>-<hash>-<5>`` and ``<cronjob>-<time>-<5>``; its claims by the names the resource
claim controller gives them (``<pod>-<entry>-<5>``, both parts shortened proportionally past 57 characters).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# A pod's path to its pod spec in each kind of owner, and whether that template can be patched in place.
SPEC_PATHS = {
    "Deployment": ("/spec/template/spec", True), "StatefulSet": ("/spec/template/spec", True),
    "DaemonSet": ("/spec/template/spec", True), "ReplicaSet": ("/spec/template/spec", True),
    "CronJob": ("/spec/jobTemplate/spec/template/spec", True), "Job": ("/spec/template/spec", False),
    "Pod": ("/spec", False),
}
_SUFFIX = "[bcdfghjklmnpqrstvwxz2456789]{5}"       # what generateName appends (k8s.io/apimachinery rand)
_PATTERNS = {                                      # kind → what follows its name in its pods' names
    "ReplicaSet": f"-{_SUFFIX}", "DaemonSet": f"-{_SUFFIX}", "StatefulSet": "-[0-9]+",
    "Job": f"(-[0-9]+)?-{_SUFFIX}", "Deployment": f"-[a-z0-9]{{6,10}}-{_SUFFIX}",
    "CronJob": f"-[0-9]+-{_SUFFIX}",
}
# Owners closest to the pod first: a pod of a ReplicaSet that still exists is that ReplicaSet's.
PATTERN_ORDER = ("ReplicaSet", "StatefulSet", "Job", "DaemonSet", "Deployment", "CronJob")


@dataclass(frozen=True)
class Workload:
    """What a pod belongs to: its top owner (or itself), with the pod spec its pods are made from."""

    namespace: str
    kind: str
    name: str
    pod_spec: Mapping[str, Any] | None = None      # the owner's pod template spec, or the pod's own
    gone: bool = False                             # neither the pod nor an owner was found: named by the pod

    @property
    def ref(self) -> str:
        return f"{self.kind.lower()}/{self.name}"

    @property
    def spec_path(self) -> str:
        return SPEC_PATHS.get(self.kind, ("", False))[0]

    @property
    def patchable(self) -> bool:
        return SPEC_PATHS.get(self.kind, ("", False))[1]


def controller_of(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """(kind, name) of the object's controlling owner."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("kind", "")), str(ref.get("name", ""))
    return None


def pod_spec_of(kind: str, obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod spec inside a workload object (its template's), or a pod's own."""
    node: Any = obj
    for key in SPEC_PATHS.get(kind, ("/spec", False))[0].strip("/").split("/"):
        node = node.get(key) if isinstance(node, Mapping) else None
    return node if isinstance(node, Mapping) else None


def owner_by_name(pod: str, candidates: Mapping[str, Iterable[str]]) -> tuple[str, str] | None:
    """(kind, name) of the owner whose pods are named like ``pod``, from the names of each kind in its
    namespace; the longest name wins among one kind (``web-1`` before ``web`` for pod ``web-1-x7k2p``)."""
    for kind in PATTERN_ORDER:
        names = sorted(candidates.get(kind, ()), key=len, reverse=True)
        for name in names:
            if re.fullmatch(re.escape(name) + _PATTERNS[kind], pod):
                return kind, name
    return None


def generated_claim_prefix(pod: str, entry: str) -> str:
    """The start of the name the resource claim controller gives the claim of pod claim entry ``entry``: the pod
    and entry names, each cut in proportion when together they pass 57 characters."""
    base = f"{pod}-{entry}-"
    if len(base) <= 57:
        return base
    return f"{pod[:len(pod) * 57 // len(base)]}-{entry[:len(entry) * 57 // len(base)]}"


@dataclass(frozen=True)
class ClaimSource:
    """Where a pod's claim comes from: its pod claim entry, and the template or shared claim it names."""

    entry: str
    kind: str                 # ResourceClaimTemplate | ResourceClaim
    name: str
    index: int                # the entry's place in spec.resourceClaims (for a patch)


def claim_source(claim: str, pod: str, pod_spec: Mapping[str, Any] | None,
                 statuses: Iterable[Mapping[str, Any]] = ()) -> ClaimSource | None:
    """The entry of the pod's ``spec.resourceClaims`` that made (or names) the claim ``claim``: from the pod's
    ``status.resourceClaimStatuses`` where the pod is known, else by the claim's name."""
    entries = [e for e in (pod_spec or {}).get("resourceClaims") or [] if isinstance(e, Mapping)]

    def source(i: int) -> ClaimSource:
        e = entries[i]
        if e.get("resourceClaimName"):
            return ClaimSource(str(e.get("name", "")), "ResourceClaim", str(e["resourceClaimName"]), i)
        return ClaimSource(str(e.get("name", "")), "ResourceClaimTemplate", str(e.get("resourceClaimTemplateName", "")),
                           i)

    by_status = {str(s.get("resourceClaimName", "")): str(s.get("name", "")) for s in statuses}
    for i, e in enumerate(entries):
        if e.get("resourceClaimName") == claim or (claim in by_status and by_status[claim] == e.get("name")):
            return source(i)
    templated = [i for i, e in enumerate(entries) if e.get("resourceClaimTemplateName")]
    matches = [i for i in templated if claim.startswith(generated_claim_prefix(pod, str(entries[i].get("name", ""))))]
    if len(matches) == 1:
        return source(matches[0])
    if len(templated) == 1 and not matches:
        return source(templated[0])
    return None


def oom_killed_containers(pod: Mapping[str, Any]) -> list[str]:
    """The pod's containers whose current or last run ended OOM-killed."""
    out = []
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in (status.get("state"), status.get("lastState")):
            if ((state or {}).get("terminated") or {}).get("reason") == "OOMKilled":
                out.append(str(status.get("name", "")))
                break
    return out


@dataclass(frozen=True)
class PodFacts:
    """What a series' pod is: its workload, the claims its status names, its OOM-killed containers."""

    workload: Workload
    pod_spec: Mapping[str, Any] | None
    claim_statuses: tuple[Mapping[str, Any], ...] = ()
    oom: tuple[str, ...] = ()
