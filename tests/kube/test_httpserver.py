"""Servers on ports any pod can reach (kube.httpserver.BoundedHTTPServer): the probe/metrics server of the plugin and
the controller, and the admission webhook over TLS. Idle connections hold no threads, requests reach workers only
whole, slow clients are cut, one client address cannot take the others' connections, probes are answered while
every worker is busy, a body the API server could not send is refused before it is read, and memory stays bounded.
Loopback only; every wait is bounded."""
from __future__ import annotations

import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing
from pathlib import Path

import pytest
from claims import admission_review, request, resource_claim
from tlscerts import ServingCert, make_serving_cert

from api.names import CONFIG_API_VERSION, DEFAULT_DRIVER_NAME
from controller.webhook import MAX_BODY, serve
from kube.httpserver import BoundedHTTPServer, ConnectionLimits, ProbeHandler, serve_health_and_metrics, start

ROOT = Path(__file__).resolve().parents[2]
QUICK = ConnectionLimits(workers=2, max_connections=32, idle_timeout=1.0, request_timeout=2.0)

Server = tuple[BoundedHTTPServer, Callable[[str], int]]  # the server, and GET path -> status


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> ServingCert:
    return make_serving_cert(tmp_path_factory.mktemp("tls"))


def _get(url: str, context: ssl.SSLContext | None = None, timeout: float = 5) -> int:
    with urllib.request.urlopen(url, context=context, timeout=timeout) as resp:
        resp.read()
        return int(resp.status)


def _probe_server(limits: ConnectionLimits | None, _certs: ServingCert) -> Server:
    srv = serve_health_and_metrics(0, lambda: (True, "ok"), "127.0.0.1", **({"limits": limits} if limits else {}))
    return srv, lambda path: _get(f"http://127.0.0.1:{srv.server_address[1]}{path}")


def _webhook_server(limits: ConnectionLimits | None, certs: ServingCert) -> Server:
    srv = serve("127.0.0.1", 0, str(certs.cert), str(certs.key), driver_name=DEFAULT_DRIVER_NAME, compat_nvidia=False,
                **({"limits": limits} if limits else {}))
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    return srv, lambda path: _get(f"https://127.0.0.1:{srv.server_address[1]}{path}", ctx)


@pytest.fixture(params=[_probe_server, _webhook_server], ids=["probes", "webhook"])
def make_server(request: pytest.FixtureRequest, certs: ServingCert) -> Iterator[Callable[..., Server]]:
    started: list[BoundedHTTPServer] = []

    def make(limits: ConnectionLimits | None = None) -> Server:
        srv, get = request.param(limits, certs)
        started.append(srv)
        return srv, get

    yield make
    for srv in started:
        srv.shutdown()
        srv.server_close()


