"""Compact copies of the objects the scheduler replica reads, for readers that hold a whole cluster's worth.

A LIST of ResourceSlices at 1000 GPU nodes is hundreds of megabytes of JSON, and as Python dicts several times
that. Most of it repeats: the nodes of a fleet publish the same profiles, capacities and counters, and every object
carries metadata (managedFields above all) that no verdict reads. ``fold_slice`` and ``fold_claim`` keep what the
allocator reads, in the same wire-format shape, with equal parts of different devices shared (``Interner``): a
device's capacity, counters and each attribute value are one object however many devices carry them. The folded
objects are read-only.
"""
from __future__ import annotations

import json
import sys
from array import array
from typing import Any

# Sub-objects kept whole per device (shared when equal), and the metadata of a slice a reader needs.
_SLICE_METADATA = ("name", "uid", "resourceVersion")
_CLAIM_METADATA = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp", "deletionTimestamp",
                   "ownerReferences")


class Interner:
    """One shared object per distinct value. The table is emptied once it holds ``limit`` entries: objects
    folded before keep what they share, later ones start sharing anew (so values that vanish from the cluster,
    e.g. a removed GPU's UUID, are not held for ever)."""

    def __init__(self, limit: int = 100_000) -> None:
        self._table: dict[Any, Any] = {}
        self._limit = limit

    def __len__(self) -> int:
        return len(self._table)

    def value(self, obj: Any) -> Any:
        """``obj`` or an equal object seen before (order-sensitive: two dicts in another order stay two)."""
        if isinstance(obj, str):
            return sys.intern(obj)
        if isinstance(obj, dict) and len(obj) == 1:
            ((k, v),) = obj.items()
            key: Any = (k, v) if isinstance(v, (str, int, bool)) and not isinstance(v, float) else None
        else:
            key = None
        if key is None:
            key = json.dumps(obj, separators=(",", ":"))
        return self._shared(key, obj)

    def entries(self, obj: dict[str, Any]) -> dict[str, Any]:
        """A dict whose keys and values are shared already (``value`` of each): one object for equal ones. The
        devices of one GPU mostly carry equal attributes (every placement of a profile does)."""
        names = self._shared(("names", *obj), tuple(obj))          # few distinct name lists: shared too
        shared: dict[str, Any] = self._shared((names, array("Q", map(id, obj.values())).tobytes()), obj)
        return shared

    def _shared(self, key: Any, obj: Any) -> Any:
        shared = self._table.get(key)
        if shared is None:
            if len(self._table) >= self._limit:
                self._table.clear()
            shared = self._table[key] = obj
        return shared


def _fold_device(device: dict[str, Any], interner: Interner) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field, value in device.items():
        if field == "name":
            out["name"] = sys.intern(str(value))
        elif field == "attributes" and isinstance(value, dict):
            out["attributes"] = interner.entries({sys.intern(k): interner.value(v) for k, v in value.items()})
        else:
            out[field] = interner.value(value)
    return out


def fold_slice(obj: dict[str, Any], interner: Interner) -> dict[str, Any]:
    """A ResourceSlice as the allocator reads it: its name and spec, devices folded."""
    meta = obj.get("metadata") or {}
    spec = dict(obj.get("spec") or {})
    if isinstance(spec.get("devices"), list):
        spec["devices"] = [_fold_device(d, interner) if isinstance(d, dict) else d for d in spec["devices"]]
    for field in ("sharedCounters", "nodeSelector"):
        if field in spec:
            spec[field] = interner.value(spec[field])
    for field in ("driver", "nodeName"):
        if isinstance(spec.get(field), str):
            spec[field] = sys.intern(spec[field])
    return {"metadata": {k: meta[k] for k in _SLICE_METADATA if k in meta}, "spec": spec}


def fold_claim(obj: dict[str, Any]) -> dict[str, Any]:
    """A ResourceClaim as the allocator and the verdict read it: identity, owner, spec, allocation and
    reservations (not status.devices, which drivers fill with their own data)."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    out: dict[str, Any] = {"metadata": {k: meta[k] for k in _CLAIM_METADATA if k in meta},
                           "spec": obj.get("spec") or {}}
    kept = {k: status[k] for k in ("allocation", "reservedFor") if status.get(k)}
    if kept:
        out["status"] = kept
    return out
