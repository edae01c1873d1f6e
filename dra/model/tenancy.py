"""MPS tenancy as the scheduler sees it: device taints that keep other namespaces off a GPU whose MPS daemon
serves one namespace.

A GPU's MPS daemon, its control socket and its /dev/shm serve the claims of one namespace (docs/mps.md). The
plugin refuses a claim of another namespace at prepare; these taints tell the scheduler first, so that such a
claim is never allocated there:

- every MPS-served device of the GPU (MPS slots, memory shares served by MPS) carries
  ``<driver>/mps-namespace=<namespace>:NoExecute`` while the daemon serves ``<namespace>``;
- claims get a toleration for their own namespace (``tenancy_toleration``) from the chart's
  MutatingAdmissionPolicy, so the tenant's next claims still fit there and nobody else's do;
- ``NoExecute``: a claim of another namespace that was allocated there before the taint was published (two
  namespaces racing for the last free GPU) has its pods evicted by the controller-manager's device-taint
  eviction, and a pod with an owner comes back elsewhere.

A GPU is tainted only while every claim of its tenant on it tolerates the taint. A claim without the toleration
(the admission policy is not installed, or the claim is older than it) would be evicted by its own GPU's taint
and its namespace kept off its GPU, so then that GPU carries no tenancy taint and the prepare-time refusal is the
only check, as before.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dra.model.devices import KIND_SHARED, KIND_SLOT, Device
from dra.model.tolerations import tolerates

TENANCY_TAINT = "mps-namespace"
TENANCY_EFFECT = "NoExecute"


def tenancy_taint_key(driver: str) -> str:
    return f"{driver}/{TENANCY_TAINT}"


def tenancy_taint(driver: str, namespace: str) -> dict[str, Any]:
    return {"key": tenancy_taint_key(driver), "value": namespace, "effect": TENANCY_EFFECT}


def tenancy_toleration(driver: str, namespace: str) -> dict[str, Any]:
    """What a claim of ``namespace`` carries (the chart's admission policy adds it). The effect is named: the
    device-taint eviction counts only tolerations for ``NoExecute`` itself."""
    return {"key": tenancy_taint_key(driver), "operator": "Equal", "value": namespace, "effect": TENANCY_EFFECT}


def tenancy_namespace(taint: Mapping[str, Any], driver: str) -> str | None:
    """The namespace whose MPS daemon a taint of ``driver``'s devices says their GPU serves; None for any other
    taint."""
    if taint.get("key") == tenancy_taint_key(driver) and taint.get("effect") == TENANCY_EFFECT:
        return str(taint.get("value") or "")
    return None


def tenancy_reason(namespace: str) -> str:
    """How a device kept for a namespace's daemon is explained, in `gpu-dra explain` and the controller's Event."""
    return f"MPS daemon serves namespace {namespace}"


def tolerates_tenancy(tolerations: Iterable[Mapping[str, Any]], driver: str, namespace: str) -> bool:
    taint = tenancy_taint(driver, namespace)
    return any(tolerates(dict(t), taint) for t in tolerations)


def mps_served(device: Device) -> bool:
    """Devices whose claims become clients of their GPU's one daemon, side by side with other claims: MPS slots
    and MPS memory shares. (A whole GPU or a MIG partition with an MPS config is one claim's alone.)"""
    return device.kind in (KIND_SLOT, KIND_SHARED) and device.sharing == "mps"


@dataclass(frozen=True)
class GpuTenant:
    """Who a GPU's daemon serves, as the plugin's prepared claims say."""

    namespace: str
    tolerated: bool            # every prepared claim of the namespace on the GPU carries the toleration


def tenancy_taints(devices: Sequence[Device], tenants: Mapping[str, GpuTenant],
                   driver: str) -> dict[str, list[dict[str, Any]]]:
    """Device name -> its tenancy taint, for the MPS-served devices of GPUs (by UUID) whose daemon serves one
    namespace whose claims all tolerate it."""
    out: dict[str, list[dict[str, Any]]] = {}
    for d in devices:
        tenant = tenants.get(d.gpu_uuid)
        if tenant is not None and tenant.tolerated and mps_served(d):
            out[d.name] = [tenancy_taint(driver, tenant.namespace)]
    return out
