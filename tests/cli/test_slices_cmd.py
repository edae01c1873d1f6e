"""The device model through the simulated fleet (fleet file -> fake NVML -> inventory -> slices), and
`gpu-dra slices`."""
from __future__ import annotations

import textwrap

import pytest
import yaml

from cli.main import main
from dra.model.policy import parse_node_policy
from dra.model.slices import ApiFeatures, desired_pool_slices, plan_pool, validate_pool
from dra.node.inventory import discover_once
from dra.sim.fleet import nvml_for_node, parse_fleet

FLEET = textwrap.dedent("""
    nodes:
      - name: node-a
        gpus:
          - model: H100-80GB
            count: 2
          - model: L4
            broken: fell off the bus
        policy:
          rules:
            - match: {model: H100}
              mig: dynamic
              slots: {count: 2, strategy: mps}
      - name: node-b
        gpus:
          - model: A30
            mig: {enabled: true, instances: [{profile: 2g.12gb, start: 0}, {profile: 1g.6gb, start: 3}]}
        policy: {default: {mig: static}}
""")


def inventory_of(fleet, name):
    return discover_once(nvml_for_node(fleet.node(name)))


@pytest.fixture
def fleet():
    return parse_fleet(yaml.safe_load(FLEET), "fleet.yaml")


def test_fleet_node_with_dynamic_mig_slots_and_a_lost_gpu(fleet):
    node = fleet.node("node-a")
    plan = plan_pool(inventory_of(fleet, "node-a"), parse_node_policy(node.policy, "p"), "gpu.dra-driver.io",
                     "node-a", ApiFeatures.all())
    assert validate_pool(plan.slices) == []
    devices = [d for s in plan.slices for d in s.get("devices", [])]
    names = [d["name"] for d in devices]
    assert names[:1] == ["gpu-0"] and "gpu-1-mig-7g80gb-0-0" in names and "gpu-1-slot-1" in names
    lost = next(d for d in devices if d["name"] == "gpu-2")
    assert lost["taints"][0]["key"] == "gpu.dra-driver.io/unhealthy"
    assert lost["taints"][0]["effect"] == "NoSchedule"
    assert [cs["name"] for s in plan.slices for cs in s.get("sharedCounters", [])] == ["gpu-0-counters", "gpu-1-counters"]


def test_fleet_node_with_static_mig_publishes_nvml_uuids(fleet):
    inv = inventory_of(fleet, "node-b")
    specs = desired_pool_slices(inv, parse_node_policy(fleet.node("node-b").policy, "p"), "gpu.nvidia.com",
                                "node-b", ApiFeatures.all())
    devices = specs[0]["devices"]
    assert [d["name"] for d in devices] == ["gpu-0-mig-1g6gb-14-3", "gpu-0-mig-2g12gb-5-0"]
    assert {d["attributes"]["uuid"]["string"] for d in devices} == {i.uuid for i in inv.gpus[0].mig_instances}
    assert all(d["attributes"]["parentUUID"]["string"] == inv.gpus[0].uuid for d in devices)


def test_fleet_inventory_is_stable_across_restarts(fleet):
    pol = parse_node_policy(fleet.node("node-a").policy, "p")
    a = desired_pool_slices(inventory_of(fleet, "node-a"), pol, "gpu.dra-driver.io", "node-a", ApiFeatures.all())
    b = desired_pool_slices(inventory_of(fleet, "node-a"), pol, "gpu.dra-driver.io", "node-a", ApiFeatures.all())
    assert a == b


def test_big_fleet_node_validates():
    data = {"nodes": [{"name": "big", "gpus": [{"model": "H200-141GB", "count": 8}, {"model": "B200", "count": 8}],
                       "policy": {"default": {"mig": "dynamic", "slots": {"count": 4, "strategy": "mps"}}}}]}
    fleet = parse_fleet(data, "big.yaml")
    plan = plan_pool(inventory_of(fleet, "big"), parse_node_policy(data["nodes"][0]["policy"], "p"),
                     "gpu.dra-driver.io", "big", ApiFeatures.all())
    assert validate_pool(plan.slices) == []
    assert sum(len(s.get("devices", [])) for s in plan.slices) == 16 * (1 + 25 + 4)


