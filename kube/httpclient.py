"""HTTP/1.1 to the API server, written and parsed by hand.

Per request, urllib3's pool layers and http.client (which parses every response's headers with the `email`
package) cost about a millisecond of CPU; the API server speaks plain HTTP/1.1 with a handful of headers, so
this client writes the request line and headers itself, parses the status line and headers itself and reads
bodies by Content-Length or chunked encoding.

Each thread keeps one connection to the server alive (threading.local), so callers need no locking and no
pool. A request that fails on a reused connection before any byte of the response arrived (the server closed
the idle connection) is sent once more on a fresh one; every other failure is a ``TransportError``. Streamed
responses (watches) get a connection of their own, which the caller closes.
"""
from __future__ import annotations

import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from io import BufferedReader
from typing import Any, cast

# A header block or a body larger than these is no answer the API server would give: refused, naming the limit,
# instead of growing without bound.
MAX_HEADER_BLOCK = 256 * 1024
MAX_BODY = 256 * 1024 * 1024
_READ_SIZE = 64 * 1024
# Failures that mean the server closed the connection (an idle one it timed out, typically).
_CLOSED = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, ssl.SSLEOFError, ssl.SSLZeroReturnError)


class TransportError(Exception):
    """No (complete, well-formed) answer from the server; the message says what went wrong."""


class _ClosedBeforeResponse(TransportError):
    """The server closed the connection before the first byte of a response."""


