"""The API reads of `gpu-dra explain`: the cluster state the scheduler allocates from (DeviceClasses,
ResourceSlices, ResourceClaims, DeviceTaintRules, Nodes) and the claims to explain, found from a claim, a
ResourceClaimTemplate (the claim it would generate) or a pod (its claims, templates' claims through
status.resourceClaimStatuses, and the claim for its extended resources: the one the scheduler made, named in
status.extendedResourceClaimStatus, else the one it would make from the DeviceClasses' extendedResourceName).
Everything stays a wire-format dict."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from api.k8snames import is_dns_label, is_dns_subdomain
from api.quantity import quantity_value
from kube.client import DEVICE_CLASSES, NODES, RESOURCE_V1, SLICES, ApiError, KubeApi
from ops.explain.verdict import Explanation, Target, explain

CLAIMS = f"{RESOURCE_V1}/resourceclaims"
TAINT_RULES = f"{RESOURCE_V1}/devicetaintrules"
KINDS = ("claim", "template", "pod")


class ExplainTargetError(LookupError):
    """The object to explain does not exist or cannot be used; the message names it."""


@dataclass
class ClusterState:
    classes: list[dict[str, Any]]
    slices: list[dict[str, Any]]
    claims: list[dict[str, Any]]
    taint_rules: list[dict[str, Any]]
    nodes: list[str]


@dataclass
class ExplainTargets:
    """(name, claim dict) per claim to explain, and lines about how they were found."""

    claims: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_cluster_state(kube: KubeApi, claims: list[dict[str, Any]] | None = None) -> ClusterState:
    """`claims`: every ResourceClaim as the caller listed it just before; listed here if None."""
    try:
        rules = kube.list(TAINT_RULES)["items"]
    except ApiError as exc:
        if exc.status not in (404, 403):
            raise
        rules = []          # servers before 1.37 have no v1 DeviceTaintRule
    return ClusterState(kube.list(DEVICE_CLASSES)["items"], kube.list(SLICES)["items"],
                        kube.list(CLAIMS)["items"] if claims is None else claims, rules,
                        [n["metadata"]["name"] for n in kube.list_metadata(NODES)["items"]])


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


def pod_extended_resource_claim(pod: dict[str, Any], classes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The claim the scheduler would create for the pod's extended resources backed by a DeviceClass: per
    resource (in name order) and per container asking for it, a request "container-<i>-request-<j>" (i: the
    container's index after the init containers, j: the resource's index among the container's requests in
    name order) for that many devices of the class. None when the pod asks for none."""
    mapping = extended_resource_classes(classes)
    spec = pod.get("spec") or {}
    inits = spec.get("initContainers") or []
    requests = []
    for resource in sorted({r for c in spec.get("containers") or [] for r in
                            ((c.get("resources") or {}).get("requests") or {}) if r in mapping}):
        for i, container in enumerate(spec.get("containers") or []):
            asked = (container.get("resources") or {}).get("requests") or {}
            count = _whole(asked.get(resource))
            if count:
                requests.append({"name": f"container-{len(inits) + i}-request-{sorted(asked).index(resource)}",
                                 "exactly": {"deviceClassName": mapping[resource], "allocationMode": "ExactCount",
                                             "count": count}})
    if not requests:
        return None
    meta = pod["metadata"]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": meta.get("namespace", ""), "name": f"{meta['name']}-extended-resources"},
            "spec": {"devices": {"requests": requests}}}


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
    if any(((c.get("resources") or {}).get("requests") or {}) for c in (pod.get("spec") or {}).get("initContainers") or []):
        out.notes.append("init containers' extended resources are not explained")
    claim = pod_extended_resource_claim(pod, kube.list(DEVICE_CLASSES)["items"])
    if claim is None:
        return None
    out.notes.append(f"pod {pod['metadata']['name']}: extended resources explained as the claim the scheduler "
                     "would create for them (on nodes that do not offer them through a device plugin)")
    return f"{namespace}/{pod['metadata']['name']} (extended resources, as the scheduler would create it)", claim


def explain_target(kube: KubeApi, target: str, namespace: str) -> Explanation:
    """`gpu-dra explain` as a function: finds the claims of `target` and explains them against the live state."""
    found = find_targets(kube, target, namespace)
    state = read_cluster_state(kube)
    result = explain([Target(n, c) for n, c in found.claims], state.classes, state.slices, state.claims,
                     state.taint_rules, state.nodes)
    result.notes = found.notes + result.notes
    return result
