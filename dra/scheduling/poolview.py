"""The devices a scheduler can allocate, as it sees them: ResourceSlices grouped into pools (highest
generation only), and what existing claims already hold — devices, shared counters and consumed capacity.

Everything is plain wire-format dicts in and small records out; no API access.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from api.quantity import quantity_value
from dra.scheduling.occupancy import consumed_counters, current_pools

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


@dataclass
class PoolDevice:
    key: DeviceKey
    raw: dict[str, Any]
    taints: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return self.key[2]

    @property
    def multi(self) -> bool:
        return bool(self.raw.get("allowMultipleAllocations"))

    def consumes(self) -> dict[str, dict[str, Fraction]]:
        """counter set -> counter -> amount this device takes while allocated (exact, for the explainer)."""
        return consumed_counters(self.raw, lambda v: quantity_value(str(v if v is not None else "0")))


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


def usage_of(claims: Sequence[dict[str, Any]], skip: Collection[str] = ()) -> Usage:
    """Who holds which device, from the claims' status.allocation and reservedFor (claims in `skip` left out)."""
    usage = Usage()
    for claim in claims:
        cid = claim_id(claim)
        if cid in skip:
            continue
        ns = (claim.get("metadata") or {}).get("namespace", "")
        pods = tuple(f"{ns}/{r.get('name')}" for r in (claim.get("status") or {}).get("reservedFor") or []
                     if r.get("resource") == "pods")
        for r in allocation_results(claim):
            consumed = {n: quantity_value(str(v)) for n, v in (r.get("consumedCapacity") or {}).items()}
            usage.holders[(r["driver"], r["pool"], r["device"])].append(
                Holder(cid, pods, bool(r.get("adminAccess")), consumed))
    return usage


def _rule_matches(rule: dict[str, Any], key: DeviceKey) -> bool:
    sel = (rule.get("spec") or {}).get("deviceSelector")
    if sel is None:
        return False                # a rule without deviceSelector matches nothing
    return all(not sel.get(f) or sel[f] == v for f, v in zip(("driver", "pool", "device"), key))


def build_pools(slices: Sequence[dict[str, Any]], taint_rules: Sequence[dict[str, Any]] = ()) -> list[Pool]:
    """Pools of the slices at their highest generation, slices in name order (dra.scheduling.occupancy's rule); a pool
    missing slices of that generation is marked incomplete (the scheduler refuses to allocate from it)."""
    pools = []
    for driver in sorted({(s.get("spec") or {}).get("driver", "") for s in slices}):
        for name, current in sorted(current_pools(slices, driver).items()):
            pools.append(_pool(driver, name, current, taint_rules))
    return pools


def _pool(driver: str, name: str, current: Sequence[Mapping[str, Any]],
          taint_rules: Sequence[dict[str, Any]]) -> Pool:
    spec0 = current[0]["spec"]
    gen = int((spec0.get("pool") or {}).get("generation", 0))
    pool = Pool(driver, name, spec0.get("nodeName"), bool(spec0.get("allNodes")))
    want = int((spec0.get("pool") or {}).get("resourceSliceCount", 1))
    if len(current) < want:
        pool.incomplete = f"pool {name} is incomplete ({len(current)} of {want} slices at generation {gen})"
    for m in current:
        for cs in m["spec"].get("sharedCounters") or []:
            pool.counters[cs["name"]] = {n: quantity_value(str(c.get("value", "0")))
                                         for n, c in (cs.get("counters") or {}).items()}
        for d in m["spec"].get("devices") or []:
            key = (driver, name, d["name"])
            taints = list(d.get("taints") or [])
            taints += [r["spec"]["taint"] for r in taint_rules if _rule_matches(r, key)]
            pool.devices.append(PoolDevice(key, dict(d), taints))
    return pool


def counters_in_use(pools: list[Pool], usage: Usage) -> dict[CounterKey, dict[str, Fraction]]:
    """Counter amounts taken by the existing exclusive allocations, per (driver, pool, counter set)."""
    taken: dict[CounterKey, dict[str, Fraction]] = defaultdict(lambda: defaultdict(Fraction))
    for pool in pools:
        for dev in pool.devices:
            if not usage.exclusive(dev.key):
                continue
            for cs, counters in dev.consumes().items():
                for n, v in counters.items():
                    taken[(pool.driver, pool.name, cs)][n] += v
    return taken


def counter_holders(pools: list[Pool], usage: Usage) -> dict[CounterKey, list[tuple[str, Holder]]]:
    """(device name, holder) of every allocated device that consumes from each counter set."""
    out: dict[CounterKey, list[tuple[str, Holder]]] = defaultdict(list)
    for pool in pools:
        for dev in pool.devices:
            for h in usage.exclusive(dev.key):
                for cs in dev.consumes():
                    out[(pool.driver, pool.name, cs)].append((dev.name, h))
    return out
