"""Benchmark ``publish``: ``gpu-dra publish --once`` of a simulated fleet on a real API server (a LocalCluster),
against the raw-ingest floor measured in the same run, on the same API server, with the same parallelism.

The fleet: ``publish_nodes`` nodes of 8 × H100-80GB with dynamic MIG and 4 MPS slots per GPU (5 slices of
~50 KB each per node; 1000 nodes make 5000 slices), or the ``--fleet`` file. Nodes are registered beforehand
(not timed). Then, in this order:

1. floor: a minimal client POSTs the same slices (the same specs and owner references, built and encoded
   before the clock starts) from ``publish_workers`` threads over one connection pool; what is timed is the
   API server taking them in. The slices are then deleted again (not timed);
2. first sync: ``gpu-dra publish --once --workers <publish_workers>`` as its own process (with its default
   ``--jobs``), timed from its start to its exit (imports, discovery and slice building of every node,
   validation, writes: all of it);
3. restart: the same command again with nothing changed: it must write nothing.

Figures: the first sync as a ratio to the floor, the restart as a ratio to the first sync, the restart's writes,
and the publisher's peak RSS (the larger of both runs; the sum of the VmHWM of the process and of its job
processes, sampled every 0.1 s until it has exited but is not yet reaped), with the absolute times, rates and
the delay to the first slice for context.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from calendar import timegm
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from bench.core import Figure
from bench.params import Params
from cli.publish_cmd import iter_fleet_pools, register_missing_nodes
from dra.model.slices import ApiFeatures
from dra.sim.fleet import Fleet, load_fleet
from kube.client import METADATA_LIST, NODES, SLICES, ApiError, ApiUnavailable, KubeApi
from kube.resourceslices import slice_name
from testbed.localcluster import LocalCluster

NAME = "publish"
DESCRIPTION = "gpu-dra publish of a simulated fleet on a real API server: convergence vs raw ingest, restart, RSS"

DRIVER = "gpu.dra-driver.io"
FLOOR_DRIVER = "floor.dra-driver.io"
H100_POLICY: dict[str, Any] = {"default": {"mig": "dynamic", "slots": {"count": 4, "strategy": "mps"}}}
REPO = Path(__file__).resolve().parents[1]


def fleet_doc(nodes: int) -> dict[str, Any]:
    return {"nodes": [{"name": f"pub-{i:04d}", "gpus": [{"model": "H100-80GB", "count": 8}], "policy": H100_POLICY}
                      for i in range(nodes)]}


def floor_bodies(fleet: Fleet, fleet_path: str, node_uids: dict[str, str]) -> list[bytes]:
    """The slices gpu-dra publish writes (specs and owner references alike), under the floor's driver name, as
    request bodies ready to send."""
    bodies = []
    for node, pool in iter_fleet_pools(fleet, fleet_path, FLOOR_DRIVER, ApiFeatures.all()):
        for i, part in enumerate(pool.slices):
            spec = {"driver": FLOOR_DRIVER, "pool": {"name": node, "generation": 1, "resourceSliceCount": len(pool.slices)},
                    "nodeName": node, **part}
            meta = {"name": slice_name(FLOOR_DRIVER, node, i), "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uids[node], "controller": True}]}
            bodies.append(json.dumps({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                                      "metadata": meta, "spec": spec}).encode())
    return bodies


def raw_ingest(cluster: LocalCluster, api: Any, bodies: list[bytes], workers: int) -> float:
    """Seconds for `workers` threads to POST every body (201 each) over the client's connection pool."""
    pool = api.rest_client.pool_manager
    url = cluster.server + SLICES
    headers = {"Authorization": f"Bearer {cluster.token}", "Content-Type": "application/json",
               "Accept": "application/json"}

    def post(body: bytes) -> None:
        resp = pool.request("POST", url, body=body, headers=headers, retries=False)
        if resp.status != 201:
            raise RuntimeError(f"floor: POST answered {resp.status}: {resp.data[:300]!r}")

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(post, bodies))
    return time.perf_counter() - start


