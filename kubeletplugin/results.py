"""What prepare/unprepare hand back to the gRPC layer, independent of the DRA API version."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kubeletplugin.claims import ClaimRef


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
    """What the DRA gRPC service needs from the driver."""

    def prepare(self, claims: list[ClaimRef]) -> dict[str, PrepareResult]:
        ...

    def unprepare(self, claims: list[ClaimRef]) -> dict[str, UnprepareResult]:
        ...
