"""`gpu-dra slices`: print the ResourceSlices a simulated node would publish, as YAML, and check them.

The devices come from the fleet file's simulated GPUs (through the same inventory code as on a real node) and
the node's policy. The output is exactly what would be sent to the API server (pool generation 1), so it can be
read, diffed or applied to a test cluster. Validation errors make the command exit with status 1.
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import Any

import yaml

from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet", required=True, metavar="FILE", help="fleet file with the simulated nodes")
    parser.add_argument("--node", metavar="NAME", help="only this node (default: every node of the fleet)")
    parser.add_argument("--driver-name", default=None, metavar="NAME",
                        help=f"DRA driver name (default {DEFAULT_DRIVER_NAME}, or {NVIDIA_DRIVER_NAME} with --compat-nvidia)")
    parser.add_argument("--compat-nvidia", action="store_true",
                        help=f"NVIDIA compatibility mode: publish as {NVIDIA_DRIVER_NAME}")
    parser.add_argument("--server-version", default="1.37", metavar="1.MINOR",
                        help="Kubernetes version of the API server; decides which ResourceSlice features are used "
                             "(default 1.37)")


def parse_server_version(text: str) -> int:
    """"1.37", "v1.35.2" -> 37 / 35. ValueError otherwise."""
    m = re.fullmatch(r"v?1\.(\d+)(\.\d+)?", text.strip())
    if not m:
        raise ValueError(f"--server-version {text!r}: expected 1.MINOR, e.g. 1.37")
    minor = int(m.group(1))
    if minor < 34:
        raise ValueError(f"--server-version {text!r}: resource.k8s.io/v1 needs Kubernetes 1.34 or later")
    return minor


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data: object) -> bool:
        return True


def run(args: argparse.Namespace) -> int:
    from dra.model.devices import DeviceModelError
    from dra.model.policy import PolicyError, parse_node_policy
    from dra.model.slices import ApiFeatures, plan_pool, resource_slice_objects, validate_pool
    from dra.node.inventory import discover_once
    from dra.sim.fleet import FleetError, load_fleet, nvml_for_node
    from kube.resourceslices import slice_name

    prog = "gpu-dra slices"
    if args.compat_nvidia and args.driver_name and args.driver_name != NVIDIA_DRIVER_NAME:
        print(f"{prog}: --compat-nvidia publishes as {NVIDIA_DRIVER_NAME}; it cannot be combined with "
              f"--driver-name {args.driver_name}", file=sys.stderr)
        return 2
    driver = NVIDIA_DRIVER_NAME if args.compat_nvidia else (args.driver_name or DEFAULT_DRIVER_NAME)
    try:
        features = ApiFeatures.for_server(parse_server_version(args.server_version))
        fleet = load_fleet(args.fleet)
        nodes = [fleet.node(args.node)] if args.node else list(fleet.nodes)
    except (ValueError, OSError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2

    objects: list[dict[str, Any]] = []
    failed = False
    for node in nodes:
        try:
            policy = parse_node_policy(node.policy, source=f"{args.fleet}: node {node.name}: policy")
            plan = plan_pool(discover_once(nvml_for_node(node)), policy, driver, node.name, features)
        except (FleetError, PolicyError, DeviceModelError) as exc:
            print(f"{prog}: node {node.name}: {exc}", file=sys.stderr)
            return 2
        for w in plan.warnings:
            print(f"{prog}: node {node.name}: warning: {w}", file=sys.stderr)
        for note in plan.notes:
            print(f"{prog}: node {node.name}: Kubernetes {args.server_version}: {note}", file=sys.stderr)
        errors = validate_pool(plan.slices)
        for e in errors:
            print(f"{prog}: node {node.name}: invalid ResourceSlice: {e}", file=sys.stderr)
        failed = failed or bool(errors)
        names = [slice_name(driver, node.name, i) for i in range(len(plan.slices))]  # as the controller names them
        objects.extend(resource_slice_objects(plan.slices, names))
    sys.stdout.write(yaml.dump_all(objects, Dumper=_NoAliases, sort_keys=False, explicit_start=True, width=10_000))
    return 1 if failed else 0
