"""From what a workload's claim request used to what it should ask for, or why nothing is said. Pure.

A group is one workload's (Deployment, StatefulSet, Job, CronJob, ... or a bare pod) claim request on one GPU
model: the series of all its pods' devices for that request. Its figures: the peak and 95th percentile of the
memory one device held (the pods of a claim shared by several pods added up, since they share its device), its
samples and the time they span, the SM use of one device. The rules, in order:

1. an OOM-killed container, or a peak within 5 % of the memory its device has: it hit its limit, so nothing
   smaller is said (advise up, not down), only the next larger device;
2. a device shared with other pods by time-slicing (or processes on its GPU in no claim's pod), or processes
   the plugin could not tell apart between devices: the memory is not this workload's alone;
3. fewer samples, or a shorter span, than asked for (not for a snapshot, which is one sample by definition);
4. otherwise the smallest device of the model the cluster offers that holds the peak plus headroom and the SMs
   it used (95th percentile plus headroom): a MIG profile, an MPS slot, a memory share, or the whole GPU.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from api.quantity import GIB
from dra.model.catalog import GpuModel
from dra.model.devices import KIND_GPU, KIND_MIG, KIND_SHARED, KIND_SLOT, parse_device_name
from ops.advise.offers import Offer, PublishedDevice
from ops.advise.owners import ClaimSource, Workload
from ops.advise.sizing import KINDS, Candidate, Need, candidates, larger, mig_fraction, smallest
from ops.advise.usage import SeriesUsage

AT_CEILING = 0.95          # a peak this close to its device's memory hit the limit

RESIZE, KEEP, AT_LIMIT, NOT_ATTRIBUTABLE, TOO_LITTLE_DATA, NOTHING_OFFERED = (
    "resize", "keep", "at-limit", "not-attributable", "too-little-data", "nothing-offered")
VERDICTS = (RESIZE, KEEP, AT_LIMIT, NOT_ATTRIBUTABLE, TOO_LITTLE_DATA, NOTHING_OFFERED)


@dataclass(frozen=True)
class Settings:
    headroom: float = 0.2
    min_samples: int = 100
    min_span: float = 3600.0
    kinds: Sequence[str] = KINDS
    snapshot: bool = False


@dataclass
class Group:
    workload: Workload
    source: ClaimSource | None
    request: str
    model: str                                 # NVML's product name
    series: list[SeriesUsage] = field(default_factory=list)
    oom: list[str] = field(default_factory=list)    # "pod/container" OOM-killed in the window


@dataclass(frozen=True)
class Figures:
    peak: float                 # bytes one device held at most
    p95: float
    samples: int
    first: float
    last: float
    sm_peak: float | None       # percent of the device NVML measured it on
    sm_p95: float | None
    pods: int

    @property
    def span(self) -> float:
        return max(0.0, self.last - self.first)


def figures(series: Sequence[SeriesUsage]) -> Figures:
    """One device's figures: per pod and device the largest of its series (a container set that changed makes
    a new series), then the pods of one device added (a shared claim), then the largest device."""
    per_pod: dict[tuple[str, str, str, str], list[float]] = {}
    for s in series:
        key = (s.node, s.claim, s.device, s.pod)
        got = per_pod.setdefault(key, [0.0, 0.0, 0.0, 0.0])
        for i, v in enumerate((s.memory_peak, s.memory_p95, s.sm_peak or 0.0, s.sm_p95 or 0.0)):
            got[i] = max(got[i], v)
    per_device: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for (node, claim, device, _), got in per_pod.items():
        summed = per_device[(node, claim, device)]
        for i, v in enumerate(got):
            summed[i] += v
    has_sm = any(s.sm_p95 is not None for s in series)
    return Figures(
        peak=max(v[0] for v in per_device.values()), p95=max(v[1] for v in per_device.values()),
        samples=sum(s.samples for s in series), first=min(s.first for s in series), last=max(s.last for s in series),
        sm_peak=min(100.0, max(v[2] for v in per_device.values())) if has_sm else None,
        sm_p95=min(100.0, max(v[3] for v in per_device.values())) if has_sm else None,
        pods=len({s.pod for s in series}))


@dataclass(frozen=True)
class RanOn:
    """The device a workload ran on: what it gave, what of the GPU it took."""

    kind: str                   # gpu | mig | slot | share
    label: str
    memory_bytes: int | None    # its ceiling
    fraction: Fraction | None
    target_sms: int | None      # the SMs its SM percentage is of (the MIG device's, else the GPU's)
    sharing: str


def ran_on(s: SeriesUsage, model: GpuModel | None, published: PublishedDevice | None,
           claimed: Mapping[str, int] | None = None) -> RanOn:
    """What the device of series ``s`` was. ``claimed``: what its claim consumed of the device (``memory``
    bytes of a share, ``slots`` of a slots device), when the claim is still there."""
    claimed = claimed or {}
    gpu_memory = model.memory_mib << 20 if model else None
    gpu_sms = model.multiprocessors if model else None
    try:
        kind = parse_device_name(s.device.split("|")[0]).kind
    except ValueError:
        kind = KIND_GPU
    if kind == KIND_MIG:
        profile = next((p for p in (model.mig_profiles if model else ()) if p.name == s.mig_profile), None)
        if profile is not None and model is not None:
            return RanOn("mig", f"mig {profile.name}", profile.memory_mib << 20, mig_fraction(model, profile),
                         profile.multiprocessors, s.sharing)
        return RanOn("mig", f"mig {s.mig_profile or '?'}", published.memory_bytes if published else None, None,
                     published.multiprocessors if published else None, s.sharing)
    if kind == KIND_SLOT:
        n = published.slot_count if published and published.slot_count else None
        k = claimed.get("slots", 1)
        if s.sharing != "mps":
            return RanOn("slot", f"{s.sharing} slot" + (f" ({k} of {n})" if n else ""), gpu_memory,
                         Fraction(k, n) if n else None, gpu_sms, s.sharing)
        memory = (published.memory_bytes if published and published.memory_bytes and k == 1 else
                  (gpu_memory // n * k if gpu_memory and n else None))
        return RanOn("slot", f"mps slot ({k} of {n or '?'})", memory, Fraction(k, n) if n else None, gpu_sms, s.sharing)
    if kind == KIND_SHARED:
        share = claimed.get("memory")
        total = gpu_memory or (published.memory_bytes if published else None)
        label = f"share {_gib(share)}" if share else "share (amount unknown: its claim is gone)"
        return RanOn("share", label, share, Fraction(share, total) if share and total else None, gpu_sms, s.sharing)
    return RanOn("gpu", "whole GPU", gpu_memory or (published.memory_bytes if published else None), Fraction(1),
                 gpu_sms or (published.multiprocessors if published else None), s.sharing)


@dataclass(frozen=True)
class Advice:
    group: Group
    figures: Figures
    ran_on: RanOn
    verdict: str
    why: str
    recommendation: Candidate | None = None
    need: Need | None = None
    frees: Fraction | None = None               # of a GPU, per device (negative: it takes more)
    alternatives: tuple[Candidate, ...] = ()    # the other candidates that hold it, smallest first


def advise(group: Group, ran: RanOn, model: GpuModel | None, offer: Offer | None, settings: Settings, *,
           shared_with: Sequence[str] = (), unattributed: float = 0.0) -> Advice:
    """The advice for one group. ``shared_with``: other pods whose series were on the same time-sliced GPU in the
    window; ``unattributed``: the most processes its GPUs had in no claim's pod."""
    f = figures(group.series)
    seen = _seen(f, settings)
    if group.oom:
        return Advice(group, f, ran, AT_LIMIT, f"OOM-killed ({', '.join(sorted(group.oom))}) in the window: it hit "
                      f"a limit, so it is advised up, not down{_up(ran, model, offer, settings)}; {seen}")
    if ran.memory_bytes and f.peak >= AT_CEILING * ran.memory_bytes:
        return Advice(group, f, ran, AT_LIMIT, f"peak {_gib(f.peak)} is {f.peak / ran.memory_bytes:.0%} of its "
                      f"{ran.label}'s {_gib(ran.memory_bytes)}: it used what it had, so it is advised up, not "
                      f"down{_up(ran, model, offer, settings)}; {seen}")
    joined = sorted({s.device for s in group.series if s.joined_devices})
    if joined:
        return Advice(group, f, ran, NOT_ATTRIBUTABLE, f"the plugin could not tell its processes apart between "
                      f"devices {', '.join(joined)}: no one device's use is known; {seen}")
    if ran.sharing == "time-slicing" and (shared_with or unattributed):
        others = f"{len(shared_with)} other pod(s)" + (f" and {unattributed:g} process(es) in no claim's pod"
                                                        if unattributed else "")
        return Advice(group, f, ran, NOT_ATTRIBUTABLE, f"its GPU was time-sliced with {others}: they drew on one "
                      f"pool of memory, so its peak is not what it needs alone; {seen}")
    if not settings.snapshot and (f.samples < settings.min_samples or f.span < settings.min_span):
        return Advice(group, f, ran, TOO_LITTLE_DATA, f"too little data: {seen}; --min-samples "
                      f"{settings.min_samples} over --min-span {duration(settings.min_span)} needed")
    if offer is None:
        return Advice(group, f, ran, NOTHING_OFFERED, f"no node publishes a device of {group.model} now: "
                      f"nothing to size against; {seen}")
    need = need_of(f, ran, settings.headroom)
    found = candidates(model, offer, need, settings.kinds)
    best = smallest(found, need)
    basis = _basis(f, ran, need, settings.headroom, seen)
    if best is None and ran.kind == "gpu":
        return Advice(group, f, ran, KEEP, f"{basis} → keep the whole GPU: nothing smaller holds it, and the whole "
                      "GPU leaves it less than the headroom", need=need)
    if best is None:
        return Advice(group, f, ran, NOTHING_OFFERED, f"{basis}: no device of {group.model} offered "
                      f"({', '.join(settings.kinds)}) holds it", need=need)
    # The next few devices that hold it; a "+me" twin says nothing its plain profile does not.
    fitting = tuple(c for c in found if c.fits(need) and c != best and "+" not in c.profile)[:4]
    frees = ran.fraction - best.fraction if ran.fraction is not None else None
    if _same(best, ran):
        verdict, what = KEEP, f"its {ran.label} is already the smallest that holds it"
    elif best.kind == KIND_GPU:
        verdict, what = (KEEP if ran.kind == "gpu" else RESIZE), "keep the whole GPU: nothing smaller holds it"
    else:
        gives = f"{_gib(best.memory_bytes)}" + (f", {best.sms} SMs" if best.sms is not None else ", SMs not bounded")
        what = f"{best.describe()} ({gives}) is the smallest that holds it"
        if frees is not None:
            what += f"; frees {float(frees):.2f} of a GPU" if frees >= 0 else f"; takes {float(-frees):.2f} more"
        verdict = RESIZE
    return Advice(group, f, ran, verdict, f"{basis} → {what}", best, need, frees if verdict == RESIZE else None,
                  fitting)


