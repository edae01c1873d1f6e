"""The transport's seam: what it asks of the driver (``NodeDriver``) and the plain types that cross it.

The kubelet names each claim by namespace, name and UID (``ClaimRef``, checked by ``claim_ref_problem`` before it
reaches an API path or a file name); the driver answers per claim UID with a ``PrepareResult`` or an
``UnprepareResult``, independent of the DRA API version the kubelet speaks. ``RequestMetrics`` is the one counter
the DRA service keeps. Nothing here knows how claims are read or devices prepared: that is the rest of
kubeletplugin, which hands a ``NodeDriver`` to ``DRAServer``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from api.k8snames import is_dns_label, is_dns_subdomain, is_uid


@dataclass(frozen=True)
class ClaimRef:
    """What the kubelet sends for each claim."""

    namespace: str
    uid: str
    name: str

    def describe(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


def claim_ref_problem(ref: ClaimRef) -> str | None:
    """Why a claim named by the kubelet is not a valid Kubernetes claim reference (it goes into API paths and
    file names), or None."""
    if not is_uid(ref.uid):
        return f"claim uid {ref.uid[:80]!r}: not a Kubernetes UID"
    if not is_dns_label(ref.namespace):
        return f"claim {ref.uid}: namespace {ref.namespace[:80]!r} is not a Kubernetes namespace name"
    if not is_dns_subdomain(ref.name):
        return f"claim {ref.uid}: name {ref.name[:260]!r} is not a Kubernetes object name"
    return None


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as the kubelet needs it (kubelet Device message)."""

    request_names: tuple[str, ...]     # base request names (sub-request suffix stripped)
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"requestNames": list(self.request_names), "poolName": self.pool_name,
                             "deviceName": self.device_name, "cdiDeviceIDs": list(self.cdi_device_ids)}
        if self.share_id:
            d["shareID"] = self.share_id
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PreparedDevice":
        return cls(request_names=tuple(d.get("requestNames") or ()), pool_name=d["poolName"],
                   device_name=d["deviceName"], cdi_device_ids=tuple(d.get("cdiDeviceIDs") or ()),
                   share_id=d.get("shareID") or None)


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class UnprepareResult:
    error: str = ""


class NodeDriver(Protocol):
    """What the DRA service needs from the driver: the claims of one call prepared or unprepared, answered
    per claim UID. ``arrived``: when the call reached the plugin (``time.monotonic()``; None: now). The kubelet's
    deadline runs from there, so the driver's time budget for the call does too, however long the call took
    to reach it."""

    def prepare(self, claims: list[ClaimRef], arrived: float | None = None) -> dict[str, PrepareResult]:
        ...

    def unprepare(self, claims: list[ClaimRef], arrived: float | None = None) -> dict[str, UnprepareResult]:
        ...


class RequestMetrics(Protocol):
    """What the DRA service counts: ``requests``, a counter of calls labelled by method and API version
    (``PluginMetrics`` has it)."""

    requests: Any
