"""The API reads of `gpu-dra explain`: the cluster state the scheduler allocates from (DeviceClasses,
ResourceSlices, ResourceClaims, DeviceTaintRules, Nodes) and the claims to explain, found from a claim, a
ResourceClaimTemplate (the claim it would generate) or a pod (its claims, templates' claims through
status.resourceClaimStatuses, and the claim for its extended resources: the one the scheduler made, named in
status.extendedResourceClaimStatus, else the one it would make from the DeviceClasses' extendedResourceName).
Everything stays a wire-format dict.

The cluster is read page by page, each page folded into a ClusterView (dra.scheduling.clusterview) before the next
is read, so that a 1000-node cluster is never held as a whole: the allocated claims (one LIST), then the slices of
the drivers the claims' classes select (a ``spec.driver`` field selector per driver, and ``spec.nodeName`` when the
pod's other claims tie it to one node), each node explained as soon as its pools are complete and then dropped.
Only a pool for all nodes makes the reader keep every slice until the end."""
from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from api.k8snames import is_dns_label, is_dns_subdomain
from api.quantity import quantity_value
from dra.scheduling.claimrequests import ClaimSpecError, read_claim_spec
from dra.scheduling.clusterview import ClusterView
from dra.scheduling.poolview import allocation_results
from kube.client import DEVICE_CLASSES, NODES, RESOURCE_V1, SLICES, ApiError, KubeApi
from ops.explain.verdict import NOT_ALLOCATABLE, Explainer, Explanation, NodeReport, Target, clip_line

CLAIMS = f"{RESOURCE_V1}/resourceclaims"
TAINT_RULES = f"{RESOURCE_V1}/devicetaintrules"
KINDS = ("claim", "template", "pod")
PAGE_SIZE = 100            # slices per page: a few MiB of JSON at most
# A class selector that pins the driver: "device.driver == '<name>'" alone or as the first of an && chain.
_PINNED_DRIVER = re.compile(r"""^\s*device\.driver\s*==\s*(?:'([^'\\]+)'|"([^"\\]+)")\s*(?:&&|$)""")


class ExplainTargetError(LookupError):
    """The object to explain does not exist or cannot be used; the message names it."""


@dataclass
class ExplainTargets:
    """(name, claim dict) per claim to explain, lines about how they were found, and why a claim the pod needs
    cannot be created at all (then that is the verdict: the scheduler never gets to see it)."""

    claims: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    uncreatable: list[str] = field(default_factory=list)


# A request for admin access is admitted only in a namespace with this label ("true"): the API server refuses
# such a claim (and the claim controller's creation from a template) elsewhere.
ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"
# The Event the claim controller posts on a pod whose claim it could not create from its template.
FAILED_CLAIM_CREATION = "FailedResourceClaimCreation"


def _pages(kube: KubeApi, path: str, field_selector: str | None = None,
           limit: int = PAGE_SIZE) -> Iterator[list[dict[str, Any]]]:
    """The pages of a LIST, the next one asked for while the caller works on this one (the API server encodes it
    and the bytes arrive meanwhile)."""
    def fetch(cont: str | None) -> dict[str, Any]:
        return kube.get(path, fieldSelector=field_selector, limit=limit, **({"continue": cont} if cont else {}))

    with ThreadPoolExecutor(1, thread_name_prefix="list-pages") as ahead:
        upcoming = ahead.submit(fetch, None)
        while True:
            page = upcoming.result()
            cont = (page.get("metadata") or {}).get("continue")
            if cont:
                upcoming = ahead.submit(fetch, cont)
            yield page.get("items") or []
            if not cont:
                return


def read_view(kube: KubeApi) -> ClusterView:
    """The view without slices: DeviceClasses, DeviceTaintRules (where served), Node names and the claims that hold
    devices (the others take nothing from anyone)."""
    view = ClusterView()
    view.set_classes(item for page in _pages(kube, DEVICE_CLASSES, limit=500) for item in page)
    try:
        view.set_taint_rules(item for page in _pages(kube, TAINT_RULES, limit=500) for item in page)
    except ApiError as exc:
        if exc.status not in (404, 403):
            raise
    view.set_nodes(n["metadata"]["name"] for n in kube.list_metadata(NODES)["items"])
    for page in _pages(kube, CLAIMS, limit=500):
        for claim in page:
            if allocation_results(claim):
                view.put_claim(claim)
    return view


