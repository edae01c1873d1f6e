"""Per-claim GPU metrics: who uses how much of each prepared device, down to the container.

At every scrape (a prometheus_client collector on the plugin's registry):

1. the prepared claims (the checkpoint) give each device's NVML target (the GPU, or the MIG device through its
   own handle), its physical GPU, MIG profile and sharing (none, time-slicing, mps, share), and the pods the claim
   was reserved for when it was prepared (``status.reservedFor``: pod name and UID, in the claim's namespace);
2. the kubelet's PodResources ``List`` (``kube.podresources``) says which containers (pod namespace and name,
   container name) hold which of these claims' devices: one series per pod and NVML target, also while no
   process runs;
3. NVML lists the processes on each target (``nvmlDeviceGetComputeRunningProcesses`` and, for MPS clients,
   ``nvmlDeviceGetMPSComputeRunningProcesses``) with their memory, and ``nvmlDeviceGetProcessUtilization``
   their latest utilisation samples;
4. each process's cgroup (``dra.node.containers``) names its pod's UID, which a process cannot change; the
   reservedFor pods name that UID's pod (a UID names one pod for ever). A pod that shares a claim prepared for
   another pod is not in the record (the kubelet prepares a claim once), so a process whose pod UID no claim
   names has the claims on its target read again from the API server (``read_claim``, each claim at most every
   ``reread_interval`` seconds).
5. The process counts for the series of its pod on its target. On a shared GPU (slots, shares, MPS) several
   pods' processes run on one target: they are told apart this way, never by name.

Nothing on the node names a container by its ID (PodResources names containers, the cgroup has only their IDs),
so within one pod a process is placed by the devices its containers hold: when one container of the pod holds
devices on the process's target, its series is exact. When several do (two containers referencing one claim, or
holding two claims' slots of one GPU), or one container holds two devices on the target, the process cannot be
told apart between them: the pod then has one series on that target whose labels that differ between those
containers and devices are joined with ``|`` (``container="main|sidecar"``, and ``device``, ``claim`` or
``request`` likewise when they differ), sorted. Its figures are the sum of all of them, and no series of one
of those containers alone is exported, since its share is not known.

A process in no pod, in a pod that no prepared claim is reserved for, or in a pod that holds no claim device on
its target (an MPS server, a host program, a container given the GPU some other way) is counted in
``gpu_dra_gpu_unattributed_processes`` per GPU. A container of a pod that holds a claim device on the target and
was given the GPU some other way as well cannot be told from its pod's other containers: it counts for the pod's
series on that target. A source that fails (the socket, NVML, a claim read from the API server) is counted in
``gpu_dra_claim_metrics_errors_total`` and the scrape goes on without what it would have given.

Labels: the workload's ``namespace``, ``pod`` and ``container``, as the DCGM exporter, cAdvisor and
kube-state-metrics name them (so a scrape keeps them with ``honor_labels``; docs/operations.md), and the DCGM
exporter's GPU labels with its values, ``Hostname`` (the node), ``gpu`` (the NVML index), ``UUID`` (the physical
GPU, a MIG device's parent) and ``modelName`` (NVML's product name), so a query joins DCGM's series on them.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from dra.model.devices import KIND_MIG, KIND_SHARED, Device
from dra.node.checkpoint import ClaimRecord
from dra.node.containers import container_of
from kube.podresources import ContainerDevice, PodResourcesError
from kubeletplugin.claims import ClaimError, reserved_pods

log = structlog.get_logger("claim-metrics")

# The labels of one device of one claim, then of its physical GPU (GPU_LABELS: the DCGM exporter's names).
GPU_LABELS = ("Hostname", "gpu", "UUID", "modelName")
LABELS = ("namespace", "pod", "container", "claim", "request", "device", "gpu_uuid", "mig_profile", "sharing",
          *GPU_LABELS)
UNATTRIBUTED_LABELS = ("gpu_uuid", *GPU_LABELS)
UTILIZATION_WINDOW_S = 30.0     # samples older than this are not "now"
ERROR_SOURCES = ("podresources", "nvml", "apiserver")
JOINED = "|"                    # between the values of containers (devices) a process cannot be told apart among


@dataclass(frozen=True)
class ClaimDevice:
    """One prepared device of one claim, with what its series are labelled by."""

    claim_namespace: str
    claim: str
    request: str
    device: str
    target_uuid: str            # what NVML is asked about: the MIG device for a MIG partition, else the GPU
    gpu_uuid: str               # the physical GPU
    mig_profile: str
    sharing: str                # none | time-slicing | mps | share
    claim_uid: str = ""
    reserved_for: tuple[tuple[str, str], ...] = ()   # (pod name, pod UID) as recorded at prepare
    gpu_index: int = -1         # the physical GPU's NVML index (DCGM's ``gpu``)
    model_name: str = ""        # its product name (DCGM's ``modelName``)


@dataclass
class _Usage:
    processes: int = 0
    memory_bytes: int = 0
    sm_percent: int = 0
    memory_percent: int = 0


def sharing_of(device: Device, record: ClaimRecord, uuid: str) -> str:
    if device.kind == KIND_SHARED:
        return "share"
    if device.sharing != "none":
        return device.sharing                          # a slot: its GPU's strategy
    if any(m.device == uuid for m in record.undo.mps_devices):
        return "mps"                                   # a whole GPU or MIG device shared through its claim's config
    if any(uuid in t.gpu_uuids for t in record.undo.time_slices):
        return "time-slicing"
    return "none"


def claim_devices(records: Iterable[ClaimRecord], devices: Mapping[str, Device], pool: str) -> list[ClaimDevice]:
    """The prepared (completed) claims' devices of this pool that the device model still knows."""
    out = []
    for record in records:
        if not record.completed:
            continue
        for prepared in record.devices:
            device = devices.get(prepared.device)
            if prepared.pool != pool or device is None:
                continue
            target = prepared.uuid or (device.mig_uuid if device.kind == KIND_MIG else device.gpu_uuid)
            if not target:
                continue
            out.append(ClaimDevice(record.namespace, record.name, ",".join(prepared.requests), prepared.device,
                                   target, device.gpu_uuid, device.mig_profile_name or "",
                                   sharing_of(device, record, target), record.uid,
                                   tuple((p.name, p.uid) for p in record.reserved_for), device.gpu_index,
                                   product_name(device)))
    return out