def _connect(srv: BoundedHTTPServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=5)


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closes `sock` (None: still open after `seconds`), sending `trickle` every 0.2 s."""
    start = time.monotonic()
    sock.settimeout(0.2)
    while (elapsed := time.monotonic() - start) < seconds:
        try:
            if trickle:
                sock.sendall(trickle)
            if sock.recv(4096) == b"":
                return elapsed
        except TimeoutError:
            continue
        except OSError:  # reset or broken pipe: closed
            return elapsed
    return None


def test_idle_connections_hold_no_threads_and_healthz_still_answers(make_server: Callable[..., Server]) -> None:
    before = threading.active_count()
    srv, get = make_server()  # the defaults, as the processes run them
    assert get("/healthz") == 200
    with ExitStack() as stack:
        idle = [stack.enter_context(closing(_connect(srv))) for _ in range(200)]
        time.sleep(0.5)  # every connection accepted
        threads = threading.active_count() - before
        # The accepting thread, the workers and the probes' thread, whatever the number of connections.
        assert threads <= 2 + ConnectionLimits().workers, f"{threads} threads for {len(idle)} idle connections"
        start = time.monotonic()
        assert get("/healthz") == 200
        assert time.monotonic() - start < 2, "a fresh /healthz waited behind idle connections"
    assert threading.active_count() - before <= 2 + ConnectionLimits().workers


def test_a_silent_connection_is_closed_after_the_idle_timeout(make_server: Callable[..., Server]) -> None:
    srv, get = make_server(QUICK)
    with closing(_connect(srv)) as sock:
        closed = _closed_within(sock, 5)
    assert closed is not None and closed < QUICK.idle_timeout + 2, closed
    # A client that sends its first bytes (a request line; for TLS, a ClientHello's first byte) and then stops.
    with closing(_connect(srv)) as sock:
        sock.sendall(b"\x16" if _is_tls(srv) else b"GET /healthz HTTP/1.1\r\n")
        closed = _closed_within(sock, 5)
    assert closed is not None and closed < QUICK.idle_timeout + 2, closed
    assert get("/healthz") == 200


def test_a_slowloris_client_is_cut_after_the_request_timeout(make_server: Callable[..., Server]) -> None:
    srv, get = make_server(QUICK)
    with closing(_connect(srv)) as sock:
        tls = _is_tls(srv)
        if tls:  # a TLS client that trickles its ClientHello
            sock.sendall(b"\x16\x03\x01\x02\x00")
            closed = _closed_within(sock, 6, trickle=b"\x00")
        else:  # a request whose headers never end
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            closed = _closed_within(sock, 6, trickle=b"X-Slow: 1\r\n")
    assert closed is not None, "a trickling client was never cut"
    assert closed < QUICK.request_timeout + 2, closed
    assert get("/healthz") == 200


def test_slow_clients_hold_no_workers_while_their_request_arrives(make_server: Callable[..., Server]) -> None:
    """More trickling clients than workers: a fresh request is answered at once, not after their cut-off."""
    srv, get = make_server(QUICK)
    with ExitStack() as stack:
        slow = [stack.enter_context(closing(_connect(srv))) for _ in range(QUICK.workers + 2)]
        for sock in slow:
            sock.sendall(b"\x16\x03\x01\x02\x00" if _is_tls(srv) else b"GET /healthz HTTP/1.1\r\n")
        time.sleep(0.3)
        start = time.monotonic()
        assert get("/healthz") == 200
        assert time.monotonic() - start < 1, f"a fresh /healthz waited {time.monotonic() - start:.1f}s"
        # The request's own bytes arrive in pieces: still one request, answered once complete.
        with closing(_connect(srv)) as sock:
            if _is_tls(srv):
                return
            for piece in (b"GET /hea", b"lthz HTTP/1.0\r\n", b"Host: x\r\n", b"\r\n"):
                sock.sendall(piece)
                time.sleep(0.1)
            assert _read_answer(sock).startswith(b"HTTP/1.0 200")


def _is_tls(srv: BoundedHTTPServer) -> bool:
    return hasattr(srv, "reloader")


# --- the webhook's body limit and memory ----------------------------------------------------------------------

def _post_head(port: int, certs: ServingCert, length: int) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    sock = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5), server_hostname="127.0.0.1")
    sock.sendall(f"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {length}\r\n\r\n".encode())
    return sock


def test_a_body_larger_than_the_api_server_sends_is_refused_before_it_is_read(certs: ServingCert) -> None:
    srv = serve("127.0.0.1", 0, str(certs.cert), str(certs.key), driver_name=DEFAULT_DRIVER_NAME, compat_nvidia=False)
    try:
        # Only the head is sent: the answer must come without the body (which never comes).
        with closing(_post_head(srv.server_address[1], certs, (3 << 20) + 1)) as sock:
            answer = _read_answer(sock)
        assert answer.startswith(b"HTTP/1.0 413"), answer[:80]
        assert b"body must be 1 to 3145728 bytes" in answer
    finally:
        srv.shutdown()
        srv.server_close()


def _read_answer(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    return out


def _rss_peak_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1])  # type: ignore[index]


@pytest.fixture
def webhook_process(certs: ServingCert) -> Iterator[tuple[int, int]]:
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "webhook", "--address", "127.0.0.1", "--port", "0",
                             "--tls-cert-file", str(certs.cert), "--tls-private-key-file", str(certs.key)],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        port = 0
        while not port and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, f"the webhook exited {proc.wait()}"
            if m := re.search(r"https://127\.0\.0\.1:(\d+)/validate", line):
                port = int(m[1])
        assert port, "the webhook never said where it serves"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its log pipe drained
        yield proc.pid, port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_memory_stays_bounded_under_concurrent_oversized_posts(webhook_process: tuple[int, int],
                                                              certs: ServingCert) -> None:
    """Eight clients at once each send a JSON list of just under 16 MiB (over 60 MiB each once parsed): the webhook
    refuses them at their head, so its peak memory barely moves."""
    pid, port = webhook_process
    body = b"[" + b"0," * ((8 << 20) - 2) + b"0]"
    assert MAX_BODY < len(body) < 16 << 20
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    assert _get(f"https://127.0.0.1:{port}/healthz", ctx) == 200
    before = _rss_peak_kib(pid)
    answers: list[bytes] = []

    def post() -> None:
        try:
            with closing(_post_head(port, certs, len(body))) as sock:
                sock.settimeout(30)
                try:
                    sock.sendall(body)
                except OSError:
                    pass  # the webhook answered and closed without reading it
                answers.append(_read_answer(sock))
        except OSError as exc:
            answers.append(repr(exc).encode())

    clients = [threading.Thread(target=post) for _ in range(8)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=60)
    assert _get(f"https://127.0.0.1:{port}/healthz", ctx) == 200
    grown_mib = (_rss_peak_kib(pid) - before) / 1024
    assert grown_mib < 48, f"peak RSS grew {grown_mib:.0f} MiB under 8 oversized POSTs"
    assert all(not a.startswith(b"HTTP/1.0 200") for a in answers), answers


def test_a_review_nested_3000_deep_gets_a_denial_not_a_dropped_connection(certs: ServingCert) -> None:
    deep = {"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mps": "DEEP"}}
    review = admission_review(resource_claim("c", "ns", requests=[request("gpu", DEFAULT_DRIVER_NAME)], config=[
        {"requests": ["gpu"], "opaque": {"driver": DEFAULT_DRIVER_NAME, "parameters": deep}}]))
    # Written as text: json.dumps itself cannot nest that deep.
    body = json.dumps(review).replace('"DEEP"', '{"a": ' * 3000 + "1" + "}" * 3000).encode()
    srv = serve("127.0.0.1", 0, str(certs.cert), str(certs.key), driver_name=DEFAULT_DRIVER_NAME, compat_nvidia=False)
    try:
        ctx = ssl.create_default_context(cafile=str(certs.ca))
        req = urllib.request.Request(f"https://127.0.0.1:{srv.server_address[1]}/validate", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            answer = json.loads(resp.read())["response"]
    finally:
        srv.shutdown()
        srv.server_close()
    assert answer["uid"] == review["request"]["uid"] and answer["allowed"] is False
    assert answer["status"]["message"] == \
        "spec.devices.config[0].opaque.parameters: parameters nested deeper than 32 levels"


def test_a_full_server_keeps_serving_when_the_connection_it_drops_was_readable() -> None:
    """Past max_connections the oldest arriving connection is closed; if it had bytes waiting in the same round,
    the server must go on (it once looked the closed connection up and died)."""
    limits = ConnectionLimits(workers=1, max_connections=4, idle_timeout=5, request_timeout=5)
    srv = serve_health_and_metrics(0, lambda: (True, "ok"), "127.0.0.1", limits=limits)
    try:
        for _ in range(50):
            socks = [_connect(srv) for _ in range(6)]
            for sock in socks:
                sock.sendall(b"GET /he")  # readable, head incomplete
            for sock in socks:
                sock.close()
        assert _get(f"http://127.0.0.1:{srv.server_address[1]}/healthz") == 200
    finally:
        srv.shutdown()
        srv.server_close()


# --- whole requests before workers, per-client and body limits, probes beside the workers ------------------------

class _EchoHandler(ProbeHandler):
    """POST answers its body; POST /wait first waits for the server's `release` (a worker kept busy)."""

    def do_POST(self) -> None:  # noqa: N802 - http.server naming
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.server.handled.append(self.path)  # type: ignore[attr-defined]
        if self.path == "/wait":
            self.server.release.wait(10)  # type: ignore[attr-defined]
        self._reply(200, "application/octet-stream", body)


