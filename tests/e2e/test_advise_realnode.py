"""`gpu-dra advise` on the real node, with the real Prometheus of the test bed scraping the plugin as the chart's
monitor does. Three workloads hold known amounts of GPU memory through the CUDA stand-in (cuda-probe --alloc-mib):
a Deployment on a whole GPU (6000 MiB), a Job on a 3g.40gb MIG device (12000 MiB) and a bare pod on an MPS slot
(3000 MiB). `advise` groups them by owner, template and request and names for each the expected device, for every
set of kinds (memory shares, MIG profiles, MPS slots); its emitted templates, applied with kubectl (the
Deployment switched with the patch it prints), schedule and run on the node with the CUDA probe seeing the
advised device. Then the bad inputs, each one line and its exit status: a wrong URL, Prometheus unreachable, no
series, and a window with a gap (the plugin stopped for longer than --max-gap, so Prometheus could not scrape
it).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from realnode_helpers import RealNode
from standin.workloads import create, wait_until

from api.names import DEFAULT_DRIVER_NAME as D
from testbed import prometheus
from testbed.localnode import cuda_probe_image
from testbed.nodeplugin import LocalNodePlugin
from testbed.podprobe import for_local_node

pytestmark = pytest.mark.e2e

NS = "ml"
REPO = Path(__file__).resolve().parents[2]
PRODUCT = "NVIDIA H100 80GB HBM3"
A = f"device.attributes['{D}']"
# workload → (kind, template, device class, CEL selector, opaque config, MiB it holds)
WORKLOADS = {
    "notebook": ("Deployment", "notebook-gpu", D, f"{A}.productName == '{PRODUCT}'", None, 6000),
    "train": ("Job", "train-gpu", f"mig.{D}", f"{A}.profile == '3g.40gb'", None, 12000),
    "infer": ("Pod", "infer-slot", f"slot.{D}", f"{A}.sharing == 'mps'",
              {"apiVersion": f"{D}/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}, 3000),
}
FLAGS = ["-n", NS, "--window", "10m", "--min-samples", "5", "--min-span", "8s"]
DOC = REPO / "docs" / "advise.md"
_VARYING = re.compile(r"\d+ samples over [0-9dhms]+")


@pytest.fixture(scope="module")
def real() -> Iterator[RealNode]:
    with RealNode().running() as node:
        yield node


@pytest.fixture(scope="module")
def ours(real: RealNode) -> LocalNodePlugin:
    return real.start_metrics_plugin(D)


def template(name: str, cls: str, cel: str, config: dict[str, Any] | None) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": cls, "selectors": [{"cel": {"expression": cel}}]}}]}
    if config:
        devices["config"] = [{"requests": ["gpu"], "opaque": {"driver": D, "parameters": config}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": devices}}}


def pod_spec(name: str, template_name: str, node: str, mib: int | None, restart: str) -> dict[str, Any]:
    """A pod spec runnable on the local node whose container holds ``mib`` on its claim's device (or, without,
    runs the probe that prints what it sees)."""
    pod = for_local_node({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                          "spec": {"restartPolicy": restart,
                                   "containers": [{"name": "cuda", "image": "unused",
                                                   "resources": {"claims": [{"name": "gpu"}]}}],
                                   "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template_name}]}},
                         cuda_probe_image(), node)
    if mib is not None:
        pod["spec"]["containers"][0]["command"] = ["cuda-probe", "--alloc-mib", str(mib)]
    return pod


def start_workloads(real: RealNode) -> None:
    """Each workload, once the one before holds its memory: the MPS slot first (GPU 1 has them, and no slot fits
    on a GPU whose whole device is out), then the 3g.40gb, then the whole GPU on what is left."""
    assert real.kube is not None and real.node is not None
    for name in ("infer", "train", "notebook"):
        kind, tpl, cls, cel, config, mib = WORKLOADS[name]
        create(real.kube, NS, template(tpl, cls, cel, config))
        pod = pod_spec(name, tpl, real.node.name, mib, "Never" if kind != "Deployment" else "Always")
        labels = {"app": name}
        if kind == "Pod":
            create(real.kube, NS, pod)
        elif kind == "Deployment":
            # Recreate: a new pod's device may be the one the old pod holds.
            real.kube.create(f"/apis/apps/v1/namespaces/{NS}/deployments", {
                "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
                "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "strategy": {"type": "Recreate"},
                         "template": {"metadata": {"labels": labels}, "spec": pod["spec"]}}})
        else:
            real.kube.create(f"/apis/batch/v1/namespaces/{NS}/jobs", {
                "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
                "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": labels}, "spec": pod["spec"]}}})
        try:
            wait_until(lambda: f"alloc: {mib} MiB on device 0" in log(real, pod_of(real, name)), 120,
                       f"{name} to hold {mib} MiB", interval=0.5)
        except AssertionError as exc:
            pod_name = pod_of(real, name)
            raise AssertionError(f"{exc}\nevents of {pod_name}:\n{real.events(NS, pod_name)}\nlog:\n"
                                 f"{log(real, pod_name)[-2000:]}") from None


def pod_of(real: RealNode, app: str) -> str:
    """The name of the workload's running pod."""
    assert real.kube is not None
    if app == "infer":
        return app
    items = real.kube.list(f"/api/v1/namespaces/{NS}/pods", label_selector=f"app={app}")["items"]
    live = [p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp")]
    return str(live[0]) if len(live) == 1 else ""


def log(real: RealNode, pod: str) -> str:
    assert real.node is not None
    try:
        return real.node.container_log(NS, pod, "cuda")
    except Exception:  # noqa: BLE001 - no log file yet
        return ""


def advise(real: RealNode, url: str, *flags: str, prog: str = "cli.main") -> subprocess.CompletedProcess[str]:
    assert real.cluster is not None
    args = ([] if prog == "cli.kubectl_gpu" else ["advise"]) + ["--prometheus", url, *flags]
    if prog == "cli.kubectl_gpu":
        args.insert(2, "advise")     # kubectl gpu --prometheus URL advise ...: flags before the command
    return subprocess.run([sys.executable, "-m", prog, *args, "--kubeconfig", str(real.cluster.kubeconfig)],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "KUBERNETES_SERVICE_HOST": ""})


