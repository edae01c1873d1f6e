"""The plugin's HTTP/2 + gRPC server against peers that break the rules, over real unix sockets.

A raw-socket peer writes the frames by hand and reads what comes back; after each case a grpcio client (the
independent implementation) checks that the server still serves. Answers are those of RFC 9113 and of grpcio.
"""
from __future__ import annotations

import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import grpc
import pytest

from api.generated.dra.v1 import api_pb2 as v1_pb
from api.generated.dra.v1 import api_pb2_grpc as v1_grpc
from api.generated.dra_health.v1 import api_pb2 as h1_pb
from api.generated.dra_health.v1 import api_pb2_grpc as h1_grpc
from api.generated.pluginregistration.v1 import api_pb2 as reg_pb
from kubeletplugin.transport import http2 as h2
from kubeletplugin.transport.client import unary_call
from kubeletplugin.transport.health import DeviceHealth, HealthBoard
from kubeletplugin.transport.hpack import Decoder, encode
from kubeletplugin.transport.http2 import Limits, frame
from kubeletplugin.transport.nodedriver import PreparedDevice, PrepareResult, UnprepareResult
from kubeletplugin.transport.registration import GET_INFO, RegistrationServicer, RegistrationState
from kubeletplugin.transport.rpc import RpcError, StatusCode, service_methods
from kubeletplugin.transport.server import DRAServer
from kubeletplugin.transport.unixserver import UnixGrpcServer

PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
WATCH = "/v1.DRAResourceHealth/NodeWatchResources"
WAIT_S = 20.0          # generous: the machine is shared


class GatedDriver:
    """Prepares one device per claim; a claim named 'slow' waits for ``gate``, one named 'boom' raises."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.slow_started = threading.Event()
        self.slow_done = threading.Event()

    def prepare(self, claims):
        out = {}
        for c in claims:
            if c.name == "boom":
                raise RuntimeError("driver exploded")
            if c.name == "slow":
                self.slow_started.set()
                self.gate.wait(WAIT_S)
                self.slow_done.set()
            out[c.uid] = PrepareResult(devices=(PreparedDevice(("gpu",), "pool", "gpu-0", ("cdi/x=y",)),))
        return out

    def unprepare(self, claims):
        return {c.uid: UnprepareResult() for c in claims}


@pytest.fixture
def short_tmp():
    d = Path(tempfile.mkdtemp(prefix="h2-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def served(short_tmp):
    driver = GatedDriver()
    board = HealthBoard(resend_interval=60)
    board.replace([DeviceHealth("pool", "gpu-0", "Healthy")])
    server = DRAServer(short_tmp / "dra.sock", driver, health=board)
    server.start()
    yield server, driver
    driver.gate.set()
    server.stop(0)


def prepare_req(*names: str) -> v1_pb.NodePrepareResourcesRequest:
    return v1_pb.NodePrepareResourcesRequest(
        claims=[v1_pb.Claim(namespace="ns", uid=f"u{i}", name=n) for i, n in enumerate(names)])


def assert_serving(path: Path) -> None:
    with grpc.insecure_channel(f"unix://{path}") as ch:
        reply = v1_grpc.DRAPluginStub(ch).NodePrepareResources(prepare_req("ok"), timeout=WAIT_S)
    assert reply.claims["u0"].devices[0].device_name == "gpu-0"


def grpc_message(body: bytes) -> bytes:
    return struct.pack(">BI", 0, len(body)) + body


class RawPeer:
    """An HTTP/2 client written frame by frame."""

    def __init__(self, path: Path, settings: bytes = b"", preface: bytes | None = h2.PREFACE):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(WAIT_S)
        self.sock.connect(str(path))
        self.decoder = Decoder()
        if preface is not None:
            self.send(preface + frame(h2.SETTINGS, 0, 0, settings))

    def close(self) -> None:
        self.sock.close()

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                # Linux reports a unix socket closed with data unread (what we sent after the error) this way.
                raise EOFError from None
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def read(self) -> tuple[int, int, int, bytes]:
        hi, lo, ftype, flags, sid = struct.unpack(">HBBBI", self._exact(9))
        return ftype, flags, sid, self._exact((hi << 8) | lo)

    def until(self, match: Callable[[int, int, int, bytes], bool]) -> tuple[int, int, int, bytes]:
        while True:
            f = self.read()
            if match(*f):
                return f

    def goaway(self) -> tuple[int, int, bytes]:
        """(last stream id, error code, debug text) of the server's GOAWAY; the server then closes."""
        _, _, _, payload = self.until(lambda t, *_: t == h2.GOAWAY)
        last, code = struct.unpack(">II", payload[:8])
        with pytest.raises(EOFError):
            while True:
                self.read()
        return last, code, payload[8:]

    def request(self, sid: int, path: str = PREPARE, body: bytes | None = None,
                content_type: bytes = b"application/grpc", end_stream: bool = True) -> None:
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
                   (b":authority", b"x"), (b"content-type", content_type), (b"te", b"trailers")]
        data = grpc_message(prepare_req("ok").SerializeToString()) if body is None else body
        self.send(frame(h2.HEADERS, h2.END_HEADERS, sid, encode(headers)),
                  frame(h2.DATA, h2.END_STREAM if end_stream else 0, sid, data))

    def response(self, sid: int) -> tuple[dict[bytes, bytes], bytes]:
        """All header fields (headers and trailers together) and the data of stream ``sid``, to its end."""
        fields: dict[bytes, bytes] = {}
        data = b""
        while True:
            ftype, flags, fsid, payload = self.read()
            if fsid != sid:
                continue
            if ftype == h2.HEADERS:
                assert flags & h2.END_HEADERS
                fields.update(self.decoder.decode(payload))
            elif ftype == h2.DATA:
                data += payload
            elif ftype == h2.RST_STREAM:
                raise AssertionError(f"stream {sid} reset: {struct.unpack('>I', payload)[0]}")
            if flags & h2.END_STREAM:
                return fields, data


