"""HTTP on ports any pod may reach: /healthz and /metrics (Prometheus text format) of the plugin and the controller,
and the admission webhook. `BoundedHTTPServer` serves them with bounded threads, connections and time."""
from __future__ import annotations

import io
import logging
import selectors
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from queue import SimpleQueue
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

HealthCheck = Callable[[], tuple[bool, str]]


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client, or many, can hold of a server."""

    # Requests handled at once: the only threads besides the one that accepts. A connection gets one once its
    # request head has arrived; until then it costs no thread.
    workers: int = 4
    # Open connections. When a new one would exceed this, the longest-waiting one whose head has not arrived is
    # closed (clients that mean to ask send at once).
    max_connections: int = 128
    # Seconds a connection may stay silent: while its head arrives (the TLS handshake included) and between reads
    # of its body.
    idle_timeout: float = 10.0
    # Seconds for the head to arrive after the connection is accepted, and again for the request to be read and
    # answered once a worker has it: a client that trickles its request, or reads the answer byte by byte, is cut.
    request_timeout: float = 30.0


# A longer request head is refused: the kubelet's, Prometheus's and the API server's are a few hundred bytes.
MAX_HEAD = 16 << 10


@dataclass
class _Arriving:
    """A connection whose request head is still arriving, read by the accepting thread as it comes."""

    addr: Any
    silent_until: float
    head_by: float
    head: bytearray = field(default_factory=bytearray)
    handshaken: bool = False


class BoundedHTTPServer(HTTPServer):
    """An HTTPServer whose `serve_forever` runs `limits.workers` worker threads and one thread that accepts
    connections, reads their request heads without blocking (and their TLS handshakes, for a `get_request` that
    wraps sockets in TLS without handshaking), hands complete heads to the workers and cuts connections past their
    time. Each connection carries one request (HTTP/1.0, as BaseHTTPRequestHandler answers)."""

    request_queue_size = 128  # listen backlog: connections are accepted promptly, and counted then

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 limits: ConnectionLimits = ConnectionLimits()) -> None:
        self.limits = limits
        self._ready: SimpleQueue[tuple[socket.socket, Any, bytes] | None] = SimpleQueue()
        self._lock = threading.Lock()
        self._busy: dict[socket.socket, float] = {}  # handed to the workers -> when it is cut
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._wake: socket.socket | None = None   # shutdown() writes to it: ends an idle loop's wait
        super().__init__(address, handler)

    def serve_forever(self, poll_interval: float = 0.2) -> None:
        self._stopped.clear()
        workers = [threading.Thread(target=self._work, name=f"{threading.current_thread().name}-{i}", daemon=True)
                   for i in range(self.limits.workers)]
        for worker in workers:
            worker.start()
        arriving: dict[socket.socket, _Arriving] = {}  # oldest first
        wake, self._wake = socket.socketpair()
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self.socket, selectors.EVENT_READ)
                sel.register(wake, selectors.EVENT_READ)
                while not self._stop.is_set():
                    with self._lock:
                        idle = not arriving and not self._busy
                    # With no connection to time out, wait for a new one or shutdown() without a timeout: an idle
                    # server uses no CPU.
                    for key, _ in sel.select(None if idle else poll_interval):
                        if key.fileobj is wake:
                            continue
                        try:
                            if key.fileobj is self.socket:
                                self._accept(sel, arriving)
                            else:
                                self._receive(sel, arriving, key.fileobj)  # type: ignore[arg-type]
                        except Exception:  # noqa: BLE001 - a fault with one connection must not end the server
                            log.exception("serving %s", self.server_address)
                    self._expire(sel, arriving)
        finally:
            wake.close()
            self._wake.close()
            for conn in arriving:
                self.shutdown_request(conn)
            for _ in workers:
                self._ready.put(None)
            self._stop.clear()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stops serve_forever and waits for it; connections being handled are finished by their workers."""
        self._stop.set()
        if self._wake is not None:
            try:
                self._wake.send(b"x")
            except OSError:   # serve_forever has ended already
                pass
        self._stopped.wait()

    def connections(self) -> int:
        """Connections handed to the workers and not closed yet."""
        with self._lock:
            return len(self._busy)

    def _accept(self, sel: selectors.BaseSelector, arriving: dict[socket.socket, _Arriving]) -> None:
        try:
            conn, addr = self.get_request()
            conn.setblocking(False)
        except OSError as exc:  # the client left already, or no file descriptor is left
            log.debug("accept: %s", exc)
            return
        if len(arriving) + self.connections() >= self.limits.max_connections:
            if not arriving:  # every connection is being answered: refuse this one
                self.shutdown_request(conn)
                return
            self._drop(sel, arriving, next(iter(arriving)))
        now = time.monotonic()
        arriving[conn] = _Arriving(addr, now + self.limits.idle_timeout, now + self.limits.request_timeout)
        sel.register(conn, selectors.EVENT_READ)

    def _receive(self, sel: selectors.BaseSelector, arriving: dict[socket.socket, _Arriving],
                 conn: socket.socket) -> None:
        state = arriving.get(conn)
        if state is None:  # dropped earlier in this round (to make room for a new connection)
            return
        state.silent_until = time.monotonic() + self.limits.idle_timeout
        try:
            complete = _read_head(conn, state)
        except OSError:  # a reset, a failed TLS handshake
            self.handle_error(conn, state.addr)
            complete = None
        if complete is None:  # closed, broken or a head too long
            self._drop(sel, arriving, conn)
        elif complete:
            sel.unregister(conn)
            del arriving[conn]
            with self._lock:
                self._busy[conn] = time.monotonic() + self.limits.request_timeout
            self._ready.put((conn, state.addr, bytes(state.head)))

    def _drop(self, sel: selectors.BaseSelector, arriving: dict[socket.socket, _Arriving],
              conn: socket.socket) -> None:
        sel.unregister(conn)
        del arriving[conn]
        self.shutdown_request(conn)

    def _expire(self, sel: selectors.BaseSelector, arriving: dict[socket.socket, _Arriving]) -> None:
        now = time.monotonic()
        for conn in [c for c, a in arriving.items() if min(a.silent_until, a.head_by) <= now]:
            self._drop(sel, arriving, conn)
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
            conn, addr, head = item
            try:
                conn.settimeout(self.limits.idle_timeout)
                self.finish_request(_HeadFirst(conn, head), addr)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - one client's failure is logged, the worker goes on
                self.handle_error(conn, addr)
            finally:
                with self._lock:
                    self._busy.pop(conn, None)
                self.shutdown_request(conn)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Resets, timeouts and cut connections are routine on a port anyone can reach: one line, no traceback.
        log.debug("connection from %s: %s", client_address[0] if client_address else "?", sys.exc_info()[1])


