"""The plugin waiting for an unreachable API server (one line per kind of failure, no traceback, nothing served,
SIGTERM still stops it), and its HTTP endpoint: /metrics with the ResourceSlice publisher's metrics, /livez and
/healthz following the gRPC servers, the registration socket and the publisher."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from api.generated.pluginregistration.v1 import api_pb2 as reg_pb
from api.generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from dra.model.slices import ApiFeatures
from kube.backoff import Backoff
from kube.client import ApiError, ApiUnavailable
from kubeletplugin.apiserver import StoppedWaiting, describe_api_failure, wait_for_api_features
from kubeletplugin.claims import DictClaimSource
from kubeletplugin.plugin import KubeletPlugin, PluginOptions

REPO = Path(__file__).resolve().parents[2]
DRIVER = "gpu.dra-driver.io"
NODE = "node-a"


@pytest.fixture
def base():
    d = Path(tempfile.mkdtemp(prefix="kps-", dir="/tmp"))  # short: unix socket paths are limited
    yield d
    shutil.rmtree(d, ignore_errors=True)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]     # nothing listens once it is closed


def write_fleet(base: Path) -> Path:
    path = base / "fleet.yaml"
    path.write_text(yaml.safe_dump({"nodes": [{"name": NODE, "gpus": [{"model": "L4", "count": 1}]}]}))
    return path


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.lines.append((level, event, fields))


def refused() -> ApiUnavailable:
    try:
        socket.create_connection(("127.0.0.1", closed_port()), timeout=2)
    except OSError as err:
        raise ApiUnavailable(f"GET https://127.0.0.1/version: {type(err).__name__}: {err}") from err
    raise AssertionError("the closed port accepted a connection")


# --------------------------------------------------------------------------------------------------- unit

def test_failure_kinds_are_short_and_stable():
    for _ in range(2):
        with pytest.raises(ApiUnavailable) as caught:
            refused()
        assert describe_api_failure(caught.value) == "connection refused"
    assert describe_api_failure(ApiError("GET", "/version", 403, '{"reason": "Forbidden"}')) == "HTTP 403 Forbidden"
    timeout = ApiUnavailable("GET x: ReadTimeoutError: Read timed out. (read timeout=30)")
    assert describe_api_failure(timeout) == "timed out"


def test_wait_logs_each_kind_of_failure_once_and_returns_the_features():
    with pytest.raises(ApiUnavailable) as caught:
        refused()
    outcomes = [caught.value] * 3 + [ApiError("GET", "/version", 503, "{}")] * 2 + [caught.value, "ok"]
    calls, waits, lines = [], [], Lines()

    def fetch(_client):
        calls.append(1)
        outcome = outcomes[len(calls) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        return ApiFeatures.all()

    features = wait_for_api_features(object(), threading.Event(), fetch=fetch, on_wait=waits.append,
                                     backoff=Backoff(initial=0.001, maximum=0.004), log=lines)
    assert features == ApiFeatures.all() and len(calls) == 7
    warnings = [event for level, event, _ in lines.lines if level == "warning"]
    assert len(warnings) == 3, warnings     # refused, HTTP 503, refused again: one line each time the kind changes
    assert "(connection refused)" in warnings[0] and "(HTTP 503)" in warnings[1] and "(connection refused)" in warnings[2]
    assert all("serving nothing to the kubelet" in w for w in warnings)
    assert [fields["attempt"] for level, _, fields in lines.lines if level == "warning"] == [1, 4, 6]
    assert [level for level, _, _ in lines.lines][-1] == "info"
    assert waits[-1].endswith("connection refused (attempt 6)")


def test_stop_ends_the_wait_at_once():
    stop = threading.Event()

    def fetch(_client):
        raise ApiUnavailable("GET x: ConnectionRefusedError: [Errno 111] Connection refused")

    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(StoppedWaiting):
        wait_for_api_features(object(), stop, fetch=fetch, backoff=Backoff(initial=60, maximum=60), log=Lines())
    assert time.monotonic() - t0 < 5


# --------------------------------------------------------------------------------------------------- the process

def test_unreachable_api_server_at_start_is_waited_for_and_sigterm_stops_it(base):
    port = closed_port()
    kubeconfig = base / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}",
                                               "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    (base / "boot_id").write_text("b1\n")
    log_path = base / "plugin.log"
    # A port found free may be taken by someone else before the plugin listens on it (a busy machine's outgoing
    # connections use the same range): then the plugin says so and exits 2, and it is started on another.
    for attempt in range(5):
        metrics_port = closed_port()
        argv = [sys.executable, "-m", "cli.main", "kubelet-plugin", "--node-name", NODE, "--kubeconfig",
                str(kubeconfig), "--registry-dir", str(base / "reg"), "--plugin-dir", str(base / "plug"),
                "--cdi-root", str(base / "cdi"), "--fleet", str(write_fleet(base)), "--driver-root", str(base / "noroot"),
                "--boot-id-path", str(base / "boot_id"), "--metrics-port", str(metrics_port), "--log-format", "text"]
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 30
        while "not usable yet" not in log_path.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        if proc.poll() is None or "cannot listen: Address already in use" not in log_path.read_text():
            break
    try:
        assert proc.poll() is None, log_path.read_text()
        time.sleep(2.5)                     # attempts after 0.5, 1.5 and 3.5 s: all of the same kind
        status, body = get(f"http://127.0.0.1:{metrics_port}/healthz")
        assert status == 503 and "waiting for the API server" in body and "connection refused" in body, body
        assert proc.poll() is None, "the plugin gave up"
        # The kubelet already finds the plugin (its sockets come first); its calls would wait for the driver.
        reg = base / "reg" / "gpu.dra-driver.io-reg.sock"
        with grpc.insecure_channel(f"unix:{reg}") as channel:
            info = reg_grpc.RegistrationStub(channel).GetInfo(reg_pb.InfoRequest(), timeout=2)
        assert info.endpoint == str(base / "plug" / "dra.sock") and (base / "plug" / "dra.sock").exists()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    lines = [line for line in text.splitlines() if "not usable yet" in line]
    assert len(lines) == 1, text
    assert "connection refused" in lines[0] and f"127.0.0.1:{port}" in lines[0]
    assert "Traceback" not in text
    assert "stopped before the API server answered" in text


# --------------------------------------------------------------------------------------------------- /metrics and health

def make_plugin(base: Path, metrics_port: int) -> KubeletPlugin:
    opts = PluginOptions(
        node_name=NODE, registry_dir=str(base / "reg"), plugin_dir=str(base / "plug"), cdi_root=str(base / "cdi"),
        driver_root=str(base / "noroot"), fleet=str(write_fleet(base)), boot_id_path=str(base / "boot_id"),
        health_wait_ms=100, metrics_port=metrics_port)
    (base / "boot_id").write_text("b1\n")
    return KubeletPlugin(opts, claim_source=DictClaimSource(), publish=False, features=ApiFeatures.all())


def failing_publisher(driver: str):
    """A real ResourceSlice publisher whose API server is away, after one failed pool sync."""
    from kubernetes import client as kclient

    from kube.resourceslices import DesiredPool, Owner, ResourceSliceController

    config = kclient.Configuration()
    config.host = f"http://127.0.0.1:{closed_port()}"
    publisher = ResourceSliceController(kclient.ApiClient(config), driver, Owner.node(NODE))
    publisher.update({NODE: DesiredPool(slices=[{"devices": []}], node_name=NODE)})
    publisher._process(NODE)
    return publisher


def test_metrics_and_health_endpoints(base):
    port = closed_port()
    plugin = make_plugin(base, port)
    plugin.start()
    url = f"http://127.0.0.1:{port}"
    try:
        assert get(f"{url}/healthz") == (200, "ok\n")
        assert get(f"{url}/livez") == (200, "ok\n")
        status, metrics = get(f"{url}/metrics")
        assert status == 200 and "gpu_dra_node_prepare_claim_duration_seconds" in metrics

        plugin.slices = publisher = failing_publisher(DRIVER)
        [(seconds, error)] = publisher.failing().values()
        assert "ApiUnavailable" in error
        status, metrics = get(f"{url}/metrics")
        assert f'gpu_dra_resourceslice_pool_syncs_total{{driver="{DRIVER}",result="error"}}' in metrics
        assert f'gpu_dra_resourceslice_desired_pools{{driver="{DRIVER}"}} 1.0' in metrics
        assert get(f"{url}/healthz") == (200, "ok\n")          # failing, but not for long yet
        plugin.options.publish_failure_grace = 0.0
        status, body = get(f"{url}/healthz")
        assert status == 503 and f"publishing ResourceSlices of pool {NODE} has failed for" in body, body
        assert get(f"{url}/readyz")[0] == 503
        assert get(f"{url}/livez") == (200, "ok\n")            # a restart would not bring the API server back
        plugin.slices = None

        plugin.paths.registration.unlink()                     # e.g. the registry directory was wiped
        status, body = get(f"{url}/livez")
        assert status == 503 and "does not answer GetInfo" in body, body
        assert get(f"{url}/healthz")[0] == 503
        plugin.registration.stop()
        assert get(f"{url}/livez") == (503, "the registration gRPC server is not running\n")
    finally:
        plugin.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/healthz", timeout=2)    # the endpoint goes with the plugin


# --------------------------------------------------------------------------------------------------- registration first

def notify_registered(plugin: KubeletPlugin) -> None:
    """What the kubelet says once it has registered the plugin."""
    import grpc

    from api.generated.pluginregistration.v1 import api_pb2 as reg_pb
    from api.generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc

    with grpc.insecure_channel(f"unix://{plugin.paths.registration}") as channel:
        reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
            reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)


def test_slices_are_published_only_once_the_kubelet_confirms_the_registration(base, monkeypatch):
    """A pod scheduled onto our devices before the kubelet knows the driver fails its prepare and waits for the
    kubelet's next resync (a minute): nothing is published before NotifyRegistrationStatus, and /healthz says
    why. A later registration (a restarted kubelet, which deleted the node's slices) syncs the pool at once."""
    from kubernetes import client as kclient

    from kube.resourceslices import ResourceSliceController

    config = kclient.Configuration()
    config.host = f"http://127.0.0.1:{closed_port()}"      # the publisher's writes fail; they are not the point
    port = closed_port()
    opts = PluginOptions(
        node_name=NODE, registry_dir=str(base / "reg"), plugin_dir=str(base / "plug"), cdi_root=str(base / "cdi"),
        driver_root=str(base / "noroot"), fleet=str(write_fleet(base)), boot_id_path=str(base / "boot_id"),
        health_wait_ms=100, metrics_port=port)
    (base / "boot_id").write_text("b1\n")
    resyncs: list[float] = []   # the prompt window of each resync
    monkeypatch.setattr(ResourceSliceController, "resync",
                        lambda self, prompt_for=0.0: resyncs.append(prompt_for))
    plugin = KubeletPlugin(opts, claim_source=DictClaimSource(), api_client=kclient.ApiClient(config),
                           features=ApiFeatures.all())
    plugin.start()
    try:
        time.sleep(0.5)
        assert plugin.slices is None
        assert get(f"http://127.0.0.1:{port}/livez") == (200, "ok\n")
        status, body = get(f"http://127.0.0.1:{port}/healthz")
        assert status == 503 and "waiting for the kubelet to register the plugin" in body, body

        notify_registered(plugin)
        deadline = time.monotonic() + 5
        # The publisher exists a moment before it is handed the pool: wait for both.
        while (plugin.slices is None or not plugin.slices._desired) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert plugin.slices is not None and set(plugin.slices._desired or {}) == {NODE}
        assert resyncs == []                                    # the first registration starts the publisher

        notify_registered(plugin)
        # A re-registration: the kubelet restarted and wipes the node's slices, maybe after this resync.
        assert len(resyncs) == 1 and resyncs[0] > 0
    finally:
        plugin.stop()