def rst_code(peer: RawPeer, sid: int) -> int:
    _, _, _, payload = peer.until(lambda t, f, s, p: t == h2.RST_STREAM and s == sid)
    return int(struct.unpack(">I", payload)[0])


# ----- connection errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,code", [
    ("bad preface", h2.PROTOCOL_ERROR),
    ("first frame not SETTINGS", h2.PROTOCOL_ERROR),
    ("frame over max size", h2.FRAME_SIZE_ERROR),
    ("HPACK garbage", h2.COMPRESSION_ERROR),
    ("Huffman bad padding", h2.COMPRESSION_ERROR),
    ("stream id going backwards", h2.PROTOCOL_ERROR),
    ("even stream id", h2.PROTOCOL_ERROR),
    ("CONTINUATION interleaved", h2.PROTOCOL_ERROR),
    ("CONTINUATION without HEADERS", h2.PROTOCOL_ERROR),
    ("header block over the limit", h2.ENHANCE_YOUR_CALM),
    ("SETTINGS of a bad length", h2.FRAME_SIZE_ERROR),
    ("SETTINGS_MAX_FRAME_SIZE too small", h2.PROTOCOL_ERROR),
    ("SETTINGS_INITIAL_WINDOW_SIZE too large", h2.FLOW_CONTROL_ERROR),
    ("PING of 7 bytes", h2.FRAME_SIZE_ERROR),
    ("WINDOW_UPDATE of 0 on the connection", h2.PROTOCOL_ERROR),
    ("DATA on an idle stream", h2.PROTOCOL_ERROR),
    ("RST_STREAM on stream 0", h2.PROTOCOL_ERROR),
    ("PUSH_PROMISE from a client", h2.PROTOCOL_ERROR),
    ("padding as long as the frame", h2.PROTOCOL_ERROR),
])
def test_protocol_violations_get_goaway_and_the_server_serves_on(served, case, code):
    server, _ = served
    hdrs = encode([(b":method", b"POST"), (b":path", PREPARE.encode())])
    frames = {
        "bad preface": [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 8],
        "first frame not SETTINGS": [h2.PREFACE, frame(h2.PING, 0, 0, b"12345678")],
        "frame over max size": [frame(h2.DATA, 0, 1, b"x" * 16385)],
        "HPACK garbage": [frame(h2.HEADERS, h2.END_HEADERS, 1, b"\xbe\xff")],
        "Huffman bad padding": [frame(h2.HEADERS, h2.END_HEADERS, 1, b"\x04\x82\x00\x00")],
        "stream id going backwards": [frame(h2.HEADERS, h2.END_HEADERS, 3, hdrs),
                                      frame(h2.HEADERS, h2.END_HEADERS, 1, hdrs)],
        "even stream id": [frame(h2.HEADERS, h2.END_HEADERS, 2, hdrs)],
        "CONTINUATION interleaved": [frame(h2.HEADERS, 0, 1, hdrs[:3]), frame(h2.HEADERS, h2.END_HEADERS, 3, hdrs)],
        "CONTINUATION without HEADERS": [frame(h2.CONTINUATION, h2.END_HEADERS, 1, hdrs)],
        "header block over the limit": [frame(h2.HEADERS, 0, 1, b"\x00" * 16384)]
                                       + [frame(h2.CONTINUATION, 0, 1, b"\x00" * 16384)] * 4,
        "SETTINGS of a bad length": [frame(h2.SETTINGS, 0, 0, b"\0" * 5)],
        "SETTINGS_MAX_FRAME_SIZE too small": [frame(h2.SETTINGS, 0, 0, struct.pack(">HI", h2.MAX_FRAME_SIZE, 100))],
        "SETTINGS_INITIAL_WINDOW_SIZE too large": [
            frame(h2.SETTINGS, 0, 0, struct.pack(">HI", h2.INITIAL_WINDOW_SIZE, 2**31))],
        "PING of 7 bytes": [frame(h2.PING, 0, 0, b"1234567")],
        "WINDOW_UPDATE of 0 on the connection": [frame(h2.WINDOW_UPDATE, 0, 0, b"\0\0\0\0")],
        "DATA on an idle stream": [frame(h2.DATA, 0, 5, b"x")],
        "RST_STREAM on stream 0": [frame(h2.RST_STREAM, 0, 0, b"\0\0\0\x08")],
        "PUSH_PROMISE from a client": [frame(h2.PUSH_PROMISE, h2.END_HEADERS, 1, b"\0\0\0\x02" + hdrs)],
        "padding as long as the frame": [frame(h2.HEADERS, h2.END_HEADERS | h2.PADDED, 1, b"\x05" + b"abcd")],
    }[case]
    raw_start = case in ("bad preface", "first frame not SETTINGS")
    peer = RawPeer(server.socket_path, preface=None if raw_start else h2.PREFACE)
    try:
        peer.send(*frames)
        _, got, debug = peer.goaway()
        assert got == code, debug
        assert debug                                      # says what was wrong
    finally:
        peer.close()
    assert_serving(server.socket_path)


