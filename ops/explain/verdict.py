"""Why a claim is (not) allocatable, node by node, decided the way kube-scheduler's allocator decides it.

For each node and each request alternative: which devices the DeviceClass and request selectors match (CEL),
and of those which are taken (by which claim and pod), blocked by shared counters, tainted, or short of
consumable capacity. Then a depth-first search over the requests in order — firstAvailable subrequests in
their order, devices in slice order, matchAttribute/distinctAttribute constraints, counters and capacity
shared between the chosen devices — finds an allocation or shows there is none. The verdict comes first, in
one sentence; the details follow.

Everything here is plain dicts in and records out, with no API access: ``ops.explain.reads`` reads the cluster.
"""
from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Any

from api.config import ConfigError, decode_opaque_config
from api.quantity import quantity_value
from dra.model.tenancy import tenancy_namespace, tenancy_reason
from dra.scheduling.claimrequests import ALL, Alternative, ClaimSpec, Constraint, read_claim_spec
from dra.scheduling.clusterview import ClusterView
from dra.scheduling.devicecel import (
    CelRuntimeError,
    CelUnsupported,
    SelectorResults,
    attribute_value,
    compile_selector,
    device_variable,
    split_qualified,
)
from dra.scheduling.devicefit import capacity_needs, format_amount, taint_text, untolerated
from dra.scheduling.poolview import (
    CounterKey,
    DeviceKey,
    Holder,
    Pool,
    PoolDevice,
    allocated_node,
    allocation_results,
)

# Bounds on the search per node (devices tried, seconds); past them the node is reported as undecided, with
# the request the search was at, not guessed.
SEARCH_LIMIT = 200_000
SEARCH_SECONDS = 1.0
# resource.k8s.io's AllocationResultsMaxSize: the most devices one claim can be allocated.
CLAIM_DEVICE_LIMIT = 32
# The verdict's first line stays short; every detail is in the lines below it.
FIRST_LINE_MAX = 200
FREE, TAKEN, COUNTERS, TAINTED, CAPACITY, CEL_ERROR = "free", "taken", "counters", "tainted", "capacity", "cel error"
_STATE_WORDS = {FREE: "free", TAKEN: "taken", COUNTERS: "blocked by shared counters", TAINTED: "tainted",
                CAPACITY: "without the capacity", CEL_ERROR: "failing the selectors with a CEL runtime error"}
ALLOCATABLE, NOT_ALLOCATABLE, CANNOT_EVALUATE, ALLOCATED = "allocatable", "not allocatable", "cannot evaluate", "allocated"


@dataclass
class Target:
    """A claim to explain: its id (namespace/name, or a template's "as generated" name) and its dict."""

    name: str
    claim: dict[str, Any]


@dataclass
class AlternativeReport:
    request: str
    wants: str
    matching: int = 0
    class_matching: int = 0
    states: dict[str, int] = field(default_factory=dict)
    free: list[str] = field(default_factory=list)
    why_not: list[str] = field(default_factory=list)     # one line per kind of unusable device
    capacity_left: list[str] = field(default_factory=list)  # consumable capacity of shared devices
    # MPS tenancy (dra.model.tenancy): namespace -> the GPUs whose matching devices are kept for its daemon
    tenancy: dict[str, list[str]] = field(default_factory=dict)
    profiles: list[str] = field(default_factory=list)     # MIG profiles among the class's devices, in order
    error: str = ""


@dataclass
class NodeReport:
    node: str
    verdict: str
    reason: str = ""
    chosen: dict[str, list[str]] = field(default_factory=dict)    # "claim: request" -> devices
    requests: list[AlternativeReport] = field(default_factory=list)
    gpus: list[str] = field(default_factory=list)                 # one line per counter set (GPU)


@dataclass
class Explanation:
    verdict: str
    sentence: str
    claims: list[str]
    nodes: list[NodeReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Opaque configs of this driver the node plugin (and the webhook) refuses: the scheduler allocates the claim
    # all the same, and preparing it then fails.
    config_problems: list[str] = field(default_factory=list)

    @property
    def allocatable(self) -> bool:
        return self.verdict in (ALLOCATABLE, ALLOCATED)

    def allocatable_nodes(self) -> list[str]:
        return [n.node for n in self.nodes if n.verdict in (ALLOCATABLE, ALLOCATED)]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "allocatable": self.allocatable}


class _SearchLimit(Exception):
    """The search ran past its bounds; the message says at which request, so what is left undecided."""


class _CelAbort(Exception):
    """The scheduler's allocator reached a device whose selector fails to evaluate: it gives up on the node."""


@dataclass
class _Candidate:
    dev: PoolDevice
    state: str
    why: str
    needs: dict[str, Fraction]
    tenant: str = ""          # the namespace whose MPS daemon the device's tenancy taint names


