"""Packing a node's devices into ResourceSlice specs under the API limits, and checking specs against them.

``build_pool_slices`` returns ResourceSlice ``spec`` dicts (wire format) in a stable order: first the
counters-only slices (at most 8 counter sets each, in GPU order), then the device slices (GPUs in order, one
GPU's devices kept in one slice where the per-slice limit allows). ``pool.resourceSliceCount`` is filled in
(it follows from the packing); ``pool.generation`` is left to the publisher, which bumps it on every change.

What the server supports decides what is published (``ApiFeatures``): without partitionable devices only
whole GPUs and static MIG partitions are published (counters stripped), without consumable capacity no
memory-share devices and no device of a capacity layout (slots, one MIG profile), and without device taints tainted devices are withheld rather than offered untainted.
Each omission comes back as a human-readable note.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from api.k8snames import is_dns_label, is_dns_subdomain, is_label_key, is_label_value, is_qualified_name
from api.quantity import quantity_value
from dra.model.devices import KIND_MIG, KIND_SHARED, KIND_SLOT, CounterSet, Device, DeviceModel, build_devices
from dra.model.gpu import NodeInventory
from dra.model.policy import NodePolicy

MAX_DEVICES = 128
MAX_DEVICES_ADVANCED = 64          # once any device uses taints, consumesCounters or list attributes
MAX_COUNTER_SETS = 8               # per counters-only slice
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMES_ENTRIES = 2           # consumesCounters entries per device
MAX_COUNTERS_PER_CONSUMPTION = 32
MAX_ATTRS_AND_CAPACITY = 32
MAX_ATTRIBUTE_VALUES = 48
MAX_STRING = 64
MAX_TAINTS = 16
MAX_VALID_VALUES = 10

_BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


@dataclass(frozen=True)
class ApiFeatures:
    """Which optional ResourceSlice features the API server accepts."""

    partitionable: bool
    consumable_capacity: bool
    device_taints: bool

    @classmethod
    def for_server(cls, minor: int) -> "ApiFeatures":
        """Kubernetes 1.<minor>: from 1.36 partitionable devices, consumable capacity and device taints are on
        by default; 1.34 and 1.35 have them only behind feature gates, so none are assumed."""
        on = minor >= 36
        return cls(partitionable=on, consumable_capacity=on, device_taints=on)

    @classmethod
    def all(cls) -> "ApiFeatures":
        return cls(True, True, True)


@dataclass(frozen=True)
class PoolPlan:
    slices: list[dict[str, Any]]
    warnings: tuple[str, ...]      # about the node (policy vs. hardware)
    notes: tuple[str, ...]         # what the server version made us leave out


# --------------------------------------------------------------------------------------------------- features

def apply_features(
    devices: Sequence[Device], counter_sets: Sequence[CounterSet], features: ApiFeatures,
) -> tuple[list[Device], list[CounterSet], list[str]]:
    """Drop or trim what the server cannot take; say what was left out."""
    kept: list[Device] = []
    dropped: dict[str, list[Device]] = {}
    for d in devices:
        if not features.partitionable and (d.kind == KIND_SLOT or (d.kind == KIND_MIG and d.mig_dynamic)):
            dropped.setdefault("dynamic MIG partitions and shared slots need partitionable devices (Kubernetes 1.36+)", []).append(d)
            continue
        if not features.consumable_capacity and d.kind == KIND_SHARED:
            dropped.setdefault("memory-share devices need consumable capacity (Kubernetes 1.36+)", []).append(d)
            continue
        if not features.consumable_capacity and d.needs_consumable_capacity:
            dropped.setdefault("devices with consumable capacity (slots.layout: capacity, dynamicMig.layout: "
                               "capacity) need consumable capacity (Kubernetes 1.36+)", []).append(d)
            continue
        if not features.device_taints and any(t.get("effect") in _BLOCKING_EFFECTS for t in d.taints):
            dropped.setdefault("unhealthy devices are withheld because the server has no device taints", []).append(d)
            continue
        if not features.partitionable and d.consumes_counters:
            d = replace(d, consumes_counters=())
        if not features.device_taints and d.taints:
            d = replace(d, taints=())
        kept.append(d)
    notes = [f"left out {len(ds)} device(s): {why}: {_summary(ds)}" for why, ds in dropped.items()]
    return kept, list(counter_sets) if features.partitionable else [], notes


def _summary(devices: list[Device]) -> str:
    """"gpu-0: 25 mig, 2 slot; gpu-3: 1 gpu" """
    per_gpu: dict[int, dict[str, int]] = {}
    for d in devices:
        kinds = per_gpu.setdefault(d.gpu_minor, {})
        kinds[d.kind] = kinds.get(d.kind, 0) + 1
    return "; ".join(f"gpu-{minor}: " + ", ".join(f"{n} {kind}" for kind, n in kinds.items())
                     for minor, kinds in per_gpu.items())


# --------------------------------------------------------------------------------------------------- packing

def _advanced(device: Mapping[str, Any]) -> bool:
    if device.get("taints") or device.get("consumesCounters"):
        return True
    return any(set(v) & {"ints", "bools", "strings", "versions"} for v in device.get("attributes", {}).values())


def _pack_devices(groups: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Greedy in order: a GPU's devices join the current slice if the whole group fits, else open a new slice;
    a group larger than a slice is split."""
    slices: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    current_adv = False

    def limit(adv: bool) -> int:
        return MAX_DEVICES_ADVANCED if adv else MAX_DEVICES

    for group in groups:
        g_adv = any(_advanced(d) for d in group)
        if current and len(current) + len(group) <= limit(current_adv or g_adv):
            current.extend(group)
            current_adv = current_adv or g_adv
            continue
        if current:
            slices.append(current)
        current, current_adv = [], False
        for d in group:
            d_adv = _advanced(d)
            if current and len(current) + 1 > limit(current_adv or d_adv):
                slices.append(current)
                current, current_adv = [], False
            current.append(d)
            current_adv = current_adv or d_adv
    if current:
        slices.append(current)
    return slices


