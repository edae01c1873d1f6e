"""Benchmark ``reconcile``: the ResourceSlice controller publishing the fleet (as ``gpu-dra publish`` does for
a simulated fleet) against an in-memory API (``bench.memapi``), not an API server.

The controller's own code runs unchanged (``ResourceSliceController.run_once``: list, per-pool diff,
generation handling, writes); only its ``kube`` attribute, the JSON client, is replaced by the in-memory
stand-in. Figures: writes on the first sync (one per slice is the minimum), writes on a resync with nothing
changed and after a controller restart (both must be 0), writes after one device of one node gets a taint,
and the controller's CPU time per node (the in-memory API answers in microseconds; a real server adds
a LIST round trip per pool).
"""
from __future__ import annotations

import copy
import time
from typing import Any

from bench.core import Figure, median, spread
from bench.memapi import InMemorySliceApi
from bench.params import Params
from bench.simfleet import DRIVER, bench_fleet, fleet_label, fleet_slices
from kube.resourceslices import DesiredPool, Owner, ResourceSliceController

NAME = "reconcile"
DESCRIPTION = "ResourceSlice controller over the fleet, in-memory API: writes on first sync, resync, restart"

TAINT = {"key": f"{DRIVER}/unhealthy", "value": "XID-79", "effect": "NoSchedule"}


def controller_on(api: InMemorySliceApi) -> ResourceSliceController:
    ctl = ResourceSliceController(None, DRIVER, Owner.cluster())
    ctl.kube = api  # the in-memory stand-in answers the same verbs as kube.client.KubeApi
    return ctl


def _sync(ctl: ResourceSliceController, api: InMemorySliceApi, pools: dict[str, DesiredPool]) -> tuple[int, float]:
    """(writes, seconds) of one update + run_once."""
    before = api.total_writes
    start = time.perf_counter()
    ctl.update(pools)
    ctl.run_once(timeout=60.0)
    seconds = time.perf_counter() - start
    if ctl.errors:
        raise AssertionError(f"pools failed to sync: {dict(list(ctl.errors.items())[:3])}")
    return api.total_writes - before, seconds


def _one_device_tainted(pools: dict[str, DesiredPool]) -> tuple[dict[str, DesiredPool], str]:
    """The same pools with one device of one node tainted (a health event)."""
    changed = dict(pools)
    for name, pool in pools.items():
        for i, part in enumerate(pool.slices):
            devices = part.get("devices") or []
            if devices and len(devices) <= 64:   # a taint makes the 64-device limit apply
                new = copy.deepcopy(pool)
                device: dict[str, Any] = new.slices[i]["devices"][0]
                device["taints"] = [*device.get("taints", []), TAINT]
                changed[name] = new
                return changed, f"{name}/{device['name']}"
    raise ValueError("no device slice to taint in the fleet")


def run(params: Params) -> list[Figure]:
    published = fleet_slices(params.reconcile_nodes, params.fleet_file)
    label = fleet_label(bench_fleet(params.reconcile_nodes, params.fleet_file), params.fleet_file)
    pools = {name: DesiredPool.from_slice_specs(list(slices), name) for name, slices in published}
    n_slices = sum(len(p.slices) for p in pools.values())
    nodes = len(pools)

    writes: dict[str, list[int]] = {"first": [], "resync": [], "restart": []}
    seconds: dict[str, list[float]] = {"first": [], "resync": [], "restart": []}
    for _ in range(max(1, params.reconcile_rounds)):
        api = InMemorySliceApi(list(pools))
        ctl = controller_on(api)
        for phase, controller in (("first", ctl), ("resync", ctl), ("restart", controller_on(api))):
            w, t = _sync(controller, api, pools)
            writes[phase].append(w)
            seconds[phase].append(t)
            if api.slice_count != n_slices:
                raise AssertionError(f"{api.slice_count} slices stored after the {phase} sync, {n_slices} desired")
    tainted, where = _one_device_tainted(pools)
    change_writes, _ = _sync(ctl, api, tainted)

    def per_node_ms(phase: str) -> float:
        return median(seconds[phase]) / nodes * 1000

    def runs(phase: str) -> str:
        return f"{nodes} pools, {n_slices} slices; whole sync {spread(seconds[phase], scale=1.0, unit='s')}"

    return [
        Figure("reconcile.first_sync.writes_per_slice", f"{label}: first sync, writes per desired slice",
               max(writes["first"]) / n_slices, "writes", f"{max(writes['first'])} writes for {n_slices} slices",
               "worst"),
        Figure("reconcile.first_sync.per_node_ms", f"{label}: first sync, controller time per node",
               per_node_ms("first"), "ms", runs("first"), "median"),
        Figure("reconcile.resync.writes", f"{label}: resync, nothing changed: writes", max(writes["resync"]),
               "writes", "every pool listed and compared again by the same controller", "worst"),
        Figure("reconcile.resync.per_node_ms", f"{label}: resync, controller time per node",
               per_node_ms("resync"), "ms", runs("resync"), "median"),
        Figure("reconcile.restart.writes", f"{label}: new controller, same state: writes", max(writes["restart"]),
               "writes", f"a second controller instance on the same API; {runs('restart')}", "worst"),
        Figure("reconcile.one_taint.writes", f"{label}: one device tainted on one node: writes", change_writes,
               "writes", f"taint on {where}"),
    ]