def product_name(device: Device) -> str:
    """The GPU's product name as published (``productName``, NVML's name: DCGM's ``modelName``)."""
    value = device.attributes.get("productName", {}).get("string")
    return value if isinstance(value, str) else ""


def joined_labels(members: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    """One label tuple for several that a process cannot be told apart among: each position's values, sorted and
    joined with ``|`` where they differ (a Kubernetes name never holds ``|``)."""
    return tuple(JOINED.join(sorted(set(values))) for values in zip(*members))


class PodsByUid:
    """Pod UID → (namespace, name), from the pods the prepared claims are reserved for: as recorded at prepare,
    and as read again from the API server for claims on a target where a process of an unknown pod runs."""

    def __init__(self, read_claim: Callable[[str, str, str], Mapping[str, Any]] | None, *, min_interval: float,
                 clock: Callable[[], float]) -> None:
        self._read_claim = read_claim
        self.min_interval = min_interval
        self._clock = clock
        self._read: dict[str, tuple[tuple[str, str], ...]] = {}    # claim UID → reservedFor as last read
        self._read_at: dict[str, float] = {}

    def known(self, prepared: Iterable[ClaimDevice]) -> dict[str, tuple[str, str]]:
        """The pods of the prepared claims; forgets the reads of claims no longer prepared."""
        claims = {d.claim_uid: d for d in prepared}
        for uid in set(self._read) - set(claims):
            del self._read[uid]
        for uid in set(self._read_at) - set(claims):
            del self._read_at[uid]
        out: dict[str, tuple[str, str]] = {}
        for uid, d in claims.items():
            for name, pod_uid in (*d.reserved_for, *self._read.get(uid, ())):
                out[pod_uid] = (d.claim_namespace, name)
        return out

    def read_again(self, claims: Iterable[ClaimDevice]) -> tuple[dict[str, tuple[str, str]], list[str]]:
        """Reads the claims not read within ``min_interval``: (their pods' UIDs, the reads that failed)."""
        found: dict[str, tuple[str, str]] = {}
        failed: list[str] = []
        if self._read_claim is None:
            return found, failed
        for d in {c.claim_uid: c for c in claims}.values():
            last = self._read_at.get(d.claim_uid)
            if last is not None and self._clock() - last < self.min_interval:
                continue
            self._read_at[d.claim_uid] = self._clock()
            try:
                claim = self._read_claim(d.claim_namespace, d.claim, d.claim_uid)
            except ClaimError as err:
                failed.append(str(err))
                continue
            self._read[d.claim_uid] = tuple(reserved_pods(claim))
            found.update({uid: (d.claim_namespace, name) for name, uid in self._read[d.claim_uid]})
        return found, failed


class ClaimMetricsCollector(Collector):
    """claim_devices:   the prepared claim devices now (see ``claim_devices``)
    pod_resources:   the kubelet's answer for this driver (``PodResourcesClient.list``)
    read_claim:      a ResourceClaim from the API server by namespace, name and UID (``ClaimSource.get_claim``);
                     None: only the pods recorded at prepare are known
    nvml:            pynvml's API (or the simulated one)
    node_name:       the node, every series' ``Hostname``"""

    def __init__(self, *, nvml: Any, claim_devices: Callable[[], list[ClaimDevice]],
                 pod_resources: Callable[[], list[ContainerDevice]],
                 read_claim: Callable[[str, str, str], Mapping[str, Any]] | None,
                 registry: CollectorRegistry, proc_root: Path | str = "/proc",
                 clock: Callable[[], float] = time.time, reread_interval: float = 10.0,
                 monotonic: Callable[[], float] = time.monotonic, node_name: str = "") -> None:
        self.nvml = nvml
        self.node_name = node_name
        self._claim_devices = claim_devices
        self._pod_resources = pod_resources
        self._pods = PodsByUid(read_claim, min_interval=reread_interval, clock=monotonic)
        self.proc_root = Path(proc_root)
        self._clock = clock
        self._lock = threading.Lock()
        # Counted here and reported by this collector, so a scrape shows the failures of that same scrape.
        self.errors: dict[str, int] = {source: 0 for source in ERROR_SOURCES}
        registry.register(self)

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield from self._families()

    @staticmethod
    def _families() -> tuple[Any, ...]:
        return (
            GaugeMetricFamily("gpu_dra_claim_gpu_memory_used_bytes", "GPU memory used by a container's processes "
                              "on one device of a ResourceClaim (NVML, per process, summed).", labels=LABELS),
            GaugeMetricFamily("gpu_dra_claim_gpu_sm_utilization_percent", "SM utilisation of a container's "
                              "processes on one device of a ResourceClaim (NVML process samples, summed, at "
                              "most 100; average it over devices).",
                              labels=LABELS),
            GaugeMetricFamily("gpu_dra_claim_gpu_memory_utilization_percent", "Memory bandwidth utilisation of a "
                              "container's processes on one device of a ResourceClaim (NVML process samples).",
                              labels=LABELS),
            GaugeMetricFamily("gpu_dra_claim_gpu_processes", "Processes of a container on one device of a "
                              "ResourceClaim (0 while it runs none).", labels=LABELS),
            GaugeMetricFamily("gpu_dra_gpu_unattributed_processes", "Processes on a GPU of this driver that are "
                              "in no container holding a claim device on it (0: none).", labels=UNATTRIBUTED_LABELS),
            CounterMetricFamily("gpu_dra_claim_metrics_errors", "Sources of the per-claim GPU metrics that failed "
                                "at a scrape, by source (podresources, nvml, apiserver).", labels=["source"]),
        )

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self._lock:
            usage, unattributed = self._gather()
            errors = dict(self.errors)
        memory, sm, mem_util, procs, loose, failed = self._families()
        for labels, u in sorted(usage.items()):
            memory.add_metric(labels, u.memory_bytes)
            sm.add_metric(labels, min(u.sm_percent, 100))
            mem_util.add_metric(labels, min(u.memory_percent, 100))
            procs.add_metric(labels, u.processes)
        for gpu_labels, count in sorted(unattributed.items()):
            loose.add_metric(gpu_labels, count)
        for source, count in errors.items():
            failed.add_metric([source], count)
        yield from (memory, sm, mem_util, procs, loose, failed)

    # ----- one scrape -------------------------------------------------------------------------------------------
    def _gather(self) -> tuple[dict[tuple[str, ...], _Usage], dict[tuple[str, ...], int]]:
        prepared = self._claim_devices()
        if not prepared:
            return {}, {}
        try:
            rows = self._pod_resources()
        except PodResourcesError as err:
            self.errors["podresources"] += 1
            log.warning("per-claim GPU metrics: no PodResources answer", error=str(err))
            return {}, {}
        by_claim_device = {(d.claim_namespace, d.claim, d.device): d for d in prepared}
        # (target, namespace, pod) → (container, claim, request, device, gpu, profile, sharing) its containers hold
        held: dict[tuple[str, str, str], set[tuple[str, ...]]] = defaultdict(set)
        for row in rows:
            d = by_claim_device.get((row.claim_namespace, row.claim_name, row.device))
            if d is None:
                continue   # another pool's device, or a claim not prepared here (any more)
            held[(d.target_uuid, row.namespace, row.pod)].add(
                (row.container, d.claim, d.request, d.device, d.gpu_uuid, d.mig_profile, d.sharing))
        # Each physical GPU's labels (GPU_LABELS), the same for every target on it.
        gpus = {d.gpu_uuid: (self.node_name, str(d.gpu_index), d.gpu_uuid, d.model_name) for d in prepared}
        gpu_of_target = {d.target_uuid: d.gpu_uuid for d in prepared}
        # One series per pod and target: its processes there cannot be told apart any finer (module docstring).
        series = {key: (key[1], key[2], *joined_labels(members), *gpus[gpu_of_target[key[0]]])
                  for key, members in held.items()}
        usage: dict[tuple[str, ...], _Usage] = {labels: _Usage() for labels in series.values()}
        pods = self._pods.known(prepared)
        # Every GPU with a prepared claim device has its count, 0 included (a panel shows "none", not nothing).
        unattributed: dict[tuple[str, ...], int] = {(gpu, *labels): 0 for gpu, labels in gpus.items()}
        targets = sorted({(d.target_uuid, d.gpu_uuid) for d in prepared})
        for target, gpu in targets:
            for pid, used in self._processes(target).items():
                pod = self._pod_of(pid, target, pods, prepared)
                labels = series.get((target, *pod)) if pod else None
                if labels is None:
                    unattributed[(gpu, *gpus[gpu])] += 1
                    continue
                u = usage[labels]
                u.processes += 1
                u.memory_bytes += used[0]
                u.sm_percent += used[1]
                u.memory_percent += used[2]
        return usage, unattributed

    def _pod_of(self, pid: int, target: str, pods: dict[str, tuple[str, str]],
                prepared: list[ClaimDevice]) -> tuple[str, str] | None:
        """(namespace, pod) of a host process, by its cgroup's pod UID; `pods` learns what a read finds."""
        cg = container_of(pid, self.proc_root)
        if cg is None:
            return None
        if cg.pod_uid not in pods:
            found, failed = self._pods.read_again(d for d in prepared if d.target_uuid == target)
            pods.update(found)
            for error in failed:   # the scrape goes on without this process's pod
                self.errors["apiserver"] += 1
                log.warning("per-claim GPU metrics: cannot read a claim's reservedFor", error=error)
        return pods.get(cg.pod_uid)

    def _processes(self, uuid: str) -> dict[int, tuple[int, int, int]]:
        """pid → (memory bytes, SM %, memory %) on one NVML device; {} when NVML cannot say (counted)."""
        nvml = self.nvml
        infos: list[Any] = []
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            infos += nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            # MPS clients: a driver without the query (or without MPS here) simply has none to report.
            try:
                infos += nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)
            except nvml.NVMLError as err:
                if err.value not in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                    raise
        except nvml.NVMLError as err:
            self.errors["nvml"] += 1
            log.warning("per-claim GPU metrics: NVML cannot list the processes", device=uuid, error=str(err))
            return {}
        out: dict[int, tuple[int, int, int]] = {}
        for info in infos:
            used = info.usedGpuMemory if isinstance(info.usedGpuMemory, int) else 0   # None: not available
            prev = out.get(int(info.pid), (0, 0, 0))
            out[int(info.pid)] = (prev[0] + used, 0, 0)
        if not out:
            return out
        since = int((self._clock() - UTILIZATION_WINDOW_S) * 1e6)
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, since)
        except nvml.NVMLError:
            samples = []    # NOT_FOUND: no samples in the window; NOT_SUPPORTED: this GPU keeps none
        latest: dict[int, Any] = {}
        for s in samples:
            if int(s.pid) in out and (int(s.pid) not in latest or s.timeStamp > latest[int(s.pid)].timeStamp):
                latest[int(s.pid)] = s
        for pid, s in latest.items():
            out[pid] = (out[pid][0], int(s.smUtil), int(s.memUtil))
        return out