class _Context:
    """One explanation's reading of the cluster view: selector results and counters left, cached."""

    def __init__(self, view: ClusterView, results: SelectorResults | None = None) -> None:
        self.view, self.classes, self.usage = view, view.classes, view.usage
        self.results = results if results is not None else SelectorResults()
        self._vars: dict[DeviceKey, dict[str, Any]] = {}
        self._free: dict[tuple[str, str, str, str], Fraction] = {}

    def matches(self, expression: str, dev: PoolDevice) -> bool:
        return self.results.matches(expression, dev.key[0], dev.raw, lambda: self._variable(dev))

    def _variable(self, dev: PoolDevice) -> dict[str, Any]:
        var = self._vars.get(dev.key)
        if var is None:
            var = self._vars[dev.key] = device_variable(dev.key[0], dev.raw)
        return var

    def class_selectors(self, name: str) -> list[str]:
        cls = self.classes.get(name)
        if cls is None:
            raise LookupError(f"DeviceClass {name} does not exist")
        return [str((s.get("cel") or {}).get("expression", "")) for s in (cls.get("spec") or {}).get("selectors") or []]

    def pools_for(self, node: str) -> list[Pool]:
        return self.view.pools_for(node)

    def counter_free(self, pool: Pool, cs: str, counter: str) -> Fraction:
        """What the existing allocations leave of a counter (fixed for the explanation: computed once)."""
        key = (pool.driver, pool.name, cs, counter)
        free = self._free.get(key)
        if free is None:
            free = self._free[key] = pool.counters.get(cs, {}).get(counter, Fraction(0)) - \
                self.view.counters_taken(pool).get(cs, {}).get(counter, Fraction(0))
        return free

    def counter_holders(self, pool: Pool, cs: str) -> list[tuple[str, Holder]]:
        return self.view.counter_holders(pool).get(cs, [])

    def capacity_taken(self, key: DeviceKey) -> dict[str, Fraction]:
        return self.view.capacity_taken(key)


# ------------------------------------------------------------------------------------ per-device states

def _classify(ctx: _Context, pool: Pool, dev: PoolDevice, alt: Alternative) -> _Candidate:
    taints = untolerated(dev.taints, alt.tolerations)
    if taints:
        tenants = [ns for ns in (tenancy_namespace(t, dev.key[0]) for t in taints) if ns is not None]
        why = f"tainted {', '.join(taint_text(t) for t in taints)}, not tolerated"
        if tenants:
            why += f" ({tenancy_reason(tenants[0])})"
        return _Candidate(dev, TAINTED, why, {}, tenants[0] if tenants else "")
    needs, why = capacity_needs(dev.raw, dev.key[0], alt.capacity)
    if why:
        return _Candidate(dev, CAPACITY, why, {})
    holders = ctx.usage.exclusive(dev.key)
    if alt.admin_access:
        # Admin access ignores who holds the device, but not the shared counters: the scheduler checks them for
        # every device it allocates (a slot of a GPU held whole stays unavailable).
        needs = {}
    elif holders and not dev.multi:
        return _Candidate(dev, TAKEN, "held by " + ", ".join(h.describe() for h in holders), needs)
    elif dev.multi:
        total = dev.raw.get("capacity") or {}
        for n, amount in needs.items():
            left = _capacity_total(total, n) - ctx.capacity_taken(dev.key).get(n, Fraction(0))
            if amount > left:
                return _Candidate(dev, CAPACITY, f"short of {n}: {format_amount(left)} left, {format_amount(amount)} "
                                  f"needed (shared by {', '.join(h.describe() for h in holders)})", needs)
        if holders:
            # A multi-allocatable device's counters were charged once, by its first share; further shares skip
            # the counter check (the scheduler's skipCounterCheck).
            return _Candidate(dev, FREE, "", needs)
    for cs, counters in dev.consumes().items():
        for n, v in counters.items():
            if v > ctx.counter_free(pool, cs, n):
                held = ctx.counter_holders(pool, cs)
                who = ", ".join(sorted({f"{d} held by {h.describe()}" for d, h in held})) or "nothing allocated"
                return _Candidate(dev, COUNTERS, f"unavailable: counter set {cs} is used up by {who}", needs)
    return _Candidate(dev, FREE, "", needs)


def _capacity_left(ctx: _Context, dev: PoolDevice) -> list[tuple[str, Fraction, Fraction]]:
    caps = dev.raw.get("capacity") or {}
    taken = ctx.capacity_taken(dev.key)
    return [(n, _capacity_total(caps, n) - taken.get(n, Fraction(0)), _capacity_total(caps, n)) for n in caps]


def _capacity_total(caps: dict[str, Any], name: str) -> Fraction:
    return _quantity(str((caps.get(name) or {}).get("value", "0")))


@lru_cache(maxsize=4096)
def _quantity(text: str) -> Fraction:
    """A capacity's value; the few distinct values of a fleet are parsed once."""
    return quantity_value(text)


def _size(caps: dict[str, Any], name: str) -> float:
    """A capacity as a number to sort by (exact Fractions compare slowly, and sizes of devices are far apart)."""
    return _float_quantity(str((caps.get(name) or {}).get("value", "0")))


@lru_cache(maxsize=4096)
def _float_quantity(text: str) -> float:
    return float(quantity_value(text))


