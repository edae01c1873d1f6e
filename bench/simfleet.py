"""Simulated nodes for the benchmarks: the 8 × H200 dynamic-MIG node and a generated fleet of mixed nodes.

The fleet cycles through node kinds so that every publishing path is exercised, weighted towards the
heaviest one (8 × H200 with dynamic MIG and 4 MPS slots per GPU: 240 devices, 8 counter sets):

=============  =======================  ==================================================
kind           GPUs                     policy
=============  =======================  ==================================================
h200-dyn       8 × H200-141GB           dynamic MIG + 4 MPS slots per GPU       (3 in 10)
h100           8 × H100-80GB            whole GPUs + 2 time-slicing slots       (2 in 10)
b200-dyn       8 × B200                 dynamic MIG                             (2 in 10)
a100-static    8 × A100-80GB, MIG on    static MIG (3g + 2g + 1g + 1g per GPU)  (1 in 10)
l4-ts          4 × L4                   8 time-slicing slots per GPU            (1 in 10)
l40s-shares    4 × L40S                 consumable memory shares                (1 in 10)
=============  =======================  ==================================================
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dra.model.gpu import NodeInventory
from dra.model.policy import NodePolicy, parse_node_policy
from dra.model.slices import ApiFeatures, plan_pool
from dra.node.inventory import discover
from dra.sim.fleet import Fleet, NodeSpec, load_fleet, nvml_for_node, parse_fleet

DRIVER = "gpu.dra-driver.io"
FEATURES = ApiFeatures.all()       # Kubernetes 1.36+: partitionable devices, consumable capacity, taints

H200_DYNAMIC_POLICY: dict[str, Any] = {"default": {"mig": "dynamic", "slots": {"count": 4, "strategy": "mps"}}}
H200_NODE_LABEL = "8×H200 dynamic MIG + 4 MPS slots/GPU"

_A100_LAYOUT = [{"profile": "3g.40gb", "start": 4}, {"profile": "2g.20gb", "start": 0},
                {"profile": "1g.10gb", "start": 2}, {"profile": "1g.10gb", "start": 3}]
_KINDS: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "h200-dyn": ([{"model": "H200-141GB", "count": 8}], H200_DYNAMIC_POLICY),
    "h100": ([{"model": "H100-80GB", "count": 8}],
             {"default": {"wholeGpu": True, "slots": {"count": 2, "strategy": "time-slicing"}}}),
    "b200-dyn": ([{"model": "B200", "count": 8}], {"default": {"mig": "dynamic"}}),
    "a100-static": ([{"model": "A100-80GB", "count": 8, "mig": {"enabled": True, "instances": _A100_LAYOUT}}],
                    {"default": {"mig": "static"}}),
    "l4-ts": ([{"model": "L4", "count": 4}], {"default": {"slots": {"count": 8, "strategy": "time-slicing"}}}),
    "l40s-shares": ([{"model": "L40S", "count": 4}],
                    {"default": {"memoryShares": {"minimum": "1Gi", "step": "1Gi"}}}),
}
_CYCLE = ("h200-dyn", "h100", "b200-dyn", "h200-dyn", "a100-static", "h100", "l4-ts", "h200-dyn", "b200-dyn",
          "l40s-shares")


def h200_node() -> NodeSpec:
    fleet = parse_fleet({"nodes": [{"name": "h200-dyn-0", "gpus": _KINDS["h200-dyn"][0],
                                    "policy": H200_DYNAMIC_POLICY}]}, "<bench h200 node>")
    return fleet.nodes[0]


def generated_fleet(nodes: int) -> Fleet:
    """``nodes`` nodes cycling through the kinds above; names ``<kind>-<n>``."""
    specs = []
    for i in range(nodes):
        kind = _CYCLE[i % len(_CYCLE)]
        gpus, policy = _KINDS[kind]
        specs.append({"name": f"{kind}-{i:03d}", "gpus": gpus, "policy": policy})
    return parse_fleet({"nodes": specs}, f"<generated fleet of {nodes} nodes>")


def bench_fleet(nodes: int, fleet_file: str | None) -> Fleet:
    return load_fleet(fleet_file) if fleet_file else generated_fleet(nodes)


def fleet_label(fleet: Fleet, fleet_file: str | None) -> str:
    return f"fleet {fleet_file} ({len(fleet.nodes)} nodes)" if fleet_file else f"{len(fleet.nodes)}-node fleet"


def policy_of(node: NodeSpec, source: str = "bench") -> NodePolicy:
    return parse_node_policy(node.policy, f"{source}: node {node.name}: policy")


@dataclass
class SimNode:
    """One node ready for discovery: its spec, policy and (initialised) simulated NVML."""

    spec: NodeSpec
    policy: NodePolicy
    nvml: Any

    @classmethod
    def of(cls, spec: NodeSpec) -> "SimNode":
        nvml = nvml_for_node(spec)
        nvml.nvmlInit()
        return cls(spec, policy_of(spec), nvml)


def publish(node: SimNode) -> tuple[NodeInventory, list[dict[str, Any]]]:
    """What a node plugin does before publishing: discovery, device model and slice packing."""
    inventory = discover(node.nvml)
    plan = plan_pool(inventory, node.policy, DRIVER, node.spec.name, FEATURES)
    return inventory, plan.slices


def device_count(slices: Sequence[dict[str, Any]]) -> int:
    return sum(len(s.get("devices") or ()) for s in slices)


FleetSlices = tuple[tuple[str, tuple[dict[str, Any], ...]], ...]
_published: dict[tuple[int, str | None], FleetSlices] = {}


def remember_fleet_slices(nodes: int, fleet_file: str | None, slices: FleetSlices) -> None:
    """Keep what one pass of the slice benchmark published, for the benchmarks that start from it."""
    _published[(nodes, fleet_file)] = slices


def fleet_slices(nodes: int, fleet_file: str | None) -> FleetSlices:
    """(node name, slice specs) of every node of the benchmark fleet, built once per process: the validation
    and reconcile benchmarks start from what the slice benchmark publishes."""
    key = (nodes, fleet_file)
    if key not in _published:
        fleet = bench_fleet(nodes, fleet_file)
        _published[key] = tuple((spec.name, tuple(publish(SimNode.of(spec))[1])) for spec in fleet.nodes)
    return _published[key]
