"""What each per-claim series of the kubelet plugins says over a window: its peak and 95th percentile of GPU memory,
its samples and the time they span, and its SM utilisation; from Prometheus' answers or from one scrape of a
plugin's ``/metrics`` (a snapshot: every figure is the value now, one sample). Pure: no I/O.

The series are the plugin's (``kubeletplugin.claimmetrics``): one per pod and device it holds, labelled with the
pod's namespace, pod and container, the claim, request and device, the physical GPU and its product name.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MEMORY = "gpu_dra_claim_gpu_memory_used_bytes"
SM = "gpu_dra_claim_gpu_sm_utilization_percent"
UNATTRIBUTED = "gpu_dra_gpu_unattributed_processes"
# Always exported by a running plugin (0 without claims): where it has no samples, the plugin was not scraped.
PLUGIN_ALIVE = "gpu_dra_prepared_claims"
# kube-state-metrics' record of a container's last termination, where a cluster runs it.
OOM_KILLED = 'kube_pod_container_status_last_terminated_reason{reason="OOMKilled"}'
# Between the values of a series' label that the plugin could not tell apart (claimmetrics.JOINED).
JOINED = "|"
# Label → field; every other label (the scrape's instance, job, ...) is not part of a series' identity here.
_FIELDS = {"namespace": "namespace", "pod": "pod", "container": "container", "claim": "claim", "request": "request",
           "device": "device", "gpu_uuid": "gpu_uuid", "mig_profile": "mig_profile", "sharing": "sharing",
           "Hostname": "node", "modelName": "model"}


@dataclass(frozen=True)
class SeriesUsage:
    """One pod's use of one device over the window."""

    namespace: str
    pod: str
    container: str
    claim: str
    request: str
    device: str
    gpu_uuid: str
    mig_profile: str
    sharing: str                 # none | time-slicing | mps | share
    node: str
    model: str                   # NVML's product name, e.g. "NVIDIA H100 80GB HBM3"
    memory_peak: float           # bytes
    memory_p95: float
    samples: int
    first: float                 # unix seconds of its first and last sample
    last: float
    sm_peak: float | None = None     # percent of the device NVML measures it on (a MIG device, else the GPU)
    sm_p95: float | None = None

    @property
    def joined_devices(self) -> bool:
        """The plugin could not tell this pod's processes apart between several devices of one GPU."""
        return JOINED in self.device


def _identity(metric: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in metric.items() if k != "__name__"))


def _value(sample: Any) -> float | None:
    try:
        return float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def series_from_vectors(vectors: Mapping[str, list[dict[str, Any]]]) -> list[SeriesUsage]:
    """The series of Prometheus' answers to the window's queries (``history.QUERIES``: one instant vector per
    figure, each element one series), joined on their labels. A series needs its memory figures; its SM figures
    may be missing."""
    figures: dict[tuple[tuple[str, str], ...], dict[str, float]] = {}
    labels: dict[tuple[tuple[str, str], ...], Mapping[str, str]] = {}
    for figure, vector in vectors.items():
        for sample in vector:
            metric = sample.get("metric") or {}
            value = _value(sample)
            if value is None or not isinstance(metric, dict):
                continue
            key = _identity(metric)
            labels.setdefault(key, metric)
            figures.setdefault(key, {})[figure] = value
    out = []
    for key, got in figures.items():
        if not {"peak", "p95", "samples"} <= set(got) or got["samples"] < 1:
            continue
        # A series too short for the subquery's steps to see has no first and last: a span of 0.
        last = got.get("last", got.get("first", 0.0))
        out.append(SeriesUsage(**_labels(labels[key]), memory_peak=got["peak"], memory_p95=got["p95"],
                               samples=int(got["samples"]), first=got.get("first", last), last=last,
                               sm_peak=got.get("sm_peak"), sm_p95=got.get("sm_p95")))
    return sorted(out, key=lambda s: (s.namespace, s.pod, s.device, s.container))


def _labels(metric: Mapping[str, str]) -> dict[str, str]:
    return {field: str(metric.get(label, "")) for label, field in _FIELDS.items()}


def series_from_exposition(text: str, at: float) -> list[SeriesUsage]:
    """The series of one scrape of a plugin's ``/metrics``: each figure is its value now."""
    from prometheus_client.parser import text_string_to_metric_families

    memory: dict[tuple[tuple[str, str], ...], tuple[Mapping[str, str], float]] = {}
    sm: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == MEMORY:
                memory[_identity(s.labels)] = (s.labels, float(s.value))
            elif s.name == SM:
                sm[_identity(s.labels)] = float(s.value)
    out = [SeriesUsage(**_labels(metric), memory_peak=value, memory_p95=value, samples=1, first=at, last=at,
                       sm_peak=sm.get(key), sm_p95=sm.get(key))
           for key, (metric, value) in memory.items()]
    return sorted(out, key=lambda s: (s.namespace, s.pod, s.device, s.container))


def unattributed_from_exposition(text: str) -> dict[str, float]:
    """GPU UUID → processes on it in no claim's pod, now."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels.get("gpu_uuid", ""): float(s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == UNATTRIBUTED}


def by_label(vector: Iterable[dict[str, Any]], label: str) -> dict[str, float]:
    """One value per value of ``label`` (the largest where several series share one)."""
    out: dict[str, float] = {}
    for sample in vector:
        key, value = str((sample.get("metric") or {}).get(label, "")), _value(sample)
        if value is not None:
            out[key] = max(value, out.get(key, value))
    return out


def oom_killed(vector: Iterable[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(namespace, pod, container) of each container kube-state-metrics saw end OOM-killed."""
    out = set()
    for sample in vector:
        metric, value = sample.get("metric") or {}, _value(sample)
        if value:
            out.add((str(metric.get("namespace", "")), str(metric.get("pod", "")), str(metric.get("container", ""))))
    return out


@dataclass(frozen=True)
class Gap:
    """A stretch of the window without samples of a plugin (``instance``: the scrape target; "" for all)."""

    start: float
    end: float
    instance: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


def gaps(matrix: Iterable[dict[str, Any]], start: float, end: float, step: float, longer_than: float) -> list[Gap]:
    """The stretches longer than ``longer_than`` seconds in which a plugin had no sample, from a range query of
    ``count by (instance) (gpu_dra_prepared_claims)`` over [start, end] at ``step``: inside each instance's
    samples (a plugin that went away for good, or came later, is not a gap), and at the end of the window when no
    instance has any (nothing scraped since). Longest first; none when no plugin's series is there at all."""
    found: list[Gap] = []
    latest = start
    matrix = list(matrix)
    if not matrix:
        return []           # no plugin series scraped at all (a scrape that keeps only some): nothing to tell
    for series in matrix:
        instance = str((series.get("metric") or {}).get("instance", ""))
        times = sorted(float(v[0]) for v in series.get("values") or [] if isinstance(v, list) and v)
        if times:
            latest = max(latest, times[-1])
        for a, b in zip(times, times[1:]):
            if b - a - step > longer_than:
                found.append(Gap(a + step, b, instance))
    if end - latest - step > longer_than:
        found.append(Gap(latest + step if latest > start else start, end, ""))
    return sorted(found, key=lambda g: (-g.seconds, g.start))
