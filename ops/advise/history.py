"""What Prometheus holds of the plugins' per-claim series over a window: one instant query per figure at the
window's end, each over the whole window (``max_over_time``, ``quantile_over_time``, ``count_over_time``, the
first and last sample's time), so the server does the work and the answer is one number per series, not its
samples; and one range query that finds the stretches in which a plugin was not scraped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ops.advise.prometheus import PrometheusApi, PrometheusError
from ops.advise.usage import (
    MEMORY,
    OOM_KILLED,
    PLUGIN_ALIVE,
    SM,
    UNATTRIBUTED,
    Gap,
    SeriesUsage,
    by_label,
    gaps,
    oom_killed,
    series_from_vectors,
)

# A range query answers at most 11,000 points a series; the gap search asks for fewer.
MAX_POINTS = 10_000


@dataclass(frozen=True)
class Window:
    """The figures of every series over [end - seconds, end]."""

    end: float
    seconds: float
    series: list[SeriesUsage]
    unattributed: dict[str, float] = field(default_factory=dict)   # GPU UUID → most processes in no claim's pod
    oom: set[tuple[str, str, str]] = field(default_factory=set)    # (namespace, pod, container) OOM-killed
    gaps: list[Gap] = field(default_factory=list)


_DURATION = re.compile(r"^(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_duration(text: str, flag: str) -> float:
    """A Prometheus duration ("7d", "1h30m", "90s", "2w") in seconds; ValueError naming ``flag``."""
    m = _DURATION.fullmatch(text.strip())
    if not m or not any(m.groups()):
        raise ValueError(f"{flag} {text!r}: a duration like 30m, 12h, 7d or 1h30m")
    weeks, days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    total = (((weeks * 7 + days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise ValueError(f"{flag} {text!r}: must be longer than 0s")
    return float(total)


def duration(seconds: float) -> str:
    """A PromQL duration: whole seconds."""
    return f"{max(1, int(seconds))}s"


def queries(seconds: float, selector: str) -> dict[str, str]:
    """The figure → its PromQL, over a window of ``seconds``."""
    w = duration(seconds)
    # The first and last sample's time, as a subquery's steps see them: fine enough for --min-span, and at most the
    # 5 minutes a step looks back, so that no sample falls between two steps.
    step = duration(min(300.0, max(1.0, seconds / 1000)))
    memory, sm = f"{MEMORY}{selector}", f"{SM}{selector}"
    return {
        "peak": f"max_over_time({memory}[{w}])",
        "p95": f"quantile_over_time(0.95, {memory}[{w}])",
        "samples": f"count_over_time({memory}[{w}])",
        "first": f"min_over_time(timestamp({memory})[{w}:{step}])",
        "last": f"max_over_time(timestamp({memory})[{w}:{step}])",
        "sm_peak": f"max_over_time({sm}[{w}])",
        "sm_p95": f"quantile_over_time(0.95, {sm}[{w}])",
    }


def selector_of(namespace: str | None) -> str:
    return "" if not namespace else '{namespace="' + namespace.replace("\\", "\\\\").replace('"', '\\"') + '"}'


def read_window(api: PrometheusApi, end: float, seconds: float, *, namespace: str | None = None,
                max_gap: float = 600.0) -> Window:
    """Every per-claim series of the window (of ``namespace`` only, when given). PrometheusError when the server
    cannot answer; an empty ``series`` when it has none."""
    selector = selector_of(namespace)
    vectors = {figure: api.query(expr, end) for figure, expr in queries(seconds, selector).items()}
    series = series_from_vectors(vectors)
    if not series:
        return Window(end, seconds, [])
    w = duration(seconds)
    unattributed = by_label(api.query(f"max_over_time({UNATTRIBUTED}[{w}])", end), "gpu_uuid")
    try:
        oom = oom_killed(api.query(f"max_over_time({OOM_KILLED[:-1]}{_inner(selector)}}}[{w}])", end))
    except PrometheusError:
        oom = set()     # no kube-state-metrics naming: the pods' own status still says it (reads)
    step = max(1.0, seconds / MAX_POINTS)
    alive = api.query_range(f"count by (instance) ({PLUGIN_ALIVE})", end - seconds, end, step)
    return Window(end, seconds, series, unattributed, oom, gaps(alive, end - seconds, end, step, max_gap))


def _inner(selector: str) -> str:
    """A selector's matchers to append after others: ',namespace="x"' or ''."""
    return "," + selector[1:-1] if selector else ""
