"""Benchmark ``mig``: create/destroy cycles of MIG devices on a simulated H200, through the driver's own MIG
code (``dra.node.migdevices``), which is what preparing a dynamic-MIG claim does.

One cycle: create the MIG device at the next placement (every profile at every valid start, in turn), try to
create an overlapping one (the simulator's placement check must refuse it), destroy the first. MIG mode is
on from the start, so no cycle pays for switching it.
"""
from __future__ import annotations

from bench.core import Figure, median, spread, timed_runs
from bench.params import Params
from dra.node import migdevices as hardware
from dra.node.inventory import discover
from dra.sim.fleet import nvml_for_node, parse_fleet

NAME = "mig"
DESCRIPTION = "fake-NVML MIG create/destroy cycles with placement checks, via dra.node.migdevices"


def run(params: Params) -> list[Figure]:
    fleet = parse_fleet({"nodes": [{"name": "mig-bench", "gpus": [
        {"model": "H200-141GB", "count": 1, "mig": {"enabled": True}}]}]}, "<bench mig node>")
    nvml = nvml_for_node(fleet.nodes[0])
    nvml.nvmlInit()
    gpu = discover(nvml).gpus[0]
    placements = [(p.profile_id, start) for p in gpu.mig_profiles for start in p.starts]
    state = {"next": 0, "cycles": 0, "refused": 0, "accepted": 0}

    def cycle() -> None:
        profile_id, start = placements[state["next"] % len(placements)]
        state["next"] += 1
        live = hardware.create_mig_device(nvml, gpu.uuid, profile_id, start)
        try:
            extra = hardware.create_mig_device(nvml, gpu.uuid, profile_id, start)
        except hardware.MigError:
            state["refused"] += 1
        else:
            state["accepted"] += 1
            hardware.destroy_mig_device(nvml, gpu.uuid, extra.gi_id, extra.ci_id, extra.uuid)
        hardware.destroy_mig_device(nvml, gpu.uuid, live.gi_id, live.ci_id, live.uuid)
        state["cycles"] += 1

    def batch() -> None:
        for _ in range(params.mig_cycles):
            cycle()

    batches = timed_runs(batch, params.mig_batches)
    left = hardware.list_mig_devices(nvml, gpu.uuid)
    if left:
        raise AssertionError(f"MIG devices left after the cycles: {left}")
    per_batch = median(batches)
    label = f"H200, {len(placements)} placements in turn"
    return [
        Figure("mig.cycles_per_s", f"{label}: create, refused overlap, destroy", params.mig_cycles / per_batch,
               "cycles/s", f"{params.mig_cycles} cycles per batch; batch time {spread(batches)}", "median"),
        Figure("mig.overlaps_accepted", f"{label}: overlapping creates accepted", state["accepted"], "creates",
               f"{state['refused']} of {state['refused'] + state['accepted']} overlapping creates refused"),
    ]
