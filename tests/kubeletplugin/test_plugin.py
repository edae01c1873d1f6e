"""The plugin process on a simulated fleet node, without an API server: sockets, registration, prepare through
the DRA socket, the health stream following NVML events, clean shutdown that leaves claims prepared, and the
command line."""
from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid as uuidlib
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from claims import resource_claim
from fixtures.fake_driver_root import build_fake_driver_root

from api.generated.dra.v1 import api_pb2 as v1_pb
from api.generated.dra.v1 import api_pb2_grpc as v1_grpc
from api.generated.dra_health.v1alpha1 import api_pb2 as h_pb
from api.generated.dra_health.v1alpha1 import api_pb2_grpc as h_grpc
from api.generated.pluginregistration.v1 import api_pb2 as reg_pb
from api.generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from cli.kubeletplugin_cmd import options_from_args
from cli.main import build_parser
from dra.model.slices import ApiFeatures
from dra.node.cdi import load_spec
from dra.sim.fleet import nvml_for_node, parse_fleet
from kubeletplugin.claims import DictClaimSource
from kubeletplugin.plugin import (
    KubeletPlugin,
    PluginConfigError,
    PluginOptions,
    UnavailableSharingControl,
    load_node_policy,
)
from kubeletplugin.transport.nodedriver import ClaimRef

DRIVER = "gpu.dra-driver.io"
NODE = "node-a"


@pytest.fixture
def base():
    d = Path(tempfile.mkdtemp(prefix="kpp-", dir="/tmp"))  # short: unix socket paths are limited
    yield d
    shutil.rmtree(d, ignore_errors=True)


def write_fleet(base: Path) -> Path:
    path = base / "fleet.yaml"
    path.write_text(yaml.safe_dump({"nodes": [{
        "name": NODE, "gpus": [{"model": "H100-80GB", "count": 2}],
        "policy": {"default": {"mig": "dynamic", "slots": {"count": 2, "strategy": "time-slicing"}}}}]}))
    return path


def make_plugin(base: Path, claims: DictClaimSource, pod_uid: str | None = None, *, publish: bool = False,
                api_client: object = None) -> KubeletPlugin:
    opts = PluginOptions(
        node_name=NODE, registry_dir=str(base / "reg"), plugin_dir=str(base / "plug"), cdi_root=str(base / "cdi"),
        driver_root=str(base / "noroot"), proc_root=str(base / "noproc"), dev_root=str(base / "nodev"),
        fleet=str(write_fleet(base)), boot_id_path=str(base / "boot_id"), health_interval=0.5,
        health_wait_ms=100, pod_uid=pod_uid)
    (base / "boot_id").write_text("b1\n")
    return KubeletPlugin(opts, claim_source=claims, publish=publish, features=ApiFeatures.all(), api_client=api_client)


def claim(name: str, device: str, uid: str | None = None) -> dict:
    return resource_claim(name, "ns", uid=uid or str(uuidlib.uuid4()), typed=False,
                          results=[{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}])