def class_drivers(view: ClusterView, targets: Sequence[Target]) -> list[str] | None:
    """The drivers whose devices the targets' requests can get, when every requested class exists and pins one
    with its first selector; None otherwise (then every slice is read)."""
    drivers = set()
    for t in targets:
        try:
            spec = read_claim_spec(t.claim.get("spec") or {})
        except ClaimSpecError:
            return None
        for req in spec.requests:
            for alt in req.alternatives:
                cls = view.classes.get(alt.device_class)
                selectors = ((cls or {}).get("spec") or {}).get("selectors") or []
                m = _PINNED_DRIVER.match(str((selectors[0].get("cel") or {}).get("expression", ""))) if selectors else None
                if m is None:
                    return None         # a class that pins no driver, or none at all (every node says so)
                drivers.add(m.group(1) or m.group(2))
    return sorted(drivers)


def explain_live(kube: KubeApi, targets: Sequence[Target], page_size: int = PAGE_SIZE) -> Explanation:
    """Explains the targets against the live cluster, reading slices page by page (see the module docstring)."""
    view = read_view(kube)
    ex = Explainer(targets, view)
    if ex.early is not None:
        return ex.early             # allocated already, or a selector this evaluator cannot read: no slice needed
    drivers = class_drivers(view, targets)
    node = next(iter(ex.fixed)) if len(ex.fixed) == 1 else None
    selectors: list[str | None] = [None] if drivers is None else [f"spec.driver={d}" for d in drivers]
    if node is not None:
        selectors = [",".join(filter(None, [s, f"spec.nodeName={node}"])) for s in selectors]
    reader = _NodeByNode(ex, view)
    for selector in selectors:
        for page in _pages(kube, SLICES, selector, page_size):
            reader.add(page)
    return reader.finish()


class _NodeByNode:
    """Slices in, node reports out: a node is explained once each of its pools has all its slices, then its
    slices leave the view (a later slice of a newer generation brings the node back). A pool for all nodes
    (rare) keeps every slice until the end, where everything left is explained."""

    def __init__(self, ex: Explainer, view: ClusterView) -> None:
        self.ex, self.view = ex, view
        self.reports: dict[str, NodeReport] = {}
        self.pool_notes: dict[tuple[str, str], tuple[int, str]] = {}   # of pools already dropped: (kind, text)
        self.missing: set[str] = set()
        self.hold = False

    def add(self, page: list[dict[str, Any]]) -> None:
        touched = set()
        for obj in page:
            spec = obj.get("spec") or {}
            # Read as listed: no folding, the slice leaves the view with its node.
            self.view.put_slice({"metadata": {"name": (obj.get("metadata") or {}).get("name", "")}, "spec": spec},
                                folded=True)
            if spec.get("allNodes"):
                self.hold = True
            if spec.get("nodeName"):
                touched.add(str(spec["nodeName"]))
        if not self.hold:
            for node in sorted(touched):
                if all(not p.incomplete for p in self.view.pools_of_node(node)):
                    self._explain(node)

    def _explain(self, node: str) -> None:
        keys = self.view.pool_keys_of_node(node)
        if self.view.nodes is not None and node not in self.view.nodes:
            self.missing.add(node)
        elif not self.ex.fixed or node in self.ex.fixed:
            self.reports[node] = self.ex.node(node)
        for key in keys:
            pool = self.view.pool(key)
            note = _pool_note(pool)
            if note is not None:
                self.pool_notes[key] = note
            else:
                self.pool_notes.pop(key, None)
            self.view.drop_pool(key)

    def finish(self) -> Explanation:
        if self.hold:
            for name in self.ex.node_names():
                self.reports[name] = self.ex.node(name)
        else:
            for node in self.view.node_names():
                self._explain(node)
        notes = {**self.pool_notes,
                 **{(p.driver, p.name): n for p in self.view.pools() if (n := _pool_note(p)) is not None}}
        missing = self.missing | {n for n in self.view.node_names()
                                  if self.view.nodes is not None and n not in self.view.nodes}
        # As the verdict orders them: incomplete pools first, then those bound by a nodeSelector.
        ordered = [text for _, _, text in sorted((kind, key, text) for key, (kind, text) in notes.items())]
        return self.ex.finish(self.reports, ordered, sorted(missing))