def rows(out: str) -> dict[str, list[str]]:
    """Table row words by workload."""
    return {line.split()[1]: line.split() for line in out.splitlines()[3:] if line.startswith(f"{NS} ")
            and not line.split()[2].endswith(":")}


@pytest.fixture(scope="module")
def prom(real: RealNode, ours: LocalNodePlugin) -> Iterator[prometheus.Prometheus]:
    """The three workloads running with their memory held, and a Prometheus that has scraped them for a while."""
    assert real.node is not None
    real.namespace(NS)
    start_workloads(real)
    config = {"global": {"scrape_interval": "2s", "scrape_timeout": "1s", "evaluation_interval": "2s"},
              "scrape_configs": [{"job_name": "gpu-dra-kubelet-plugin", "honor_labels": True,
                                  "static_configs": [{"targets": [f"127.0.0.1:{ours.metrics_port}"],
                                                      "labels": {"namespace": "gpu-dra", "pod": "plugin-x",
                                                                 "node": real.node.name}}]}]}
    with prometheus.running(config) as server:
        def enough() -> bool:
            counts = server.query(f"count_over_time(gpu_dra_claim_gpu_memory_used_bytes{{namespace='{NS}'}}[10m])")
            return len(counts) == 3 and all(float(c["value"][1]) >= 6 for c in counts)

        wait_until(enough, 90, "6 samples of each workload's series", interval=1.0)
        time.sleep(4)                                     # a span of 10 s at least
        yield server


