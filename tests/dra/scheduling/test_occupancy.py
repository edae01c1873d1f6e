"""`gpu-dra status`: who holds which device and what is free (dra.scheduling.occupancy), over wire-format slices,
claims and pods as the API server returns them; the table and JSON output; the kubectl plugin's arguments."""
from __future__ import annotations

import json
import textwrap
from typing import Any

import pytest
import yaml
from claims import reserved, resource_claim
from hypothesis import given, settings
from hypothesis import strategies as st

from cli import kubectl_gpu
from cli.status_cmd import render
from dra.model.catalog import get_model
from dra.model.devices import mig_device_name
from dra.model.mig import placement_problem
from dra.model.policy import parse_node_policy
from dra.model.slices import ApiFeatures, plan_pool
from dra.node.inventory import discover_once
from dra.scheduling.occupancy import BLOCKED, FREE, HELD, TAINTED, draw_slices, fleet_status, fleet_summary
from dra.sim.fleet import nvml_for_node, parse_fleet

DRIVER = "gpu.dra-driver.io"
H100 = get_model("H100-80GB")

FLEET = yaml.safe_load(textwrap.dedent("""
    nodes:
      - name: node-a
        gpus: [{model: H100-80GB, count: 4}]
        policy:
          default: {wholeGpu: true, mig: dynamic}
          rules:
            - match: {index: 2}
              mig: dynamic
              slots: {count: 4, strategy: mps}
            - match: {index: 3}
              wholeGpu: false
              memoryShares: {minimum: 1Gi, step: 1Gi}
      - name: node-s
        gpus:
          - model: A100-80GB
            mig: {enabled: true, instances: [{profile: 3g.40gb, start: 4}, {profile: 2g.20gb, start: 0},
                                             {profile: 1g.10gb, start: 2}, {profile: 1g.10gb, start: 3}]}
        policy: {default: {mig: static}}
"""))


def published(node: str, doc: dict[str, Any] = FLEET, generation: int = 1,
              taints: dict[str, list[dict[str, str]]] | None = None) -> list[dict[str, Any]]:
    """The node's ResourceSlices as the API server returns them."""
    fleet = parse_fleet(doc, "test fleet")
    spec = fleet.node(node)
    inv = discover_once(nvml_for_node(spec))
    plan = plan_pool(inv, parse_node_policy(spec.policy, "test"), DRIVER, node, ApiFeatures.all(), taints=taints)
    return [{"metadata": {"name": f"{node}-{DRIVER}-{i:04d}"},
             "spec": {**s, "pool": {**s["pool"], "generation": generation}}} for i, s in enumerate(plan.slices)]


def claim(name: str, *devices: str, ns: str = "team", pool: str = "node-a", pods: tuple[str, ...] = (),
          memory: str | None = None) -> dict[str, Any]:
    results = []
    for d in devices:
        r: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": pool, "device": d}
        if memory:
            r["consumedCapacity"] = {"memory": memory}
        results.append(r)
    return resource_claim(name, ns, uid=f"uid-{name}", results=results, reserved_for=reserved(*((p, f"uid-{p}") for p in pods)),
                          typed=False)


def gpu(status: list[Any], minor: int, node: str = "node-a") -> Any:
    [n] = [n for n in status if n.name == node]
    [g] = [g for g in n.gpus if g.minor == minor]
    return g


def state(g: Any, name: str) -> str:
    [d] = [d for d in g.devices if d.name == name]
    return d.state


# --------------------------------------------------------------------------------------------------- holders

def test_an_empty_gpu_is_free_whole_and_for_every_profile() -> None:
    g = gpu(fleet_status(published("node-a"), [], [], DRIVER), 0)
    assert g.whole_free is True and g.healthy and g.product == "NVIDIA H100 80GB HBM3"
    assert g.uuid.startswith("GPU-")
    # every profile as often as it fits on an empty H100 (7 compute slices, one OFA engine)
    assert g.mig_free == {"1g.10gb": 7, "1g.10gb+me": 1, "1g.20gb": 4, "2g.20gb": 3, "3g.40gb": 2, "4g.40gb": 1,
                          "7g.80gb": 1}
    assert g.memory_slices == "[........]" and g.legend == []


