"""`gpu-dra inventory`: show the GPUs discovery finds, through the real NVML or in a simulated fleet."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from dra.model.catalog import family_of
from dra.model.gpu import GpuInfo, NodeInventory
from dra.node.nodeobjects import NodeObjects, NodePaths, NodeSetupError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet", metavar="FILE", help="simulated fleet file (default: this machine's GPUs via NVML)")
    parser.add_argument("--node", metavar="NAME", help="only this node of the fleet (default: all nodes)")
    add_node_path_arguments(parser)


def add_node_path_arguments(parser: argparse.ArgumentParser) -> None:
    """Where this process sees the node's driver, /dev and /proc: the plugin's flags of the same names."""
    parser.add_argument("--driver-root", default=os.environ.get("NVIDIA_DRIVER_ROOT") or "/", metavar="DIR",
                        help="where this process sees the NVIDIA driver's files, e.g. /run/nvidia/driver or "
                             "/usr/local/nvidia; NVML is loaded from there (default /; ignored with --fleet) "
                             "[env NVIDIA_DRIVER_ROOT]")
    parser.add_argument("--dev-root", default=os.environ.get("DEV_ROOT") or "/", metavar="DIR",
                        help="where this process sees /dev (default /) [env DEV_ROOT]")
    parser.add_argument("--proc-root", default=os.environ.get("PROC_ROOT") or "/proc", metavar="DIR",
                        help="where this process sees /proc (default /proc) [env PROC_ROOT]")


def node_paths(args: argparse.Namespace) -> NodePaths:
    return NodePaths(driver_root=args.driver_root, dev_root=args.dev_root, proc_root=args.proc_root)


def run(args: argparse.Namespace) -> int:
    if args.node and not args.fleet:
        print("gpu-dra inventory: --node needs --fleet", file=sys.stderr)
        return 2
    if args.fleet:
        return _run_fleet(args.fleet, args.node)
    return _run_local(NodeObjects(node_paths(args)))


def _run_local(objects: NodeObjects) -> int:
    import pynvml

    from dra.node.inventory import describe_nvml_error, discover

    try:
        objects.open_nvml()
    except NodeSetupError as exc:
        print(f"gpu-dra inventory: {exc}", file=sys.stderr)
        return 1
    except pynvml.NVMLError as exc:
        print(f"gpu-dra inventory: NVML is not available on this machine ({describe_nvml_error(exc)}); "
              "is the NVIDIA driver installed? Use --fleet FILE to show a simulated fleet.", file=sys.stderr)
        return 1
    try:
        inventory = discover(pynvml)
    finally:
        pynvml.nvmlShutdown()
    print(render_inventory("local", inventory))
    return 0


def _run_fleet(path: str, node_name: str | None) -> int:
    from dra.node.inventory import discover_once
    from dra.sim.fleet import FleetError, load_fleet, nvml_for_node

    try:
        fleet = load_fleet(path)
        nodes = [fleet.node(node_name)] if node_name else list(fleet.nodes)
    except FleetError as exc:       # a usage problem, as for the other commands
        print(f"gpu-dra inventory: {exc}", file=sys.stderr)
        return 2
    blocks = []
    for node in nodes:
        blocks.append(render_inventory(node.name, discover_once(nvml_for_node(node))))
    print("\n\n".join(blocks))
    return 0


def _mig_mode(g: GpuInfo) -> str:
    if not g.mig_capable:
        return "-"
    mode = "on" if g.mig_enabled else "off"
    if g.mig_pending != g.mig_enabled:
        mode += " (pending " + ("on" if g.mig_pending else "off") + ")"
    return mode


def _instances(g: GpuInfo) -> str:
    if not g.mig_instances:
        return "-"
    names = {p.profile_id: p.name for p in g.mig_profiles}
    return ", ".join(f"{names.get(m.profile_id, m.profile_id)}@{m.start}" for m in g.mig_instances)


def _row(g: GpuInfo) -> list[Any]:
    cc = g.cuda_compute_capability
    known = g.uuid != ""
    return [
        g.index,
        g.minor if g.minor >= 0 else "?",
        g.product_name or "?",
        f"{g.memory_mib / 1024:.1f} GiB" if g.memory_mib else "?",
        f"{cc[0]}.{cc[1]} {family_of(*cc)}" if cc != (0, 0) else "?",
        g.pci_bus_id or "?",
        "-" if g.numa_node is None else g.numa_node,
        _mig_mode(g),
        _instances(g),
        "ok" if g.healthy else f"UNHEALTHY: {g.health_reason}" + ("" if known else " (identity unknown)"),
    ]


_HEADERS = ["INDEX", "MINOR", "MODEL", "MEMORY", "CC/FAMILY", "PCI", "NUMA", "MIG", "INSTANCES", "HEALTH"]


def render_inventory(node: str, inventory: NodeInventory) -> str:
    """A readable table of one node's GPUs."""
    head = (f"node {node}: {len(inventory.gpus)} GPU(s), driver {inventory.driver_version}, "
            f"CUDA {inventory.cuda_driver_version}")
    if not inventory.gpus:
        return head + "\n(no GPUs)"
    rows = [_HEADERS] + [[str(c) for c in _row(g)] for g in inventory.gpus]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADERS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([head, *lines])
