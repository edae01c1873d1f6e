"""Benchmark ``status``: ``gpu-dra status`` of a whole fleet on a real API server (a LocalCluster), against the raw
LIST of the same slices measured in the same run.

The fleet: ``status_nodes`` nodes of 8 × H100-80GB (1000 in the full run), most of them published as whole GPUs,
one in ten with two GPUs in dynamic MIG, one in ten with 4 time-slicing slots per GPU (see ``KINDS``). Set-up,
not timed: the nodes are registered, their slices created by a bare client, and on every node a claim holds
gpu-0 (on the MIG nodes a 3g.40gb and a 1g.10gb partition of gpu-6 instead) for a pod bound to the node; the
claims' allocations and reservations are written through their status, as the scheduler would.

Then, interleaved run by run: the floor, one unpaginated GET of the driver's slices decoded from JSON (the least
any reader of them does), and the status (``cli.status_cmd.collect`` + the table: the LISTs of slices and claims
side by side, pods only where a claim is allocated but unreserved, the computation of ``dra.scheduling.occupancy``,
the text). Figures: the status median (target in
bench/targets.yaml), its ratio to the floor's median, and for context the floor, the computation alone and the
fleet's size.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from bench.core import Figure, median, spread
from bench.params import Params
from cli.publish_cmd import iter_fleet_pools, register_missing_nodes
from dra.model.slices import ApiFeatures
from dra.sim.fleet import load_fleet
from kube.client import NODES, SLICES, KubeApi
from kube.resourceslices import slice_name
from testbed.localcluster import LocalCluster

NAME = "status"
DESCRIPTION = "gpu-dra status of a fleet of nodes × 8 H100 on a real API server, against the raw LIST of its slices"

DRIVER = "gpu.dra-driver.io"
NAMESPACE = "bench-status"
WORKERS = 8
MIG_GPU = 6
KINDS: dict[str, dict[str, Any]] = {
    "whole": {"default": {"wholeGpu": True}},
    "mig": {"default": {"wholeGpu": True},
            "rules": [{"match": {"index": 6}, "mig": "dynamic"}, {"match": {"index": 7}, "mig": "dynamic"}]},
    "slots": {"default": {"wholeGpu": True, "slots": {"count": 4, "strategy": "time-slicing"}}},
}
CYCLE = ("whole", "whole", "mig", "whole", "whole", "whole", "slots", "whole", "whole", "whole")


def kind_of(i: int) -> str:
    return CYCLE[i % len(CYCLE)]


def fleet_doc(nodes: int) -> dict[str, Any]:
    return {"nodes": [{"name": f"st-{i:04d}", "gpus": [{"model": "H100-80GB", "count": 8}], "policy": KINDS[kind_of(i)]}
                      for i in range(nodes)]}


def slice_bodies(fleet_path: Path, node_uids: dict[str, str]) -> list[bytes]:
    """The slices of every node, as a node's plugin publishes them, ready to POST."""
    fleet = load_fleet(fleet_path)
    bodies = []
    for node, pool in iter_fleet_pools(fleet, str(fleet_path), DRIVER, ApiFeatures.all()):
        for i, part in enumerate(pool.slices):
            spec = {"driver": DRIVER, "pool": {"name": node, "generation": 1, "resourceSliceCount": len(pool.slices)},
                    "nodeName": node, **part}
            meta = {"name": slice_name(DRIVER, node, i), "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uids[node], "controller": True}]}
            bodies.append(json.dumps({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                                      "metadata": meta, "spec": spec}).encode())
    return bodies


def held_devices(i: int) -> list[list[str]]:
    """The devices each claim of node ``i`` holds."""
    if kind_of(i) == "mig":
        return [[f"gpu-{MIG_GPU}-mig-3g40gb-9-4"], [f"gpu-{MIG_GPU}-mig-1g10gb-19-3"]]
    return [["gpu-0"]]


def allocate(kube: KubeApi, node: str, claim: str, devices: list[str]) -> None:
    """A claim holding ``devices`` on ``node`` for a pod bound there, as the scheduler leaves them."""
    base = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"
    obj = kube.create(base, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": claim},
                             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}})
    pod = kube.create(f"/api/v1/namespaces/{NAMESPACE}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": claim},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "example.invalid/none",
                                                    "resources": {"claims": [{"name": "gpu"}]}}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]}})
    obj["status"] = {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": DRIVER, "pool": node, "device": d} for d in devices]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]}},
        "reservedFor": [{"resource": "pods", "name": claim, "uid": pod["metadata"]["uid"]}]}
    kube.request("PUT", f"{base}/{claim}/status", body=obj)


