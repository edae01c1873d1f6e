"""Who holds which GPU device and what is still free: the computation behind ``gpu-dra status``.

Pure, over wire-format objects as the API server returns them: this driver's ResourceSlices, ResourceClaims
(``status.allocation.devices.results`` and ``status.reservedFor``) and Pods (which claims they use). Nothing
here reads the API; ``ops.status.reads`` does that.

What is free is decided by the rule the scheduler applies, the published counters
(docs/devices.md, "Counters"): a device can be allocated when nobody holds it, no NoSchedule/NoExecute taint
is on it, and what it consumes fits in what its counter set has left after the allocated devices. The counters
encode the MIG placement rule of ``dra.model.mig``, so MIG profiles still placeable come from them too:
for each profile, how many more instances first-fit allocation in the published order (what the scheduler
does) would still place. Static MIG partitions consume no counters; the memory slices they cover come from
the placement rule itself (``dra.model.mig.interval`` with the catalog's profile of their product).

The MIG memory-slice row of a GPU draws each memory slice: the letter of the allocated device covering it,
``+`` where several cover it (slots), ``.`` where it is free; placements are separated by ``|``, e.g.
``[AAAA|BB|..|C]``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Callable

from api.quantity import format_bytes, quantity_value
from dra.model.catalog import model_for_product_name
from dra.model.devices import KIND_GPU, KIND_MIG, KIND_SHARED, KIND_SLOT, DeviceName, parse_device_name
from dra.model.mig import interval

BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
MEMORY_SLICE = "memory-slice-"
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"

HELD, FREE, BLOCKED, TAINTED = "held", "free", "blocked", "tainted"

Counters = dict[str, dict[str, int]]          # counter set -> counter -> value


@dataclass(frozen=True)
class Holder:
    """One allocation of a device: the claim, its namespace, the pods using it, what it consumes."""

    namespace: str
    claim: str
    pods: tuple[str, ...]
    request: str = ""
    memory_bytes: int | None = None         # consumed memory of a shared device
    slots: int | None = None                # consumed slots of a slot device with capacity (slots.layout: capacity)
    instances: int | None = None            # consumed instances of a MIG device with capacity (dynamicMig.layout)

    def describe(self) -> str:
        pods = ", ".join(self.pods) if self.pods else "no pod"
        memory = f" {format_bytes(self.memory_bytes)}" if self.memory_bytes else ""
        return f"{self.namespace}/{self.claim}{memory} → {pods}"


@dataclass(frozen=True)
class DeviceState:
    """One published device: held (with its holders), free, blocked by what others hold, or tainted."""

    name: str
    kind: str
    state: str
    detail: str = ""                        # MIG profile, or the sharing strategy of a slot or share
    memory: str = ""                        # the memory capacity as published
    holders: tuple[Holder, ...] = ()
    taints: tuple[str, ...] = ()
    dynamic_mig: bool = False


@dataclass
class GpuStatus:
    """One GPU of one node."""

    node: str
    minor: int
    uuid: str
    product: str
    devices: list[DeviceState] = field(default_factory=list)
    taints: tuple[str, ...] = ()            # every taint on any of its devices, "key=value:effect"
    whole_free: bool | None = None          # None: no whole-GPU device published
    mig_free: dict[str, int] = field(default_factory=dict)   # profile -> instances still placeable
    slots_free: int = 0
    slots_total: int = 0
    share_free_bytes: int | None = None     # None: no share device
    share_total_bytes: int | None = None
    memory_slices: str = ""                 # the MIG row, "" for a GPU without MIG partitions
    legend: list[tuple[str, str]] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not any(t.rsplit(":", 1)[-1] in BLOCKING_EFFECTS for t in self.taints)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["healthy"] = self.healthy
        out["legend"] = [{"letter": k, "holder": v} for k, v in self.legend]
        for key in ("share_free_bytes", "share_total_bytes"):
            if out[key] is not None:
                out[key.replace("_bytes", "")] = format_bytes(out[key])
        return out


@dataclass
class NodeStatus:
    name: str
    gpus: list[GpuStatus] = field(default_factory=list)
    others: list[DeviceState] = field(default_factory=list)    # devices whose names are not ours

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "gpus": [g.to_dict() for g in self.gpus],
                "other_devices": [asdict(d) for d in self.others]}


# --------------------------------------------------------------------------------------------------- reading

@lru_cache(maxsize=4096)
def _amount(text: str) -> int:
    """A counter or capacity quantity as a whole number (memory in bytes, counters as counts)."""
    return int(quantity_value(text))


def _quantity(value: Any) -> int:
    try:
        return _amount(str(value))
    except (ValueError, TypeError):
        return 0


def _string(attrs: Mapping[str, Any], name: str) -> str:
    """A string attribute of a device's ``attributes`` ("" when it has none)."""
    value = attrs.get(name)
    return str(value.get("string", "")) if isinstance(value, dict) else ""


