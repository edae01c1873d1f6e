"""Benchmark ``scheduler``: the real kube-scheduler allocating claims from a published fleet, for each device-model
shape, against the whole-GPU shape in the same run.

For each shape in ``SHAPES`` (one LocalCluster of the pinned binaries each, one after the other; the scheduler's and
controller-manager's API client limits raised to ``CLIENT_QPS``/``CLIENT_BURST`` so that neither waits on its own
throttle): ``sched_nodes`` Nodes are registered (no kubelet: pods only need binding), ``gpu-dra publish --once`` of
the fleet (``sched_nodes`` × 8 H100-80GB under the shape's node policy) is timed, the scheduler is given time to
take the slices in (its CPU falls quiet), then ``sched_pods`` pods are created in batches of ``BATCH`` (each batch
by ``CREATORS`` threads, the next batch right after), each with one claim from a ResourceClaimTemplate of the
shape's claim mix, using the chart's DeviceClasses. A watch of bound pods (``spec.nodeName`` set) gives each pod's
create → scheduled time (client clock: from its POST being sent to the watch event arriving).

A shape may instead describe another driver's device model (``Shape.peer``): ``NVIDIA`` publishes, for the same
GPUs, what NVIDIA's DRA driver publishes with dynamic MIG (bench/nvidia.py), its slices POSTed by this benchmark
and its pods claiming through NVIDIA's DeviceClasses.

Figures per shape: pods bound per second (all pods over first POST → last bind), create → scheduled p50/p99, the
scheduler's CPU per pod (utime + stime of kube-scheduler from /proc over the pod phase), the scheduler's and API
server's peak RSS (VmHWM, the whole run), the publish time; for every shape other than ``BASELINE`` its
ratios to the baseline: bound/s, CPU per pod, publish time; and, when ``NVIDIA`` ran, every shape of ours (but
the baseline) as a ratio to it: bound/s, CPU per pod, scheduler RSS.

``sched_shapes`` runs only the named shapes (the baseline always); targets of the others are not judged.

With ``sched_profile_dir`` set, the scheduler's own profiler is read too: a CPU profile over the first
``sched_profile_s`` seconds of the pod phase, the heap once every pod is bound, and /metrics, written as
``<dir>/<shape>-<nodes>n-{cpu,heap}.pb.gz`` and ``-metrics.txt`` (read them with ``go tool pprof -top``).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from api.deviceclasses import device_classes
from bench import nvidia
from bench.core import Figure, Target
from bench.params import Params
from bench.publish import H100_POLICY, publish
from cli.publish_cmd import register_missing_nodes
from kube.client import NODES, SLICES, ApiUnavailable, KubeApi, iter_json_lines
from testbed.localcluster import LocalCluster

NAME = "scheduler"
DESCRIPTION = ("the real kube-scheduler binding pods with claims on a published fleet of nodes × 8 H100, for each "
               "device-model shape against whole GPUs")

DRIVER = "gpu.dra-driver.io"
NAMESPACE = "bench-sched"
GPUS_PER_NODE = 8
CLIENT_QPS = 500           # the scheduler's and controller-manager's API client (defaults 50/100 and 20/30)
CLIENT_BURST = 1000
BATCH = 100                # pods per batch
CREATORS = 8               # threads creating one batch
GIB = float(1 << 30)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# Claim templates (spec.spec of a ResourceClaimTemplate), by name: one device of one of the chart's classes.
TEMPLATES: dict[str, dict[str, Any]] = {
    "gpu": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
    "mig-1g10gb": {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": f"mig.{DRIVER}",
        "selectors": [{"cel": {"expression": f"device.attributes['{DRIVER}'].profile == '1g.10gb'"}}]}}]}},
    "mps-slot": {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": f"slot.{DRIVER}",
        "selectors": [{"cel": {"expression": f"device.attributes['{DRIVER}'].sharing == 'mps'"}}]}}]}},
    # The same two requests as NVIDIA's users write them: its chart's classes, its attribute domain.
    "nvidia-gpu": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": nvidia.GPU_CLASS}}]}},
    "nvidia-mig-1g10gb": {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": nvidia.MIG_CLASS,
        "selectors": [{"cel": {"expression": f"device.attributes['{nvidia.NVIDIA_DRIVER}'].profile == '1g.10gb'"}}]}}]}},
}


@dataclass(frozen=True)
class Shape:
    """A device model as the scheduler sees it: the node policy every node is published with (or a fleet generator
    for anything a policy alone does not say) and the claims the pods make, as template name -> share.

    ``peer``: another driver's device model, measured to compare ours with, not judged by targets of its own;
    ``slices`` turns the fleet document into each node's slice specs, which the benchmark POSTs itself (instead
    of ``gpu-dra publish``), and ``classes`` are the DeviceClasses its claims use (default: our chart's)."""

    policy: dict[str, Any]
    mix: dict[str, float]
    what: str
    fleet: Callable[[int], dict[str, Any]] | None = None   # nodes -> fleet document; default: fleet_doc(policy)
    slices: Callable[[dict[str, Any]], Iterator[tuple[str, list[dict[str, Any]]]]] | None = None
    classes: Callable[[], list[dict[str, Any]]] | None = None
    peer: bool = False

    def fleet_doc(self, nodes: int) -> dict[str, Any]:
        if self.fleet is not None:
            return self.fleet(nodes)
        return {"nodes": [{"name": node_name(i), "gpus": [{"model": "H100-80GB", "count": GPUS_PER_NODE}],
                           "policy": self.policy} for i in range(nodes)]}


# The shapes measured, in the order they run; each other shape is compared with BASELINE, and each of ours with
# NVIDIA. A new device model is one entry here (and its targets in bench/targets.yaml).
BASELINE = "whole"
NVIDIA = "nvidia-dynmig"
SHAPES: dict[str, Shape] = {
    "whole": Shape({"default": {"wholeGpu": True}}, {"gpu": 1.0}, "whole GPUs only (8 devices per node)"),
    "rich": Shape(H100_POLICY, {"gpu": 0.4, "mig-1g10gb": 0.4, "mps-slot": 0.2},
                  "whole GPU + dynamic MIG + 4 MPS slots per GPU (240 devices per node); "
                  "claims 40 % whole GPU, 40 % MIG 1g.10gb, 20 % MPS slot"),
    # The rich policy limited to the MIG profile the cluster uses (node policy dynamicMig.profiles, what
    # `gpu-dra convert --dynamic-mig` writes for a mig-parted config naming 1g.10gb): 96 devices per node.
    "used": Shape({"default": {**H100_POLICY["default"], "dynamicMig": {"profiles": ["1g.10gb"]}}},
                  {"gpu": 0.4, "mig-1g10gb": 0.4, "mps-slot": 0.2},
                  "as rich, dynamic MIG limited to the profile the claims use (dynamicMig.profiles: [1g.10gb]; "
                  "96 devices per node)"),
    # As used, with each GPU's 4 MPS slots published as one device with consumable capacity slots: 4 (node policy
    # slots.layout: capacity): 72 devices per node.
    "capacity": Shape({"default": {**H100_POLICY["default"], "dynamicMig": {"profiles": ["1g.10gb"]},
                                   "slots": {**H100_POLICY["default"]["slots"], "layout": "capacity"}}},
                      {"gpu": 0.4, "mig-1g10gb": 0.4, "mps-slot": 0.2},
                      "as used, the 4 MPS slots of a GPU as one device with capacity slots: 4 "
                      "(slots.layout: capacity; 72 devices per node)"),
    # As capacity, with the one MIG profile as one device with consumable capacity instances: 7 too (node policy
    # dynamicMig.layout: capacity, what `gpu-dra convert --dynamic-mig --mig-capacity` writes): 24 devices per node.
    "capacity-mig": Shape({"default": {**H100_POLICY["default"],
                                       "dynamicMig": {"profiles": ["1g.10gb"], "layout": "capacity"},
                                       "slots": {**H100_POLICY["default"]["slots"], "layout": "capacity"}}},
                          {"gpu": 0.4, "mig-1g10gb": 0.4, "mps-slot": 0.2},
                          "as capacity, the 1g.10gb profile of a GPU as one device with capacity instances: 7 "
                          "(dynamicMig.layout: capacity; 24 devices per node)"),
    # What NVIDIA's DRA driver offers with dynamic MIG (which it cannot combine with MPS), in our default layout:
    # the whole GPU and every profile at every placement, 26 devices per GPU. Compared with NVIDIA below.
    "dynmig": Shape({"default": {"mig": "dynamic"}}, {"gpu": 0.5, "mig-1g10gb": 0.5},
                    "whole GPU + dynamic MIG, every profile at every placement (208 devices per node); "
                    "claims 50 % whole GPU, 50 % MIG 1g.10gb"),
    # The same GPUs as NVIDIA's driver publishes them with its DynamicMIG gate (bench/nvidia.py): 208 devices and 8
    # counter sets per node in 9 slices; the same claims through NVIDIA's classes.
    NVIDIA: Shape({"default": {"mig": "dynamic"}}, {"nvidia-gpu": 0.5, "nvidia-mig-1g10gb": 0.5},
                  "NVIDIA's DRA driver with DynamicMIG: whole GPU + every MIG placement, each a partitionable device "
                  "(208 devices per node, a counter set of 15 counters per GPU); claims as dynmig, through "
                  "gpu.nvidia.com and mig.nvidia.com",
                  slices=nvidia.fleet_slice_specs, classes=nvidia.device_classes, peer=True),
}


def node_name(i: int) -> str:
    return f"sched-{i:04d}"


def check_shapes(shapes: Mapping[str, Shape]) -> None:
    """Every shape's mix names known templates with shares summing to 1, and the baseline is among them."""
    if BASELINE not in shapes:
        raise ValueError(f"the shapes must include the baseline {BASELINE!r}")
    for name, shape in shapes.items():
        unknown = sorted(set(shape.mix) - set(TEMPLATES))
        if unknown:
            raise ValueError(f"shape {name}: unknown claim template(s) {unknown}; known: {sorted(TEMPLATES)}")
        if any(share <= 0 for share in shape.mix.values()) or abs(sum(shape.mix.values()) - 1.0) > 1e-9:
            raise ValueError(f"shape {name}: claim shares must be positive and sum to 1, got {shape.mix}")
    if shapes[BASELINE].peer:
        raise ValueError(f"the baseline {BASELINE!r} must be one of our shapes")


def select_shapes(shapes: Mapping[str, Shape], names: Sequence[str] | None) -> dict[str, Shape]:
    """The shapes ``names`` asks for (all without it), in table order, the baseline always among them."""
    if names is None:
        return dict(shapes)
    unknown = sorted(set(names) - set(shapes))
    if unknown:
        raise ValueError(f"unknown scheduler shape(s) {unknown}; known: {', '.join(shapes)}")
    return {name: shape for name, shape in shapes.items() if name == BASELINE or name in names}


def unjudged(targets: Mapping[str, Target], names: Sequence[str] | None) -> set[str]:
    """The keys of ``targets`` that a run of only the shapes ``names`` cannot answer: those of the shapes left
    out, and every comparison with NVIDIA when it is left out."""
    if names is None:
        return set()
    ran = set(select_shapes(SHAPES, names))
    out = set()
    for key in targets:
        bench, _, rest = key.partition(".")
        if bench != NAME:
            continue
        shape, _, what = rest.rpartition(".")
        if shape in SHAPES and (shape not in ran or (what.startswith("nvidia_") and NVIDIA not in ran)):
            out.add(key)
    return out


def assign_templates(mix: Mapping[str, float], pods: int) -> list[str]:
    """The template of each pod: interleaved so that every prefix follows the mix as closely as it can (smooth
    weighted round-robin), so each batch and the run's tail ask for the same kinds as the whole."""
    given = dict.fromkeys(mix, 0)
    out = []
    for i in range(pods):
        name = max(mix, key=lambda t: mix[t] * (i + 1) - given[t])
        given[name] += 1
        out.append(name)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not within 0..100")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def metric_sums(text: str, name: str, label: str, where: Mapping[str, str] | None = None) -> dict[str, tuple[float, float]]:
    """From Prometheus text: ``label`` value -> (sum, count) of histogram ``name`` over the series whose labels
    include ``where``."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for suffix, idx in (("_sum", 0), ("_count", 1)):
            head = f"{name}{suffix}{{"
            if not line.startswith(head):
                continue
            labels_text, _, value = line[len(head):].rpartition("} ")
            labels = dict(part.split("=", 1) for part in _split_labels(labels_text))
            labels = {k: v.strip('"') for k, v in labels.items()}
            if where and any(labels.get(k) != v for k, v in where.items()):
                continue
            key = labels.get(label, "")
            out.setdefault(key, [0.0, 0.0])[idx] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def metric_values(text: str, name: str, label: str, where: Mapping[str, str] | None = None) -> dict[str, float]:
    """From Prometheus text: ``label`` value -> value of counter or gauge ``name``, summed over the series whose
    labels include ``where``."""
    out: dict[str, float] = {}
    head = f"{name}{{"
    for line in text.splitlines():
        if not line.startswith(head):
            continue
        labels_text, _, value = line[len(head):].rpartition("} ")
        labels = {k: v.strip('"') for k, v in (part.split("=", 1) for part in _split_labels(labels_text))}
        if where and any(labels.get(k) != v for k, v in where.items()):
            continue
        out[labels.get(label, "")] = out.get(labels.get(label, ""), 0.0) + float(value)
    return out


def _split_labels(text: str) -> Iterator[str]:
    part, quoted = "", False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            yield part
            part = ""
        else:
            part += ch
    if part:
        yield part


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def peak_rss(pid: int) -> float:
    """VmHWM in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024.0
    raise RuntimeError(f"no VmHWM for process {pid}")


def wait_quiet(pid: int, timeout: float, busy_share: float = 0.05) -> float:
    """Seconds until the process used less than ``busy_share`` of a CPU over one second (it has taken in what
    it was sent); raises after ``timeout``."""
    start = time.monotonic()
    last = cpu_seconds(pid)
    while time.monotonic() - start < timeout:
        time.sleep(1.0)
        now = cpu_seconds(pid)
        if now - last < busy_share:
            return time.monotonic() - start
        last = now
    raise RuntimeError(f"process {pid} still busy {timeout:.0f} s after the fleet was published")


@dataclass
class ShapeRun:
    """What one shape's run measured."""

    shape: str
    nodes: int
    devices: int
    slices: int
    publish_s: float
    settle_s: float
    pods: int
    span_s: float                       # first POST sent -> last pod bound
    latencies_s: list[float]
    sched_cpu_s: float                  # over the pod phase
    sched_rss: float
    apiserver_rss: float
    etcd_rss: float
    dra_plugin: dict[str, tuple[float, float]] = field(default_factory=dict)   # extension point -> (sum s, count)
    extension_points: dict[str, tuple[float, float]] = field(default_factory=dict)
    dra_evaluations: dict[str, float] = field(default_factory=dict)           # extension point -> calls
    allocation_bytes: float = 0.0       # mean JSON size of a claim's status.allocation

    @property
    def bound_per_s(self) -> float:
        return self.pods / self.span_s

    @property
    def cpu_ms_per_pod(self) -> float:
        return self.sched_cpu_s * 1000 / self.pods


class BindWatch:
    """Watches the namespace's bound pods (field selector spec.nodeName set) and notes when each was first seen."""

    def __init__(self, kube: KubeApi, expected: int) -> None:
        self.kube, self.expected = kube, expected
        self.bound: dict[str, float] = {}
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._stop = threading.Event()
        listed = kube.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods", query={"limit": 1})
        self._rv = listed["metadata"]["resourceVersion"]
        self._thread = threading.Thread(target=self._run, name="bind-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and len(self.bound) < self.expected:
                try:
                    resp = self.kube.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods", stream=True, timeout=90,
                                             query={"watch": 1, "resourceVersion": self._rv, "timeoutSeconds": 60,
                                                    "fieldSelector": "spec.nodeName!=", "allowWatchBookmarks": 1})
                except ApiUnavailable:
                    continue
                try:
                    for event in iter_json_lines(resp):
                        now = time.monotonic()
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            raise RuntimeError(f"pod watch: {obj.get('message', obj)}")
                        self._rv = obj["metadata"]["resourceVersion"]
                        if event["type"] == "ADDED" and obj.get("spec", {}).get("nodeName"):
                            self.bound.setdefault(obj["metadata"]["name"], now)
                            if len(self.bound) >= self.expected:
                                break
                finally:
                    resp.close()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which raises it
            self.error = exc
        finally:
            self.done.set()

    def wait(self, timeout: float) -> None:
        if not self.done.wait(timeout):
            self._stop.set()
            raise RuntimeError(f"{len(self.bound)} of {self.expected} pods bound after {timeout:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"pod watch failed: {self.error}") from self.error


def pod_doc(name: str, template: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "example.invalid/none",
                                     "resources": {"claims": [{"name": "gpu"}]}}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
                     "terminationGracePeriodSeconds": 0}}


