"""Side by side with the Go reference driver (``python -m bench --peer-bin PATH``): what a pod costs the node with
``gpu-dra kubelet-plugin`` against the kubelet plugin of kubernetes-sigs/dra-example-driver
(``hack/build-peer-driver.sh`` builds it), both registered with the same real kubelet at the same time.

A local control plane and one real node (kubelet, containerd, runc; ``testbed.localnode``), each plugin with a CDI
directory of its own (the reference's CDI cache watches its directory, so our spec writes must not wake it), our
plugin for 8 simulated whole L4 GPUs (the GPUs in memory, ``--sim-state none``, as ``bench.plugin_api``), the
reference with its ``gpu`` profile and 8 devices. Every figure is ours / the peer's, with a 95 % interval from a
paired bootstrap over rounds (``bench.pairstats``); in each round the order of the two alternates.

* **start → GetInfo**: each plugin started on its own registration directory (not the kubelet's) and timed from
  spawn until its registration socket answers GetInfo, interleaved, before the node's instances start;
* **idle**: both registered and idle for ``idle_s``; the CPU of every thread of each process
  (``/proc/<pid>/task/*/schedstat``) over slices of the window, and each one's VmRSS after it;
* **pods**: ``peer_pods`` pods each (a busybox container, one claim from a template of one device of the driver's
  class), interleaved; per pod the kubelet's own histograms (``/metrics`` of the kubelet, read before the pod and
  after its claim was unprepared): ``dra_grpc_operations_duration_seconds`` per driver, whose sum grows by exactly
  the one call's duration (its buckets start at 0.1 s, too coarse for a bucket quantile), and
  ``dra_operations_duration_seconds`` (the kubelet's whole step, claim lookups included); the plugin's CPU from
  the pod's create to its claim unprepared, less its idle rate over that time; containerd's StartContainer from
  its log; create → Running from the create request to the first Running status seen by a 10 ms poll;
* **back to back**: without the kubelet, prepare and unprepare over each plugin's DRA socket on claims allocated by
  hand, ``b2b_rounds`` rounds; CPU per cycle over each round (and a short settle after it, so work a call
  queued is counted), less the idle rate.
"""
from __future__ import annotations

import os
import shutil
import ssl
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from api.deviceclasses import device_classes
from api.generated.dra.v1 import api_pb2 as dra_pb
from api.generated.dra.v1 import api_pb2_grpc as dra_grpc
from api.names import DEFAULT_DRIVER_NAME
from bench import kubeletpattern, pairstats
from bench.containerdlog import start_container_seconds
from bench.core import Figure
from bench.imageruntime import image_python
from bench.params import Params
from bench.plugin_api import REPO, _Server, byte_compile
from bench.realnodebed import RealNodeBed
from kube.client import DEVICE_CLASSES, RESOURCE_V1
from kubeletplugin.transport.sockets import socket_paths
from testbed.localcluster import free_port
from testbed.localnode import busybox_image
from testbed.nodeplugin import LocalNodePlugin

NAME = "peer"
DESCRIPTION = ("side by side with the Go reference kubelet plugin on one real kubelet (--peer-bin): "
               "prepare/unprepare, CPU, memory, start-up, as ours / the peer's")
OURS = DEFAULT_DRIVER_NAME
PEER = "gpu.example.com"          # the reference's driver and DeviceClass name with its gpu profile
GPUS = 8
POLL_S = 0.01
SETTLE_S = 5.0
IDLE_SLICE_S = 5.0
B2B_SETTLE_S = 0.05
PREPARE, UNPREPARE = "NodePrepareResources", "NodeUnprepareResources"


class PeerBinaryError(ValueError):
    """The --peer-bin path cannot be run; the message says why and how to build it."""


def check_peer_bin(path: str | os.PathLike[str] | None) -> Path:
    """The reference kubelet plugin's binary, checked: it exists, is a regular file and is executable."""
    hint = "build it with hack/build-peer-driver.sh, which prints its path"
    if path is None or str(path) == "":
        raise PeerBinaryError(f"no --peer-bin given; {hint}")
    p = Path(path)
    if not p.exists():
        raise PeerBinaryError(f"--peer-bin {p}: no such file; {hint}")
    if not p.is_file():
        raise PeerBinaryError(f"--peer-bin {p}: not a regular file; {hint}")
    if not os.access(p, os.X_OK):
        raise PeerBinaryError(f"--peer-bin {p}: not executable (chmod +x it, or {hint})")
    return p.resolve()