def test_header_list_over_the_limit_is_refused_with_431_and_the_connection_goes_on(served):
    server, _ = served
    peer = RawPeer(server.socket_path)
    try:
        big = [(b":method", b"POST"), (b":path", PREPARE.encode()), (b"x-big", b"v" * 15000),
               (b"x-more", b"w" * 2000)]
        block = encode(big)
        peer.send(frame(h2.HEADERS, 0, 1, block[:10000]),
                  frame(h2.CONTINUATION, h2.END_HEADERS | 0, 1, block[10000:]))
        fields, _ = peer.response(1)
        assert fields[b":status"] == b"431"
        peer.request(3)                                   # the same connection still answers
        fields, data = peer.response(3)
        assert fields[b"grpc-status"] == b"0"
        assert v1_pb.NodePrepareResourcesResponse.FromString(data[5:]).claims["u0"].devices[0].device_name == "gpu-0"
    finally:
        peer.close()


def test_ping_is_answered_with_its_payload(served):
    server, _ = served
    peer = RawPeer(server.socket_path)
    try:
        peer.send(frame(h2.PING, 0, 0, b"pingpong"))
        _, flags, _, payload = peer.until(lambda t, *_: t == h2.PING)
        assert flags & h2.ACK and payload == b"pingpong"
        # Our SETTINGS came first, and were followed by the ACK of theirs.
    finally:
        peer.close()


def test_server_settings_come_first_and_theirs_are_acked(served):
    server, _ = served
    peer = RawPeer(server.socket_path)
    try:
        ftype, flags, sid, payload = peer.read()
        assert (ftype, flags, sid) == (h2.SETTINGS, 0, 0)
        ours = dict(struct.unpack_from(">HI", payload, i) for i in range(0, len(payload), 6))
        assert ours[h2.MAX_FRAME_SIZE] == 16384 and ours[h2.MAX_CONCURRENT_STREAMS] == 100
        assert ours[h2.MAX_HEADER_LIST_SIZE] == 16384 and ours[h2.ENABLE_PUSH] == 0
        peer.until(lambda t, f, *_: t == h2.SETTINGS and f & h2.ACK)
    finally:
        peer.close()


