"""The kubelet stand-in's rule checks, against tiny in-test plugins served through the generated stubs."""
from __future__ import annotations

import json
import shutil
import socket
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from api.generated.dra.v1 import api_pb2 as v1
from api.generated.dra.v1 import api_pb2_grpc as v1_grpc
from api.generated.dra.v1beta1 import api_pb2 as v1beta1
from api.generated.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from api.generated.dra_health.v1alpha1 import api_pb2 as health
from api.generated.dra_health.v1alpha1 import api_pb2_grpc as health_grpc
from api.generated.pluginregistration.v1 import api_pb2 as reg
from api.generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from standin import (
    AllocatedDevice,
    CdiError,
    ClaimOutcome,
    ClaimRef,
    DraCallError,
    DraClient,
    DriverNotRegistered,
    KubeletStandin,
    PluginWatcher,
    PodNotReady,
    PodPrepareError,
    PreparedDevice,
    ProtocolViolation,
    resolve_cdi,
)
from standin.rules import cdi_id_problem, cdi_ids_for_container, check_prepare_response, check_unprepare_response

DRIVER = "gpu.example.com"
CDI = "k8s.gpu.example.com/claim"


# --- a tiny plugin ---------------------------------------------------------------------------------------


class FakeDra:
    """DRA servicer whose answers come from ``prepare`` / ``unprepare`` callables; records every request."""

    def __init__(self, messages, prepare=None, unprepare=None):
        self.m = messages
        self.requests: list[tuple[str, list[tuple[str, str, str]]]] = []
        self.prepare = prepare or self.prepare_all
        self.unprepare = unprepare or (lambda req: {c.uid: "" for c in req.claims})

    def prepare_all(self, req):
        """Default: one device gpu-0 per claim, request 'gpu'."""
        return {c.uid: dict(devices=[dict(request_names=["gpu"], pool_name="node-a", device_name="gpu-0",
                                          cdi_device_ids=[f"{CDI}={c.uid}-gpu-0"])]) for c in req.claims}

    def NodePrepareResources(self, request, context):
        self.requests.append(("prepare", [(c.namespace, c.name, c.uid) for c in request.claims]))
        answer = self.prepare(request)
        if isinstance(answer, grpc.StatusCode):
            context.abort(answer, "plugin says no")
        out = self.m.NodePrepareResourcesResponse()
        for uid, entry in answer.items():
            item = out.claims[uid]
            item.error = entry.get("error", "")
            for d in entry.get("devices", []):
                item.devices.add(**d)
        return out

    def NodeUnprepareResources(self, request, context):
        self.requests.append(("unprepare", [(c.namespace, c.name, c.uid) for c in request.claims]))
        out = self.m.NodeUnprepareResourcesResponse()
        for uid, error in self.unprepare(request).items():
            out.claims[uid].error = error
        return out


class FakeRegistration(reg_grpc.RegistrationServicer):
    def __init__(self, info: reg.PluginInfo):
        self.info = info
        self.statuses: list[tuple[bool, str]] = []

    def GetInfo(self, request, context):
        return self.info

    def NotifyRegistrationStatus(self, request, context):
        self.statuses.append((request.plugin_registered, request.error))
        return reg.RegistrationStatusResponse()


class FakeHealth(health_grpc.DRAResourceHealthServicer):
    def __init__(self, updates: list[list[tuple[str, str, int]]]):
        self.updates = updates

    def NodeWatchResources(self, request, context):
        for devices in self.updates:
            yield health.NodeWatchResourcesResponse(devices=[
                health.DeviceHealth(device=health.DeviceIdentifier(pool_name=p, device_name=d), health=h,
                                    last_updated_time=int(time.time()))
                for p, d, h in devices
            ])
        while context.is_active():
            time.sleep(0.05)