def test_holders_name_claim_namespace_and_pods_and_the_row_draws_placements() -> None:
    c = claim("train", "gpu-0-mig-3g40gb-9-4", "gpu-0-mig-1g10gb-19-1", pods=("train-0",))
    g = gpu(fleet_status(published("node-a"), [c], [], DRIVER), 0)
    assert state(g, "gpu-0-mig-3g40gb-9-4") == HELD
    [holder] = [d for d in g.devices if d.name == "gpu-0-mig-3g40gb-9-4"][0].holders
    assert (holder.namespace, holder.claim, holder.pods) == ("team", "train", ("train-0",))
    assert holder.describe() == "team/train → train-0"
    assert state(g, "gpu-0") == BLOCKED                       # the whole GPU needs every memory slice
    assert state(g, "gpu-0-mig-2g20gb-14-2") == FREE
    assert state(g, "gpu-0-mig-3g40gb-9-0") == BLOCKED        # overlaps the 1g at slice 1
    assert state(g, "gpu-0-mig-4g40gb-5-0") == BLOCKED        # 4g needs 4 compute slices, 3 are left
    assert g.whole_free is False
    # slices 0, 2, 3 free; 3 compute slices left
    assert g.mig_free == {"1g.10gb": 3, "1g.10gb+me": 1, "1g.20gb": 1, "2g.20gb": 1}
    assert g.memory_slices == "[.|A|..|BBBB]"
    assert [letter for letter, _ in g.legend] == ["A", "B"]
    assert g.legend[1][1] == "gpu-0-mig-3g40gb-9-4 (3g.40gb): team/train → train-0"


def test_a_held_whole_gpu_fills_the_row_and_leaves_nothing() -> None:
    g = gpu(fleet_status(published("node-a"), [claim("big", "gpu-1")], [], DRIVER), 1)
    assert g.whole_free is False and g.mig_free == {}
    assert g.memory_slices == "[AAAAAAAA]"
    assert all(d.state in (HELD, BLOCKED) for d in g.devices)


def test_slots_count_free_and_exclude_the_whole_gpu_and_partitions() -> None:
    claims = [claim("s0", "gpu-2-slot-0", pods=("a",)), claim("s3", "gpu-2-slot-3", pods=("b",))]
    g = gpu(fleet_status(published("node-a"), claims, [], DRIVER), 2)
    assert (g.slots_free, g.slots_total) == (2, 4)
    assert g.whole_free is False and g.mig_free == {}
    assert g.memory_slices == "[++++++++]"                  # two slots share every memory slice
    assert [t for _, t in g.legend] == ["gpu-2-slot-0 (mps): team/s0 → a", "gpu-2-slot-3 (mps): team/s3 → b"]


def test_a_held_partition_leaves_no_slot() -> None:
    g = gpu(fleet_status(published("node-a"), [claim("m", "gpu-2-mig-1g10gb-19-6")], [], DRIVER), 2)
    assert (g.slots_free, g.slots_total) == (0, 4)
    assert state(g, "gpu-2-slot-0") == BLOCKED


CAPACITY_FLEET = {"nodes": [{"name": "node-c", "gpus": [{"model": "H100-80GB", "count": 1}], "policy": {"default": {
    "mig": "dynamic", "dynamicMig": {"profiles": ["1g.10gb"]},
    "slots": {"count": 4, "strategy": "mps", "layout": "capacity"}}}}]}


