"""Benchmark ``plugin``: the ``gpu-dra kubelet-plugin`` process as the kubelet sees it, against floors measured
in the same run on the same machine and API server.

A local control plane (LocalCluster) holds allocated ResourceClaims; the plugin runs as its own process with a
simulated node (32 whole L4 GPUs, so 32 claims are independent); one client calls NodePrepareResources and
NodeUnprepareResources over the plugin's DRA socket as the kubelet does, one claim per call.

Floors, what no prepare or unprepare can avoid, done by a bare client with the same tools:

* prepare: one GET of the claim from the same API server, one fsync'd atomic write of a CDI-sized file, one
  fsync'd write of a checkpoint-record-sized file;
* unprepare: the unlink of that CDI file (made durable) plus one checkpoint-record-sized fsync'd write.

Floor and plugin calls are interleaved round by round, so machine noise hits both alike; figures are medians
and ratios. Also: 32 callers on independent claims against the serial prepare rate of the plugin itself, and
the time from the plugin's start to its registration socket answering GetInfo, beside the same time and the idle
memory of a bare gRPC server (``bench.floorserver``: grpc and the registration stubs only).

The plugin runs as the chart deploys it: rolling-update mode (--pod-uid: each call under the state directory's
file lock), registered (the bench tells it so, as the kubelet would, so it publishes its slices) and serving
/metrics. Its simulated GPUs live in memory (--sim-state none): the state file and the CUDA stand-in's GPU
listing that a simulated node otherwise keeps are simulator plumbing no real node has (the listing is rebuilt
from NVML at every CDI write, ~2 ms on 32 GPUs; the simulated event wait looks at the state file every 0.15 s).
The kubelet's own pattern, single calls seconds apart and an idle plugin, is
``bench.kubeletpattern``.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import yaml

from api.generated.dra.v1 import api_pb2 as dra_pb
from api.generated.dra.v1 import api_pb2_grpc as dra_grpc
from api.generated.pluginregistration.v1 import api_pb2 as reg_pb
from api.generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from bench import kubeletpattern
from bench.core import Figure
from bench.params import Params
from dra.node.atomicfile import remove_file, write_atomic
from kube.client import RESOURCE_V1, KubeApi
from kubeletplugin.transport.sockets import socket_paths
from testbed.localcluster import LocalCluster, free_port

NAME = "plugin"
DESCRIPTION = "gpu-dra kubelet-plugin over its DRA socket on a real API server: prepare/unprepare against floors"

DRIVER = "gpu.dra-driver.io"
NODE = "bench-node"
GPUS = 32
NAMESPACE = "bench"
POD_UID = "0b3c9a52-bench-plugin"    # rolling-update mode, as the chart runs the plugin (POD_UID)
REPO = Path(__file__).resolve().parents[1]


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class _Server:
    """A process serving the registration socket, timed from spawn to GetInfo answered: the plugin and its floor
    (``bench.floorserver``) alike, so the start-up ratio compares the same interpreter, cwd and polling client."""

    def __init__(self, name: str, argv: list[str], registration: Path, log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.registration_socket, self.log = name, argv, registration, log
        self.env = None if env is None else {**os.environ, **env}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> float:
        """Start the process; returns the seconds until its registration socket answered GetInfo."""
        started = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)
        reg = self.registration_socket
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: "
                                   f"{self.log.read_text()[-2000:]}")
            if reg.exists():
                try:
                    with grpc.insecure_channel(f"unix:{reg}") as ch:
                        reg_grpc.RegistrationStub(ch).GetInfo(reg_pb.InfoRequest(), timeout=1)
                    return time.monotonic() - started
                except grpc.RpcError:
                    pass
            if time.monotonic() - started > 120:
                raise RuntimeError(f"{self.name}: registration socket did not answer in 120 s")
            time.sleep(0.002)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class _Plugin(_Server):
    def __init__(self, work: Path, kubeconfig: Path) -> None:
        self.work = work
        fleet = {"nodes": [{"name": NODE, "gpus": [{"model": "L4", "count": GPUS}]}]}
        (work / "fleet.yaml").write_text(yaml.safe_dump(fleet))
        self.registry, self.plugins = work / "registry", work / "plugins"
        self.cdi, self.state = work / "cdi", work / "state"
        self.metrics_port = free_port()
        self.sockets = socket_paths(DRIVER, self.registry, self.plugins, POD_UID)
        for d in (self.registry, self.plugins, self.cdi, self.state):
            d.mkdir(parents=True, exist_ok=True)
        super().__init__(
            "plugin", [sys.executable, "-m", "cli.main", "kubelet-plugin", "--node-name", NODE, "--driver-name", DRIVER,
             "--kubeconfig", str(kubeconfig), "--registry-dir", str(self.registry), "--plugin-dir",
             str(self.plugins), "--cdi-root", str(self.cdi), "--state-dir", str(self.state), "--fleet",
             str(work / "fleet.yaml"), "--log-level", "warning", "--log-format", "json",
             "--metrics-port", str(self.metrics_port), "--pod-uid", POD_UID, "--sim-state", "none"],
            self.sockets.registration, work / "plugin.log")

    def registration(self) -> Any:
        return reg_grpc.RegistrationStub(grpc.insecure_channel(f"unix:{self.sockets.registration}"))

    def register(self) -> None:
        """Tell the plugin it is registered, as the kubelet does: it starts publishing its slices."""
        self.registration().NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=10)

    def dra(self) -> Any:
        sock = self.sockets.dra
        deadline = time.monotonic() + 120
        while not sock.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("plugin DRA socket did not appear")
            time.sleep(0.05)
        return dra_grpc.DRAPluginStub(grpc.insecure_channel(f"unix:{sock}"))

    def cpu_seconds(self) -> float:
        """User + system CPU the plugin process has used so far."""
        return kubeletpattern.cpu_seconds(self.pid)


def allocated_claims(kube: KubeApi, count: int) -> list[tuple[str, str]]:
    """``count`` allocated claims, claim i holding gpu-(i % GPUS); returns (name, uid)."""
    out = []
    for i in range(count):
        name = f"c{i}"
        claim = kube.create(f"{RESOURCE_V1}/namespaces/{NAMESPACE}/resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}}})
        claim["status"] = {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": f"gpu-{i % GPUS}"}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}}}
        kube.request("PUT", f"{RESOURCE_V1}/namespaces/{NAMESPACE}/resourceclaims/{name}/status", body=claim)
        out.append((name, claim["metadata"]["uid"]))
    return out


def _seconds(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def _get_info(stub: Any) -> float:
    started = time.perf_counter()
    stub.GetInfo(reg_pb.InfoRequest(), timeout=10)
    return time.perf_counter() - started


def _call(stub: Any, method: str, claims: list[tuple[str, str]]) -> float:
    request = (dra_pb.NodePrepareResourcesRequest if method == "prepare" else dra_pb.NodeUnprepareResourcesRequest)(
        claims=[dra_pb.Claim(namespace=NAMESPACE, name=n, uid=u) for n, u in claims])
    started = time.perf_counter()
    reply = (stub.NodePrepareResources if method == "prepare" else stub.NodeUnprepareResources)(request, timeout=45)
    took = time.perf_counter() - started
    errors = [c.error for c in reply.claims.values() if c.error]
    if errors:
        raise RuntimeError(f"{method}: {errors[0]}")
    return took


class _Floor:
    """What a prepare and an unprepare cannot avoid, done by a bare client."""

    def __init__(self, kube: KubeApi, work: Path, cdi_bytes: int, record_bytes: int) -> None:
        self.kube, self.dir = kube, work / "floor"
        self.dir.mkdir()
        self.cdi = b"x" * cdi_bytes
        self.record = b"y" * record_bytes
        self.journal = os.open(self.dir / "journal", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def _record(self) -> None:
        os.write(self.journal, self.record)
        os.fsync(self.journal)

    def prepare(self, name: str) -> float:
        started = time.perf_counter()
        self.kube.get(f"{RESOURCE_V1}/namespaces/{NAMESPACE}/resourceclaims/{name}")
        write_atomic(self.dir / f"{name}.json", self.cdi)
        self._record()
        return time.perf_counter() - started

    def unprepare(self, name: str) -> float:
        started = time.perf_counter()
        remove_file(self.dir / f"{name}.json")
        self._record()
        return time.perf_counter() - started


def byte_compile() -> None:
    """The project's modules byte-compiled, as the image ships them (hack/build-image.py compiles the installed
    app): a checkout run under PYTHONDONTWRITEBYTECODE would otherwise compile every module the plugin imports
    at each start, which no node does. The packages are pyproject's (tool.setuptools.packages.find), and bench."""
    import compileall
    import tomllib

    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for package in [pattern.rstrip("*") for pattern in found["include"]] + ["bench"]:
        if not compileall.compile_dir(REPO / package, quiet=1):
            raise RuntimeError(f"byte-compiling {REPO / package} failed")