def _read_head(conn: socket.socket, state: _Arriving) -> bool | None:
    """Reads what has arrived on non-blocking `conn` into `state.head`: True once the head is complete, False while
    it is not, None when the client closed or the head is too long."""
    try:
        if isinstance(conn, ssl.SSLSocket) and not state.handshaken:
            conn.do_handshake()
            state.handshaken = True
        while True:
            data = conn.recv(MAX_HEAD)
            if not data:
                return None
            state.head += data
            if b"\n\r\n" in state.head or b"\n\n" in state.head:
                return True
            if len(state.head) > MAX_HEAD:
                return None
    except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
        return False


class _HeadFirst:
    """An accepted socket as the request handler sees it: reads return the head read already, then the socket's."""

    def __init__(self, sock: socket.socket, head: bytes) -> None:
        self._sock, self._head = sock, head

    def makefile(self, mode: str = "r", buffering: int | None = None) -> Any:
        if "r" not in mode:
            return self._sock.makefile(mode, buffering)  # type: ignore[call-overload]
        return io.BufferedReader(_HeadThenSocket(self._head, self._sock))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _HeadThenSocket(io.RawIOBase):
    def __init__(self, head: bytes, sock: socket.socket) -> None:
        self._head, self._sock = memoryview(head), sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._sock.recv_into(buffer)


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
