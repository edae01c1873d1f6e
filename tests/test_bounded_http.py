"""Servers on ports any pod can reach (kube.httpserver.BoundedHTTPServer): the probe/metrics server of the plugin and
the controller, and the admission webhook over TLS. Idle connections hold no threads, slow clients are cut, a body
the API server could not send is refused before it is read, and the webhook's memory stays bounded. Loopback only;
every wait is bounded."""
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

from api.names import DEFAULT_DRIVER_NAME
from controller.webhook import MAX_BODY, serve
from kube.httpserver import BoundedHTTPServer, ConnectionLimits, serve_health_and_metrics
from tlscerts import ServingCert, make_serving_cert

ROOT = Path(__file__).resolve().parents[1]
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
        # The accepting thread and the workers, whatever the number of connections.
        assert threads <= 1 + ConnectionLimits().workers, f"{threads} threads for {len(idle)} idle connections"
        start = time.monotonic()
        assert get("/healthz") == 200
        assert time.monotonic() - start < 2, "a fresh /healthz waited behind idle connections"
    assert threading.active_count() - before <= 1 + ConnectionLimits().workers


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
    from test_webhook import GOOD_MPS, admission, claim

    review = admission(claim((DEFAULT_DRIVER_NAME, {**GOOD_MPS, "sharing": {"strategy": "MPS", "mps": "DEEP"}})))
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
