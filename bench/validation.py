"""Benchmark ``validate``: ``validate_pool`` (every ResourceSlice limit plus the pool-wide rules) over what the
``slices`` benchmark publishes: the 8 × H200 node and the fleet. The CLI and the publisher run it before
anything is written, so it must stay cheap next to building the slices."""
from __future__ import annotations

from bench.core import Figure, median, spread, timed_runs
from bench.params import Params
from bench.simfleet import (
    H200_NODE_LABEL,
    SimNode,
    bench_fleet,
    device_count,
    fleet_label,
    fleet_slices,
    h200_node,
    publish,
)
from dra.model.slices import validate_pool

NAME = "validate"
DESCRIPTION = "validate_pool over the 8×H200 node's slices and over the fleet's"


def run(params: Params) -> list[Figure]:
    _, node_slices = publish(SimNode.of(h200_node()))
    node_runs = timed_runs(lambda: validate_pool(node_slices), params.repeats)
    node_errors = validate_pool(node_slices)

    pools = fleet_slices(params.fleet_nodes, params.fleet_file)
    label = fleet_label(bench_fleet(params.fleet_nodes, params.fleet_file), params.fleet_file)
    devices = sum(device_count(slices) for _, slices in pools)
    errors: list[str] = []

    def validate_all() -> None:
        errors[:] = [f"{name}: {e}" for name, slices in pools for e in validate_pool(slices)]

    passes = timed_runs(validate_all, params.fleet_repeats)
    per_pass = median(passes)
    first_error = f"; first: {errors[0]}" if errors else ""
    return [
        Figure("validate.node_ms", f"{H200_NODE_LABEL} ({device_count(node_slices)} devices): validate_pool",
               median(node_runs) * 1000, "ms", spread(node_runs), "median"),
        Figure("validate.fleet.per_node_ms", f"{label}: validate_pool per node", per_pass / len(pools) * 1000, "ms",
               spread([p / len(pools) for p in passes]), "median"),
        Figure("validate.fleet.devices_per_s", f"{label}: devices validated per second", devices / per_pass,
               "devices/s", f"{devices} devices / median pass {per_pass:.2f} s over {len(passes)} pass(es)", "median"),
        Figure("validate.problems", f"{label} and the 8×H200 node: problems validate_pool finds",
               len(errors) + len(node_errors), "problems", f"{len(errors) + len(node_errors)} problem(s){first_error}"),
    ]
