"""The scheduler benchmark's pure parts: percentiles, the claim mix, the shape table, metrics parsing, and the
figures and ratios its targets judge. The benchmark itself runs in test_bench.py's smoke run."""
from __future__ import annotations

import pytest

from bench.core import check, load_targets
from bench.scheduler import (
    BASELINE,
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
)
from dra.model.policy import parse_node_policy


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
            "capacity-mig": shape_run("capacity-mig", 100, 2.5, 1.5, 0.3, 10.5)}
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

    result = check(list(figures.values()), load_targets(), ["scheduler"])
    assert result.problems == ()
    verdicts = {v.figure.key: v for v in result.verdicts if v.target is not None}
    assert not verdicts["scheduler.rich.bound_ratio"].ok          # 0.25× < 0.5×
    assert not verdicts["scheduler.rich.cpu_ratio"].ok            # 5× > 3×
    assert verdicts["scheduler.rich.publish_ratio"].ok            # 2× ≤ 3×
    assert verdicts["scheduler.rich.scheduler_rss_gib"].ok        # 1.0 ≤ 1.5 GiB


def test_every_shape_but_the_baseline_has_its_ratio_targets() -> None:
    targets = load_targets()
    for name in SHAPES:
        if name == BASELINE:
            continue
        for what in ("bound_ratio", "cpu_ratio", "publish_ratio", "scheduler_rss_gib", "apiserver_rss_gib"):
            assert f"scheduler.{name}.{what}" in targets, (name, what)