def delete_driver_slices(cluster: LocalCluster, kube: KubeApi, driver: str, timeout: float = 900.0) -> None:
    """Deletes every slice of `driver` and waits until they are gone. The API server gives a request 60 s: a
    collection of thousands is deleted over several requests, each answered 504 when its time is up."""
    deadline = time.monotonic() + timeout
    selector = f"spec.driver={driver}"
    while kube.list_metadata(SLICES, field_selector=selector)["items"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"slices of {driver} still there {timeout:.0f} s after deleting them")
        try:
            # The answer lists every deleted object: metadata only, or thousands of full slices come back.
            kube.request("DELETE", SLICES, query={"fieldSelector": selector}, accept=METADATA_LIST, timeout=120)
        except ApiError as exc:
            if exc.status != 504:
                raise
        except ApiUnavailable:
            pass
    time.sleep(5)   # let the scheduler's and controller-manager's watches catch up before the next phase


class Run:
    """One `gpu-dra publish --once` process: wall time, peak RSS, its summary line."""

    def __init__(self, seconds: float, rss_mib: float, out: str, started_at: float) -> None:
        self.seconds, self.rss_mib, self.out, self.started_at = seconds, rss_mib, out, started_at

    @property
    def writes(self) -> dict[str, int]:
        m = re.search(r"writes: (.*)$", self.out.strip().splitlines()[-1] if self.out.strip() else "")
        if not m:
            raise RuntimeError(f"gpu-dra publish printed no summary: {self.out[-500:]}")
        if m.group(1) == "none":
            return {}
        return {op: int(n) for op, n in (w.split() for w in m.group(1).split(", "))}


