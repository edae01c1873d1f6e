"""A misbehaving gRPC client for the transport's tests: raw HTTP/2 frames on a unix socket, so that a test can do
what no well-kept client does (never read, shrink its window to zero, reset thousands of calls).

It writes only: header blocks as HPACK literals without indexing or Huffman coding (RFC 7541 section 6.2.2),
which every decoder must take. What the server answers is read only when a test asks, and then not decoded.
"""
from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x8
END_STREAM, END_HEADERS = 0x1, 0x4
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
CANCEL = 0x8


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _int(value: int, prefix_bits: int = 7) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([value])
    out, value = bytearray([limit]), value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def header_block(path: str) -> bytes:
    fields = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"),
              ("content-type", "application/grpc"), ("te", "trailers")]
    out = bytearray()
    for name, value in fields:
        out += b"\x00" + _int(len(name)) + name.encode() + _int(len(value)) + value.encode()
    return bytes(out)


def grpc_message(body: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(body)) + body


class RawPeer:
    """One connection. ``window``: the initial stream window it announces (0: the server may send nothing).
    ``drain``: read and drop what the server sends (else nothing is read, and the socket's buffer fills)."""

    def __init__(self, path: Path | str, window: int | None = None, timeout: float = 10.0, drain: bool = False):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        settings = b"" if window is None else struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, window)
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0, settings))
        self.next_stream = 1
        self.received = 0
        if drain:
            threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            self.received += len(chunk)

    def call(self, path: str, body: bytes, end: bool = True) -> int:
        """Starts a unary or server-streaming call; returns its stream ID."""
        stream, self.next_stream = self.next_stream, self.next_stream + 2
        self.sock.sendall(frame(HEADERS, END_HEADERS, stream, header_block(path))
                          + frame(DATA, END_STREAM if end else 0, stream, grpc_message(body)))
        return stream

    def calls_reset(self, path: str, body: bytes, count: int, batch: int = 200) -> int:
        """``count`` calls, each reset right after it was sent (the rapid-reset pattern); returns how many went
        out before the server closed the connection."""
        sent = 0
        while sent < count:
            out = bytearray()
            for _ in range(min(batch, count - sent)):
                stream, self.next_stream = self.next_stream, self.next_stream + 2
                out += (frame(HEADERS, END_HEADERS, stream, header_block(path))
                        + frame(DATA, END_STREAM, stream, grpc_message(body))
                        + frame(RST_STREAM, 0, stream, struct.pack(">I", CANCEL)))
            try:
                self.sock.sendall(out)
            except OSError:
                return sent
            sent += min(batch, count - sent)
        return sent

    def close(self) -> None:
        self.sock.close()