def test_slot_shares_of_the_capacity_layout_count_their_slots_and_exclude_the_rest() -> None:
    slices = published("node-c", CAPACITY_FLEET)
    g = gpu(fleet_status(slices, [], [], DRIVER), 0, "node-c")
    assert (g.slots_free, g.slots_total) == (4, 4) and g.whole_free is True and g.mig_free == {"1g.10gb": 7}
    one = resource_claim("s1", "team", uid="uid-s1", typed=False, results=[{
        "request": "gpu", "driver": DRIVER, "pool": "node-c", "device": "gpu-0-slots", "shareID": "a",
        "consumedCapacity": {"slots": "1"}}])
    two = resource_claim("s2", "team", uid="uid-s2", typed=False, results=[{
        "request": "gpu", "driver": DRIVER, "pool": "node-c", "device": "gpu-0-slots", "shareID": "b",
        "consumedCapacity": {"slots": "2"}}])
    g = gpu(fleet_status(slices, [one, two], [], DRIVER), 0, "node-c")
    assert (g.slots_free, g.slots_total) == (1, 4)
    assert g.whole_free is False and g.mig_free == {}
    assert state(g, "gpu-0-slots") == HELD and state(g, "gpu-0") == BLOCKED
    whole = claim("w", "gpu-0", pool="node-c")
    g = gpu(fleet_status(slices, [whole], [], DRIVER), 0, "node-c")
    assert (g.slots_free, g.slots_total) == (0, 4) and state(g, "gpu-0-slots") == BLOCKED


MIG_CAPACITY_FLEET = {"nodes": [{"name": "node-m", "gpus": [{"model": "H100-80GB", "count": 1}], "policy": {
    "default": {"mig": "dynamic", "dynamicMig": {"profiles": ["1g.10gb"], "layout": "capacity"},
                "slots": {"count": 4, "strategy": "mps", "layout": "capacity"}}}}]}


def test_mig_shares_of_the_capacity_layout_count_their_instances_and_exclude_the_rest() -> None:
    slices = published("node-m", MIG_CAPACITY_FLEET)
    g = gpu(fleet_status(slices, [], [], DRIVER), 0, "node-m")
    assert g.mig_free == {"1g.10gb": 7} and g.whole_free is True and g.slots_free == 4
    shares = [resource_claim(f"m{i}", "team", uid=f"uid-m{i}", typed=False, results=[{
        "request": "mig", "driver": DRIVER, "pool": "node-m", "device": "gpu-0-mig-1g10gb-19", "shareID": f"s{i}",
        "consumedCapacity": {"instances": str(k)}}]) for i, k in enumerate((1, 3))]
    g = gpu(fleet_status(slices, shares, [], DRIVER), 0, "node-m")
    assert g.mig_free == {"1g.10gb": 3} and g.whole_free is False and g.slots_free == 0
    assert state(g, "gpu-0-mig-1g10gb-19") == HELD and state(g, "gpu-0") == BLOCKED
    g = gpu(fleet_status(slices, [claim("w", "gpu-0", pool="node-m")], [], DRIVER), 0, "node-m")
    assert g.mig_free == {} and state(g, "gpu-0-mig-1g10gb-19") == BLOCKED


def test_share_memory_left_is_the_total_less_what_claims_consumed() -> None:
    claims = [claim("a", "gpu-3-shared", memory="10Gi", pods=("p",)), claim("b", "gpu-3-shared", memory="4Gi")]
    g = gpu(fleet_status(published("node-a"), claims, [], DRIVER), 3)
    assert g.share_total_bytes == 81559 << 20
    assert g.share_free_bytes == (81559 << 20) - (14 << 30)
    [d] = g.devices
    assert d.state == HELD and [h.claim for h in d.holders] == ["a", "b"]
    assert g.memory_slices == "" and g.whole_free is None