def test_unknown_frames_priority_and_padding_are_accepted(served):
    server, _ = served
    peer = RawPeer(server.socket_path)
    try:
        hdrs = encode([(b":method", b"POST"), (b":scheme", b"http"), (b":path", PREPARE.encode()),
                       (b"content-type", b"application/grpc+proto")])
        body = grpc_message(prepare_req("ok").SerializeToString())
        peer.send(frame(0xFA, 0xFF, 0, b"extension"),
                  frame(h2.PRIORITY, 0, 1, b"\0\0\0\0\x10"),
                  frame(h2.HEADERS, h2.PADDED | h2.PRIORITY_FLAG, 1, b"\x03" + b"\0\0\0\0\x10" + hdrs[:4] + b"pad"),
                  frame(h2.CONTINUATION, h2.END_HEADERS, 1, hdrs[4:]),
                  frame(h2.DATA, h2.PADDED, 1, b"\x02" + body[:7] + b"\0\0"),
                  frame(h2.DATA, h2.END_STREAM, 1, body[7:]))
        fields, data = peer.response(1)
        assert fields[b"grpc-status"] == b"0" and data[5:]
    finally:
        peer.close()


# ----- stream errors and flow control ---------------------------------------------------------------------------

def registration_server(path: Path, limits: Limits) -> UnixGrpcServer:
    servicer = RegistrationServicer("d", Path("/x"), ["v1.DRAPlugin"], RegistrationState())
    return UnixGrpcServer(path, service_methods(reg_pb, "Registration", servicer), limits=limits)


def test_data_beyond_the_stream_window_resets_that_stream_only(short_tmp):
    server = registration_server(short_tmp / "r.sock", Limits(initial_window=4096))
    server.start()
    peer = RawPeer(short_tmp / "r.sock")
    try:
        peer.request(1, GET_INFO, body=grpc_message(b"\0" * 5000), end_stream=False)
        assert rst_code(peer, 1) == h2.FLOW_CONTROL_ERROR
        peer.request(3, GET_INFO, body=grpc_message(b""))
        fields, data = peer.response(3)
        assert fields[b"grpc-status"] == b"0" and reg_pb.PluginInfo.FromString(data[5:]).name == "d"
    finally:
        peer.close()
        server.stop(0)


def test_the_server_never_sends_more_than_the_peer_window(served):
    """The peer allows 10 bytes per stream: the answer comes in pieces, each after a WINDOW_UPDATE."""
    server, _ = served
    peer = RawPeer(server.socket_path, settings=struct.pack(">HI", h2.INITIAL_WINDOW_SIZE, 10))
    try:
        peer.request(1)
        got = b""
        while True:
            ftype, flags, sid, payload = peer.until(lambda t, f, s, p: s == 1 and t in (h2.DATA, h2.HEADERS))
            if ftype == h2.DATA:
                assert len(payload) <= 10
                got += payload
                peer.send(frame(h2.WINDOW_UPDATE, 0, 1, struct.pack(">I", len(payload))))
            if flags & h2.END_STREAM:
                break
        assert v1_pb.NodePrepareResourcesResponse.FromString(got[5:]).claims["u0"].devices
    finally:
        peer.close()


def test_data_after_end_stream_resets_that_stream(served):
    """A request stays half-closed (remote) while its handler runs: more DATA on it is STREAM_CLOSED."""
    server, driver = served
    peer = RawPeer(server.socket_path)
    try:
        peer.request(1, body=grpc_message(prepare_req("slow").SerializeToString()))
        assert driver.slow_started.wait(WAIT_S)
        peer.send(frame(h2.DATA, 0, 1, b"more"))
        assert rst_code(peer, 1) == h2.STREAM_CLOSED
        driver.gate.set()
        peer.request(3)
        fields, _ = peer.response(3)
        assert fields[b"grpc-status"] == b"0"
    finally:
        peer.close()


