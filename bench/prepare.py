"""Benchmark ``prepare``: NodePrepareResources / NodeUnprepareResources work of the node plugin's ``Driver``,
without gRPC, on a simulated 8 × H200 node (dynamic MIG + 4 MPS slots per GPU) with claims from a dict.

Everything the plugin does for a claim runs for real: checkpoint writes, CDI spec files, MIG devices created in
the simulated NVML, MPS daemons started through the simulated sharing tools, the plugin's metrics and JSON
logs (rendered, then discarded).

* Latency of one claim at a time, for a whole GPU, a dynamic MIG partition and an MPS slot.
* Parallel throughput: 32 independent dynamic-MIG claims (4 per GPU) prepared and unprepared one call at a
  time, then all in one call, as the kubelet does for many pods. Real MIG changes take from tens of
  milliseconds to about a second each, and the simulator answers in microseconds, so here every
  MIG-changing NVML call waits ``nvml_latency_s`` first (outside the simulator's lock, as if in the
  driver). The ratio parallel / serial wall time then shows what the per-GPU locks buy: a node-wide lock
  would give about 1.0.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid as uuidlib
from pathlib import Path
from typing import Any

import structlog

from bench.core import Figure, median, spread
from bench.params import Params
from bench.simfleet import DRIVER, H200_DYNAMIC_POLICY, h200_node
from dra.model.devices import KIND_MIG, build_devices
from dra.model.policy import parse_node_policy
from dra.node import migdevices as hardware
from dra.node.cdi import CdiSpecWriter, ToolkitSpecs
from dra.node.checkpoint import CheckpointStore
from dra.node.inventory import discover
from dra.node.sharing import MpsDaemons, TimeSlicing
from dra.sim.driverroot import SimulatedDriverRoot
from dra.sim.fleet import nvml_for_node
from dra.sim.sharingtools import SimulatedSharingControl
from kubeletplugin.claims import DictClaimSource
from kubeletplugin.driver import Driver
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.transport.nodedriver import ClaimRef

NAME = "prepare"
DESCRIPTION = "Driver prepare/unprepare: one claim (whole GPU, dynamic MIG, MPS slot) and 32 claims in parallel"

# The NVML calls that change MIG state: on real GPUs each takes tens of milliseconds up to about a second.
MIG_CHANGING_CALLS = frozenset({
    "nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstance", "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlGpuInstanceCreateComputeInstance", "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
    "nvmlComputeInstanceDestroy", "nvmlGpuInstanceDestroy",
})


class SlowMigNvml:
    """An NVML library whose MIG-changing calls first wait ``latency_s``; everything else is passed through."""

    def __init__(self, nvml: Any, latency_s: float) -> None:
        self._nvml = nvml
        self._latency_s = latency_s
        self.slow_calls = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._nvml, name)
        if name not in MIG_CHANGING_CALLS:
            return value

        def slow(*args: Any, **kwargs: Any) -> Any:
            self.slow_calls += 1
            time.sleep(self._latency_s)
            return value(*args, **kwargs)

        return slow


def _plugin_log(sink: Any) -> Any:
    """Info-level JSON logs, rendered as the plugin renders them, written to ``sink``."""
    return structlog.wrap_logger(
        structlog.PrintLogger(sink),
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )


class PluginNode:
    """A simulated 8 × H200 node with the plugin's ``Driver`` over a temporary state directory."""

    def __init__(self, base: Path, latency_s: float = 0.0) -> None:
        self.fake = nvml_for_node(h200_node())
        self.fake.nvmlInit()
        self.nvml: Any = SlowMigNvml(self.fake, latency_s) if latency_s > 0 else self.fake
        inventory = discover(self.fake)
        self.model = build_devices(inventory, parse_node_policy(H200_DYNAMIC_POLICY, "benchmark policy"),
                                   driver=DRIVER)
        self.uuids = [g.uuid for g in inventory.gpus]
        self.node_name = "h200-dyn-0"
        self._log_sink = open(os.devnull, "w")  # noqa: SIM115 - closed in close()
        (base / "boot_id").write_text("boot-1\n")
        for d in ("root", "proc", "state", "cdi"):
            (base / d).mkdir()
        root = SimulatedDriverRoot(base / "root", dev_root=base / "root", proc_root=base / "proc",
                                   driver_version=inventory.driver_version)
        control = SimulatedSharingControl(nvml=self.fake)
        self.claims = DictClaimSource()
        self.driver = Driver(
            driver_name=DRIVER, pool_name=self.node_name, devices=self.model.by_name, claims=self.claims,
            checkpoint=CheckpointStore(base / "state" / "checkpoint.json", boot_id_path=base / "boot_id"),
            cdi=CdiSpecWriter(base / "cdi", root, toolkit=ToolkitSpecs([])), nvml=self.nvml,
            mps=MpsDaemons(control, base / "state"), time_slicing=TimeSlicing(control),
            metrics=PluginMetrics(), log=_plugin_log(self._log_sink))
        self.driver.start()

    def claim(self, device: str) -> ClaimRef:
        """A new allocated claim for one device of this node."""
        uid = str(uuidlib.uuid4())
        name = f"bench-{uid[:8]}"
        self.claims.put({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default", "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra-driver.io"}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": self.node_name, "device": device}], "config": []}},
                "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": f"pod-{uid}"}]},
        })
        return ClaimRef(namespace="default", uid=uid, name=name)

    def prepare(self, refs: list[ClaimRef]) -> None:
        out = self.driver.prepare(refs)
        failed = {uid: r.error for uid, r in out.items() if r.error}
        if failed:
            raise AssertionError(f"prepare failed: {failed}")

    def unprepare(self, refs: list[ClaimRef]) -> None:
        out = self.driver.unprepare(refs)
        failed = {uid: r.error for uid, r in out.items() if r.error}
        if failed:
            raise AssertionError(f"unprepare failed: {failed}")

    def mig_devices_left(self) -> int:
        return sum(len(hardware.list_mig_devices(self.fake, u)) for u in self.uuids)

    def close(self) -> None:
        self.driver.close()
        self.fake.nvmlShutdown()
        self._log_sink.close()


