"""Prometheus metrics of the controllers (process-wide; labelled by driver)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge

SLICE_WRITES = Counter(
    "gpu_dra_resourceslice_writes",
    "ResourceSlice writes sent to the API server (create, update, delete).",
    ["driver", "operation"])
SLICE_SYNCS = Counter(
    "gpu_dra_resourceslice_pool_syncs",
    "Pool reconciliations, by result (ok, error).",
    ["driver", "result"])
SLICE_POOLS = Gauge(
    "gpu_dra_resourceslice_desired_pools",
    "Pools the ResourceSlice controller currently publishes.",
    ["driver"])
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
