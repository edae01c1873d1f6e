"""Prometheus metrics of the cluster controller (process-wide; labelled by driver)."""
from __future__ import annotations

from prometheus_client import Counter

DEVICECLASS_WRITES = Counter(
    "gpu_dra_deviceclass_writes",
    "DeviceClass writes (create, update) by the cluster controller.",
    ["driver", "operation"])
STALE_SLICE_DELETES = Counter(
    "gpu_dra_stale_resourceslice_deletes",
    "ResourceSlices deleted by the cluster controller because their Node no longer exists.",
    ["driver"])
CLUSTER_RECONCILES = Counter(
    "gpu_dra_cluster_reconciles",
    "Cluster controller passes, by result (ok, error).",
    ["driver", "result"])
PENDING_PASSES = Counter(
    "gpu_dra_pending_claim_passes",
    "Passes over pending claims (controller.pendingclaims), by result (ok; waiting: the caches are not synced yet).",
    ["driver", "result"])
WATCH_LISTS = Counter(
    "gpu_dra_controller_lists",
    "LISTs the controller's caches made, by resource: one at start, another only after a watch was answered 410 "
    "Gone.", ["resource"])