def _pool_note(pool: Any) -> tuple[int, str] | None:
    if pool.incomplete:
        return 0, str(pool.incomplete)
    if not pool.node and not pool.all_nodes:
        return 1, f"pool {pool.name} of {pool.driver} is bound to nodes by a nodeSelector: not evaluated here"
    return None


def _claims_path(ns: str) -> str:
    return f"{RESOURCE_V1}/namespaces/{ns}/resourceclaims"


def _get(kube: KubeApi, path: str) -> dict[str, Any] | None:
    try:
        return kube.get(path)
    except ApiError as exc:
        if exc.not_found:
            return None
        raise


def generated_claim(template: dict[str, Any], namespace: str, name: str | None = None) -> dict[str, Any]:
    """The claim a template would generate (unallocated): its spec.spec, in the template's namespace."""
    tname = template["metadata"]["name"]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": namespace, "name": name or f"{tname}-<generated>"},
            "spec": (template.get("spec") or {}).get("spec") or {}}


def find_targets(kube: KubeApi, target: str, namespace: str) -> ExplainTargets:
    """`target` is NAME (a claim, else a template, else a pod of that name) or claim/NAME, template/NAME,
    pod/NAME."""
    kind, _, name = target.rpartition("/")
    if kind and kind not in KINDS:
        raise ExplainTargetError(f"{target}: the kind before '/' must be one of {', '.join(KINDS)}")
    if not name:
        raise ExplainTargetError(f"{target!r}: no name given")
    # Both go into request paths: only Kubernetes names, so a path cannot be steered elsewhere.
    if not is_dns_subdomain(name):
        raise ExplainTargetError(f"{name!r} is not a Kubernetes object name (lower-case DNS subdomain)")
    if not is_dns_label(namespace):
        raise ExplainTargetError(f"namespace {namespace!r} is not a Kubernetes namespace name (lower-case DNS label)")
    out = ExplainTargets()
    if kind in ("", "claim"):
        claim = _get(kube, f"{_claims_path(namespace)}/{name}")
        if claim is not None:
            out.claims.append((f"{namespace}/{name}", claim))
            return out
    if kind in ("", "template"):
        tpl = _get(kube, f"{RESOURCE_V1}/namespaces/{namespace}/resourceclaimtemplates/{name}")
        if tpl is not None:
            out.claims.append((f"{namespace}/{name} (template, as generated)", generated_claim(tpl, namespace)))
            out.uncreatable += _admin_access_refused(kube, tpl, namespace)
            return out
    if kind in ("", "pod"):
        pod = _get(kube, f"/api/v1/namespaces/{namespace}/pods/{name}")
        if pod is not None:
            return _pod_targets(kube, pod, namespace)
    what = kind or "claim, template or pod"
    raise ExplainTargetError(f"no {what} named {name} in namespace {namespace}")


