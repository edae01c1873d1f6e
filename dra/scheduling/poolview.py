"""The devices a scheduler can allocate, as it sees them: a pool of ResourceSlices at its highest generation
(``pool_of``), its devices, and who holds one (``Holder``, ``Usage``). dra.scheduling.clusterview keeps these for a
whole cluster.

Everything is plain wire-format dicts in and small records out; no API access.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Any

from api.quantity import quantity_value
from dra.scheduling.occupancy import consumed_counters

DeviceKey = tuple[str, str, str]     # (driver, pool, device)
CounterKey = tuple[str, str, str]    # (driver, pool, counter set) -> counters by name
ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"


@dataclass(frozen=True)
class Holder:
    """An allocation of one device by an existing claim."""

    claim: str                      # namespace/name
    pods: tuple[str, ...]           # namespace/name of the pods in reservedFor
    admin_access: bool
    consumed: dict[str, Fraction]   # consumedCapacity (multi-allocatable devices)

    def describe(self) -> str:
        return self.claim + (f" (pod {', '.join(self.pods)})" if self.pods else "")


@dataclass(slots=True)
class PoolDevice:
    key: DeviceKey
    raw: dict[str, Any]
    taints: list[dict[str, Any]]
    _consumes: dict[str, dict[str, Fraction]] | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.key[2]

    @property
    def multi(self) -> bool:
        return bool(self.raw.get("allowMultipleAllocations"))

    def consumes(self) -> dict[str, dict[str, Fraction]]:
        """counter set -> counter -> amount this device takes while allocated (exact, for the explainer); read
        once per device."""
        if self._consumes is None:
            self._consumes = _consumed(self.raw.get("consumesCounters"))
        return self._consumes


# Parsed counters by content: the devices of a fleet consume alike, and its pools share alike, so each distinct
# list is parsed once and its parse is one shared (read-only) object, whatever the objects it came from.
_PARSED: dict[tuple[Any, ...], dict[str, dict[str, Fraction]]] = {}
_PARSED_LIMIT = 50_000


def _parsed(key: tuple[Any, ...], parse: Any) -> dict[str, dict[str, Fraction]]:
    kept = _PARSED.get(key)
    if kept is None:
        if len(_PARSED) >= _PARSED_LIMIT:
            _PARSED.clear()
        kept = _PARSED[key] = parse()
    return kept


def _counter_items(counters: Any) -> tuple[tuple[str, str], ...]:
    return tuple((k, str((v or {}).get("value", "0"))) for k, v in (counters or {}).items())


def _shared_counters(entries: Any) -> dict[str, dict[str, Fraction]]:
    """counter set -> counter -> amount of a slice's sharedCounters."""
    if not entries:
        return {}
    sets = tuple((str(cs.get("name", "")), _counter_items(cs.get("counters"))) for cs in entries)
    return _parsed(("shared", *sets), lambda: {name: {n: _amount(v) for n, v in items} for name, items in sets})


def _consumed(entries: Any) -> dict[str, dict[str, Fraction]]:
    """counter set -> counter -> amount of a device's consumesCounters."""
    if not entries:
        return {}
    key = ("consumes", *((e.get("counterSet", ""), _counter_items(e.get("counters"))) for e in entries))
    return _parsed(key, lambda: consumed_counters({"consumesCounters": entries}, _amount))


@lru_cache(maxsize=4096)
def _exact(text: str) -> Fraction:
    return quantity_value(text)


def _amount(value: Any) -> Fraction:
    """A counter amount as an exact number; the few distinct amounts of a fleet are parsed once."""
    return _exact(str(value if value is not None else "0"))


@dataclass
class Pool:
    driver: str
    name: str
    node: str | None                # None: the pool is not bound to one node (allNodes / nodeSelector)
    all_nodes: bool
    devices: list[PoolDevice] = field(default_factory=list)
    counters: dict[str, dict[str, Fraction]] = field(default_factory=dict)
    incomplete: str = ""            # why the scheduler would not use the pool, if it would not


@dataclass
class Usage:
    """What the existing allocations hold."""

    holders: dict[DeviceKey, list[Holder]] = field(default_factory=lambda: defaultdict(list))

    def exclusive(self, key: DeviceKey) -> list[Holder]:
        return [h for h in self.holders.get(key, []) if not h.admin_access]


def claim_id(claim: dict[str, Any]) -> str:
    meta = claim.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def allocation_results(claim: dict[str, Any]) -> list[dict[str, Any]]:
    status = claim.get("status") or {}
    return (((status.get("allocation") or {}).get("devices") or {}).get("results")) or []


def allocated_node(claim: dict[str, Any]) -> str | None:
    """The node of a node-local allocation (its nodeSelector's metadata.name), if any."""
    selector = ((claim.get("status") or {}).get("allocation") or {}).get("nodeSelector") or {}
    for term in selector.get("nodeSelectorTerms") or []:
        for req in term.get("matchFields") or []:
            if req.get("key") == "metadata.name" and req.get("operator") == "In" and req.get("values"):
                return str(req["values"][0])
    return None




def _rule_matches(rule: dict[str, Any], key: DeviceKey) -> bool:
    sel = (rule.get("spec") or {}).get("deviceSelector")
    if sel is None:
        return False                # a rule without deviceSelector matches nothing
    return all(not sel.get(f) or sel[f] == v for f, v in zip(("driver", "pool", "device"), key))




def pool_of(driver: str, name: str, current: Sequence[Mapping[str, Any]],
            taint_rules: Sequence[dict[str, Any]]) -> Pool:
    """One pool from its current slices (dra.scheduling.occupancy.current_pools); devices are read, not copied."""
    spec0 = current[0]["spec"]
    gen = int((spec0.get("pool") or {}).get("generation", 0))
    pool = Pool(driver, name, spec0.get("nodeName"), bool(spec0.get("allNodes")))
    want = int((spec0.get("pool") or {}).get("resourceSliceCount", 1))
    if len(current) < want:
        pool.incomplete = f"pool {name} is incomplete ({len(current)} of {want} slices at generation {gen})"
    for m in current:
        pool.counters.update(_shared_counters(m["spec"].get("sharedCounters")))
        for d in m["spec"].get("devices") or []:
            key = (driver, name, d["name"])
            taints = d.get("taints") or []
            if taint_rules:
                taints = list(taints) + [r["spec"]["taint"] for r in taint_rules if _rule_matches(r, key)]
            pool.devices.append(PoolDevice(key, d, taints))
    return pool



