"""Prometheus metrics of the ResourceSlice publisher (process-wide; labelled by driver)."""
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