def build_pool_slices(
    driver: str,
    pool: str,
    node_name: str,
    devices: Sequence[Device],
    counter_sets: Sequence[CounterSet],
    features: ApiFeatures,
) -> list[dict[str, Any]]:
    """ResourceSlice specs for one node-local pool (see module docstring for order and pool fields)."""
    devices, counter_sets, _ = apply_features(devices, counter_sets, features)
    return _slices(driver, pool, node_name, devices, counter_sets)


def _slices(driver: str, pool: str, node_name: str, devices: Sequence[Device],
            counter_sets: Sequence[CounterSet]) -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = []
    sets = list(counter_sets)
    for i in range(0, len(sets), MAX_COUNTER_SETS):
        bodies.append({"sharedCounters": [cs.to_wire() for cs in sets[i:i + MAX_COUNTER_SETS]]})
    groups: dict[int, list[dict[str, Any]]] = {}
    for d in devices:
        groups.setdefault(d.gpu_minor, []).append(d.to_wire())
    for chunk in _pack_devices(list(groups.values())):
        bodies.append({"devices": chunk})
    out = []
    for body in bodies:
        spec: dict[str, Any] = {
            "driver": driver,
            "pool": {"name": pool, "resourceSliceCount": len(bodies)},
            "nodeName": node_name,
        }
        spec.update(body)
        out.append(spec)
    return out


def plan_pool(
    inventory: NodeInventory,
    policy: NodePolicy,
    driver: str,
    node_name: str,
    features: ApiFeatures,
    taints: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    model_name_of: Any = None,
) -> PoolPlan:
    """Everything a node publishes, with the warnings and notes a human should see."""
    model: DeviceModel = build_devices(inventory, policy, driver=driver, taints=taints, model_name_of=model_name_of)
    devices, counter_sets, notes = apply_features(model.devices, model.counter_sets, features)
    return PoolPlan(_slices(driver, node_name, node_name, devices, counter_sets), model.warnings, tuple(notes))


