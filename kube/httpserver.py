"""/healthz and /metrics (Prometheus text format) over plain HTTP, in a background thread."""
from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

HealthCheck = Callable[[], tuple[bool, str]]


class ProbeHandler(BaseHTTPRequestHandler):
    """GET /healthz, /readyz (``health``), /livez (``live``, default ``health``) and /metrics; subclasses
    add their own routes (the admission webhook's POST /validate)."""

    health: HealthCheck = staticmethod(lambda: (True, "ok"))
    live: HealthCheck | None = None
    registry: CollectorRegistry = REGISTRY

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        path = self.path.split("?", 1)[0]
        if path in ("/healthz", "/livez", "/readyz"):
            check = self.live if path == "/livez" and self.live is not None else self.health
            try:
                ok, reason = check()
            except Exception as exc:  # noqa: BLE001 - a failing check is an unhealthy answer, not a 500
                ok, reason = False, f"health check failed: {type(exc).__name__}: {exc}"
            self._reply(200 if ok else 503, "text/plain; charset=utf-8", (reason + "\n").encode())
        elif path == "/metrics":
            self._reply(200, CONTENT_TYPE_LATEST, generate_latest(self.registry))
        else:
            self._reply(404, "text/plain; charset=utf-8", b"not found\n")

    def _reply(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - keep probes out of the log
        return


def serve_health_and_metrics(port: int, health: HealthCheck, address: str = "0.0.0.0", *,
                             registry: CollectorRegistry = REGISTRY,
                             live: HealthCheck | None = None) -> ThreadingHTTPServer:
    """Starts serving; port 0 picks a free one (see server.server_address). Stop with server.shutdown().

    /healthz and /readyz answer ``health``; /livez answers ``live`` (default: ``health``), for a process whose
    liveness is narrower than its health (restarting it would not cure every unhealthy state)."""
    handler = type("Handler", (ProbeHandler,), {"health": staticmethod(health),
                                                "live": staticmethod(live) if live else None,
                                                "registry": registry})
    server = ThreadingHTTPServer((address, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health-metrics", daemon=True).start()
    return server