def floor_list(cluster: LocalCluster, api: Any) -> int:
    """One GET of every slice of the driver, decoded: returns how many."""
    pool = api.rest_client.pool_manager
    resp = pool.request("GET", f"{cluster.server}{SLICES}?fieldSelector=spec.driver%3D{DRIVER}",
                        headers={"Authorization": f"Bearer {cluster.token}", "Accept": "application/json"},
                        retries=False, timeout=120)
    if resp.status != 200:
        raise RuntimeError(f"floor: LIST answered {resp.status}: {resp.data[:300]!r}")
    return len(json.loads(resp.data)["items"])


def _progress(line: str) -> None:
    print(f"  status: {line}", file=sys.stderr, flush=True)


def run(params: Params) -> list[Figure]:
    from cli.status_cmd import collect, render
    from dra.scheduling.occupancy import fleet_status
    from ops.status.reads import read_status_objects

    nodes = params.status_nodes
    runs = max(1, min(params.repeats, 7))
    work = Path(tempfile.mkdtemp(prefix="gpu-dra-bench-status-"))
    fleet_path = work / "fleet.yaml"
    fleet_path.write_text(yaml.safe_dump(fleet_doc(nodes), sort_keys=False))
    cluster = LocalCluster(workdir=work / "cluster")
    try:
        cluster.start()
        api = cluster.api_client()
        kube = KubeApi(api, timeout=120)
        names = [f"st-{i:04d}" for i in range(nodes)]
        register_missing_nodes(api, names)
        uids = {o["metadata"]["name"]: o["metadata"]["uid"] for o in kube.list_metadata(NODES)["items"]}
        bodies = slice_bodies(fleet_path, uids)
        with ThreadPoolExecutor(WORKERS) as ex:
            list(ex.map(lambda b: kube.create(SLICES, b), bodies))
            kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
            jobs = [(names[i], f"c-{i:04d}-{k}", devices) for i in range(nodes) for k, devices in enumerate(held_devices(i))]
            list(ex.map(lambda j: allocate(kube, *j), jobs))
        _progress(f"{nodes} nodes, {len(bodies)} slices, {len(jobs)} claims with pods set up")

        floor_s: list[float] = []
        status_s: list[float] = []
        listed = shown = 0
        for _ in range(runs + 1):                # the first of each is a warm-up
            start = time.perf_counter()
            listed = floor_list(cluster, api)
            floor_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            fleet = collect(api, DRIVER)
            text = render(fleet)
            status_s.append(time.perf_counter() - start)
            shown = sum(len(n.gpus) for n in fleet)
        floor_s, status_s = floor_s[1:], status_s[1:]
        objects = read_status_objects(kube, DRIVER)
        start = time.perf_counter()
        fleet = fleet_status(objects.slices, objects.claims, objects.pods, DRIVER)
        compute_s = time.perf_counter() - start
        held = sum(1 for n in fleet for g in n.gpus for d in g.devices if d.holders)
        expected = sum(len(devices) for _, _, devices in jobs)
        if (listed, shown, held) != (len(bodies), nodes * 8, expected):
            raise RuntimeError(f"status saw {listed} slices, {shown} GPUs, {held} held devices; expected "
                               f"{len(bodies)}, {nodes * 8}, {expected}")
        _progress(f"status {median(status_s):.2f} s, floor {median(floor_s):.2f} s, table of {len(text)} bytes")
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)

    label = f"{nodes} nodes × 8 H100 ({len(bodies)} slices, {len(jobs)} claims)"
    return [
        Figure("status.seconds", f"{label}: gpu-dra status (LISTs, computation, table)", median(status_s), "s",
               spread(status_s, 1.0, "s"), "median"),
        Figure("status.ratio", f"{label}: gpu-dra status / raw LIST of its slices", median(status_s) / median(floor_s),
               "×", f"status {median(status_s):.2f} s, floor {median(floor_s):.2f} s, {runs} runs each, interleaved"),
        Figure("status.floor.seconds", f"{label}: one GET of the driver's slices, decoded", median(floor_s), "s",
               spread(floor_s, 1.0, "s"), "median"),
        Figure("status.compute_ms", f"{label}: dra.scheduling.occupancy over the objects read", compute_s * 1000, "ms",
               "one run"),
    ]