def test_our_header_blocks_follow_the_peers_header_table_size(served):
    """We index nothing, but a peer that shrinks its table hears it in our next block (RFC 7541 section 4.2)."""
    server, _ = served
    peer = RawPeer(server.socket_path, settings=struct.pack(">HI", h2.HEADER_TABLE_SIZE, 0))
    try:
        peer.until(lambda t, f, *_: t == h2.SETTINGS and f & h2.ACK)
        peer.request(1)
        _, _, _, block = peer.until(lambda t, f, s, p: t == h2.HEADERS and s == 1)
        assert block[0] == 0x20                            # dynamic table size update to 0, first
        assert dict(peer.decoder.decode(block))[b":status"] == b"200"
    finally:
        peer.close()


def test_too_many_concurrent_streams_are_refused(served):
    server, _ = served
    peer = RawPeer(server.socket_path)
    try:
        for sid in range(1, 203, 2):            # 101 open requests (no END_STREAM)
            peer.request(sid, end_stream=False)
        assert rst_code(peer, 201) == h2.REFUSED_STREAM
    finally:
        peer.close()
    assert_serving(server.socket_path)


def test_many_calls_at_once_on_one_connection_and_a_slow_one_blocks_none(served):
    server, driver = served
    with grpc.insecure_channel(f"unix://{server.socket_path}") as ch:
        stub = v1_grpc.DRAPluginStub(ch)
        slow = stub.NodePrepareResources.future(prepare_req("slow"), timeout=WAIT_S)
        assert driver.slow_started.wait(WAIT_S)
        futures = [stub.NodePrepareResources.future(prepare_req(f"c{i}"), timeout=WAIT_S) for i in range(40)]
        for f in futures:
            assert f.result().claims["u0"].devices[0].device_name == "gpu-0"
        assert not slow.done()
        driver.gate.set()
        assert slow.result().claims["u0"].devices


def test_rst_stream_mid_call_drops_the_answer_and_the_connection_goes_on(served):
    server, driver = served
    peer = RawPeer(server.socket_path)
    try:
        peer.request(1, body=grpc_message(prepare_req("slow").SerializeToString()))
        assert driver.slow_started.wait(WAIT_S)
        peer.send(frame(h2.RST_STREAM, 0, 1, struct.pack(">I", h2.CANCEL)))
        driver.gate.set()
        assert driver.slow_done.wait(WAIT_S)
        peer.request(3)
        fields, _ = peer.response(3)                # response() fails on anything for stream 1 but DATA/HEADERS
        assert fields[b"grpc-status"] == b"0"
        peer.send(frame(h2.PING, 0, 0, b"after-rs"))
        peer.until(lambda t, f, s, p: t == h2.PING and p == b"after-rs")
    finally:
        peer.close()


def stream_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "dra-stream")


def wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("how", ["RST_STREAM", "vanish"])
def test_a_health_stream_ends_when_the_client_cancels_or_vanishes(served, how):
    server, _ = served
    before = stream_threads()
    peer = RawPeer(server.socket_path)
    try:
        peer.request(1, WATCH, body=grpc_message(b""), end_stream=True)
        ftype, *_ = peer.until(lambda t, f, s, p: s == 1 and t == h2.DATA)
        assert stream_threads() == before + 1
        if how == "RST_STREAM":
            peer.send(frame(h2.RST_STREAM, 0, 1, struct.pack(">I", h2.CANCEL)))
        else:
            peer.sock.shutdown(socket.SHUT_RDWR)
        wait_for(lambda: stream_threads() == before, "the stream's thread to end")
    finally:
        peer.close()
    assert_serving(server.socket_path)


def test_client_vanishing_mid_response_leaves_the_server_serving(served):
    """The peer allows 10 bytes, takes the first and disappears: the sender waiting for its window gives up."""
    server, driver = served
    peer = RawPeer(server.socket_path, settings=struct.pack(">HI", h2.INITIAL_WINDOW_SIZE, 10))
    peer.request(1)
    peer.until(lambda t, f, s, p: t == h2.DATA and s == 1)
    peer.sock.shutdown(socket.SHUT_RDWR)
    peer.close()
    assert_serving(server.socket_path)


def test_peer_goaway_lets_open_calls_finish(served):
    server, driver = served
    peer = RawPeer(server.socket_path)
    try:
        peer.request(1, body=grpc_message(prepare_req("slow").SerializeToString()))
        assert driver.slow_started.wait(WAIT_S)
        peer.send(frame(h2.GOAWAY, 0, 0, struct.pack(">II", 0, h2.NO_ERROR)))
        driver.gate.set()
        fields, _ = peer.response(1)
        assert fields[b"grpc-status"] == b"0"
        with pytest.raises(EOFError):               # then the server closes
            while True:
                peer.read()
    finally:
        peer.close()