def set_up_api(kube: KubeApi, shape: Shape) -> None:
    """The shape's DeviceClasses (our chart's unless it brings its own), the namespace and the claim templates."""
    for cls in (shape.classes() if shape.classes is not None else device_classes(DRIVER)):
        kube.create("/apis/resource.k8s.io/v1/deviceclasses", cls)
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    for name, spec in TEMPLATES.items():
        kube.create(f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaimtemplates",
                    {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
                     "spec": {"spec": spec}})


def create_pods(kube: KubeApi, templates: list[str]) -> dict[str, float]:
    """Creates the pods in batches; returns pod name -> monotonic time its POST was sent."""
    sent: dict[str, float] = {}

    def create(job: tuple[int, str]) -> None:
        name = f"p-{job[0]:05d}"
        sent[name] = time.monotonic()
        kube.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_doc(name, job[1]))

    jobs = list(enumerate(templates))
    with ThreadPoolExecutor(CREATORS) as ex:
        for start in range(0, len(jobs), BATCH):
            list(ex.map(create, jobs[start:start + BATCH]))
    return sent


def claims_summary(kube: KubeApi) -> tuple[int, float]:
    """(allocated claims, mean JSON bytes of their status.allocation)."""
    items = kube.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims",
                         timeout=120)["items"]
    sizes = [len(json.dumps(c["status"]["allocation"], separators=(",", ":"))) for c in items
             if c.get("status", {}).get("allocation")]
    return len(sizes), (sum(sizes) / len(sizes) if sizes else 0.0)