def _peak_rss_mib(pid: int) -> float | None:
    """VmHWM: the peak resident set of the process's current program (exec resets it; ru_maxrss would count the
    bench process it was forked from)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _tree(pid: int) -> list[int]:
    """The process and its descendants (the publisher's job processes)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def publish(work: Path, kubeconfig: Path, fleet_path: Path, workers: int, timeout: float, tag: str) -> Run:
    argv = [sys.executable, "-m", "cli.main", "publish", "--fleet", str(fleet_path), "--kubeconfig", str(kubeconfig),
            "--driver-name", DRIVER, "--once", "--workers", str(workers), "--timeout", str(timeout),
            "--log-level", "WARNING"]
    log_path = work / f"publish-{tag}.log"
    out_path = work / f"publish-{tag}.out"
    started_at = time.time()
    start = time.perf_counter()
    peaks: dict[int, float] = {}
    with open(log_path, "wb") as err, open(out_path, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=err)
        while True:
            # HWM only grows: sampled until the process is a zombie (waitid without reaping), the last is the peak.
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
            for pid in _tree(proc.pid):
                peaks[pid] = max(peaks.get(pid, 0.0), _peak_rss_mib(pid) or 0.0)
            if info is not None:
                break
            time.sleep(0.1)
        proc.wait()
    peak = sum(peaks.values())    # each process at its own peak: an upper bound of the tree's
    seconds = time.perf_counter() - start
    text = out_path.read_text(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"gpu-dra publish ({tag}) exited {proc.returncode}:\n{text}\n{tail}")
    return Run(seconds, peak, text, started_at)


def first_slice_after(kube: KubeApi, started_at: float) -> float:
    """Seconds from the publisher's start to the creation of its first slice (the server's clock, 1 s steps)."""
    stamps = [timegm(time.strptime(o["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ"))
              for o in kube.list_metadata(SLICES, field_selector=f"spec.driver={DRIVER}")["items"]]
    return max(0.0, min(stamps) - started_at) if stamps else float("nan")


def _progress(line: str) -> None:
    print(f"  publish: {line}", file=sys.stderr, flush=True)


def run(params: Params) -> list[Figure]:
    workers = params.publish_workers
    work = Path(tempfile.mkdtemp(prefix="gpu-dra-bench-publish-"))
    fleet_path = Path(params.fleet_file) if params.fleet_file else work / "fleet.yaml"
    if not params.fleet_file:
        fleet_path.write_text(yaml.safe_dump(fleet_doc(params.publish_nodes), sort_keys=False))
    fleet = load_fleet(fleet_path)
    label = (f"fleet {params.fleet_file} ({len(fleet.nodes)} nodes)" if params.fleet_file
             else f"{len(fleet.nodes)} nodes × 8 H100")
    cluster = LocalCluster(workdir=work / "cluster")
    try:
        cluster.start()
        api = cluster.api_client()
        kube = KubeApi(api)
        register_missing_nodes(api, fleet.node_names)
        uids = {o["metadata"]["name"]: o["metadata"]["uid"] for o in kube.list_metadata(NODES)["items"]}
        bodies = floor_bodies(fleet, str(fleet_path), uids)
        slices = len(bodies)
        floor_s = raw_ingest(cluster, api, bodies, workers)
        del bodies
        _progress(f"floor: {slices} slices in {floor_s:.1f} s")
        delete_driver_slices(cluster, kube, FLOOR_DRIVER)

        timeout = 120.0 + 3.0 * slices
        first = publish(work, cluster.kubeconfig, fleet_path, workers, timeout, "first")
        first_slice_s = first_slice_after(kube, first.started_at)
        stored = len(kube.list_metadata(SLICES, field_selector=f"spec.driver={DRIVER}")["items"])
        if first.writes != {"create": slices} or stored != slices:
            raise RuntimeError(f"first sync: writes {first.writes}, {stored} slices stored, {slices} expected")
        _progress(f"first sync: {first.seconds:.1f} s, peak RSS {first.rss_mib:.0f} MiB, {first.writes}")
        restart = publish(work, cluster.kubeconfig, fleet_path, workers, timeout, "restart")
        restart_writes = sum(restart.writes.values())
        _progress(f"restart: {restart.seconds:.1f} s, peak RSS {restart.rss_mib:.0f} MiB, {restart.writes or 'no writes'}")
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)

    how = f"{slices} slices, {workers} writes in flight, one run each"
    return [
        Figure("publish.converge.ratio", f"{label}: first sync / raw-ingest floor", first.seconds / floor_s, "×",
               f"gpu-dra publish --once {first.seconds:.1f} s, floor {floor_s:.1f} s; {how}"),
        Figure("publish.converge.seconds", f"{label}: first sync (process start to exit)", first.seconds, "s"),
        Figure("publish.floor.seconds", f"{label}: raw ingest of the same slices", floor_s, "s",
               f"{slices / floor_s:.1f} creates/s by a bare client"),
        Figure("publish.converge.creates_per_s", f"{label}: first sync, creates per second", slices / first.seconds,
               "creates/s"),
        Figure("publish.first_slice.seconds", f"{label}: first slice stored after", first_slice_s, "s",
               "creationTimestamp of the earliest slice minus the process start (1 s resolution)"),
        Figure("publish.first_sync.writes_per_slice", f"{label}: first sync, writes per slice",
               sum(first.writes.values()) / slices, "writes", f"{first.writes}", "worst"),
        Figure("publish.restart.ratio", f"{label}: unchanged restart / first sync", restart.seconds / first.seconds,
               "×", f"restart {restart.seconds:.1f} s, first sync {first.seconds:.1f} s"),
        Figure("publish.restart.seconds", f"{label}: unchanged restart (process start to exit)", restart.seconds, "s"),
        Figure("publish.restart.writes", f"{label}: unchanged restart, writes", restart_writes, "writes",
               f"{restart.writes or 'none'}", "worst"),
        Figure("publish.peak_rss_mib", f"{label}: publisher peak RSS", max(first.rss_mib, restart.rss_mib), "MiB",
               f"first sync {first.rss_mib:.0f} MiB, restart {restart.rss_mib:.0f} MiB (VmHWM, summed over its processes)",
               "peak"),
    ]
