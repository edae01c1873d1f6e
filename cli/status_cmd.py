"""`gpu-dra status [NODE]` (also `kubectl gpu`): who holds which GPU device, what is still free, and each MIG
GPU's memory slices drawn in one row, from the API server alone (ResourceSlices, ResourceClaims, Pods).

The computation is ``dra.scheduling.occupancy``; the reads are ``ops.status.reads``. The table lists every device
except the dynamic MIG placements nobody holds (``--all`` lists those too): they overlap each other, so the
free ones are summed up as the profiles still placeable instead.
"""
from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable, Sequence
from typing import Any

from api.names import DEFAULT_DRIVER_NAME
from cli.kubeflags import add_connection_arguments, dump

PROG = "gpu-dra status"
# In --help (cli.main), with the statuses of cluster failures (cli.failures).
EXIT_STATUS = {0: "printed", 1: "NODE publishes no devices of the driver"}
USES_CLUSTER = True
# kubectl's: the table, the table with more columns, the document, one "node/NAME" line per node.
FORMATS = ("table", "wide", "json", "yaml", "name")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("node", nargs="?", metavar="NODE", help="only this node (default: every node with GPUs)")
    parser.add_argument("-o", "--output", default="table", choices=FORMATS,
                        help="output format (default: table; wide adds memory and taints per device)")
    add_connection_arguments(parser)
    parser.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME, metavar="NAME",
                        help=f"DRA driver name (default {DEFAULT_DRIVER_NAME})")
    parser.add_argument("--all", action="store_true", dest="all_devices",
                        help="also list every dynamic MIG placement nobody holds")


def collect(api_client: Any, driver: str, node: str | None = None) -> list[Any]:
    """The NodeStatus of every node of ``driver`` (or of ``node``), read from the API server."""
    from dra.scheduling.occupancy import fleet_status
    from kube.client import KubeApi
    from ops.status.reads import read_status_objects

    objects = read_status_objects(KubeApi(api_client, timeout=60.0), driver, node)
    return fleet_status(objects.slices, objects.claims, objects.pods, driver, node)


def run(args: argparse.Namespace) -> int:
    gc.disable()        # short-lived, parses pages of slices and claims: as gpu-dra explain (cli/explain_cmd.py)
    from api.k8snames import is_dns_subdomain
    from cli.failures import EXIT_USAGE, report
    from kube.connect import ConnectError, api_client_from
    from ops.status.reads import RIGHTS, StatusReadError

    # Both go into field selectors: anything but a Kubernetes name is refused before a request is made.
    for what, value in (("NODE", args.node), ("--driver-name", args.driver_name)):
        if value is not None and not is_dns_subdomain(value):
            print(f"{PROG}: {what} {value[:260]!r}: not a Kubernetes name (lower-case DNS subdomain)", file=sys.stderr)
            return EXIT_USAGE
    try:
        api = api_client_from(args.kubeconfig, args.context)
    except ConnectError as err:
        return report(PROG, err)
    try:
        nodes = collect(api, args.driver_name, args.node)
    except StatusReadError as err:
        return report(PROG, err, api, needs=f"{PROG} needs {RIGHTS}")
    finally:
        api.close()
    if args.node and not nodes:
        print(f"{PROG}: node {args.node!r} publishes no devices of driver {args.driver_name}", file=sys.stderr)
        return 1
    print(render(nodes, args.output, all_devices=args.all_devices), end="")
    return 0


def render(nodes: Sequence[Any], output: str = "table", *, all_devices: bool = False) -> str:
    from dra.scheduling.occupancy import fleet_summary

    if output in ("json", "yaml"):
        return dump({"summary": fleet_summary(nodes), "nodes": [n.to_dict() for n in nodes]}, output)
    if output == "name":
        return "".join(f"node/{n.name}\n" for n in nodes)
    lines: list[str] = []
    for n in nodes:
        render_node(n, lines.append, all_devices=all_devices, wide=output == "wide")
    if not nodes:
        lines.append("no devices published")
    return "\n".join(lines) + "\n"


def render_node(node: Any, out: Callable[[str], None], *, all_devices: bool = False, wide: bool = False) -> None:
    from api.quantity import format_bytes

    gpus = node.gpus
    parts = [f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}",
             f"{sum(1 for g in gpus if g.whole_free)} whole free"]
    slots = sum(g.slots_total for g in gpus)
    if slots:
        parts.append(f"{sum(g.slots_free for g in gpus)}/{slots} slots free")
    unhealthy = sum(1 for g in gpus if not g.healthy)
    if unhealthy:
        parts.append(f"{unhealthy} unhealthy")
    out(f"NODE {node.name}: " + ", ".join(parts))
    for g in gpus:
        health = "healthy" if g.healthy else "UNHEALTHY"
        taints = f" taints: {', '.join(g.taints)}" if g.taints else ""
        out(f"  GPU {g.minor}  {g.product or '?'}  {g.uuid or '?'}  {health}{taints}")
        rows = [d for d in g.devices if all_devices or d.holders or not d.dynamic_mig]
        width = max((len(d.name) for d in rows), default=0)
        for d in rows:
            detail = f"{d.kind} {d.detail}".strip()
            holder = "; ".join(h.describe() for h in d.holders)
            extra = f"{d.memory or '-':<9} {','.join(d.taints) or '-':<12} " if wide else ""
            out(f"    {d.name.ljust(width)}  {detail:<18} {d.state:<7} {extra}{holder}".rstrip())
        free: list[str] = []
        if g.whole_free is not None:
            free.append(f"whole GPU {'yes' if g.whole_free else 'no'}")
        if g.slots_total:
            free.append(f"slots {g.slots_free}/{g.slots_total}")
        if g.share_total_bytes is not None:
            free.append(f"share memory {format_bytes(g.share_free_bytes or 0)} of {format_bytes(g.share_total_bytes)}")
        if g.mig_free:
            free.append("MIG " + ", ".join(f"{p} ×{k}" for p, k in g.mig_free.items()))
        elif g.memory_slices:
            free.append("MIG none")
        out(f"    free: {'; '.join(free) or 'nothing'}")
        if g.memory_slices:
            out(f"    memory slices {g.memory_slices}  (. = free)")
            for letter, text in g.legend:
                out(f"      {letter} {text}")
    for d in node.others:
        out(f"  other device {d.name}: {d.state}")