def run(params: Params) -> list[Figure]:
    rounds = max(3, params.api_rounds)
    byte_compile()
    work = Path(tempfile.mkdtemp(prefix="bench-plugin-"))
    cluster = LocalCluster(workdir=work / "cluster")
    plugin: _Plugin | None = None
    floor_sock = work / "floorserver.sock"
    floor_server = _Server("bench.floorserver", [sys.executable, "-m", "bench.floorserver", str(floor_sock)],
                           floor_sock, work / "floorserver.log")
    try:
        cluster.start()
        cluster.add_node(NODE)
        kube = KubeApi(cluster.api_client())
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        claims = allocated_claims(kube, max(GPUS, params.api_parallel))
        # Start-up floor first, each start beside one of the plugin's; the floor's memory once it has idled; it
        # keeps running, idle, through the plugin's idle window.
        floor_startup = [floor_server.start()]
        time.sleep(kubeletpattern.FLOOR_SETTLE_S)
        rss_floor = kubeletpattern.rss_mib(floor_server.pid)
        plugin = _Plugin(work, cluster.kubeconfig)
        startup = [plugin.start()]
        plugin.register()
        stub = plugin.dra()
        _call(stub, "prepare", [claims[0]])            # warm: connections, first spec written
        _call(stub, "unprepare", [claims[0]])
        cdi_bytes = max((p.stat().st_size for p in plugin.cdi.glob("*.json")), default=1500) or 1500
        floor = _Floor(kube, work, cdi_bytes=max(cdi_bytes, 1500), record_bytes=600)
        registration = plugin.registration()

        # The kubelet's pattern first, on a plugin that has been idle since the warm-up above.
        pattern = kubeletpattern.Pattern(
            pid=plugin.pid, metrics_url=f"http://127.0.0.1:{plugin.metrics_port}/metrics",
            call=lambda operation, claim: _call(stub, operation, [claim]), noop=lambda: _get_info(registration),
            floor=floor)
        idle = pattern.idle(params.idle_s, claims[1], floor_pid=floor_server.pid)
        floor_server.stop()
        spaced = pattern.spaced(params.spaced_rounds, params.spaced_gap_s, claims[2:GPUS])

        prep, unprep, f_prep, f_unprep, rpc = [], [], [], [], []
        cpu_before = plugin.cpu_seconds()
        for r in range(rounds):                          # interleaved: plugin call, then floor, same round
            claim = claims[r % GPUS]
            prep.append(_call(stub, "prepare", [claim]))
            f_prep.append(floor.prepare(claim[0]))
            unprep.append(_call(stub, "unprepare", [claim]))
            f_unprep.append(floor.unprepare(claim[0]))
        cpu_per_cycle = (plugin.cpu_seconds() - cpu_before) / rounds
        for _ in range(rounds):                          # the transport alone: a call that does nothing
            rpc.append(_get_info(registration))

        # 32 callers at once on independent claims, against the plugin's own serial rate.
        batch = claims[:params.api_parallel]
        serial_rates, parallel_rates, serial_cpu_shares = [], [], []
        for _ in range(max(1, params.parallel_rounds)):
            started, cpu_before = time.perf_counter(), plugin.cpu_seconds()
            for c in batch:
                _call(stub, "prepare", [c])
            took = time.perf_counter() - started
            serial_rates.append(len(batch) / took)
            serial_cpu_shares.append((plugin.cpu_seconds() - cpu_before) / took)
            for c in batch:
                _call(stub, "unprepare", [c])
            started = time.perf_counter()
            with ThreadPoolExecutor(len(batch)) as pool:
                list(pool.map(lambda c: _call(stub, "prepare", [c]), batch))
            parallel_rates.append(len(batch) / (time.perf_counter() - started))
            with ThreadPoolExecutor(len(batch)) as pool:
                list(pool.map(lambda c: _call(stub, "unprepare", [c]), batch))

        plugin.stop()
        for _ in range(max(1, params.api_startups - 1)):   # start-up again, on the now warm file cache
            floor_startup.append(floor_server.start())
            floor_server.stop()
            startup.append(plugin.start())
            plugin.stop()
        imports = kubeletpattern.import_rss(REPO)
    finally:
        floor_server.stop()
        if plugin is not None:
            plugin.stop()
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    p50, fp50, u50, fu50 = med(prep), med(f_prep), med(unprep), med(f_unprep)
    serial, parallel = med(serial_rates), med(parallel_rates)
    start, floor_start = med(startup), med(floor_startup)
    return [
        Figure("plugin.prepare.p50_ratio", f"prepare p50 / floor p50 ({p50 * 1000:.2f} / {fp50 * 1000:.2f} ms)",
               p50 / fp50, "x", f"{rounds} rounds, whole GPU, one claim per call"),
        Figure("plugin.prepare.p99_over_p50", f"prepare p99 / p50 ({_p(prep, 0.99) * 1000:.2f} ms p99)",
               _p(prep, 0.99) / p50, "x"),
        Figure("plugin.unprepare.p50_ratio", f"unprepare p50 / floor p50 ({u50 * 1000:.2f} / {fu50 * 1000:.2f} ms)",
               u50 / fu50, "x"),
        Figure("plugin.parallel.ratio", f"{len(batch)} callers / serial prepare rate ({parallel:.0f} / "
               f"{serial:.0f} claims/s)", parallel / serial, "x"),
        Figure("plugin.grpc_roundtrip_ms", "gRPC round trip of a call that does nothing (GetInfo), in neither floor",
               med(rpc) * 1000, "ms", f"median of {len(rpc)}, after the prepare rounds"),
        Figure("plugin.cpu_ms_per_cycle", "plugin CPU per prepare+unprepare cycle (status writes included)",
               cpu_per_cycle * 1000, "ms"),
        Figure("plugin.serial.cpu_share", "plugin CPU while one caller prepares (32 callers: at most 1/this faster)",
               med(serial_cpu_shares), "CPUs", "one Python process runs on one CPU at a time (the GIL)"),
        Figure("plugin.startup.getinfo_s", "start to GetInfo answered (median of "
               f"{len(startup)}: {_seconds(startup)} s)", start, "s"),
        Figure("plugin.startup.floor_s", "bare gRPC server (grpc + registration stubs): start to GetInfo answered "
               f"(median of {len(floor_startup)}: {_seconds(floor_startup)} s)", floor_start, "s",
               "python -m bench.floorserver, each start beside one of the plugin's, timed the same way"),
        Figure("plugin.startup.getinfo_ratio", f"start to GetInfo: plugin / bare gRPC server ({start:.3f} / "
               f"{floor_start:.3f} s)", start / floor_start, "x"),
    ] + kubeletpattern.figures(idle, rss_floor, imports, spaced, params.spaced_gap_s)
