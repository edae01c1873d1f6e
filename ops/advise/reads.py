"""What ``gpu-dra advise`` reads from the API server: the driver's ResourceSlices (what each GPU model offers), each
pod a series names and its owners up to the top one (or, for a pod that is gone, the workloads of its namespace
whose pods are named like it), the ResourceClaimTemplates and claims to advise on, and, for ``--from-node``, the
kubelet plugin's ``/metrics`` through the API server's proxy to its pod. Reads only (docs/advise.md lists the
rights)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from api.quantity import quantity_value
from kube.client import SLICES, ApiError, ApiUnavailable, KubeApi, namespaced_collection
from ops.advise.owners import (
    PATTERN_ORDER,
    PodFacts,
    Workload,
    controller_of,
    oom_killed_containers,
    owner_by_name,
    pod_spec_of,
)

RIGHTS = ("get and list on resourceslices, pods, resourceclaims, resourceclaimtemplates, replicasets, deployments, "
          "statefulsets, daemonsets, jobs and cronjobs (and get on pods/proxy for --from-node)")
# The kinds this command reads (RIGHTS): a pod, its owners up the chain, the claims and their templates.
_READS = frozenset({"Pod", "ResourceClaim", "ResourceClaimTemplate", "ReplicaSet", "Deployment", "StatefulSet",
                    "DaemonSet", "Job", "CronJob"})
# The controller up the chain each owner kind may have (a ReplicaSet's Deployment, a Job's CronJob).
_PARENT = {"ReplicaSet": "Deployment", "Job": "CronJob"}
PLUGIN_SELECTOR = "app.kubernetes.io/name=gpu-dra-driver,app.kubernetes.io/component=kubelet-plugin"


class AdviseReadError(RuntimeError):
    """A read the API server refused or did not answer; the message names it and what is needed."""


def _fail(what: str, err: ApiError | ApiUnavailable) -> AdviseReadError:
    if isinstance(err, ApiError) and err.status in (401, 403):
        return AdviseReadError(f"the API server refused to read {what} ({err.status} {err.reason}): gpu-dra advise "
                               f"needs {RIGHTS}")
    return AdviseReadError(f"reading {what}: {err}")


def get(kube: KubeApi, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    """One object; None when it does not exist."""
    try:
        return kube.get(f"{namespaced_collection(kind, namespace)}/{name}")
    except ApiError as err:
        if err.not_found:
            return None
        raise _fail(f"{kind} {namespace}/{name}", err) from err
    except ApiUnavailable as err:
        raise _fail(f"{kind} {namespace}/{name}", err) from err


def read_slices(kube: KubeApi, driver: str) -> list[dict[str, Any]]:
    try:
        return list(kube.iter_list(SLICES, field_selector=f"spec.driver={driver}", page_size=200))
    except (ApiError, ApiUnavailable) as err:
        raise _fail("resourceslices", err) from err


@dataclass
class Owners:
    """Pods and their owners, each read once."""

    kube: KubeApi
    _objects: dict[tuple[str, str, str], dict[str, Any] | None] = field(default_factory=dict)
    _names: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    def _get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        key = (kind, namespace, name)
        if key not in self._objects:
            self._objects[key] = get(self.kube, kind, namespace, name)
        return self._objects[key]

    def _names_of(self, kind: str, namespace: str) -> list[str]:
        key = (kind, namespace)
        if key not in self._names:
            try:
                items = self.kube.list_metadata(namespaced_collection(kind, namespace))["items"]
            except (ApiError, ApiUnavailable) as err:
                raise _fail(f"{kind.lower()}s of namespace {namespace}", err) from err
            self._names[key] = [str((i.get("metadata") or {}).get("name", "")) for i in items]
        return self._names[key]

    def pod(self, namespace: str, name: str) -> PodFacts:
        pod = self._get("Pod", namespace, name)
        if pod is not None:
            statuses = tuple((pod.get("status") or {}).get("resourceClaimStatuses") or [])
            owner = controller_of(pod)
            workload = (self._top(namespace, *owner, fallback=pod) if owner else
                        Workload(namespace, "Pod", name, pod_spec_of("Pod", pod)))
            return PodFacts(workload, pod_spec_of("Pod", pod), statuses, tuple(oom_killed_containers(pod)))
        names = {kind: self._names_of(kind, namespace) for kind in PATTERN_ORDER}
        found = owner_by_name(name, names)
        if found is None:
            return PodFacts(Workload(namespace, "Pod", name, None, gone=True), None)
        workload = self._top(namespace, *found)
        return PodFacts(workload, workload.pod_spec)

    def _top(self, namespace: str, kind: str, name: str, fallback: Mapping[str, Any] | None = None) -> Workload:
        """The top owner from (kind, name) up: a ReplicaSet's Deployment, a Job's CronJob."""
        if kind not in _READS:           # an owner of a kind this command does not read (a custom resource)
            return Workload(namespace, kind, name, pod_spec_of("Pod", fallback) if fallback else None)
        obj = self._get(kind, namespace, name)
        if obj is None:
            return Workload(namespace, kind, name, pod_spec_of("Pod", fallback) if fallback else None)
        parent = controller_of(obj)
        if parent and parent[0] == _PARENT.get(kind):
            top = self._get(parent[0], namespace, parent[1])
            if top is not None:
                return Workload(namespace, parent[0], parent[1], pod_spec_of(parent[0], top))
        return Workload(namespace, kind, name, pod_spec_of(kind, obj))


def consumed(claim: Mapping[str, Any] | None, device: str) -> dict[str, int]:
    """What the claim consumed of ``device`` (``memory`` bytes, ``slots``), from its allocation."""
    results = ((((claim or {}).get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    for r in results:
        if r.get("device") == device:
            out = {}
            for name, value in (r.get("consumedCapacity") or {}).items():
                try:
                    out[str(name)] = int(quantity_value(str(value)))
                except (ValueError, ZeroDivisionError):
                    continue
            return out
    return {}


def plugin_metrics(kube: KubeApi, node: str) -> tuple[str, str]:
    """(the /metrics text, "namespace/pod") of the driver's kubelet plugin pod on ``node``, through the API
    server's proxy to the pod's ``metrics`` port."""
    try:
        pods = kube.list("/api/v1/pods", field_selector=f"spec.nodeName={node}", label_selector=PLUGIN_SELECTOR)
    except (ApiError, ApiUnavailable) as err:
        raise _fail(f"the kubelet plugin pods of node {node}", err) from err
    running = [p for p in pods["items"] if (p.get("status") or {}).get("phase") == "Running"]
    if not running:
        raise AdviseReadError(f"no running kubelet plugin pod of the driver on node {node} "
                              f"(labels {PLUGIN_SELECTOR}): is the chart installed there?")
    meta = running[0].get("metadata") or {}
    where = f"{meta.get('namespace')}/{meta.get('name')}"
    path = f"/api/v1/namespaces/{meta.get('namespace')}/pods/{meta.get('name')}:metrics/proxy/metrics"
    try:
        text = kube.request("GET", path, accept="text/plain", as_text=True)
    except (ApiError, ApiUnavailable) as err:
        raise _fail(f"the /metrics of {where}", err) from err
    return str(text), where
