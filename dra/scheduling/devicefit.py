"""Whether one device can serve one request alternative apart from the selectors, as the scheduler decides it:
device taints against the request's tolerations, and the capacity a request takes from a device (consumable
capacity with requestPolicy rounding, or a plain minimum on devices that are allocated whole)."""
from __future__ import annotations

from fractions import Fraction
from typing import Any

from api.quantity import quantity_value
from dra.model.tolerations import tolerates
from dra.scheduling.devicecel import split_qualified

# Taint effects that keep a device from being allocated; None and unknown effects do not.
_BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


def untolerated(taints: list[dict[str, Any]], tolerations: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The blocking taints that no toleration covers."""
    return [t for t in taints
            if t.get("effect") in _BLOCKING_EFFECTS and not any(tolerates(tol, t) for tol in tolerations)]


def taint_text(taint: dict[str, Any]) -> str:
    """`key=value:Effect`, as kubectl writes a taint."""
    return f"{taint.get('key')}{'=' + taint['value'] if taint.get('value') else ''}:{taint.get('effect')}"


def untolerated_taints(taints: list[dict[str, Any]], tolerations: tuple[dict[str, Any], ...]) -> list[str]:
    """The blocking taints that no toleration covers, as `key=value:Effect`."""
    return [taint_text(t) for t in untolerated(taints, tolerations)]


def _device_capacity(device: dict[str, Any], name: str, driver: str) -> dict[str, Any] | None:
    caps = device.get("capacity") or {}
    if name in caps:
        return caps[name]
    domain, ident = split_qualified(name, driver)
    return caps.get(ident) if domain == driver else None


def _rounded(policy: dict[str, Any], want: Fraction) -> Fraction | None:
    """The amount a requestPolicy grants for `want`: the next valid value or step, None if none fits."""
    if policy.get("validValues"):
        values = sorted(quantity_value(str(v)) for v in policy["validValues"])
        return next((v for v in values if v >= want), None)
    rng = policy.get("validRange")
    if rng:
        low = quantity_value(str(rng["min"]))
        amount = max(want, low)
        if rng.get("step"):
            step = quantity_value(str(rng["step"]))
            steps = -((low - amount) // step)          # ceil((amount - low) / step)
            amount = low + steps * step
        if rng.get("max") is not None and amount > quantity_value(str(rng["max"])):
            return None
        return amount
    return want


def capacity_needs(device: dict[str, Any], driver: str,
                   requested: tuple[tuple[str, Fraction], ...]) -> tuple[dict[str, Fraction], str]:
    """(capacity name -> amount taken, "") for a multi-allocatable device, ({}, "") for a device allocated
    whole that has the requested capacities, or ({}, why) when the device cannot serve the request; `why`
    reads after "the device is", e.g. "too small: memory 80Gi, 100Gi requested"."""
    wanted = {}
    for name, amount in requested:
        cap = _device_capacity(device, name, driver)
        if cap is None:
            return {}, f"without capacity {name}"
        wanted[split_qualified(name, driver)[1] if name not in (device.get("capacity") or {}) else name] = amount
    if not device.get("allowMultipleAllocations"):
        for name, amount in wanted.items():
            total = quantity_value(str(device["capacity"][name].get("value", "0")))
            if total < amount:
                return {}, f"too small: {name} {_fmt(total)}, {_fmt(amount)} requested"
        return {}, ""
    needs: dict[str, Fraction] = {}
    for name, cap in (device.get("capacity") or {}).items():
        total = quantity_value(str(cap.get("value", "0")))
        policy = cap.get("requestPolicy") or {}
        if name in wanted:
            rounded = _rounded(policy, wanted[name]) if policy else wanted[name]
            if rounded is None:
                return {}, (f"outside the {name} request policy: no valid amount for {_fmt(wanted[name])} "
                            f"({_policy_text(policy)})")
            amount = rounded
        elif policy.get("default") is not None:
            amount = quantity_value(str(policy["default"]))
        else:
            amount = total
        if amount > total:
            return {}, f"too small: {name} {_fmt(total)}, {_fmt(amount)} requested"
        needs[name] = amount
    return needs, ""


def _policy_text(policy: dict[str, Any]) -> str:
    """What a requestPolicy grants, e.g. "valid: 1Gi to 79Gi in steps of 1Gi" or "valid: 10Gi, 20Gi"."""
    if policy.get("validValues"):
        return "valid: " + ", ".join(_fmt(quantity_value(str(v))) for v in policy["validValues"])
    rng = policy.get("validRange") or {}
    text = f"valid: {_fmt(quantity_value(str(rng.get('min', '0'))))}"
    text += f" to {_fmt(quantity_value(str(rng['max'])))}" if rng.get("max") is not None else " or more"
    return text + (f" in steps of {_fmt(quantity_value(str(rng['step'])))}" if rng.get("step") else "")


def _fmt(v: Fraction) -> str:
    for unit, size in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if v >= size and v % size == 0:
            return f"{v // size}{unit}"
    return str(v.numerator) if v.denominator == 1 else str(float(v))


format_amount = _fmt
