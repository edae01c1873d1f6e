"""A raw HTTP/1.1 server on 127.0.0.1 whose answers a test writes byte by byte (kube.httpclient's tests)."""
from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Request:
    conn: int
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


Answer = Callable[[Request], "bytes | None"]


@dataclass
class Scripted:
    """A raw HTTP/1.1 server on 127.0.0.1: `answer` gives the bytes of each response (None: close the connection
    without one). `close_after_answer` closes every connection after its first answer (an idle timeout that
    fired)."""

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
            rfile = conn.makefile("rb")
            while line := rfile.readline():
                method, target, _ = line.decode().split(" ", 2)
                headers = {}
                while (h := rfile.readline()) not in (b"\r\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = rfile.read(int(headers.get("content-length", "0")))
                req = Request(n, method, target, headers, body)
                self.requests.append(req)
                out = self.answer(req)
                if out is None:
                    return
                conn.sendall(out)
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


