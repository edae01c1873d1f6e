"""What the cluster offers per GPU model, from the driver's ResourceSlices: whole GPUs, the MIG profiles
published, MPS slots (how many per GPU, as devices or as capacity) and memory shares (their minimum, step and
largest amount); and each published device's memory and SMs, to know what a workload ran on. Pure: the slices
are read elsewhere.

"Where the node policy offers it": a recommendation is only ever a device some node publishes for that model
now, so a template written for it can be allocated.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from api.quantity import quantity_value


@dataclass(frozen=True)
class SlotOffer:
    """MPS slots on a GPU: ``count`` per GPU; ``capacity``: one device whose ``slots`` a claim takes k of."""

    count: int
    capacity: bool = False


@dataclass(frozen=True)
class ShareOffer:
    """A memory-share device's request policy (bytes) and how it shares (mps: the amount is enforced)."""

    minimum: int
    step: int
    maximum: int
    strategy: str


@dataclass
class Offer:
    """One GPU model (by NVML's product name) across the cluster."""

    product_name: str
    memory_bytes: int = 0                  # the whole GPU's, where a device says it
    multiprocessors: int = 0
    whole: bool = False
    mig_profiles: set[str] = field(default_factory=set)
    mps_slots: set[SlotOffer] = field(default_factory=set)
    shares: set[ShareOffer] = field(default_factory=set)


@dataclass(frozen=True)
class PublishedDevice:
    """One device as published now: what a workload that ran on it had."""

    node: str
    name: str
    type: str                              # gpu | mig | slot | shared
    product_name: str
    sharing: str
    profile: str = ""
    memory_bytes: int | None = None        # capacity memory (a share device: the GPU's total)
    multiprocessors: int | None = None
    slot_count: int | None = None          # a slot's GPU: N slots


def _attr(device: Mapping[str, Any], driver: str, name: str) -> Any:
    value = ((device.get("attributes") or {}).get(name) or (device.get("attributes") or {}).get(f"{driver}/{name}")
             or {})
    return next(iter(value.values()), None) if isinstance(value, dict) and value else None


def _capacity(device: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = (device.get("capacity") or {}).get(name)
    return value if isinstance(value, dict) else {}


def _amount(text: Any) -> int | None:
    try:
        return int(quantity_value(str(text)))
    except (ValueError, ZeroDivisionError):
        return None


def read_offers(slices: Iterable[Mapping[str, Any]], driver: str) -> tuple[dict[str, Offer],
                                                                              dict[tuple[str, str], PublishedDevice]]:
    """(product name → Offer, (node, device) → PublishedDevice) of the driver's slices."""
    offers: dict[str, Offer] = {}
    devices: dict[tuple[str, str], PublishedDevice] = {}
    slots_per_gpu: dict[tuple[str, str], int] = defaultdict(int)   # (node, parent UUID) → slot devices
    slot_devices: list[tuple[PublishedDevice, str, bool]] = []
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != driver:
            continue
        node = str(spec.get("nodeName") or (spec.get("pool") or {}).get("name") or "")
        for d in spec.get("devices") or []:
            kind, product = _attr(d, driver, "type"), _attr(d, driver, "productName")
            if not isinstance(kind, str) or not isinstance(product, str):
                continue
            offer = offers.setdefault(product, Offer(product))
            memory = _capacity(d, "memory")
            sms = _amount(_capacity(d, "multiprocessors").get("value"))
            pub = PublishedDevice(node, str(d.get("name", "")), kind, product, str(_attr(d, driver, "sharing") or ""),
                                  str(_attr(d, driver, "profile") or ""), _amount(memory.get("value")), sms)
            if kind == "gpu":
                offer.whole = True
                offer.memory_bytes = pub.memory_bytes or offer.memory_bytes
                offer.multiprocessors = sms or offer.multiprocessors
            elif kind == "mig" and pub.profile:
                offer.mig_profiles.add(pub.profile)
            elif kind == "shared":
                offer.memory_bytes = offer.memory_bytes or pub.memory_bytes or 0
                share = _share(memory, pub.sharing)
                if share is not None:
                    offer.shares.add(share)
            elif kind == "slot":
                units = _amount(_capacity(d, "slots").get("value"))
                parent = str(_attr(d, driver, "parentUUID") or "")
                if units is None:
                    slots_per_gpu[(node, parent)] += 1
                else:
                    pub = replace(pub, slot_count=units)
                slot_devices.append((pub, parent, units is not None))
            devices[(node, pub.name)] = pub
    for pub, parent, capacity in slot_devices:
        count = pub.slot_count if capacity else slots_per_gpu[(pub.node, parent)]
        devices[(pub.node, pub.name)] = replace(pub, slot_count=count)
        if pub.sharing == "mps" and count:
            offers[pub.product_name].mps_slots.add(SlotOffer(count, capacity))
    return offers, devices


def _share(memory: Mapping[str, Any], strategy: str) -> ShareOffer | None:
    valid = (memory.get("requestPolicy") or {}).get("validRange") or {}
    lo, step, hi = _amount(valid.get("min")), _amount(valid.get("step")), _amount(valid.get("max"))
    if lo is None or hi is None:
        return None
    return ShareOffer(lo, step or 1, hi, strategy)