def test_advise_names_the_device_each_workload_needs(real: RealNode, prom: prometheus.Prometheus) -> None:
    done = advise(real, prom.url, *FLAGS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    got = rows(done.stdout)
    assert set(got) == {"deployment/notebook", "job/train", "pod/infer"}, done.stdout
    # ran on, peak and the advice: shares first, they take the least of the GPU.
    assert got["deployment/notebook"][2:] == ["notebook-gpu/gpu", "H100-80GB", "whole", "GPU", "5.86Gi", "5.86Gi",
                                             "share", "8Gi", "0.90"], done.stdout
    assert got["job/train"][2:] == ["train-gpu/gpu", "H100-80GB", "mig", "3g.40gb", "11.72Gi", "11.72Gi", "share",
                                    "15Gi", "0.31"], done.stdout
    assert got["pod/infer"][2:] == ["infer-slot/gpu", "H100-80GB", "mps", "slot", "2.93Gi", "2.93Gi", "share", "4Gi",
                                    "0.20"], done.stdout
    assert (f"{NS} deployment/notebook notebook-gpu/gpu: peak 5.86 GiB, p95 5.86 GiB, " in done.stdout
            and "+ 20% = 7.03 GiB → share 8Gi (8.00 GiB, SMs not bounded) is the smallest that holds it"
            in done.stdout)

    mig = json.loads(advise(real, prom.url, *FLAGS, "--kinds", "mig,slot", "-o", "json").stdout)
    advice = {a["workload"]["name"]: a for a in mig["advice"]}
    assert {n: a["recommendation"]["device"] for n, a in advice.items()} == {
        "notebook": "mig 1g.10gb", "train": "mig 1g.20gb", "infer": "mig 1g.10gb"}
    assert advice["train"]["ranOn"]["device"] == "mig 3g.40gb" and advice["train"]["freesGpuFraction"] == 0.25
    assert advice["infer"]["source"] == {"kind": "ResourceClaimTemplate", "name": "infer-slot", "entry": "gpu"}

    slots = json.loads(advise(real, prom.url, *FLAGS, "--kinds", "slot", "-o", "json", prog="cli.kubectl_gpu").stdout)
    verdicts = {a["workload"]["name"]: (a["verdict"], (a["recommendation"] or {}).get("device"))
                for a in slots["advice"]}
    assert verdicts == {"notebook": ("resize", "mps slot (1 of 4, 25% threads)"),
                        "train": ("resize", "mps slot (1 of 4, 25% threads)"),
                        "infer": ("keep", "mps slot (1 of 4, 25% threads)")}

    thin = advise(real, prom.url, "--window", "10m")
    assert thin.returncode == 0 and all(r[-3:] == ["none", "(too-little-data)", "-"]
                                        for r in rows(thin.stdout).values()), thin.stdout
    same_as_documented(done.stdout, 0)


def documented(block: int) -> list[str]:
    """The lines of the ``block``th text block of docs/advise.md's example, after its command line."""
    example = DOC.read_text().split("\n## An example\n", 1)[1]
    text = re.findall(r"```text\n(.*?)```", example, re.S)[block]
    return text.splitlines()[1:]


def same_as_documented(out: str, block: int) -> None:
    """docs/advise.md shows what advise printed here: the same lines but for the time, the server's port, and how
    many samples over what span."""
    def normal(lines: list[str]) -> list[str]:
        return [_VARYING.sub("N samples over T", line) for line in lines]

    doc, got = documented(block), out.splitlines()
    assert doc[0].split(" over ")[0].split(" http")[0] == got[0].split(" over ")[0].split(" http")[0]
    assert normal(doc[1:]) == normal(got[1:]), "docs/advise.md's example is not what advise prints now:\n" + out


def test_a_snapshot_of_the_plugins_metrics(real: RealNode, ours: LocalNodePlugin,
                                           prom: prometheus.Prometheus) -> None:
    assert real.cluster is not None and real.node is not None
    done = subprocess.run([sys.executable, "-m", "cli.main", "advise", "--from-node", real.node.name,
                           "--metrics-url", f"http://127.0.0.1:{ours.metrics_port}/metrics", "--kinds", "mig",
                           "--kubeconfig", str(real.cluster.kubeconfig)], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "KUBERNETES_SERVICE_HOST": ""})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"advice from a snapshot of node {real.node.name} (http://127.0.0.1:")
    got = rows(done.stdout)
    assert {w: " ".join(r[-3:]) for w, r in got.items()} == {
        "deployment/notebook": "mig 1g.10gb 0.86", "job/train": "mig 1g.20gb 0.25", "pod/infer": "mig 1g.10gb 0.11"}, \
        done.stdout
    assert "snapshot: 5.86 GiB now" in done.stdout


