"""HTTP on ports any pod may reach: /healthz and /metrics (Prometheus text format) of the plugin and the controller,
and the admission webhook. `BoundedHTTPServer` serves them with bounded threads, connections, memory and time: a
request reaches a worker thread only once it has arrived whole, and probes have a thread of their own."""
from __future__ import annotations

import http.client
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

    # Requests handled at once: the only threads besides the one that accepts and the one that answers probes. A
    # request reaches a worker only once it has arrived whole (head and body); until then it costs no thread.
    workers: int = 4
    # Open connections. When a new one would exceed this, the longest-waiting one whose request has not arrived
    # is closed (clients that mean to ask send at once).
    max_connections: int = 128
    # Open connections from one client address. Past it, that client's own longest-waiting arriving connection is
    # closed instead: one client cannot take the others' share of max_connections.
    per_client: int = 32
    # Seconds a connection may stay silent while its request arrives (the TLS handshake included).
    idle_timeout: float = 10.0
    # Seconds from accepting a connection until its answer is written, whatever the client does: one that trickles
    # its request, or reads the answer byte by byte, is cut then, and a request still waiting for a worker by
    # then is not handled.
    request_timeout: float = 30.0
    # The longest body read before a worker takes the request. One that declares a longer body goes to a worker
    # with its head only, for the handler to refuse; a handler never reads past what was read for it.
    max_body: int = 0
    # Bytes of bodies held at once, counted by declared length from a head's arrival until its answer. A body
    # that would not fit closes the longest-waiting arriving requests holding some; if none, its own.
    max_buffered: int = 32 << 20


# A longer request head is refused: the kubelet's, Prometheus's and the API server's are a few hundred bytes.
MAX_HEAD = 16 << 10


@dataclass
class _Arriving:
    """A connection whose request is still arriving, read by the accepting thread as it comes; the same record goes
    with the complete request to a worker."""

    addr: Any
    deadline: float      # when it is cut, arriving or being answered
    silent_until: float
    data: bytearray = field(default_factory=bytearray)
    handshaken: bool = False
    size: int | None = None  # head and body, once the head has arrived
    reserved: int = 0        # body bytes counted against max_buffered

    @property
    def client(self) -> Any:
        return self.addr[0] if isinstance(self.addr, tuple) else self.addr