def need_of(f: Figures, ran: RanOn, headroom: float) -> Need:
    """Peak memory and 95th-percentile SMs, each with the headroom."""
    sms = (f.sm_p95 or 0.0) / 100 * (ran.target_sms or 0) * (1 + headroom)
    return Need(math.ceil(f.peak * (1 + headroom)), sms)


def _same(c: Candidate, ran: RanOn) -> bool:
    return c.kind == ran.kind and c.memory_bytes == ran.memory_bytes


def _up(ran: RanOn, model: GpuModel | None, offer: Offer | None, settings: Settings) -> str:
    if offer is None or not ran.memory_bytes:
        return ""
    up = larger(candidates(model, offer, Need(ran.memory_bytes + 1), settings.kinds), ran.memory_bytes)
    return f" (next larger: {up.describe()}, {_gib(up.memory_bytes)})" if up else " (nothing larger is offered)"


def _seen(f: Figures, settings: Settings) -> str:
    if settings.snapshot:
        return f"snapshot: {_gib(f.peak)} now"
    return f"peak {_gib(f.peak)}, p95 {_gib(f.p95)}, {f.samples} samples over {duration(f.span)}"


def _basis(f: Figures, ran: RanOn, need: Need, headroom: float, seen: str) -> str:
    text = f"{seen}; + {headroom:.0%} = {_gib(need.memory_bytes)}"
    if f.sm_p95 and ran.target_sms:
        which = "now" if "snapshot" in seen else "p95"
        text += f", SM {which} {f.sm_p95:.0f}% of {ran.target_sms} = {need.sms:.1f} SMs"
    return text


def _gib(n: float | int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


def duration(seconds: float) -> str:
    """7d, 3h12m, 5m30s, 40s."""
    s = int(round(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    parts = [(d, "d"), (h, "h"), (m, "m"), (s, "s")]
    shown = [f"{v}{u}" for v, u in parts if v][:2]
    return "".join(shown) or "0s"


def gpu_sharers(series: Iterable[SeriesUsage]) -> dict[tuple[str, str], set[tuple[str, str]]]:
    """(node, GPU UUID) of each time-sliced device → the pods (namespace, pod) whose series were on it."""
    out: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    for s in series:
        if s.sharing == "time-slicing":
            out[(s.node, s.gpu_uuid)].add((s.namespace, s.pod))
    return out