@lru_cache(maxsize=8192)
def _parsed(name: str) -> DeviceName:
    """parse_device_name, once per name: every node publishes the same names."""
    return parse_device_name(name)


def _taint_text(t: Mapping[str, Any]) -> str:
    value = f"={t['value']}" if t.get("value") else ""
    return f"{t.get('key', '')}{value}:{t.get('effect', '')}"


def current_pools(slices: Iterable[Mapping[str, Any]], driver: str) -> dict[str, list[Mapping[str, Any]]]:
    """Pool name -> its slices of the highest generation, in name order (the scheduler's view of a pool: slices
    of an older generation are being replaced)."""
    by_pool: dict[str, list[Mapping[str, Any]]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != driver:
            continue
        by_pool.setdefault((spec.get("pool") or {}).get("name", ""), []).append(s)
    out = {}
    for pool, items in by_pool.items():
        newest = max(int((s["spec"].get("pool") or {}).get("generation") or 0) for s in items)
        out[pool] = sorted((s for s in items if int((s["spec"].get("pool") or {}).get("generation") or 0) == newest),
                           key=lambda s: (s.get("metadata") or {}).get("name", ""))
    return out


def claim_pods(claims: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], tuple[str, ...]]:
    """(namespace, claim name) -> the pods using it: those it is reserved for, and those whose spec or status
    names it (a pod not yet admitted by the kubelet may be missing from reservedFor)."""
    users: dict[tuple[str, str], set[str]] = {}
    for c in claims:
        meta = c.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        for r in (c.get("status") or {}).get("reservedFor") or []:
            if r.get("resource", "pods") == "pods" and r.get("name"):
                users.setdefault(key, set()).add(r["name"])
    for p in pods:
        meta = p.get("metadata") or {}
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        generated = {s.get("name"): s.get("resourceClaimName")
                     for s in (p.get("status") or {}).get("resourceClaimStatuses") or []}
        for rc in (p.get("spec") or {}).get("resourceClaims") or []:
            claim = rc.get("resourceClaimName") or generated.get(rc.get("name"))
            if claim:
                users.setdefault((ns, claim), set()).add(name)
    return {k: tuple(sorted(v)) for k, v in users.items()}


