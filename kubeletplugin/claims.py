"""Claims as the driver sees them: what the kubelet names (``ClaimRef``), what the driver answers
(``PrepareResult``, independent of the DRA API version), and where the allocation is read from.

The kubelet passes only (namespace, name, uid) over gRPC; the allocation itself is read from the API
server. ``ClaimSource`` hides that read so the prepare/unprepare driver can be exercised with plain dicts.
Claims are handled as wire-format dicts (camelCase), as the API server returns them.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol


class ClaimError(Exception):
    """A claim that cannot be prepared as it is (gone, replaced, not allocated, bad allocation)."""


@dataclass(frozen=True)
class ClaimRef:
    """What the kubelet sends for each claim."""

    namespace: str
    uid: str
    name: str

    def describe(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


class ClaimSource(Protocol):
    def get_claim(self, namespace: str, name: str, uid: str) -> dict[str, Any]:
        """The ResourceClaim as a wire-format dict. Raises ClaimError if it is missing or has another UID."""
        ...


def check_claim_identity(claim: dict[str, Any], ref: ClaimRef) -> None:
    """The object read must be the claim the kubelet meant: same UID (a claim deleted and re-created
    under the same name is a different claim)."""
    uid = (claim.get("metadata") or {}).get("uid")
    if uid != ref.uid:
        raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name} has UID {uid!r}, expected {ref.uid!r} "
                         f"(it was deleted and re-created)")


class DictClaimSource:
    """Claims held in memory, keyed by (namespace, name). For tests and offline runs."""

    def __init__(self, claims: list[dict[str, Any]] | None = None):
        self._lock = threading.Lock()
        self._claims: dict[tuple[str, str], dict[str, Any]] = {}
        for c in claims or []:
            self.put(c)
        self.reads = 0

    def put(self, claim: dict[str, Any]) -> None:
        meta = claim["metadata"]
        with self._lock:
            self._claims[(meta.get("namespace", "default"), meta["name"])] = claim

    def delete(self, namespace: str, name: str) -> None:
        with self._lock:
            self._claims.pop((namespace, name), None)

    def get_claim(self, namespace: str, name: str, uid: str) -> dict[str, Any]:
        with self._lock:
            self.reads += 1
            claim = self._claims.get((namespace, name))
        if claim is None:
            raise ClaimError(f"ResourceClaim {namespace}/{name} not found")
        check_claim_identity(claim, ClaimRef(namespace, uid, name))
        return claim


class KubernetesClaimSource:
    """Reads claims from the API server as raw JSON (the typed client models drop fields they do not know).

    Tries ``resource.k8s.io/v1`` first and falls back to older served versions when the API server does
    not serve v1 at all (the claim status shape we read is the same in v1beta1/v1beta2)."""

    API_VERSIONS = ("v1", "v1beta2", "v1beta1")

    def __init__(self, api_client: Any, timeout_s: float = 10.0):
        self._api = api_client
        self._timeout = timeout_s
        self._version: str | None = None

    def _read(self, version: str, namespace: str, name: str) -> tuple[int, dict[str, Any]]:
        path = f"/apis/resource.k8s.io/{version}/namespaces/{namespace}/resourceclaims/{name}"
        method, url, headers, body, post = self._api.param_serialize(
            "GET", path, header_params={"Accept": "application/json"}, auth_settings=["BearerToken"])
        resp = self._api.call_api(method, url, header_params=headers, body=body, post_params=post,
                                  _request_timeout=self._timeout)
        raw = resp.read()
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            data = {"message": raw[:200].decode(errors="replace") if isinstance(raw, bytes) else str(raw)[:200]}
        return resp.status, data if isinstance(data, dict) else {}

    def get_claim(self, namespace: str, name: str, uid: str) -> dict[str, Any]:
        versions = [self._version] if self._version else list(self.API_VERSIONS)
        last = ""
        for version in versions:
            status, body = self._read(version, namespace, name)
            if status == 200:
                self._version = version
                check_claim_identity(body, ClaimRef(namespace, uid, name))
                return body
            details = body.get("details") or {}
            if status == 404 and details.get("name") == name:
                raise ClaimError(f"ResourceClaim {namespace}/{name} not found")
            if status == 404:
                last = f"resource.k8s.io/{version} not served"
                continue  # this API version is not served; try the next
            raise ClaimError(f"reading ResourceClaim {namespace}/{name}: HTTP {status}: "
                             f"{body.get('message') or body}")
        raise ClaimError(f"reading ResourceClaim {namespace}/{name}: {last or 'no API version answered'}")


@dataclass(frozen=True)
class AllocatedDevice:
    """One allocation result of this driver in this node's pool."""

    request: str                  # as allocated, "gpu" or "gpu/h200" (firstAvailable sub-request)
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    consumed_capacity: dict[str, str] = field(default_factory=dict)

    @property
    def base_request(self) -> str:
        """The claim's request name: the kubelet matches containers against it, never the sub-request."""
        return self.request.split("/", 1)[0]


@dataclass(frozen=True)
class OpaqueConfigEntry:
    """One ``status.allocation.devices.config[]`` entry for this driver."""

    source: str                   # "FromClass" or "FromClaim"
    requests: tuple[str, ...]     # empty: applies to every request
    parameters: Any
    index: int                    # position in the allocation's config list (for error messages)


@dataclass(frozen=True)
class ClaimAllocation:
    devices: tuple[AllocatedDevice, ...]
    configs: tuple[OpaqueConfigEntry, ...]


def allocation_for(claim: dict[str, Any], driver_name: str, pool_name: str) -> ClaimAllocation:
    """The results of ``driver_name`` in ``pool_name`` and this driver's opaque configs, in allocation order.

    A claim may hold results of other drivers (handled by their plugins) and, for network-attached pools,
    of other pools; those are skipped. A claim with no allocation is an error: the kubelet only asks for
    allocated, reserved claims, so this means the claim was deallocated meanwhile."""
    meta = claim.get("metadata") or {}
    where = f"ResourceClaim {meta.get('namespace', '?')}/{meta.get('name', '?')}"
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"{where} is not allocated")
    devs = allocation.get("devices") or {}
    results: list[AllocatedDevice] = []
    for i, r in enumerate(devs.get("results") or []):
        if r.get("driver") != driver_name or r.get("pool") != pool_name:
            continue
        if not r.get("request") or not r.get("device"):
            raise ClaimError(f"{where}: status.allocation.devices.results[{i}] lacks request or device")
        results.append(AllocatedDevice(
            request=r["request"], pool=r["pool"], device=r["device"],
            admin_access=bool(r.get("adminAccess")),
            share_id=r.get("shareID") or None,
            consumed_capacity={str(k): str(v) for k, v in (r.get("consumedCapacity") or {}).items()},
        ))
    configs: list[OpaqueConfigEntry] = []
    for i, c in enumerate(devs.get("config") or []):
        opaque = c.get("opaque")
        if not opaque or opaque.get("driver") != driver_name:
            continue
        configs.append(OpaqueConfigEntry(source=c.get("source", "FromClaim"),
                                         requests=tuple(c.get("requests") or ()),
                                         parameters=opaque.get("parameters"), index=i))
    return ClaimAllocation(devices=tuple(results), configs=tuple(configs))


# ----- what prepare/unprepare hand back to the gRPC layer -----------------------------------------------------
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
