"""Registration, DRA v1/v1beta1 and health servers over real unix sockets, driven through the generated
stubs the way the kubelet calls them."""
from __future__ import annotations

import os
import socket
import stat
import threading
import time
from pathlib import Path

import grpc
import pytest

from api.generated.dra.v1 import api_pb2 as v1_pb
from api.generated.dra.v1 import api_pb2_grpc as v1_grpc
from api.generated.dra.v1beta1 import api_pb2 as v1beta1_pb
from api.generated.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from api.generated.dra_health.v1 import api_pb2 as h1_pb
from api.generated.dra_health.v1 import api_pb2_grpc as h1_grpc
from api.generated.dra_health.v1alpha1 import api_pb2 as h1a1_pb
from api.generated.dra_health.v1alpha1 import api_pb2_grpc as h1a1_grpc
from api.generated.pluginregistration.v1 import api_pb2 as reg_pb
from api.generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from kubeletplugin.transport.grpcserver import UnixGrpcServer
from kubeletplugin.transport.health import DeviceHealth, HealthBoard, health_from_taints
from kubeletplugin.transport.nodedriver import ClaimRef, PreparedDevice, PrepareResult, UnprepareResult
from kubeletplugin.transport.registration import RegistrationServer, supported_services
from kubeletplugin.transport.server import DRAServer
from kubeletplugin.transport.sockets import MAX_UNIX_PATH, SocketPathError, socket_paths

DRIVER = "gpu.dra-driver.io"


@pytest.fixture
def short_tmp():
    # pytest's tmp_path can exceed the 107-byte AF_UNIX limit; sockets need a short directory.
    import shutil
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="kp-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def channel(path: Path) -> grpc.Channel:
    return grpc.insecure_channel(f"unix://{path}")


class RecordingDriver:
    """Answers prepare with one device per claim; a claim named 'bad' fails."""

    def __init__(self):
        self.prepared: list[list[ClaimRef]] = []
        self.unprepared: list[list[ClaimRef]] = []

    def prepare(self, claims, arrived=None):
        self.prepared.append(list(claims))
        out = {}
        for c in claims:
            if c.name == "bad":
                out[c.uid] = PrepareResult(error="opaque config: unknown field 'x'")
            else:
                out[c.uid] = PrepareResult(devices=(PreparedDevice(
                    request_names=("gpu",), pool_name="node-a", device_name="gpu-0-shared",
                    cdi_device_ids=(f"k8s.{DRIVER}/claim={c.uid}-gpu-0-shared",), share_id="share-1"),))
        return out

    def unprepare(self, claims, arrived=None):
        self.unprepared.append(list(claims))
        return {c.uid: UnprepareResult(error="busy" if c.name == "bad" else "") for c in claims}


def test_socket_names_default_and_rolling_update(short_tmp):
    p = socket_paths(DRIVER, short_tmp / "reg", short_tmp / "plugins" / DRIVER)
    assert p.registration == short_tmp / "reg" / f"{DRIVER}-reg.sock"
    assert p.dra == short_tmp / "plugins" / DRIVER / "dra.sock"
    uid = "0f6c8a6e-3d0b-4d0c-9d7e-7d8f1f2b3c4d"
    r = socket_paths(DRIVER, short_tmp / "reg", short_tmp / "p", pod_uid=uid)
    assert r.registration.name == f"{DRIVER}-{uid}-reg.sock"
    assert r.dra.name == f"dra-{uid}.sock"


def test_rolling_update_names_shortened_to_fit_af_unix():
    uid = "0f6c8a6e-3d0b-4d0c-9d7e-7d8f1f2b3c4d"
    long_dir = "/var/lib/kubelet/" + "x" * 40
    p = socket_paths(DRIVER, long_dir, long_dir, pod_uid=uid)
    assert len(str(p.registration)) <= MAX_UNIX_PATH and len(str(p.dra)) <= MAX_UNIX_PATH
    assert uid not in p.registration.name          # hashed form
    other = socket_paths(DRIVER, long_dir, long_dir, pod_uid=uid.replace("0f", "1f"))
    assert other.registration != p.registration and other.dra != p.dra
    with pytest.raises(SocketPathError, match="longer than"):
        socket_paths(DRIVER, "/" + "y" * 120, "/tmp", pod_uid=uid)