class FakePlugin:
    """A registration socket in ``registry`` and a DRA socket in ``plugin_dir``, like the real plugin."""

    def __init__(self, registry: Path, plugin_dir: Path, *, name=DRIVER, type_="DRAPlugin",
                 versions=("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"),
                 endpoint: str | None = None, reg_name: str | None = None, health_updates=()):
        self.dra_socket = plugin_dir / "dra.sock"
        self.reg_socket = registry / (reg_name or f"{name}-reg.sock")
        self.v1 = FakeDra(v1)
        self.v1beta1 = FakeDra(v1beta1)
        info = reg.PluginInfo(type=type_, name=name, endpoint=str(self.dra_socket) if endpoint is None else endpoint,
                              supported_versions=list(versions))
        self.registration = FakeRegistration(info)
        self.dra_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        v1_grpc.add_DRAPluginServicer_to_server(self.v1, self.dra_server)
        v1beta1_grpc.add_DRAPluginServicer_to_server(self.v1beta1, self.dra_server)
        health_grpc.add_DRAResourceHealthServicer_to_server(FakeHealth(list(health_updates)), self.dra_server)
        self.dra_server.add_insecure_port("unix:" + str(self.dra_socket))
        self.reg_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        reg_grpc.add_RegistrationServicer_to_server(self.registration, self.reg_server)
        self.reg_server.add_insecure_port("unix:" + str(self.reg_socket))

    def start(self) -> "FakePlugin":
        self.dra_server.start()      # DRA socket first, so the endpoint is listening when registration starts
        self.reg_server.start()
        return self

    def stop(self) -> None:
        self.reg_server.stop(None).wait()
        self.dra_server.stop(None).wait()
        for p in (self.reg_socket, self.dra_socket):
            p.unlink(missing_ok=True)


@pytest.fixture
def dirs():
    # AF_UNIX paths are limited to 107 bytes: keep them short instead of using pytest's tmp_path.
    root = Path(tempfile.mkdtemp(prefix="ks-", dir="/tmp"))
    (root / "reg").mkdir()
    (root / "plug").mkdir()
    yield root / "reg", root / "plug"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def plugins(dirs):
    started: list[FakePlugin] = []

    def make(**kw) -> FakePlugin:
        p = FakePlugin(*dirs, **kw).start()
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


def refs(*uids: str) -> list[ClaimRef]:
    return [ClaimRef(namespace="ns", name=f"claim-{u}", uid=u) for u in uids]


def alloc(uid: str, *devices: tuple[str, str], share_id=None) -> dict[str, list[AllocatedDevice]]:
    return {uid: [AllocatedDevice(request=r, driver=DRIVER, pool="node-a", device=d, share_id=share_id) for r, d in devices]}


# --- pure rules -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cdi_id", ["k8s.gpu.example.com/claim=abc-gpu-0", "nvidia.com/gpu=0", "v/c=MIG-1:2.3_4"])
def test_well_formed_cdi_ids_pass(cdi_id):
    assert cdi_id_problem(cdi_id) is None


@pytest.mark.parametrize("cdi_id", ["", "gpu-0", "vendor/class", "/class=x", "vendor/=x", "vendor/class=", "1vendor/c=x",
                                    "vendor./c=x", "vendor/class=-x", "vendor/class=x y", "a/b/c=x"])
def test_malformed_cdi_ids_are_named(cdi_id):
    assert cdi_id_problem(cdi_id)


def test_missing_and_unknown_claims_are_violations():
    answered = {"b": ClaimOutcome(ClaimRef("ns", "x", "b")), "z": ClaimOutcome(ClaimRef("", "", "z"))}
    problems = check_prepare_response(refs("a", "b"), answered)
    assert any("unknown claim UID 'z'" in p for p in problems)
    assert any("skipped 1 ResourceClaims" in p and "ns/claim-a" in p for p in problems)
    assert check_unprepare_response(refs("a"), ["a"]) == []
    assert "skipped" in check_unprepare_response(refs("a", "b"), ["a"])[0]


def test_per_claim_error_is_an_outcome_not_a_violation():
    bad_device = PreparedDevice(("gpu",), "", "", ("nonsense",))
    answered = {"a": ClaimOutcome(refs("a")[0], devices=(bad_device,), error="config: bad")}
    assert check_prepare_response(refs("a"), answered, alloc("a", ("gpu", "gpu-0"))) == []


