"""The scheduler benchmark's pure parts: percentiles, the claim mix, the shape table, metrics parsing, the figures
and ratios its targets judge, and the slices of NVIDIA's device model it publishes beside ours. The benchmark
itself runs in test_bench.py's smoke run."""
from __future__ import annotations

import pytest

from bench import nvidia
from bench.__main__ import main
from bench.core import check, load_targets
from bench.scheduler import (
    BASELINE,
    NVIDIA,
    SHAPES,
    TEMPLATES,
    Shape,
    ShapeRun,
    assign_templates,
    check_shapes,
    figures_of,
    metric_sums,
    metric_values,
    percentile,
    select_shapes,
    unjudged,
)
from dra.model.policy import parse_node_policy
from dra.model.slices import ApiFeatures, plan_pool, validate_pool
from dra.node.inventory import discover_once
from dra.sim.fleet import nvml_for_node, parse_fleet


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]   # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 100.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0     # order of the input does not matter
    assert percentile([7.0], 99) == 7.0


def test_percentile_refuses_no_values_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="101"):
        percentile([1.0], 101)


def test_templates_follow_the_mix_in_every_batch() -> None:
    mix = SHAPES["rich"].mix
    out = assign_templates(mix, 1000)
    assert len(out) == 1000
    for start in range(0, 1000, 100):
        batch = out[start:start + 100]
        assert {t: batch.count(t) for t in mix} == {"gpu": 40, "mig-1g10gb": 40, "mps-slot": 20}
    assert out[:5].count("mps-slot") == 1          # interleaved, not 40 whole GPUs first
    assert assign_templates({"gpu": 1.0}, 3) == ["gpu"] * 3


def test_shape_table_is_consistent() -> None:
    check_shapes(SHAPES)
    assert BASELINE in SHAPES
    for name, shape in SHAPES.items():
        doc = shape.fleet_doc(2)
        assert len(doc["nodes"]) == 2, name
        for node in doc["nodes"]:
            parse_node_policy(node["policy"], f"shape {name}")   # a policy the publisher accepts


def test_a_shape_with_an_unknown_template_or_bad_shares_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown claim template"):
        check_shapes({**SHAPES, "x": Shape({}, {"nope": 1.0}, "x")})
    with pytest.raises(ValueError, match="sum to 1"):
        check_shapes({**SHAPES, "x": Shape({}, {"gpu": 0.5}, "x")})
    with pytest.raises(ValueError, match="baseline"):
        check_shapes({"rich": SHAPES["rich"]})
    with pytest.raises(ValueError, match="one of our shapes"):
        check_shapes({**SHAPES, BASELINE: SHAPES[NVIDIA]})
    assert set(TEMPLATES) >= {t for s in SHAPES.values() for t in s.mix}


def test_a_shape_can_bring_its_own_fleet() -> None:
    shape = Shape({}, {"gpu": 1.0}, "custom", fleet=lambda n: {"nodes": [{"name": f"c-{i}"} for i in range(n)]})
    assert shape.fleet_doc(3) == {"nodes": [{"name": "c-0"}, {"name": "c-1"}, {"name": "c-2"}]}


