"""Benchmark ``slices``: discovery + device model + slice packing, for one 8 × H200 node and for a fleet.

This is what a node plugin does at start and after every hardware change, and what a cluster-wide publisher
does for every node. The simulated NVML is built before timing starts; discovery still goes through it, so
its per-call cost is part of the discovery figure (real NVML calls are slower, see the README).
"""
from __future__ import annotations

import gc
import time
from typing import Any

from bench.core import MIB, Figure, median, peak_memory, spread, timed_runs
from bench.params import Params
from bench.simfleet import (
    DRIVER,
    FEATURES,
    H200_NODE_LABEL,
    SimNode,
    bench_fleet,
    device_count,
    fleet_label,
    h200_node,
    publish,
    remember_fleet_slices,
)
from dra.model.devices import build_devices
from dra.model.slices import build_pool_slices, validate_pool
from dra.node.inventory import discover

NAME = "slices"
DESCRIPTION = "discovery + device model + slice packing: one 8×H200 dynamic-MIG node, and a fleet"


def _node_stages(node: SimNode) -> tuple[dict[str, float], list[dict[str, Any]]]:
    t0 = time.perf_counter()
    inventory = discover(node.nvml)
    t1 = time.perf_counter()
    model = build_devices(inventory, node.policy, driver=DRIVER)
    t2 = time.perf_counter()
    slices = build_pool_slices(DRIVER, node.spec.name, node.spec.name, model.devices, model.counter_sets, FEATURES)
    t3 = time.perf_counter()
    return {"discover": t1 - t0, "model": t2 - t1, "pack": t3 - t2, "total": t3 - t0}, slices


def node_figures(params: Params) -> list[Figure]:
    node = SimNode.of(h200_node())
    _, reference = publish(node)
    _, staged = _node_stages(node)
    if staged != reference:
        raise AssertionError("staged discovery/model/packing differs from plan_pool's slices")
    errors = validate_pool(reference)
    if errors:
        raise AssertionError(f"the benchmark node publishes invalid slices: {errors[:3]}")
    devices, n_slices = device_count(reference), len(reference)

    runs: dict[str, list[float]] = {"discover": [], "model": [], "pack": [], "total": []}
    _node_stages(node)  # warm-up
    for _ in range(params.repeats):
        gc.collect()
        stages, _ = _node_stages(node)
        for k, v in stages.items():
            runs[k].append(v)
    _, peak = peak_memory(lambda: publish(node))

    figures = [Figure("slices.node.total_ms",
                      f"{H200_NODE_LABEL}: discovery+model+packing ({devices} devices, {n_slices} slices)",
                      median(runs["total"]) * 1000, "ms", spread(runs["total"]), "median")]
    for stage, text in (("discover", "discovery"), ("model", "device model"), ("pack", "slice packing")):
        figures.append(Figure(f"slices.node.{stage}_ms", f"  of which {text}", median(runs[stage]) * 1000, "ms",
                              spread(runs[stage]), "median"))
    figures.append(Figure("slices.node.peak_mib", f"{H200_NODE_LABEL}: memory of one publish",
                          peak / MIB, "MiB", "tracemalloc peak above the baseline, one run", "peak"))
    return figures


def fleet_figures(params: Params) -> list[Figure]:
    fleet = bench_fleet(params.fleet_nodes, params.fleet_file)
    nodes = [SimNode.of(spec) for spec in fleet.nodes]
    label = fleet_label(fleet, params.fleet_file)
    last: list[list[dict[str, Any]]] = []

    def publish_all() -> None:
        last[:] = [publish(n)[1] for n in nodes]

    passes = timed_runs(publish_all, params.fleet_repeats, warmup=0)
    per_pass = median(passes)
    devices = sum(device_count(s) for s in last)
    remember_fleet_slices(params.fleet_nodes, params.fleet_file,
                          tuple((n.spec.name, tuple(s)) for n, s in zip(nodes, last)))
    last.clear()

    # tracemalloc slows Python down several times, so --quick holds one cycle of the node mix only.
    sample = nodes if params.fleet_memory_nodes is None else nodes[:params.fleet_memory_nodes]
    held, peak = peak_memory(lambda: [publish(n)[1] for n in sample])
    del held
    per_node = [p / len(nodes) for p in passes]
    return [
        Figure("slices.fleet.per_node_ms", f"{label} ({devices} devices): time per node",
               per_pass / len(nodes) * 1000, "ms", spread(per_node), "median"),
        Figure("slices.fleet.devices_per_s", f"{label}: devices published per second", devices / per_pass,
               "devices/s", f"{devices} devices / median pass {per_pass:.2f} s over {len(passes)} pass(es)", "median"),
        Figure("slices.fleet.held_mib_per_node", f"{label}: memory per node, all nodes' slices held",
               peak / MIB / len(sample), "MiB",
               f"tracemalloc peak {peak / MIB:.1f} MiB above the baseline while publishing and holding "
               f"{len(sample)} of {len(nodes)} nodes, one pass", "peak"),
    ]


def run(params: Params) -> list[Figure]:
    return node_figures(params) + fleet_figures(params)