def _single_claims(params: Params, node: PluginNode) -> list[Figure]:
    mig = next(d.name for d in node.model.devices if d.kind == KIND_MIG and d.gpu_minor == 1)
    kinds = (("whole", "whole GPU", "gpu-0"), ("mig", "dynamic MIG", mig), ("mps_slot", "MPS slot", "gpu-2-slot-0"))
    figures = []
    for key, text, device in kinds:
        prep: list[float] = []
        unprep: list[float] = []
        for i in range(params.claim_repeats + 1):   # the first round warms up
            ref = node.claim(device)
            t0 = time.perf_counter()
            node.prepare([ref])
            t1 = time.perf_counter()
            node.unprepare([ref])
            t2 = time.perf_counter()
            if i:
                prep.append(t1 - t0)
                unprep.append(t2 - t1)
        figures.append(Figure(f"prepare.{key}.prepare_ms", f"{text} ({device}): prepare one claim",
                              median(prep) * 1000, "ms", spread(prep), "median"))
        figures.append(Figure(f"prepare.{key}.unprepare_ms", f"{text} ({device}): unprepare one claim",
                              median(unprep) * 1000, "ms", spread(unprep), "median"))
    if node.mig_devices_left():
        raise AssertionError("MIG devices left after the single-claim rounds")
    return figures


def independent_mig_devices(node: PluginNode, count: int) -> list[str]:
    """``count`` dynamic MIG partitions that can all exist at once: the smallest plain profile, spread over
    the GPUs round-robin (4 per GPU for 32 claims on 8 GPUs)."""
    per_gpu: dict[int, list[str]] = {}
    for d in node.model.devices:
        if d.kind == KIND_MIG and d.mig_profile_name and "+" not in d.mig_profile_name and d.mig_size == 1:
            per_gpu.setdefault(d.gpu_minor, []).append(d.name)
    minors = sorted(per_gpu)
    out = []
    for i in range(count):
        gpu = per_gpu[minors[i % len(minors)]]
        k = i // len(minors)
        if k >= len(gpu):
            raise ValueError(f"{count} claims need more than {len(gpu)} one-slice partitions per GPU")
        out.append(gpu[k])
    return out


def _round(node: PluginNode, devices: list[str], together: bool) -> float:
    """Wall time to prepare and then unprepare one new claim per device: all in one call each (as the
    kubelet's concurrent calls for many pods), or one claim per call, one after the other."""
    refs = [node.claim(d) for d in devices]
    start = time.perf_counter()
    if together:
        node.prepare(refs)
        node.unprepare(refs)
    else:
        for ref in refs:
            node.prepare([ref])
        for ref in refs:
            node.unprepare([ref])
    return time.perf_counter() - start


def _parallel_claims(params: Params, node: PluginNode) -> list[Figure]:
    devices = independent_mig_devices(node, params.parallel_claims)
    n = len(devices)
    serial: list[float] = []
    parallel: list[float] = []
    for _ in range(max(1, params.parallel_rounds)):
        serial.append(_round(node, devices, together=False))
        parallel.append(_round(node, devices, together=True))
        if node.mig_devices_left():
            raise AssertionError("MIG devices left after a parallel round")
    s, p = median(serial), median(parallel)
    latency = f"{params.nvml_latency_s * 1000:g} ms per MIG-changing NVML call"
    what = f"{n} dynamic-MIG claims, {len({d.split('-mig-')[0] for d in devices})} GPUs"
    return [
        Figure("prepare.parallel.ratio", f"{what}: parallel / serial wall time", p / s, "×",
               f"{latency}; prepare + unprepare of all claims: serial {spread(serial)}; "
               f"parallel {spread(parallel)}", "median"),
        Figure("prepare.parallel.claims_per_s", f"{what}: in parallel, prepare+unprepare", n / p, "claims/s",
               f"{latency}; {n} claims / median parallel round {p * 1000:.0f} ms", "median"),
        Figure("prepare.serial.claims_per_s", f"{what}: one at a time, prepare+unprepare", n / s, "claims/s",
               f"{latency}; {n} claims / median serial round {s * 1000:.0f} ms", "median"),
    ]


def run(params: Params) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="gpu-dra-bench-") as tmp:
        base = Path(tmp)
        (base / "single").mkdir()
        (base / "parallel").mkdir()
        node = PluginNode(base / "single")
        try:
            figures = _single_claims(params, node)
        finally:
            node.close()
        slow = PluginNode(base / "parallel", latency_s=params.nvml_latency_s)
        try:
            figures += _parallel_claims(params, slow)
        finally:
            slow.close()
    return figures