METRICS = """\
# HELP scheduler_plugin_execution_duration_seconds [ALPHA] Duration for running a plugin at a specific extension point.
scheduler_plugin_execution_duration_seconds_bucket{extension_point="Filter",plugin="DynamicResources",profile="default-scheduler",status="Success",le="1e-05"} 3
scheduler_plugin_execution_duration_seconds_sum{extension_point="Filter",plugin="DynamicResources",profile="default-scheduler",status="Success"} 1.5
scheduler_plugin_execution_duration_seconds_count{extension_point="Filter",plugin="DynamicResources",profile="default-scheduler",status="Success"} 10
scheduler_plugin_execution_duration_seconds_sum{extension_point="Filter",plugin="DynamicResources",profile="default-scheduler",status="Unschedulable"} 0.5
scheduler_plugin_execution_duration_seconds_count{extension_point="Filter",plugin="DynamicResources",profile="default-scheduler",status="Unschedulable"} 5
scheduler_plugin_execution_duration_seconds_sum{extension_point="Filter",plugin="NodeAffinity",profile="default-scheduler",status="Success"} 9
scheduler_plugin_execution_duration_seconds_count{extension_point="Filter",plugin="NodeAffinity",profile="default-scheduler",status="Success"} 9
scheduler_plugin_execution_duration_seconds_sum{extension_point="PreBind",plugin="DynamicResources",profile="default-scheduler",status="Success"} 0.25
scheduler_plugin_execution_duration_seconds_count{extension_point="PreBind",plugin="DynamicResources",profile="default-scheduler",status="Success"} 2
scheduler_plugin_evaluation_total{extension_point="Filter",plugin="DynamicResources",profile="default-scheduler"} 360
scheduler_plugin_evaluation_total{extension_point="Filter",plugin="NodePorts",profile="default-scheduler"} 7
scheduler_plugin_evaluation_total{extension_point="Score",plugin="DynamicResources",profile="a,b"} 4
"""


def test_metric_sums_add_up_series_by_label() -> None:
    assert metric_sums(METRICS, "scheduler_plugin_execution_duration_seconds", "extension_point",
                       {"plugin": "DynamicResources"}) == {"Filter": (2.0, 15.0), "PreBind": (0.25, 2.0)}
    assert metric_sums(METRICS, "scheduler_plugin_execution_duration_seconds", "plugin",
                       {"extension_point": "Filter"}) == {"DynamicResources": (2.0, 15.0), "NodeAffinity": (9.0, 9.0)}
    assert metric_sums(METRICS, "no_such_metric", "plugin") == {}


def test_metric_values_read_counters_with_commas_in_quoted_labels() -> None:
    assert metric_values(METRICS, "scheduler_plugin_evaluation_total", "extension_point",
                         {"plugin": "DynamicResources"}) == {"Filter": 360.0, "Score": 4.0}
    assert metric_values(METRICS, "scheduler_plugin_evaluation_total", "profile",
                         {"extension_point": "Score"}) == {"a,b": 4.0}


def shape_run(shape: str, pods: int, span_s: float, cpu_s: float, rss_gib: float, publish_s: float) -> ShapeRun:
    return ShapeRun(shape=shape, nodes=200, devices=1600, slices=200, publish_s=publish_s, settle_s=1.0, pods=pods,
                    span_s=span_s, latencies_s=[float(i) for i in range(1, pods + 1)], sched_cpu_s=cpu_s,
                    sched_rss=rss_gib * (1 << 30), apiserver_rss=0.5 * (1 << 30), etcd_rss=0.1 * (1 << 30))