def test_a_socket_path_at_the_af_unix_limit_is_served(short_tmp):
    """socket_paths allows MAX_UNIX_PATH bytes, so the server must bind that long a path (gRPC's "unix://" form
    failed from 106 bytes on, e.g. under a kubelet root dir in /tmp)."""
    name = "s" * (MAX_UNIX_PATH - len(str(short_tmp)) - 1)
    path = short_tmp / name
    assert len(str(path)) == MAX_UNIX_PATH
    server = UnixGrpcServer(path, lambda _server: None)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))
    finally:
        server.stop(0)
    assert not path.exists()


def test_registration_getinfo_and_notify(short_tmp):
    paths = socket_paths(DRIVER, short_tmp / "reg", short_tmp / "plugin")
    # A stale socket from an earlier run is replaced.
    paths.registration.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(paths.registration))
    stale.close()
    statuses = []
    server = RegistrationServer(DRIVER, paths.registration, paths.dra, supported_services(),
                                on_status=lambda ok, err: statuses.append((ok, err)))
    server.start()
    try:
        assert stat.S_IMODE(os.stat(paths.registration).st_mode) == 0o600
        with channel(paths.registration) as ch:
            stub = reg_grpc.RegistrationStub(ch)
            info = stub.GetInfo(reg_pb.InfoRequest(), timeout=1)
            assert info.type == "DRAPlugin"
            assert info.name == DRIVER
            assert info.endpoint == str(paths.dra)
            assert list(info.supported_versions)[:2] == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
            assert "v1alpha1.DRAResourceHealth" in info.supported_versions
            assert "v1.DRAResourceHealth" in info.supported_versions

            stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=False, error="no"), timeout=5)
            assert not server.state.registered and server.state.last_error == "no"
            # Still serving after a rejection: the kubelet retries from GetInfo.
            assert stub.GetInfo(reg_pb.InfoRequest(), timeout=1).name == DRIVER
            stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
            assert server.state.registered
            assert statuses == [(False, "no"), (True, "")]
    finally:
        server.stop()
    assert not paths.registration.exists()


def test_stale_path_that_is_not_a_socket_is_refused(short_tmp):
    path = short_tmp / "reg.sock"
    path.write_text("not a socket")
    server = RegistrationServer(DRIVER, path, short_tmp / "dra.sock", supported_services())
    with pytest.raises(SocketPathError, match="not a unix socket"):
        server.start()
    assert path.read_text() == "not a socket"


