"""gRPC over our HTTP/2 connections (kubeletplugin.transport.http2): method routing, message framing, status.

A service is a table of ``Method``s keyed by path ("/<package>.<Service>/<Method>"), built from the generated
``*_pb2`` descriptors (``service_methods``), never from the ``*_pb2_grpc`` modules, which import grpcio.
Unary calls run on the server's thread pool, so a slow prepare never holds up another call on the kubelet's one
connection; a server-streaming call runs its blocking generator in a thread of its own until it ends, the client
cancels, or the connection goes away (``CallContext.add_callback`` hears of the last two).

Errors are answered as grpcio answers them: unknown method UNIMPLEMENTED, a compressed message UNIMPLEMENTED, a
message over 4 MiB RESOURCE_EXHAUSTED, a request that does not parse INTERNAL, a handler exception UNKNOWN with
its text, ``context.abort(code, details)`` with that status, a reply after ``grpc-timeout`` DEADLINE_EXCEEDED.
"""
from __future__ import annotations

import enum
import struct
import threading
import time
import urllib.parse
from concurrent.futures import Executor
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping, NoReturn

from kubeletplugin.transport.hpack import Header
from kubeletplugin.transport.http2 import ServerConnection, Stream

MAX_MESSAGE = 4 * 1024 * 1024                  # grpcio's default receive limit
_PREFIX = struct.Struct(">BI")
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_RESPONSE_HEADERS: list[Header] = [(b":status", b"200"), (b"content-type", b"application/grpc")]