@pytest.fixture
def echo_server() -> Iterator[Callable[[ConnectionLimits], BoundedHTTPServer]]:
    started: list[BoundedHTTPServer] = []

    def make(limits: ConnectionLimits) -> BoundedHTTPServer:
        srv = BoundedHTTPServer(("127.0.0.1", 0), _EchoHandler, limits=limits)
        srv.release = threading.Event()  # type: ignore[attr-defined]
        srv.handled = []  # type: ignore[attr-defined]
        started.append(start(srv, "echo"))
        return srv

    yield make
    for srv in started:
        srv.release.set()  # type: ignore[attr-defined]
        srv.shutdown()
        srv.server_close()


def _post(srv: BoundedHTTPServer, path: str, body: bytes, *, declared: int | None = None,
          source: str = "127.0.0.1") -> socket.socket:
    """A connection that has sent a POST head declaring `declared` bytes (default: len(body)) and then `body`."""
    sock = socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=5, source_address=(source, 0))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body) if declared is None else declared}"
                 f"\r\n\r\n".encode() + body)
    return sock


def _open(sock: socket.socket) -> bool:
    """Whether the server still holds `sock` open (nothing it sends is expected yet)."""
    sock.settimeout(0)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(5)


def _wait_closed(socks: list[socket.socket], seconds: float = 5) -> None:
    deadline = time.monotonic() + seconds
    while any(_open(s) for s in socks):
        assert time.monotonic() < deadline, f"{sum(_open(s) for s in socks)} connections never closed"
        time.sleep(0.02)


