"""The chart's MPS tenancy MutatingAdmissionPolicy owns the tenancy key, on the real control plane.

The policy (rendered by `helm template` from templates/mutatingadmissionpolicy-mps-tenancy.yaml and applied as it
is) gives every new ResourceClaim the toleration of its own namespace for ``<driver>/mps-namespace``. A claim must
not step around it with a toleration of that key of its own: ``operator: Exists`` (any namespace) or ``value:
<another namespace>`` would let the scheduler place it on a GPU whose MPS daemon serves another namespace, where
the plugin refuses to prepare it and its pod waits in ContainerCreating. So every toleration of the key the user
wrote is dropped, in requests and in firstAvailable sub-requests, and the namespace's own is put in its place;
other tolerations stay as written.

On a node whose GPUs' MPS slots are all tainted for namespace A, pods of namespace B with such tolerations (in
their templates, so the claims the controller-manager makes from them) stay Pending, and a pod of A is placed.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from allocation_helpers import PublishedFleet
from standin.workloads import wait_until

from dra.model.tenancy import tenancy_taint, tenancy_taint_key, tenancy_toleration
from kube.client import ApiError, KubeApi, namespaced_collection
from testbed.demo_examples import apply_objects, create_namespace, delete_namespace
from testbed.helmchart import render

pytestmark = pytest.mark.e2e

MAP_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies"
MAP_BINDING_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicybindings"
MPS_SLOTS = {"default": {"wholeGpu": False, "slots": {"count": 2, "strategy": "mps"}}}
OTHER = {"key": "example.com/maintenance", "operator": "Exists", "effect": "NoSchedule"}
_probes = itertools.count()


def user_forms(key: str, other_namespace: str) -> dict[str, dict[str, Any]]:
    """Tolerations of the tenancy key a claim may carry of its own, by name."""
    return {"exists": {"key": key, "operator": "Exists"},
            "exists-noexecute": {"key": key, "operator": "Exists", "effect": "NoExecute"},
            "other-namespace": {"key": key, "operator": "Equal", "value": other_namespace, "effect": "NoExecute"},
            "other-namespace-any-effect": {"key": key, "value": other_namespace}}


@pytest.fixture
def tenancy_policy(api_client: Any, driver_name: str) -> Iterator[KubeApi]:
    """The chart's MutatingAdmissionPolicy and binding for the test's driver, in force."""
    kube = KubeApi(api_client)
    prefix = driver_name.split(".")[0]
    objects = [o for o in render("--set", f"driverName={driver_name}", "--set", f"fullnameOverride={prefix}-mps",
                                 release=f"{prefix}-mps", namespace=f"{prefix}-gpu-dra")
               if o["kind"] in ("MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")]
    assert [o["kind"] for o in objects] == ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"]
    paths = [MAP_PATH if o["kind"] == "MutatingAdmissionPolicy" else MAP_BINDING_PATH for o in objects]
    probe_ns = f"{prefix}-mps-probe"
    create_namespace(kube, probe_ns)
    try:
        for path, obj in zip(paths, objects):
            kube.create(path, obj)

        def in_force() -> bool:      # policies load asynchronously
            claim = kube.create(namespaced_collection("ResourceClaim", probe_ns),
                                claim_body(f"probe-{next(_probes)}", driver_name))
            return tenancy_toleration(driver_name, probe_ns) in tolerations_of(claim)[0]

        wait_until(in_force, 60, "the MutatingAdmissionPolicy to take effect")
        yield kube
    finally:
        for path, obj in zip(reversed(paths), reversed(objects)):
            try:
                kube.request("DELETE", f"{path}/{obj['metadata']['name']}")
            except ApiError:
                pass
        delete_namespace(kube, probe_ns)


def claim_spec(driver: str, tolerations: list[dict[str, Any]] | None = None,
               first_available: bool = False) -> dict[str, Any]:
    request: dict[str, Any] = {"deviceClassName": f"slot.{driver}"}
    if tolerations is not None:
        request["tolerations"] = tolerations
    if first_available:
        return {"devices": {"requests": [{"name": "slot", "firstAvailable": [{"name": "mps", **request}]}]}}
    return {"devices": {"requests": [{"name": "slot", "exactly": request}]}}


def claim_body(name: str, driver: str, tolerations: list[dict[str, Any]] | None = None,
               first_available: bool = False) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": claim_spec(driver, tolerations, first_available)}


def tolerations_of(claim: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The tolerations of each request and sub-request of a stored claim, in order."""
    out = []
    for r in claim["spec"]["devices"]["requests"]:
        for part in ([r["exactly"]] if "exactly" in r else r.get("firstAvailable") or []):
            out.append(part.get("tolerations") or [])
    return out