def emitted(real: RealNode, url: str, *flags: str) -> tuple[list[dict[str, Any]], str]:
    done = advise(real, url, *FLAGS, "--emit", "templates", *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d], done.stdout


def kubectl_apply(real: RealNode, objects: list[dict[str, Any]], tmp: Path) -> None:
    assert real.cluster is not None
    path = tmp / "advised.yaml"
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    real.cluster.kubectl("apply", "-f", str(path))


def probe_pod(real: RealNode, name: str, template_name: str) -> Any:
    assert real.kube is not None and real.node is not None
    create(real.kube, NS, pod_spec(name, template_name, real.node.name, None, "Never"))
    real.wait_running(NS, name, 120)
    return real.view(NS, name, "cuda")


def test_the_emitted_templates_schedule_and_run_with_the_advised_device(
        real: RealNode, prom: prometheus.Prometheus, tmp_path: Path) -> None:
    assert real.kube is not None and real.cluster is not None
    mig, mig_text = emitted(real, prom.url, "--kinds", "mig")
    shares, _ = emitted(real, prom.url)
    slots, _ = emitted(real, prom.url, "--kinds", "slot")
    assert [o["metadata"]["name"] for o in mig] == ["notebook-gpu-1g10gb", "train-gpu-1g20gb", "infer-slot-1g10gb"]
    assert [o["metadata"]["name"] for o in shares] == ["notebook-gpu-share-8gi", "train-gpu-share-15gi",
                                                       "infer-slot-share-4gi"]
    assert [o["metadata"]["name"] for o in slots] == ["notebook-gpu-mps-slot", "train-gpu-mps-slot"]
    kubectl_apply(real, mig + shares + slots, tmp_path)
    # The Job and the bare pod are done with: the GPUs of the MPS slot and the 3g.40gb are free again.
    real.kube.request("DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/train",
                      body={"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Foreground"})
    real.delete_pod(NS, "infer")
    wait_until(lambda: not real.kube.list(f"/api/v1/namespaces/{NS}/pods", label_selector="app=train")["items"],
               60, "the Job's pod to be gone")
    # An MPS slot (GPU 1 has them, and no MIG device while a slot is out) and a memory share (GPU 3).
    slot = probe_pod(real, "probe-slot", "notebook-gpu-mps-slot")
    assert slot.env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == "25", slot.summary()
    claim = real.claim_of(NS, real.pod(NS, "probe-slot"), "gpu")
    assert "-slot-" in claim["status"]["allocation"]["devices"]["results"][0]["device"]
    share = probe_pod(real, "probe-share", "notebook-gpu-share-8gi")
    claim = real.claim_of(NS, real.pod(NS, "probe-share"), "gpu")
    result, = claim["status"]["allocation"]["devices"]["results"]
    assert result["device"].endswith("-shared") and result["consumedCapacity"] == {"memory": "8Gi"}
    assert share.env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") == "0=8192M", share.summary()
    real.delete_pod(NS, "probe-slot")
    # The Deployment switched with the patch advise printed: its new pod holds its 6000 MiB on a 1g.10gb.
    patch, = [line[len("# then: "):] for line in mig_text.splitlines() if line.startswith("# then: kubectl")]
    words = shlex.split(patch)
    assert words[:5] == ["kubectl", "-n", NS, "patch", "deployment/notebook"]
    real.cluster.kubectl(*words[1:])

    def switched() -> str | None:
        pods = real.kube.list(f"/api/v1/namespaces/{NS}/pods", label_selector="app=notebook")["items"]
        ready = [p["metadata"]["name"] for p in pods if p["spec"]["resourceClaims"][0].get(
            "resourceClaimTemplateName") == "notebook-gpu-1g10gb" and "alloc: 6000 MiB" in log(
            real, p["metadata"]["name"])]
        return ready[0] if ready and len(pods) == 1 else None

    new = wait_until(switched, 120, "the Deployment's new pod on its 1g.10gb, holding its 6000 MiB", interval=1.0)
    assert "cuda: device 0 MIG-" in log(real, new) and " 9984 MiB " in log(real, new), log(real, new)
    # The Job and the pod would be created again with theirs: a pod of each template sees its MIG device.
    for name, tpl, mib in (("probe-train", "train-gpu-1g20gb", 20096), ("probe-infer", "infer-slot-1g10gb", 9984)):
        view = probe_pod(real, name, tpl)
        assert [(d.uuid[:4], d.memory_mib) for d in view.cuda] == [("MIG-", mib)], view.summary()
    same_as_documented(mig_text, 1)