def test_trickling_bodies_hold_no_workers_and_no_server_full_of_them_refuses_a_new_request(
        echo_server: Callable[[ConnectionLimits], BoundedHTTPServer]) -> None:
    """Each connection sends a whole head and then its body byte by byte: none gets a worker, and when they fill
    every connection a new request still gets in (they are still arriving, so the oldest makes room)."""
    limits = ConnectionLimits(workers=1, max_connections=4, max_body=1 << 20)
    srv = echo_server(limits)
    with ExitStack() as stack:
        slow = [stack.enter_context(closing(_post(srv, "/", b"{", declared=1 << 20))) for _ in range(4)]
        for sock in slow:
            sock.sendall(b" ")
        start = time.monotonic()
        with closing(_post(srv, "/", b"hello")) as sock:
            answer = _read_answer(sock)
        assert time.monotonic() - start < 1, f"a request waited {time.monotonic() - start:.1f}s behind slow bodies"
        assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b"\r\n\r\nhello"), answer
        _wait_closed(slow[:1])  # the oldest made room for it
        assert srv.handled == ["/"]  # type: ignore[attr-defined]
        # A body in pieces is one request, handled once it is whole.
        with closing(_post(srv, "/", b"abc", declared=9)) as sock:
            for piece in (b"def", b"ghi"):
                time.sleep(0.1)
                sock.sendall(piece)
            assert _read_answer(sock).endswith(b"\r\n\r\nabcdefghi")


def test_a_trickled_body_is_cut_at_the_request_deadline(
        echo_server: Callable[[ConnectionLimits], BoundedHTTPServer]) -> None:
    """Never silent for idle_timeout, yet cut once request_timeout has passed since it connected."""
    srv = echo_server(ConnectionLimits(idle_timeout=1.0, request_timeout=2.0, max_body=1 << 20))
    with closing(_post(srv, "/", b"{", declared=1 << 20)) as sock:
        closed = _closed_within(sock, 6, trickle=b" ")
    assert closed is not None, "a trickled body was never cut"
    assert closed < 2.0 + 1, closed
    assert srv.handled == []  # type: ignore[attr-defined]


