"""One pod's life on the real node, as the plugin pays for it: CPU per thread and wall time per step.

``python -m bench.podlife [--rounds N] [--idle S] [--hold S]`` (root and ``make node-binaries``, as the real-node
tests). A local control plane, one real node (kubelet, containerd, runc) and ``gpu-dra kubelet-plugin`` as the chart
runs it (log level info, per-claim metrics from the kubelet's PodResources socket, /metrics served, no scraper) for
two simulated H100s. After an idle window, each round creates a pod with a claim on a whole GPU, waits until it
runs, lets it run ``--hold`` seconds, deletes it and waits until the plugin has unprepared its claim (CDI spec
gone), then ``--hold`` seconds of quiet. Printed:

* the plugin's CPU while idle, per thread (ms/s);
* per pod: the plugin's CPU per thread over the round minus what the same threads take idle over the same time,
  so what remains is what the pod cost; the plugin's own claim-handler time (its histograms) and the pod's create
  → Running.

Threads are told apart by their name in /proc (comm): gRPC's C-core threads name themselves; Python 3.11 does not
give its threads' names to the OS, so the plugin's Python threads all read ``python`` unless something in the
process sets them (e.g. a ``sitecustomize`` on PYTHONPATH: the plugin inherits this script's environment).
``--signal-profiler`` sends the plugin SIGUSR1 before and after the rounds, for a profiler loaded that way that
writes its figures on that signal.
Context for bench/README.md ("Where a pod's CPU goes"), not a target.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from api.deviceclasses import device_classes
from api.names import DEFAULT_DRIVER_NAME
from bench.realnodebed import RealNodeBed
from kube.client import DEVICE_CLASSES
from testbed.localnode import cuda_probe_image, install_driver_root
from testbed.nodeplugin import LocalNodePlugin
from testbed.podprobe import for_local_node

DRIVER = DEFAULT_DRIVER_NAME
POLL_S = 0.01
NS = "podlife"
HANDLER = {"prepare": "gpu_dra_node_prepare_claim_duration_seconds_sum",
           "unprepare": "gpu_dra_node_unprepare_claim_duration_seconds_sum"}


def thread_cpu(pid: int) -> dict[str, float]:
    """Seconds on a CPU so far, summed per thread name (comm), from /proc/<pid>/task/*/schedstat."""
    out: dict[str, float] = defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns = int((task / "schedstat").read_text().split()[0])
            name = (task / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
        out[name] += ns / 1e9
    return out


def _minus(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a.keys() | b.keys()}


def _handler_sums(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for op, name in HANDLER.items():
        out[op] = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
    return out


class PodLife(RealNodeBed):
    def __init__(self, work: Path, env: dict[str, str]) -> None:
        super().__init__(work)
        self.work = work
        self.env = env

    def start(self) -> None:
        fleet = self.start_node({"gpus": [{"model": "H100-80GB", "count": 2}]})
        assert self.kube is not None and self.node is not None
        for cls in device_classes(DRIVER):
            self.kube.create(DEVICE_CLASSES, cls)
        socket = self.node.root_dir / "pod-resources" / "kubelet.sock"
        self.plugin = LocalNodePlugin(self.node, fleet, DRIVER, log_level="info", env=self.env,
                                      extra_args=("--pod-resources-socket", str(socket)))
        install_driver_root(self.plugin.driver_root, self.node.bin_dir, "host", fleet=fleet, node_name=self.node.name)
        self.plugin.start()
        self.plugin.wait_registered(60)
        self.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        self.kube.create(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "gpu"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}}})
        deadline = time.monotonic() + 60
        while not self.kube.list("/apis/resource.k8s.io/v1/resourceslices",
                                 field_selector=f"spec.nodeName={self.node.name}")["items"]:
            if time.monotonic() > deadline:
                raise RuntimeError("no ResourceSlices within 60 s")
            time.sleep(0.2)

    def run_pod(self, name: str) -> tuple[float, str]:
        """Creates the pod; returns (seconds to Running, its claim's UID)."""
        assert self.kube is not None and self.node is not None
        pod = for_local_node({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                              "spec": {"containers": [{"name": "cuda", "image": "unused",
                                                       "resources": {"claims": [{"name": "gpu"}]}}],
                                       "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]}},
                             cuda_probe_image(), self.node.name)
        path = f"/api/v1/namespaces/{NS}/pods/{name}"
        start = time.perf_counter()
        self.kube.create(f"/api/v1/namespaces/{NS}/pods", {**pod, "metadata": {**pod["metadata"], "namespace": NS}})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            got = self.kube.get(path)
            status = got.get("status") or {}
            if status.get("phase") == "Running":
                took = time.perf_counter() - start
                claim = status["resourceClaimStatuses"][0]["resourceClaimName"]
                uid = self.kube.get(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{claim}")
                return took, uid["metadata"]["uid"]
            time.sleep(POLL_S)
        raise RuntimeError(f"pod {name} did not run within 120 s")

    def delete_pod(self, name: str, uid: str) -> None:
        assert self.kube is not None and self.plugin is not None
        self.kube.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not any(uid in p.name for p in self.plugin.cdi_dir.iterdir()):
                return
            time.sleep(0.02)
        raise RuntimeError(f"pod {name}: claim {uid} not unprepared within 60 s")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.podlife", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--idle", type=float, default=20.0, help="idle window before the pods, seconds")
    ap.add_argument("--hold", type=float, default=2.0, help="seconds a pod runs, and the quiet after it")
    ap.add_argument("--signal-profiler", action="store_true", help="SIGUSR1 to the plugin before and after the rounds")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-dra-bench-podlife-"))
    life = PodLife(work, env={})
    try:
        life.start()
        assert life.plugin is not None and life.plugin.proc is not None
        pid = life.plugin.proc.pid
        for i in range(2):     # the first calls: imports, connection pools
            _, uid = life.run_pod(f"warmup-{i}")
            life.delete_pod(f"warmup-{i}", uid)
        time.sleep(5)
        t0, c0 = time.monotonic(), thread_cpu(pid)
        time.sleep(args.idle)
        idle_s = time.monotonic() - t0
        idle = {k: v / idle_s for k, v in _minus(thread_cpu(pid), c0).items()}
        if args.signal_profiler:
            os.kill(pid, signal.SIGUSR1)    # the profile so far (start, warm-up, idle) apart from the rounds'
            time.sleep(2)
        per_pod: list[dict[str, float]] = []
        running: list[float] = []
        handler: list[dict[str, float]] = []
        walls: list[float] = []
        for i in range(args.rounds):
            h0 = _handler_sums(life.plugin.metrics_port)    # read outside the CPU window: a scrape costs CPU too
            time.sleep(0.2)
            c0, t0 = thread_cpu(pid), time.monotonic()
            took, uid = life.run_pod(f"pod-{i}")
            time.sleep(args.hold)
            life.delete_pod(f"pod-{i}", uid)
            time.sleep(args.hold)
            wall = time.monotonic() - t0
            used = _minus(thread_cpu(pid), c0)
            per_pod.append({k: v - idle.get(k, 0.0) * wall for k, v in used.items()})
            h1 = _handler_sums(life.plugin.metrics_port)
            handler.append({k: h1[k] - h0[k] for k in h0})
            running.append(took)
            walls.append(wall)
        print(f"idle over {idle_s:.0f} s: {sum(idle.values()) * 1000:.3f} ms/s  " +
              "  ".join(f"{k} {v * 1000:.3f}" for k, v in sorted(idle.items(), key=lambda kv: -kv[1]) if v > 1e-6))
        totals = [sum(p.values()) * 1000 for p in per_pod]
        print(f"per pod, idle subtracted, {args.rounds} rounds: median {statistics.median(totals):.1f} ms "
              f"(min {min(totals):.1f}, max {max(totals):.1f}); round wall median {statistics.median(walls):.2f} s")
        names = sorted({k for p in per_pod for k in p}, key=lambda k: -statistics.median(p.get(k, 0.0)
                                                                                         for p in per_pod))
        for name in names:
            vals = [p.get(name, 0.0) * 1000 for p in per_pod]
            if abs(statistics.median(vals)) >= 0.05:
                print(f"  {name:20s} median {statistics.median(vals):7.2f} ms  (min {min(vals):.2f}, max {max(vals):.2f})")
        for op in ("prepare", "unprepare"):
            vals = [h[op] * 1000 for h in handler]
            print(f"claim handler {op}: median {statistics.median(vals):.2f} ms (min {min(vals):.2f}, "
                  f"max {max(vals):.2f})")
        print(f"create → Running: median {statistics.median(running) * 1000:.0f} ms "
              f"(min {min(running) * 1000:.0f}, max {max(running) * 1000:.0f})")
        if args.signal_profiler:
            os.kill(pid, signal.SIGUSR1)
            time.sleep(2)
    finally:
        life.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