def test_plugin_serves_kubelet_and_leaves_claims_prepared_on_shutdown(base):
    claims = DictClaimSource()
    c = claim("mig", "gpu-1-mig-1g10gb-19-6")
    claims.put(c)
    uid = c["metadata"]["uid"]
    plugin = make_plugin(base, claims)
    plugin.start()
    reg_sock = base / "reg" / f"{DRIVER}-reg.sock"
    dra_sock = base / "plug" / "dra.sock"
    try:
        assert reg_sock.exists() and dra_sock.exists()
        with grpc.insecure_channel(f"unix://{reg_sock}") as ch:
            info = reg_grpc.RegistrationStub(ch).GetInfo(reg_pb.InfoRequest(), timeout=1)
            assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, str(dra_sock))
            reg_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
                reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
        assert plugin.registration.state.registered
        assert plugin.metrics.registered._value.get() == 1

        with grpc.insecure_channel(f"unix://{dra_sock}") as ch:
            resp = v1_grpc.DRAPluginStub(ch).NodePrepareResources(v1_pb.NodePrepareResourcesRequest(
                claims=[v1_pb.Claim(namespace="ns", uid=uid, name="mig")]), timeout=10)
            assert resp.claims[uid].error == ""
            [dev] = resp.claims[uid].devices
            assert dev.device_name == "gpu-1-mig-1g10gb-19-6"
            spec = load_spec(base / "cdi" / f"k8s.{DRIVER}-claim_{uid}.json")
            nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
            assert nodes[0] == "/dev/nvidia1" and len(nodes) == 3   # synthetic nodes on a simulated node
            assert plugin.metrics.devices.labels(state="prepared")._value.get() == 1
            assert plugin.metrics.prepared_claims._value.get() == 1

            # Health: a fatal XID on GPU 0 makes its devices unhealthy in the stream.
            stream = h_grpc.DRAResourceHealthStub(ch).NodeWatchResources(h_pb.NodeWatchResourcesRequest(), timeout=20)
            first = next(stream)
            names = {d.device.device_name for d in first.devices}
            assert {"gpu-0", "gpu-1", "gpu-0-slot-1"} <= names
            assert all(d.health == h_pb.HEALTHY for d in first.devices)
            plugin.nvml.inject_xid(plugin.inventory.gpus[0].uuid, 79)
            deadline = time.monotonic() + 10
            for msg in stream:
                health = {d.device.device_name: d.health for d in msg.devices}
                if health["gpu-0"] == h_pb.UNHEALTHY:
                    break
                assert time.monotonic() < deadline, "XID never reached the health stream"
            assert health["gpu-0-slot-0"] == h_pb.UNHEALTHY and health["gpu-1"] == h_pb.HEALTHY
            stream.cancel()
        assert plugin.metrics.devices.labels(state="prepared")._value.get() == 1
        assert plugin.metrics.devices.labels(state="unhealthy")._value.get() > 0
    finally:
        plugin.stop()
    assert not reg_sock.exists() and not dra_sock.exists()
    # Shutdown does not unprepare: the CDI spec, the MIG device and the checkpoint entry remain.
    assert (base / "cdi" / f"k8s.{DRIVER}-claim_{uid}.json").exists()
    assert plugin.driver.checkpoint.get(uid).completed
    assert len(plugin.driver.checkpoint.get(uid).undo.mig_devices) == 1


def test_rolling_update_socket_names_and_file_lock(base):
    claims = DictClaimSource()
    pod = "5d1e7c3a-0000-4000-8000-00000000beef"
    plugin = make_plugin(base, claims, pod_uid=pod)
    plugin.start()
    try:
        assert (base / "reg" / f"{DRIVER}-{pod}-reg.sock").exists()
        assert (base / "plug" / f"dra-{pod}.sock").exists()
        c = claim("whole", "gpu-0")
        claims.put(c)
        from kubeletplugin.transport.nodedriver import ClaimRef
        ref = ClaimRef("ns", c["metadata"]["uid"], "whole")
        assert plugin.driver.prepare([ref])[ref.uid].error == ""
        assert (base / "plug" / "serialize.lock").exists()
    finally:
        plugin.stop()


def test_node_policy_file_errors_name_the_file(base):
    bad = base / "policy.yaml"
    bad.write_text("default:\n  mig: sometimes\n")
    with pytest.raises(PluginConfigError, match="policy.yaml.*mig"):
        load_node_policy(str(bad))
    with pytest.raises(PluginConfigError, match="missing.yaml"):
        load_node_policy(str(base / "missing.yaml"))
    good = base / "good.yaml"
    good.write_text("default:\n  slots: {count: 3}\n")
    assert load_node_policy(str(good)).default.slots.count == 3


@pytest.mark.parametrize("content, reason", [
    (b"default: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested deeper than"),
    (b"default:\n  mig: \xff\n", "not UTF-8"),
    (b"default: [unclosed\n", "not valid YAML"),
])
def test_a_bad_node_policy_file_is_one_line(base, content, reason):
    path = base / "policy.yaml"
    path.write_bytes(content)
    with pytest.raises(PluginConfigError) as err:
        load_node_policy(str(path))
    assert str(path) in str(err.value) and reason in str(err.value) and "\n" not in str(err.value)


