"""The smallest device that holds a workload: the candidates a GPU model offers, each with the memory and SMs it
gives and the fraction of the GPU it takes, and the first that holds a need. Pure.

The fraction a device takes is what the scheduler charges for it (docs/devices.md, "Counters"): a MIG profile
its memory or compute slices, whichever share of the GPU is larger (a ``1g.10gb`` on an H100 takes 1/7: one of 7
compute slices, though one of 8 memory slices); an MPS slot k/N; a memory share its amount of the GPU's memory;
the whole GPU 1. Candidates are ranked by that fraction, then by how well they isolate (MIG, then an MPS slot,
then a share), then by memory; a ``+me`` profile comes after its plain twin. Time-slicing slots are never
candidates: they bound neither memory nor SMs.

SMs: a MIG profile has its own; an MPS slot gets its share of the GPU's threads; a memory share bounds none
(its claims share every SM), so it holds any SM need, and the reason says so.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from api.quantity import MIB, format_bytes
from dra.model.catalog import GpuModel
from dra.model.gpu import MigProfile
from ops.advise.offers import Offer, ShareOffer, SlotOffer

KIND_MIG, KIND_SLOT, KIND_SHARE, KIND_GPU = "mig", "slot", "share", "gpu"
KINDS = (KIND_MIG, KIND_SLOT, KIND_SHARE, KIND_GPU)
_ISOLATION = {KIND_MIG: 0, KIND_SLOT: 1, KIND_SHARE: 2, KIND_GPU: 3}


@dataclass(frozen=True)
class Need:
    """What a device must give: bytes of memory and SMs (peaks and headroom already applied)."""

    memory_bytes: int
    sms: float = 0.0


@dataclass(frozen=True)
class Candidate:
    kind: str
    memory_bytes: int
    fraction: Fraction                     # of the GPU
    sms: int | None = None                 # None: not bounded (a memory share)
    profile: str = ""                      # MIG
    slots: int = 0                         # MPS slot: k of slot_count
    slot_count: int = 0
    slot_capacity: bool = False
    thread_percentage: int = 0
    share_strategy: str = ""               # memory share: mps | time-slicing

    def describe(self) -> str:
        if self.kind == KIND_MIG:
            return f"mig {self.profile}"
        if self.kind == KIND_SLOT:
            k = f"{self.slots} of {self.slot_count} slots" if self.slots > 1 else f"1 of {self.slot_count}"
            return f"mps slot ({k}, {self.thread_percentage}% threads)"
        if self.kind == KIND_SHARE:
            return f"share {format_bytes(self.memory_bytes)}"
        return "whole GPU"

    def fits(self, need: Need) -> bool:
        return self.memory_bytes >= need.memory_bytes and (self.sms is None or self.sms >= need.sms)

    def rank(self) -> tuple[Fraction, int, int, int, str]:
        # Last the name: a plain profile before its "+me" twin, which holds the GPU's one media extension.
        return self.fraction, _ISOLATION[self.kind], self.memory_bytes, self.slots, self.profile


def mig_fraction(model: GpuModel, profile: MigProfile) -> Fraction:
    """The share of the GPU a partition takes: memory or compute slices, the larger."""
    return max(Fraction(profile.memory_slices, model.mig_memory_slices),
               Fraction(profile.compute_slices, model.mig_compute_slices))


def mig_candidates(model: GpuModel, offered: Iterable[str]) -> list[Candidate]:
    names = set(offered)
    return [Candidate(KIND_MIG, p.memory_mib * MIB, mig_fraction(model, p), p.multiprocessors, profile=p.name)
            for p in model.mig_profiles if p.name in names]


def slot_candidates(slots: SlotOffer, memory_bytes: int, sms: int) -> list[Candidate]:
    """MPS slots as the plugin gives them: each 1/N of the memory (pinned limit) and of the threads; with
    capacity, k slots are k times that."""
    n = slots.count
    one_memory = memory_bytes // MIB // n * MIB
    one_sms = max(1, sms // n) if sms else 0
    return [Candidate(KIND_SLOT, one_memory * k, Fraction(k, n), one_sms * k if sms else None, slots=k, slot_count=n,
                      slot_capacity=slots.capacity, thread_percentage=100 // n * k)
            for k in (range(1, n + 1) if slots.capacity else (1,))]


def share_size(share: ShareOffer, need_bytes: int) -> int | None:
    """The smallest amount the share's policy accepts that holds ``need_bytes``; None above its maximum."""
    if need_bytes <= share.minimum:
        return share.minimum
    size = share.minimum + math.ceil((need_bytes - share.minimum) / share.step) * share.step
    return size if size <= share.maximum else None


def candidates(model: GpuModel | None, offer: Offer, need: Need, kinds: Sequence[str] = KINDS) -> list[Candidate]:
    """Every device ``offer`` has for this model (of ``kinds``), smallest first; a memory share at the size that
    holds ``need``."""
    memory = model.memory_mib * MIB if model else offer.memory_bytes
    sms = model.multiprocessors if model else offer.multiprocessors
    out: list[Candidate] = []
    if KIND_MIG in kinds and model is not None and model.mig_capable:
        out += mig_candidates(model, offer.mig_profiles)
    if KIND_SLOT in kinds and memory:
        for slots in offer.mps_slots:
            out += slot_candidates(slots, memory, sms)
    if KIND_SHARE in kinds and memory:
        for share in offer.shares:
            size = share_size(share, need.memory_bytes)
            if size is not None:
                out.append(Candidate(KIND_SHARE, size, Fraction(size, memory), share_strategy=share.strategy))
    if KIND_GPU in kinds and (offer.whole or not out) and memory:
        out.append(Candidate(KIND_GPU, memory, Fraction(1), sms or None))
    return sorted(out, key=Candidate.rank)


def smallest(found: Iterable[Candidate], need: Need) -> Candidate | None:
    """The first candidate, by rank, that holds the need."""
    return min((c for c in found if c.fits(need)), key=Candidate.rank, default=None)


def larger(found: Iterable[Candidate], than: int) -> Candidate | None:
    """The smallest candidate with more memory than ``than`` bytes (what "advise up" names)."""
    return min((c for c in found if c.memory_bytes > than), key=Candidate.rank, default=None)
