"""The series grouped as the advice is given: per workload (its top owner, or the bare pod), per claim template
(or claim) and request, per GPU model. Pure."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ops.advise.advice import Group
from ops.advise.owners import PodFacts, claim_source
from ops.advise.usage import SeriesUsage


def request_of(s: SeriesUsage) -> str:
    """The claim request a series is for: a firstAvailable sub-request ("gpu/h100") counts for its request."""
    return ",".join(sorted({r.split("/")[0] for r in s.request.split(",")}))


def group_series(series: Iterable[SeriesUsage], pods: Mapping[tuple[str, str], PodFacts],
                 oom: Iterable[tuple[str, str, str]] = ()) -> list[Group]:
    """One Group per (workload, template or claim, request, GPU model); ``oom``: (namespace, pod, container)
    OOM-killed in the window, besides what the pods' own statuses say."""
    killed = set(oom)
    groups: dict[tuple[Any, ...], Group] = {}
    for s in series:
        facts = pods[(s.namespace, s.pod)]
        source = claim_source(s.claim, s.pod, facts.pod_spec or facts.workload.pod_spec, facts.claim_statuses)
        w = facts.workload
        key = (w.namespace, w.kind, w.name, source.kind if source else "", source.name if source else s.claim,
               request_of(s), s.model)
        group = groups.get(key)
        if group is None:
            group = groups[key] = Group(w, source, request_of(s), s.model)
        group.series.append(s)
        for container in facts.oom:
            if f"{s.pod}/{container}" not in group.oom:
                group.oom.append(f"{s.pod}/{container}")
        for namespace, pod, container in killed:
            if (namespace, pod) == (s.namespace, s.pod) and f"{pod}/{container}" not in group.oom:
                group.oom.append(f"{pod}/{container}")
    return sorted(groups.values(), key=lambda g: (g.workload.namespace, g.workload.ref,
                                                  g.source.name if g.source else "", g.request, g.model))
