"""MPS tenancy as the scheduler sees it (dra.model.tenancy): which devices of a GPU carry the tenancy taint, for
which namespace, and when not at all (the tenant's claims lack the toleration, several namespaces share the
daemon, the daemon serves a MIG device)."""
from __future__ import annotations

from pathlib import Path

import pytest

from dra.model.devices import build_devices
from dra.model.tenancy import (
    GpuTenant,
    mps_served,
    tenancy_taint,
    tenancy_taints,
    tenancy_toleration,
    tolerates_tenancy,
)
from test_kubeletplugin_driver import DRIVER, Node, ok
from test_mps_tenancy import SLOTS, slot_claim


def tolerating(namespace: str) -> list[dict]:
    return [tenancy_toleration(DRIVER, namespace)]


def test_the_toleration_of_a_namespace_tolerates_its_taint_only() -> None:
    assert tolerates_tenancy(tolerating("team-a"), DRIVER, "team-a")
    assert not tolerates_tenancy(tolerating("team-a"), DRIVER, "team-b")
    assert not tolerates_tenancy([], DRIVER, "team-a")
    # For the eviction the effect must be NoExecute itself (device-taint eviction ignores other effects).
    assert tenancy_toleration(DRIVER, "x")["effect"] == tenancy_taint(DRIVER, "x")["effect"] == "NoExecute"
    assert tolerates_tenancy([{"operator": "Exists"}], DRIVER, "team-a")   # an admin's catch-all


def test_only_the_mps_served_devices_of_a_tenant_gpu_are_tainted(tmp_path: Path) -> None:
    node = Node(tmp_path, {"default": {"wholeGpu": True, "slots": {"count": 4, "strategy": "mps"}}})
    model = build_devices(node.inventory, node.policy, driver=DRIVER)
    gpu0 = node.uuids[0]
    taints = tenancy_taints(model.devices, {gpu0: GpuTenant("team-a", tolerated=True)}, DRIVER)
    assert set(taints) == {f"gpu-0-slot-{i}" for i in range(4)}
    assert all(t == [tenancy_taint(DRIVER, "team-a")] for t in taints.values())
    assert not any(mps_served(d) for d in model.devices if d.kind == "gpu")
    # A tenant whose claims do not all carry the toleration leaves its GPU untainted (its own pods stay).
    assert tenancy_taints(model.devices, {gpu0: GpuTenant("team-a", tolerated=False)}, DRIVER) == {}


def test_time_slicing_slots_are_never_tainted(tmp_path: Path) -> None:
    node = Node(tmp_path, {"default": {"wholeGpu": False, "slots": {"count": 2, "strategy": "time-slicing"}}})
    model = build_devices(node.inventory, node.policy, driver=DRIVER)
    assert tenancy_taints(model.devices, {node.uuids[0]: GpuTenant("a", tolerated=True)}, DRIVER) == {}


def tolerated_claim(node: Node, name: str, slot: int, namespace: str, gpu: int = 0, tolerate: bool = True):
    results = [{"request": "s", "device": f"gpu-{gpu}-slot-{slot}",
                "tolerations": tolerating(namespace) if tolerate else []}]
    return node.add_claim(name, results, namespace=namespace)


def test_the_driver_names_each_gpu_tenant_from_its_prepared_claims(tmp_path: Path) -> None:
    node = Node(tmp_path, {"default": SLOTS})
    a = tolerated_claim(node, "a", 0, "team-a")
    ok(node.driver, a)
    assert node.driver.mps_tenants() == {node.uuids[0]: GpuTenant("team-a", tolerated=True)}
    a2 = tolerated_claim(node, "a2", 1, "team-a", tolerate=False)    # made before the admission policy
    ok(node.driver, a2)
    assert node.driver.mps_tenants() == {node.uuids[0]: GpuTenant("team-a", tolerated=False)}
    b = tolerated_claim(node, "b", 0, "team-b", gpu=1)
    ok(node.driver, b)
    assert node.driver.mps_tenants()[node.uuids[1]] == GpuTenant("team-b", tolerated=True)
    node.driver.unprepare([a, a2])
    assert node.uuids[0] not in node.driver.mps_tenants()                # the daemon serves nobody now


def test_a_tolerated_claim_record_survives_a_restart(tmp_path: Path) -> None:
    node = Node(tmp_path, {"default": SLOTS})
    ok(node.driver, tolerated_claim(node, "a", 0, "team-a"))
    restarted = node.restart()
    assert restarted.mps_tenants() == {node.uuids[0]: GpuTenant("team-a", tolerated=True)}


def test_a_daemon_shared_across_namespaces_has_no_one_tenant(tmp_path: Path) -> None:
    node = Node(tmp_path, {"default": SLOTS, "mps": {"shareAcrossNamespaces": True}})
    ok(node.driver, tolerated_claim(node, "a", 0, "team-a"))
    ok(node.driver, tolerated_claim(node, "b", 1, "team-b"))
    assert node.driver.mps_tenants() == {}


@pytest.mark.parametrize("tolerations", [
    [{"key": f"{DRIVER}/mps-namespace", "operator": "Equal", "value": "team-a"}],   # no effect: fits all
    [{"key": f"{DRIVER}/mps-namespace", "operator": "Exists", "effect": "NoExecute"}],
])
def test_other_forms_of_the_toleration_count(tmp_path: Path, tolerations: list) -> None:
    node = Node(tmp_path, {"default": SLOTS})
    ref = node.add_claim("a", [{"request": "s", "device": "gpu-0-slot-0", "tolerations": tolerations}],
                         namespace="team-a")
    ok(node.driver, ref)
    assert node.driver.mps_tenants()[node.uuids[0]].tolerated


def test_a_malformed_toleration_list_fails_that_claim_naming_the_field(tmp_path: Path) -> None:
    node = Node(tmp_path, {"default": SLOTS})
    ref = node.add_claim("a", [{"request": "s", "device": "gpu-0-slot-0", "tolerations": ["x"]}],
                         namespace="team-a")
    error = node.driver.prepare([ref])[ref.uid].error
    assert "results[0].tolerations[0]: must be an object" in error
