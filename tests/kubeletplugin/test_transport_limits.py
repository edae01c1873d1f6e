"""The kubelet transport against peers that misbehave: a client that stops reading, a thousand idle connections,
twenty thousand reset calls, a process at its thread limit, streams and calls past their caps. Each time the
kubelet's prepare is still answered promptly (the 1 s bounds are what a kubelet call may lose to a noisy
neighbour on the socket, not a guess at timing)."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from h2peer import RawPeer

from api.generated.dra.v1 import api_pb2 as v1_pb
from api.generated.dra.v1 import api_pb2_grpc as v1_grpc
from api.generated.dra_health.v1 import api_pb2 as h1_pb
from api.generated.dra_health.v1 import api_pb2_grpc as h1_grpc
from kubeletplugin.transport.grpcserver import Limits, UnixGrpcServer
from kubeletplugin.transport.health import DeviceHealth, HealthBoard
from kubeletplugin.transport.nodedriver import ClaimRef, PreparedDevice, PrepareResult, UnprepareResult
from kubeletplugin.transport.server import MAX_HEALTH_STREAMS, DRAPluginV1, DRAServer, DRAService

REPO = Path(__file__).resolve().parents[2]
UID = "0f6c8a6e-3d0b-4d0c-9d7e-7d8f1f2b3c4d"
PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
WATCH = "/v1.DRAResourceHealth/NodeWatchResources"
REQUEST = v1_pb.NodePrepareResourcesRequest(claims=[v1_pb.Claim(namespace="ns", name="c", uid=UID)])


class CountingDriver:
    """Prepares each claim in ``work_s`` seconds (the real driver reads the claim and writes a CDI spec)."""

    def __init__(self, work_s: float = 0.0):
        self.work_s = work_s
        self.prepares = 0
        self._lock = threading.Lock()

    def prepare(self, claims: list[ClaimRef], arrived: float | None = None) -> dict[str, PrepareResult]:
        with self._lock:
            self.prepares += 1
        time.sleep(self.work_s)
        return {c.uid: PrepareResult(devices=(PreparedDevice(("gpu",), "node-a", "gpu-0", ("k8s.x/claim=y",)),))
                for c in claims}

    def unprepare(self, claims: list[ClaimRef], arrived: float | None = None) -> dict[str, UnprepareResult]:
        return {c.uid: UnprepareResult() for c in claims}


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    import shutil
    d = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def serve(directory: Path, driver: CountingDriver, board: HealthBoard | None = None) -> DRAServer:
    server = DRAServer(directory / "dra.sock", driver, health=board)
    server.start()
    return server


def prepare_seconds(path: Path) -> float:
    """How long the kubelet's prepare takes, on a connection of its own (as the kubelet's client has)."""
    with grpc.insecure_channel(f"unix:{path}") as channel:
        start = time.monotonic()
        answer = v1_grpc.DRAPluginStub(channel).NodePrepareResources(REQUEST, timeout=30)
        took = time.monotonic() - start
    assert answer.claims[UID].devices[0].device_name == "gpu-0"
    return took


def test_a_client_that_stops_reading_does_not_delay_another_clients_prepare(short_tmp: Path) -> None:
    """Peers that announce a zero window and never read: 16 prepares and 8 health streams each. The prepares'
    answers and the streams' messages can never be sent; none of that may hold a worker the kubelet needs."""
    board = HealthBoard()
    board.replace([DeviceHealth("node-a", f"gpu-{i}", "Healthy") for i in range(8)])
    server = serve(short_tmp, CountingDriver(), board)
    peers = []
    try:
        for _ in range(4):
            peer = RawPeer(short_tmp / "dra.sock", window=0)
            for _ in range(16):
                peer.call(PREPARE, REQUEST.SerializeToString())
            for _ in range(8):
                peer.call(WATCH, b"")
            peers.append(peer)
        assert prepare_seconds(short_tmp / "dra.sock") < 1.0
    finally:
        for peer in peers:
            peer.close()
        server.stop(0)