def _candidates(ctx: _Context, node: str, alt: Alternative, report: AlternativeReport,
                claim: str = "") -> list[tuple[Pool, _Candidate]]:
    """The devices of the node matching the alternative's class and selectors, each with its state."""
    class_exprs = ctx.class_selectors(alt.device_class)
    out = []
    for pool in ctx.pools_for(node):
        for dev in pool.devices:
            try:
                if not _selected(ctx, dev, class_exprs, f"class {alt.device_class}"):
                    continue
                report.class_matching += 1
                profile = (dev.raw.get("attributes") or {}).get("profile")
                if profile and str(attribute_value(profile)) not in report.profiles:
                    report.profiles.append(str(attribute_value(profile)))
                if not _selected(ctx, dev, alt.selectors, f"claim {claim.split(' ')[0]}"):
                    continue
                error = ""
            except CelRuntimeError as exc:
                error = str(exc)
            cand = _classify(ctx, pool, dev, alt)
            if error:
                # Looking for devices one by one, the allocator skips those in use before it evaluates selectors
                # (taints and counters come after); for allocationMode All it evaluates every device first. Any
                # other device it reaches with a failing selector makes it give up on the node.
                if alt.mode != ALL and cand.state == TAKEN and not alt.admin_access:
                    continue
                cand = _Candidate(dev, CEL_ERROR, error, {})
            out.append((pool, cand))
    report.matching = len(out)
    for _, c in out:
        if c.dev.multi:
            report.capacity_left += [f"{c.dev.name}: {n} {format_amount(left)} of {format_amount(total)} left"
                                     for n, left, total in _capacity_left(ctx, c.dev)]
    report.states = dict(Counter(c.state for _, c in out))
    for _, c in out:
        if c.tenant:
            gpus = report.tenancy.setdefault(c.tenant, [])
            if _gpu_of(c.dev) not in gpus:
                gpus.append(_gpu_of(c.dev))
    report.free = [c.dev.name for _, c in out if c.state == FREE]
    by_why: dict[str, list[str]] = defaultdict(list)
    for _, c in out:
        if c.state != FREE:
            by_why[c.why].append(c.dev.name)
    failing = {c.why for _, c in out if c.state == CEL_ERROR}
    report.why_not = [f"{_names(devs)} {'is' if len(devs) == 1 else 'are'} {why}" if why not in failing else
                      f"{_names(devs)} cannot be evaluated: {why}" for why, devs in by_why.items()]
    return out


def _selected(ctx: _Context, dev: PoolDevice, expressions: Sequence[str], whose: str) -> bool:
    """Whether every expression matches the device; a failing one raises CelRuntimeError worded as the
    scheduler words it ("<whose>: selector #i on device <driver/pool/device>: CEL runtime error: ...")."""
    for i, e in enumerate(expressions):
        try:
            if not ctx.matches(e, dev):
                return False
        except CelRuntimeError as exc:
            raise CelRuntimeError(f"{whose}: selector #{i} on device {'/'.join(dev.key)}: CEL runtime error: "
                                  f"{cel_error_text(str(exc))}") from exc
    return True


def cel_error_text(text: str) -> str:
    """The CEL runtime's message in the words of the Go runtime kube-scheduler uses (cel-go and the Kubernetes
    CEL library), with the hint Kubernetes adds to a missing key."""
    m = re.match(r'NOT_FOUND: Key not found in map\s*:\s*"?(.*?)"?$', text)
    if m:
        return (f"no such key: {m.group(1)}. consider using CEL optional chaining (.? followed by orValue()) "
                "or guarding the check with has() for optional fields")
    if text.startswith("UNKNOWN: No matching overloads found"):
        return "no such overload" + text.removeprefix("UNKNOWN: No matching overloads found").replace(" : ", ": ")
    return re.sub(r"^[A-Z_]+: ", "", text)


def _gpu_of(dev: PoolDevice) -> str:
    """The GPU a device is part of: its parentUUID attribute (slots, shares, MIG devices), else its own name."""
    attrs = dev.raw.get("attributes") or {}
    parent = attrs.get("parentUUID") or attrs.get(f"{dev.key[0]}/parentUUID") or {}
    return str(parent.get("string") or dev.name)


def _names(devs: list[str]) -> str:
    return ", ".join(devs) if len(devs) <= 3 else f"{devs[0]}, {devs[1]} and {len(devs) - 2} more"


# ------------------------------------------------------------------------------------------ the search

@dataclass
class _Slot:
    claim: str
    request: str
    constraints: list[Constraint]
    alternatives: list[tuple[Alternative, list[tuple[Pool, _Candidate]]]]


