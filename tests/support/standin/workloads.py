"""Cluster-side utilities for end-to-end tests: DeviceClasses, example claims rewritten for a test's own
driver name, pods pinned to a node, waiting for scheduling and allocation, deleting pods without a kubelet."""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from api.deviceclasses import device_classes
from api.names import DEFAULT_DRIVER_NAME
from kube.client import DEVICE_CLASSES, RESOURCE_V1, ApiError, KubeApi, namespaced_collection

T = TypeVar("T")

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

def wait_until(check: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll ``check`` until it returns something truthy; the error says what was awaited and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def create_namespace(api: KubeApi, name: str) -> None:
    api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


def apply_device_classes(api: KubeApi, driver: str) -> list[str]:
    """Create the driver's DeviceClasses (already existing ones are kept); returns their names."""
    names = []
    for cls in device_classes(driver):
        try:
            api.create(DEVICE_CLASSES, cls)
        except ApiError as exc:
            if not exc.conflict:
                raise
        names.append(cls["metadata"]["name"])
    return names


def load_example(folder: str) -> list[dict[str, Any]]:
    """The objects of ``examples/<folder>/claim.yaml``."""
    return [d for d in yaml.safe_load_all((EXAMPLES / folder / "claim.yaml").read_text()) if d]


def for_driver(obj: dict[str, Any], driver: str) -> dict[str, Any]:
    """A copy of an example object that uses ``driver`` instead of the default driver name: DeviceClass
    names, CEL attribute/capacity domains and opaque-config drivers. The config apiVersion stays as it is."""
    obj = copy.deepcopy(obj)
    spec = obj["spec"]["spec"] if obj["kind"] == "ResourceClaimTemplate" else obj.get("spec", {})
    devices = spec.get("devices") if obj["kind"] != "Pod" else None
    if not devices:
        return obj
    for request in devices.get("requests") or []:
        for sub in [request.get("exactly")] + list(request.get("firstAvailable") or []):
            if not sub:
                continue
            sub["deviceClassName"] = sub["deviceClassName"].replace(DEFAULT_DRIVER_NAME, driver)
            for sel in sub.get("selectors") or []:
                sel["cel"]["expression"] = sel["cel"]["expression"].replace(f"'{DEFAULT_DRIVER_NAME}'", f"'{driver}'")
    for cfg in devices.get("config") or []:
        if "opaque" in cfg and cfg["opaque"].get("driver") == DEFAULT_DRIVER_NAME:
            cfg["opaque"]["driver"] = driver
    return obj


def pin_to_node(pod: dict[str, Any], node: str) -> dict[str, Any]:
    """The scheduler may only bind the pod to ``node``."""
    pod = copy.deepcopy(pod)
    pod["spec"].setdefault("nodeSelector", {})["kubernetes.io/hostname"] = node
    return pod


def create(api: KubeApi, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["metadata"]["namespace"] = namespace
    return api.create(namespaced_collection(obj["kind"], namespace), obj)


def get(api: KubeApi, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return api.get(f"{namespaced_collection(kind, namespace)}/{name}")
    except ApiError as exc:
        if exc.not_found:
            return None
        raise


def _claim_ready(api: KubeApi, namespace: str, name: str, pod_uid: str) -> bool:
    claim = get(api, "ResourceClaim", namespace, name)
    status = (claim or {}).get("status") or {}
    return bool(status.get("allocation")) and any(r.get("uid") == pod_uid for r in status.get("reservedFor") or [])


def wait_for_scheduled_pod(api: KubeApi, namespace: str, name: str, timeout: float = 60.0) -> dict[str, Any]:
    """The pod once it is bound to a node and every claim it names exists, is allocated and reserved for it
    (what the kubelet needs before it prepares). The error carries the scheduler's last word."""
    def ready() -> dict[str, Any] | None:
        pod = get(api, "Pod", namespace, name)
        if pod is None or not pod["spec"].get("nodeName"):
            return None
        statuses = {s["name"]: s.get("resourceClaimName") for s in pod.get("status", {}).get("resourceClaimStatuses") or []}
        for pc in pod["spec"].get("resourceClaims") or []:
            claim = pc.get("resourceClaimName") or statuses.get(pc["name"])
            if claim is None or not _claim_ready(api, namespace, claim, pod["metadata"]["uid"]):
                return None
        return pod

    try:
        return wait_until(ready, timeout, f"pod {namespace}/{name} to be scheduled with allocated claims")
    except AssertionError as exc:
        pod = get(api, "Pod", namespace, name) or {}
        conditions = [(c.get("type"), c.get("reason"), c.get("message")) for c in pod.get("status", {}).get("conditions") or []]
        raise AssertionError(f"{exc}; pod conditions: {conditions}") from None


def delete_pod(api: KubeApi, namespace: str, name: str, timeout: float = 30.0) -> None:
    """Delete at once (no kubelet would ever confirm a graceful stop) and wait until it is gone."""
    try:
        api.request("DELETE", f"{namespaced_collection('Pod', namespace)}/{name}",
                    body={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
    except ApiError as exc:
        if not exc.not_found:
            raise
    wait_until(lambda: get(api, "Pod", namespace, name) is None, timeout, f"pod {namespace}/{name} to be deleted")


def node_slices(api: KubeApi, driver: str, node: str) -> list[dict[str, Any]]:
    return api.list(f"{RESOURCE_V1}/resourceslices", field_selector=f"spec.driver={driver},spec.nodeName={node}")["items"]


def complete_pool(slices: list[dict[str, Any]]) -> bool:
    """All slices of the newest generation are there (the scheduler ignores an incomplete pool)."""
    if not slices:
        return False
    newest = max(s["spec"]["pool"]["generation"] for s in slices)
    current = [s for s in slices if s["spec"]["pool"]["generation"] == newest]
    return len(current) == current[0]["spec"]["pool"]["resourceSliceCount"]


def slice_devices(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for s in slices for d in s["spec"].get("devices") or []]