def cpu_s(pid: int) -> float:
    """CPU seconds of every thread of a process now (schedstat: ns resolution, unlike the 10 ms ticks of stat)."""
    return sum(t.cpu_ns for t in kubeletpattern.thread_stats(pid).values()) / 1e9


def kubelet_samples(port: int) -> dict[tuple[str, pairstats.Labels], float]:
    """The kubelet's /metrics (its HTTPS port on loopback, self-signed, anonymous allowed on this node)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=10, context=ctx) as resp:
        return pairstats.parse_samples(resp.read().decode())


def _template(name: str, device_class: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}]}}}}


@dataclass
class Side:
    """One driver on the node: its process, its claim template, what was measured of it."""

    driver: str
    tag: str                        # "ours" or "peer": object names
    pid: Callable[[], int]
    dra_socket: Callable[[], Path]
    idle_cpu: list[float] = field(default_factory=list)    # CPU s/s per idle slice
    idle_rss: float = 0.0
    startup: list[float] = field(default_factory=list)
    prepare: list[float] = field(default_factory=list)     # kubelet gRPC histogram, s per call
    unprepare: list[float] = field(default_factory=list)
    prepare_op: list[float] = field(default_factory=list)  # kubelet's whole PrepareResources step
    unprepare_op: list[float] = field(default_factory=list)
    pod_cpu: list[float] = field(default_factory=list)     # s per pod, idle subtracted
    pod_cpu_ticks: float = 0.0                             # utime+stime over the pod phase (cross-check)
    running: list[float] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)   # runtime ids of the recorded pods' containers, in order
    start_container: list[float] = field(default_factory=list)   # containerd's StartContainer, s
    b2b_prepare: list[float] = field(default_factory=list)
    b2b_unprepare: list[float] = field(default_factory=list)
    b2b_cpu: list[float] = field(default_factory=list)

    @property
    def idle_rate(self) -> float:
        return statistics.fmean(self.idle_cpu)


class _Bench(RealNodeBed):
    def __init__(self, work: Path, peer_bin: Path) -> None:
        super().__init__(work)
        self.work, self.peer_bin = work, peer_bin
        self.peer: subprocess.Popen[bytes] | None = None
        self.cdi_ours, self.cdi_peer = work / "cdi-ours", work / "cdi-peer"
        # Ours as the image runs it (bench.imageruntime): the image's wheels alone, no dev packages.
        self.python, self.python_env = image_python()

    # ---- set-up ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.fleet = self.start_node({"gpus": [{"model": "L4", "count": GPUS}]},
                                     cdi_dirs=[self.cdi_ours, self.cdi_peer])
        assert self.kube is not None
        for cls in device_classes(OURS):
            self.kube.create(DEVICE_CLASSES, cls)
        self.kube.create(DEVICE_CLASSES, {
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": PEER},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{PEER}'"}}]}})
        for ns in ("pods", "b2b"):
            self.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        self.kube.create(f"{RESOURCE_V1}/namespaces/pods/resourceclaimtemplates", _template(OURS, OURS))
        self.kube.create(f"{RESOURCE_V1}/namespaces/pods/resourceclaimtemplates", _template(PEER, PEER))

    def ours_argv(self, registry: Path, plugins: Path, cdi: Path, state: Path) -> list[str]:
        assert self.node is not None
        return [*self.python, "-m", "cli.main", "kubelet-plugin", "--node-name", self.node.name,
                "--driver-name", OURS, "--kubeconfig", str(self.cluster.kubeconfig), "--registry-dir", str(registry),
                "--plugin-dir", str(plugins / OURS), "--cdi-root", str(cdi), "--state-dir", str(state),
                "--fleet", str(self.fleet), "--sim-state", "none", "--log-level", "info", "--log-format", "json",
                "--metrics-port", str(free_port())]

    def peer_argv(self, registry: Path, plugins: Path, cdi: Path) -> list[str]:
        assert self.node is not None
        return [str(self.peer_bin), "--node-name", self.node.name, "--cdi-root", str(cdi),
                "--num-devices", str(GPUS), "--kubelet-registrar-directory-path", str(registry),
                "--kubelet-plugins-directory-path", str(plugins), "--kubeconfig", str(self.cluster.kubeconfig),
                "--metrics-port", str(free_port()), "--healthcheck-port", str(free_port())]

    def time_startups(self, starts: int, ours: Side, peer: Side) -> None:
        """Spawn → GetInfo of each plugin on registration directories of its own, interleaved, order alternating."""
        for i in range(starts):
            for side in ((ours, peer) if i % 2 == 0 else (peer, ours)):
                d = Path(tempfile.mkdtemp(prefix="s-", dir=self.work))
                reg, plugins, cdi, state = d / "r", d / "p", d / "c", d / "s"
                for x in (reg, plugins, cdi, state):
                    x.mkdir()
                if side is ours:
                    sock = socket_paths(OURS, reg, plugins / OURS).registration
                    server = _Server("gpu-dra kubelet-plugin", self.ours_argv(reg, plugins, cdi, state), sock,
                                     d / "log", env=self.python_env)
                else:
                    server = _Server("reference kubelet plugin", self.peer_argv(reg, plugins, cdi),
                                     reg / f"{PEER}-reg.sock", d / "log")
                try:
                    side.startup.append(server.start())
                finally:
                    server.stop()

    def start_plugins(self) -> tuple[Side, Side]:
        assert self.node is not None and self.kube is not None
        # Both as their charts deploy them: ours logs at info as JSON and serves /metrics (testbed.nodeplugin),
        # the reference serves its /metrics and its gRPC health service.
        self.plugin = LocalNodePlugin(self.node, self.fleet, OURS, log_level="info",
                                      extra_args=["--sim-state", "none", "--log-format", "json"],
                                      python=self.python, env=self.python_env)
        self.plugin.start()
        with open(self.work / "peer.log", "ab") as log:
            self.peer = subprocess.Popen(
                self.peer_argv(self.node.plugins_registry_dir, self.node.plugins_dir, self.cdi_peer),
                cwd=self.work, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "NODE_NAME": self.node.name})
        self.plugin.wait_registered(60)
        plugin, peer = self.plugin, self.peer
        ours = Side(OURS, "ours", lambda: plugin.proc.pid if plugin.proc else -1,
                    lambda: socket_paths(OURS, plugin.node.plugins_registry_dir, plugin.plugin_dir).dra)
        node = self.node
        theirs = Side(PEER, "peer", lambda: peer.pid, lambda: Path(node.plugins_dir) / PEER / "dra.sock")
        self._wait_devices(PEER)
        self._wait_devices(OURS)
        return ours, theirs

    def _wait_devices(self, driver: str) -> None:
        assert self.kube is not None and self.node is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.peer is not None and self.peer.poll() is not None:
                raise RuntimeError(f"the reference kubelet plugin exited with {self.peer.returncode}:\n"
                                   f"{self._peer_log_tail()}")
            slices = self.kube.list(f"{RESOURCE_V1}/resourceslices",
                                    field_selector=f"spec.nodeName={self.node.name},spec.driver={driver}")["items"]
            if sum(len(s["spec"].get("devices") or []) for s in slices) >= GPUS:
                return
            time.sleep(0.2)
        raise RuntimeError(f"{driver} published no {GPUS} devices on {self.node.name} within 60 s"
                           + (f"\n{self._peer_log_tail()}" if driver == PEER else ""))

    def _peer_log_tail(self) -> str:
        try:
            return "\n".join((self.work / "peer.log").read_text(errors="replace").splitlines()[-30:])
        except OSError as exc:
            return f"(no log: {exc})"

    def stop(self) -> None:
        if self.peer is not None and self.peer.poll() is None:
            self.peer.terminate()
            try:
                self.peer.wait(15)
            except subprocess.TimeoutExpired:
                self.peer.kill()
                self.peer.wait(5)
        super().stop()

    # ---- idle -----------------------------------------------------------------------------------------------

    def idle(self, seconds: float, sides: tuple[Side, Side]) -> None:
        time.sleep(min(SETTLE_S, seconds))
        slices = max(1, round(seconds / IDLE_SLICE_S))
        for _ in range(slices):
            before = [(cpu_s(s.pid()), time.monotonic()) for s in sides]
            time.sleep(seconds / slices)
            for s, (c0, t0) in zip(sides, before):
                s.idle_cpu.append((cpu_s(s.pid()) - c0) / (time.monotonic() - t0))
        for s in sides:
            s.idle_rss = kubeletpattern.rss_mib(s.pid())

    # ---- pods -----------------------------------------------------------------------------------------------

    def _metrics(self) -> dict[tuple[str, pairstats.Labels], float]:
        assert self.node is not None
        return kubelet_samples(self.node.ports["kubelet"])

    def pod(self, side: Side, name: str, record: bool) -> None:
        """One pod on ``side``'s driver, from create to its claim unprepared."""
        assert self.kube is not None and self.node is not None
        pod = self.node.pod_manifest(name, ["sh", "-c", "trap 'exit 0' TERM; sleep 86400 & wait"], namespace="pods",
                                     image=busybox_image(),
                                     resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": side.driver}])
        pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
        m0 = self._metrics()
        cpu0, t0 = cpu_s(side.pid()), time.monotonic()
        path = f"/api/v1/namespaces/pods/pods/{name}"
        started = time.perf_counter()
        self.kube.create("/api/v1/namespaces/pods/pods", pod)
        deadline = time.monotonic() + 120
        phase = None
        while True:
            phase = (self.kube.get(path).get("status") or {}).get("phase")
            if phase == "Running":
                running = time.perf_counter() - started
                break
            if phase in ("Failed", "Succeeded") or time.monotonic() > deadline:
                raise RuntimeError(f"pod {name} ({side.driver}) did not run within 120 s (phase {phase})\n"
                                   f"{self.node.logs_tail()}")
            time.sleep(POLL_S)
        container = next(iter(self.node.container_ids("pods", name).values()), "")
        self.kube.request("DELETE", path)
        # The kubelet observes its step's histogram after the call's, once its own bookkeeping is done: wait for both.
        before = (pairstats.grpc_call_totals(m0, side.driver, UNPREPARE).count,
                  pairstats.operation_totals(m0, "UnprepareResources").count)
        deadline = time.monotonic() + 60
        while True:
            m1 = self._metrics()
            if (pairstats.grpc_call_totals(m1, side.driver, UNPREPARE).count > before[0]
                    and pairstats.operation_totals(m1, "UnprepareResources").count > before[1]):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"pod {name}: the kubelet did not unprepare its {side.driver} claim within 60 s")
            time.sleep(0.05)
        cpu1, t1 = cpu_s(side.pid()), time.monotonic()
        if not record:
            return
        calls = {m: pairstats.grpc_call_totals(m1, side.driver, m) - pairstats.grpc_call_totals(m0, side.driver, m)
                 for m in (PREPARE, UNPREPARE)}
        ops = {o: pairstats.operation_totals(m1, o) - pairstats.operation_totals(m0, o)
               for o in ("PrepareResources", "UnprepareResources")}
        for what, totals in {**calls, **ops}.items():
            if totals.count != 1:
                raise RuntimeError(f"pod {name} ({side.driver}): the kubelet's {what} count grew by {totals.count:g}, "
                                   "not 1 (a retry or another pod's call): the round cannot be attributed")
        side.prepare.append(calls[PREPARE].sum)
        side.unprepare.append(calls[UNPREPARE].sum)
        side.prepare_op.append(ops["PrepareResources"].sum)
        side.unprepare_op.append(ops["UnprepareResources"].sum)
        side.pod_cpu.append(max(0.0, (cpu1 - cpu0) - side.idle_rate * (t1 - t0)))
        side.running.append(running)
        side.containers.append(container)

    def pods(self, count: int, ours: Side, peer: Side) -> None:
        for side in (ours, peer):                          # warm-up, not recorded
            self.pod(side, f"warm-{side.tag}", record=False)
        ticks0 = {s.driver: kubeletpattern.cpu_seconds(s.pid()) for s in (ours, peer)}
        t0 = time.monotonic()
        for i in range(count):
            for side in ((ours, peer) if i % 2 == 0 else (peer, ours)):
                self.pod(side, f"{side.tag}-{i}", record=True)
        took = time.monotonic() - t0
        for s in (ours, peer):
            s.pod_cpu_ticks = (kubeletpattern.cpu_seconds(s.pid()) - ticks0[s.driver] - s.idle_rate * took) / count
        assert self.node is not None
        starts = start_container_seconds(self.node.containerd_log.read_text(errors="replace"))
        for s in (ours, peer):
            missing = [c for c in s.containers if c not in starts]
            if missing:
                raise RuntimeError(f"containerd's log has no StartContainer for {len(missing)} of {s.driver}'s "
                                   f"containers (e.g. {missing[0]!r})")
            s.start_container = [starts[c] for c in s.containers]

    # ---- back to back ---------------------------------------------------------------------------------------

    def _claims(self, side: Side, count: int) -> list[tuple[str, str]]:
        """``count`` claims in namespace b2b allocated by hand to the side's devices gpu-0…, (name, uid)."""
        assert self.kube is not None and self.node is not None
        driver = side.driver
        out = []
        for i in range(count):
            name = f"{side.tag}-{i}"
            claim = self.kube.create(f"{RESOURCE_V1}/namespaces/b2b/resourceclaims", {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": driver}}]}}})
            claim["status"] = {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": driver, "pool": self.node.name, "device": f"gpu-{i % GPUS}"}]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [self.node.name]}]}]}}}
            self.kube.request("PUT", f"{RESOURCE_V1}/namespaces/b2b/resourceclaims/{name}/status", body=claim)
            out.append((name, claim["metadata"]["uid"]))
        return out

    def back_to_back(self, rounds: int, ours: Side, peer: Side) -> None:
        claims = {s.driver: self._claims(s, GPUS) for s in (ours, peer)}
        stubs = {s.driver: dra_grpc.DRAPluginStub(grpc.insecure_channel(f"unix:{s.dra_socket()}"))
                 for s in (ours, peer)}

        def call(side: Side, method: str, claim: tuple[str, str]) -> float:
            msg = dra_pb.NodePrepareResourcesRequest if method == PREPARE else dra_pb.NodeUnprepareResourcesRequest
            request = msg(claims=[dra_pb.Claim(namespace="b2b", name=claim[0], uid=claim[1])])
            started = time.perf_counter()
            reply = getattr(stubs[side.driver], method)(request, timeout=45)
            took = time.perf_counter() - started
            errors = [c.error for c in reply.claims.values() if c.error]
            if errors:
                raise RuntimeError(f"{side.driver} {method}: {errors[0]}")
            return took

        for side in (ours, peer):                          # warm: connections, first specs
            call(side, PREPARE, claims[side.driver][0])
            call(side, UNPREPARE, claims[side.driver][0])
        for r in range(rounds):
            for side in ((ours, peer) if r % 2 == 0 else (peer, ours)):
                claim = claims[side.driver][r % GPUS]
                c0, t0 = cpu_s(side.pid()), time.monotonic()
                side.b2b_prepare.append(call(side, PREPARE, claim))
                side.b2b_unprepare.append(call(side, UNPREPARE, claim))
                time.sleep(B2B_SETTLE_S)
                side.b2b_cpu.append(max(0.0, cpu_s(side.pid()) - c0 - side.idle_rate * (time.monotonic() - t0)))


def figures(ours: Side, peer: Side) -> list[Figure]:
    """The rows of the side-by-side table from what was measured."""
    def p90(v: Any) -> float:
        return pairstats.percentile(v, 0.9)

    out = []

    def ratio(key: str, label: str, a: list[float], b: list[float], how: str,
              stat: Callable[[Any], float] = statistics.median, scale: float = 1000.0, unit: str = "ms") -> None:
        r = pairstats.paired_ratio(a, b, stat)
        out.append(Figure(f"{NAME}.{key}", f"{label} ours/peer ({_short(r, scale, unit)})", r.ratio, "×",
                          f"{r.describe(scale, unit)}; {how}", stat="median" if stat is statistics.median else "p90"))

    kubelet = "the kubelet's dra_grpc_operations_duration_seconds, sum delta over one call"
    ratio("prepare.p50_ratio", "NodePrepareResources p50 as the kubelet times it", ours.prepare, peer.prepare, kubelet)
    ratio("prepare.p90_ratio", "NodePrepareResources p90 as the kubelet times it", ours.prepare, peer.prepare,
          kubelet, stat=p90)
    ratio("unprepare.p50_ratio", "NodeUnprepareResources p50 as the kubelet times it", ours.unprepare,
          peer.unprepare, kubelet)
    step = "the kubelet's dra_operations_duration_seconds (its whole step: claim lookups, call, bookkeeping)"
    ratio("kubelet_prepare_step.p50_ratio", "kubelet's PrepareResources step p50", ours.prepare_op, peer.prepare_op,
          step)
    ratio("kubelet_unprepare_step.p50_ratio", "kubelet's UnprepareResources step p50", ours.unprepare_op,
          peer.unprepare_op, step)
    ratio("cpu_per_pod_ratio", "plugin CPU per pod, idle subtracted", ours.pod_cpu, peer.pod_cpu,
          "schedstat of every thread from create to the claim unprepared, less the idle rate × that time; "
          f"cross-check from /proc/<pid>/stat ticks over all pods: {ours.pod_cpu_ticks * 1000:.1f} / "
          f"{peer.pod_cpu_ticks * 1000:.1f} ms per pod")
    ratio("pod_running_ratio", "pod create → Running", ours.running, peer.running,
          "create request to first Running status, 10 ms poll")
    ratio("start_container_ratio", "containerd's StartContainer (runc create with the CDI hooks, start)",
          ours.start_container, peer.start_container, "from containerd's log: the call's arrival to its success")
    d = pairstats.paired_difference([x * 1000 for x in ours.idle_cpu], [x * 1000 for x in peer.idle_cpu])
    out.append(Figure(f"{NAME}.idle.cpu_excess_ms_per_s",
                      f"plugin CPU while idle, ours − peer ({ours.idle_rate * 1000:.2f} − {peer.idle_rate * 1000:.2f} "
                      "ms/s)", d.difference, "ms/s",
                      f"mean over {d.samples} paired slices of the idle window, 95 % CI [{d.low:.2f}, {d.high:.2f}] "
                      "ms/s; schedstat of every thread", stat="mean"))
    out.append(Figure(f"{NAME}.idle.cpu_ms_per_s", f"our plugin's CPU while idle (peer {peer.idle_rate * 1000:.2f} ms/s)",
                      ours.idle_rate * 1000, "ms/s", "schedstat of every thread over the idle window", stat="mean"))
    out.append(Figure(f"{NAME}.idle.rss_mib", f"our resident memory, idle (peer {peer.idle_rss:.1f} MiB)",
                      ours.idle_rss, "MiB", "VmRSS after the idle window", stat="peak"))
    ratio("b2b.prepare.p50_ratio", "back to back over the DRA socket: prepare p50", ours.b2b_prepare,
          peer.b2b_prepare, "client-side time of one claim per call, no kubelet")
    ratio("b2b.unprepare.p50_ratio", "back to back over the DRA socket: unprepare p50", ours.b2b_unprepare,
          peer.b2b_unprepare, "client-side time of one claim per call, no kubelet")
    ratio("b2b.cpu_per_cycle_ratio", "back to back: plugin CPU per prepare+unprepare", ours.b2b_cpu, peer.b2b_cpu,
          f"schedstat over each cycle and a {B2B_SETTLE_S * 1000:.0f} ms settle, less the idle rate")
    s = pairstats.paired_ratio(ours.startup, peer.startup)
    out.append(Figure(f"{NAME}.startup.getinfo_s", f"our start → GetInfo (peer {s.peer:.3f} s, ratio {s.ratio:.2f})",
                      s.ours, "s", f"{s.describe(1.0, 's')}; spawn to the registration socket answering GetInfo",
                      stat="median"))
    return out


def _short(r: pairstats.PairedRatio, scale: float, unit: str) -> str:
    return f"{r.ours * scale:.3g} / {r.peer * scale:.3g} {unit}, CI {r.low:.2f}–{r.high:.2f}"


def run(params: Params) -> list[Figure]:
    peer_bin = check_peer_bin(params.peer_bin)
    byte_compile()
    work = Path(tempfile.mkdtemp(prefix="gpu-dra-bench-peer-"))
    bench = _Bench(work, peer_bin)
    try:
        bench.start()
        ours_start = Side(OURS, "ours", lambda: -1, lambda: Path())
        peer_start = Side(PEER, "peer", lambda: -1, lambda: Path())
        bench.time_startups(params.api_startups, ours_start, peer_start)
        ours, peer = bench.start_plugins()
        ours.startup, peer.startup = ours_start.startup, peer_start.startup
        bench.idle(params.idle_s, (ours, peer))
        bench.pods(params.peer_pods, ours, peer)
        bench.back_to_back(params.peer_b2b_rounds, ours, peer)
    finally:
        bench.stop()
        shutil.rmtree(work, ignore_errors=True)
    return figures(ours, peer)


__all__ = ["NAME", "DESCRIPTION", "run", "check_peer_bin", "PeerBinaryError", "figures", "Side", "REPO"]