class _Search:
    def __init__(self, ctx: _Context, slots: list[_Slot], use_constraints: bool = True) -> None:
        self.ctx, self.slots, self.use_constraints = ctx, slots, use_constraints
        self.steps = 0
        self.chosen: set[DeviceKey] = set()
        self.admin_chosen: set[tuple[str, DeviceKey]] = set()     # (claim, device) picked with admin access
        self.deadline = time.monotonic() + SEARCH_SECONDS
        self.per_claim: Counter[str] = Counter()                   # devices picked so far per claim
        self.counters: dict[CounterKey, dict[str, Fraction]] = defaultdict(lambda: defaultdict(Fraction))
        self.capacity: dict[DeviceKey, dict[str, Fraction]] = defaultdict(lambda: defaultdict(Fraction))
        self.values: dict[tuple[str, int], list[Any]] = defaultdict(list)    # (claim, constraint#) -> values
        self.result: dict[str, list[str]] = {}

    def run(self) -> dict[str, list[str]] | None:
        return dict(self.result) if self._slot(0) else None

    def _slot(self, i: int) -> bool:
        if i == len(self.slots):
            return True
        slot = self.slots[i]
        for alt, cands in slot.alternatives:
            usable = [(p, c) for p, c in cands if c.state in (FREE, CEL_ERROR)]
            if alt.mode == ALL:
                if not cands or len(usable) != len(cands):
                    continue
                if self._take_all(slot, alt, usable, i):
                    return True
            elif self._choose(slot, alt, usable, 0, alt.count, [], i):
                return True
        return False

    def _take_all(self, slot: _Slot, alt: Alternative, usable: list[tuple[Pool, _Candidate]], i: int) -> bool:
        undo: list[tuple[Any, ...]] = []
        for pool, c in usable:
            if not self._fits(slot, alt, pool, c):
                for u in reversed(undo):
                    self._release(*u)
                return False
            undo.append(self._apply(slot, alt, pool, c))
        self.result[f"{slot.claim}: {alt.request}"] = [c.dev.name for _, c in usable]
        if self._slot(i + 1):
            return True
        for u in reversed(undo):
            self._release(*u)
        del self.result[f"{slot.claim}: {alt.request}"]
        return False

    def _choose(self, slot: _Slot, alt: Alternative, usable: list[tuple[Pool, _Candidate]], start: int,
                left: int, picked: list[str], i: int) -> bool:
        if left == 0:
            self.result[f"{slot.claim}: {alt.request}"] = list(picked)
            if self._slot(i + 1):
                return True
            del self.result[f"{slot.claim}: {alt.request}"]
            return False
        if self._short_of_values(slot, alt, usable, start, left):
            return False
        # With a device whose selector fails among them, every device is tried as the scheduler tries them
        # (it gives up on the node when it reaches that device), else only where enough are left after it.
        end = len(usable) if any(c.state == CEL_ERROR for _, c in usable[start:]) else len(usable) - left + 1
        for j in range(start, end):
            self.steps += 1
            if self.steps > SEARCH_LIMIT or (self.steps % 512 == 0 and time.monotonic() > self.deadline):
                bound = f"{SEARCH_LIMIT} steps" if self.steps > SEARCH_LIMIT else f"{SEARCH_SECONDS:g}s"
                raise _SearchLimit(f"search stopped after {bound} at {slot.claim}: request {alt.request}")
            pool, c = usable[j]
            if c.state == CEL_ERROR:
                if c.dev.key in self.chosen and not alt.admin_access:
                    continue        # picked by an earlier request: in use, skipped before its selectors
                raise _CelAbort(c.why)
            if self.per_claim[slot.claim] >= CLAIM_DEVICE_LIMIT:
                return False        # the claim limit (the allocator checks it before each device)
            if not self._fits(slot, alt, pool, c):
                continue
            undo = self._apply(slot, alt, pool, c)
            picked.append(c.dev.name)
            if self._choose(slot, alt, usable, j + 1, left - 1, picked, i):
                return True
            picked.pop()
            self._release(*undo)
        return False

    def _short_of_values(self, slot: _Slot, alt: Alternative, usable: list[tuple[Pool, _Candidate]], start: int,
                         left: int) -> bool:
        """Whether the devices from `start` on cannot give `left` more devices under the claim's constraints:
        too few distinct values left for a distinctAttribute, too few of the matched value for a
        matchAttribute. Prunes what would otherwise be a search over every combination."""
        if not self.use_constraints or left <= 1:
            return False
        for ci, con in enumerate(slot.constraints):
            if not con.applies_to(alt.request):
                continue
            seen = self.values[(slot.claim, ci)]
            rest = [_attribute(c.dev, con.match_attribute or con.distinct_attribute or "") for _, c in usable[start:]
                    if c.state == FREE]
            if con.distinct_attribute:
                fresh = {_hashable(v) for v in rest if v is not _MISSING} - {_hashable(v) for v in seen}
                if len(fresh) < left:
                    return True
            elif seen:
                if sum(1 for v in rest if v == seen[0]) < left:
                    return True
            elif max(Counter(_hashable(v) for v in rest if v is not _MISSING).values(), default=0) < left:
                return True
        return False

    def _fits(self, slot: _Slot, alt: Alternative, pool: Pool, c: _Candidate) -> bool:
        dev = c.dev
        if alt.admin_access and not dev.multi and (slot.claim, dev.key) in self.admin_chosen:
            return False
        if not alt.admin_access and dev.key in self.chosen and not dev.multi:
            return False
        for cs, counters in self._to_charge(dev).items():
            mine = self.counters.get((pool.driver, pool.name, cs), {})
            if any(v + mine.get(n, 0) > self.ctx.counter_free(pool, cs, n) for n, v in counters.items()):
                return False
        if not alt.admin_access:
            if dev.multi:
                caps = dev.raw.get("capacity") or {}
                taken = self.ctx.capacity_taken(dev.key)
                for n, v in c.needs.items():
                    if v + self.capacity[dev.key][n] + taken.get(n, 0) > _capacity_total(caps, n):
                        return False
        if self.use_constraints:
            for ci, con in enumerate(slot.constraints):
                if not con.applies_to(alt.request):
                    continue
                value = _attribute(dev, con.match_attribute or con.distinct_attribute or "")
                if value is _MISSING:
                    return False
                seen = self.values[(slot.claim, ci)]
                if con.match_attribute and seen and seen[0] != value:
                    return False
                if con.distinct_attribute and value in seen:
                    return False
        return True

    def _to_charge(self, dev: PoolDevice) -> dict[str, dict[str, Fraction]]:
        """The counters allocating ``dev`` once more takes: none for a multi-allocatable device that already has
        a share out (allocated before, or chosen in this search), since its counters are charged once."""
        if dev.multi and (self.ctx.usage.exclusive(dev.key) or dev.key in self.chosen):
            return {}
        return dev.consumes()

    def _apply(self, slot: _Slot, alt: Alternative, pool: Pool, c: _Candidate) -> tuple[Any, ...]:
        dev = c.dev
        added = dev.key not in self.chosen
        self.per_claim[slot.claim] += 1
        charged = self._to_charge(dev)
        for cs, counters in charged.items():
            for n, v in counters.items():
                self.counters[(pool.driver, pool.name, cs)][n] += v
        if alt.admin_access:
            added = (slot.claim, dev.key) not in self.admin_chosen
            self.admin_chosen.add((slot.claim, dev.key))
        else:
            self.chosen.add(dev.key)
            for n, v in c.needs.items():
                self.capacity[dev.key][n] += v
        pushed = []
        if self.use_constraints:
            for ci, con in enumerate(slot.constraints):
                if con.applies_to(alt.request):
                    self.values[(slot.claim, ci)].append(_attribute(dev, con.match_attribute or con.distinct_attribute or ""))
                    pushed.append(ci)
        return (slot, alt, pool, c, added, pushed, charged)

    def _release(self, slot: _Slot, alt: Alternative, pool: Pool, c: _Candidate, added: bool,
                 pushed: list[int], charged: dict[str, dict[str, Fraction]]) -> None:
        dev = c.dev
        self.per_claim[slot.claim] -= 1
        for cs, counters in charged.items():
            for n, v in counters.items():
                self.counters[(pool.driver, pool.name, cs)][n] -= v
        if alt.admin_access:
            if added:
                self.admin_chosen.discard((slot.claim, dev.key))
        else:
            if added:
                self.chosen.discard(dev.key)
            for n, v in c.needs.items():
                self.capacity[dev.key][n] -= v
        for ci in pushed:
            self.values[(slot.claim, ci)].pop()


