"""What every benchmark shares: figures, targets, the target check, timing and memory helpers, the table.

A benchmark returns ``Figure``s. A figure's ``key`` (``<benchmark>.<what>``) names its target in
``bench/targets.yaml``; a figure without a target is informational. The check turns each figure into a
``Verdict`` whose ``ratio`` is the share of the budget used, so ``<= 1.0`` always passes:

* ``max`` targets (times, memory, writes): ratio = measured / limit;
* ``min`` targets (throughput): ratio = limit / measured.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

T = TypeVar("T")
Direction = Literal["max", "min"]
MIB = 1 << 20
TARGETS_FILE = Path(__file__).with_name("targets.yaml")


class TargetsError(ValueError):
    """A targets file that cannot be used; the message names the file, the key and the reason."""


@dataclass(frozen=True)
class Figure:
    """One measured number."""

    key: str            # "<benchmark>.<what>", the key of its target
    label: str          # what was measured, for people
    value: float
    unit: str           # "ms", "MiB", "devices/s", "cycles/s", "writes", "×"
    detail: str = ""    # how it was measured: "median of 9 runs (min 23.1, max 30.2)"
    stat: str = ""      # what kind of number, shown before it: "median", "peak", "worst"

    @property
    def benchmark(self) -> str:
        return self.key.split(".", 1)[0]


@dataclass(frozen=True)
class Target:
    key: str
    direction: Direction
    limit: float
    unit: str
    why: str = ""

    def describe(self) -> str:
        sign = "≤" if self.direction == "max" else "≥"
        return f"{sign} {format_value(self.limit, self.unit)}"


@dataclass(frozen=True)
class Verdict:
    figure: Figure
    target: Target | None
    ratio: float | None     # share of the budget used; None without a target

    @property
    def ok(self) -> bool:
        return self.ratio is None or self.ratio <= 1.0


@dataclass(frozen=True)
class CheckResult:
    verdicts: tuple[Verdict, ...]
    problems: tuple[str, ...]    # targets that no figure answered, unit mismatches

    @property
    def ok(self) -> bool:
        return not self.problems and all(v.ok for v in self.verdicts)

    @property
    def missed(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if not v.ok)


# --------------------------------------------------------------------------------------------------- targets

def parse_targets(data: Any, source: str) -> dict[str, Target]:
    """Targets from parsed YAML: ``{key: {max|min: number, unit: str, why: str}}``."""
    if not isinstance(data, Mapping):
        raise TargetsError(f"{source}: must be a mapping of figure keys to targets")
    out: dict[str, Target] = {}
    for key, spec in data.items():
        where = f"{source}: {key}"
        if not isinstance(key, str) or "." not in key:
            raise TargetsError(f"{where}: key must look like <benchmark>.<figure>")
        if not isinstance(spec, Mapping):
            raise TargetsError(f"{where}: must be a mapping with max or min, and unit")
        unknown = set(spec) - {"max", "min", "unit", "why"}
        if unknown:
            raise TargetsError(f"{where}: unknown field(s) {sorted(unknown)} (allowed: max, min, unit, why)")
        directions = [d for d in ("max", "min") if d in spec]
        if len(directions) != 1:
            raise TargetsError(f"{where}: give exactly one of max or min")
        direction: Direction = directions[0]  # type: ignore[assignment]
        limit = spec[direction]
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit < 0:
            raise TargetsError(f"{where}.{direction}: must be a finite number >= 0, got {limit!r}")
        if direction == "min" and limit == 0:
            raise TargetsError(f"{where}.min: 0 is no target; remove it or give a positive number")
        unit = spec.get("unit")
        if not isinstance(unit, str) or not unit:
            raise TargetsError(f"{where}.unit: must be a non-empty string")
        why = spec.get("why", "")
        if not isinstance(why, str):
            raise TargetsError(f"{where}.why: must be a string")
        out[key] = Target(key=key, direction=direction, limit=float(limit), unit=unit, why=why)
    return out


def load_targets(path: Path | str = TARGETS_FILE) -> dict[str, Target]:
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TargetsError(f"{source}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TargetsError(f"{source}: not valid YAML: {exc}") from None
    return parse_targets(data, source)


def budget_ratio(value: float, target: Target) -> float:
    """Share of the budget used (<= 1 passes)."""
    if target.direction == "max":
        if target.limit == 0:
            return 0.0 if value <= 0 else math.inf
        return value / target.limit
    return math.inf if value <= 0 else target.limit / value


def check(figures: Sequence[Figure], targets: Mapping[str, Target], benchmarks_run: Iterable[str]) -> CheckResult:
    """Judge every figure against its target. A target of a benchmark that ran but produced no such figure
    is a problem (a renamed figure must not silently drop its target)."""
    problems: list[str] = []
    verdicts: list[Verdict] = []
    seen: set[str] = set()
    for f in figures:
        seen.add(f.key)
        target = targets.get(f.key)
        if target is None:
            verdicts.append(Verdict(f, None, None))
            continue
        if target.unit != f.unit:
            problems.append(f"target {f.key}: unit {target.unit!r} but the figure is in {f.unit!r}")
            verdicts.append(Verdict(f, target, None))
            continue
        ratio = math.inf if math.isnan(f.value) else budget_ratio(f.value, target)
        verdicts.append(Verdict(f, target, ratio))
    ran = set(benchmarks_run)
    for key in sorted(targets):
        if key.split(".", 1)[0] in ran and key not in seen:
            problems.append(f"target {key}: its benchmark ran but reported no such figure")
    return CheckResult(tuple(verdicts), tuple(problems))


# --------------------------------------------------------------------------------------------------- measuring

def timed_runs(fn: Callable[[], Any], runs: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of ``runs`` calls after ``warmup`` untimed ones. The garbage collector is run
    before each call so one run does not pay for the previous run's garbage."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(max(1, runs)):
        gc.collect()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float], scale: float = 1000.0, unit: str = "ms") -> str:
    """"median of 9 runs (min 23.1 ms, max 30.2 ms)" for seconds scaled to ``unit``."""
    if len(values) == 1:
        return f"1 run ({_num(values[0] * scale)} {unit})"
    lo, hi = min(values) * scale, max(values) * scale
    return f"median of {len(values)} runs (min {_num(lo)} {unit}, max {_num(hi)} {unit})"


def peak_memory(fn: Callable[[], T]) -> tuple[T, int]:
    """(result, peak bytes allocated by Python while ``fn`` ran), measured with tracemalloc. Objects that
    existed before the call are not counted; what ``fn`` returns and keeps alive is."""
    gc.collect()
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return result, max(0, peak - base)


# --------------------------------------------------------------------------------------------------- output

def _num(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    if x == int(x) and abs(x) < 1e15:
        return f"{int(x):,}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def format_value(value: float, unit: str) -> str:
    if unit == "×":
        return f"{_num(value)}×"
    return f"{_num(value)} {unit}"


def format_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "-"
    if math.isinf(ratio):
        return "∞"
    return f"{ratio:.2f}×"


def render_table(result: CheckResult) -> str:
    """One line per figure: benchmark, what, measured, target, share of budget, verdict."""
    header = ("benchmark", "figure", "measured", "target", "of target", "")
    rows = [header]
    for v in result.verdicts:
        f = v.figure
        verdict = "" if v.target is None else ("ok" if v.ok else "MISSED")
        measured = format_value(f.value, f.unit)
        rows.append((f.benchmark, f.label, f"{f.stat} {measured}" if f.stat else measured,
                     v.target.describe() if v.target else "-", format_ratio(v.ratio), verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for i, r in enumerate(rows):
        cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2]), r[3].ljust(widths[3]),
                 r[4].rjust(widths[4]), r[5]]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths).rstrip())
    return "\n".join(lines)


def render_details(figures: Sequence[Figure]) -> str:
    """How each figure was measured (runs, spread), below the table."""
    return "\n".join(f"  {f.key}: {f.detail}" for f in figures if f.detail)