def test_command_line_flags_and_environment(monkeypatch):
    monkeypatch.setenv("NODE_NAME", "node-x")
    monkeypatch.setenv("POD_UID", "pod-1")
    monkeypatch.setenv("HEALTH_INTERVAL", "7")
    args = build_parser().parse_args(["kubelet-plugin", "--compat-nvidia", "--cdi-root", "/tmp/cdi",
                                      "--fleet", "f.yaml"])
    opts = options_from_args(args)
    assert opts.node_name == "node-x" and opts.pod_uid == "pod-1" and opts.health_interval == 7.0
    assert opts.driver_name == "gpu.nvidia.com" and opts.compat_nvidia
    assert opts.cdi_root == "/tmp/cdi" and opts.fleet == "f.yaml"
    assert opts.plugin_directory == Path("/var/lib/kubelet/plugins/gpu.nvidia.com")
    assert opts.registry_dir == "/var/lib/kubelet/plugins_registry"


def test_health_quiet_period_flag(monkeypatch, base):
    def parse(*extra: str):
        return options_from_args(build_parser().parse_args(["kubelet-plugin", "--node-name", NODE, *extra]))
    monkeypatch.delenv("HEALTH_QUIET_PERIOD", raising=False)
    assert parse().health_quiet_period == 300.0
    assert parse("--health-quiet-period", "0").health_quiet_period == 0.0
    monkeypatch.setenv("HEALTH_QUIET_PERIOD", "12.5")
    assert parse().health_quiet_period == 12.5
    with pytest.raises(ValueError, match="--health-quiet-period -1.0"):
        parse("--health-quiet-period", "-1")
    # The monitor gets it; 0 means the taints stay until the GPU is declared healthy.
    plugin = make_plugin(base, DictClaimSource())
    plugin.options.health_quiet_period = 0
    plugin.start()
    try:
        assert plugin.monitor.quiet_period_s is None
        assert plugin.monitor.recoveries is not None    # simulated GPUs: `gpu-dra simulate recover` reaches it
    finally:
        plugin.stop()


def test_command_requires_node_name(monkeypatch, capsys):
    monkeypatch.delenv("NODE_NAME", raising=False)
    from cli.main import main

    assert main(["kubelet-plugin", "--fleet", "x.yaml"]) == 2
    assert "--node-name" in capsys.readouterr().err