class StatusCode(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class RpcError(Exception):
    """Ends a call with ``code`` and ``details`` (raised by ``CallContext.abort``)."""

    def __init__(self, code: StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class CallContext:
    """What a handler knows of its call: the deadline, whether the client is still there, and abort."""

    def __init__(self, stream: Stream, deadline: float | None):
        self._stream = stream
        self.deadline = deadline                # time.monotonic() value, None without grpc-timeout

    def abort(self, code: StatusCode, details: str) -> NoReturn:
        raise RpcError(code, details)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def is_active(self) -> bool:
        return not self._stream.reset

    def add_callback(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs when the client cancels the call or the connection goes away."""
        self._stream.on_reset(callback)


Handler = Callable[[Any, CallContext], Any]


class Method:
    """One method of a service (a plain class: a dataclass would cost ~0.5 ms before the sockets listen)."""

    __slots__ = ("request_type", "handler", "server_streaming")

    def __init__(self, request_type: Any, handler: Handler, server_streaming: bool = False):
        self.request_type = request_type       # the generated message class (FromString parses)
        self.handler = handler                 # unary: returns the response; streaming: returns an iterator
        self.server_streaming = server_streaming


def service_methods(pb: ModuleType, service: str, impl: object) -> dict[str, Method]:
    """The methods of ``service`` (as named in the .proto of the ``*_pb2`` module ``pb``) bound to the
    same-named methods of ``impl``."""
    desc = pb.DESCRIPTOR.services_by_name.get(service)
    if desc is None:
        raise ValueError(f"{pb.__name__} has no service {service!r}")
    methods = {}
    for m in desc.methods:
        handler = getattr(impl, m.name, None)
        if handler is None:
            raise ValueError(f"{type(impl).__name__} does not implement {desc.full_name}.{m.name}")
        methods[f"/{desc.full_name}/{m.name}"] = Method(getattr(pb, m.input_type.name), handler,
                                                          m.server_streaming)
    return methods


def parse_timeout(value: bytes) -> float | None:
    """Seconds of a ``grpc-timeout`` header ("<up to 8 digits><H|M|S|m|u|n>"), None if malformed."""
    digits, unit = value[:-1], value[-1:]
    if not digits.isdigit() or len(digits) > 8 or unit not in _TIMEOUT_UNITS:
        return None
    return int(digits) * _TIMEOUT_UNITS[unit]


def _percent_encode(message: str) -> bytes:
    # The gRPC spec: grpc-message is percent-encoded UTF-8; printable ASCII other than '%' goes as is.
    return urllib.parse.quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode()


def status_trailers(code: StatusCode, message: str = "") -> list[Header]:
    trailers: list[Header] = [(b"grpc-status", str(int(code)).encode())]
    if message:
        trailers.append((b"grpc-message", _percent_encode(message)))
    return trailers


def _log_exception(method: str) -> None:
    import structlog  # only on this path: a handler bug is rare, and the server's import stays small

    structlog.get_logger("grpc").exception("handler raised", method=method)


class Dispatcher:
    """The application of a server's HTTP/2 connections: routes each request to its ``Method``."""

    def __init__(self, methods: Mapping[str, Method], pool: Executor, name: str = "grpc"):
        self.methods = dict(methods)
        self.pool = pool
        self.name = name

    def __call__(self, conn: ServerConnection, stream: Stream) -> None:
        """Called on the connection's thread with a complete request: hand it on, never block here."""
        method = self.methods.get(_header(stream.headers, b":path").decode("utf-8", "replace"))
        if method is not None and method.server_streaming:
            threading.Thread(target=self._run, args=(conn, stream, method), name=f"{self.name}-stream",
                             daemon=True).start()
        else:
            try:
                self.pool.submit(self._run, conn, stream, method)
            except RuntimeError:                        # the pool is shut down: the server is stopping
                conn.send(stream, _RESPONSE_HEADERS + status_trailers(StatusCode.UNAVAILABLE, "the server is stopping"),
                          end_stream=True)

    def _run(self, conn: ServerConnection, stream: Stream, method: Method | None) -> None:
        try:
            self._serve(conn, stream, method)
        except Exception:   # noqa: BLE001 - the last guard: a bug here must not kill the pool thread silently
            _log_exception(_header(stream.headers, b":path").decode("utf-8", "replace"))
            conn.send(stream, _RESPONSE_HEADERS + status_trailers(StatusCode.INTERNAL, "server error"),
                      end_stream=True)

    def _serve(self, conn: ServerConnection, stream: Stream, method: Method | None) -> None:
        headers = stream.headers
        path = _header(headers, b":path").decode("utf-8", "replace")
        if _header(headers, b":method") != b"POST":
            conn.send(stream, [(b":status", b"405")], end_stream=True)
            return
        content_type = _header(headers, b"content-type")
        if not content_type.startswith(b"application/grpc"):
            # The gRPC spec: 415, so that plain HTTP clients do not read a gRPC answer.
            conn.send(stream, [(b":status", b"415"), (b"content-type", b"text/plain")]
                      + status_trailers(StatusCode.INTERNAL, f"content-type {content_type.decode('latin-1')!r} "
                                                             "is not application/grpc"), end_stream=True)
            return
        timeout = _header(headers, b"grpc-timeout")
        seconds = parse_timeout(timeout) if timeout else None
        deadline = time.monotonic() + seconds if seconds is not None else None
        try:
            if method is None:
                raise RpcError(StatusCode.UNIMPLEMENTED, f"unknown method {path}")
            request = method.request_type.FromString(self._message(stream))
        except RpcError as err:
            conn.send(stream, _RESPONSE_HEADERS + status_trailers(err.code, err.details), end_stream=True)
            return
        except Exception as err:   # noqa: BLE001 - protobuf's DecodeError and kin: the client sent garbage
            conn.send(stream, _RESPONSE_HEADERS + status_trailers(
                StatusCode.INTERNAL, f"cannot parse the request of {path}: {err}"), end_stream=True)
            return
        context = CallContext(stream, deadline)
        if method.server_streaming:
            self._stream_out(conn, stream, method, request, context, path)
            return
        try:
            response = method.handler(request, context)
            body = response.SerializeToString()
        except RpcError as err:
            conn.send(stream, _RESPONSE_HEADERS + status_trailers(err.code, err.details), end_stream=True)
            return
        except Exception as err:   # noqa: BLE001 - a handler bug answers its call; the server goes on
            _log_exception(path)
            conn.send(stream, _RESPONSE_HEADERS + status_trailers(
                StatusCode.UNKNOWN, f"Exception calling application: {err}"), end_stream=True)
            return
        if deadline is not None and time.monotonic() > deadline:
            conn.send(stream, _RESPONSE_HEADERS + status_trailers(StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
                      end_stream=True)
            return
        conn.send(stream, _RESPONSE_HEADERS, _PREFIX.pack(0, len(body)) + body, status_trailers(StatusCode.OK))

    @staticmethod
    def _message(stream: Stream) -> bytes:
        """The one message of a unary request (or the first of a streaming one)."""
        body = stream.body
        if len(body) < 5:
            raise RpcError(StatusCode.INTERNAL, "the request carries no message")
        flag, length = _PREFIX.unpack_from(body)
        if length > MAX_MESSAGE:
            raise RpcError(StatusCode.RESOURCE_EXHAUSTED,
                           f"Received message larger than max ({length} vs. {MAX_MESSAGE})")
        if flag == 1:
            raise RpcError(StatusCode.UNIMPLEMENTED, "compressed messages are not supported "
                                                     "(no grpc-encoding is accepted)")
        if flag != 0:
            raise RpcError(StatusCode.INTERNAL, f"message flag {flag} (0 or 1 expected)")
        if len(body) != 5 + length:
            raise RpcError(StatusCode.INTERNAL, f"the request's body is {len(body) - 5} bytes after its prefix, "
                                                f"the prefix says {length} (exactly one message expected)")
        return bytes(body[5:])

    @staticmethod
    def _stream_out(conn: ServerConnection, stream: Stream, method: Method, request: Any, context: CallContext,
                    path: str) -> None:
        messages: Iterator[Any] = iter(method.handler(request, context))
        sent_headers = False
        try:
            for msg in messages:
                body = msg.SerializeToString()
                if not conn.send(stream, None if sent_headers else _RESPONSE_HEADERS, _PREFIX.pack(0, len(body)) + body):
                    return                                  # the client cancelled or went away
                sent_headers = True
        except RpcError as err:
            trailers = status_trailers(err.code, err.details)
        except Exception as err:   # noqa: BLE001 - a handler bug ends its stream; the server goes on
            _log_exception(path)
            trailers = status_trailers(StatusCode.UNKNOWN, f"Exception iterating responses: {err}")
        else:
            trailers = status_trailers(StatusCode.OK)
        finally:
            close = getattr(messages, "close", None)
            if close is not None:
                close()                                     # runs the generator's clean-up now
        if sent_headers:
            conn.send(stream, trailers=trailers)
        else:
            conn.send(stream, _RESPONSE_HEADERS + trailers, end_stream=True)


def _header(headers: list[Header], name: bytes) -> bytes:
    for n, v in headers:
        if n == name:
            return v
    return b""