def _pod_targets(kube: KubeApi, pod: dict[str, Any], namespace: str) -> ExplainTargets:
    out = ExplainTargets()
    generated = {s.get("name"): s.get("resourceClaimName")
                 for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
    for ref in (pod.get("spec") or {}).get("resourceClaims") or []:
        if ref.get("resourceClaimName"):
            claim = _get(kube, f"{_claims_path(namespace)}/{ref['resourceClaimName']}")
            if claim is None:
                raise ExplainTargetError(f"pod {pod['metadata']['name']}: claim {ref['resourceClaimName']} "
                                         f"does not exist")
            out.claims.append((f"{namespace}/{ref['resourceClaimName']}", claim))
        elif ref.get("resourceClaimTemplateName"):
            made = generated.get(ref.get("name"))
            claim = _get(kube, f"{_claims_path(namespace)}/{made}") if made else None
            if claim is not None:
                out.claims.append((f"{namespace}/{made}", claim))
                continue
            tpl = _get(kube, f"{RESOURCE_V1}/namespaces/{namespace}/resourceclaimtemplates/"
                             f"{ref['resourceClaimTemplateName']}")
            if tpl is None:
                raise ExplainTargetError(f"pod {pod['metadata']['name']}: template "
                                         f"{ref['resourceClaimTemplateName']} does not exist")
            out.notes.append(f"pod claim {ref.get('name')}: not generated yet, explained from template "
                             f"{ref['resourceClaimTemplateName']}")
            out.claims.append((f"{namespace}/{ref['resourceClaimTemplateName']} (template, as generated)",
                               generated_claim(tpl, namespace)))
            out.uncreatable += _admin_access_refused(kube, tpl, namespace)
    if any("(template, as generated)" in n for n, _ in out.claims):
        out.uncreatable += _creation_failures(kube, pod, namespace)
    extended = _extended_resource_claim(kube, pod, namespace, out)
    if extended is not None:
        out.claims.append(extended)
    if not out.claims:
        raise ExplainTargetError(f"pod {pod['metadata']['name']} has no resource claims and asks for no extended "
                                 "resource of a DeviceClass")
    return out


# The extended resource name every DeviceClass answers to besides its spec.extendedResourceName.
CLASS_RESOURCE_PREFIX = "deviceclass.resource.kubernetes.io/"


def extended_resource_classes(classes: list[dict[str, Any]]) -> dict[str, str]:
    """Extended resource name -> DeviceClass name, as the scheduler maps them: each class's
    "deviceclass.resource.kubernetes.io/<name>" and its spec.extendedResourceName, the newest class winning
    where two name the same resource."""
    out: dict[str, tuple[str, str]] = {}
    for cls in sorted(classes, key=lambda c: c["metadata"]["name"]):
        name = cls["metadata"]["name"]
        created = str(cls["metadata"].get("creationTimestamp") or "")
        for resource in (CLASS_RESOURCE_PREFIX + name, (cls.get("spec") or {}).get("extendedResourceName")):
            if resource and (resource not in out or created > out[resource][0]):
                out[resource] = (created, name)
    return {r: n for r, (_, n) in out.items()}


# From this Kubernetes minor on, the scheduler counts init containers as the kubelet runs them (the rule of
# k8s.io/component-helpers' PodRequests): an init container reuses the devices of the containers that run after
# it, and only the largest need beyond those is requested. Before, every container got a request of its own.
INIT_CONTAINERS_REUSE_MINOR = 37


def pod_extended_resource_claim(pod: dict[str, Any], classes: list[dict[str, Any]],
                                server_minor: int = INIT_CONTAINERS_REUSE_MINOR) -> dict[str, Any] | None:
    """The claim the scheduler would create for the pod's extended resources backed by a DeviceClass, with its
    requests "container-<i>-request-<j>" (i: the container's index in init containers + containers, j: the
    resource's index among the container's requests in name order), for each resource in name order:

    - every long-lived container (an app container, or an init container with restartPolicy Always) asking for
      the resource gets a request for that many devices;
    - an init container that runs to completion reuses the requests of the long-lived containers after it and
      asks for the rest; of those, only the largest is requested (they run one after another).

    Servers before 1.``INIT_CONTAINERS_REUSE_MINOR`` gave every container a request of its own. None when the
    pod asks for no such resource."""
    mapping = extended_resource_classes(classes)
    spec = pod.get("spec") or {}
    inits = list(spec.get("initContainers") or [])
    containers = inits + list(spec.get("containers") or [])
    resources = sorted({r for c in containers for r, v in _requests(c).items() if r in mapping and _whole(v)})
    requests: list[dict[str, Any]] = []
    for resource in resources:
        cls = mapping[resource]
        if server_minor < INIT_CONTAINERS_REUSE_MINOR:
            requests += [_device_request(i, c, resource, cls, _whole(_requests(c).get(resource)))
                         for i, c in enumerate(containers) if _whole(_requests(c).get(resource))]
            continue
        long_lived: list[dict[str, Any] | None] = [None] * len(containers)
        for i, c in enumerate(containers):
            if (i >= len(inits) or c.get("restartPolicy") == "Always") and _whole(_requests(c).get(resource)):
                long_lived[i] = _device_request(i, c, resource, cls, _whole(_requests(c).get(resource)))
        largest: dict[str, Any] | None = None
        for i, c in enumerate(inits):
            wanted = _whole(_requests(c).get(resource))
            if c.get("restartPolicy") == "Always" or not wanted:
                continue
            rest = wanted - sum(r["exactly"]["count"] for r in long_lived[i:] if r is not None)
            if rest > 0 and (largest is None or largest["exactly"]["count"] < rest):
                largest = _device_request(i, c, resource, cls, rest)
        requests += ([largest] if largest else []) + [r for r in long_lived if r is not None]
    if not requests:
        return None
    meta = pod["metadata"]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": meta.get("namespace", ""), "name": f"{meta['name']}-extended-resources"},
            "spec": {"devices": {"requests": sorted(requests, key=lambda r: str(r["name"]))}}}


