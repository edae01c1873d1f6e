"""``gpu-dra advise`` put together: the usage (Prometheus over a window, or one scrape of a plugin), the
workloads behind it and what the cluster offers, read from the API server; the advice for each group; and the
objects to apply for those advised a different device."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dra.model.catalog import model_for_product_name
from kube.client import KubeApi
from ops.advise.advice import RESIZE, Advice, RanOn, Settings, advise, gpu_sharers, ran_on
from ops.advise.groups import group_series
from ops.advise.history import Window
from ops.advise.offers import read_offers
from ops.advise.owners import PodFacts
from ops.advise.reads import Owners, consumed, get
from ops.advise.templates import Emitted, emit
from ops.advise.usage import JOINED, Gap, SeriesUsage


@dataclass(frozen=True)
class Source:
    """Where the usage came from: ``kind`` "prometheus" (``where``: its URL) or "snapshot" (the plugin scraped)."""

    kind: str
    where: str
    window: Window


@dataclass
class Report:
    source: str                  # "prometheus" | "snapshot"
    where: str
    end: float
    window: float                # seconds (0 for a snapshot)
    advices: list[Advice]
    gaps: list[Gap] = field(default_factory=list)


def build(kube: KubeApi, slices: Sequence[Mapping[str, Any]], source: Source, settings: Settings,
          driver: str) -> Report:
    """The advice for every group of the source's series, against what ``slices`` (the driver's) offer."""
    window = source.window
    offers, published = read_offers(slices, driver)
    owners = Owners(kube)
    pods: dict[tuple[str, str], PodFacts] = {}
    for s in window.series:
        if (s.namespace, s.pod) not in pods:
            pods[(s.namespace, s.pod)] = owners.pod(s.namespace, s.pod)
    sharers = gpu_sharers(window.series)
    advices = []
    for group in group_series(window.series, pods, window.oom):
        model = model_for_product_name(group.model)
        top = max(group.series, key=lambda s: s.memory_peak)
        claimed = {}
        if _consumes(top):
            claimed = consumed(get(kube, "ResourceClaim", top.namespace, top.claim), top.device)
        ran: RanOn = ran_on(top, model, published.get((top.node, top.device)), claimed)
        own = {(s.namespace, s.pod) for s in group.series}
        others = sorted({p for s in group.series for p in sharers.get((s.node, s.gpu_uuid), set())} - own)
        unattributed = max((window.unattributed.get(s.gpu_uuid, 0.0) for s in group.series), default=0.0)
        advices.append(advise(group, ran, model, offers.get(group.model), settings,
                              shared_with=[f"{ns}/{pod}" for ns, pod in others], unattributed=unattributed))
    return Report(source.kind, source.where, window.end, window.seconds, advices, window.gaps)


def _consumes(s: SeriesUsage) -> bool:
    """A device whose claims consume part of it (a memory share, the slots device of the capacity layout), of one
    claim the plugin told apart from others."""
    return s.device.endswith(("-shared", "-slots")) and JOINED not in s.claim + s.device


def emit_all(kube: KubeApi, advices: Sequence[Advice], driver: str) -> list[Emitted]:
    """Per workload and template (or claim), the object asking for the advised devices."""
    by_source: dict[tuple[str, str, str, str, str], list[Advice]] = defaultdict(list)
    for a in advices:
        if a.verdict == RESIZE and a.recommendation is not None:
            w, src = a.group.workload, a.group.source
            by_source[(w.namespace, w.kind, w.name, src.kind if src else "", src.name if src else "")].append(a)
    out = []
    for (namespace, _, _, kind, name), group in sorted(by_source.items()):
        existing = get(kube, kind, namespace, name) if kind else None
        out.append(emit(group[0].group.workload, group[0].group.source, existing, group, driver))
    return out
