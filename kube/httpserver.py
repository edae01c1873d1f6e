"""HTTP on ports any pod may reach: /healthz and /metrics (Prometheus text format) of the plugin and the controller,
and the admission webhook. `BoundedHTTPServer` serves them with bounded threads, connections and time."""
from __future__ import annotations

import logging
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from queue import SimpleQueue
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

HealthCheck = Callable[[], tuple[bool, str]]


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client, or many, can hold of a server."""

    # Requests handled at once: the only threads besides the one that accepts. A readable connection waits for one.
    workers: int = 4
    # Open connections. A connection holds no thread until its first bytes arrive; when a new one would exceed
    # this, the longest-waiting silent one is closed (clients that mean to ask send at once).
    max_connections: int = 128
    # Seconds a connection may stay silent: before its first byte, and between reads while handled (the TLS
    # handshake included).
    idle_timeout: float = 10.0
    # Seconds from a connection's first byte until it is cut, whatever it still sends or reads: a client that
    # trickles its request (or reads the answer byte by byte) holds a worker for no longer than this.
    request_timeout: float = 30.0


class BoundedHTTPServer(HTTPServer):
    """An HTTPServer whose `serve_forever` runs `limits.workers` worker threads and one thread that accepts
    connections, watches the silent ones (no thread each) and cuts those past their time. Each connection carries
    one request (HTTP/1.0, as BaseHTTPRequestHandler answers). Subclasses may wrap accepted sockets in
    `get_request` (TLS, with the handshake left to the worker's first read)."""

    request_queue_size = 128  # listen backlog: connections are accepted promptly, and counted then

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 limits: ConnectionLimits = ConnectionLimits()) -> None:
        self.limits = limits
        self._ready: SimpleQueue[tuple[socket.socket, Any] | None] = SimpleQueue()
        self._lock = threading.Lock()
        self._busy: dict[socket.socket, float] = {}  # handed to the workers -> when it is cut
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        super().__init__(address, handler)

    def serve_forever(self, poll_interval: float = 0.2) -> None:
        self._stopped.clear()
        workers = [threading.Thread(target=self._work, name=f"{threading.current_thread().name}-{i}", daemon=True)
                   for i in range(self.limits.workers)]
        for worker in workers:
            worker.start()
        waiting: dict[socket.socket, tuple[Any, float]] = {}  # silent connections, oldest first -> (address, expiry)
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self.socket, selectors.EVENT_READ)
                while not self._stop.is_set():
                    for key, _ in sel.select(poll_interval):
                        if key.fileobj is self.socket:
                            self._accept(sel, waiting)
                        else:
                            conn: Any = key.fileobj
                            sel.unregister(conn)
                            self._dispatch(conn, waiting.pop(conn)[0])
                    self._expire(sel, waiting)
        finally:
            for conn in waiting:
                self.shutdown_request(conn)
            for _ in workers:
                self._ready.put(None)
            self._stop.clear()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stops serve_forever and waits for it; connections being handled are finished by their workers."""
        self._stop.set()
        self._stopped.wait()

    def connections(self) -> int:
        """Connections handed to the workers and not closed yet (tests, metrics)."""
        with self._lock:
            return len(self._busy)

    def _accept(self, sel: selectors.BaseSelector, waiting: dict[socket.socket, tuple[Any, float]]) -> None:
        try:
            conn, addr = self.get_request()
        except OSError as exc:  # the client left already, or no file descriptor is left
            log.debug("accept: %s", exc)
            return
        if len(waiting) + self.connections() >= self.limits.max_connections:
            if not waiting:  # every connection is being answered: refuse this one
                self.shutdown_request(conn)
                return
            oldest = next(iter(waiting))
            sel.unregister(oldest)
            del waiting[oldest]
            self.shutdown_request(oldest)
        waiting[conn] = (addr, time.monotonic() + self.limits.idle_timeout)
        sel.register(conn, selectors.EVENT_READ)

    def _dispatch(self, conn: socket.socket, addr: Any) -> None:
        with self._lock:
            self._busy[conn] = time.monotonic() + self.limits.request_timeout
        self._ready.put((conn, addr))

    def _expire(self, sel: selectors.BaseSelector, waiting: dict[socket.socket, tuple[Any, float]]) -> None:
        now = time.monotonic()
        for conn in [c for c, (_, expiry) in waiting.items() if expiry <= now]:
            sel.unregister(conn)
            del waiting[conn]
            self.shutdown_request(conn)
        with self._lock:  # a worker drops its connection from _busy (under the lock) before closing it
            for conn, cut in self._busy.items():
                if cut <= now:
                    self._busy[conn] = float("inf")
                    try:
                        # The plain socket's shutdown (also under TLS): the worker's blocked read or write returns.
                        socket.socket.shutdown(conn, socket.SHUT_RDWR)
                    except OSError:
                        pass

    def _work(self) -> None:
        while (item := self._ready.get()) is not None:
            conn, addr = item
            try:
                conn.settimeout(self.limits.idle_timeout)
                self.finish_request(conn, addr)
            except Exception:  # noqa: BLE001 - one client's failure is logged, the worker goes on
                self.handle_error(conn, addr)
            finally:
                with self._lock:
                    self._busy.pop(conn, None)
                self.shutdown_request(conn)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Resets, timeouts and cut connections are routine on a port anyone can reach: one line, no traceback.
        log.debug("connection from %s: %s", client_address[0] if client_address else "?", sys.exc_info()[1])


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


def start(server: BoundedHTTPServer, name: str) -> BoundedHTTPServer:
    """Runs `server.serve_forever` in a daemon thread called `name` (its workers are named after it)."""
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


def serve_health_and_metrics(port: int, health: HealthCheck, address: str = "0.0.0.0", *,
                             registry: CollectorRegistry = REGISTRY, live: HealthCheck | None = None,
                             limits: ConnectionLimits = ConnectionLimits()) -> BoundedHTTPServer:
    """Starts serving; port 0 picks a free one (see server.server_address). Stop with server.shutdown().

    /healthz and /readyz answer ``health``; /livez answers ``live`` (default: ``health``), for a process whose
    liveness is narrower than its health (restarting it would not cure every unhealthy state)."""
    handler = type("Handler", (ProbeHandler,), {"health": staticmethod(health),
                                                "live": staticmethod(live) if live else None,
                                                "registry": registry})
    return start(BoundedHTTPServer((address, port), handler, limits=limits), "health-metrics")