def post_slices(kube: KubeApi, shape: Shape, fleet_doc: dict[str, Any], workers: int) -> float:
    """A peer shape's slices, built before the clock starts and then POSTed by ``workers`` threads; returns the
    seconds the API server took to take them in (what stands for the publish time)."""
    if shape.slices is None:
        raise ValueError("post_slices needs a shape with a slice generator")
    uids = {o["metadata"]["name"]: o["metadata"]["uid"] for o in kube.list_metadata(NODES)["items"]}
    bodies = [obj for node, specs in shape.slices(fleet_doc) for obj in nvidia.slice_objects(node, specs, uids[node])]
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(lambda body: kube.create(SLICES, body), bodies))
    return time.perf_counter() - start


def _progress(line: str) -> None:
    print(f"  scheduler: {line}", file=sys.stderr, flush=True)


def run_shape(name: str, shape: Shape, nodes: int, pods: int, params: Params, work: Path) -> ShapeRun:
    fleet_path = work / f"fleet-{name}.yaml"
    fleet_doc = shape.fleet_doc(nodes)
    fleet_path.write_text(yaml.safe_dump(fleet_doc, sort_keys=False))
    names = [n["name"] for n in fleet_doc["nodes"]]
    templates = assign_templates(shape.mix, pods)
    profile_dir = Path(params.sched_profile_dir) if params.sched_profile_dir else None
    cluster = LocalCluster(workdir=work / f"cluster-{name}", client_qps=CLIENT_QPS, client_burst=CLIENT_BURST,
                           debug_access=True)
    try:
        cluster.start()
        pids = cluster.component_pids()
        sched_pid = pids["kube-scheduler"]
        api = cluster.api_client()
        kube = KubeApi(api, timeout=60)
        set_up_api(kube, shape)
        register_missing_nodes(api, names)
        if shape.slices is not None:
            publish_s = post_slices(kube, shape, fleet_doc, params.publish_workers)
        else:
            publish_s = publish(work, cluster.kubeconfig, fleet_path, params.publish_workers, 120.0 + 10.0 * nodes,
                                name).seconds
        settle_s = wait_quiet(sched_pid, timeout=120.0 + nodes)
        _progress(f"{name}: {nodes} nodes published in {publish_s:.1f} s; scheduler quiet after {settle_s:.0f} s")

        watch = BindWatch(kube, pods)
        profile: dict[str, bytes] = {}
        profiler = None
        if profile_dir is not None:
            def take_profile() -> None:
                profile["cpu"] = cluster.scheduler_get(f"/debug/pprof/profile?seconds={params.sched_profile_s}",
                                                       timeout=params.sched_profile_s + 60)
            profiler = threading.Thread(target=take_profile, name="cpu-profile", daemon=True)
        cpu0 = cpu_seconds(sched_pid)
        if profiler is not None:
            profiler.start()
        sent = create_pods(kube, templates)
        watch.wait(timeout=120.0 + 2.0 * pods)
        cpu1 = cpu_seconds(sched_pid)
        last = max(watch.bound.values())
        latencies = [watch.bound[p] - t for p, t in sent.items()]
        span = last - min(sent.values())
        rss = {c: peak_rss(pids[c]) for c in ("kube-scheduler", "kube-apiserver", "etcd")}
        metrics = cluster.scheduler_get("/metrics").decode()
        allocated, alloc_bytes = claims_summary(kube)
        if allocated != pods:
            raise RuntimeError(f"{name}: {pods} pods bound but {allocated} claims allocated")
        slices = devices = 0
        for item in kube.iter_list(SLICES, page_size=50):    # after the peaks: a page at a time
            slices += 1
            devices += len(item["spec"].get("devices") or [])
        if profile_dir is not None:
            profile_dir.mkdir(parents=True, exist_ok=True)
            stem = f"{name}-{nodes}n"
            if profiler is not None:
                profiler.join(params.sched_profile_s + 90)
            (profile_dir / f"{stem}-heap.pb.gz").write_bytes(cluster.scheduler_get("/debug/pprof/heap"))
            (profile_dir / f"{stem}-metrics.txt").write_text(metrics)
            if "cpu" in profile:
                (profile_dir / f"{stem}-cpu.pb.gz").write_bytes(profile["cpu"])
        result = ShapeRun(
            shape=name, nodes=nodes, devices=devices, slices=slices, publish_s=publish_s, settle_s=settle_s,
            pods=pods, span_s=span, latencies_s=latencies, sched_cpu_s=cpu1 - cpu0, sched_rss=rss["kube-scheduler"],
            apiserver_rss=rss["kube-apiserver"], etcd_rss=rss["etcd"],
            dra_plugin=metric_sums(metrics, "scheduler_plugin_execution_duration_seconds", "extension_point",
                                   {"plugin": "DynamicResources"}),
            extension_points=metric_sums(metrics, "scheduler_framework_extension_point_duration_seconds",
                                         "extension_point"),
            dra_evaluations=metric_values(metrics, "scheduler_plugin_evaluation_total", "extension_point",
                                          {"plugin": "DynamicResources"}),
            allocation_bytes=alloc_bytes)
        _progress(f"{name}: {pods} pods bound in {span:.1f} s ({result.bound_per_s:.1f}/s), p50 "
                  f"{percentile(latencies, 50):.1f} s, p99 {percentile(latencies, 99):.1f} s, scheduler "
                  f"{result.cpu_ms_per_pod:.1f} ms CPU/pod, RSS {result.sched_rss / GIB:.2f} GiB, API server "
                  f"{result.apiserver_rss / GIB:.2f} GiB")
        return result
    finally:
        cluster.stop()