def test_devices_must_be_allocated_to_the_claim_and_its_requests():
    claim = refs("a")[0]

    def problems(*devices, allocations=alloc("a", ("gpu", "gpu-0"), ("big/h100", "gpu-1")), with_share_id=True):
        return check_prepare_response([claim], {"a": ClaimOutcome(claim, devices=devices)}, allocations,
                                      with_share_id=with_share_id)

    ok = PreparedDevice(("gpu",), "node-a", "gpu-0", (f"{CDI}=a-0",))
    assert problems(ok, PreparedDevice(("big",), "node-a", "gpu-1", (f"{CDI}=a-1",))) == []
    assert problems(PreparedDevice((), "node-a", "gpu-0", ())) == []  # no request names = all requests; no CDI IDs is allowed
    assert "not allocated" in problems(PreparedDevice(("gpu",), "node-a", "gpu-7", ()))[0]
    assert "not allocated" in problems(PreparedDevice(("gpu",), "node-b", "gpu-0", ()))[0]
    assert "was not allocated this device" in problems(PreparedDevice(("big",), "node-a", "gpu-0", ()))[0]
    assert "base request" in problems(PreparedDevice(("big/h100",), "node-a", "gpu-1", ()))[0]
    assert "pool_name is empty" in problems(PreparedDevice(("gpu",), "", "gpu-0", ()), allocations=None)[0]
    assert "vendor/class=name" in problems(PreparedDevice(("gpu",), "node-a", "gpu-0", ("gpu0",)))[0]
    assert "listed twice" in problems(ok, ok)[0]


def test_share_ids_must_match_the_allocation():
    claim = refs("a")[0]
    allocations = alloc("a", ("share", "gpu-0-shared"), share_id="1234")

    def problems(share_id, with_share_id=True):
        dev = PreparedDevice(("share",), "node-a", "gpu-0-shared", (), share_id)
        return check_prepare_response([claim], {"a": ClaimOutcome(claim, devices=(dev,))}, allocations,
                                      with_share_id=with_share_id)

    assert problems("1234") == []
    assert "share_id" in problems(None)[0]
    assert "share_id" in problems("9999")[0]
    assert problems(None, with_share_id=False) == []  # v1beta1 has no share_id field


def test_container_cdi_ids_follow_request_names():
    devices = {
        "gpus": [PreparedDevice(("a",), "p", "gpu-0", ("v/c=0",)), PreparedDevice(("b",), "p", "gpu-1", ("v/c=1",)),
                 PreparedDevice((), "p", "gpu-2", ("v/c=2",))],
        "other": [PreparedDevice(("x",), "p", "gpu-3", ("v/c=3",))],
    }
    assert cdi_ids_for_container([{"name": "gpus"}], devices) == ["v/c=0", "v/c=1", "v/c=2"]
    assert cdi_ids_for_container([{"name": "gpus", "request": "b"}], devices) == ["v/c=1", "v/c=2"]
    assert cdi_ids_for_container([{"name": "other"}, {"name": "gpus", "request": "a"}], devices) == ["v/c=3", "v/c=0", "v/c=2"]
    assert cdi_ids_for_container([], devices) == []


# --- registration ---------------------------------------------------------------------------------------


def test_registers_a_plugin_and_notifies_it(dirs, plugins):
    p = plugins()
    watcher = PluginWatcher(dirs[0])
    try:
        plugin = watcher.wait_for_plugin(DRIVER, timeout=10)
        assert plugin.endpoint == str(p.dra_socket)
        assert plugin.dra_service == "v1.DRAPlugin"
        assert plugin.health_service == "v1alpha1.DRAResourceHealth"
        assert p.registration.statuses == [(True, "")]
    finally:
        watcher.stop()


def test_picks_the_first_service_in_the_plugins_order_that_the_kubelet_speaks(dirs, plugins):
    p = plugins(versions=("v9.Future", "v1beta1.DRAPlugin", "v1.DRAPlugin"))
    watcher = PluginWatcher(dirs[0])
    try:
        plugin = watcher.wait_for_plugin(DRIVER, timeout=10)
        assert plugin.dra_service == "v1beta1.DRAPlugin"
        plugin.client.prepare(refs("a"))
        assert [r[0] for r in p.v1beta1.requests] == ["prepare"] and p.v1.requests == []
    finally:
        watcher.stop()


