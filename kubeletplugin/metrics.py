"""Prometheus metrics of the node plugin.

Each ``PluginMetrics`` owns its own registry, so several drivers (tests, a simulated fleet in one process)
do not collide; ``serve`` exposes one registry over HTTP, with the process-wide ResourceSlice publisher metrics
(``gpu_dra_resourceslice_*``) and the plugin's health checks.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from kube.httpserver import BoundedHTTPServer, HealthCheck, serve_health_and_metrics
from kube.metrics import SLICE_POOLS, SLICE_SYNCS, SLICE_WRITES

NAMESPACE = "gpu_dra"
# 5 ms .. ~20 s: prepare of a whole GPU is milliseconds, of a dynamic MIG partition up to seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)

DEVICE_STATES = ("available", "prepared", "unhealthy")


class PluginMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.prepare_seconds = Histogram(
            "node_prepare_claim_duration_seconds", "Time to prepare one ResourceClaim (including cached answers).",
            namespace=NAMESPACE, buckets=LATENCY_BUCKETS, registry=r)
        self.unprepare_seconds = Histogram(
            "node_unprepare_claim_duration_seconds", "Time to unprepare one ResourceClaim.",
            namespace=NAMESPACE, buckets=LATENCY_BUCKETS, registry=r)
        self.prepare_errors = Counter(
            "node_prepare_errors_total", "ResourceClaims whose prepare failed, by reason.",
            ["reason"], namespace=NAMESPACE, registry=r)
        self.unprepare_errors = Counter(
            "node_unprepare_errors_total", "ResourceClaims whose unprepare failed, by reason.",
            ["reason"], namespace=NAMESPACE, registry=r)
        self.requests = Counter(
            "grpc_requests_total", "DRA gRPC calls served, by method and API version.",
            ["method", "version"], namespace=NAMESPACE, registry=r)
        self.inflight = Gauge(
            "requests_inflight", "Prepare/unprepare claims being worked on now.",
            ["operation"], namespace=NAMESPACE, registry=r)
        self.prepared_claims = Gauge(
            "prepared_claims", "ResourceClaims prepared on this node (checkpoint state PrepareCompleted).",
            namespace=NAMESPACE, registry=r)
        self.dynamic_mig_devices = Gauge(
            "dynamic_mig_devices", "MIG devices this plugin created for claims (dynamic MIG) and has not destroyed "
            "yet, from the checkpoint.", namespace=NAMESPACE, registry=r)
        self.devices = Gauge(
            "devices", "Devices this node publishes, by state.", ["state"], namespace=NAMESPACE, registry=r)
        self.claim_status_writes = Counter(
            "claim_status_writes_total", "Writes of this driver's ResourceClaim status.devices entries, by operation "
            "(publish, after a prepare) and result (ok, error).",
            ["operation", "result"], namespace=NAMESPACE, registry=r)
        self.registered = Gauge(
            "kubelet_registered", "1 when the kubelet accepted the plugin's registration.",
            namespace=NAMESPACE, registry=r)
        for state in DEVICE_STATES:
            self.devices.labels(state=state).set(0)
        # The ResourceSlice publisher's metrics (process-wide, labelled by driver) are served here too.
        if r is not REGISTRY:   # the process-wide registry holds them already
            for collector in (SLICE_WRITES, SLICE_SYNCS, SLICE_POOLS):
                r.register(collector)

    @contextmanager
    def timed(self, operation: str) -> Iterator[None]:
        """Time one claim's prepare or unprepare and count it in flight."""
        hist = self.prepare_seconds if operation == "prepare" else self.unprepare_seconds
        gauge = self.inflight.labels(operation=operation)
        gauge.inc()
        start = time.monotonic()
        try:
            yield
        finally:
            hist.observe(time.monotonic() - start)
            gauge.dec()

    def error(self, operation: str, reason: str) -> None:
        (self.prepare_errors if operation == "prepare" else self.unprepare_errors).labels(reason=reason).inc()

    def set_devices(self, available: int, prepared: int, unhealthy: int) -> None:
        self.devices.labels(state="available").set(available)
        self.devices.labels(state="prepared").set(prepared)
        self.devices.labels(state="unhealthy").set(unhealthy)

    def serve(self, port: int, addr: str = "0.0.0.0", *, health: HealthCheck | None = None,
              live: HealthCheck | None = None) -> BoundedHTTPServer:
        """Expose /metrics, /healthz, /readyz (``health``) and /livez (``live``) on ``port`` (a daemon thread;
        port 0 picks a free one). Stop it with ``shutdown()`` on the returned server."""
        return serve_health_and_metrics(port, health or (lambda: (True, "ok")), addr, registry=self.registry,
                                        live=live)
