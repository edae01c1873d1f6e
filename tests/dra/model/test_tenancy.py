"""MPS tenancy as the scheduler sees it (dra.model.tenancy): which devices of a GPU carry the tenancy taint, for
which namespace, and when not at all (the tenant's claims lack the toleration, several namespaces share the
daemon, the daemon serves a MIG device)."""
from __future__ import annotations

from pathlib import Path

import pytest
from driver_node import DRIVER, SLOTS, Node, ok

from dra.model.devices import build_devices
from dra.model.tenancy import (
    GpuTenant,
    mps_served,
    tenancy_taint,
    tenancy_taints,
    tenancy_toleration,
    tolerates_tenancy,
)


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


# ----- the plugin: what it publishes and reports ---------------------------------------------------------------------
def _plugin(base: Path, claims: object, features: object) -> object:
    import yaml

    from kubeletplugin.plugin import KubeletPlugin, PluginOptions

    fleet = base / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"nodes": [{"name": "node-a", "gpus": [{"model": "H100-80GB", "count": 2}],
                                                "policy": {"default": SLOTS}}]}))
    (base / "boot_id").write_text("b1\n")
    opts = PluginOptions(node_name="node-a", registry_dir=str(base / "reg"), plugin_dir=str(base / "plug"),
                         cdi_root=str(base / "cdi"), driver_root=str(base / "noroot"), proc_root=str(base / "noproc"),
                         dev_root=str(base / "nodev"), fleet=str(fleet), boot_id_path=str(base / "boot_id"),
                         health_wait_ms=100)
    return KubeletPlugin(opts, claim_source=claims, features=features, publish=False)


@pytest.mark.parametrize("device_taints", [True, False], ids=["1.36+", "no-device-taints"])
def test_the_plugin_taints_its_tenants_gpu_and_keeps_it_healthy(device_taints: bool) -> None:
    """With device taints on the server the tenant's GPU's slots carry the taint (and stay healthy in the
    kubelet's health stream); without (1.34/1.35, even with partitionable devices gated on) none do."""
    import shutil
    import tempfile

    from dra.model.slices import ApiFeatures
    from kubeletplugin.claims import DictClaimSource
    from kubeletplugin.transport.nodedriver import ClaimRef

    base = Path(tempfile.mkdtemp(prefix="tnt-", dir="/tmp"))   # short: unix socket paths are limited
    claims = DictClaimSource()
    uid = "0b6f7a49-3c2d-4b7e-9a51-7f00c0ffee01"
    claims.put({"metadata": {"name": "a", "namespace": "team-a", "uid": uid}, "status": {"allocation": {"devices": {
        "results": [{"request": "s", "driver": DRIVER, "pool": "node-a", "device": "gpu-0-slot-0",
                     "tolerations": tolerating("team-a")}]}}}})
    plugin = _plugin(base, claims, ApiFeatures(partitionable=True, consumable_capacity=True,
                                               device_taints=device_taints))
    try:
        plugin.start()
        result = plugin.driver.prepare([ClaimRef("team-a", uid, "a")])
        plugin._after_call()              # what the driver calls after every kubelet call
        assert result[uid].error == ""
        taints = {d.name: d.taints for d in plugin.published if d.taints}
        want = {f"gpu-0-slot-{i}": (tenancy_taint(DRIVER, "team-a"),) for i in range(4)} if device_taints else {}
        assert taints == want
        _, health = plugin.health_board.snapshot()
        assert {h.status for h in health} == {"Healthy"}            # a tenancy taint says nothing of health
        assert plugin.metrics.devices.labels(state="unhealthy")._value.get() == 0
        plugin.driver.unprepare([ClaimRef("team-a", uid, "a")])
        plugin._after_call()
        assert not any(d.taints for d in plugin.published)          # the daemon serves nobody: no taint
    finally:
        plugin.stop()
        from standin.node import kill_mps_daemons_under

        kill_mps_daemons_under(base)
        shutil.rmtree(base, ignore_errors=True)