def desired_pool_slices(
    inventory: NodeInventory,
    policy: NodePolicy,
    driver: str,
    node_name: str,
    features: ApiFeatures,
    taints: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """The ResourceSlice specs one node should have (pool name = node name). Pure; the controller diffs these
    against what exists and sets ``pool.generation``."""
    return plan_pool(inventory, policy, driver, node_name, features, taints).slices


# --------------------------------------------------------------------------------------------------- objects

def resource_slice_objects(specs: Sequence[Mapping[str, Any]], names: Sequence[str],
                           generation: int = 1) -> list[dict[str, Any]]:
    """Full ResourceSlice objects as they would be sent: the given object names, pool generation set."""
    if len(names) != len(specs):
        raise ValueError(f"{len(specs)} slice specs but {len(names)} names")
    out = []
    for spec, name in zip(specs, names):
        body = dict(spec)
        body["pool"] = {"name": spec["pool"]["name"], "generation": generation,
                        **{k: v for k, v in spec["pool"].items() if k not in ("name", "generation")}}
        # wire order: driver, pool, nodeName, then devices or sharedCounters
        ordered: dict[str, Any] = {k: body[k] for k in ("driver", "pool", "nodeName") if k in body}
        ordered.update({k: v for k, v in body.items() if k not in ordered})
        out.append({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": ordered,
        })
    return out


# --------------------------------------------------------------------------------------------------- validation

_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)(([KMGTPE]i)|[numkMGTPE]|[eE][+-]?\d+)?$")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


def _quantity(v: Any) -> bool:
    return isinstance(v, str) and bool(_QUANTITY.fullmatch(v))


def _check_attribute(where: str, name: str, attr: Any, errors: list[str]) -> int:
    """Validate one DeviceAttribute; return how many values it holds."""
    if not isinstance(attr, Mapping):
        errors.append(f"{where}: attribute {name}: must be a mapping")
        return 0
    kinds = [k for k in ("int", "bool", "string", "version", "ints", "bools", "strings", "versions") if k in attr]
    extra = set(attr) - {"int", "bool", "string", "version", "ints", "bools", "strings", "versions"}
    if len(kinds) != 1 or extra:
        errors.append(f"{where}: attribute {name}: exactly one of int/bool/string/version (or a list form) must be set")
        return 0
    kind = kinds[0]
    values = attr[kind] if kind.endswith("s") else [attr[kind]]
    if kind.endswith("s") and (not isinstance(values, list) or not values):
        errors.append(f"{where}: attribute {name}: {kind} must be a non-empty list")
        return 0
    base = kind.rstrip("s")
    for v in values:
        if base == "int" and (not isinstance(v, int) or isinstance(v, bool)):
            errors.append(f"{where}: attribute {name}: {v!r} is not an int")
        elif base == "bool" and not isinstance(v, bool):
            errors.append(f"{where}: attribute {name}: {v!r} is not a bool")
        elif base == "string":
            if not isinstance(v, str):
                errors.append(f"{where}: attribute {name}: {v!r} is not a string")
            elif len(v) > MAX_STRING:
                errors.append(f"{where}: attribute {name}: string longer than {MAX_STRING} characters")
        elif base == "version":
            if not isinstance(v, str) or len(v) > MAX_STRING or not _SEMVER.fullmatch(v):
                errors.append(f"{where}: attribute {name}: {v!r} is not a semantic version (x.y.z)")
    return len(values)