def test_a_v1beta1_kubelet_calls_the_v1beta1_service(dirs, plugins):
    p = plugins()
    watcher = PluginWatcher(dirs[0], kubelet_services=("v1beta1.DRAPlugin",))
    try:
        plugin = watcher.wait_for_plugin(DRIVER, timeout=10)
        assert plugin.dra_service == "v1beta1.DRAPlugin"
        outcome = plugin.client.prepare(refs("a"), alloc("a", ("gpu", "gpu-0")))["a"]
        assert outcome.devices[0].share_id is None
        assert p.v1.requests == [] and len(p.v1beta1.requests) == 1
    finally:
        watcher.stop()


@pytest.mark.parametrize("kw, reason", [
    (dict(type_="CSIPlugin"), "no handler registered for plugin type"),
    (dict(versions=("v1alpha3.NodeService", "1.0.0")), "none of services supported by the plugin"),
    (dict(versions=()), "empty list of supported versions"),
    (dict(endpoint="/nonexistent/dra.sock"), "is not a unix socket"),
    (dict(endpoint="relative/dra.sock"), "not an absolute path"),
    (dict(name=""), "plugin name is empty"),
])
def test_refused_plugins_are_told_why(dirs, plugins, kw, reason):
    p = plugins(**kw, reg_name="refused-reg.sock")
    watcher = PluginWatcher(dirs[0])
    try:
        watcher.sync()
        assert watcher.registered == {}
        assert reason in watcher.failures[p.reg_socket].message
        assert p.registration.statuses and p.registration.statuses[0][0] is False
        assert reason in p.registration.statuses[0][1]
    finally:
        watcher.stop()


def test_hidden_sockets_and_plain_files_are_ignored(dirs, plugins):
    registry, _ = dirs
    (registry / "notes.txt").write_text("not a socket")
    p = plugins(reg_name=".hidden-reg.sock")
    watcher = PluginWatcher(registry)
    try:
        watcher.sync()
        assert watcher.registered == {} and watcher.failures == {}
        assert p.registration.statuses == []
    finally:
        watcher.stop()


def test_sockets_in_sub_directories_are_found(dirs):
    registry, plugin_dir = dirs
    (registry / "sub").mkdir()
    p = FakePlugin(registry / "sub", plugin_dir).start()
    watcher = PluginWatcher(registry)
    try:
        assert watcher.wait_for_plugin(DRIVER, timeout=10).registration_socket == p.reg_socket
    finally:
        watcher.stop()
        p.stop()


def test_same_endpoint_twice_is_refused(dirs, plugins):
    registry, plugin_dir = dirs
    first = plugins()
    watcher = PluginWatcher(registry)
    try:
        watcher.wait_for_plugin(DRIVER, timeout=10)
        # a second registration socket announcing the same endpoint
        second = FakeRegistration(first.registration.info)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        reg_grpc.add_RegistrationServicer_to_server(second, server)
        server.add_insecure_port("unix:" + str(registry / "again-reg.sock"))
        server.start()
        try:
            watcher.sync()
            assert "already registered" in watcher.failures[registry / "again-reg.sock"].message
            assert second.statuses[0][0] is False
        finally:
            server.stop(None).wait()
    finally:
        watcher.stop()


def test_socket_removal_deregisters_and_a_restarted_plugin_registers_again(dirs):
    registry, plugin_dir = dirs
    watcher = PluginWatcher(registry, poll_interval=0.05)
    watcher.start()
    try:
        first = FakePlugin(registry, plugin_dir).start()
        before = watcher.wait_for_plugin(DRIVER, timeout=10)
        first.stop()
        watcher.wait_for_deregistration(DRIVER, timeout=10)
        second = FakePlugin(registry, plugin_dir).start()
        try:
            after = watcher.wait_for_plugin(DRIVER, timeout=10, newer_than=before.registered_at)
            after.client.prepare(refs("a"))
            assert len(second.v1.requests) == 1
            events = [(e, d) for e, d, _ in watcher.history]
            assert events == [("registered", DRIVER), ("deregistered", DRIVER), ("registered", DRIVER)]
        finally:
            second.stop()
    finally:
        watcher.stop()