def test_a_thousand_idle_connections_leave_prepare_answered_within_a_second(short_tmp: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2500 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))     # both ends of 1000 connections in one process
    before = threading.active_count()                  # threads other tests of this process left are not ours
    server = serve(short_tmp, CountingDriver())
    peers: list[RawPeer] = []
    try:
        for i in range(1000):
            peers.append(RawPeer(short_tmp / "dra.sock", window=None if i % 2 else 65535))
        assert prepare_seconds(short_tmp / "dra.sock") < 1.0
        assert threading.active_count() - before < 100  # no thread per connection (the pool is 16)
    finally:
        for peer in peers:
            peer.close()
        server.stop(0)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_twenty_thousand_reset_calls_do_not_delay_a_prepare(short_tmp: Path) -> None:
    """The rapid-reset pattern: each call's HEADERS, DATA and RST_STREAM at once. A reset call never reaches the
    driver (each would cost a real prepare), and the kubelet's prepares meanwhile stay within 1 s."""
    driver = CountingDriver(work_s=0.005)
    server = serve(short_tmp, driver)
    latencies: list[float] = []
    flooding = threading.Event()
    flooding.set()

    def kubelet() -> None:
        while flooding.is_set():
            latencies.append(prepare_seconds(short_tmp / "dra.sock"))

    try:
        prober = threading.Thread(target=kubelet)
        prober.start()
        sent = 0
        while sent < 20000:                             # a new connection whenever the server closes one
            peer = RawPeer(short_tmp / "dra.sock", drain=True)
            done = peer.calls_reset(PREPARE, REQUEST.SerializeToString(), 20000 - sent)
            peer.close()
            assert done or sent, "the server took no call at all"
            sent += done
        latencies.append(prepare_seconds(short_tmp / "dra.sock"))
        flooding.clear()
        prober.join()
        assert max(latencies) < 1.0, sorted(latencies)[-5:]
        assert driver.prepares - len(latencies) < 200, f"{driver.prepares - len(latencies)} reset calls prepared"
    finally:
        flooding.clear()
        server.stop(0)


