"""The one builder of ResourceClaim objects for the tests: a claim as the API server stores it, with only the
parts a test names (spec requests and configs, the allocation's results and configs, the pods it is reserved for).

Tests that need a particular shape build on it: ``request`` for a spec request, ``allocated`` for a copy with an
allocation, ``reserved`` for reservedFor entries."""
from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

API_VERSION = "resource.k8s.io/v1"


def resource_claim(name: str = "c", namespace: str | None = "ns", *, uid: str | None = None,
                   requests: Iterable[dict[str, Any]] | None = None, config: Iterable[dict[str, Any]] | None = None,
                   constraints: list[dict[str, Any]] | None = None, results: list[dict[str, Any]] | None = None,
                   allocation_config: list[dict[str, Any]] | None = None,
                   reserved_for: list[dict[str, Any]] | None = None, typed: bool = True,
                   api_version: str = API_VERSION, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ResourceClaim. ``requests``/``config``/``constraints`` make its spec (none given: no spec, as in a claim
    read only for its status); ``results`` (with ``allocation_config``) its allocation; ``reserved_for`` its
    reservedFor; ``metadata`` adds to its metadata. ``typed=False`` leaves out apiVersion and kind, as code that reads claims never looks at them."""
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    if uid is not None:
        meta["uid"] = uid
    meta.update(metadata or {})
    claim: dict[str, Any] = {"apiVersion": api_version, "kind": "ResourceClaim"} if typed else {}
    claim["metadata"] = meta
    if requests is not None or config is not None or constraints is not None:
        devices: dict[str, Any] = {"requests": list(requests or [])}
        if config is not None:
            devices["config"] = list(config)
        if constraints:
            devices["constraints"] = constraints
        claim["spec"] = {"devices": devices}
    status: dict[str, Any] = {}
    if results is not None:
        status["allocation"] = {"devices": {"results": results, **({"config": allocation_config}
                                                                   if allocation_config is not None else {})}}
    if reserved_for is not None:
        status["reservedFor"] = reserved_for
    if results is not None or reserved_for is not None:
        claim["status"] = status
    return claim


def request(name: str, device_class: str, *, cel: str | None = None, **exactly: Any) -> dict[str, Any]:
    """A spec request for exactly the given DeviceClass, with an optional CEL selector."""
    body: dict[str, Any] = {"deviceClassName": device_class, **exactly}
    if cel:
        body["selectors"] = [{"cel": {"expression": cel}}]
    return {"name": name, "exactly": body}


def reserved(*pods: tuple[str, str]) -> list[dict[str, Any]]:
    """reservedFor entries for pods given as (name, uid)."""
    return [{"resource": "pods", "name": n, "uid": u} for n, u in pods]


def allocated(claim: dict[str, Any], results: list[dict[str, Any]], **allocation: Any) -> dict[str, Any]:
    """A copy of ``claim`` allocated with ``results`` (and any further allocation fields, e.g. nodeSelector)."""
    out = copy.deepcopy(claim)
    out.setdefault("status", {})["allocation"] = {"devices": {"results": results}, **allocation}
    return out


def admission_review(obj: dict[str, Any], *, operation: str = "CREATE", version: str = "v1",
              sub_resource: str | None = None) -> dict[str, Any]:
    """The AdmissionReview the API server sends a validating webhook for a claim or claim template."""
    resource = "resourceclaims" if obj["kind"] == "ResourceClaim" else "resourceclaimtemplates"
    req: dict[str, Any] = {
        "uid": "0b8a0d6e-2f5e-4c1e-9f0e-1b2c3d4e5f60",
        "kind": {"group": "resource.k8s.io", "version": version, "kind": obj["kind"]},
        "resource": {"group": "resource.k8s.io", "version": version, "resource": resource},
        "operation": operation, "namespace": "ns", "object": obj,
        "userInfo": {"username": "alice"},
    }
    if sub_resource:
        req["subResource"] = sub_resource
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}