def test_ratios_to_the_baseline_are_what_the_targets_judge() -> None:
    runs = {"whole": shape_run("whole", 100, 2.0, 1.0, 0.2, 10.0),
            "rich": shape_run("rich", 100, 8.0, 5.0, 1.0, 20.0),
            "used": shape_run("used", 100, 4.0, 2.5, 0.5, 12.0),
            "capacity": shape_run("capacity", 100, 3.0, 2.0, 0.4, 11.0),
            "capacity-mig": shape_run("capacity-mig", 100, 2.5, 1.5, 0.3, 10.5),
            "dynmig": shape_run("dynmig", 100, 5.0, 4.0, 0.8, 15.0),
            NVIDIA: shape_run(NVIDIA, 100, 4.0, 5.0, 1.0, 12.0)}
    figures = {f.key: f for f in figures_of(runs)}
    assert figures["scheduler.used.cpu_ratio"].value == pytest.approx(2.5)         # 25 vs 10 ms per pod
    assert figures["scheduler.capacity.cpu_ratio"].value == pytest.approx(2.0)     # 20 vs 10 ms per pod
    assert figures["scheduler.capacity-mig.cpu_ratio"].value == pytest.approx(1.5)  # 15 vs 10 ms per pod
    assert figures["scheduler.whole.bound_per_s"].value == pytest.approx(50.0)
    assert figures["scheduler.rich.bound_ratio"].value == pytest.approx(0.25)      # 12.5 vs 50 pods/s
    assert figures["scheduler.rich.cpu_ratio"].value == pytest.approx(5.0)         # 50 vs 10 ms per pod
    assert figures["scheduler.rich.cpu_ms_per_pod"].value == pytest.approx(50.0)
    assert figures["scheduler.rich.publish_ratio"].value == pytest.approx(2.0)
    assert figures["scheduler.rich.scheduler_rss_gib"].value == pytest.approx(1.0)
    assert figures["scheduler.rich.scheduled_p50_s"].value == pytest.approx(50.5)
    assert not any(k.startswith("scheduler.whole.") and k.endswith("_ratio") for k in figures)
    # ours against NVIDIA's: bound/s ours over theirs, CPU and RSS ours over theirs
    assert figures["scheduler.dynmig.nvidia_bound_ratio"].value == pytest.approx(0.8)    # 20 vs 25 pods/s
    assert figures["scheduler.dynmig.nvidia_cpu_ratio"].value == pytest.approx(0.8)      # 40 vs 50 ms per pod
    assert figures["scheduler.dynmig.nvidia_rss_ratio"].value == pytest.approx(0.8)
    assert figures["scheduler.capacity-mig.nvidia_cpu_ratio"].value == pytest.approx(0.3)
    assert not any(k.startswith(f"scheduler.{NVIDIA}.nvidia_") for k in figures)      # not against itself
    assert figures[f"scheduler.{NVIDIA}.cpu_ratio"].value == pytest.approx(5.0)         # its ratios to whole: shown
    assert "POSTed" in figures[f"scheduler.{NVIDIA}.publish_s"].label

    result = check(list(figures.values()), load_targets(), ["scheduler"])
    assert result.problems == ()
    verdicts = {v.figure.key: v for v in result.verdicts if v.target is not None}
    assert not verdicts["scheduler.rich.bound_ratio"].ok          # 0.25× < 0.5×
    assert not verdicts["scheduler.rich.cpu_ratio"].ok            # 5× > 3×
    assert verdicts["scheduler.rich.publish_ratio"].ok            # 2× ≤ 3×
    assert verdicts["scheduler.rich.scheduler_rss_gib"].ok        # 1.0 ≤ 1.5 GiB
    assert not verdicts["scheduler.dynmig.nvidia_bound_ratio"].ok  # 0.8× < 1.0×
    assert verdicts["scheduler.dynmig.nvidia_cpu_ratio"].ok       # 0.8× ≤ 1.0×
    assert not any(k.startswith(f"scheduler.{NVIDIA}.") for k in verdicts)   # NVIDIA's model is not ours to judge

    # Without NVIDIA's shape in the run there is nothing to compare with.
    alone = {f.key for f in figures_of({k: v for k, v in runs.items() if k != NVIDIA})}
    assert not any(".nvidia_" in k for k in alone)


def test_every_shape_but_the_baseline_has_its_ratio_targets() -> None:
    targets = load_targets()
    for name, shape in SHAPES.items():
        if name == BASELINE or shape.peer:
            continue
        for what in ("bound_ratio", "cpu_ratio", "publish_ratio", "scheduler_rss_gib", "apiserver_rss_gib"):
            assert f"scheduler.{name}.{what}" in targets, (name, what)
    assert not any(k.startswith(f"scheduler.{NVIDIA}.") for k in targets)
    assert targets["scheduler.dynmig.nvidia_bound_ratio"].limit == 1.0
    assert targets["scheduler.dynmig.nvidia_bound_ratio"].direction == "min"
    assert targets["scheduler.dynmig.nvidia_cpu_ratio"].limit == 1.0
    assert targets["scheduler.dynmig.nvidia_cpu_ratio"].direction == "max"


