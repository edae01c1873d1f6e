"""Benchmark ``controlloops``: our own control loops on a large cluster (a LocalCluster of the pinned binaries):
`gpu-dra controller` under a steady stream of pending claims, `gpu-dra explain pod/NAME` and `gpu-dra status NODE`.

The fleet: ``loops_nodes`` nodes (200; 1000 for the large row) of the demo's node-a (examples/fleets/demo.yaml:
8 × H100 with whole GPUs and dynamic MIG, MPS slots on GPU 6, memory shares on GPU 7: 187 devices, ~210 KB of
slices per node), published with ``gpu-dra publish --once``; the chart's DeviceClasses. Then, not timed:
``loops_pending`` pods whose claims no node can hold (more GPUs, MIG devices or slots than a node has, from four
templates) stay Pending throughout.

1. without the controller, ``loops_window_s`` seconds of the stream: one new pending pod a second (the templates in
   turn) — the API server's CPU over it is the baseline;
2. `gpu-dra controller` started as the local cluster's audited admin (testbed.localcluster: its requests are in the
   API server's audit log), timed until its caches are synced and its first pending pass is done;
3. the same stream for ``loops_window_s`` seconds with the controller: its CPU (utime + stime of the process) and
   RSS, the bytes it read (``rchar`` of /proc/<pid>/io: every byte the API server sent it, TLS included), its
   LISTs from the audit log (none may come after its start), and the API server's CPU over the window less the
   baseline's;
4. with every pending pod but one deleted and the scheduler settled (its retries of the pending pods would take
   the CPUs the tools are timed on), `gpu-dra explain pod/NAME` of that pod and `gpu-dra status NODE` of one node,
   each a process of its own: wall time, peak RSS (the child's ru_maxrss) and CPU.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from api.deviceclasses import device_classes
from bench.core import Figure
from bench.params import Params
from bench.publish import DRIVER, REPO, publish
from bench.scheduler import cpu_seconds, peak_rss, wait_quiet
from cli.publish_cmd import register_missing_nodes
from kube.client import DEVICE_CLASSES, KubeApi
from testbed.localcluster import LocalCluster, free_port

NAME = "controlloops"
DESCRIPTION = ("our control loops on nodes × the demo's node-a: the controller under a stream of pending claims, "
               "explain of a pending pod, status of one node")

NAMESPACE = "bench-loops"
MIB = float(1 << 20)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def node_a() -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "fleets" / "demo.yaml").read_text())
    return next(n for n in doc["nodes"] if n["name"] == "node-a")


def fleet_doc(nodes: int) -> dict[str, Any]:
    spec = node_a()
    return {"nodes": [{"name": f"loop-{i:04d}", "gpus": spec["gpus"], "policy": spec["policy"]} for i in range(nodes)]}


# Four kinds of claims no node-a can hold: what a busy cluster's waiting pods ask for.
TEMPLATES: dict[str, dict[str, Any]] = {
    "gpus-9": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 9}}]}},
    "mig-7g-9": {"devices": {"requests": [{"name": "mig", "exactly": {
        "deviceClassName": f"mig.{DRIVER}", "count": 9,
        "selectors": [{"cel": {"expression": f"device.attributes['{DRIVER}'].profile == '7g.80gb'"}}]}}]}},
    "slots-5": {"devices": {"requests": [{"name": "slots", "exactly": {"deviceClassName": f"slot.{DRIVER}",
                                                                         "count": 5}}]}},
    "gpu-and-mig": {"devices": {"requests": [
        {"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 8}},
        {"name": "mig", "exactly": {"deviceClassName": f"mig.{DRIVER}", "count": 1}}]}},
}


def set_up(kube: KubeApi) -> None:
    for cls in device_classes(DRIVER):
        kube.create(DEVICE_CLASSES, cls)
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    for name, spec in TEMPLATES.items():
        kube.create(f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaimtemplates", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": spec}})


def create_pod(kube: KubeApi, name: str, template: str) -> None:
    kube.create(f"/api/v1/namespaces/{NAMESPACE}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
                 "containers": [{"name": "c", "image": "example.invalid/none", "resources": {"claims": [{"name": "gpu"}]}}]}})


class Stream:
    """One new pending pod a second, the templates in turn, until stopped."""

    def __init__(self, kube: KubeApi, tag: str) -> None:
        self.kube, self.tag, self.created = kube, tag, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stream-{tag}", daemon=True)

    def __enter__(self) -> "Stream":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        names = list(TEMPLATES)
        start = time.monotonic()
        while not self._stop.is_set():
            create_pod(self.kube, f"{self.tag}-{self.created:05d}", names[self.created % len(names)])
            self.created += 1
            self._stop.wait(max(0.0, start + self.created - time.monotonic()))


def audited_lists(cluster: LocalCluster) -> Counter[str]:
    """LISTs of the audited identity by path (a LIST's further pages, with a continue token, are not counted)."""
    return Counter(e["requestURI"].split("?")[0] for e in cluster.audited_requests()
                   if e.get("verb") == "list" and "continue=" not in e["requestURI"])


def names_of_pods(kube: KubeApi) -> list[str]:
    return [p["metadata"]["name"] for p in kube.list_metadata(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]]


def read_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError(f"no rchar in /proc/{pid}/io")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def controller_metric(port: int, series: str) -> float:
    """The sum of the series whose line starts with ``series`` (a name, or a name and its labels)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(series) and not line.startswith("#"))


def run_tool(argv: list[str], log: Path) -> tuple[float, float, float]:
    """(wall seconds, peak RSS in MiB, CPU seconds) of one command."""
    start = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1):           # explain exits 1 for "not allocatable", which is what is asked
        raise RuntimeError(f"{' '.join(argv[2:5])} exited {code}: {log.read_text(errors='replace')[-2000:]}")
    return seconds, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def run(params: Params) -> list[Figure]:
    nodes, window = params.loops_nodes, params.loops_window_s
    work = Path(tempfile.mkdtemp(prefix="gpu-dra-bench-loops-"))
    cluster = LocalCluster(workdir=work / "cluster")
    controller: subprocess.Popen[bytes] | None = None
    try:
        cluster.start()
        pids = cluster.component_pids()
        apiserver, scheduler = pids["kube-apiserver"], pids["kube-scheduler"]
        kube = KubeApi(cluster.api_client(), timeout=120)
        fleet_path = work / "fleet.yaml"
        doc = fleet_doc(nodes)
        fleet_path.write_text(yaml.safe_dump(doc, sort_keys=False))
        register_missing_nodes(cluster.api_client(), [n["name"] for n in doc["nodes"]])
        set_up(kube)
        published = publish(work, cluster.kubeconfig, fleet_path, params.publish_workers, 120.0 + 10.0 * nodes,
                            "loops")
        print(f"controlloops: {nodes} nodes published in {published.seconds:.0f} s", file=sys.stderr, flush=True)
        names = list(TEMPLATES)
        for i in range(params.loops_pending):
            create_pod(kube, f"long-{i:03d}", names[i % len(names)])

        cpu0, t0 = cpu_seconds(apiserver), time.monotonic()
        with Stream(kube, "base"):
            time.sleep(window)
        base_cpu = (cpu_seconds(apiserver) - cpu0) / (time.monotonic() - t0)

        port = free_port()
        started = time.perf_counter()
        with open(work / "controller.log", "wb") as log:
            controller = subprocess.Popen(
                [sys.executable, "-m", "cli.main", "controller", "--kubeconfig", str(cluster.audited_kubeconfig),
                 "--driver-name", DRIVER, "--metrics-port", str(port), "--metrics-address", "127.0.0.1",
                 "--log-level", "warning"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120 + nodes
        while True:
            if controller.poll() is not None:
                raise RuntimeError(f"gpu-dra controller exited: {(work / 'controller.log').read_text()[-2000:]}")
            try:
                if controller_metric(port, 'gpu_dra_pending_claim_passes_total{driver="' + DRIVER + '",result="ok"}'):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("gpu-dra controller: no pending pass done")
            time.sleep(0.5)
        start_s = time.perf_counter() - started
        start_peak = peak_rss(controller.pid) / MIB
        lists_before = audited_lists(cluster)        # its caches' first LISTs are in

        ticks0, bytes0, cpu0, t0 = cpu_seconds(controller.pid), read_bytes(controller.pid), cpu_seconds(apiserver), \
            time.monotonic()
        with Stream(kube, "with"):
            time.sleep(window)
        span = time.monotonic() - t0
        ctl_cpu = (cpu_seconds(controller.pid) - ticks0) / span
        ctl_bytes = (read_bytes(controller.pid) - bytes0) / span
        api_cpu = max(0.0, (cpu_seconds(apiserver) - cpu0) / span - base_cpu)   # below the noise: none
        ctl_rss = rss_mib(controller.pid)
        lists_after = audited_lists(cluster)
        lists = sum((lists_after - lists_before).values())
        passes = controller_metric(port, 'gpu_dra_pending_claim_passes_total{driver="' + DRIVER + '",result="ok"}')

        # The pending pods keep the scheduler retrying (at 1000 nodes, for good); on 2 CPUs that takes the CPU the
        # tools are timed on. All but the one explained go, and the tools are timed once the scheduler has settled.
        for name in names_of_pods(kube):
            if name != "long-000":
                kube.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
        try:
            settled = f"after the scheduler settled in {wait_quiet(scheduler, timeout=180, busy_share=0.1):.0f} s"
        except RuntimeError:
            settled = "with the scheduler still busy after 180 s"
        explain_s, explain_rss, explain_cpu = run_tool([sys.executable, "-m", "cli.main", "explain", "pod/long-000", "-n",
                                           NAMESPACE, "--kubeconfig", str(cluster.kubeconfig)], work / "explain.out")
        status_s, status_rss, status_cpu = run_tool([sys.executable, "-m", "cli.main", "status", "loop-0000", "--driver-name",
                                         DRIVER, "--kubeconfig", str(cluster.kubeconfig)], work / "status.out")
    finally:
        if controller is not None:
            controller.terminate()
            controller.wait(30)
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)

    at = f"{nodes} nodes × node-a"
    return [
        Figure(f"{NAME}.controller.rss_mib", f"controller RSS under the pending stream ({at})", ctl_rss, "MiB",
               f"VmRSS after a {window:g} s window of one new pending pod a second, {params.loops_pending} pending "
               f"throughout; peak at start {start_peak:.0f} MiB"),
        Figure(f"{NAME}.controller.cpu_cores", f"controller CPU under the pending stream ({at})", ctl_cpu, "cores",
               f"utime+stime over the window; {passes:.0f} pending passes since its start"),
        Figure(f"{NAME}.controller.read_mb_per_s", f"bytes from the API server to the controller ({at})",
               ctl_bytes / 1e6, "MB/s", "rchar of /proc/<pid>/io over the window (TLS included)"),
        Figure(f"{NAME}.controller.lists_after_start", f"controller LISTs after its start ({at})", float(lists),
               "requests", "the API server's audit log of the controller's identity: LISTs beyond its caches' first"),
        Figure(f"{NAME}.controller.apiserver_cpu_cores", f"API server CPU the controller adds ({at})", api_cpu,
               "cores", f"API server utime+stime over the window less the same window without the controller "
                        f"({base_cpu:.3f} cores)"),
        Figure(f"{NAME}.controller.start_s", f"controller start to its first pending pass ({at})", start_s, "s",
               "process start, one LIST of each resource, first pass"),
        Figure(f"{NAME}.explain.seconds", f"gpu-dra explain pod/NAME of a pending pod ({at})", explain_s, "s",
               f"wall time of the command, {settled}; its CPU {explain_cpu:.1f} s"),
        Figure(f"{NAME}.explain.rss_mib", f"gpu-dra explain peak RSS ({at})", explain_rss, "MiB", "ru_maxrss"),
        Figure(f"{NAME}.status_node.seconds", f"gpu-dra status NODE ({at})", status_s, "s",
               f"wall time; its CPU {status_cpu:.2f} s"),
        Figure(f"{NAME}.status_node.rss_mib", f"gpu-dra status NODE peak RSS ({at})", status_rss, "MiB", "ru_maxrss"),
    ]


def main() -> None:            # python -m bench.controlloops: one run, its figures as JSON
    from bench.params import FULL
    print(json.dumps([f.__dict__ for f in run(FULL)], indent=1))


if __name__ == "__main__":
    main()