def test_bad_input_is_one_line_and_its_exit_status(real: RealNode, ours: LocalNodePlugin,
                                                    prom: prometheus.Prometheus) -> None:
    wrong = advise(real, f"{prom.url}/nothing")
    assert wrong.returncode == 8 and wrong.stdout == "" and wrong.stderr.count("\n") == 1, wrong.stderr
    assert wrong.stderr.startswith(f"gpu-dra advise: {prom.url}/nothing is not a Prometheus HTTP API (POST "
                                   "/api/v1/query answered 4"), wrong.stderr
    assert wrong.stderr.endswith(" - --prometheus takes the server's base URL, e.g. "
                                 "http://prometheus.monitoring:9090\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    away = advise(real, f"http://127.0.0.1:{closed}")
    assert (away.returncode, away.stderr) == (8, f"gpu-dra advise: cannot reach Prometheus at http://127.0.0.1:"
                                                 f"{closed}: connection refused - is the URL right and the server "
                                                 "up?\n")
    none = advise(real, prom.url, "-n", "nobody-here")
    assert none.returncode == 1 and none.stderr.count("\n") == 1 and "has no gpu_dra_claim_gpu_memory_used_bytes " \
        "series of namespace nobody-here in the last 7d" in none.stderr
    # The plugin stops answering for 12 s: Prometheus cannot scrape it, and the window has a gap.
    assert ours.proc is not None
    os.kill(ours.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(12)
    finally:
        os.kill(ours.proc.pid, signal.SIGCONT)
    wait_until(lambda: prom.query("count_over_time(up{job='gpu-dra-kubelet-plugin'}[8s]) > 0 and "
                                  "min_over_time(up{job='gpu-dra-kubelet-plugin'}[5s]) == 1"), 60,
               "scrapes of the plugin again", interval=1.0)
    gap = advise(real, prom.url, "--window", "3m", "--max-gap", "6s", "--min-samples", "1", "--min-span", "1s")
    assert gap.returncode == 3, gap.stdout + gap.stderr
    line, = gap.stderr.splitlines()
    assert line.startswith(f"gpu-dra advise: the window has a gap: no samples from the plugin at 127.0.0.1:"
                           f"{ours.metrics_port} between "), line
    assert line.endswith(": a peak there is not seen") and "advice from Prometheus" in gap.stdout
