"""`gpu-dra doctor`: checks that this node (or a simulated fleet node) can run GPU containers with this driver:
NVML, the driver root and its layout, the CDI hook, a whole-GPU CDI spec against the node, a container made from
it (as root), the sharing tools. One PASS/WARN/FAIL/SKIP line per check, with the fix; exit 0 when nothing failed.
It changes no GPU setting. Run it on the node or with `kubectl exec` in the plugin pod (its environment gives the
plugin's paths)."""
from __future__ import annotations

import argparse
import os
import sys

from cli.inventory_cmd import add_node_path_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet", metavar="FILE", help="check a simulated node of this fleet file (with --node)")
    parser.add_argument("--node", metavar="NAME", help="the fleet's node to check")
    add_node_path_arguments(parser)
    parser.add_argument("--host-driver-root", default=os.environ.get("NVIDIA_HOST_DRIVER_ROOT") or None,
                        metavar="DIR", help="the driver root as the host sees it, for CDI host paths (default: "
                                            "--driver-root) [env NVIDIA_HOST_DRIVER_ROOT]")
    parser.add_argument("--cdi-hook-path", default=os.environ.get("CDI_HOOK_PATH") or None, metavar="FILE",
                        help="host path of nvidia-cdi-hook (default: one in the driver root) [env CDI_HOOK_PATH]")
    parser.add_argument("--probe", metavar="FILE", default=os.environ.get("GPU_DRA_CUDA_PROBE") or None,
                        help="a cuda-probe program run in the container check (default: the libraries are loaded "
                             "with ctypes) [env GPU_DRA_CUDA_PROBE]")
    parser.add_argument("--sys-root", default=os.environ.get("SYS_ROOT") or "/sys", metavar="DIR",
                        help="where this process sees /sys, for the NVIDIA PCI devices (default /sys) [env SYS_ROOT]")
    parser.add_argument("--no-container", action="store_true",
                        help="skip the container check (a private mount namespace, needs root)")


def run(args: argparse.Namespace) -> int:
    from dra.node.nodeobjects import NodeObjects, NodePaths, NodeSetupError
    from ops.doctor.checks import DoctorOptions, exit_code, render, run_checks

    if bool(args.fleet) != bool(args.node):
        print("gpu-dra doctor: --fleet and --node go together", file=sys.stderr)
        return 2
    paths = NodePaths(driver_root=args.driver_root, host_driver_root=args.host_driver_root, dev_root=args.dev_root,
                      proc_root=args.proc_root, cdi_hook_path=args.cdi_hook_path)
    if args.fleet:
        from dra.sim.nodeobjects import SimulatedNodeObjects

        try:
            objects: NodeObjects = SimulatedNodeObjects.from_fleet(args.fleet, args.node, paths)
        except NodeSetupError as exc:
            print(f"gpu-dra doctor: {exc}", file=sys.stderr)
            return 2
        where = f"simulated node {args.node} of {args.fleet}"
    else:
        objects = NodeObjects(paths)
        where = "this node"
    print(f"gpu-dra doctor: {where}; driver root {paths.driver_root}"
          + (f" (host {paths.host_driver_root})" if paths.host_driver_root else "")
          + f", dev root {paths.dev_root}, proc root {paths.proc_root}")
    checks = run_checks(objects, DoctorOptions(probe=args.probe, container=not args.no_container,
                                               sys_root=args.sys_root))
    print(render(checks))
    return exit_code(checks)