def test_dra_v1_and_v1beta1_share_one_handler(short_tmp):
    driver = RecordingDriver()
    server = DRAServer(short_tmp / "dra.sock", driver)
    server.start()
    try:
        assert stat.S_IMODE(os.stat(short_tmp / "dra.sock").st_mode) == 0o600
        with channel(short_tmp / "dra.sock") as ch:
            req1 = v1_pb.NodePrepareResourcesRequest(claims=[
                v1_pb.Claim(namespace="ns", uid="u1", name="good"),
                v1_pb.Claim(namespace="ns", uid="u2", name="bad")])
            r1 = v1_grpc.DRAPluginStub(ch).NodePrepareResources(req1, timeout=5)
            assert set(r1.claims) == {"u1", "u2"}
            assert r1.claims["u2"].error.startswith("opaque config")
            dev = r1.claims["u1"].devices[0]
            assert (list(dev.request_names), dev.pool_name, dev.device_name) == (["gpu"], "node-a", "gpu-0-shared")
            assert list(dev.cdi_device_ids) == [f"k8s.{DRIVER}/claim=u1-gpu-0-shared"]
            assert dev.HasField("share_id") and dev.share_id == "share-1"

            req2 = v1beta1_pb.NodePrepareResourcesRequest(claims=[v1beta1_pb.Claim(namespace="ns", uid="u3", name="x")])
            r2 = v1beta1_grpc.DRAPluginStub(ch).NodePrepareResources(req2, timeout=5)
            assert r2.claims["u3"].devices[0].device_name == "gpu-0-shared"
            assert not r2.claims["u3"].error

            un = v1beta1_grpc.DRAPluginStub(ch).NodeUnprepareResources(v1beta1_pb.NodeUnprepareResourcesRequest(
                claims=[v1beta1_pb.Claim(namespace="ns", uid="u1", name="good"),
                        v1beta1_pb.Claim(namespace="ns", uid="u2", name="bad")]), timeout=5)
            assert set(un.claims) == {"u1", "u2"}
            assert un.claims["u1"].error == "" and un.claims["u2"].error == "busy"

            # An empty request (used by liveness probes) is answered without calling the driver.
            empty = v1_grpc.DRAPluginStub(ch).NodePrepareResources(v1_pb.NodePrepareResourcesRequest(), timeout=5)
            assert len(empty.claims) == 0

            with pytest.raises(grpc.RpcError) as err:
                v1_grpc.DRAPluginStub(ch).NodePrepareResources(v1_pb.NodePrepareResourcesRequest(
                    claims=[v1_pb.Claim(namespace="ns", uid="", name="x")]), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [c.uid for c in driver.prepared[0]] == ["u1", "u2"]
        assert [c.uid for c in driver.prepared[1]] == ["u3"]
        assert len(driver.prepared) == 2
    finally:
        server.stop()
    assert not (short_tmp / "dra.sock").exists()


def test_health_from_taints():
    assert health_from_taints([]) == ("Healthy", "")
    assert health_from_taints([{"key": "gpu.dra-driver.io/xid", "value": "13", "effect": "None"}]) == ("Healthy", "")
    status, msg = health_from_taints([{"key": "gpu.dra-driver.io/xid", "value": "79", "effect": "NoSchedule"}])
    assert status == "Unhealthy" and "xid=79" in msg


@pytest.mark.parametrize("pb,grpc_mod", [(h1_pb, h1_grpc), (h1a1_pb, h1a1_grpc)], ids=["v1", "v1alpha1"])
def test_health_stream_full_snapshots_on_change_and_periodically(short_tmp, pb, grpc_mod):
    board = HealthBoard(resend_interval=0.3, timeout_seconds=45)
    board.set_from_taints("node-a", ["gpu-0", "gpu-1"], {})
    server = DRAServer(short_tmp / "dra.sock", RecordingDriver(), health=board)
    server.start()
    try:
        with channel(short_tmp / "dra.sock") as ch:
            stream = grpc_mod.DRAResourceHealthStub(ch).NodeWatchResources(pb.NodeWatchResourcesRequest(), timeout=10)
            first = next(stream)
            assert [(d.device.pool_name, d.device.device_name, d.health) for d in first.devices] == [
                ("node-a", "gpu-0", pb.HEALTHY), ("node-a", "gpu-1", pb.HEALTHY)]
            assert first.devices[0].health_check_timeout_seconds == 45
            t0 = time.monotonic()
            again = next(stream)  # nothing changed: re-sent after the interval
            assert time.monotonic() - t0 >= 0.2
            assert len(again.devices) == 2
            threading.Timer(0.05, lambda: board.set_from_taints(
                "node-a", ["gpu-0", "gpu-1"],
                {"gpu-1": [{"key": "gpu.dra-driver.io/gpu-lost", "effect": "NoSchedule"}]})).start()
            changed = next(stream)
            while all(d.health == pb.HEALTHY for d in changed.devices):
                changed = next(stream)
            by_name = {d.device.device_name: d for d in changed.devices}
            assert by_name["gpu-1"].health == pb.UNHEALTHY and "gpu-lost" in by_name["gpu-1"].message
            assert by_name["gpu-0"].health == pb.HEALTHY
            stream.cancel()
    finally:
        server.stop()


def test_health_board_watch_ends_on_close():
    board = HealthBoard(resend_interval=5)
    board.replace([DeviceHealth("p", "gpu-0", "Healthy")])
    seen = []
    first = threading.Event()

    def consume():
        for snap in board.watch():
            seen.append(snap)
            first.set()

    watcher = threading.Thread(target=consume)
    watcher.start()
    assert first.wait(3)
    board.close()                  # from another thread, as the server's stop does
    watcher.join(3)
    assert not watcher.is_alive() and len(seen) == 1


def test_health_watch_ends_when_stopped():
    """A cancelled stream sets its stop event and wakes the board: the watch ends without waiting for a resend."""
    board = HealthBoard(resend_interval=60)
    board.replace([DeviceHealth("p", "gpu-0", "Healthy")])
    stop = threading.Event()
    watch = board.watch(stop)
    assert next(watch)[0].device == "gpu-0"
    ended = threading.Event()

    def drain():
        for _ in watch:
            pass
        ended.set()

    threading.Thread(target=drain, daemon=True).start()
    stop.set()
    board.wake()
    assert ended.wait(3)


def test_health_watch_sleeps_between_changes_and_resends():
    """A watch wakes for a change made from another thread and for its resend, not in between: an idle stream
    costs nothing until the kubelet's resend is due."""
    board = HealthBoard(resend_interval=0.5)
    board.replace([DeviceHealth("p", "gpu-0", "Healthy")])
    times: list[float] = []

    watch = board.watch()
    next(watch)
    t0 = time.monotonic()
    threading.Timer(0.1, lambda: board.replace([DeviceHealth("p", "gpu-0", "Unhealthy", "x")])).start()
    changed = next(watch)
    times.append(time.monotonic() - t0)
    assert changed[0].status == "Unhealthy"
    resent = next(watch)                                          # nothing changed: the resend
    times.append(time.monotonic() - t0)
    assert resent == changed
    watch.close()
    assert 0.05 <= times[0] < 0.4 and times[1] >= 0.55


def test_names_from_the_kubelet_are_checked_before_use(short_tmp):
    """Namespace, name and UID go into API paths and file names: each must be a Kubernetes name, or its
    claim fails alone (a namespace '..' and name '..' once fetched /apis/resource.k8s.io/v1/)."""
    driver = RecordingDriver()
    server = DRAServer(short_tmp / "dra.sock", driver)
    server.start()
    try:
        with channel(short_tmp / "dra.sock") as ch:
            stub = v1_grpc.DRAPluginStub(ch)
            bad = [v1_pb.Claim(namespace="..", uid="u1", name=".."),
                   v1_pb.Claim(namespace="ns", uid="../../etc", name="x"),
                   v1_pb.Claim(namespace="ns", uid="u3", name="a/b"),
                   v1_pb.Claim(namespace="NS", uid="u4", name="x")]
            good = v1_pb.Claim(namespace="ns", uid="u5", name="fine")
            reply = stub.NodePrepareResources(v1_pb.NodePrepareResourcesRequest(claims=[*bad, good]), timeout=5)
            assert "namespace '..'" in reply.claims["u1"].error
            assert "not a Kubernetes UID" in reply.claims["../../etc"].error
            assert "name 'a/b'" in reply.claims["u3"].error
            assert "namespace 'NS'" in reply.claims["u4"].error
            assert reply.claims["u5"].error == ""
            assert [c.uid for c in driver.prepared[0]] == ["u5"]          # only the good claim reached the driver
            un = stub.NodeUnprepareResources(v1_pb.NodeUnprepareResourcesRequest(claims=bad), timeout=5)
            assert all(un.claims[c.uid].error for c in bad) and driver.unprepared == []
    finally:
        server.stop()


def test_both_sockets_are_served_by_grpcio_in_the_plugins_process(short_tmp):
    """What the plugin's command starts first (kubeletplugin.transport.endpoints) serves through grpcio's server,
    one for both sockets (one serving thread waking an idle plugin, not two); the kubelet's GetInfo is answered
    through it."""
    probe = (
        "import sys\n"
        "from kubeletplugin.transport.endpoints import start_endpoints\n"
        "from kubeletplugin.transport.registration import get_info\n"
        f"e = start_endpoints({DRIVER!r}, {str(short_tmp / 'reg')!r}, {str(short_tmp / 'plugin')!r}, None, 10.0)\n"
        "info = get_info(e.paths.registration, timeout=5)\n"
        "servers = {type(s._server._server).__module__ for s in (e.dra, e.registration)}\n"
        "assert e.dra.server is e.registration._server\n"
        "e.registration.stop()\n"
        "assert not e.paths.registration.exists() and e.paths.dra.exists() and not e.registration.running\n"
        "e.stop()\n"
        "assert not e.paths.dra.exists()\n"
        "print(info.name, 'grpc' in sys.modules, sorted(servers))\n")
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [DRIVER, "True", "['grpc._server']"]