def test_a_run_of_some_shapes_leaves_the_others_targets_unjudged() -> None:
    targets = load_targets()
    assert list(select_shapes(SHAPES, ["dynmig", NVIDIA])) == [BASELINE, "dynmig", NVIDIA]   # table order
    assert select_shapes(SHAPES, None) == SHAPES
    with pytest.raises(ValueError, match="unknown scheduler shape"):
        select_shapes(SHAPES, ["nope"])
    assert unjudged(targets, None) == set()
    skipped = unjudged(targets, ["dynmig", NVIDIA])
    assert "scheduler.rich.cpu_ratio" in skipped and "scheduler.capacity-mig.bound_ratio" in skipped
    assert not any(k.startswith("scheduler.dynmig.") for k in skipped)
    assert not any(not k.startswith("scheduler.") for k in skipped)
    # without NVIDIA's shape, the comparisons with it cannot be answered
    assert {"scheduler.dynmig.nvidia_bound_ratio", "scheduler.dynmig.nvidia_cpu_ratio"} <= unjudged(targets, ["dynmig"])
    assert "scheduler.dynmig.cpu_ratio" not in unjudged(targets, ["dynmig"])


def test_cli_refuses_an_unknown_shape_before_running(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--only", "scheduler", "--sched-shapes", "dynmig,nope"]) == 2
    assert "unknown scheduler shape(s) ['nope']" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------- NVIDIA's model

def nvidia_pool(nodes: int = 1) -> list[tuple[str, list[dict]]]:
    return list(nvidia.fleet_slice_specs(SHAPES[NVIDIA].fleet_doc(nodes)))


def test_nvidia_shape_publishes_a_valid_pool_within_the_api_limits() -> None:
    (node, specs), = nvidia_pool()
    assert validate_pool(specs) == []
    # counters-only slice first, then one devices-only slice per GPU
    assert [("sharedCounters" in s, len(s.get("devices") or s["sharedCounters"])) for s in specs] == \
        [(True, 8)] + [(False, 26)] * 8
    assert all(s["driver"] == "gpu.nvidia.com" and s["nodeName"] == node and s["pool"]["name"] == node
               and s["pool"]["resourceSliceCount"] == 9 for s in specs)
    sets = specs[0]["sharedCounters"]
    assert [cs["name"] for cs in sets] == [f"gpu-{i}-counter-set" for i in range(8)]
    assert set(sets[0]["counters"]) == {"memory", "multiprocessors", "copy-engines", "decoders", "encoders",
                                        "jpeg-engines", "ofa-engines", *(f"memory-slice-{i}" for i in range(8))}
    assert sets[0]["counters"]["memory"] == {"value": "81152Mi"}     # the largest profile's memory (7g.80gb)


def test_nvidia_devices_carry_its_names_attributes_capacities_and_counters() -> None:
    (_, specs), = nvidia_pool()
    devices = specs[1]["devices"]
    names = [d["name"] for d in devices]
    assert names == sorted(names) and names[0] == "gpu-0"
    assert "gpu-0-mig-1g10gb-19-6" in names and "gpu-0-mig-1g10gb-me-20-0" in names
    assert "gpu-0-mig-3g40gb-9-4" in names and "gpu-0-mig-7g80gb-0-0" in names
    by_name = {d["name"]: d for d in devices}
    whole, mig = by_name["gpu-0"], by_name["gpu-0-mig-3g40gb-9-4"]
    parent = ["productName", "brand", "architecture", "cudaComputeCapability", "driverVersion", "cudaDriverVersion",
              "resource.kubernetes.io/pciBusID", "resource.kubernetes.io/pcieRoot", "resource.kubernetes.io/numaNode"]
    assert set(whole["attributes"]) == {"type", "uuid", *parent}
    assert set(mig["attributes"]) == {"type", "parentUUID", "profile", *parent}          # no uuid until prepared
    assert mig["attributes"]["parentUUID"] == whole["attributes"]["uuid"]
    assert mig["attributes"]["profile"] == {"string": "3g.40gb"}
    assert whole["attributes"]["driverVersion"] == {"version": "580.95.5"}
    caps = {"memory", "multiprocessors", "copyEngines", "decoders", "encoders", "jpegEngines", "ofaEngines"}
    assert set(whole["capacity"]) == set(mig["capacity"]) == caps
    assert mig["capacity"]["memory"] == {"value": "40448Mi"} and mig["capacity"]["multiprocessors"] == {"value": "60"}
    (w,), (m,) = whole["consumesCounters"], mig["consumesCounters"]
    assert w["counterSet"] == m["counterSet"] == "gpu-0-counter-set"
    assert w["counters"] == specs[0]["sharedCounters"][0]["counters"]                   # the whole GPU takes all
    assert {k for k in m["counters"] if k.startswith("memory-slice-")} == {f"memory-slice-{i}" for i in range(4, 8)}
    assert m["counters"]["multiprocessors"] == {"value": "60"}


def test_nvidia_and_our_dynmig_shape_offer_the_same_devices_of_the_same_gpus() -> None:
    doc = SHAPES["dynmig"].fleet_doc(1)
    node = parse_fleet(doc).nodes[0]
    ours = plan_pool(discover_once(nvml_for_node(node)), parse_node_policy(node.policy, "dynmig"), "gpu.dra-driver.io",
                     node.name, ApiFeatures.all()).slices
    (_, theirs), = nvidia.fleet_slice_specs(doc)

    def offered(specs: list[dict]) -> set[tuple[str, str, str]]:
        """(parent GPU UUID, type, device name) of every device."""
        out = set()
        for s in specs:
            for d in s.get("devices") or []:
                a = d["attributes"]
                gpu = (a.get("uuid") if a["type"]["string"] == "gpu" else a["parentUUID"])["string"]
                out.add((gpu, a["type"]["string"], d["name"]))
        return out

    assert len(offered(ours)) == len(offered(theirs)) == 208
    # the same GPUs, and per GPU the whole GPU and the same 25 placements (names differ in the +me slug only)
    assert {(g, t) for g, t, _ in offered(ours)} == {(g, t) for g, t, _ in offered(theirs)}
    placements = {(g, n.replace("1g10gbme", "1g10gb-me")) for g, t, n in offered(ours) if t == "mig"}
    assert placements == {(g, n) for g, t, n in offered(theirs) if t == "mig"}


def test_nvidia_slices_are_named_and_owned_per_node() -> None:
    (node, specs), = nvidia_pool()
    objs = nvidia.slice_objects(node, specs, "uid-1")
    assert [o["metadata"]["name"] for o in objs] == [f"{node}-gpu.nvidia.com-{i:04d}" for i in range(9)]
    assert objs[0]["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": node, "uid": "uid-1", "controller": True}]
    two = nvidia_pool(2)
    assert two[0][1][1]["devices"][0]["attributes"]["uuid"] != two[1][1][1]["devices"][0]["attributes"]["uuid"]


def test_nvidia_names_and_classes() -> None:
    assert nvidia.profile_slug("1g.10gb") == "1g10gb" and nvidia.profile_slug("1g.10gb+me") == "1g10gb-me"
    assert nvidia.dns_name("copyEngines") == "copy-engines" and nvidia.dns_name("memory") == "memory"
    classes = {c["metadata"]["name"]: c["spec"] for c in nvidia.device_classes()}
    assert classes["gpu.nvidia.com"]["extendedResourceName"] == "nvidia.com/gpu"
    assert classes["mig.nvidia.com"]["selectors"][0]["cel"]["expression"] == \
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"
    assert "extendedResourceName" not in classes["mig.nvidia.com"]
