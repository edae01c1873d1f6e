"""What ``gpu-dra status`` reads from the API server: this driver's ResourceSlices, every ResourceClaim and the
Pods (of one node, or all). Reads only: ``get``/``list`` on resourceslices, resourceclaims and pods is all the
RBAC it needs (docs/operations.md, "Who holds which GPU"). The three lists run side by side."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kube.client import RESOURCE_V1, SLICES, ApiError, ApiUnavailable, KubeApi

CLAIMS = f"{RESOURCE_V1}/resourceclaims"
PODS = "/api/v1/pods"


class StatusReadError(RuntimeError):
    """A list the API server refused or did not answer; the message names the resource and what is needed."""


@dataclass(frozen=True)
class StatusObjects:
    slices: list[dict[str, Any]]
    claims: list[dict[str, Any]]
    pods: list[dict[str, Any]]


def read_status_objects(kube: KubeApi, driver: str, node: str | None = None) -> StatusObjects:
    """The slices of ``driver`` (on ``node`` only, when given), all ResourceClaims, and the Pods (on ``node``)."""
    slice_selector = f"spec.driver={driver}" + (f",spec.nodeName={node}" if node else "")
    pod_selector = f"spec.nodeName={node}" if node else None
    jobs = {"resourceslices": (SLICES, slice_selector), "resourceclaims": (CLAIMS, None), "pods": (PODS, pod_selector)}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {what: pool.submit(_list, kube, what, path, selector) for what, (path, selector) in jobs.items()}
        lists = {what: f.result() for what, f in futures.items()}
    return StatusObjects(lists["resourceslices"], lists["resourceclaims"], lists["pods"])


def _list(kube: KubeApi, what: str, path: str, selector: str | None) -> list[dict[str, Any]]:
    try:
        return kube.list(path, field_selector=selector)["items"]
    except ApiError as err:
        if err.status in (401, 403):
            raise StatusReadError(f"the API server refused to list {what} ({err.status} {err.reason}): "
                                  "gpu-dra status needs get and list on resourceslices, resourceclaims and pods"
                                  ) from err
        raise StatusReadError(f"listing {what}: {err}") from err
    except ApiUnavailable as err:
        raise StatusReadError(f"listing {what}: {err}") from err