def _requests(container: dict[str, Any]) -> dict[str, Any]:
    return dict((container.get("resources") or {}).get("requests") or {})


def _device_request(index: int, container: dict[str, Any], resource: str, cls: str, count: int) -> dict[str, Any]:
    return {"name": f"container-{index}-request-{sorted(_requests(container)).index(resource)}",
            "exactly": {"deviceClassName": cls, "allocationMode": "ExactCount", "count": count}}


def _whole(value: Any) -> int:
    try:
        amount = quantity_value(str(value)) if value is not None else 0
    except ValueError:
        return 0
    return int(amount) if amount == int(amount) else 0


def _extended_resource_claim(kube: KubeApi, pod: dict[str, Any], namespace: str,
                             out: ExplainTargets) -> tuple[str, dict[str, Any]] | None:
    made = ((pod.get("status") or {}).get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
    if made:
        claim = _get(kube, f"{_claims_path(namespace)}/{made}")
        if claim is not None:
            return f"{namespace}/{made} (extended resources)", claim
    classes = kube.list(DEVICE_CLASSES)["items"]
    if not any(r in extended_resource_classes(classes) for c in ((pod.get("spec") or {}).get("initContainers") or [])
               + ((pod.get("spec") or {}).get("containers") or []) for r in _requests(c)):
        return None
    claim = pod_extended_resource_claim(pod, classes, kube.server_version()[1])
    if claim is None:
        return None
    out.notes.append(f"pod {pod['metadata']['name']}: extended resources explained as the claim the scheduler "
                     "would create for them (on nodes that do not offer them through a device plugin)")
    return f"{namespace}/{pod['metadata']['name']} (extended resources, as the scheduler would create it)", claim


def _admin_access_refused(kube: KubeApi, template: dict[str, Any], namespace: str) -> list[str]:
    """Why the claim of a template asking for admin access cannot be created in the namespace, if it cannot."""
    requests = (((template.get("spec") or {}).get("spec") or {}).get("devices") or {}).get("requests") or []
    asks = [r.get("name", "") for r in requests
            if (r.get("exactly") or {}).get("adminAccess")
            or any(s.get("adminAccess") for s in r.get("firstAvailable") or [])]
    if not asks:
        return []
    try:
        ns = kube.get(f"/api/v1/namespaces/{namespace}")
    except ApiError as exc:
        if exc.status in (403, 404):
            return []                 # cannot tell: the claim controller will say, in the pod's Events
        raise
    if ((ns.get("metadata") or {}).get("labels") or {}).get(ADMIN_ACCESS_LABEL) == "true":
        return []
    return [f"its claim cannot be created: template {template['metadata']['name']} asks for admin access (request "
            f"{asks[0]}), which the API server admits only in a namespace labelled {ADMIN_ACCESS_LABEL}=true, and "
            f"namespace {namespace} is not"]


def _creation_failures(kube: KubeApi, pod: dict[str, Any], namespace: str) -> list[str]:
    """The claim controller's latest word on why it could not create a claim of the pod (its Warning Event)."""
    uid = (pod.get("metadata") or {}).get("uid")
    if not uid:
        return []
    try:
        events = kube.list(f"/api/v1/namespaces/{namespace}/events",
                           field_selector=f"involvedObject.uid={uid},reason={FAILED_CLAIM_CREATION}")["items"]
    except ApiError as exc:
        if exc.status in (403, 404):
            return []
        raise
    if not events:
        return []
    last = max(events, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    return [f"its claim cannot be created ({FAILED_CLAIM_CREATION}): {str(last.get('message', '')).strip()}"]


def explain_target(kube: KubeApi, target: str, namespace: str) -> Explanation:
    """`gpu-dra explain` as a function: finds the claims of `target` and explains them against the live state.
    A claim that cannot be created is the verdict, before any node."""
    found = find_targets(kube, target, namespace)
    if found.uncreatable:
        return Explanation(NOT_ALLOCATABLE, clip_line(f"not allocatable: {found.uncreatable[0]}"),
                           [n for n, _ in found.claims], notes=found.notes + found.uncreatable[1:])
    result = explain_live(kube, [Target(n, c) for n, c in found.claims])
    result.notes = found.notes + result.notes
    return result
