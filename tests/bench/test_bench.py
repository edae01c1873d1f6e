"""The benchmark harness: every benchmark runs with tiny parameters and answers its targets, and the target
check fails figures that miss. No timing is asserted here; the targets themselves live in bench/targets.yaml."""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from bench import BENCHMARKS, ON_REQUEST, REAL_NODE, load
from bench.__main__ import main
from bench.core import Figure, Target, TargetsError, budget_ratio, check, load_targets, parse_targets, render_table
from bench.memapi import InMemorySliceApi
from bench.params import TINY
from bench.prepare import MIG_CHANGING_CALLS, SlowMigNvml
from kube.client import SLICES, ApiError

# Figures that count things rather than time them: their targets must hold on any machine.
COUNT_UNITS = {"writes", "problems", "creates"}


# --------------------------------------------------------------------------------------------------- smoke runs

@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.e2e) if n in REAL_NODE else n
                                  for n in BENCHMARKS])
def test_each_benchmark_runs_tiny_and_answers_its_targets(name: str) -> None:
    module = load(name)
    assert module.NAME == name and module.DESCRIPTION
    figures = module.run(TINY)
    assert figures
    for f in figures:
        assert f.benchmark == name, f.key
        assert math.isfinite(f.value) and f.value >= 0, f
        assert f.label and f.unit
    result = check(figures, load_targets(), [name])
    assert result.problems == ()   # every target of this benchmark got a figure, in the target's unit
    judged = [v for v in result.verdicts if v.target is not None]
    assert judged, f"no target judges any figure of {name}"
    for v in judged:
        if v.figure.unit in COUNT_UNITS:
            assert v.ok, f"{v.figure.key} = {v.figure.value}, target {v.target.describe()}"


def test_shipped_targets_belong_to_known_benchmarks() -> None:
    targets = load_targets()
    assert targets
    assert {key.split(".", 1)[0] for key in targets} <= set(BENCHMARKS) | set(ON_REQUEST)


# --------------------------------------------------------------------------------------------------- the check

def fig(key: str, value: float, unit: str = "ms") -> Figure:
    return Figure(key, key, value, unit)


def test_figure_over_a_max_target_misses() -> None:
    targets = {"x.t": Target("x.t", "max", 100, "ms")}
    result = check([fig("x.t", 150)], targets, ["x"])
    [v] = result.verdicts
    assert not v.ok and v.ratio == pytest.approx(1.5)
    assert not result.ok and result.missed == (v,)
    assert "MISSED" in render_table(result)


def test_figure_at_or_under_a_max_target_passes() -> None:
    targets = {"x.t": Target("x.t", "max", 100, "ms")}
    assert check([fig("x.t", 100)], targets, ["x"]).ok
    result = check([fig("x.t", 41)], targets, ["x"])
    assert result.ok and result.verdicts[0].ratio == pytest.approx(0.41)
    assert "0.41×" in render_table(result)


def test_throughput_under_a_min_target_misses() -> None:
    targets = {"x.rate": Target("x.rate", "min", 1000, "devices/s")}
    low = check([fig("x.rate", 500, "devices/s")], targets, ["x"])
    assert not low.ok and low.verdicts[0].ratio == pytest.approx(2.0)
    high = check([fig("x.rate", 4000, "devices/s")], targets, ["x"])
    assert high.ok and high.verdicts[0].ratio == pytest.approx(0.25)
    assert not check([fig("x.rate", 0, "devices/s")], targets, ["x"]).ok


def test_zero_budget_allows_only_zero() -> None:
    target = Target("x.writes", "max", 0, "writes")
    assert budget_ratio(0, target) == 0
    assert math.isinf(budget_ratio(1, target))
    assert not check([fig("x.writes", 1, "writes")], {"x.writes": target}, ["x"]).ok


def test_not_a_number_misses() -> None:
    targets = {"x.t": Target("x.t", "max", 100, "ms")}
    assert not check([fig("x.t", float("nan"))], targets, ["x"]).ok


def test_unit_mismatch_and_unanswered_targets_are_problems() -> None:
    targets = {"x.t": Target("x.t", "max", 100, "ms"), "x.gone": Target("x.gone", "max", 1, "ms"),
               "y.t": Target("y.t", "max", 1, "ms")}
    result = check([fig("x.t", 1, "s")], targets, ["x"])
    assert not result.ok
    assert any("x.t" in p and "unit" in p for p in result.problems)
    assert any("x.gone" in p for p in result.problems)
    assert not any("y.t" in p for p in result.problems)   # benchmark y did not run


def test_figures_without_target_are_informational() -> None:
    result = check([fig("x.info", 1e9)], {}, ["x"])
    assert result.ok and result.verdicts[0].ratio is None


