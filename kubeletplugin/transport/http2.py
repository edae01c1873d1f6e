"""The server side of one HTTP/2 connection (RFC 9113) on a blocking socket, as gRPC uses it.

``ServerConnection.serve`` runs in the connection's own thread: it reads frames until the peer goes away and
hands every complete request (headers and body, ``Stream``) to the application, which answers from any thread
with ``send``. Between frames the thread sleeps in ``recv``: an idle connection costs nothing.

Strict and bounded: a frame, header block, request body or number of streams over our limits, or anything the
RFC calls a connection error, gets GOAWAY with its error code and the connection closes; a stream error resets
that stream only. Flow control both ways: we never send more than the peer's windows allow (a sender waits for
its WINDOW_UPDATE) and credit the peer for what we received. No server push, no priorities (PRIORITY is read
and ignored), no HPACK dynamic table on our side.
"""
from __future__ import annotations

import socket
import struct
import threading
from typing import Callable, Iterable

from kubeletplugin.transport import hpack
from kubeletplugin.transport.hpack import Header

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (section 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# Flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# Error codes (section 7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT, STREAM_CLOSED, \
    FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, CONNECT_ERROR, ENHANCE_YOUR_CALM, \
    INADEQUATE_SECURITY, HTTP_1_1_REQUIRED = range(14)
# Settings (section 6.5.2).
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, \
    MAX_HEADER_LIST_SIZE = range(1, 7)

DEFAULT_WINDOW = 65535
MIN_FRAME_SIZE = 16384
MAX_WINDOW = 2**31 - 1
_FRAME_HEADER = struct.Struct(">HBBBI")    # 24-bit length as 16 + 8 bits, type, flags, stream id


class Limits:
    """What we accept from a peer. The defaults suit the kubelet: small calls, one client."""

    __slots__ = ("max_concurrent_streams", "initial_window", "max_header_list", "max_header_block", "max_body")

    def __init__(self, max_concurrent_streams: int = 100,
                 initial_window: int = 1 << 20,          # per stream; the connection window is raised to this too
                 max_header_list: int = 16384,           # decoded, in RFC 7541 section 4.1 sizes (advertised)
                 max_header_block: int = 65536,          # encoded bytes across HEADERS + CONTINUATION
                 max_body: int = 4 * 1024 * 1024 + 5):   # one gRPC message of 4 MiB and its 5-byte prefix
        self.max_concurrent_streams = max_concurrent_streams
        self.initial_window = initial_window
        self.max_header_list = max_header_list
        self.max_header_block = max_header_block
        self.max_body = max_body


class ProtocolError(Exception):
    """A connection error (section 5.4.1): GOAWAY with ``code``, then close."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class StreamError(Exception):
    """A stream error (section 5.4.2): RST_STREAM with ``code``; the connection goes on."""

    def __init__(self, stream_id: int, code: int, message: str):
        super().__init__(message)
        self.stream_id, self.code = stream_id, code


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME_HEADER.pack(n >> 8, n & 0xFF, ftype, flags, stream_id & MAX_WINDOW) + payload


class Stream:
    """One request. ``headers`` and ``body`` are complete when the application gets it (``too_large``: the
    body went over Limits.max_body and the rest is discarded). Plain classes here, not dataclasses: each of
    those costs ~0.5 ms at import, before the sockets listen."""

    __slots__ = ("id", "send_window", "recv_window", "headers", "body", "too_large", "remote_closed",
                 "local_closed", "reset", "unacked", "_on_reset")

    def __init__(self, stream_id: int, send_window: int, recv_window: int, headers: list[Header]):
        self.id = stream_id
        self.send_window = send_window
        self.recv_window = recv_window
        self.headers = headers
        self.body = bytearray()
        self.too_large = False
        self.remote_closed = False            # END_STREAM received
        self.local_closed = False             # END_STREAM sent
        self.reset = False                    # RST_STREAM either way, or the connection is gone
        self.unacked = 0                      # received bytes not yet credited back with WINDOW_UPDATE
        self._on_reset: list[Callable[[], None]] = []

    def on_reset(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once, from the connection's thread) if the stream is reset or the connection lost;
        at once if that already happened."""
        self._on_reset.append(callback)
        if self.reset:
            self._fire()

    def _fire(self) -> None:
        callbacks, self._on_reset = self._on_reset, []
        for callback in callbacks:
            callback()


class _Block:
    """A header block in flight (HEADERS without END_HEADERS, then CONTINUATION)."""

    __slots__ = ("stream_id", "end_stream", "fragments")

    def __init__(self, stream_id: int, end_stream: bool, fragments: bytearray):
        self.stream_id, self.end_stream, self.fragments = stream_id, end_stream, fragments


class ServerConnection:
    def __init__(self, sock: socket.socket, on_request: Callable[[ServerConnection, Stream], None],
                 limits: Limits = Limits()):
        self.sock = sock
        self._on_request = on_request
        self.limits = limits
        self._rfile = sock.makefile("rb", buffering=65536)
        self._decoder = hpack.Decoder()
        self._lock = threading.Lock()                 # streams, windows, peer settings
        self._window_open = threading.Condition(self._lock)
        self._wlock = threading.Lock()                # one writer on the socket at a time
        self._streams: dict[int, Stream] = {}
        self._last_stream_id = 0
        self._send_window = DEFAULT_WINDOW             # connection-level, ours to spend
        self._recv_window = DEFAULT_WINDOW
        self._recv_unacked = 0
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = MIN_FRAME_SIZE
        self._table_update: int | None = None          # peer changed HEADER_TABLE_SIZE: tell its decoder
        self._block: _Block | None = None
        self._closed = False
        self._peer_goaway = False
        self._going_away = False

    # ----- reading ------------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Run the connection until the peer closes it, a connection error, or ``close``."""
        try:
            self._send_raw(self._server_preface())
            if self._read_exact(len(PREFACE)) != PREFACE:
                raise ProtocolError(PROTOCOL_ERROR, "the connection does not start with the HTTP/2 preface")
            first = True
            while True:
                ftype, flags, stream_id, payload = self._read_frame()
                if first and (ftype != SETTINGS or flags & ACK):
                    raise ProtocolError(PROTOCOL_ERROR, "the first frame after the preface must be SETTINGS")
                first = False
                try:
                    self._handle(ftype, flags, stream_id, payload)
                except StreamError as err:
                    self._reset_stream(err.stream_id, err.code)
        except ProtocolError as err:
            self._goaway(err.code, str(err))
        except (EOFError, OSError, ValueError):
            pass                                        # the peer went away (or close() shut the socket)
        finally:
            self._teardown()

    def _read_exact(self, n: int) -> bytes:
        data: bytes | None = self._rfile.read(n)
        if data is None or len(data) < n:
            raise EOFError("connection closed")
        return data

    def _read_frame(self) -> tuple[int, int, int, bytes]:
        hi, lo, ftype, flags, stream_id = _FRAME_HEADER.unpack(self._read_exact(9))
        length = (hi << 8) | lo
        stream_id &= MAX_WINDOW
        if length > MIN_FRAME_SIZE:                     # our SETTINGS_MAX_FRAME_SIZE is the minimum
            raise ProtocolError(FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds the maximum {MIN_FRAME_SIZE}")
        return ftype, flags, stream_id, self._read_exact(length) if length else b""

    def _server_preface(self) -> bytes:
        lim = self.limits
        settings = b"".join(struct.pack(">HI", k, v) for k, v in (
            (ENABLE_PUSH, 0), (MAX_CONCURRENT_STREAMS, lim.max_concurrent_streams),
            (INITIAL_WINDOW_SIZE, lim.initial_window), (MAX_FRAME_SIZE, MIN_FRAME_SIZE),
            (MAX_HEADER_LIST_SIZE, lim.max_header_list)))
        out = frame(SETTINGS, 0, 0, settings)
        if lim.initial_window > DEFAULT_WINDOW:
            out += frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", lim.initial_window - DEFAULT_WINDOW))
            self._recv_window = lim.initial_window
        return out

    def _handle(self, ftype: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is not None and ftype != CONTINUATION:
            raise ProtocolError(PROTOCOL_ERROR, f"frame type {ftype} inside the header block of stream "
                                                f"{self._block.stream_id} (CONTINUATION expected)")
        if ftype == DATA:
            self._on_data(flags, stream_id, payload)
        elif ftype == HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif ftype == CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif ftype == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif ftype == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif ftype == PING:
            if stream_id:
                raise ProtocolError(PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise ProtocolError(FRAME_SIZE_ERROR, f"PING of {len(payload)} bytes (8 expected)")
            if not flags & ACK:
                self._send_raw(frame(PING, ACK, 0, payload))
        elif ftype == RST_STREAM:
            self._on_rst_stream(stream_id, payload)
        elif ftype == GOAWAY:
            if stream_id:
                raise ProtocolError(PROTOCOL_ERROR, "GOAWAY on a stream")
            with self._lock:
                self._peer_goaway = True
                idle = not self._streams
            if idle:
                raise EOFError("the peer went away")
        elif ftype == PRIORITY:
            if not stream_id:
                raise ProtocolError(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                raise StreamError(stream_id, FRAME_SIZE_ERROR, "PRIORITY of the wrong size")
        elif ftype == PUSH_PROMISE:
            raise ProtocolError(PROTOCOL_ERROR, "a client cannot push")
        # Any other type is an extension we do not know: ignored (section 5.5).

    def _unpad(self, flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ProtocolError(PROTOCOL_ERROR, "padding as long as the frame")
        return payload[1:len(payload) - payload[0]]

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "HEADERS on stream 0")
        fragment = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(fragment) < 5:
                raise ProtocolError(FRAME_SIZE_ERROR, "HEADERS too short for its priority fields")
            fragment = fragment[5:]
        self._block = _Block(stream_id, bool(flags & END_STREAM), bytearray(fragment))
        self._check_block_size()
        if flags & END_HEADERS:
            self._end_block()

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is None or self._block.stream_id != stream_id:
            raise ProtocolError(PROTOCOL_ERROR, f"CONTINUATION on stream {stream_id} without a header block to continue")
        self._block.fragments += payload
        self._check_block_size()
        if flags & END_HEADERS:
            self._end_block()

    def _check_block_size(self) -> None:
        assert self._block is not None
        if len(self._block.fragments) > self.limits.max_header_block:
            raise ProtocolError(ENHANCE_YOUR_CALM, f"header block over {self.limits.max_header_block} bytes")

    def _end_block(self) -> None:
        block, self._block = self._block, None
        assert block is not None
        try:
            # Decoded whole even when we refuse the stream: the peer's table must stay in step with ours.
            headers = self._decoder.decode(bytes(block.fragments))
        except hpack.HPACKError as err:
            raise ProtocolError(COMPRESSION_ERROR, f"header block: {err}") from None
        sid = block.stream_id
        with self._lock:
            stream = self._streams.get(sid)
        if stream is not None:                          # trailers of a request: gRPC clients send none
            if stream.remote_closed:
                raise StreamError(sid, STREAM_CLOSED, "HEADERS after the end of the stream")
            if not block.end_stream:
                raise StreamError(sid, PROTOCOL_ERROR, "trailers without END_STREAM")
            self._remote_end(stream)
            return
        if sid % 2 == 0 or sid <= self._last_stream_id:
            raise ProtocolError(PROTOCOL_ERROR, f"new stream {sid} must be odd and above {self._last_stream_id}")
        self._last_stream_id = sid
        if self._going_away:
            raise StreamError(sid, REFUSED_STREAM, "the server is shutting down")
        with self._lock:
            if len(self._streams) >= self.limits.max_concurrent_streams:
                raise StreamError(sid, REFUSED_STREAM, "too many concurrent streams")
            stream = Stream(sid, self._peer_initial_window, self.limits.initial_window, headers)
            self._streams[sid] = stream
        size = sum(len(n) + len(v) + hpack.ENTRY_OVERHEAD for n, v in headers)
        if size > self.limits.max_header_list:
            # Section 10.5.1: refuse the request, keep the connection (431 Request Header Fields Too Large).
            self.send(stream, [(b":status", b"431")], end_stream=True)
            return
        if block.end_stream:
            self._remote_end(stream)

    def _remote_end(self, stream: Stream) -> None:
        stream.remote_closed = True
        if not stream.too_large and not stream.reset and not stream.local_closed:
            self._on_request(self, stream)
        self._forget_if_done(stream)

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "DATA on stream 0")
        n = len(payload)
        credit = 0
        with self._lock:
            if n > self._recv_window:
                raise ProtocolError(FLOW_CONTROL_ERROR, f"DATA of {n} bytes beyond the connection window "
                                                        f"({self._recv_window})")
            self._recv_window -= n
            self._recv_unacked += n                      # bytes we hold no more than the limits allow
            if self._recv_unacked >= self.limits.initial_window // 2:
                credit, self._recv_unacked = self._recv_unacked, 0
                self._recv_window += credit
            stream = self._streams.get(stream_id)
        if credit:
            self._send_raw(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", credit)))
        if stream is None:
            if stream_id > self._last_stream_id:
                raise ProtocolError(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            return                                      # a stream we reset or finished: in-flight data dropped
        if stream.remote_closed:
            raise StreamError(stream_id, STREAM_CLOSED, "DATA after the end of the stream")
        if n > stream.recv_window:
            raise StreamError(stream_id, FLOW_CONTROL_ERROR, f"DATA of {n} bytes beyond the stream window")
        stream.recv_window -= n
        data = self._unpad(flags, payload)
        if not stream.too_large:
            if len(stream.body) + len(data) > self.limits.max_body:
                stream.too_large = True
                stream.body += data[:self.limits.max_body - len(stream.body)]
                self._on_request(self, stream)          # answered now; the rest of the body is discarded
            else:
                stream.body += data
        if flags & END_STREAM:
            self._remote_end(stream)
            return
        stream.unacked += n
        if stream.unacked >= self.limits.initial_window // 2 and not stream.too_large:
            credit, stream.unacked = stream.unacked, 0
            stream.recv_window += credit
            self._send_raw(frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", credit)))

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ProtocolError(FRAME_SIZE_ERROR, f"SETTINGS of {len(payload)} bytes (a multiple of 6 expected)")
        for off in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, off)
            if key == ENABLE_PUSH and value > 1:
                raise ProtocolError(PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}")
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, f"SETTINGS_INITIAL_WINDOW_SIZE {value}")
                with self._window_open:
                    delta = value - self._peer_initial_window
                    self._peer_initial_window = value
                    for s in self._streams.values():
                        s.send_window += delta
                        if s.send_window > MAX_WINDOW:
                            raise ProtocolError(FLOW_CONTROL_ERROR, "a stream window over 2^31-1")
                    self._window_open.notify_all()
            elif key == MAX_FRAME_SIZE:
                if not MIN_FRAME_SIZE <= value <= 2**24 - 1:
                    raise ProtocolError(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value}")
                self._peer_max_frame = value
            elif key == HEADER_TABLE_SIZE:
                with self._wlock:
                    # We index nothing: our next block tells its decoder so (size 0 fits any setting).
                    self._table_update = 0
        self._send_raw(frame(SETTINGS, ACK, 0))

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, f"WINDOW_UPDATE of {len(payload)} bytes (4 expected)")
        increment = struct.unpack(">I", payload)[0] & MAX_WINDOW
        with self._window_open:
            if not stream_id:
                if not increment:
                    raise ProtocolError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on the connection")
                self._send_window += increment
                if self._send_window > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            else:
                stream = self._streams.get(stream_id)
                if stream is None:
                    if stream_id > self._last_stream_id:
                        raise ProtocolError(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {stream_id}")
                    return
                if not increment:
                    raise StreamError(stream_id, PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
                stream.send_window += increment
                if stream.send_window > MAX_WINDOW:
                    raise StreamError(stream_id, FLOW_CONTROL_ERROR, "stream window over 2^31-1")
            self._window_open.notify_all()

    def _on_rst_stream(self, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, f"RST_STREAM of {len(payload)} bytes (4 expected)")
        if stream_id > self._last_stream_id:
            raise ProtocolError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
        with self._window_open:
            stream = self._streams.pop(stream_id, None)
            if stream is not None:
                stream.reset = True
            self._window_open.notify_all()             # a sender waiting for its window gives up
        if stream is not None:
            stream._fire()
        self._maybe_finish()

    # ----- writing ------------------------------------------------------------------------------------------
    def _send_raw(self, data: bytes) -> None:
        with self._wlock:
            self.sock.sendall(data)

    def _header_frames(self, stream_id: int, headers: Iterable[Header], end_stream: bool) -> bytes:
        """Under _wlock: HPACK blocks must reach the peer in the order they were encoded."""
        block = hpack.encode(list(headers), self._table_update)
        self._table_update = None
        size = self._peer_max_frame
        first, rest = block[:size], block[size:]
        flags = (END_STREAM if end_stream else 0) | (0 if rest else END_HEADERS)
        out = bytearray(frame(HEADERS, flags, stream_id, first))
        while rest:
            chunk, rest = rest[:size], rest[size:]
            out += frame(CONTINUATION, 0 if rest else END_HEADERS, stream_id, chunk)
        return bytes(out)

    def send(self, stream: Stream, headers: list[Header] | None = None, data: bytes = b"",
             trailers: list[Header] | None = None, end_stream: bool = False) -> bool:
        """Send on ``stream``, in order: headers, data (waiting for window as needed), trailers. The stream ends
        with the trailers, or with the last frame if ``end_stream``. False when the stream or connection is gone
        (nothing more will be sent on it)."""
        ends = end_stream or trailers is not None
        view = memoryview(data)
        pos = 0
        pending_headers = headers
        out = bytearray()
        while True:
            n = 0
            if pos < len(view):
                with self._window_open:
                    while not (stream.reset or self._closed):
                        n = min(len(view) - pos, self._send_window, stream.send_window)
                        if n > 0 or out or pending_headers is not None:
                            break
                        self._window_open.wait()
                    if stream.reset or self._closed:
                        return False
                    if n > 0:
                        self._send_window -= n
                        stream.send_window -= n
            elif stream.reset or self._closed:
                return False
            chunk_end = pos + max(n, 0)
            last = chunk_end == len(view)
            with self._wlock:
                if pending_headers is not None:
                    out += self._header_frames(stream.id, pending_headers, ends and not view and trailers is None)
                    pending_headers = None
                step = self._peer_max_frame
                while pos < chunk_end:
                    end = min(pos + step, chunk_end)
                    eos = ends and trailers is None and last and end == chunk_end
                    out += frame(DATA, END_STREAM if eos else 0, stream.id, bytes(view[pos:end]))
                    pos = end
                finished = pos == len(view)
                if finished and trailers is not None:
                    out += self._header_frames(stream.id, trailers, True)
                if finished and ends and not stream.remote_closed:
                    # A complete answer before the whole request (section 8.1): stop the rest of it.
                    out += frame(RST_STREAM, 0, stream.id, struct.pack(">I", NO_ERROR))
                if out and not self._closed:
                    try:
                        self.sock.sendall(out)
                    except OSError:
                        return False
                out = bytearray()
            if finished:
                break
        if ends:
            stream.local_closed = True
            if not stream.remote_closed:
                stream.remote_closed = True             # reset above: nothing more is read from it
            self._forget_if_done(stream)
        return True

    def _forget_if_done(self, stream: Stream) -> None:
        if stream.local_closed and stream.remote_closed:
            with self._lock:
                self._streams.pop(stream.id, None)
            self._maybe_finish()

    def _reset_stream(self, stream_id: int, code: int) -> None:
        with self._window_open:
            stream = self._streams.pop(stream_id, None)
            if stream is not None:
                stream.reset = True
            self._window_open.notify_all()
        try:
            self._send_raw(frame(RST_STREAM, 0, stream_id, struct.pack(">I", code)))
        except OSError:
            pass
        if stream is not None:
            stream._fire()

    def _goaway(self, code: int, message: str, stopping: bool = False) -> None:
        """Send GOAWAY. ``stopping``: never block on a peer that does not read (stop must not hang on it; the
        connection is closed after the grace period anyway)."""
        payload = frame(GOAWAY, 0, 0, struct.pack(">II", self._last_stream_id, code) + message.encode()[:256])
        if not self._wlock.acquire(timeout=1.0 if stopping else -1):
            return
        try:
            if stopping:
                self.sock.send(payload, socket.MSG_DONTWAIT)
            else:
                self.sock.sendall(payload)
        except OSError:
            pass
        finally:
            self._wlock.release()

    # ----- ending -------------------------------------------------------------------------------------------
    def _maybe_finish(self) -> None:
        """After the peer's GOAWAY (or ours, on shutdown): close once the last stream is done."""
        with self._lock:
            done = (self._peer_goaway or self._going_away) and not self._streams
        if done:
            self.close()

    def shutdown(self) -> None:
        """Refuse new streams (GOAWAY NO_ERROR) and close once the open ones are done."""
        self._going_away = True
        self._goaway(NO_ERROR, "server stopping", stopping=True)
        self._maybe_finish()

    def close(self) -> None:
        """Close at once: blocked reads and writes return, open streams are reset."""
        with self._window_open:
            if self._closed:
                return
            self._closed = True
            self._window_open.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    @property
    def open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def _teardown(self) -> None:
        self.close()
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.reset = True
            s._fire()
        with self._wlock:                               # no writer is between its check and its sendall
            try:
                self._rfile.close()
                self.sock.close()
            except OSError:
                pass
