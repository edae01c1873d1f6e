"""Claims as the driver sees them: where the allocation is read from and what it holds for this driver.

The kubelet passes only (namespace, name, uid) over gRPC (``ClaimRef``; it and the driver's answers are the
transport's, kubeletplugin.transport.nodedriver); the allocation itself is read from the API server. ``ClaimSource`` hides that read so the prepare/unprepare driver can be exercised with plain dicts.
Claims are handled as wire-format dicts (camelCase), as the API server returns them.
"""
from __future__ import annotations

import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Protocol

from api.k8snames import is_dns_subdomain, is_uid
from kubeletplugin.transport.nodedriver import ClaimRef


class ClaimError(Exception):
    """A claim that cannot be prepared as it is (gone, replaced, not allocated, bad allocation) or cannot be
    read now. ``reason`` is the kind, for metrics: claim (missing, replaced, not allocated, malformed),
    unavailable, forbidden, api (another answer of the API server), plan."""

    def __init__(self, message: str, reason: str = "claim") -> None:
        super().__init__(message)
        self.reason = reason


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
    not serve v1 at all (the claim status shape we read is the same in v1beta1/v1beta2). API failures become
    ClaimErrors by kind (``claim`` for not found, ``unavailable``, ``forbidden``, ``api``) with a one-line message: the
    kubelet retries, and no traceback is logged for what is not a bug."""

    API_VERSIONS = ("v1", "v1beta2", "v1beta1")

    def __init__(self, api_client: Any, timeout_s: float = 10.0):
        from kube.client import KubeApi

        self._kube = KubeApi(api_client, timeout=timeout_s)
        self._version: str | None = None

    def get_claim(self, namespace: str, name: str, uid: str) -> dict[str, Any]:
        from kube.client import ApiError, ApiUnavailable

        what = f"ResourceClaim {namespace}/{name}"
        versions = [self._version] if self._version else list(self.API_VERSIONS)
        last = ""
        for version in versions:
            path = (f"/apis/resource.k8s.io/{version}/namespaces/{urllib.parse.quote(namespace, safe='')}"
                    f"/resourceclaims/{urllib.parse.quote(name, safe='')}")
            try:
                body = self._kube.get(path)
            except ApiUnavailable as err:
                raise ClaimError(f"reading {what}: the API server is unavailable ({_first_line(err)}); "
                                 "the kubelet retries", reason="unavailable") from None
            except ApiError as err:
                details = _details(err)
                if err.status == 404 and details.get("name") == name:
                    raise ClaimError(f"{what} not found") from None
                if err.status == 404:
                    last = f"resource.k8s.io/{version} not served"
                    continue  # this API version is not served; try the next
                if err.status in (401, 403):
                    raise ClaimError(f"reading {what}: forbidden (HTTP {err.status}): {err.message}; check the "
                                     "plugin's RBAC", reason="forbidden") from None
                raise ClaimError(f"reading {what}: HTTP {err.status} {err.reason}: {err.message}",
                                 reason="api") from None
            if not isinstance(body, dict):
                raise ClaimError(f"reading {what}: the API server sent no object", reason="api")
            self._version = version
            check_claim_identity(body, ClaimRef(namespace, uid, name))
            return body
        raise ClaimError(f"reading {what}: {last or 'no API version answered'}", reason="api")


def _details(err: Any) -> dict[str, Any]:
    try:
        doc = json.loads(err.body) if getattr(err, "body", None) else {}
    except ValueError:
        return {}
    details = doc.get("details") if isinstance(doc, dict) else None
    return details if isinstance(details, dict) else {}


def _first_line(err: Exception) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0][:300]


@dataclass(frozen=True)
class AllocatedDevice:
    """One allocation result of this driver in this node's pool."""

    request: str                  # as allocated, "gpu" or "gpu/h200" (firstAvailable sub-request)
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    consumed_capacity: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, str], ...] = ()   # copied by the scheduler from the request (device taints)

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


def _tolerations(result: dict[str, Any], at: str) -> tuple[dict[str, str], ...]:
    """A result's tolerations with the fields that matching reads, as strings (tolerationSeconds is the
    eviction controller's business, not ours)."""
    out = []
    for i, t in enumerate(_field(result, "tolerations", list, at) or []):
        if not isinstance(t, dict):
            raise ClaimError(f"{at}.tolerations[{i}]: must be an object, got {type(t).__name__}")
        out.append({k: t[k] for k in ("key", "operator", "value", "effect") if isinstance(t.get(k), str)})
    return tuple(out)