def test_streams_past_the_cap_and_calls_past_the_limit_are_refused_at_once(short_tmp: Path) -> None:
    """The health streams beyond MAX_HEALTH_STREAMS are RESOURCE_EXHAUSTED, and so are calls beyond the server's
    concurrent-call limit (the kubelet retries them) instead of waiting in an unbounded queue; streams that end
    free their place."""
    board = HealthBoard()
    board.replace([DeviceHealth("node-a", "gpu-0", "Healthy")])
    slow = CountingDriver(work_s=1.0)
    server = serve(short_tmp, slow, board)
    try:
        with grpc.insecure_channel(f"unix:{short_tmp / 'dra.sock'}") as channel:
            watch = h1_grpc.DRAResourceHealthStub(channel).NodeWatchResources
            streams = [watch(h1_pb.NodeWatchResourcesRequest(), timeout=30) for _ in range(MAX_HEALTH_STREAMS)]
            for stream in streams:
                next(stream)
            extra = watch(h1_pb.NodeWatchResourcesRequest(), timeout=30)
            with pytest.raises(grpc.RpcError) as refused:
                next(extra)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for stream in streams:
                stream.cancel()
            again = [watch(h1_pb.NodeWatchResourcesRequest(), timeout=30) for _ in range(MAX_HEALTH_STREAMS)]
            for stream in again:                        # the cancelled streams gave their places back
                assert len(next(stream).devices) == 1
                stream.cancel()


    finally:
        server.stop(0)
    # A server of the same kind with a limit of 64 calls at once, 16 workers: three connections (each takes 32
    # calls at once) send 96.
    limited = UnixGrpcServer(short_tmp / "limited.sock", lambda s: v1_grpc.add_DRAPluginServicer_to_server(
        DRAPluginV1(DRAService(slow)), s), max_workers=16, max_concurrent_rpcs=64)
    limited.start()
    try:
        channels = [grpc.insecure_channel(f"unix:{short_tmp / 'limited.sock'}",
                                          options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(3)]
        futures = [v1_grpc.DRAPluginStub(channels[i % 3]).NodePrepareResources.future(REQUEST, timeout=60)
                   for i in range(96)]
        codes = [f.exception().code() if f.exception() else grpc.StatusCode.OK for f in futures]
        for channel in channels:
            channel.close()
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 16, codes
        assert codes.count(grpc.StatusCode.OK) >= 16, codes
    finally:
        limited.stop(0)


def test_a_message_over_4_mib_is_refused(short_tmp: Path) -> None:
    server = serve(short_tmp, CountingDriver())
    try:
        huge = v1_pb.NodePrepareResourcesRequest(claims=[v1_pb.Claim(namespace="ns", name="c" * 200, uid=f"{i}")
                                                         for i in range(Limits().max_message // 200)])
        with grpc.insecure_channel(f"unix:{short_tmp / 'dra.sock'}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                v1_grpc.DRAPluginStub(channel).NodePrepareResources(huge, timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert prepare_seconds(short_tmp / "dra.sock") < 1.0
    finally:
        server.stop(0)


# ---- the process's thread limit ------------------------------------------------------------------------------

SERVER_AT_ITS_THREAD_LIMIT = """
import sys, threading, time
from pathlib import Path
from kubeletplugin.transport.nodedriver import PreparedDevice, PrepareResult
from kubeletplugin.transport.server import DRAServer

class Driver:
    def prepare(self, claims, arrived=None):
        return {c.uid: PrepareResult(devices=(PreparedDevice(("gpu",), "node-a", "gpu-0", ("k8s.x/claim=y",)),))
                for c in claims}

server = DRAServer(Path(sys.argv[1]), Driver())
server.start()
print("serving", flush=True)
sys.stdin.readline()                   # now in a cgroup whose pids.max leaves room for a few threads
hold = threading.Event()
started = 0
while True:
    try:
        threading.Thread(target=hold.wait, daemon=True).start()
        started += 1
    except RuntimeError as err:
        print(f"at the limit after {started} threads: {err}", flush=True)
        break
time.sleep(300)
"""


def _pids_cgroup() -> Path:
    """A new pids cgroup (v1 hierarchy, or v2 where the root delegates pids)."""
    name = f"gpu-dra-test-{uuid.uuid4().hex[:8]}"
    v1 = Path("/sys/fs/cgroup/pids")
    if v1.is_dir():
        path = v1 / name
    elif "pids" in Path("/sys/fs/cgroup/cgroup.subtree_control").read_text().split():
        path = Path("/sys/fs/cgroup") / name
    else:
        raise AssertionError("no pids cgroup controller to limit the server's threads with")
    path.mkdir()
    return path


def test_the_thread_limit_reached_while_connections_arrive_does_not_stop_the_server(short_tmp: Path) -> None:
    """The server's process uses up its pids.max (as a pod at its pid limit does); connections that arrive then,
    and the calls on them, are still served: no thread is started per connection or per call."""
    sock = short_tmp / "dra.sock"
    cgroup = _pids_cgroup()
    proc = subprocess.Popen([sys.executable, "-c", SERVER_AT_ITS_THREAD_LIMIT, str(sock)], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "serving"
        tasks = len(os.listdir(f"/proc/{proc.pid}/task"))
        (cgroup / "pids.max").write_text(str(tasks + 16))
        (cgroup / "cgroup.procs").write_text(str(proc.pid))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert "at the limit" in proc.stdout.readline()
        peers = []
        for _ in range(50):
            peers.append(RawPeer(sock))
            assert prepare_seconds(sock) < 1.0
        for peer in peers:
            peer.close()
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        cgroup.rmdir()