# ----- gRPC answers ---------------------------------------------------------------------------------------------

def test_message_over_4_mib_is_resource_exhausted(served):
    server, _ = served
    with grpc.insecure_channel(f"unix://{server.socket_path}") as ch:
        with pytest.raises(grpc.RpcError) as err:
            v1_grpc.DRAPluginStub(ch).NodePrepareResources(prepare_req("x" * (5 << 20)), timeout=WAIT_S)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in err.value.details()
    assert_serving(server.socket_path)


def test_unknown_method_is_unimplemented(served):
    server, _ = served
    with grpc.insecure_channel(f"unix://{server.socket_path}") as ch:
        call = ch.unary_unary("/no.Such/Method", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            call(b"", timeout=WAIT_S)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "/no.Such/Method" in err.value.details()


def test_wrong_content_type_is_415(served):
    server, _ = served
    peer = RawPeer(server.socket_path)
    try:
        peer.request(1, content_type=b"application/json")
        fields, _ = peer.response(1)
        assert fields[b":status"] == b"415"
    finally:
        peer.close()


@pytest.mark.parametrize("body,code,text", [
    (b"\x01\0\0\0\x01x", StatusCode.UNIMPLEMENTED, b"compressed"),
    (b"\0\0\0\0\x09abc", StatusCode.INTERNAL, b"exactly one message"),
    (b"\0\0\0\0\x03\xff\xff\xff", StatusCode.INTERNAL, b"cannot parse"),
    (b"", StatusCode.INTERNAL, b"no message"),
])
def test_bad_messages_get_grpcio_status(served, body, code, text):
    server, _ = served
    peer = RawPeer(server.socket_path)
    try:
        peer.request(1, body=body)
        fields, _ = peer.response(1)
        assert fields[b"grpc-status"] == str(int(code)).encode() and text in fields[b"grpc-message"]
    finally:
        peer.close()


def test_an_answer_after_grpc_timeout_is_deadline_exceeded(served):
    server, driver = served
    driver.gate.set()
    peer = RawPeer(server.socket_path)
    try:
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PREPARE.encode()),
                   (b"content-type", b"application/grpc"), (b"grpc-timeout", b"1n")]
        peer.send(frame(h2.HEADERS, h2.END_HEADERS, 1, encode(headers)),
                  frame(h2.DATA, h2.END_STREAM, 1, grpc_message(prepare_req("slow").SerializeToString())))
        fields, data = peer.response(1)
        assert fields[b"grpc-status"] == str(int(StatusCode.DEADLINE_EXCEEDED)).encode() and not data
        assert driver.slow_done.is_set()
    finally:
        peer.close()


def test_handler_exception_is_unknown_and_the_server_lives_on(served):
    server, _ = served
    with grpc.insecure_channel(f"unix://{server.socket_path}") as ch:
        with pytest.raises(grpc.RpcError) as err:
            v1_grpc.DRAPluginStub(ch).NodePrepareResources(prepare_req("boom"), timeout=WAIT_S)
        assert err.value.code() == grpc.StatusCode.UNKNOWN and "driver exploded" in err.value.details()
    assert_serving(server.socket_path)


def test_abort_message_is_percent_encoded_and_decoded_by_grpcio(served):
    server, _ = served
    with grpc.insecure_channel(f"unix://{server.socket_path}") as ch:
        with pytest.raises(grpc.RpcError) as err:
            v1_grpc.DRAPluginStub(ch).NodePrepareResources(v1_pb.NodePrepareResourcesRequest(
                claims=[v1_pb.Claim(namespace="ns", uid="", name="100%-ü\n")]), timeout=WAIT_S)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'100%-ü\\n'" in err.value.details()