def shape_figures(r: ShapeRun, label: str, posted: bool = False) -> list[Figure]:
    k = f"scheduler.{r.shape}"
    plugin = ", ".join(f"{ep} {s / c * 1000:.2f} ms × {c:.0f}" for ep, (s, c) in sorted(r.dra_plugin.items()) if c)
    points = ", ".join(f"{ep} {s:.1f} s" for ep, (s, c) in sorted(r.extension_points.items()) if s >= 0.05)
    return [
        Figure(f"{k}.bound_per_s", f"{label}: pods bound per second", r.bound_per_s, "pods/s",
               f"{r.pods} pods (batches of {BATCH}) in {r.span_s:.1f} s, first POST sent to last bind seen"),
        Figure(f"{k}.scheduled_p50_s", f"{label}: create → scheduled p50", percentile(r.latencies_s, 50), "s"),
        Figure(f"{k}.scheduled_p99_s", f"{label}: create → scheduled p99", percentile(r.latencies_s, 99), "s",
               f"max {max(r.latencies_s):.1f} s; POST sent to the watch event of the bound pod"),
        Figure(f"{k}.cpu_ms_per_pod", f"{label}: scheduler CPU per pod", r.cpu_ms_per_pod, "ms",
               f"{r.sched_cpu_s:.1f} CPU-s over the pod phase; extension points (all plugins, s): {points or '-'}; "
               f"DynamicResources (sampled): {plugin or '-'}; its Filter ran "
               f"{r.dra_evaluations.get('Filter', 0) / r.pods:.0f}× per pod; "
               f"allocation result {r.allocation_bytes:.0f} B/claim"),
        Figure(f"{k}.scheduler_rss_gib", f"{label}: scheduler RSS", r.sched_rss / GIB, "GiB",
               "VmHWM over the whole run", "peak"),
        Figure(f"{k}.apiserver_rss_gib", f"{label}: API server RSS", r.apiserver_rss / GIB, "GiB",
               f"VmHWM over the whole run; etcd {r.etcd_rss / GIB:.2f} GiB", "peak"),
        Figure(f"{k}.publish_s", f"{label}: " + ("its slices POSTed" if posted else "gpu-dra publish --once"),
               r.publish_s, "s", f"{r.slices} slices; scheduler quiet {r.settle_s:.0f} s after it"),
    ]