def _check_capacity(where: str, name: str, cap: Any, multi: bool, errors: list[str]) -> None:
    if not isinstance(cap, Mapping) or "value" not in cap:
        errors.append(f"{where}: capacity {name}: needs a value")
        return
    extra = set(cap) - {"value", "requestPolicy"}
    if extra:
        errors.append(f"{where}: capacity {name}: unknown field(s) {sorted(extra)}")
    if not _quantity(cap["value"]):
        errors.append(f"{where}: capacity {name}: value {cap['value']!r} is not a quantity")
        return
    policy = cap.get("requestPolicy")
    if policy is None:
        return
    if not multi:
        errors.append(f"{where}: capacity {name}: requestPolicy needs allowMultipleAllocations: true")
    total = quantity_value(cap["value"])
    default = policy.get("default")
    if default is not None and not _quantity(default):
        errors.append(f"{where}: capacity {name}: requestPolicy.default {default!r} is not a quantity")
        return
    if "validValues" in policy and "validRange" in policy:
        errors.append(f"{where}: capacity {name}: requestPolicy has both validValues and validRange")
    if "validValues" in policy:
        vals = policy["validValues"]
        if not isinstance(vals, list) or not vals or len(vals) > MAX_VALID_VALUES or not all(_quantity(v) for v in vals):
            errors.append(f"{where}: capacity {name}: validValues must be 1..{MAX_VALID_VALUES} quantities")
            return
        nums = [quantity_value(v) for v in vals]
        if nums != sorted(set(nums)):
            errors.append(f"{where}: capacity {name}: validValues must be strictly ascending")
        if default is not None and quantity_value(default) not in nums:
            errors.append(f"{where}: capacity {name}: validValues must contain the default")
        if nums[-1] > total:
            errors.append(f"{where}: capacity {name}: validValues exceed the capacity value")
    if "validRange" in policy:
        rng = policy["validRange"]
        if not isinstance(rng, Mapping) or "min" not in rng:
            errors.append(f"{where}: capacity {name}: validRange.min is required")
            return
        for key in ("min", "max", "step"):
            if key in rng and not _quantity(rng[key]):
                errors.append(f"{where}: capacity {name}: validRange.{key} {rng[key]!r} is not a quantity")
                return
        lo = quantity_value(rng["min"])
        hi = quantity_value(rng["max"]) if "max" in rng else total
        if lo > hi or hi > total:
            errors.append(f"{where}: capacity {name}: validRange must satisfy min <= max <= value")
        if "step" in rng:
            step = quantity_value(rng["step"])
            if step <= 0:
                errors.append(f"{where}: capacity {name}: validRange.step must be positive")
            elif "max" in rng and (hi - lo) % step:
                errors.append(f"{where}: capacity {name}: validRange max - min must be a multiple of step")
        if default is not None:
            d = quantity_value(default)
            if d < lo or d > hi or ("step" in rng and (d - lo) % quantity_value(rng["step"])):
                errors.append(f"{where}: capacity {name}: requestPolicy.default is not in validRange")