class BoundedHTTPServer(HTTPServer):
    """An HTTPServer whose `serve_forever` runs `limits.workers` worker threads, one thread for probes and one
    thread that accepts connections and reads whole requests without blocking (their TLS handshakes too, for a
    `get_request` that wraps sockets in TLS without handshaking): workers get only complete requests, so no worker
    waits on a client. The accepting thread also cuts connections past their time. Each connection carries one
    request (HTTP/1.0, as BaseHTTPRequestHandler answers)."""

    request_queue_size = 128  # listen backlog: connections are accepted promptly, and counted then
    # GET paths answered by a thread of their own: the kubelet's probes never wait behind other requests.
    probe_paths = frozenset({"/healthz", "/livez", "/readyz"})

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 limits: ConnectionLimits = ConnectionLimits()) -> None:
        self.limits = limits
        self._ready: SimpleQueue[tuple[socket.socket, _Arriving] | None] = SimpleQueue()
        self._probes: SimpleQueue[tuple[socket.socket, _Arriving] | None] = SimpleQueue()
        self._lock = threading.Lock()  # the three below: workers release what they held
        self._busy: dict[socket.socket, float] = {}  # handed to a worker -> when it is cut
        self._clients: dict[Any, int] = {}  # client address -> its open connections, arriving or handed over
        self._buffered = 0  # bytes of bodies reserved
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._wake: socket.socket | None = None   # shutdown() writes to it: ends an idle loop's wait
        super().__init__(address, handler)

    def serve_forever(self, poll_interval: float = 0.2) -> None:
        self._stopped.clear()
        name = threading.current_thread().name
        lanes = [(self._ready, f"{name}-{i}") for i in range(self.limits.workers)] + [(self._probes, f"{name}-probes")]
        workers = [threading.Thread(target=self._work, args=(queue,), name=thread_name, daemon=True)
                   for queue, thread_name in lanes]
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
            for conn in list(arriving):
                self._drop(None, arriving, conn)
            for queue, _ in lanes:
                queue.put(None)
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
        now = time.monotonic()
        state = _Arriving(addr, now + self.limits.request_timeout, now + self.limits.idle_timeout)
        with self._lock:
            mine = self._clients.get(state.client, 0)
            total = len(arriving) + len(self._busy)
        if mine >= self.limits.per_client:
            room = self._evict(sel, arriving, lambda other: other.client == state.client)
        elif total >= self.limits.max_connections:
            room = self._evict(sel, arriving, lambda other: True)
        else:
            room = True
        if not room:  # every connection it could replace is being answered: refuse this one
            self.shutdown_request(conn)
            return
        with self._lock:
            self._clients[state.client] = self._clients.get(state.client, 0) + 1
        arriving[conn] = state
        sel.register(conn, selectors.EVENT_READ)

    def _receive(self, sel: selectors.BaseSelector, arriving: dict[socket.socket, _Arriving],
                 conn: socket.socket) -> None:
        state = arriving.get(conn)
        if state is None:  # dropped earlier in this round (to make room for a new connection)
            return
        state.silent_until = time.monotonic() + self.limits.idle_timeout
        try:
            complete = self._read(sel, arriving, conn, state)
        except OSError:  # a reset, a failed TLS handshake
            self.handle_error(conn, state.addr)
            complete = None
        if complete is None:  # closed, broken, a head too long, or no room for its body
            self._drop(sel, arriving, conn)
        elif complete:
            sel.unregister(conn)
            del arriving[conn]
            with self._lock:
                self._busy[conn] = state.deadline
            (self._probes if self._is_probe(state.data) else self._ready).put((conn, state))

    def _read(self, sel: selectors.BaseSelector, arriving: dict[socket.socket, _Arriving], conn: socket.socket,
              state: _Arriving) -> bool | None:
        """Reads what has arrived on non-blocking `conn` into `state.data`: True once the request is complete,
        False while it is not, None when the client closed, the head is too long or its body finds no room."""
        try:
            if isinstance(conn, ssl.SSLSocket) and not state.handshaken:
                conn.do_handshake()
                state.handshaken = True
            while state.size is None or len(state.data) < state.size:
                want = MAX_HEAD if state.size is None else state.size - len(state.data)
                data = conn.recv(min(want, 1 << 16))
                if not data:
                    return None
                state.data += data
                if state.size is None:
                    end = _head_end(state.data)
                    if end is None:
                        if len(state.data) > MAX_HEAD:
                            return None
                        continue
                    body = self._body_length(state.data[:end])
                    if body and not self._reserve(sel, arriving, state, body):
                        return None
                    state.size = end + body
                    del state.data[state.size:]  # nothing past the request is read
            return True
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False

    def _body_length(self, head: bytes | bytearray) -> int:
        """The body to read before a worker takes the request: its Content-Length, as the handler will read it
        (http.server's own header parser), when that is 1 to max_body bytes; else none."""
        if self.limits.max_body <= 0:
            return 0
        _, _, fields = head.partition(b"\n")
        try:
            length = int(http.client.parse_headers(io.BytesIO(fields)).get("Content-Length", ""))
        except (ValueError, http.client.HTTPException):
            return 0
        return length if 0 < length <= self.limits.max_body else 0

    def _reserve(self, sel: selectors.BaseSelector, arriving: dict[socket.socket, _Arriving], state: _Arriving,
                 size: int) -> bool:
        while True:
            with self._lock:
                if self._buffered + size <= self.limits.max_buffered:
                    self._buffered += size
                    state.reserved = size
                    return True
            if not self._evict(sel, arriving, lambda other: other.reserved > 0 and other is not state):
                return False

    def _is_probe(self, request: bytearray) -> bool:
        method, _, rest = bytes(request[:256]).partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        return method == b"GET" and path.decode("latin-1") in self.probe_paths

    def _evict(self, sel: selectors.BaseSelector, arriving: dict[socket.socket, _Arriving],
               which: Callable[[_Arriving], bool]) -> bool:
        """Closes the longest-waiting arriving connection that `which` picks; False when there is none."""
        for conn, state in arriving.items():
            if which(state):
                self._drop(sel, arriving, conn)
                return True
        return False

    def _drop(self, sel: selectors.BaseSelector | None, arriving: dict[socket.socket, _Arriving],
              conn: socket.socket) -> None:
        if sel is not None:
            sel.unregister(conn)
        self._release(arriving.pop(conn))
        self.shutdown_request(conn)

    def _release(self, state: _Arriving) -> None:
        with self._lock:
            self._buffered -= state.reserved
            state.reserved = 0
            if (left := self._clients[state.client] - 1) > 0:
                self._clients[state.client] = left
            else:
                del self._clients[state.client]

    def _expire(self, sel: selectors.BaseSelector, arriving: dict[socket.socket, _Arriving]) -> None:
        now = time.monotonic()
        for conn in [c for c, a in arriving.items() if min(a.silent_until, a.deadline) <= now]:
            self._drop(sel, arriving, conn)
        with self._lock:  # a worker drops its connection from _busy (under the lock) before closing it
            for conn, cut in self._busy.items():
                if cut <= now:
                    self._busy[conn] = float("inf")
                    try:
                        # The plain socket's shutdown (also under TLS): the worker's blocked write returns.
                        socket.socket.shutdown(conn, socket.SHUT_RDWR)
                    except OSError:
                        pass

    def _work(self, queue: SimpleQueue[tuple[socket.socket, _Arriving] | None]) -> None:
        while (item := queue.get()) is not None:
            conn, state = item
            try:
                left = state.deadline - time.monotonic()
                if left > 0:  # else its client has given up waiting (and the connection is cut)
                    conn.settimeout(left)
                    self.finish_request(_Received(conn, state.data), state.addr)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - one client's failure is logged, the worker goes on
                self.handle_error(conn, state.addr)
            finally:
                with self._lock:
                    self._busy.pop(conn, None)
                self._release(state)
                self.shutdown_request(conn)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Resets, timeouts and cut connections are routine on a port anyone can reach: one line, no traceback.
        log.debug("connection from %s: %s", client_address[0] if client_address else "?", sys.exc_info()[1])


def _head_end(data: bytearray) -> int | None:
    """Where the body begins (past the blank line that ends the head), or None while the head is incomplete."""
    ends = [i + len(sep) for sep in (b"\n\r\n", b"\n\n") if (i := data.find(sep)) >= 0]
    return min(ends) if ends else None


class _Received:
    """An accepted socket as the request handler sees it: reads return the request read for it and then end, so a
    handler never waits on its client; everything else is the socket's."""

    def __init__(self, sock: socket.socket, request: bytearray) -> None:
        self._sock, self._request = sock, request

    def makefile(self, mode: str = "r", buffering: int | None = None) -> Any:
        if "r" not in mode:
            return self._sock.makefile(mode, buffering)  # type: ignore[call-overload]
        return io.BufferedReader(_ReadOnce(self._request))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _ReadOnce(io.RawIOBase):
    def __init__(self, data: bytearray) -> None:
        self._data = memoryview(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self._data))
        buffer[:n] = self._data[:n]
        self._data = self._data[n:]
        return n


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