def test_a_claims_own_tolerations_of_the_tenancy_key_are_replaced_by_its_namespaces(
        tenancy_policy: KubeApi, driver_name: str) -> None:
    kube, prefix = tenancy_policy, driver_name.split(".")[0]
    team_a, team_b = f"{prefix}-team-a", f"{prefix}-team-b"
    key = tenancy_taint_key(driver_name)
    own = tenancy_toleration(driver_name, team_b)
    create_namespace(kube, team_b)
    try:
        for name, form in user_forms(key, team_a).items():
            for first_available in (False, True):
                suffix = "-fa" if first_available else ""
                stored = kube.create(namespaced_collection("ResourceClaim", team_b),
                                     claim_body(f"{name}{suffix}", driver_name, [OTHER, form], first_available))
                assert tolerations_of(stored) == [[OTHER, own]], (name, first_available, stored["spec"])
        # The 16 tolerations the API allows, all of the key: all dropped, the namespace's own in their place.
        stored = kube.create(namespaced_collection("ResourceClaim", team_b),
                             claim_body("sixteen", driver_name, [user_forms(key, team_a)["exists"]] * 16))
        assert tolerations_of(stored) == [[own]]
        # 16 other tolerations leave no room for the namespace's own: kept as written, the claim is still made
        # (without the toleration the scheduler keeps it off every tenant's GPU; its GPU stays untainted).
        others = [{**OTHER, "key": f"example.com/t{i}"} for i in range(16)]
        stored = kube.create(namespaced_collection("ResourceClaim", team_b), claim_body("full", driver_name, others))
        assert tolerations_of(stored) == [others]
    finally:
        delete_namespace(kube, team_b)


def slot_template(name: str, driver: str, tolerations: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": claim_spec(driver, tolerations)}}


def pod(name: str, template: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "resourceClaims": [{"name": "slot", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "c", "image": "example.invalid/none",
                                     "resources": {"claims": [{"name": "slot"}]}}]}}


def scheduling(kube: KubeApi, ns: str, name: str) -> str:
    """'bound' (to a node), 'unschedulable', or '' while the scheduler has not decided."""
    got = kube.get(f"{namespaced_collection('Pod', ns)}/{name}")
    if got["spec"].get("nodeName"):
        return "bound"
    cond = next((c for c in (got.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"), {})
    return "unschedulable" if cond.get("status") == "False" and cond.get("reason") == "Unschedulable" else ""


def test_a_pod_of_another_namespace_cannot_tolerate_its_way_onto_a_tenants_gpu(
        tenancy_policy: KubeApi, cluster: Any, api_client: Any, driver_name: str, tmp_path: Path) -> None:
    kube, prefix = tenancy_policy, driver_name.split(".")[0]
    team_a, team_b = f"{prefix}-team-a", f"{prefix}-team-b"
    key = tenancy_taint_key(driver_name)
    fleet = PublishedFleet(cluster, api_client, driver_name,
                           {"nodes": [{"name": f"{prefix}-mps-node", "gpus": [{"model": "H100-80GB", "count": 2}],
                                       "policy": MPS_SLOTS}]}, tmp_path).publish()
    try:
        # Every MPS slot serves namespace A, as the plugin taints them while A's daemons run.
        for pool in fleet.pools.values():
            for part in pool.slices:
                for dev in part.get("devices") or []:
                    if (dev.get("attributes") or {}).get("type") == {"string": "slot"}:
                        dev["taints"] = [tenancy_taint(driver_name, team_a)]
        assert fleet.controller is not None
        fleet.controller.update(fleet.pools)
        fleet.controller.run_once(timeout=30)
        for ns in (team_a, team_b):
            create_namespace(kube, ns)
        # A's own pod fits there (the policy gave its claim A's toleration), and leaves three slots free ...
        apply_objects(kube, [slot_template("plain", driver_name, None), pod("plain", "plain")], team_a)
        assert wait_until(lambda: scheduling(kube, team_a, "plain"), 60, "the scheduler to place A's pod") == "bound"
        # ... which B's pods, whatever they tolerate of the key, are kept off.
        forms = user_forms(key, team_a)
        apply_objects(kube, [obj for name, form in forms.items()
                             for obj in (slot_template(name, driver_name, [form]), pod(name, name))], team_b)

        def decided() -> dict[str, str]:
            states = {name: scheduling(kube, team_b, name) for name in forms}
            return states if all(states.values()) else {}

        assert wait_until(decided, 90, "the scheduler to decide B's pods") == {name: "unschedulable" for name in forms}
        time.sleep(2)       # and none is placed on a later try
        assert all(scheduling(kube, team_b, name) == "unschedulable" for name in forms)
    finally:
        for ns in (team_a, team_b):
            delete_namespace(kube, ns)
        fleet.remove()