def validate_slice_spec(spec: Mapping[str, Any], pool_counter_sets: Mapping[str, Iterable[str]] | None = None) -> list[str]:
    """Every documented ResourceSlice limit this driver can run into; [] when the spec is valid.

    ``pool_counter_sets`` (set name -> counter names, over the whole pool) also checks that consumesCounters
    refer to counter sets and counters that exist; ``validate_pool`` supplies it.
    """
    errors: list[str] = []
    driver = spec.get("driver")
    if not is_dns_subdomain(driver, 63):
        errors.append(f"driver {driver!r}: must be a lower-case DNS subdomain of at most 63 characters")
    pool = spec.get("pool") or {}
    pool_name = pool.get("name")
    if not isinstance(pool_name, str) or not pool_name or len(pool_name) > 253 or not all(
            is_dns_subdomain(part) for part in pool_name.split("/")):
        errors.append(f"pool.name {pool_name!r}: must be DNS subdomains joined by '/', at most 253 characters")
    if "resourceSliceCount" in pool and (not isinstance(pool["resourceSliceCount"], int) or pool["resourceSliceCount"] < 1):
        errors.append("pool.resourceSliceCount must be a positive integer")
    if "generation" in pool and (not isinstance(pool["generation"], int) or pool["generation"] < 0):
        errors.append("pool.generation must be a non-negative integer")
    selectors = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)]
    if len(selectors) != 1:
        errors.append(f"exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection must be set (got {selectors})")
    if "devices" in spec and "sharedCounters" in spec:
        errors.append("a slice holds either devices or sharedCounters, not both")

    set_names: set[str] = set()
    shared = spec.get("sharedCounters") or []
    if len(shared) > MAX_COUNTER_SETS:
        errors.append(f"sharedCounters: {len(shared)} counter sets, at most {MAX_COUNTER_SETS} per slice")
    for cs in shared:
        name = cs.get("name")
        if not is_dns_label(name):
            errors.append(f"sharedCounters {name!r}: name must be a DNS label")
        if name in set_names:
            errors.append(f"sharedCounters {name!r}: duplicate name")
        set_names.add(name)
        counters = cs.get("counters") or {}
        if not counters:
            errors.append(f"sharedCounters {name!r}: needs at least one counter")
        if len(counters) > MAX_COUNTERS_PER_SET:
            errors.append(f"sharedCounters {name!r}: {len(counters)} counters, at most {MAX_COUNTERS_PER_SET}")
        for cname, c in counters.items():
            if not is_dns_label(cname):
                errors.append(f"sharedCounters {name!r}: counter {cname!r} must be a DNS label")
            if not isinstance(c, Mapping) or not _quantity(c.get("value")):
                errors.append(f"sharedCounters {name!r}: counter {cname!r} needs a quantity value")

    devices = spec.get("devices") or []
    limit = MAX_DEVICES_ADVANCED if any(_advanced(d) for d in devices) else MAX_DEVICES
    if len(devices) > limit:
        errors.append(f"devices: {len(devices)} devices, at most {limit} allowed"
                      + (" when devices use taints, counters or list attributes" if limit == MAX_DEVICES_ADVANCED else ""))
    names: set[str] = set()
    for d in devices:
        dname = d.get("name")
        where = f"device {dname!r}"
        if not is_dns_label(dname):
            errors.append(f"{where}: name must be a DNS label (at most 63 characters, [a-z0-9-])")
        if dname in names:
            errors.append(f"{where}: duplicate name")
        names.add(dname)
        attrs = d.get("attributes") or {}
        caps = d.get("capacity") or {}
        if len(attrs) + len(caps) > MAX_ATTRS_AND_CAPACITY:
            errors.append(f"{where}: {len(attrs)} attributes + {len(caps)} capacities, at most {MAX_ATTRS_AND_CAPACITY}")
        n_values = 0
        for aname, attr in attrs.items():
            if not is_qualified_name(aname):
                errors.append(f"{where}: attribute name {aname!r} is not a qualified name")
            n_values += _check_attribute(where, aname, attr, errors)
        if n_values > MAX_ATTRIBUTE_VALUES:
            errors.append(f"{where}: {n_values} attribute values, at most {MAX_ATTRIBUTE_VALUES}")
        multi = bool(d.get("allowMultipleAllocations"))
        for cname, cap in caps.items():
            if not is_qualified_name(cname):
                errors.append(f"{where}: capacity name {cname!r} is not a qualified name")
            _check_capacity(where, cname, cap, multi, errors)
        consumes = d.get("consumesCounters") or []
        if len(consumes) > MAX_CONSUMES_ENTRIES:
            errors.append(f"{where}: {len(consumes)} consumesCounters entries, at most {MAX_CONSUMES_ENTRIES}")
        seen_sets: set[str] = set()
        for entry in consumes:
            set_name = entry.get("counterSet")
            if set_name in seen_sets:
                errors.append(f"{where}: consumesCounters names counter set {set_name!r} twice")
            seen_sets.add(set_name)
            if not is_dns_label(set_name):
                errors.append(f"{where}: consumesCounters counterSet {set_name!r} must be a DNS label")
            counters = entry.get("counters") or {}
            if not counters:
                errors.append(f"{where}: consumesCounters for {set_name!r} lists no counters")
            if len(counters) > MAX_COUNTERS_PER_CONSUMPTION:
                errors.append(f"{where}: consumes {len(counters)} counters of {set_name!r}, at most {MAX_COUNTERS_PER_CONSUMPTION}")
            for cname, c in counters.items():
                if not isinstance(c, Mapping) or not _quantity(c.get("value")):
                    errors.append(f"{where}: consumesCounters {set_name}/{cname} needs a quantity value")
            if pool_counter_sets is not None:
                if set_name not in pool_counter_sets:
                    errors.append(f"{where}: consumes from counter set {set_name!r}, which the pool does not define")
                else:
                    missing = set(counters) - set(pool_counter_sets[set_name])
                    if missing:
                        errors.append(f"{where}: counters {sorted(missing)} are not in counter set {set_name!r}")
        taints = d.get("taints") or []
        if len(taints) > MAX_TAINTS:
            errors.append(f"{where}: {len(taints)} taints, at most {MAX_TAINTS}")
        for t in taints:
            if not is_label_key(t.get("key")):
                errors.append(f"{where}: taint key {t.get('key')!r} is not a label name")
            if "value" in t and not is_label_value(t["value"]):
                errors.append(f"{where}: taint value {t.get('value')!r} is not a label value")
            if t.get("effect") not in ("None", "NoSchedule", "NoExecute"):
                errors.append(f"{where}: taint effect {t.get('effect')!r} must be None, NoSchedule or NoExecute")
    return errors


