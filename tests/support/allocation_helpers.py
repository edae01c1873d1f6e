"""Helpers for the allocation end-to-end tests: a simulated fleet published for a driver of its own, its
DeviceClasses, one namespace per test, claims with pods, and what the scheduler made of them."""
from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from e2e_helpers import slices_of

from api.deviceclasses import device_classes
from cli.publish_cmd import SIMULATED_LABEL, desired_fleet_pools
from controller.cluster import ClusterController
from dra.sim.fleet import load_fleet
from kube.client import KubeApi, namespaced_collection
from kube.resourceslices import DesiredPool, Owner, ResourceSliceController
from kube.serverversion import api_features
from testbed.demo_examples import create_namespace, delete_namespace
from testbed.demo_report import device_index

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
FLEETS = EXAMPLES / "fleets"


def renamed_fleet(doc: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The fleet with every node renamed `<prefix>-<name>`, so tests on the shared cluster never meet."""
    out = copy.deepcopy(doc)
    for node in out["nodes"]:
        node["name"] = f"{prefix}-{node['name']}"
    return out


class PublishedFleet:
    """A fleet whose nodes are registered and whose slices are published (once, by the slice controller)."""

    def __init__(self, cluster: Any, api_client: Any, driver: str, doc: dict[str, Any], workdir: Path) -> None:
        self.cluster, self.api_client, self.driver = cluster, api_client, driver
        self.path = workdir / "fleet.yaml"
        self.path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.fleet = load_fleet(self.path)
        self.pools: dict[str, DesiredPool] = {}
        self.controller: ResourceSliceController | None = None

    @property
    def node_names(self) -> list[str]:
        return self.fleet.node_names

    def publish(self, timeout: float = 60.0, with_classes: bool = True) -> "PublishedFleet":
        for name in self.node_names:
            self.cluster.add_node(name, {SIMULATED_LABEL: "true"})
        self.pools = desired_fleet_pools(self.fleet, str(self.path), self.driver, api_features(self.api_client))
        self.controller = ResourceSliceController(self.api_client, self.driver, Owner.cluster())
        self.controller.update(self.pools)
        self.controller.run_once(timeout=timeout)
        if with_classes:
            ClusterController(self.api_client, self.driver, device_classes(self.driver)).run_until_success(30)
        return self

    def slices(self) -> list[dict[str, Any]]:
        return slices_of(self.api_client, self.driver)

    def devices(self) -> dict[tuple[str, str, str], dict[str, Any]]:
        return device_index(self.slices())

    def remove(self) -> None:
        """Deletes the nodes; the garbage collector removes their slices (the Node owns them)."""
        for name in self.node_names:
            try:
                self.cluster.delete_node(name)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass


@contextmanager
def temporary_namespace(api_client: Any, name: str) -> Iterator[str]:
    """A namespace for the duration of the block; its pods and then itself are deleted after."""
    kube = KubeApi(api_client)
    create_namespace(kube, name)
    try:
        yield name
    finally:
        delete_namespace(kube, name)


def attr(device: dict[str, Any], name: str) -> Any:
    value = (device.get("attributes") or {}).get(name) or {}
    return next(iter(value.values()), None)


# ---------------------------------------------------------------------------------------------- claims + pods

def claim_with_pod(name: str, device_class: str, cel: str | None = None,
                   capacity: dict[str, str] | None = None, *, request: str = "dev",
                   container: str = "c") -> list[dict[str, Any]]:
    """A ResourceClaim for one device of `device_class` and a pod that uses it (which makes the scheduler
    allocate it). The claim's request and the pod's claim entry are both named `request`."""
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if cel:
        exactly["selectors"] = [{"cel": {"expression": cel}}]
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
             "spec": {"devices": {"requests": [{"name": request, "exactly": exactly}]}}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"restartPolicy": "Never",
                    "containers": [{"name": container, "image": "example.invalid/none",
                                    "resources": {"claims": [{"name": request}]}}],
                    "resourceClaims": [{"name": request, "resourceClaimName": name}]}}
    return [claim, pod]


def get_claim(kube: KubeApi, ns: str, name: str) -> dict[str, Any]:
    return kube.get(f"{namespaced_collection('ResourceClaim', ns)}/{name}")


def get_pod(kube: KubeApi, ns: str, name: str) -> dict[str, Any]:
    return kube.get(f"{namespaced_collection('Pod', ns)}/{name}")


def allocated_devices(claim: dict[str, Any]) -> list[str]:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return [r["device"] for r in results]


def wait_allocated(kube: KubeApi, ns: str, name: str, timeout: float = 30.0) -> dict[str, Any]:
    """The claim once allocated and its pod bound; fails with the scheduler's word otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        claim = get_claim(kube, ns, name)
        pod = get_pod(kube, ns, name)
        if allocated_devices(claim) and pod["spec"].get("nodeName"):
            return claim
        if time.monotonic() > deadline:
            raise AssertionError(f"claim {ns}/{name} not allocated within {timeout}s: "
                                 f"{pod_scheduled_condition(pod)}")
        time.sleep(0.2)


def pod_scheduled_condition(pod: dict[str, Any]) -> dict[str, Any]:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled":
            return cond
    return {}


def wait_unschedulable(kube: KubeApi, ns: str, name: str, timeout: float = 30.0) -> str:
    """Waits until the scheduler has tried and given up on the pod; returns its message. Fails if the pod
    gets bound or its claim allocated instead."""
    deadline = time.monotonic() + timeout
    while True:
        pod = get_pod(kube, ns, name)
        claim = get_claim(kube, ns, name)
        assert not pod["spec"].get("nodeName"), f"pod {name} was bound to {pod['spec']['nodeName']}"
        assert not allocated_devices(claim), f"claim {name} was allocated {allocated_devices(claim)}"
        cond = pod_scheduled_condition(pod)
        if cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            return str(cond.get("message", ""))
        if time.monotonic() > deadline:
            raise AssertionError(f"the scheduler did not report pod {name} unschedulable within {timeout}s "
                                 f"(condition: {cond})")
        time.sleep(0.2)