def allocation_for(claim: dict[str, Any], driver_name: str, pool_name: str) -> ClaimAllocation:
    """The results of ``driver_name`` in ``pool_name`` and this driver's opaque configs, in allocation order.

    A claim may hold results of other drivers (handled by their plugins) and, for network-attached pools,
    of other pools; those are skipped. A claim with no allocation is an error: the kubelet only asks for
    allocated, reserved claims, so this means the claim was deallocated meanwhile."""
    meta = claim.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
    where = f"ResourceClaim {meta.get('namespace', '?')}/{meta.get('name', '?')}"
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, dict) else None
    if not allocation:
        raise ClaimError(f"{where} is not allocated")
    if not isinstance(allocation, dict):
        raise ClaimError(f"{where}: status.allocation must be an object, got {type(allocation).__name__}")
    devs = _field(allocation, "devices", dict, f"{where}: status.allocation") or {}
    results: list[AllocatedDevice] = []
    for i, r in enumerate(_field(devs, "results", list, f"{where}: status.allocation.devices") or []):
        at = f"{where}: status.allocation.devices.results[{i}]"
        if not isinstance(r, dict):
            raise ClaimError(f"{at}: must be an object, got {type(r).__name__}")
        if r.get("driver") != driver_name or r.get("pool") != pool_name:
            continue
        if not isinstance(r.get("request"), str) or not r["request"] or not isinstance(r.get("device"), str) \
                or not r["device"]:
            raise ClaimError(f"{at} lacks request or device")
        share = r.get("shareID")
        results.append(AllocatedDevice(
            request=r["request"], pool=r["pool"], device=r["device"],
            admin_access=r.get("adminAccess") is True,
            share_id=share if isinstance(share, str) and share else None,
            consumed_capacity={str(k): str(v) for k, v in
                               (_field(r, "consumedCapacity", dict, at) or {}).items()},
            tolerations=_tolerations(r, at),
        ))
    configs: list[OpaqueConfigEntry] = []
    for i, c in enumerate(_field(devs, "config", list, f"{where}: status.allocation.devices") or []):
        at = f"{where}: status.allocation.devices.config[{i}]"
        if not isinstance(c, dict):
            raise ClaimError(f"{at}: must be an object, got {type(c).__name__}")
        opaque = c.get("opaque")
        if not opaque:
            continue
        if not isinstance(opaque, dict):
            raise ClaimError(f"{at}.opaque: must be an object, got {type(opaque).__name__}")
        if opaque.get("driver") != driver_name:
            continue
        requests = _field(c, "requests", list, at) or []
        if not all(isinstance(r, str) for r in requests):
            raise ClaimError(f"{at}.requests: must be a list of request names")
        configs.append(OpaqueConfigEntry(source=str(c.get("source", "FromClaim")), requests=tuple(requests),
                                         parameters=opaque.get("parameters"), index=i))
    return ClaimAllocation(devices=tuple(results), configs=tuple(configs))


def reserved_pods(claim: Any) -> list[tuple[str, str]]:
    """(name, uid) of the pods in the claim's ``status.reservedFor`` (in the claim's namespace). Entries that are
    not pods, or whose name or UID is not a Kubernetes one, are left out."""
    status = claim.get("status") if isinstance(claim, dict) else None
    reserved = status.get("reservedFor") if isinstance(status, dict) else None
    if not isinstance(reserved, list):
        return []
    return [(r["name"], r["uid"]) for r in reserved
            if isinstance(r, dict) and r.get("resource", "pods") == "pods" and not r.get("apiGroup")
            and is_dns_subdomain(r.get("name")) and is_uid(r.get("uid"))]


def _field(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
    """obj[key] if it is a ``kind`` (or absent/null); a ClaimError naming the field otherwise."""
    value = obj.get(key)
    if value is not None and not isinstance(value, kind):
        raise ClaimError(f"{where}.{key}: must be {'a list' if kind is list else 'an object'}, "
                         f"got {type(value).__name__}")
    return value
