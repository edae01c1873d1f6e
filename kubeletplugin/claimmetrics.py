"""Per-claim GPU metrics: who uses how much of each prepared device, down to the container.

At every scrape (a prometheus_client collector on the plugin's registry):

1. the prepared claims (the checkpoint) give each device's NVML target (the GPU, or the MIG device through its
   own handle), its physical GPU, MIG profile and sharing (none, time-slicing, mps, share);
2. the kubelet's PodResources ``List`` (``kube.podresources``) says which containers hold which of these claims'
   devices: one series per container and device, also while no process runs;
3. NVML lists the processes on each target (``nvmlDeviceGetComputeRunningProcesses`` and, for MPS clients,
   ``nvmlDeviceGetMPSComputeRunningProcesses``) with their memory, and ``nvmlDeviceGetProcessUtilization``
   their latest utilisation samples;
4. each process is put in its container by its cgroup (``dra.node.containers``: pod UID and container ID, which a
   process cannot change) and the node's pod list (``kube.nodepods``: container ID → pod and container name),
   and counted for the claim device of that container on that target. On a shared GPU (slots, shares, MPS)
   several claims' containers run on one target: their processes are told apart this way, never by name.

A process in no container that holds a claim device on its target (an MPS server, a host program, a container
given the GPU some other way) is counted in ``gpu_dra_gpu_unattributed_processes`` per GPU. A source that
fails (the socket, NVML, the API server) is counted in ``gpu_dra_claim_metrics_errors_total`` and the scrape
goes on without what it would have given.
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
from kube.client import ApiError, ApiUnavailable
from kube.podresources import ContainerDevice, PodResourcesError

log = structlog.get_logger("claim-metrics")

LABELS = ("namespace", "pod", "container", "claim", "request", "device", "gpu_uuid", "mig_profile", "sharing")
UTILIZATION_WINDOW_S = 30.0     # samples older than this are not "now"
ERROR_SOURCES = ("podresources", "nvml", "apiserver")


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
                                   sharing_of(device, record, target)))
    return out


class ClaimMetricsCollector(Collector):
    """claim_devices:   the prepared claim devices now (see ``claim_devices``)
    pod_resources:   the kubelet's answer for this driver (``PodResourcesClient.list``)
    pods:            container ID → pod and container (``NodePods.container``)
    nvml:            pynvml's API (or the simulated one)"""

    def __init__(self, *, nvml: Any, claim_devices: Callable[[], list[ClaimDevice]],
                 pod_resources: Callable[[], list[ContainerDevice]], pods: Callable[[str], Any],
                 registry: CollectorRegistry, proc_root: Path | str = "/proc",
                 clock: Callable[[], float] = time.time) -> None:
        self.nvml = nvml
        self._claim_devices = claim_devices
        self._pod_resources = pod_resources
        self._pods = pods
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
                              "processes on one device of a ResourceClaim (NVML process samples, summed).",
                              labels=LABELS),
            GaugeMetricFamily("gpu_dra_claim_gpu_memory_utilization_percent", "Memory bandwidth utilisation of a "
                              "container's processes on one device of a ResourceClaim (NVML process samples).",
                              labels=LABELS),
            GaugeMetricFamily("gpu_dra_claim_gpu_processes", "Processes of a container on one device of a "
                              "ResourceClaim (0 while it runs none).", labels=LABELS),
            GaugeMetricFamily("gpu_dra_gpu_unattributed_processes", "Processes on a GPU of this driver that are "
                              "in no container holding a claim device on it.", labels=["gpu_uuid"]),
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
        for gpu, count in sorted(unattributed.items()):
            loose.add_metric([gpu], count)
        for source, count in errors.items():
            failed.add_metric([source], count)
        yield from (memory, sm, mem_util, procs, loose, failed)

    # ----- one scrape -------------------------------------------------------------------------------------------
    def _gather(self) -> tuple[dict[tuple[str, ...], _Usage], dict[str, int]]:
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
        # (target, namespace, pod, container) → the claim device that container holds on that target
        holders: dict[tuple[str, str, str, str], tuple[str, ...]] = {}
        usage: dict[tuple[str, ...], _Usage] = {}
        for row in sorted(rows, key=lambda r: (r.namespace, r.pod, r.container, r.claim_name, r.device)):
            d = by_claim_device.get((row.claim_namespace, row.claim_name, row.device))
            if d is None:
                continue   # another pool's device, or a claim not prepared here (any more)
            labels = (row.namespace, row.pod, row.container, d.claim, d.request, d.device, d.gpu_uuid,
                      d.mig_profile, d.sharing)
            usage.setdefault(labels, _Usage())
            holders.setdefault((d.target_uuid, row.namespace, row.pod, row.container), labels)
        unattributed: dict[str, int] = defaultdict(int)
        targets = sorted({(d.target_uuid, d.gpu_uuid) for d in prepared})
        for target, gpu in targets:
            processes = self._processes(target)
            for pid, used in processes.items():
                where = self._container(pid)
                labels_of = holders.get((target, *where)) if where else None
                if labels_of is None:
                    unattributed[gpu] += 1
                    continue
                u = usage[labels_of]
                u.processes += 1
                u.memory_bytes += used[0]
                u.sm_percent += used[1]
                u.memory_percent += used[2]
        return usage, dict(unattributed)

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

    def _container(self, pid: int) -> tuple[str, str, str] | None:
        """(namespace, pod, container) of a host process, by its cgroup and the node's pods."""
        cg = container_of(pid, self.proc_root)
        if cg is None:
            return None
        try:
            found = self._pods(cg.container_id)
        except (ApiError, ApiUnavailable) as err:   # the scrape goes on without this process's container
            self.errors["apiserver"] += 1
            log.warning("per-claim GPU metrics: cannot list this node's pods", error=str(err))
            return None
        if found is None or found.pod_uid != cg.pod_uid:
            return None    # not a pod's container (or the pod was replaced by one of the same name)
        return (found.namespace, found.pod, found.container)