def ratio_figures(r: ShapeRun, base: ShapeRun, label: str) -> list[Figure]:
    k = f"scheduler.{r.shape}"
    vs = f"{label} / {BASELINE}"
    return [
        Figure(f"{k}.bound_ratio", f"{vs}: pods bound per second", r.bound_per_s / base.bound_per_s, "×",
               f"{r.bound_per_s:.1f} vs {base.bound_per_s:.1f} pods/s"),
        Figure(f"{k}.cpu_ratio", f"{vs}: scheduler CPU per pod", r.cpu_ms_per_pod / base.cpu_ms_per_pod, "×",
               f"{r.cpu_ms_per_pod:.1f} vs {base.cpu_ms_per_pod:.1f} ms"),
        Figure(f"{k}.rss_ratio", f"{vs}: scheduler RSS", r.sched_rss / base.sched_rss, "×",
               f"{r.sched_rss / GIB:.2f} vs {base.sched_rss / GIB:.2f} GiB"),
        Figure(f"{k}.publish_ratio", f"{vs}: publish time", r.publish_s / base.publish_s, "×",
               f"{r.publish_s:.1f} vs {base.publish_s:.1f} s"),
    ]


def nvidia_figures(r: ShapeRun, peer: ShapeRun, label: str) -> list[Figure]:
    """One of our shapes against NVIDIA's device model in the same run: above 1 ours binds faster (bound), below
    1 ours costs the scheduler less (CPU, RSS)."""
    k = f"scheduler.{r.shape}"
    vs = f"{label} / {peer.shape} ({peer.devices:,} devices)"
    return [
        Figure(f"{k}.nvidia_bound_ratio", f"{vs}: pods bound per second", r.bound_per_s / peer.bound_per_s, "×",
               f"{r.bound_per_s:.1f} vs {peer.bound_per_s:.1f} pods/s"),
        Figure(f"{k}.nvidia_cpu_ratio", f"{vs}: scheduler CPU per pod", r.cpu_ms_per_pod / peer.cpu_ms_per_pod, "×",
               f"{r.cpu_ms_per_pod:.1f} vs {peer.cpu_ms_per_pod:.1f} ms"),
        Figure(f"{k}.nvidia_rss_ratio", f"{vs}: scheduler RSS", r.sched_rss / peer.sched_rss, "×",
               f"{r.sched_rss / GIB:.2f} vs {peer.sched_rss / GIB:.2f} GiB"),
    ]