def test_one_client_address_cannot_take_the_connections_of_others(
        echo_server: Callable[[ConnectionLimits], BoundedHTTPServer]) -> None:
    """Past per_client, a client's new connection closes that client's own oldest, not another client's."""
    srv = echo_server(ConnectionLimits(max_connections=8, per_client=4))
    with ExitStack() as stack:
        other = stack.enter_context(closing(socket.create_connection(("127.0.0.1", srv.server_address[1]), 5)))
        flood = [stack.enter_context(closing(socket.create_connection(
            ("127.0.0.1", srv.server_address[1]), timeout=5, source_address=("127.0.0.2", 0)))) for _ in range(10)]
        _wait_closed(flood[:6])  # the sixth is closed when the tenth is accepted
        assert all(_open(sock) for sock in flood[6:])
        # The server's 8 connections were exceeded (11 opened), yet the oldest, another client's, is still held.
        assert _open(other)
        other.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        assert _read_answer(other).startswith(b"HTTP/1.0 200")


def test_bodies_past_the_buffer_budget_close_the_oldest_arriving_body(
        echo_server: Callable[[ConnectionLimits], BoundedHTTPServer]) -> None:
    """Bodies are counted by their declared length from their head on: the one that does not fit closes the
    longest-waiting arriving request holding a body, so memory stays within max_buffered."""
    srv = echo_server(ConnectionLimits(max_body=1000, max_buffered=2500))
    with ExitStack() as stack:
        first, second, third = (stack.enter_context(closing(_post(srv, "/", b"x", declared=1000))) for _ in range(3))
        _wait_closed([first])
        assert _open(second) and _open(third)
        third.sendall(b"y" * 999)
        assert _read_answer(third).endswith(b"\r\n\r\nx" + b"y" * 999)
        # The answered request gave its share back: another full body fits beside the second.
        with closing(_post(srv, "/", b"z" * 1000)) as sock:
            assert _read_answer(sock).endswith(b"z" * 1000)
        assert _open(second)


def test_a_body_longer_than_max_body_goes_to_the_handler_with_nothing_read(
        echo_server: Callable[[ConnectionLimits], BoundedHTTPServer]) -> None:
    """Such a request is not held for its body; its handler reads only what the server read for it (no body), so
    it answers at once instead of waiting on the client."""
    srv = echo_server(ConnectionLimits(workers=1, max_body=100))
    with closing(_post(srv, "/", b"abc", declared=101)) as sock:
        answer = _read_answer(sock)
    assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b"\r\n\r\n"), answer


def test_probes_are_answered_while_every_worker_is_busy(
        echo_server: Callable[[ConnectionLimits], BoundedHTTPServer]) -> None:
    srv = echo_server(ConnectionLimits(workers=1, max_body=100))
    with ExitStack() as stack:
        busy = [stack.enter_context(closing(_post(srv, "/wait", b"w"))) for _ in range(2)]  # one handled, one queued
        deadline = time.monotonic() + 5
        while srv.handled != ["/wait"]:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the worker never took a request"
            time.sleep(0.02)
        for path in ("/healthz", "/readyz", "/livez"):
            start = time.monotonic()
            assert _get(f"http://127.0.0.1:{srv.server_address[1]}{path}") == 200
            assert time.monotonic() - start < 1, f"{path} waited {time.monotonic() - start:.1f}s behind requests"
        srv.release.set()  # type: ignore[attr-defined]
        assert all(_read_answer(sock).endswith(b"\r\n\r\nw") for sock in busy)


def test_a_request_whose_deadline_passed_while_queued_is_not_handled(
        echo_server: Callable[[ConnectionLimits], BoundedHTTPServer]) -> None:
    """Its client has been cut already: handling it would only take a worker from the requests behind it."""
    srv = echo_server(ConnectionLimits(workers=1, request_timeout=1.0, max_body=100))
    with closing(_post(srv, "/wait", b"w")), closing(_post(srv, "/late", b"l")) as late:
        assert _closed_within(late, 5) is not None, "the queued request was never cut"
        srv.release.set()  # type: ignore[attr-defined]
        with closing(_post(srv, "/after", b"a")) as sock:
            assert _read_answer(sock).endswith(b"\r\n\r\na")
    assert srv.handled == ["/wait", "/after"]  # type: ignore[attr-defined]
