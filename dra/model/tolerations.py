"""Kubernetes toleration matching, one rule for the driver's tenancy taints (dra.model.tenancy) and the
scheduler's replica that decides whether a device fits a request (dra.scheduling.devicefit)."""
from __future__ import annotations

from typing import Any


def tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    """Kubernetes toleration matching: empty effect matches every effect; Exists with empty key every key."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint.get("key")
    return toleration.get("key") == taint.get("key") and (toleration.get("value") or "") == (taint.get("value") or "")