def validate_pool(specs: Sequence[Mapping[str, Any]]) -> list[str]:
    """validate_slice_spec for every slice plus the pool-wide rules: counter-set names and device names unique
    in the pool, consumesCounters pointing at existing sets/counters, consistent pool fields, and no device
    consuming more of a counter than the counter holds (such a device could never be allocated)."""
    errors: list[str] = []
    sets: dict[str, dict[str, Fraction]] = {}
    for i, spec in enumerate(specs):
        for cs in spec.get("sharedCounters") or []:
            if cs.get("name") in sets:
                errors.append(f"slice {i}: counter set {cs.get('name')!r} is defined twice in the pool")
            sets[cs.get("name")] = {k: quantity_value(v["value"]) for k, v in (cs.get("counters") or {}).items()
                                    if isinstance(v, Mapping) and _quantity(v.get("value"))}
    device_names: set[str] = set()
    keys = {(s.get("driver"), (s.get("pool") or {}).get("name"), s.get("nodeName")) for s in specs}
    if len(keys) > 1:
        errors.append(f"slices of one pool disagree on driver, pool name or node: {sorted(map(str, keys))}")
    counts = {(s.get("pool") or {}).get("resourceSliceCount") for s in specs}
    if specs and counts != {len(specs)} and counts != {None}:
        errors.append(f"pool.resourceSliceCount {sorted(map(str, counts))} does not match the {len(specs)} slices")
    for i, spec in enumerate(specs):
        errors.extend(f"slice {i}: {e}" for e in validate_slice_spec(spec, sets))
        for d in spec.get("devices") or []:
            if d.get("name") in device_names:
                errors.append(f"slice {i}: device {d.get('name')!r} appears twice in the pool")
            device_names.add(d.get("name"))
            for entry in d.get("consumesCounters") or []:
                have = sets.get(entry.get("counterSet"), {})
                for cname, c in (entry.get("counters") or {}).items():
                    if cname in have and _quantity(c.get("value")) and quantity_value(c["value"]) > have[cname]:
                        errors.append(f"slice {i}: device {d.get('name')!r} consumes more {cname} than "
                                      f"{entry.get('counterSet')!r} holds")
    return errors

