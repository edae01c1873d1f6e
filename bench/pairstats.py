"""The pure parts of the side-by-side benchmark (``bench.peer``): ratios of paired rounds with bootstrap confidence
intervals, and the kubelet's DRA histograms read from its ``/metrics`` text.

A round measures ours and the peer's figure back to back, so machine noise hits both alike; the ratio of the
two medians is the figure, and its 95 % interval comes from resampling whole rounds (a paired bootstrap), so the
pairing is kept."""
from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

RESAMPLES = 2000
SEED = 27                # fixed: the same rounds always give the same interval
# The kubelet's per-driver histogram of its gRPC calls to a DRA plugin (pkg/kubelet/metrics, v1.34+), labelled
# driver_name, method_name (the full gRPC method) and grpc_status_code.
KUBELET_GRPC_HISTOGRAM = "dra_grpc_operations_duration_seconds"
# The kubelet's histogram of its whole prepare/unprepare step for a pod (all its claims), labelled operation_name
# (PrepareResources, UnprepareResources) and is_error.
KUBELET_OPERATION_HISTOGRAM = "dra_operations_duration_seconds"

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class MetricsFormatError(ValueError):
    """A line of a Prometheus text exposition that cannot be read; the message quotes it."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is not within 0..1")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class PairedRatio:
    """stat(ours) / stat(peer) over paired rounds, with its bootstrap interval."""

    ours: float             # the statistic of our rounds (e.g. the median)
    peer: float
    ratio: float
    low: float              # 2.5th percentile of the bootstrap ratios
    high: float             # 97.5th percentile
    ours_higher: int        # rounds where our value was above the peer's
    rounds: int

    def describe(self, scale: float = 1000.0, unit: str = "ms") -> str:
        return (f"{_fmt(self.ours * scale)} / {_fmt(self.peer * scale)} {unit}, ratio {self.ratio:.2f} "
                f"[95 % CI {self.low:.2f}, {self.high:.2f}], ours higher in {self.ours_higher} of {self.rounds} rounds")


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def paired_ratio(ours: Sequence[float], peer: Sequence[float], stat: Callable[[Sequence[float]], float] = _median,
                 resamples: int = RESAMPLES, seed: int = SEED) -> PairedRatio:
    """stat(ours) / stat(peer) with a 95 % percentile-bootstrap interval that resamples rounds (pairs).

    Raises ValueError when the rounds are not paired (different counts), there are none, or the peer's
    statistic is not positive (no ratio)."""
    if len(ours) != len(peer):
        raise ValueError(f"paired rounds differ in number: {len(ours)} of ours, {len(peer)} of the peer's")
    if not ours:
        raise ValueError("no rounds to compare")
    p = stat(peer)
    if p <= 0:
        raise ValueError(f"the peer's statistic is {p:g}: no ratio to it")
    o = stat(ours)
    rng = random.Random(seed)
    n = len(ours)
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        sp = stat([peer[i] for i in idx])
        if sp > 0:
            ratios.append(stat([ours[i] for i in idx]) / sp)
    if not ratios:
        raise ValueError("every resample of the peer's rounds had a statistic of 0")
    return PairedRatio(o, p, o / p, percentile(ratios, 0.025), percentile(ratios, 0.975),
                       sum(1 for a, b in zip(ours, peer) if a > b), n)


@dataclass(frozen=True)
class PairedDifference:
    """mean(ours − peer) over paired samples, with its bootstrap interval."""

    difference: float
    low: float
    high: float
    samples: int


def paired_difference(ours: Sequence[float], peer: Sequence[float], resamples: int = RESAMPLES,
                      seed: int = SEED) -> PairedDifference:
    """Mean of ours[i] − peer[i] with a 95 % percentile-bootstrap interval over the pairs."""
    if len(ours) != len(peer):
        raise ValueError(f"paired samples differ in number: {len(ours)} of ours, {len(peer)} of the peer's")
    if not ours:
        raise ValueError("no samples to compare")
    diffs = [a - b for a, b in zip(ours, peer)]
    rng = random.Random(seed)
    n = len(diffs)
    means = [statistics.fmean([diffs[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples)]
    return PairedDifference(statistics.fmean(diffs), percentile(means, 0.025), percentile(means, 0.975), n)


# --------------------------------------------------------------------------------------------------- kubelet metrics

Labels = tuple[tuple[str, str], ...]


def parse_samples(text: str) -> dict[tuple[str, Labels], float]:
    """Samples of a Prometheus text exposition: (name, sorted labels) -> value. Comments and blank lines are
    skipped; a line that is neither raises MetricsFormatError."""
    out: dict[tuple[str, Labels], float] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise MetricsFormatError(f"line {number} is not a metric sample: {line[:120]!r}")
        try:
            value = float(m["value"])
        except ValueError:
            raise MetricsFormatError(f"line {number}: value {m['value']!r} is not a number") from None
        labels = tuple(sorted(_LABEL.findall(m["labels"] or "")))
        out[(m["name"], labels)] = value
    return out


@dataclass(frozen=True)
class HistogramTotals:
    """What a histogram has observed so far: the sum of the observations (seconds) and their count."""

    sum: float = 0.0
    count: float = 0.0

    def __sub__(self, other: "HistogramTotals") -> "HistogramTotals":
        return HistogramTotals(self.sum - other.sum, self.count - other.count)


def histogram_totals(samples: dict[tuple[str, Labels], float], name: str, match: dict[str, str],
                     suffix_match: dict[str, str] | None = None) -> HistogramTotals:
    """Sum and count of histogram ``name`` over every series whose labels equal ``match`` and whose labels end
    with ``suffix_match`` (e.g. the gRPC method's last part). The sum's exact delta between two reads over one
    call is that call's duration, finer than any bucket."""
    total_sum = total_count = 0.0
    for (metric, labels), value in samples.items():
        if metric not in (f"{name}_sum", f"{name}_count"):
            continue
        d = dict(labels)
        if any(d.get(k) != v for k, v in match.items()):
            continue
        if suffix_match and any(not d.get(k, "").endswith(v) for k, v in suffix_match.items()):
            continue
        if metric.endswith("_sum"):
            total_sum += value
        else:
            total_count += value
    return HistogramTotals(total_sum, total_count)


def grpc_call_totals(samples: dict[tuple[str, Labels], float], driver: str, method: str) -> HistogramTotals:
    """The kubelet's gRPC histogram for ``driver``'s ``method`` (NodePrepareResources, NodeUnprepareResources),
    every status code together."""
    return histogram_totals(samples, KUBELET_GRPC_HISTOGRAM, {"driver_name": driver}, {"method_name": f"/{method}"})


def operation_totals(samples: dict[tuple[str, Labels], float], operation: str) -> HistogramTotals:
    """The kubelet's histogram of its whole ``operation`` (PrepareResources, UnprepareResources) step, errors
    included."""
    return histogram_totals(samples, KUBELET_OPERATION_HISTOGRAM, {"operation_name": operation})
