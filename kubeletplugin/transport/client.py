"""A unary gRPC call over a unix socket on our HTTP/2 code: one connection, one stream, one answer.

For the plugin's own probes of its sockets (/livez asks the registration socket for GetInfo), so that the plugin
process needs no grpcio. A connection per call: probes are seconds apart and a unix connect costs microseconds.
"""
from __future__ import annotations

import socket
import struct
import time
import urllib.parse
from pathlib import Path
from typing import Any

from kubeletplugin.transport import hpack
from kubeletplugin.transport.http2 import (
    ACK,
    CONTINUATION,
    DATA,
    ENABLE_PUSH,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)
from kubeletplugin.transport.rpc import RpcError, StatusCode

# The largest answer we take (a 16 MiB message, the kubelet's own PodResources limit, and its prefix): the window
# is that large from the start, so the server never waits for a WINDOW_UPDATE.
WINDOW = (16 << 20) + 1024
MAX_FRAME = 16384              # we do not raise SETTINGS_MAX_FRAME_SIZE
_PREFIX = struct.Struct(">BI")
_FRAME_HEADER = struct.Struct(">HBBBI")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise RpcError(StatusCode.UNAVAILABLE, "the server closed the connection")
        buf += chunk
    return bytes(buf)


def unary_call(path: Path | str, method: str, request: Any, response_type: Any, timeout: float) -> Any:
    """Call ``method`` ("/<package>.<Service>/<Method>") on the gRPC server at unix socket ``path``.
    RpcError with the server's status, or UNAVAILABLE / DEADLINE_EXCEEDED when it cannot be reached in time."""
    deadline = time.monotonic() + timeout
    body = request.SerializeToString()
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode()),
               (b":authority", b"localhost"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
               (b"grpc-timeout", f"{max(1, int(timeout * 1000))}m".encode())]
    settings = struct.pack(">HIHI", ENABLE_PUSH, 0, INITIAL_WINDOW_SIZE, WINDOW)
    out = (PREFACE + frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", WINDOW - 65535))
           + frame(HEADERS, END_HEADERS, 1, hpack.encode(headers))
           + frame(DATA, END_STREAM, 1, _PREFIX.pack(0, len(body)) + body))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            sock.sendall(out)
            return _read_answer(sock, response_type, deadline)
    except socket.timeout:
        raise RpcError(StatusCode.DEADLINE_EXCEEDED, f"no answer from {path} within {timeout} s") from None
    except OSError as err:
        raise RpcError(StatusCode.UNAVAILABLE, f"cannot call {path}: {err}") from None


def _read_answer(sock: socket.socket, response_type: Any, deadline: float) -> Any:
    decoder = hpack.Decoder()
    block = bytearray()
    fields: list[hpack.Header] = []
    data = bytearray()
    ended = False
    while True:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        hi, lo, ftype, flags, stream_id = _FRAME_HEADER.unpack(_recv_exact(sock, 9))
        length = (hi << 8) | lo
        if length > MAX_FRAME:
            raise RpcError(StatusCode.INTERNAL, f"the server sent a frame of {length} bytes (at most {MAX_FRAME})")
        payload = _recv_exact(sock, length)
        if ftype == SETTINGS and not flags & ACK:
            sock.sendall(frame(SETTINGS, ACK, 0))
        elif ftype == PING and not flags & ACK:
            sock.sendall(frame(PING, ACK, 0, payload))
        elif ftype == GOAWAY:
            raise RpcError(StatusCode.UNAVAILABLE, f"the server sent GOAWAY: {payload[8:].decode(errors='replace')}")
        elif stream_id != 1:
            continue
        elif ftype == RST_STREAM:
            raise RpcError(StatusCode.UNAVAILABLE, f"the server reset the call (code {struct.unpack('>I', payload)[0]})")
        elif ftype in (HEADERS, CONTINUATION):
            if ftype == HEADERS:
                if flags & PADDED:
                    payload = payload[1:len(payload) - payload[0]]
                if flags & PRIORITY_FLAG:
                    payload = payload[5:]
            block += payload
            if flags & END_HEADERS:
                try:
                    fields += decoder.decode(bytes(block))
                except hpack.HPACKError as err:
                    raise RpcError(StatusCode.INTERNAL, f"the answer's headers: {err}") from None
                block.clear()
        elif ftype == DATA:
            data += payload[1:len(payload) - payload[0]] if flags & PADDED else payload
            if len(data) > WINDOW:
                raise RpcError(StatusCode.RESOURCE_EXHAUSTED, f"answer over {WINDOW} bytes")
        if ftype in (HEADERS, DATA) and flags & END_STREAM:
            ended = True
        if ended and not block:
            return _result(fields, bytes(data), response_type)


def _result(fields: list[hpack.Header], data: bytes, response_type: Any) -> Any:
    got = dict(fields)
    status = got.get(b"grpc-status")
    if status is None:
        raise RpcError(StatusCode.UNKNOWN, f"no grpc-status in the answer (HTTP status {got.get(b':status', b'?')!r})")
    try:
        code = StatusCode(int(status))
    except ValueError:
        code = StatusCode.UNKNOWN
    if code != StatusCode.OK:
        raise RpcError(code, urllib.parse.unquote(got.get(b"grpc-message", b"").decode()))
    if len(data) < 5:
        raise RpcError(StatusCode.INTERNAL, "the answer carries no message")
    flag, length = _PREFIX.unpack_from(data)
    if flag or len(data) != 5 + length:
        raise RpcError(StatusCode.INTERNAL, "the answer is not one uncompressed message")
    return response_type.FromString(data[5:])