_MISSING = object()


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _attribute(dev: PoolDevice, qualified: str) -> Any:
    attrs = dev.raw.get("attributes") or {}
    raw = attrs.get(qualified)
    if raw is None:
        domain, ident = split_qualified(qualified, dev.key[0])
        raw = attrs.get(ident) if domain == dev.key[0] else None
    if raw is None:
        return _MISSING
    value = attribute_value(raw)
    return value.SerializeToString() if hasattr(value, "SerializeToString") else value


# ------------------------------------------------------------------------------------------- per node

def _request_reason(slot: _Slot, reports: list[AlternativeReport]) -> str | None:
    """Why a request alone cannot be met on the node, or None if some alternative could be alone."""
    parts = []
    for (alt, cands), rep in zip(slot.alternatives, reports):
        free = rep.states.get(FREE, 0)
        if alt.mode == ALL:
            if cands and free == len(cands):
                return None
        elif free >= alt.count:
            return None
        if not cands:
            why = (f"no device of class {alt.device_class} on the node" if not rep.class_matching else
                   f"none of the {rep.class_matching} devices of class {alt.device_class} matches the selectors")
            if rep.profiles:
                why += f" (MIG profiles there: {', '.join(rep.profiles)})"
        elif alt.mode == ALL:
            why = f"all {len(cands)} matching devices are needed, {len(cands) - free} cannot be allocated: " + \
                "; ".join(rep.why_not)
        elif len(cands) < alt.count:
            why = f"needs {alt.count} devices, only {len(cands)} match"
        else:
            why = f"needs {alt.count}, {free} of {len(cands)} matching usable: " + "; ".join(rep.why_not)
        parts.append(why if len(slot.alternatives) == 1 else f"{alt.request}: {why}")
    prefix = f"{slot.claim}: request {slot.request}"
    return f"{prefix}: " + (parts[0] if len(parts) == 1 else "no alternative fits (" + "; ".join(parts) + ")")