def test_failed_registration_is_retried(dirs):
    registry, plugin_dir = dirs
    # A socket nobody answers on (bound, not listening): the dial fails and the watcher backs off.
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(registry / "dead-reg.sock"))
    watcher = PluginWatcher(registry)
    try:
        import standin.registry as registry_module
        old = registry_module.DIAL_TIMEOUT
        registry_module.DIAL_TIMEOUT = 0.3
        try:
            watcher.sync()
        finally:
            registry_module.DIAL_TIMEOUT = old
        failure = watcher.failures[registry / "dead-reg.sock"]
        assert "not answering" in failure.message and failure.attempts == 1
        watcher.sync()  # inside the back-off: no new attempt
        assert watcher.failures[registry / "dead-reg.sock"].attempts == 1
    finally:
        sock.close()
        watcher.stop()


# --- NodePrepareResources / NodeUnprepareResources ----------------------------------------------------


@pytest.fixture
def client(dirs, plugins):
    p = plugins()
    c = DraClient(str(p.dra_socket), "v1.DRAPlugin", call_timeout=5)
    yield p, c
    c.close()


def test_claim_references_go_on_the_wire_as_namespace_name_uid(client):
    p, c = client
    outcomes = c.prepare([ClaimRef("team-a", "pod-gpu-x7k2q", "uid-1"), ClaimRef("team-b", "shared", "uid-2")])
    assert p.v1.requests == [("prepare", [("team-a", "pod-gpu-x7k2q", "uid-1"), ("team-b", "shared", "uid-2")])]
    assert outcomes["uid-1"].claim.name == "pod-gpu-x7k2q"
    assert outcomes["uid-1"].devices[0].cdi_device_ids == (f"{CDI}=uid-1-gpu-0",)
    assert c.unprepare([ClaimRef("team-a", "pod-gpu-x7k2q", "uid-1")]) == {"uid-1": ""}


def test_a_plugin_that_omits_a_claim_is_reported(client):
    p, c = client
    p.v1.prepare = lambda req: {req.claims[0].uid: {}}
    with pytest.raises(ProtocolViolation) as err:
        c.prepare(refs("a", "b"))
    assert "skipped 1 ResourceClaims: ns/claim-b (b)" in str(err.value)


def test_a_plugin_that_answers_an_unknown_claim_is_reported(client):
    p, c = client
    p.v1.prepare = lambda req: {"a": {}, "stranger": {}}
    with pytest.raises(ProtocolViolation, match="unknown claim UID 'stranger'"):
        c.prepare(refs("a"))


def test_unallocated_devices_and_bad_cdi_ids_are_reported(client):
    p, c = client
    p.v1.prepare = lambda req: {"a": dict(devices=[
        dict(request_names=["gpu"], pool_name="node-a", device_name="gpu-5", cdi_device_ids=[f"{CDI}=a"]),
        dict(request_names=["gpu"], pool_name="node-a", device_name="gpu-0", cdi_device_ids=["", "gpu0"]),
    ])}
    with pytest.raises(ProtocolViolation) as err:
        c.prepare(refs("a"), alloc("a", ("gpu", "gpu-0")))
    text = "\n".join(err.value.violations)
    assert "gpu-5: not allocated" in text
    assert "empty CDI device ID" in text and "'gpu0' is not of the form" in text


def test_share_id_travels_in_v1(client):
    p, c = client
    p.v1.prepare = lambda req: {"a": dict(devices=[dict(request_names=["share"], pool_name="node-a",
                                                        device_name="gpu-0-shared", cdi_device_ids=[f"{CDI}=a"],
                                                        share_id="s-1")])}
    outcome = c.prepare(refs("a"), alloc("a", ("share", "gpu-0-shared"), share_id="s-1"))["a"]
    assert outcome.devices[0].share_id == "s-1"
    with pytest.raises(ProtocolViolation, match="share_id"):
        c.prepare(refs("a"), alloc("a", ("share", "gpu-0-shared"), share_id="s-2"))


def test_per_claim_errors_fail_only_that_claim(client):
    p, c = client
    p.v1.prepare = lambda req: {"a": {"error": "config.sharing.strategy: unknown"}, **{
        u: v for u, v in FakeDra(v1).prepare_all(req).items() if u != "a"}}
    outcomes = c.prepare(refs("a", "b"))
    assert not outcomes["a"].ok and "sharing.strategy" in outcomes["a"].error
    assert outcomes["b"].ok and outcomes["b"].devices