def wait_for(check, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def board(plugin: KubeletPlugin) -> dict[str, str]:
    return {d.device: d.status for d in plugin.health_board.snapshot()[1]}


def test_fatal_xid_taint_survives_a_plugin_restart_until_recovered(base):
    claims = DictClaimSource()
    plugin = make_plugin(base, claims)
    plugin.start()
    try:
        gpu0 = plugin.inventory.gpus[0].uuid
        plugin.nvml.inject_xid(gpu0, 79)
        wait_for(lambda: board(plugin).get("gpu-0") == "Unhealthy", what="the XID to taint gpu-0")
        tainted = {d.name: d.taints for d in plugin.published}["gpu-0"]
    finally:
        plugin.stop()
    assert (base / "plug" / "device-taints.json").exists()      # in the state directory

    again = make_plugin(base, claims)     # a new process: the XID event itself is history on the GPUs
    again.start()
    try:
        # Tainted from the first publish on, with the same timeAdded, before any new event.
        assert {d.name: d.taints for d in again.published}["gpu-0"] == tainted
        assert board(again)["gpu-0"] == "Unhealthy" and board(again)["gpu-0-slot-0"] == "Unhealthy"
        assert board(again)["gpu-1"] == "Healthy"
        again.nvml.recover_gpu(gpu0)      # the operator's word
        wait_for(lambda: board(again).get("gpu-0") == "Healthy", what="recover to clear gpu-0")
    finally:
        again.stop()
    third = make_plugin(base, claims)
    third.start()
    try:
        assert board(third)["gpu-0"] == "Healthy"
    finally:
        third.stop()


class Publisher:
    """Stands in for the ResourceSlice publisher: records what it is asked to publish."""

    def __init__(self) -> None:
        self.pools: list[dict] = []

    def update(self, pools: dict) -> None:
        self.pools.append(pools)

    def stop(self) -> None:
        pass


class Lines:
    """Stands in for the plugin's logger: (level, event, fields) per line."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.lines.append((level, event, fields))


def test_invalid_pool_is_not_published_and_logged_once(base, monkeypatch):
    from kubeletplugin import plugin as plugin_module

    plugin = make_plugin(base, DictClaimSource())
    plugin.start()
    publisher = plugin.slices = Publisher()
    lines = Lines()
    monkeypatch.setattr(plugin_module, "log", lines)
    try:
        plugin._rebuild()
        assert len(publisher.pools) == 1 and plugin.invalid_pool is None
        valid = plugin_module.desired_pool_slices

        def with_a_duplicate(*args, **kwargs):
            specs = valid(*args, **kwargs)
            devices = next(s for s in specs if s.get("devices"))["devices"]
            devices.append(dict(devices[0]))
            return specs

        monkeypatch.setattr(plugin_module, "desired_pool_slices", with_a_duplicate)
        plugin._rebuild()
        plugin.nvml.inject_xid(plugin.inventory.gpus[1].uuid, 79)   # another rebuild, same problem
        wait_for(lambda: board(plugin).get("gpu-1") == "Unhealthy", what="the XID to taint gpu-1")
        plugin._rebuild()
        assert len(publisher.pools) == 1                           # nothing invalid was sent
        errors = [(event, fields) for level, event, fields in lines.lines if level == "error"]
        assert len(errors) == 1, errors
        event, fields = errors[0]
        assert f"not publishing ResourceSlices for pool {NODE}" in event and "published before stay" in event
        assert any("appears twice in the pool" in p for p in fields["problems"])
        assert plugin.invalid_pool == tuple(fields["problems"])

        monkeypatch.setattr(plugin_module, "desired_pool_slices", valid)
        plugin._rebuild()
        assert len(publisher.pools) == 2 and plugin.invalid_pool is None
        assert any(event.startswith("ResourceSlices valid again") for _, event, _ in lines.lines)
    finally:
        plugin.stop()


class _RecordingSlices:
    """Stands in for the slice publisher: records that it was started."""
    started = threading.Event()

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def start(self) -> "_RecordingSlices":
        self.started.set()
        return self

    def update(self, pools: object) -> None:
        pass

    def resync(self, prompt_for: float = 0.0) -> None:
        pass

    def failing(self) -> dict:
        return {}

    def stop(self) -> None:
        pass


def test_slices_are_published_when_the_kubelet_registers_the_plugin_and_stop_ends_the_wait(base, monkeypatch):
    """The publisher waits for the registration without polling: the kubelet's NotifyRegistrationStatus wakes it
    at once, and stop() ends a wait for a registration that never comes."""
    import kube.resourceslices

    monkeypatch.setattr(kube.resourceslices, "ResourceSliceController", _RecordingSlices)
    _RecordingSlices.started = threading.Event()
    plugin = make_plugin(base, DictClaimSource(), publish=True, api_client=object())
    plugin.start()
    try:
        assert not _RecordingSlices.started.wait(0.5)   # not registered: nothing published
        with grpc.insecure_channel(f"unix://{plugin.paths.registration}") as ch:
            reg_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
                reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
        assert _RecordingSlices.started.wait(5)
    finally:
        plugin.stop()

    _RecordingSlices.started = threading.Event()
    other = base / "unregistered"
    other.mkdir()
    plugin = make_plugin(other, DictClaimSource(), publish=True, api_client=object())
    plugin.start()
    began = time.monotonic()
    plugin.stop()
    assert time.monotonic() - began < 5          # the registration wait ended with stop, not a timeout
    assert not _RecordingSlices.started.is_set()


def test_mps_supervisor_waits_for_a_call_while_no_daemon_is_in_use(base, monkeypatch):
    """No MPS daemon in use: the supervisor does not poll; it looks again after a kubelet call, and supervises every
    interval while a claim uses a daemon."""
    plugin = make_plugin(base, DictClaimSource())
    plugin.options.mps_supervise_interval = 0.05
    plugin.start()
    try:
        rounds: list[float] = []
        monkeypatch.setattr(plugin.driver, "supervise_mps", lambda: rounds.append(time.monotonic()) or [])
        time.sleep(0.5)
        assert rounds == []                      # a 0.05 s poll would have run about ten rounds
        monkeypatch.setattr(plugin.driver.actions, "mps_devices_in_use", lambda except_claim=None: {"d": "gpu"})
        plugin.driver._changed()                 # what every kubelet call ends with
        deadline = time.monotonic() + 5
        while len(rounds) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(rounds) >= 3
    finally:
        began = time.monotonic()
        plugin.stop()
    assert time.monotonic() - began < 5


# --- a driver root without nvidia-smi -------------------------------------------------------------------------------
# The plugin on a node whose driver root has no ``nvidia-smi``: it still starts, whole GPUs keep working, and
# claims that need time-slicing or MPS fail with the reason instead of breaking the node.

def put_claim(claims: DictClaimSource, name: str, device: str, config: dict[str, Any] | None = None) -> ClaimRef:
    uid = str(uuidlib.uuid4())
    opaque = [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": config}}] if config else []
    claims.put(resource_claim(name, "ns", uid=uid, typed=False, allocation_config=opaque,
                              results=[{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]))
    return ClaimRef("ns", uid, name)


def sharing(strategy: str, **settings: Any) -> dict[str, Any]:
    return {"apiVersion": "gpu.dra-driver.io/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": strategy, **settings}}


def test_without_nvidia_smi_whole_gpus_work_and_sharing_claims_fail_with_the_reason(base):
    tree = build_fake_driver_root(base / "host", gpu_minors=(0, 1, 2))
    (tree.root / "usr/bin/nvidia-smi").unlink()
    tree.add_hook()   # a real node does not start without a CDI hook
    nvml = nvml_for_node(parse_fleet({"nodes": [{"name": NODE, "gpus": [{"model": "L4", "count": 3}]}]}).node(NODE))
    nvml.nvmlInit()
    (base / "boot_id").write_text("b1\n")
    claims = DictClaimSource()
    opts = PluginOptions(node_name=NODE, registry_dir=str(base / "reg"), plugin_dir=str(base / "plug"),
                         cdi_root=str(base / "cdi"), driver_root=str(tree.root), dev_root=str(tree.dev_root),
                         proc_root=str(tree.proc_root), boot_id_path=str(base / "boot_id"), health_wait_ms=100)
    plugin = KubeletPlugin(opts, nvml=nvml, claim_source=claims, publish=False, features=ApiFeatures.all())
    plugin.start()
    try:
        assert isinstance(plugin.driver.mps.control, UnavailableSharingControl)
        reason = f"GPU sharing is unavailable on this node: driver root {tree.root}: nvidia-smi not found"

        sliced = put_claim(claims, "sliced", "gpu-0", sharing("TimeSlicing", timeSlicing={"interval": "Long"}))
        mps = put_claim(claims, "mps", "gpu-1", sharing("MPS", mps={"activeThreadPercentage": 50}))
        plain = put_claim(claims, "plain", "gpu-2")
        out = plugin.driver.prepare([sliced, mps, plain])
        assert out[sliced.uid].error == f"claim {sliced.describe()}: {reason}"
        assert out[mps.uid].error == f"claim {mps.describe()}: {reason}"
        assert out[plain.uid].error == ""
        assert [d.device_name for d in out[plain.uid].devices] == ["gpu-2"]

        # The failed claims hold nothing: their retries fail the same way, and their GPUs go whole to other claims.
        for ref in (sliced, mps):
            assert plugin.driver.checkpoint.get(ref.uid) is None
            assert not plugin.driver.cdi.spec_path(ref.uid).exists()
            assert plugin.driver.prepare([ref])[ref.uid].error == f"claim {ref.describe()}: {reason}"
        after = [put_claim(claims, "after-0", "gpu-0"), put_claim(claims, "after-1", "gpu-1")]
        assert [r.error for r in plugin.driver.prepare(after).values()] == ["", ""]
        assert [r.error for r in plugin.driver.unprepare([plain, *after]).values()] == ["", "", ""]
        assert plugin.driver.checkpoint.claims() == {}
    finally:
        plugin.stop()