def figures_of(runs: Mapping[str, ShapeRun], shapes: Mapping[str, Shape] = SHAPES) -> list[Figure]:
    """Every shape's figures, each non-baseline shape's ratios to the baseline of the same run, and each of our
    shapes but the baseline against NVIDIA's when that ran."""
    base = runs[BASELINE]
    peer = runs.get(NVIDIA)
    out: list[Figure] = []
    for name, r in runs.items():
        label = f"{r.nodes} nodes × {GPUS_PER_NODE} H100, {name} ({r.devices:,} devices)"
        ours = not shapes[name].peer
        out += shape_figures(r, label, posted=shapes[name].slices is not None)
        if name != BASELINE:
            out += ratio_figures(r, base, label)
            if ours and peer is not None:
                out += nvidia_figures(r, peer, label)
    return out


def run(params: Params) -> list[Figure]:
    check_shapes(SHAPES)
    shapes = select_shapes(SHAPES, params.sched_shapes)
    nodes, pods = params.sched_nodes, params.sched_pods
    if pods > nodes * GPUS_PER_NODE:
        raise ValueError(f"{pods} pods do not fit {nodes} nodes × {GPUS_PER_NODE} GPUs as whole GPUs")
    work = Path(tempfile.mkdtemp(prefix="gpu-dra-bench-sched-"))
    try:
        runs = {name: run_shape(name, shape, nodes, pods, params, work) for name, shape in shapes.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return figures_of(runs)