def test_health_stream_through_grpcio_and_stop_ends_it(short_tmp):
    board = HealthBoard(resend_interval=60)
    board.replace([DeviceHealth("pool", "gpu-0", "Healthy")])
    server = DRAServer(short_tmp / "dra.sock", GatedDriver(), health=board)
    server.start()
    try:
        with grpc.insecure_channel(f"unix://{short_tmp / 'dra.sock'}") as ch:
            stream = h1_grpc.DRAResourceHealthStub(ch).NodeWatchResources(h1_pb.NodeWatchResourcesRequest())
            assert next(stream).devices[0].device.device_name == "gpu-0"
            stopper = threading.Thread(target=server.stop)
            stopper.start()
            with pytest.raises(StopIteration):          # the board closes: the stream ends with OK
                next(stream)
            stopper.join(WAIT_S)
            assert not stopper.is_alive()
    finally:
        server.stop(0)
    assert not (short_tmp / "dra.sock").exists()


# ----- our client, and no grpcio in the plugin ------------------------------------------------------------------

def test_our_client_calls_getinfo_and_reports_errors(short_tmp):
    server = registration_server(short_tmp / "r.sock", Limits())
    server.start()
    try:
        info = unary_call(short_tmp / "r.sock", GET_INFO, reg_pb.InfoRequest(), reg_pb.PluginInfo, timeout=WAIT_S)
        assert info.name == "d"
        with pytest.raises(RpcError) as err:
            unary_call(short_tmp / "r.sock", "/x.Y/Z", reg_pb.InfoRequest(), reg_pb.PluginInfo, timeout=WAIT_S)
        assert err.value.code == StatusCode.UNIMPLEMENTED
    finally:
        server.stop(0)
    with pytest.raises(RpcError) as err:
        unary_call(short_tmp / "r.sock", GET_INFO, reg_pb.InfoRequest(), reg_pb.PluginInfo, timeout=WAIT_S)
    assert err.value.code == StatusCode.UNAVAILABLE


def test_our_client_works_against_grpcio_server(short_tmp):
    """The client speaks HTTP/2 as grpcio's server understands it (not only as ours does)."""
    from concurrent import futures

    from api.generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc

    servicer = RegistrationServicer("peer", Path("/x"), ["v1.DRAPlugin"], RegistrationState())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    reg_grpc.add_RegistrationServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{short_tmp / 'g.sock'}")
    server.start()
    try:
        info = unary_call(short_tmp / "g.sock", GET_INFO, reg_pb.InfoRequest(), reg_pb.PluginInfo, timeout=WAIT_S)
        assert info.name == "peer"
    finally:
        server.stop(0)


def test_the_plugin_serves_both_sockets_without_importing_grpc(short_tmp):
    """Start the endpoints and the plugin's module in a fresh interpreter, call GetInfo, and look."""
    import subprocess

    code = f"""
import sys
import kubeletplugin.plugin
from kubeletplugin.transport.endpoints import start_endpoints
from kubeletplugin.transport.client import unary_call
from kubeletplugin.transport.registration import GET_INFO
from api.generated.pluginregistration.v1 import api_pb2 as reg_pb
ep = start_endpoints("gpu.example.com", "{short_tmp}/reg", "{short_tmp}/plug", None, 10.0)
info = unary_call(ep.paths.registration, GET_INFO, reg_pb.InfoRequest(), reg_pb.PluginInfo, timeout=10)
assert info.name == "gpu.example.com", info
ep.stop()
print(sorted(m for m in sys.modules if m == "grpc" or m.startswith("grpc.")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"



def test_stop_is_prompt_with_a_sender_waiting_for_window_and_an_idle_connection(short_tmp):
    server = DRAServer(short_tmp / "dra.sock", GatedDriver())
    server.start()
    waiting = RawPeer(short_tmp / "dra.sock", settings=struct.pack(">HI", h2.INITIAL_WINDOW_SIZE, 0))
    idle = RawPeer(short_tmp / "dra.sock")
    try:
        waiting.request(1)                       # the answer waits for a WINDOW_UPDATE that never comes
        waiting.until(lambda t, f, s, p: t == h2.HEADERS and s == 1)
        idle.until(lambda t, f, *_: t == h2.SETTINGS)   # accepted (a connection still in the backlog is just closed)
        stopper = threading.Thread(target=server.stop, kwargs={"grace": 0.2})
        stopper.start()
        stopper.join(WAIT_S)
        assert not stopper.is_alive()
        for peer in (waiting, idle):             # both hear GOAWAY, then the connection closes
            _, code, _ = peer.goaway()
            assert code == h2.NO_ERROR
    finally:
        waiting.close()
        idle.close()
        server.stop(0)
    assert not (short_tmp / "dra.sock").exists()
