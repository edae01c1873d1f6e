"""Which API server we talk to decides which slice features we may publish."""
from __future__ import annotations

import logging
import time
from typing import Any

from kube.backoff import Backoff
from kube.client import ApiError, ApiUnavailable, KubeApi

log = logging.getLogger(__name__)

# Partitionable devices (shared counters) and consumable capacity are on by default from 1.36.
FULL_FEATURES_MINOR = 36


def fetch_server_minor(api_client: Any, timeout: float = 120.0, backoff: Backoff | None = None) -> int:
    """The API server's minor version (1.<minor>), retrying with back-off while it is unreachable."""
    kube, backoff = KubeApi(api_client), backoff or Backoff()
    deadline = time.monotonic() + timeout
    while True:
        try:
            major, minor = kube.server_version()
            if major != 1:
                raise ApiError("GET", "/version", 200, f'{{"message": "unexpected major version {major}"}}')
            return minor
        except ApiUnavailable as exc:
            delay = backoff.failure("version")
            if time.monotonic() + delay > deadline:
                raise
            log.warning("API server not reachable (%s); asking for its version again in %.1fs", exc, delay)
            time.sleep(delay)


def api_features(api_client: Any, timeout: float = 120.0) -> Any:
    """`dra.model.slices.ApiFeatures` for the connected API server. Logs one line when it is older than 1.36."""
    from dra.model.slices import ApiFeatures

    minor = fetch_server_minor(api_client, timeout)
    if minor < FULL_FEATURES_MINOR:
        log.warning("API server is Kubernetes 1.%d (older than 1.%d): publishing only whole GPUs and static MIG "
                    "devices; dynamic MIG, shared slots and memory shares need 1.%d or newer",
                    minor, FULL_FEATURES_MINOR, FULL_FEATURES_MINOR)
    return ApiFeatures.for_server(minor)