def test_a_blocking_taint_makes_the_gpu_unhealthy_and_its_devices_unavailable() -> None:
    taints = {"gpu-1": [{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}],
              "gpu-0": [{"key": f"{DRIVER}/unmonitored", "effect": "None"}]}
    status = fleet_status(published("node-a", taints=taints), [], [], DRIVER)
    sick, fine = gpu(status, 1), gpu(status, 0)
    assert not sick.healthy and sick.taints == (f"{DRIVER}/xid=79:NoSchedule",)
    assert sick.whole_free is False and sick.mig_free == {}
    assert {d.state for d in sick.devices} == {TAINTED}
    assert fine.healthy and fine.taints == (f"{DRIVER}/unmonitored:None",) and fine.whole_free
    assert fleet_summary(status)["unhealthy_gpus"] == 1


def test_static_partitions_are_drawn_with_the_placement_rule() -> None:
    g = gpu(fleet_status(published("node-s"), [claim("inf", "gpu-0-mig-3g40gb-9-4", pool="node-s")], [], DRIVER),
            0, node="node-s")
    assert g.whole_free is None
    assert g.mig_free == {"1g.10gb": 2, "2g.20gb": 1}         # the free static partitions
    assert g.memory_slices == "[....|AAAA]"


def test_pods_found_through_their_spec_and_generated_claim_names() -> None:
    c = claim("job-gpu-x7k2", "gpu-0")
    pods = [{"metadata": {"namespace": "team", "name": "job"},
             "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]},
             "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "job-gpu-x7k2"}]}},
            {"metadata": {"namespace": "other", "name": "same-claim-name-elsewhere"},
             "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "job-gpu-x7k2"}]}}]
    g = gpu(fleet_status(published("node-a"), [c], pods, DRIVER), 0)
    [d] = [d for d in g.devices if d.name == "gpu-0"]
    assert d.holders[0].pods == ("job",)


def test_only_the_newest_pool_generation_and_this_driver_count() -> None:
    old = published("node-a", generation=1)
    new = published("node-a", generation=2)
    for s in old:
        s["metadata"]["name"] += "-old"
    foreign = [{**s, "spec": {**s["spec"], "driver": "other.example.com"}} for s in published("node-a")]
    status = fleet_status(old + new + foreign, [claim("c", "gpu-0")], [], DRIVER)
    [n] = status
    assert len(n.gpus) == 4
    assert len([d for d in n.gpus[0].devices if d.name == "gpu-0"]) == 1
    assert fleet_status(old + new, [], [], DRIVER, node="node-b") == []


def test_claims_of_other_drivers_and_pools_hold_nothing_here() -> None:
    claims = [claim("x", "gpu-0", pool="node-b"), {**claim("y", "gpu-0"), "status": {"allocation": {"devices": {
        "results": [{"request": "r", "driver": "other.example.com", "pool": "node-a", "device": "gpu-0"}]}}}}]
    assert gpu(fleet_status(published("node-a"), claims, [], DRIVER), 0).whole_free is True


def test_pods_are_read_only_where_an_allocated_claim_has_no_reservation() -> None:
    from ops.status.reads import unreserved_namespaces

    unreserved = {**claim("u", "gpu-0", ns="waiting"), "status": {**claim("u", "gpu-0")["status"], "reservedFor": []}}
    foreign = {**claim("f", "gpu-0", ns="other"), "status": {"allocation": {"devices": {"results": [
        {"request": "r", "driver": "other.example.com", "pool": "node-a", "device": "gpu-0"}]}}}}
    pending = {"metadata": {"namespace": "pending", "name": "p"}, "status": {}}
    assert unreserved_namespaces([claim("r", "gpu-1", pods=("p",)), unreserved, foreign, pending], DRIVER) == {"waiting"}


# --------------------------------------------------------------------------------------------------- one rule

PROFILES = H100.mig_profiles


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([(p.profile_id, s) for p in PROFILES for s in p.starts]), max_size=5))
def test_a_profile_is_placeable_exactly_when_the_placement_rule_admits_it(wanted: list[tuple[int, int]]) -> None:
    """The counters the status reads and dra.model.mig's placement rule agree on every reachable layout."""
    layout: list[tuple[int, int]] = []
    for pid, start in wanted:
        if placement_problem(PROFILES, layout, pid, start) is None:
            layout.append((pid, start))
    by_id = {p.profile_id: p for p in PROFILES}
    held = [mig_device_name(0, by_id[pid].name, pid, s) for pid, s in layout]
    g = gpu(fleet_status(published("node-a"), [claim("c", *held)] if held else [], [], DRIVER), 0)
    for p in PROFILES:
        admitted = any(placement_problem(PROFILES, layout, p.profile_id, s) is None for s in p.starts)
        assert (g.mig_free.get(p.name, 0) > 0) == admitted, (layout, p.name)


def test_draw_slices_groups_runs_of_one_occupant() -> None:
    assert draw_slices([["A"]] * 4 + [["B"]] * 2 + [[], []] + [["C"]]) == "[AAAA|BB|..|C]"
    assert draw_slices([["A"], ["A", "B"], []]) == "[A|+|.]"
    assert draw_slices([["A"], ["B"]]) == "[A|B]"


# --------------------------------------------------------------------------------------------------- output

def test_table_lists_holders_free_capacity_and_the_row() -> None:
    c = claim("train", "gpu-0-mig-3g40gb-9-4", pods=("train-0",))
    text = render(fleet_status(published("node-a"), [c], [], DRIVER))
    assert "NODE node-a: 4 GPUs, 2 whole free, 4/4 slots free" in text
    assert "gpu-0-mig-3g40gb-9-4  mig 3g.40gb" in text and "held    team/train → train-0" in text
    assert "gpu-0-mig-1g10gb-19-6" not in text                # free dynamic placements are summed up
    assert "free: whole GPU no; MIG 1g.10gb ×4, 1g.10gb+me ×1, 1g.20gb ×2, 2g.20gb ×2, 3g.40gb ×1, 4g.40gb ×1" in text
    assert "memory slices [....|AAAA]  (. = free)" in text
    assert "      A gpu-0-mig-3g40gb-9-4 (3g.40gb): team/train → train-0" in text
    assert "free: share memory 81559Mi of 81559Mi" in text
    assert "gpu-0-mig-1g10gb-19-6" in render(fleet_status(published("node-a"), [c], [], DRIVER), all_devices=True)


def test_json_and_yaml_carry_the_same_document() -> None:
    status = fleet_status(published("node-a"), [claim("c", "gpu-1", pods=("p",))], [], DRIVER)
    doc = json.loads(render(status, "json"))
    assert doc == yaml.safe_load(render(status, "yaml"))
    # Kubernetes' JSON conventions: camelCase keys; names used as keys (MIG profiles) as they are.
    assert doc["summary"]["gpus"] == 4 and doc["summary"]["wholeGpusFree"] == 2
    g1 = doc["nodes"][0]["gpus"][1]
    assert g1["memorySlices"] == "[AAAAAAAA]" and g1["healthy"] is True
    assert g1["legend"] == [{"letter": "A", "holder": "gpu-1: team/c → p"}]
    assert doc["nodes"][0]["gpus"][3]["shareFree"] == "81559Mi"
    assert "otherDevices" in doc["nodes"][0] and "1g.10gb" in doc["summary"]["migPlaceable"]
    assert not [k for k in _keys(doc) if "_" in k]


def _keys(doc: Any) -> list[str]:
    """Every key of every mapping in the document."""
    if isinstance(doc, dict):
        return [*doc, *(k for v in doc.values() for k in _keys(v))]
    return [k for v in doc for k in _keys(v)] if isinstance(doc, list) else []


def test_wide_and_name_outputs() -> None:
    status = fleet_status(published("node-a"), [claim("c", "gpu-1", pods=("p",))], [], DRIVER)
    wide = render(status, "wide").splitlines()
    row = next(line for line in wide if line.strip().startswith("gpu-1 "))
    assert "80Gi" in row or "Mi" in row, row           # the memory column
    assert len(row) > len(next(line for line in render(status, "table").splitlines()
                               if line.strip().startswith("gpu-1 ")))
    assert render(status, "name") == "node/node-a\n"


@pytest.mark.parametrize("argv, expected", [
    ([], ["status"]),
    (["node-a"], ["status", "node-a"]),
    (["status", "node-a", "-o", "json"], ["status", "node-a", "-o", "json"]),
    (["-o", "yaml"], ["status", "-o", "yaml"]),
    # Flags anywhere, as kubectl takes them: before the command, with their values.
    (["--kubeconfig", "K", "status", "node-b"], ["status", "--kubeconfig", "K", "node-b"]),
    (["--context", "prod", "-o", "wide"], ["status", "--context", "prod", "-o", "wide"]),
    (["-n", "ml", "explain", "pod/p"], ["explain", "-n", "ml", "pod/p"]),
    (["--kubeconfig=K", "explain", "pod/p"], ["explain", "--kubeconfig=K", "pod/p"]),
])
def test_kubectl_gpu_runs_status_by_default(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                            expected: list[str]) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(kubectl_gpu, "gpu_dra", lambda args, prog="gpu-dra": seen.append(args) or 0)
    assert kubectl_gpu.main(argv) == 0
    assert seen == [expected]


def test_kubectl_gpu_help_names_kubectl_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        kubectl_gpu.main(["--kubeconfig", "K", "status", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: kubectl gpu status") and "--context" in out and "gpu-dra" not in out


def test_kubectl_gpu_is_a_console_script() -> None:
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubectl-gpu"] == "cli.kubectl_gpu:main"


def test_the_readme_example_is_what_the_command_prints() -> None:
    """README.md's `gpu-dra status node-a` example: node-a of the demo fleet with its five claims."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    block = readme.split("$ gpu-dra status node-a\n", 1)[1].split("```", 1)[0].splitlines()
    doc = yaml.safe_load((Path(__file__).resolve().parents[3] / "examples" / "fleets" / "demo.yaml").read_text())
    claims = [claim("whole-gpu", "gpu-0", ns="gpu-demo", pods=("whole-gpu",)),
              claim("mig-3g", "gpu-1-mig-3g40gb-9-4", ns="gpu-demo", pods=("mig-3g",)),
              claim("mig-1g", "gpu-1-mig-1g10gb-19-3", ns="gpu-demo", pods=("mig-1g",)),
              claim("mps-slot", "gpu-6-slot-0", ns="gpu-demo", pods=("mps-slot",)),
              claim("memory-share", "gpu-7-shared", ns="gpu-demo", pods=("memory-share",), memory="10Gi")]
    printed = render(fleet_status(published("node-a", doc), claims, [], DRIVER)).splitlines()
    shown = [line for line in block if line.strip() != "..."]
    rest = iter(printed)
    missing = [line for line in shown if not any(line == p for p in rest)]    # in order, lines left out allowed
    assert len(shown) > 20 and missing == []


@pytest.mark.parametrize("argv, message, code", [
    (["status", "node-a,spec.driver=other.example.com"], "NODE 'node-a,spec.driver=other.example.com': not a Kubernetes name", 2),
    (["status", "--driver-name", "Bad_Driver"], "--driver-name 'Bad_Driver': not a Kubernetes name", 2),
    (["status", "--kubeconfig", "/nonexistent/kubeconfig"], "--kubeconfig /nonexistent/kubeconfig: no such file", 5),
])
def test_bad_input_is_one_line_and_its_exit_status(argv: list[str], message: str, code: int,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """2: bad arguments; 5: no usable kubeconfig (cli.failures)."""
    from cli.main import main

    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.startswith("gpu-dra status: ") and message in err and err.count("\n") == 1
