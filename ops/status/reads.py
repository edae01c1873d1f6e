"""What ``gpu-dra status`` reads from the API server: this driver's ResourceSlices (of one node, or all; field
selectors on ``spec.driver`` and ``spec.nodeName``), the ResourceClaims that hold a device of it, and the Pods of
the namespaces where such a claim is reserved for no pod (the pods that name it are its users then; otherwise
``reservedFor`` names them and no pod is read). Everything is read a page at a time and folded before the next
page (dra.scheduling.compact): other claims are dropped as they arrive, so a 1000-node cluster is never held as
JSON. Reads only: ``get``/``list`` on resourceslices, resourceclaims and pods is all the RBAC it needs
(docs/operations.md, "Who holds which GPU"). Slices and claims are listed side by side."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from dra.scheduling.compact import Interner, fold_claim, fold_slice
from kube.client import RESOURCE_V1, SLICES, ApiError, ApiUnavailable, KubeApi

CLAIMS = f"{RESOURCE_V1}/resourceclaims"
PAGE_SIZE = 200


# What `gpu-dra status` reads with: the grants its identity needs (docs/operations.md).
RIGHTS = "get and list on resourceslices, resourceclaims and pods"


class StatusReadError(RuntimeError):
    """A list the API server refused or did not answer; the message names the resource and what is needed."""


@dataclass(frozen=True)
class StatusObjects:
    slices: list[dict[str, Any]]
    claims: list[dict[str, Any]]
    pods: list[dict[str, Any]]


def read_status_objects(kube: KubeApi, driver: str, node: str | None = None) -> StatusObjects:
    """The slices of ``driver`` (on ``node`` only, when given), all ResourceClaims, and the Pods that may use an
    allocated claim nobody has reserved."""
    slice_selector = f"spec.driver={driver}" + (f",spec.nodeName={node}" if node else "")
    interner = Interner()
    with ThreadPoolExecutor(2) as pool:
        slices = pool.submit(_list, kube, "resourceslices", SLICES, slice_selector, lambda o: fold_slice(o, interner))
        claims = pool.submit(_list, kube, "resourceclaims", CLAIMS, None,
                             lambda c: fold_claim(c) if _holds(c, driver) else None)
        objects = StatusObjects(slices.result(), claims.result(), [])
    for ns in sorted(unreserved_namespaces(objects.claims, driver)):
        objects.pods.extend(_list(kube, "pods", f"/api/v1/namespaces/{ns}/pods", None))
    return objects


def unreserved_namespaces(claims: list[dict[str, Any]], driver: str) -> set[str]:
    """Namespaces of claims with a device of ``driver`` allocated and no reservation."""
    out = set()
    for c in claims:
        status = c.get("status") or {}
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        if not status.get("reservedFor") and any(r.get("driver") == driver for r in results):
            out.add((c.get("metadata") or {}).get("namespace", ""))
    return out


def _holds(claim: dict[str, Any], driver: str) -> bool:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return any(r.get("driver") == driver for r in results)


def _list(kube: KubeApi, what: str, path: str, selector: str | None,
          fold: Callable[[dict[str, Any]], dict[str, Any] | None] = lambda o: o) -> list[dict[str, Any]]:
    try:
        return [kept for item in kube.iter_list(path, field_selector=selector, page_size=PAGE_SIZE)
                if (kept := fold(item)) is not None]
    except ApiError as err:
        if err.status in (401, 403):
            raise StatusReadError(f"the API server refused to list {what} ({err.status} {err.reason}): "
                                  f"gpu-dra status needs {RIGHTS}") from err
        raise StatusReadError(f"listing {what}: {err}") from err
    except ApiUnavailable as err:
        raise StatusReadError(f"listing {what}: {err}") from err