def _gpu_lines(ctx: _Context, node: str) -> list[str]:
    """Per counter set (one per GPU here): who holds it and the largest MIG profile still placeable."""
    lines = []
    for pool in ctx.pools_for(node):
        untouched = not ctx.view.counters_taken(pool)
        profiled: dict[str, list[PoolDevice]] = defaultdict(list)      # MIG devices by the counter sets they use
        for dev in pool.devices:
            if (dev.raw.get("attributes") or {}).get("profile"):
                for entry in dev.raw.get("consumesCounters") or ():
                    profiled[str(entry.get("counterSet", ""))].append(dev)
        for cs in pool.counters:
            held = ctx.counter_holders(pool, cs)
            text = f"{cs}: " + (", ".join(sorted({f"{d} held by {h.describe()}" for d, h in held}))
                                if held else "nothing allocated")
            if profiled.get(cs):
                # The largest placeable is the first, by memory (largest first, published order among equals),
                # that is free and fits what the counters have left.
                best = next((d for d in sorted(profiled[cs], key=lambda d: _size(
                    d.raw.get("capacity") or {}, "memory"), reverse=True) if not ctx.usage.exclusive(d.key) and
                             _fits_left(ctx, pool, d, untouched)), None)
                placeable = str(attribute_value(best.raw["attributes"]["profile"])) if best else "none"
                text += f"; largest MIG profile still placeable: {placeable}"
            lines.append(text)
    return lines


# Whether a device's counters fit what its pool has when nothing of the pool is allocated: the same for every pool
# of a fleet that publishes alike (the parsed counters are shared objects, dra.scheduling.poolview), so answered
# once. Each entry keeps the objects whose identities make its key.
_FITS_EMPTY: dict[tuple[int, ...], tuple[Any, tuple[Any, ...], bool]] = {}


def _fits_left(ctx: _Context, pool: Pool, dev: PoolDevice, untouched: bool) -> bool:
    """Whether what the device consumes fits what its counter sets have left."""
    consumes = dev.consumes()
    if untouched:
        sets = tuple(pool.counters.get(cs) for cs in consumes)
        key = (id(consumes), *map(id, sets))
        kept = _FITS_EMPTY.get(key)
        if kept is not None and kept[0] is consumes and all(a is b for a, b in zip(kept[1], sets)):
            return kept[2]
    fits = not any(v > ctx.counter_free(pool, s, n) for s, cnt in consumes.items() for n, v in cnt.items())
    if untouched:
        if len(_FITS_EMPTY) >= 50_000:
            _FITS_EMPTY.clear()
        _FITS_EMPTY[key] = (consumes, sets, fits)
    return fits


def _explain_node(ctx: _Context, node: str, targets: list[tuple[str, ClaimSpec]]) -> NodeReport:
    report = NodeReport(node, NOT_ALLOCATABLE)
    slots = []
    reasons = []
    # The allocator's order: per claim, per request, the class and (for allocationMode All) every device's
    # selectors, then the claim's device count so far against the claim limit; then the search.
    for name, spec in targets:
        counted = 0
        for req in spec.requests:
            alts, reps = [], []
            for alt in req.alternatives:
                rep = AlternativeReport(alt.request if len(targets) == 1 else f"{name}: {alt.request}", alt.describe())
                try:
                    cands = _candidates(ctx, node, alt, rep, name)
                except LookupError as exc:
                    rep.error, cands = str(exc), []
                report.requests.append(rep)
                failing = [c for _, c in cands if c.state == CEL_ERROR]
                if alt.mode == ALL and failing:
                    report.gpus = _gpu_lines(ctx, node)
                    report.reason = f"{name}: request {alt.request}: {failing[0].why}"
                    return report
                alts.append((alt, cands))
                reps.append(rep)
            least = min((len(cands) if alt.mode == ALL else alt.count for alt, cands in alts), default=0)
            if least > CLAIM_DEVICE_LIMIT - counted:
                report.gpus = _gpu_lines(ctx, node)
                report.reason = (f"{name}: request {req.name}: adding {least} devices exceeds the claim limit of "
                                 f"{CLAIM_DEVICE_LIMIT}, with {counted} already accounted for")
                return report
            counted += least
            slot = _Slot(name, req.name, spec.constraints, alts)
            slots.append(slot)
            why = _request_reason(slot, reps)
            errors = [r.error for r in reps if r.error]
            if why:
                reasons.append(f"{name}: request {req.name}: {errors[0]}" if len(errors) == len(reps) else why)
    report.gpus = _gpu_lines(ctx, node)
    failing_somewhere = any(c.state == CEL_ERROR for s in slots for _, cands in s.alternatives for _, c in cands)
    if reasons and not failing_somewhere:
        report.reason = reasons[0]
        return report
    try:
        chosen = _Search(ctx, slots).run()
        if chosen is not None:
            report.verdict, report.chosen = ALLOCATABLE, chosen
            return report
        if reasons:
            report.reason = reasons[0]
        elif any(s.constraints for s in slots) and _Search(ctx, slots, use_constraints=False).run() is not None:
            report.reason = _constraint_reason(slots)
        else:
            report.reason = "the requests together need more than the free devices, counters or capacity allow"
    except _CelAbort as exc:
        report.reason = str(exc)
    except _SearchLimit as exc:
        report.verdict = CANNOT_EVALUATE
        report.reason = f"{exc}: cannot decide whether the requests can be met together"
    return report