def test_grpc_errors_and_timeouts_fail_the_whole_call(client):
    p, c = client
    p.v1.prepare = lambda req: grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(DraCallError) as err:
        c.prepare(refs("a"))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION

    def slow(req):
        time.sleep(1.0)
        return {"a": {}}

    p.v1.prepare = slow
    c.call_timeout = 0.2
    with pytest.raises(DraCallError) as err:
        c.prepare(refs("a"))
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unprepare_must_answer_every_claim(client):
    p, c = client
    p.v1.unprepare = lambda req: {}
    with pytest.raises(ProtocolViolation, match="NodeUnprepareResources skipped 2"):
        c.unprepare(refs("a", "b"))
    p.v1.unprepare = lambda req: {"a": "", "b": "device busy"}
    assert c.unprepare(refs("a", "b")) == {"a": "", "b": "device busy"}


def test_health_stream_updates_are_collected(dirs, plugins):
    p = plugins(health_updates=[[("node-a", "gpu-0", health.HEALTHY)],
                                [("node-a", "gpu-0", health.UNHEALTHY), ("node-a", "gpu-1", health.HEALTHY)]])
    c = DraClient(str(p.dra_socket))
    try:
        with c.watch_health("v1alpha1.DRAResourceHealth") as watch:
            update = watch.wait_for(lambda u: u.devices.get(("node-a", "gpu-0"), ("",))[0] == "UNHEALTHY", timeout=5)
            assert update.devices[("node-a", "gpu-1")][0] == "HEALTHY"
            assert len(watch.updates) == 2
            with pytest.raises(TimeoutError):
                watch.wait_for(lambda u: "gpu-9" in str(u.devices), timeout=0.2)
    finally:
        c.close()


# --- pod-level prepare/unprepare (claims served from a dict instead of an API server) -------------------


def make_claim(name: str, uid: str, pod_uids: list[str], devices: list[tuple[str, str]], *, owner: str | None = None,
               driver: str = DRIVER) -> dict:
    meta = {"name": name, "namespace": "ns", "uid": uid}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": owner, "controller": True}]
    return {"metadata": meta, "status": {
        "allocation": {"devices": {"results": [
            {"request": r, "driver": driver, "pool": "node-a", "device": d} for r, d in devices]}},
        "reservedFor": [{"resource": "pods", "name": "p", "uid": u} for u in pod_uids]}}


def make_pod(name: str, uid: str, claims: dict[str, str], *, generated: dict[str, str] | None = None,
             node: str = "node-a") -> dict:
    resource_claims = [{"name": k, "resourceClaimName": v} for k, v in claims.items()]
    resource_claims += [{"name": k, "resourceClaimTemplateName": "tmpl"} for k in (generated or {})]
    containers = [{"name": "main", "resources": {"claims": [{"name": k} for k in [*claims, *(generated or {})]]}}]
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid},
            "spec": {"nodeName": node, "resourceClaims": resource_claims, "containers": containers},
            "status": {"resourceClaimStatuses": [{"name": k, "resourceClaimName": v} for k, v in (generated or {}).items()]}}


@pytest.fixture
def kubelet(dirs, plugins):
    p = plugins()
    store: dict[str, dict] = {}
    k = KubeletStandin("node-a", dirs[0])
    k.read_claim = lambda namespace, name: store[f"{namespace}/{name}"]
    k.wait_for_plugin(DRIVER, timeout=10)
    yield k, p, store
    k.stop()