def allocations(claims: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
                driver: str) -> dict[tuple[str, str], list[Holder]]:
    """(pool, device) -> the holders of each device of this driver that a claim has allocated."""
    claims = list(claims)
    users = claim_pods(claims, pods)
    out: dict[tuple[str, str], list[Holder]] = {}
    for c in claims:
        meta = c.get("metadata") or {}
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        results = (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
        for r in results:
            if r.get("driver") != driver:
                continue
            consumed = (r.get("consumedCapacity") or {}).get("memory")
            slots = (r.get("consumedCapacity") or {}).get("slots")
            instances = (r.get("consumedCapacity") or {}).get("instances")
            out.setdefault((r.get("pool", ""), r.get("device", "")), []).append(Holder(
                namespace=ns, claim=name, pods=users.get((ns, name), ()), request=str(r.get("request", "")),
                memory_bytes=_quantity(consumed) if consumed is not None else None,
                slots=_quantity(slots) if slots is not None else None,
                instances=_quantity(instances) if instances is not None else None))
    return out


# --------------------------------------------------------------------------------------------------- counters

def consumed_counters(device: Mapping[str, Any], amount: Callable[[Any], Any]) -> dict[str, dict[str, Any]]:
    """counter set -> counter -> what a published device takes of it while allocated (its ``consumesCounters``),
    each value read by ``amount``. The one reader of a device's counters (``gpu-dra status`` and explain)."""
    out: dict[str, dict[str, Any]] = {}
    for entry in device.get("consumesCounters") or ():
        out[entry.get("counterSet", "")] = {k: amount((v or {}).get("value")) for k, v in
                                             (entry.get("counters") or {}).items()}
    return out


def _consumption(device: Mapping[str, Any]) -> Counters:
    return consumed_counters(device, _quantity)


def _fits(need: Counters, left: Counters) -> bool:
    """The scheduler's counter rule: everything a device consumes must still be left in its counter sets."""
    return not need or all(v <= left.get(cs, {}).get(k, 0) for cs, counters in need.items() for k, v in counters.items())


def _take(need: Counters, left: Counters) -> None:
    for cs, counters in need.items():
        have = left.setdefault(cs, {})
        for k, v in counters.items():
            have[k] = have.get(k, 0) - v


# --------------------------------------------------------------------------------------------------- the pool

def pool_status(node: str, slices: Sequence[Mapping[str, Any]], holders: Mapping[tuple[str, str], list[Holder]],
                pool: str | None = None) -> NodeStatus:
    """Every GPU of one pool (its current slices, in order) with holders, free capacity and the MIG row."""
    pool = pool if pool is not None else node
    left: Counters = {}
    devices: list[Mapping[str, Any]] = []
    for s in slices:
        spec = s.get("spec") or {}
        for cs in spec.get("sharedCounters") or []:
            left[cs.get("name", "")] = {k: _quantity((v or {}).get("value")) for k, v in
                                        (cs.get("counters") or {}).items()}
        devices.extend(spec.get("devices") or [])
    need = {d.get("name", ""): _consumption(d) for d in devices}
    for d in devices:
        if holders.get((pool, d.get("name", ""))):
            _take(need[d.get("name", "")], left)

    status = NodeStatus(node)
    gpus: dict[int, GpuStatus] = {}
    members: dict[int, list[tuple[Mapping[str, Any], DeviceState]]] = {}
    for d in devices:
        name = d.get("name", "")
        attrs = d.get("attributes") or {}
        held = tuple(holders.get((pool, name), ()))
        raw_taints = d.get("taints") or ()
        kind = _string(attrs, "type")
        if held:
            state = HELD
        elif any(t.get("effect") in BLOCKING_EFFECTS for t in raw_taints):
            state = TAINTED
        else:
            state = FREE if _fits(need[name], left) else BLOCKED
        detail = _string(attrs, "profile" if kind == KIND_MIG else "sharing")
        ds = DeviceState(name=name, kind=kind, state=state, detail="" if detail == "none" else detail,
                         memory=str(((d.get("capacity") or {}).get("memory") or {}).get("value", "")),
                         holders=held, taints=tuple(_taint_text(t) for t in raw_taints),
                         dynamic_mig=kind == KIND_MIG and "uuid" not in attrs)
        try:
            minor = _parsed(name).minor
        except ValueError:
            status.others.append(ds)
            continue
        gpu = gpus.get(minor)
        if gpu is None:
            gpu = gpus[minor] = GpuStatus(node=node, minor=minor, uuid="", product=_string(attrs, "productName"))
            members[minor] = []
        if not gpu.uuid:
            gpu.uuid = _string(attrs, "uuid" if kind == KIND_GPU else "parentUUID")
        gpu.devices.append(ds)
        members[minor].append((d, ds))
    for minor in sorted(gpus):
        _summarise(gpus[minor], members[minor], need, left)
        status.gpus.append(gpus[minor])
    return status


def _summarise(gpu: GpuStatus, members: list[tuple[Mapping[str, Any], DeviceState]], need: Mapping[str, Counters],
               left: Counters) -> None:
    taints: dict[str, None] = {}
    for _, ds in members:
        taints.update(dict.fromkeys(ds.taints))
    gpu.taints = tuple(taints)
    for d, ds in members:
        if ds.kind == KIND_GPU:
            gpu.whole_free = ds.state == FREE
        elif ds.kind == KIND_SLOT and d.get("allowMultipleAllocations"):
            # The capacity layout's one slot device: its counters were charged by its first share, so while
            # it is held only its slots capacity bounds the next share.
            total = _quantity(((d.get("capacity") or {}).get("slots") or {}).get("value"))
            gpu.slots_total += total
            if ds.state in (HELD, FREE):
                gpu.slots_free += max(0, total - sum(h.slots or 0 for h in ds.holders))
        elif ds.kind == KIND_SLOT:
            gpu.slots_total += 1
        elif ds.kind == KIND_SHARED:
            total = _quantity(((d.get("capacity") or {}).get("memory") or {}).get("value"))
            used = sum(h.memory_bytes or 0 for h in ds.holders)
            gpu.share_total_bytes = (gpu.share_total_bytes or 0) + total
            gpu.share_free_bytes = (gpu.share_free_bytes or 0) + (max(0, total - used) if ds.state != TAINTED else 0)
    gpu.slots_free += _first_fit([ds for d, ds in members if ds.kind == KIND_SLOT
                                  and not d.get("allowMultipleAllocations")], need, left)
    profiles: dict[str, list[DeviceState]] = {}
    for d, ds in members:
        if ds.kind == KIND_MIG and d.get("allowMultipleAllocations"):
            # One profile as capacity: its counters were charged by its first share, so while it is held only
            # its instances capacity bounds the next share.
            total = _quantity(((d.get("capacity") or {}).get("instances") or {}).get("value"))
            free = max(0, total - sum(h.instances or 0 for h in ds.holders)) if ds.state in (HELD, FREE) else 0
            if free:
                gpu.mig_free[ds.detail] = free
        elif ds.kind == KIND_MIG:
            profiles.setdefault(ds.detail, []).append(ds)
    for profile, group in profiles.items():
        placeable = _first_fit(group, need, left)
        if placeable:
            gpu.mig_free[profile] = placeable
    if profiles:
        gpu.memory_slices, gpu.legend = _slice_row(gpu, [ds for _, ds in members], need)


def _first_fit(group: Sequence[DeviceState], need: Mapping[str, Counters], left: Counters) -> int:
    """How many devices of ``group`` first-fit allocation in published order would still give out, one after
    another (each one taken uses up its counters for the next)."""
    scratch = {cs: dict(v) for cs, v in left.items() if any(cs in need[ds.name] for ds in group)}
    n = 0
    for ds in group:
        if ds.state == FREE and _fits(need[ds.name], scratch):
            _take(need[ds.name], scratch)
            n += 1
    return n


# --------------------------------------------------------------------------------------------------- MIG row

def _covered(need: Counters, ds: DeviceState, product: str, width: int) -> list[int]:
    """The memory slices a device covers: from its counters (dynamic partitions, whole GPU and slots), else
    from the placement rule with the catalog's profile (static partitions)."""
    slices = sorted(int(k[len(MEMORY_SLICE):]) for counters in need.values() for k in counters
                    if k.startswith(MEMORY_SLICE) and k[len(MEMORY_SLICE):].isdigit())
    if slices:
        return slices
    if ds.kind in (KIND_GPU, KIND_SLOT):
        return list(range(width))
    if ds.kind != KIND_MIG:
        return []
    name = _parsed(ds.name)
    model = model_for_product_name(product)
    profile = model.profile_by_id(name.profile_id) if model is not None and name.profile_id is not None else None
    if profile is None or name.start is None:
        return [name.start] if name.start is not None and name.start < width else []
    return [k for k in interval(profile, name.start) if k < width]


def _width(gpu: GpuStatus, members: Sequence[DeviceState], need: Mapping[str, Counters]) -> int:
    """Memory slices of the GPU: its counters' memory slices, else the catalog's MIG geometry."""
    counted = {k for ds in members for counters in need[ds.name].values() for k in counters
               if k.startswith(MEMORY_SLICE)}
    if len(counted) > 1:
        return len(counted)
    model = model_for_product_name(gpu.product)
    if model is not None and model.mig_memory_slices:
        return model.mig_memory_slices
    starts = [_parsed(ds.name).start or 0 for ds in members if ds.kind == KIND_MIG]
    return max(starts, default=0) + 1


def _slice_row(gpu: GpuStatus, members: Sequence[DeviceState],
               need: Mapping[str, Counters]) -> tuple[str, list[tuple[str, str]]]:
    width = _width(gpu, members, need)
    cells: list[list[str]] = [[] for _ in range(width)]
    legend: list[tuple[str, str]] = []
    for ds in members:
        if ds.state != HELD:
            continue
        letter = LETTERS[len(legend) % len(LETTERS)]
        what = f"{ds.name} ({ds.detail})" if ds.detail else ds.name
        legend.append((letter, f"{what}: " + "; ".join(h.describe() for h in ds.holders)))
        for k in _covered(need[ds.name], ds, gpu.product, width):
            if 0 <= k < width:
                cells[k].append(letter)
    return draw_slices(cells), legend


def draw_slices(cells: Sequence[Sequence[str]]) -> str:
    """``[AAAA|BB|..|C]`` from the occupants of each memory slice: a letter where one device covers it, ``+``
    where several do, ``.`` where none does; a ``|`` wherever the occupant changes."""
    chars = ["." if not c else c[0] if len(c) == 1 else "+" for c in cells]
    groups: list[str] = []
    for i, ch in enumerate(chars):
        if i and ch == chars[i - 1] and list(cells[i]) == list(cells[i - 1]):
            groups[-1] += ch
        else:
            groups.append(ch)
    return "[" + "|".join(groups) + "]"


# --------------------------------------------------------------------------------------------------- the fleet

def fleet_status(slices: Iterable[Mapping[str, Any]], claims: Iterable[Mapping[str, Any]],
                 pods: Iterable[Mapping[str, Any]], driver: str, node: str | None = None) -> list[NodeStatus]:
    """Every pool of ``driver`` (or only ``node``'s), by node name."""
    holders = allocations(claims, pods, driver)
    out = []
    for pool, items in current_pools(slices, driver).items():
        node_name = str((items[0].get("spec") or {}).get("nodeName") or pool)
        if node is not None and node_name != node:
            continue
        out.append(pool_status(node_name, items, holders, pool))
    return sorted(out, key=lambda n: n.name)


def fleet_summary(nodes: Sequence[NodeStatus]) -> dict[str, Any]:
    """Totals over the fleet: GPUs, whole GPUs free, GPUs with a blocking taint, MIG instances placeable."""
    gpus = [g for n in nodes for g in n.gpus]
    mig: dict[str, int] = {}
    for g in gpus:
        for profile, k in g.mig_free.items():
            mig[profile] = mig.get(profile, 0) + k
    return {"nodes": len(nodes), "gpus": len(gpus), "whole_gpus_free": sum(1 for g in gpus if g.whole_free),
            "unhealthy_gpus": sum(1 for g in gpus if not g.healthy),
            "slots_free": sum(g.slots_free for g in gpus), "slots_total": sum(g.slots_total for g in gpus),
            "mig_placeable": dict(sorted(mig.items()))}