def _constraint_reason(slots: list[_Slot]) -> str:
    """Why the constraints cannot be met: a request needing more distinct values than its free devices have,
    or, failing that, the constraints named."""
    for slot in slots:
        for ci, con in enumerate(slot.constraints):
            if not con.distinct_attribute:
                continue
            for alt, cands in slot.alternatives:
                if con.applies_to(alt.request) and alt.mode != ALL:
                    values = {_hashable(v) for v in (_attribute(c.dev, con.distinct_attribute) for _, c in cands
                                                     if c.state == FREE) if v is not _MISSING}
                    if alt.count > len(values):
                        return (f"{slot.claim}: request {alt.request} needs {alt.count} devices with distinct "
                                f"{con.distinct_attribute}; the free matching devices have {len(values)} distinct "
                                "values")
    cons = sorted({c.match_attribute or c.distinct_attribute or "" for s in slots for c in s.constraints})
    return f"the free devices cannot meet the constraint on {', '.join(cons)}"


# ------------------------------------------------------------------------------------------ the whole

def explain(targets: Sequence[Target], classes: Sequence[dict[str, Any]], slices: Sequence[dict[str, Any]],
            claims: Sequence[dict[str, Any]], taint_rules: Sequence[dict[str, Any]] = (),
            nodes: Sequence[str] | None = None, results: SelectorResults | None = None) -> Explanation:
    """Explains the targets (the claims of one pod are allocated together, on one node) against the cluster
    state: the DeviceClasses, ResourceSlices, every ResourceClaim (their allocations) and DeviceTaintRules.
    ``results``: selector results kept from earlier explanations (a long-lived caller's)."""
    return explain_view(targets, ClusterView.of(classes, slices, claims, taint_rules, nodes), results)


def explain_view(targets: Sequence[Target], view: ClusterView, results: SelectorResults | None = None) -> Explanation:
    """``explain`` against a cluster view (dra.scheduling.clusterview), every node it knows."""
    with view.reading():
        ex = Explainer(targets, view, results)
        if ex.early is not None:
            return ex.early
        return ex.finish({n: ex.node(n) for n in ex.node_names()})


class Explainer:
    """One explanation in steps, for callers that see the nodes one at a time (a reader of pages) or keep node
    reports between explanations: ``early`` (a verdict that needs no node), ``node_names``, ``node`` per node
    and ``finish``. The view is read at each step; the caller holds it still (``view.reading()``)."""

    def __init__(self, targets: Sequence[Target], view: ClusterView, results: SelectorResults | None = None) -> None:
        self.targets, self.view = list(targets), view
        self.names = [t.name for t in targets]
        self.ctx = _Context(view, results)
        self.notes: list[str] = []
        self.done = [t for t in targets if allocation_results(t.claim)]
        self.pending = [t for t in targets if not allocation_results(t.claim)]
        self.specs: list[tuple[str, ClaimSpec]] = []
        self.fixed = {allocated_node(t.claim) for t in self.done} - {None}
        self.early: Explanation | None = None
        if not self.pending:
            where = "; ".join(f"{t.name} on {allocated_node(t.claim) or 'any node'}: " +
                              ", ".join(r["device"] for r in allocation_results(t.claim)) for t in self.done)
            self.early = Explanation(ALLOCATED, f"already allocated: {where}", self.names, notes=self.pool_notes())
            return
        try:
            self.specs = [(t.name, read_claim_spec(t.claim.get("spec") or {})) for t in self.pending]
            for _, spec in self.specs:
                for req in spec.requests:
                    for alt in req.alternatives:
                        for e in alt.selectors:
                            compile_selector(e)
                        if alt.device_class in self.ctx.classes:
                            for e in self.ctx.class_selectors(alt.device_class):
                                compile_selector(e)
        except CelUnsupported as exc:
            self.early = Explanation(CANNOT_EVALUATE, f"cannot evaluate: {exc}", self.names, notes=self.pool_notes())

    def pool_notes(self) -> list[str]:
        pools = self.view.pools()
        return ([p.incomplete for p in pools if p.incomplete] +
                [f"pool {p.name} of {p.driver} is bound to nodes by a nodeSelector: not evaluated here"
                 for p in pools if not p.node and not p.all_nodes])

    def node_names(self) -> list[str]:
        """The nodes to evaluate: those with pools (and a Node object, when the Nodes are known), or every Node
        when a pool serves all nodes; only the node of the pod's allocated claims when it has some."""
        names = self.view.node_names()
        if self.view.nodes is not None:
            names = [n for n in names if n in self.view.nodes]
            if self.view.has_all_node_pools():
                names = sorted(self.view.nodes)
        if len(self.fixed) == 1:
            names = [n for n in names if n in self.fixed]
        return names

    def node(self, node: str) -> NodeReport:
        return _explain_node(self.ctx, node, self.specs)

    def finish(self, reports: dict[str, NodeReport], pool_notes: list[str] | None = None,
               missing_nodes: Sequence[str] | None = None) -> Explanation:
        """The explanation from the reports of ``node_names()`` (in their order). ``pool_notes`` and
        ``missing_nodes`` (nodes with pools but no Node object): as a reader that dropped evaluated pools saw
        them; from the view otherwise."""
        notes = list(pool_notes) if pool_notes is not None else self.pool_notes()
        if missing_nodes is None:
            missing_nodes = [n for n in self.view.node_names()
                             if self.view.nodes is not None and n not in self.view.nodes]
        if missing_nodes:
            notes.append(f"no Node object for {', '.join(missing_nodes)}: the scheduler cannot place pods there")
        if len(self.fixed) == 1:
            notes.append(f"already allocated claims of the pod tie it to node {next(iter(self.fixed))}")
        names = sorted(reports)
        ordered = [reports[n] for n in names]
        problems = [p for t in self.pending for p in config_problems(t.name, t.claim, _our_drivers(self.ctx))]
        verdict, sentence = _verdict(ordered, names)
        if problems and verdict == ALLOCATABLE:
            where = ", ".join(n for n in [r.node for r in ordered if r.verdict == ALLOCATABLE][:2])
            sentence = clip_line(f"allocatable on {where}, but the node plugin will not prepare it: {problems[0]}")
        return Explanation(verdict, sentence, self.names, ordered, notes + self.notes, problems)