def test_prepare_pod_prepares_shared_claims_once_and_unprepares_after_the_last_pod(kubelet):
    k, p, store = kubelet
    store["ns/shared"] = make_claim("shared", "c-shared", ["pod-1", "pod-2"], [("gpu", "gpu-0")])
    store["ns/p1-own"] = make_claim("p1-own", "c-own", ["pod-1"], [("gpu", "gpu-0")], owner="pod-1")
    pod1 = make_pod("p1", "pod-1", {"s": "shared"}, generated={"own": "p1-own"})
    pod2 = make_pod("p2", "pod-2", {"s": "shared"})

    prepared = k.prepare_pod(pod1)
    assert sorted(uid for _, uid in [(m, c.uid) for m, c in prepared.claims.items()]) == ["c-own", "c-shared"]
    assert prepared.container_cdi_ids["main"] == [f"{CDI}=c-shared-gpu-0", f"{CDI}=c-own-gpu-0"]
    k.prepare_pod(pod2)
    prepare_calls = [c for c in k.calls if c.method == "NodePrepareResources"]
    assert [sorted(c.claim_uids) for c in prepare_calls] == [["c-own", "c-shared"]]  # one call; pod 2 reused the claim

    assert [r.uid for r in k.unprepare_pod(pod1)] == ["c-own"]
    assert [r.uid for r in k.unprepare_pod(pod2)] == ["c-shared"]
    assert [c.claim_uids for c in k.calls if c.method == "NodeUnprepareResources"] == [("c-own",), ("c-shared",)]
    assert k.claim_cache == {}


def test_prepare_pod_waits_for_what_the_kubelet_waits_for(kubelet):
    k, p, store = kubelet
    store["ns/c"] = make_claim("c", "c-1", ["someone-else"], [("gpu", "gpu-0")])
    with pytest.raises(PodNotReady, match="not reserved"):
        k.prepare_pod(make_pod("p", "pod-1", {"x": "c"}))
    store["ns/c"]["status"] = {"reservedFor": [{"uid": "pod-1"}]}
    with pytest.raises(PodNotReady, match="not allocated"):
        k.prepare_pod(make_pod("p", "pod-1", {"x": "c"}))
    store["ns/g"] = make_claim("g", "c-2", ["pod-1"], [("gpu", "gpu-0")], owner="another-pod")
    with pytest.raises(PodNotReady, match="was not created for pod"):
        k.prepare_pod(make_pod("p", "pod-1", {}, generated={"x": "g"}))
    pod = make_pod("p", "pod-1", {}, generated={"x": "g"})
    pod["status"] = {}
    with pytest.raises(PodNotReady, match="no generated ResourceClaim"):
        k.prepare_pod(pod)
    with pytest.raises(PodNotReady, match="bound to 'node-b'"):
        k.prepare_pod(make_pod("p", "pod-1", {}, node="node-b"))
    assert p.v1.requests == []


def test_prepare_pod_needs_the_driver_registered(kubelet):
    k, p, store = kubelet
    store["ns/c"] = make_claim("c", "c-1", ["pod-1"], [("gpu", "gpu-0")], driver="other.example.com")
    with pytest.raises(DriverNotRegistered, match="other.example.com is not registered"):
        k.prepare_pod(make_pod("p", "pod-1", {"x": "c"}))


def test_a_failed_claim_fails_the_pod_but_others_stay_prepared(kubelet):
    k, p, store = kubelet
    store["ns/good"] = make_claim("good", "c-good", ["pod-1"], [("gpu", "gpu-0")])
    store["ns/bad"] = make_claim("bad", "c-bad", ["pod-1"], [("gpu", "gpu-0")])
    ok = p.v1.prepare_all
    p.v1.prepare = lambda req: {**ok(req), "c-bad": {"error": "parameters.sharing: bad"}}
    pod = make_pod("p", "pod-1", {"g": "good", "b": "bad"})
    with pytest.raises(PodPrepareError) as err:
        k.prepare_pod(pod)
    assert err.value.errors == {"c-bad": "parameters.sharing: bad"}
    assert k.claim_cache["c-good"].is_prepared and not k.claim_cache["c-bad"].is_prepared
    # the kubelet unprepares every claim it cached for the pod, prepared or not
    assert sorted(r.uid for r in k.unprepare_pod(pod)) == ["c-bad", "c-good"]


# --- the runtime side: CDI resolution -------------------------------------------------------------------


