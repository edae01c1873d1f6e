"""A raw HTTP/1.1 server on 127.0.0.1 whose answers a test writes byte by byte, to play a broken or hostile API
server to kube.client; and a little http proxy (CONNECT tunnels and absolute-URI requests) that records what
it was asked."""
from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Request:
    conn: int
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    client_cert: str = ""          # the common name of the client certificate the TLS peer presented


Answer = Callable[[Request], "bytes | Iterable[bytes] | None"]


@dataclass
class Scripted:
    """A raw HTTP/1.1 server on 127.0.0.1: `answer` gives the bytes of each response (None: close the connection
    without one), or pieces of it to send one after the other (a generator: sending stops when the client goes).
    `close_after_answer` closes every connection after its first answer (an idle timeout that fired)."""

    answer: Answer
    tls: ssl.SSLContext | None = None
    close_after_answer: bool = False
    requests: list[Request] = field(default_factory=list)
    connections: int = 0
    closed: int = 0
    handshake_errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn, self.connections), daemon=True).start()

    def _serve(self, raw: socket.socket, n: int) -> None:
        conn: socket.socket = raw
        try:
            if self.tls is not None:
                try:
                    conn = self.tls.wrap_socket(raw, server_side=True)
                except (ssl.SSLError, OSError) as exc:
                    self.handshake_errors.append(str(exc))
                    return
            cert = conn.getpeercert() if isinstance(conn, ssl.SSLSocket) else None
            common_name = next((v for rdn in (cert or {}).get("subject", ()) for k, v in rdn if k == "commonName"), "")
            rfile = conn.makefile("rb")
            while line := rfile.readline():
                method, target, _ = line.decode().split(" ", 2)
                headers = {}
                while (h := rfile.readline()) not in (b"\r\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = rfile.read(int(headers.get("content-length", "0")))
                req = Request(n, method, target, headers, body, str(common_name))
                self.requests.append(req)
                out = self.answer(req)
                if out is None:
                    return
                for piece in [out] if isinstance(out, bytes) else out:
                    conn.sendall(piece)
                if self.close_after_answer:
                    return
        except OSError:
            return
        finally:
            conn.close()
            self.closed += 1

    def stop(self) -> None:
        self.sock.close()


def response(doc: Any, status: int = 200, chunks: int = 0, headers: str = "") -> bytes:
    """An HTTP/1.1 response carrying `doc` as JSON: with Content-Length, or in `chunks` chunks (and a trailer)."""
    body = json.dumps(doc).encode()
    head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n{headers}"
    if not chunks:
        return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
    step = -(-len(body) // chunks)
    parts = [body[i:i + step] for i in range(0, len(body), step)]
    out = f"{head}Transfer-Encoding: chunked\r\n\r\n".encode()
    out += b"".join(f"{len(p):x};ext=1\r\n".encode() + p + b"\r\n" for p in parts)
    return out + b"0\r\nX-Trailer: yes\r\n\r\n"


@dataclass
class Proxy:
    """An http proxy on 127.0.0.1 in front of `port` (whatever the request names): a CONNECT gets a tunnel, any
    other request is passed on as it came. `heads` holds each request head it got (request line, then the
    headers with lower-case names)."""

    port: int
    heads: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            byte = conn.recv(1)
            if not byte:
                conn.close()
                return
            head += byte
        first, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
        self.heads.append((first, headers))
        upstream = socket.create_connection(("127.0.0.1", self.port))
        if first.startswith("CONNECT "):
            conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            upstream.sendall(head)
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def stop(self) -> None:
        self.sock.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
