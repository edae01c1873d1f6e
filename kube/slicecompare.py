"""Comparing a desired ResourceSlice spec with what the API server stored.

The server re-serialises what it stores: Quantities come back in canonical form ("1024Mi" -> "1Gi"),
empty lists/maps and false booleans are omitted, and it sets `timeAdded` on device taints. A naive
comparison would see a change where there is none and rewrite the slice forever. `normalize_spec`
maps both sides to one form: Quantities become exact numbers, omitted-when-empty fields are dropped,
server-set taint timestamps are ignored. Attribute values are compared exactly (a `bool: false`
attribute is real data, not an omitted field).
"""
from __future__ import annotations

from typing import Any

from api.quantity import quantity_value


def _qty(v: Any) -> Any:
    try:
        return ("quantity", quantity_value(v))
    except ValueError:
        return v  # left as-is: the server would have rejected it, and then we see the error


def prune_empty(v: Any) -> Any:
    """Drop None, empty containers and false booleans (all omitted by the server's JSON encoding)."""
    if isinstance(v, dict):
        out = {k: prune_empty(x) for k, x in v.items()}
        return {k: x for k, x in out.items() if x is not None and x != {} and x != [] and x is not False}
    if isinstance(v, list):
        return [prune_empty(x) for x in v]
    return v


def _counters(counters: Any) -> Any:
    if not isinstance(counters, dict):
        return counters
    return {name: {**c, "value": _qty(c.get("value"))} if isinstance(c, dict) else c for name, c in counters.items()}


def _capacity(capacity: Any) -> Any:
    if not isinstance(capacity, dict):
        return capacity
    out = {}
    for name, cap in capacity.items():
        if not isinstance(cap, dict):
            out[name] = cap
            continue
        cap = dict(cap)
        if "value" in cap:
            cap["value"] = _qty(cap["value"])
        policy = cap.get("requestPolicy")
        if isinstance(policy, dict):
            policy = dict(policy)
            if "default" in policy:
                policy["default"] = _qty(policy["default"])
            if isinstance(policy.get("validValues"), list):
                policy["validValues"] = [_qty(x) for x in policy["validValues"]]
            if isinstance(policy.get("validRange"), dict):
                policy["validRange"] = {k: _qty(x) for k, x in policy["validRange"].items()}
            cap["requestPolicy"] = policy
        out[name] = cap
    return out


def _device(dev: Any) -> Any:
    if not isinstance(dev, dict):
        return dev
    attributes = dev.get("attributes")
    d = dict(dev)
    d.pop("attributes", None)
    if "capacity" in d:
        d["capacity"] = _capacity(d["capacity"])
    if isinstance(d.get("consumesCounters"), list):
        d["consumesCounters"] = [{**c, "counters": _counters(c.get("counters"))} if isinstance(c, dict) else c
                                 for c in d["consumesCounters"]]
    if isinstance(d.get("taints"), list):
        # timeAdded is set by the API server when the driver leaves it empty.
        d["taints"] = [{k: x for k, x in t.items() if k != "timeAdded"} if isinstance(t, dict) else t
                       for t in d["taints"]]
    out = prune_empty(d)
    if attributes:
        out["attributes"] = attributes  # exact: bool false and empty strings are data here
    return out


def normalize_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A comparable form of a ResourceSlice spec (without `pool`, which is compared on its own)."""
    s = {k: v for k, v in spec.items() if k != "pool"}
    if isinstance(s.get("devices"), list):
        s["devices"] = [_device(d) for d in s["devices"]]
    if isinstance(s.get("sharedCounters"), list):
        s["sharedCounters"] = [{**cs, "counters": _counters(cs.get("counters"))} if isinstance(cs, dict) else cs
                               for cs in s["sharedCounters"]]
    devices = s.pop("devices", None)
    out = prune_empty(s)
    if devices:
        out["devices"] = devices  # already normalised per device
    return out


def spec_differences(desired: dict[str, Any], actual: dict[str, Any], limit: int = 5) -> list[str]:
    """Human-readable paths where two normalised specs differ (for logs about dropped fields)."""
    diffs: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if len(diffs) >= limit:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                if k not in b:
                    diffs.append(f"{path}.{k}: dropped by the server")
                elif k not in a:
                    diffs.append(f"{path}.{k}: added by the server")
                else:
                    walk(a[k], b[k], f"{path}.{k}")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")
        elif a != b:
            diffs.append(f"{path}: {a!r} != {b!r}"[:200])

    walk(desired, actual, "spec")
    return diffs