def write_spec(directory: Path, name: str, spec: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(json.dumps(spec))


def test_cdi_ids_resolve_to_container_edits(tmp_path):
    write_spec(tmp_path, "v-c_claim.json", {
        "cdiVersion": "0.5.0", "kind": "v.example.com/gpu",
        "containerEdits": {"env": ["A=1"]},
        "devices": [{"name": "x", "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=0"],
            "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/drv/dev/nvidia0"}],
            "mounts": [{"hostPath": "/tmp/mps", "containerPath": "/mps", "options": ["rbind"]}]}}]})
    edits = resolve_cdi([tmp_path], ["v.example.com/gpu=x"])
    assert edits.env_map() == {"A": "1", "NVIDIA_VISIBLE_DEVICES": "0"}
    assert edits.device_paths() == ["/dev/nvidia0"] and edits.mount_targets() == ["/mps"]
    with pytest.raises(CdiError, match="unresolvable"):
        resolve_cdi([tmp_path], ["v.example.com/gpu=y"])


@pytest.mark.parametrize("spec, reason", [
    ({"cdiVersion": "0.5.0", "kind": "v/c", "devices": [{"name": "x", "containerEdits": {}, "extra": 1}]}, "unknown field"),
    ({"cdiVersion": "9.9.9", "kind": "v/c", "devices": [{"name": "x", "containerEdits": {}}]}, "unknown cdiVersion"),
    ({"cdiVersion": "0.3.0", "kind": "v/c", "devices": [{"name": "x", "containerEdits": {
        "deviceNodes": [{"path": "/dev/x", "hostPath": "/dev/x"}]}}]}, "hostPath needs cdiVersion >= 0.5.0"),
    ({"cdiVersion": "0.5.0", "kind": "v/c", "devices": []}, "non-empty"),
    ({"cdiVersion": "0.4.0", "kind": "v/c", "devices": [{"name": "0x", "containerEdits": {}}]}, "starts with a digit"),
    ({"cdiVersion": "0.5.0", "kind": "v/c.d", "devices": [{"name": "x", "containerEdits": {}}]}, "class with dots"),
    ({"cdiVersion": "0.5.0", "kind": "vc", "devices": [{"name": "x", "containerEdits": {}}]}, "is not vendor/class"),
    ({"cdiVersion": "0.5.0", "kind": "v/c", "devices": [{"name": "x"}]}, "containerEdits is required"),
    ({"cdiVersion": "0.5.0", "kind": "v/c", "devices": [{"name": "x", "containerEdits": {"env": ["NOEQUALS"]}}]}, "KEY=VALUE"),
])
def test_specs_a_runtime_refuses_are_refused(tmp_path, spec, reason):
    write_spec(tmp_path, "s.json", spec)
    with pytest.raises(CdiError, match=reason):
        resolve_cdi([tmp_path], ["v/c=x"])


def test_two_specs_defining_one_device_conflict_but_later_dirs_override(tmp_path):
    spec = {"cdiVersion": "0.5.0", "kind": "v/c", "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}]}
    write_spec(tmp_path / "etc", "a.json", spec)
    write_spec(tmp_path / "etc", "b.json", spec)
    with pytest.raises(CdiError, match="defined in both"):
        resolve_cdi([tmp_path / "etc"], ["v/c=x"])
    write_spec(tmp_path / "static", "a.json", spec)
    override = {**spec, "devices": [{"name": "x", "containerEdits": {"env": ["A=2"]}}]}
    write_spec(tmp_path / "run", "a.yaml", override)
    assert resolve_cdi([tmp_path / "static", tmp_path / "run"], ["v/c=x"]).env_map() == {"A": "2"}


# --- example objects rewritten for a test's own driver --------------------------------------------------


def test_examples_are_rewritten_for_another_driver_name():
    from standin.workloads import for_driver, load_example, pin_to_node

    template, pod = load_example("mps-slot")
    mine = for_driver(template, "t1.e2e.example.com")
    request = mine["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert request["deviceClassName"] == "slot.t1.e2e.example.com"
    assert request["selectors"][0]["cel"]["expression"] == "device.attributes['t1.e2e.example.com'].sharing == 'mps'"
    opaque = mine["spec"]["spec"]["devices"]["config"][0]["opaque"]
    assert opaque["driver"] == "t1.e2e.example.com"
    assert opaque["parameters"]["apiVersion"] == "gpu.dra-driver.io/v1alpha1"  # the config API keeps its name
    assert template["spec"]["spec"]["devices"]["config"][0]["opaque"]["driver"] == "gpu.dra-driver.io"  # a copy
    assert pin_to_node(pod, "n1")["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "n1"}
    assert "nodeSelector" not in pod["spec"]