# --------------------------------------------------------------------------------------------- CLI

@pytest.fixture
def fleet_file(tmp_path):
    p = tmp_path / "fleet.yaml"
    p.write_text(FLEET)
    return p


def run_cli(capsys, *argv):
    rc = main(["slices", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_prints_full_resourceslice_objects(capsys, fleet_file):
    rc, out, err = run_cli(capsys, "--fleet", fleet_file)
    assert rc == 0, err
    objs = list(yaml.safe_load_all(out))
    assert [o["metadata"]["name"] for o in objs] == [
        "node-a-gpu.dra-driver.io-0000", "node-a-gpu.dra-driver.io-0001", "node-b-gpu.dra-driver.io-0000"]
    for o in objs:
        assert o["apiVersion"] == "resource.k8s.io/v1" and o["kind"] == "ResourceSlice"
        assert o["spec"]["pool"]["generation"] == 1
    assert validate_pool([o["spec"] for o in objs[:2]]) == []
    assert objs[0]["spec"]["pool"]["resourceSliceCount"] == 2
    assert "&id" not in out  # no YAML anchors: kubectl and humans read it


def test_cli_compat_nvidia_and_node_filter(capsys, fleet_file):
    rc, out, _ = run_cli(capsys, "--fleet", fleet_file, "--node", "node-b", "--compat-nvidia")
    assert rc == 0
    objs = list(yaml.safe_load_all(out))
    assert [o["metadata"]["name"] for o in objs] == ["node-b-gpu.nvidia.com-0000"]
    assert objs[0]["spec"]["driver"] == "gpu.nvidia.com"


def test_cli_old_server_leaves_out_and_says_so(capsys, fleet_file):
    rc, out, err = run_cli(capsys, "--fleet", fleet_file, "--node", "node-a", "--server-version", "1.35")
    assert rc == 0
    objs = list(yaml.safe_load_all(out))
    assert [d["name"] for o in objs for d in o["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert "partitionable devices" in err and "gpu-2: 1 gpu" in err


@pytest.mark.parametrize("argv, words", [
    (["--node", "nope"], "no node 'nope'"),
    (["--server-version", "2.0"], "--server-version"),
    (["--server-version", "1.30"], "1.34"),
    (["--compat-nvidia", "--driver-name", "x.example.com"], "cannot be combined"),
])
def test_cli_bad_arguments(capsys, fleet_file, argv, words):
    rc, _, err = run_cli(capsys, "--fleet", fleet_file, *argv)
    assert rc == 2 and words in err


def test_cli_policy_error_names_the_field(capsys, tmp_path):
    p = tmp_path / "f.yaml"
    p.write_text("nodes: [{name: n, gpus: [{model: L4}], policy: {default: {slots: {count: 99}}}}]\n")
    rc, _, err = run_cli(capsys, "--fleet", p)
    assert rc == 2 and "slots.count" in err


def test_cli_device_model_error_names_the_gpu(capsys, tmp_path):
    p = tmp_path / "f.yaml"
    p.write_text("nodes: [{name: n, gpus: [{model: L4}], policy: {default: {mig: dynamic}}}]\n")
    rc, _, err = run_cli(capsys, "--fleet", p)
    assert rc == 2 and "NVIDIA L4" in err and "mig: dynamic" in err


def test_cli_exits_1_on_validation_errors(capsys, fleet_file, monkeypatch):
    import dra.model.slices

    monkeypatch.setattr(dra.model.slices, "validate_pool", lambda specs: ["device 'x': too long"])
    rc, out, err = run_cli(capsys, "--fleet", fleet_file, "--node", "node-b")
    assert rc == 1 and "invalid ResourceSlice: device 'x': too long" in err