class Response:
    """A complete response: status, headers (lower-case names) and body."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


class Server:
    """Where the API server is: scheme, host, port, the path prefix of its URL and the TLS context to use."""

    def __init__(self, url: str, ssl_context: ssl.SSLContext | None, tls_server_name: str | None = None,
                 proxy: str | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"server {url!r}: not an http(s) URL with a host")
        self.url = url
        self.tls = parts.scheme == "https"
        self.hostname = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        self.host_header = host if parts.port is None else f"{host}:{self.port}"
        self.ssl_context = ssl_context if self.tls else None
        if self.tls and self.ssl_context is None:
            self.ssl_context = ssl.create_default_context()
        self.server_name = tls_server_name or self.hostname
        # An http:// proxy: https is tunnelled through CONNECT, http requests name the absolute URL.
        self.proxy: tuple[str, int] | None = None
        if proxy:
            p = urllib.parse.urlsplit(proxy)
            if p.scheme != "http" or not p.hostname:
                raise ValueError(f"proxy {proxy!r}: not an http:// URL with a host")
            self.proxy = (p.hostname, p.port or 80)
        self.origin = f"http://{self.host_header}" if self.proxy and not self.tls else ""


class _Connection:
    __slots__ = ("sock", "rfile")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rfile = cast(BufferedReader, sock.makefile("rb", buffering=_READ_SIZE))

    def close(self) -> None:
        try:
            self.rfile.close()
        finally:
            self.sock.close()


class HttpTransport:
    """Requests to one server, on one kept-alive connection per thread."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self._local = threading.local()

    def request(self, method: str, target: str, headers: dict[str, str], body: bytes | None,
                connect_timeout: float, read_timeout: float) -> Response:
        """`target`: the path and query (without the server URL's prefix)."""
        data = self._encode(method, target, headers, body)
        conn: _Connection | None = getattr(self._local, "conn", None)
        self._local.conn = None                # only a connection left clean goes back
        for fresh in ((False, True) if conn is not None else (True,)):
            if fresh:
                conn = self._connect(connect_timeout)
            assert conn is not None
            try:
                status, resp_headers = self._send(conn, data, read_timeout)
                resp_body, reusable = _read_body(conn.rfile, method, status, resp_headers)
            except _ClosedBeforeResponse:
                conn.close()
                if fresh:
                    raise
                continue                       # the server had closed the idle connection: once more, fresh
            except BaseException:
                conn.close()
                raise
            if reusable:
                self._local.conn = conn
            else:
                conn.close()
            return Response(status, resp_headers, resp_body)
        raise AssertionError("unreachable")

    def open_stream(self, method: str, target: str, headers: dict[str, str], body: bytes | None,
                    connect_timeout: float, read_timeout: float) -> "StreamResponse":
        """A response whose body is read as it comes (a watch), on a connection of its own."""
        conn = self._connect(connect_timeout)
        try:
            status, resp_headers = self._send(conn, self._encode(method, target, headers, body), read_timeout)
        except BaseException:
            conn.close()
            raise
        return StreamResponse(conn, method, status, resp_headers)

    def close(self) -> None:
        """Closes the calling thread's kept-alive connection (other threads' close with their thread)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _encode(self, method: str, target: str, headers: dict[str, str], body: bytes | None) -> bytes:
        lines = [f"{method} {self.server.origin}{self.server.prefix}{target} HTTP/1.1", f"Host: {self.server.host_header}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return head + body if body else head

    def _connect(self, timeout: float) -> _Connection:
        s = self.server
        try:
            sock = socket.create_connection(s.proxy or (s.hostname, s.port), timeout=timeout)
        except OSError as exc:
            via = f" through proxy {s.proxy[0]}:{s.proxy[1]}" if s.proxy else ""
            raise TransportError(f"connecting to {s.host_header}{via}: {type(exc).__name__}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if s.proxy and s.ssl_context is not None:
                _tunnel(sock, s.host_header)
            if s.ssl_context is not None:
                sock = s.ssl_context.wrap_socket(sock, server_hostname=s.server_name)
        except OSError as exc:
            sock.close()
            raise TransportError(f"TLS with {s.host_header}: {type(exc).__name__}: {exc}") from exc
        return _Connection(sock)

    @staticmethod
    def _send(conn: _Connection, data: bytes, read_timeout: float) -> tuple[int, dict[str, str]]:
        try:
            conn.sock.settimeout(read_timeout)
            conn.sock.sendall(data)
            first = conn.rfile.readline(MAX_HEADER_BLOCK + 1)
        except _CLOSED as exc:
            raise _ClosedBeforeResponse(f"{type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        if not first:
            raise _ClosedBeforeResponse("remote end closed the connection without a response")
        try:
            return _read_head(conn.rfile, first)
        except OSError as exc:
            raise TransportError(f"reading the response headers: {type(exc).__name__}: {exc}") from exc


def _tunnel(sock: socket.socket, host_header: str) -> None:
    """Asks an http proxy for a tunnel to the server (CONNECT); the TLS handshake then runs through it."""
    sock.sendall(f"CONNECT {host_header} HTTP/1.1\r\nHost: {host_header}\r\n\r\n".encode("latin-1"))
    with sock.makefile("rb", buffering=0) as rfile:     # unbuffered: no byte of the TLS handshake is taken
        first = _readline_unbuffered(rfile)
        if not first:
            raise TransportError(f"the proxy closed the connection instead of a tunnel to {host_header}")
        status, _ = _read_head(rfile, first, _readline_unbuffered)
    if status != 200:
        raise TransportError(f"the proxy refused a tunnel to {host_header}: HTTP {status}")


def _readline_unbuffered(rfile: Any, limit: int = MAX_HEADER_BLOCK + 1) -> bytes:
    line = bytearray()
    while len(line) < limit and not line.endswith(b"\n"):
        byte = rfile.read(1)
        if not byte:
            break
        line += byte
    return bytes(line)


class StreamResponse:
    """A response whose body is read as it arrives; close() (or shutdown() from another thread) ends it."""

    def __init__(self, conn: _Connection, method: str, status: int, headers: dict[str, str]) -> None:
        self._conn, self.status, self.headers = conn, status, headers
        self._chunks = _iter_body(conn.rfile, method, status, headers)

    def iter_chunks(self) -> Iterator[bytes]:
        """The body, piece by piece as it arrives (chunked encoding removed)."""
        try:
            yield from self._chunks
        except OSError as exc:
            raise TransportError(f"reading a streamed response: {type(exc).__name__}: {exc}") from exc

    def read(self) -> bytes:
        """The rest of the body (bounded by MAX_BODY)."""
        return _join_bounded(self.iter_chunks())

    def shutdown(self) -> None:
        """Ends a read blocked in another thread."""
        try:
            self._conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "StreamResponse":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_head(rfile: Any, first: bytes, readline: Callable[[Any, int], bytes] | None = None) -> tuple[int, dict[str, str]]:
    """The status and headers of a response whose status line is `first` (1xx interim responses skipped)."""
    read_line = readline or (lambda f, limit: f.readline(limit))
    while True:
        parts = first.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise TransportError(f"not an HTTP/1.x status line: {first[:100]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        if parts[0] == b"HTTP/1.0":
            headers["connection"] = "close"     # HTTP/1.0 connections are not kept alive here
        total = len(first)
        while True:
            line = read_line(rfile, MAX_HEADER_BLOCK - total + 1)
            total += len(line)
            if total > MAX_HEADER_BLOCK:
                raise TransportError(f"response header block larger than {MAX_HEADER_BLOCK} bytes")
            if not line:
                raise TransportError("the server closed the connection inside the response headers")
            if line in (b"\r\n", b"\n"):
                break
            name, sep, value = line.partition(b":")
            if not sep:
                raise TransportError(f"malformed response header line {line[:100]!r}")
            key = name.strip().lower().decode("latin-1")
            text = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        if not 100 <= status < 200 or status == 101:
            return status, headers
        first = read_line(rfile, MAX_HEADER_BLOCK + 1)
        if not first:
            raise TransportError("the server closed the connection after an interim response")


def _read_body(rfile: BufferedReader, method: str, status: int, headers: dict[str, str]) -> tuple[bytes, bool]:
    """The whole body and whether the connection may carry another request."""
    try:
        length = _content_length(headers)
        if _bodiless(method, status):
            body = b""
        elif length is not None and "chunked" not in headers.get("transfer-encoding", ""):
            if length > MAX_BODY:
                raise TransportError(f"response body of {length} bytes is larger than {MAX_BODY} bytes")
            body = rfile.read(length)
            if len(body) != length:
                raise TransportError(f"the server closed the connection after {len(body)} of {length} body bytes")
        else:
            body = _join_bounded(_iter_body(rfile, method, status, headers))
    except OSError as exc:
        raise TransportError(f"reading the response body: {type(exc).__name__}: {exc}") from exc
    delimited = _bodiless(method, status) or length is not None or "chunked" in headers.get("transfer-encoding", "")
    return body, delimited and "close" not in headers.get("connection", "").lower()


def _iter_body(rfile: BufferedReader, method: str, status: int, headers: dict[str, str]) -> Iterator[bytes]:
    if _bodiless(method, status):
        return
    if "chunked" in headers.get("transfer-encoding", ""):
        while True:
            line = rfile.readline(1024)
            size_text = line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                if not line:
                    raise TransportError("the server closed the connection inside a chunked body") from None
                raise TransportError(f"malformed chunk size line {line[:100]!r}") from None
            if size == 0:
                _skip_trailers(rfile)
                return
            if size > MAX_BODY:
                raise TransportError(f"response chunk of {size} bytes is larger than {MAX_BODY} bytes")
            data = rfile.read(size)
            if len(data) != size or rfile.readline(3) not in (b"\r\n", b"\n"):
                raise TransportError("the server closed the connection inside a chunked body")
            yield data
    length = _content_length(headers)
    if length is not None:
        left = length
        while left > 0:
            data = rfile.read1(min(left, _READ_SIZE))
            if not data:
                raise TransportError(f"the server closed the connection after {length - left} of {length} body bytes")
            left -= len(data)
            yield data
        return
    while data := rfile.read1(_READ_SIZE):
        yield data                                  # delimited by the end of the connection


def _skip_trailers(rfile: BufferedReader) -> None:
    total = 0
    while True:
        line = rfile.readline(MAX_HEADER_BLOCK + 1)
        total += len(line)
        if total > MAX_HEADER_BLOCK:
            raise TransportError(f"response trailer block larger than {MAX_HEADER_BLOCK} bytes")
        if line in (b"\r\n", b"\n", b""):
            return


def _join_bounded(chunks: Iterator[bytes]) -> bytes:
    parts, total = [], 0
    for chunk in chunks:
        total += len(chunk)
        if total > MAX_BODY:
            raise TransportError(f"response body larger than {MAX_BODY} bytes")
        parts.append(chunk)
    return b"".join(parts)


def _content_length(headers: dict[str, str]) -> int | None:
    text = headers.get("content-length")
    if text is None:
        return None
    if not text.isdigit():
        raise TransportError(f"malformed Content-Length {text[:40]!r}")
    return int(text)


def _bodiless(method: str, status: int) -> bool:
    return method == "HEAD" or status in (204, 304) or 100 <= status < 200