def _our_drivers(ctx: _Context) -> set[str]:
    """The drivers of this project: those with this project's DeviceClasses (the class named after the driver and
    its mig. class), whose opaque configs the plugin decodes."""
    return {name for name in ctx.classes if f"mig.{name}" in ctx.classes}


def config_problems(name: str, claim: dict[str, Any], drivers: set[str]) -> list[str]:
    """The claim's opaque configs for one of `drivers` that do not decode, in the webhook's words (the same
    decoder, api.config), NVIDIA's config types accepted as in compatibility mode."""
    configs = ((claim.get("spec") or {}).get("devices") or {}).get("config") or []
    problems = []
    for i, entry in enumerate(configs if isinstance(configs, list) else []):
        opaque = entry.get("opaque") if isinstance(entry, dict) else None
        if not isinstance(opaque, dict) or opaque.get("driver") not in drivers:
            continue
        try:
            decode_opaque_config(opaque.get("parameters"), compat_nvidia=True)
        except ConfigError as exc:
            problems.append(f"{name}: " + str(exc.with_prefix(f"spec.devices.config[{i}].opaque.parameters")))
    return problems


def _verdict(reports: list[NodeReport], node_names: list[str]) -> tuple[str, str]:
    verdict, sentence = _full_verdict(reports, node_names)
    return verdict, clip_line(sentence)


def clip_line(text: str, limit: int = FIRST_LINE_MAX) -> str:
    """The text cut below `limit` characters at a word boundary, saying the rest is below (the node lines)."""
    if len(text) < limit:
        return text
    tail = " … (details below)"
    cut = text[:limit - 1 - len(tail)]
    return cut[:max(cut.rfind(" "), limit // 2)].rstrip(",;:") + tail


def _full_verdict(reports: list[NodeReport], node_names: list[str]) -> tuple[str, str]:
    ok = [r for r in reports if r.verdict == ALLOCATABLE]
    if ok:
        first = ok[0]
        picks = "; ".join(f"{k} -> {_names(v)}" for k, v in first.chosen.items())
        more = f" (and {len(ok) - 1} other node{'s' * (len(ok) > 2)})" if len(ok) > 1 else ""
        return ALLOCATABLE, f"allocatable on {first.node}{more}: {picks}"
    undecided = [r for r in reports if r.verdict == CANNOT_EVALUATE]
    if undecided:
        return CANNOT_EVALUATE, f"cannot evaluate: node {undecided[0].node}: {undecided[0].reason}"
    if not node_names:
        return NOT_ALLOCATABLE, "not allocatable: no node has devices published in a complete pool"
    by_reason: dict[str, list[str]] = defaultdict(list)
    for r in reports:
        by_reason[r.reason].append(r.node)
    parts = [f"{', '.join(ns) if len(ns) <= 3 else f'{len(ns)} nodes'}: {reason}" for reason, ns in by_reason.items()]
    return NOT_ALLOCATABLE, "not allocatable on any node: " + " | ".join(parts)


def format_text(exp: Explanation) -> str:
    """The verdict sentence first, then per node the requests and GPUs."""
    lines = [exp.sentence, ""]
    lines += [f"config refused: {p}" for p in exp.config_problems]
    lines += [f"note: {n}" for n in exp.notes]
    for node in exp.nodes:
        head = f"node {node.node}: {node.verdict}"
        if node.reason and node.reason not in exp.sentence:
            head += f": {node.reason}"
        lines.append(head)
        for k, v in node.chosen.items():
            lines.append(f"  would allocate {k} -> {', '.join(v)}")
        for rep in node.requests:
            if rep.error:
                lines.append(f"  request {rep.request}: {rep.error}")
                continue
            states = ", ".join(f"{n} {_STATE_WORDS[s]}" for s, n in sorted(rep.states.items()))
            lines.append(f"  request {rep.request} ({rep.wants}): {rep.class_matching} of the class, "
                         f"{rep.matching} match the selectors" + (f" ({states})" if states else ""))
            if rep.free:
                lines.append(f"    free: {_names(rep.free)}")
            lines += [f"    {w}" for w in rep.why_not]
            lines += [f"    capacity: {c}" for c in rep.capacity_left]
        if node.gpus and any(r.matching or r.error for r in node.requests):
            lines.append("  GPUs (shared counter sets):")
            lines += [f"    {g}" for g in node.gpus]
    return "\n".join(lines).rstrip() + "\n"