@pytest.mark.parametrize("data, message", [
    ({"x.t": {"max": 1, "min": 2, "unit": "ms"}}, "exactly one of max or min"),
    ({"x.t": {"unit": "ms"}}, "exactly one of max or min"),
    ({"x.t": {"max": -1, "unit": "ms"}}, "x.t.max: must be a finite number >= 0"),
    ({"x.t": {"max": "fast", "unit": "ms"}}, "x.t.max: must be a finite number"),
    ({"x.t": {"min": 0, "unit": "ms"}}, "x.t.min: 0 is no target"),
    ({"x.t": {"max": 1}}, "x.t.unit: must be a non-empty string"),
    ({"x.t": {"max": 1, "unit": "ms", "limit": 3}}, "unknown field(s) ['limit']"),
    ({"nodot": {"max": 1, "unit": "ms"}}, "key must look like <benchmark>.<figure>"),
    (["x.t"], "must be a mapping"),
])
def test_bad_targets_name_file_key_and_reason(data: object, message: str) -> None:
    with pytest.raises(TargetsError) as err:
        parse_targets(data, "my-targets.yaml")
    assert "my-targets.yaml" in str(err.value) and message in str(err.value)


# --------------------------------------------------------------------------------------------------- the CLI

def test_cli_exits_non_zero_when_a_target_is_missed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    impossible = tmp_path / "targets.yaml"
    impossible.write_text("mig.cycles_per_s: {min: 1000000000000000, unit: cycles/s}\n")
    assert main(["--quick", "--only", "mig", "--targets", str(impossible)]) == 1
    out = capsys.readouterr().out
    assert "MISSED" in out and "mig.cycles_per_s" in out


def test_cli_passes_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    targets = tmp_path / "targets.yaml"
    targets.write_text("mig.overlaps_accepted: {max: 0, unit: creates}\n")
    report = tmp_path / "figures.json"
    assert main(["--quick", "--only", "mig", "--targets", str(targets), "--json", str(report)]) == 0
    assert "all 1 targets met" in capsys.readouterr().out
    assert '"mig.cycles_per_s"' in report.read_text()


def test_cli_rejects_unknown_benchmarks_and_bad_target_files(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown benchmark"):
        main(["--only", "nope"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("x.t: {max: 1}\n")
    assert main(["--only", "mig", "--targets", str(bad)]) == 2


# --------------------------------------------------------------------------------------------------- helpers

def test_in_memory_api_keeps_optimistic_concurrency() -> None:
    api = InMemorySliceApi(["node-a"])
    obj = {"metadata": {"name": "s1"}, "spec": {"driver": "d.example.com", "nodeName": "node-a",
                                                 "pool": {"name": "node-a", "generation": 1}}}
    stored = api.create(SLICES, obj)
    with pytest.raises(ApiError) as exists:
        api.create(SLICES, obj)
    assert exists.value.conflict
    listed = api.list(SLICES, "spec.driver=d.example.com,spec.pool.name=node-a")["items"]
    assert [o["metadata"]["name"] for o in listed] == ["s1"]
    assert api.list(SLICES, "spec.driver=other.example.com")["items"] == []
    stale = {**stored, "metadata": {**stored["metadata"], "resourceVersion": "0"}}
    with pytest.raises(ApiError) as conflict:
        api.replace(SLICES, stale)
    assert conflict.value.conflict
    updated = api.replace(SLICES, stored)
    assert updated["metadata"]["uid"] == stored["metadata"]["uid"]
    with pytest.raises(ApiError) as precondition:
        api.delete(SLICES, "s1", uid="someone-else")
    assert precondition.value.conflict
    api.delete(SLICES, "s1", uid=stored["metadata"]["uid"])
    with pytest.raises(ApiError) as gone:
        api.delete(SLICES, "s1")
    assert gone.value.not_found
    assert dict(api.writes) == {"create": 1, "update": 1, "delete": 1}
    assert api.get("/api/v1/nodes/node-a")["metadata"]["name"] == "node-a"
    with pytest.raises(ApiError):
        api.get("/api/v1/nodes/node-b")


def test_slow_nvml_delays_only_mig_changing_calls() -> None:
    calls: list[str] = []

    class Recorder:
        def __getattr__(self, name: str):
            return lambda *a: calls.append(name) or name

    slow = SlowMigNvml(Recorder(), latency_s=0.02)
    start = time.perf_counter()
    assert slow.nvmlDeviceGetCount() == "nvmlDeviceGetCount"
    assert slow.slow_calls == 0
    assert "nvmlGpuInstanceDestroy" in MIG_CHANGING_CALLS
    assert slow.nvmlGpuInstanceDestroy("gi") == "nvmlGpuInstanceDestroy"
    assert slow.slow_calls == 1 and calls == ["nvmlDeviceGetCount", "nvmlGpuInstanceDestroy"]
    assert time.perf_counter() - start >= 0.02
