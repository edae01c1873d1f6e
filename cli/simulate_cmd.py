"""`gpu-dra simulate`: inject faults into a simulated node's GPUs while its plugin runs.

The plugin of a simulated node (``gpu-dra kubelet-plugin --fleet ...``) keeps its GPUs in a state file
(``--sim-state``); this command changes that file under its lock and the plugin notices within a fraction of a
second, as if the hardware had reported it:

    gpu-dra simulate xid --sim-state FILE --gpu 1 --xid 79            # XID on the whole GPU
    gpu-dra simulate xid --sim-state FILE --gpu GPU-... --xid 94 --gi 3 --ci 0   # on one MIG device
    gpu-dra simulate lose --sim-state FILE --gpu 1                    # the GPU falls off the bus
    gpu-dra simulate recover --sim-state FILE --gpu 1                 # answers again, declared healthy

``--gpu`` takes a GPU UUID or its index on the node.
"""
from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--sim-state", default=os.environ.get("SIM_STATE"), metavar="FILE",
                       help="the simulated node's GPU state file (the plugin's --sim-state) [env SIM_STATE]")
        p.add_argument("--gpu", required=True, metavar="UUID|INDEX", help="the GPU, by UUID or index on the node")
        return p

    xid = action("xid", "raise an XID critical-error event on a GPU or on one of its MIG devices")
    xid.add_argument("--xid", type=int, required=True, metavar="N", help="the XID number (1..65535)")
    xid.add_argument("--gi", type=int, metavar="G", help="GPU instance the event names (a MIG device)")
    xid.add_argument("--ci", type=int, metavar="C", help="compute instance the event names (needs --gi)")
    lose = action("lose", "make a GPU fall off the bus: every NVML call on it fails with GPU_IS_LOST")
    lose.add_argument("--reason", default=None, help="why it is lost (kept in the state file)")
    action("recover", "make a lost GPU answer again and declare the GPU healthy (its health taints go)")


def run(args: argparse.Namespace) -> int:
    from dra.sim.faults import DEFAULT_LOST_REASON, inject_xid, lose_gpu, recover_gpu
    from dra.sim.state import SimulatedHardwareState, SimulatedStateError

    if not args.sim_state:
        print("gpu-dra simulate: --sim-state (or SIM_STATE) is required", file=sys.stderr)
        return 2
    state = SimulatedHardwareState(args.sim_state)
    try:
        if args.action == "xid":
            event = inject_xid(state, args.gpu, args.xid, args.gi, args.ci)
            where = "" if args.gi is None else f" GPU instance {args.gi}" + (
                "" if args.ci is None else f" compute instance {args.ci}")
            print(f"XID {args.xid} on GPU {event.gpu_uuid}{where}: event {event.seq} recorded in {state.path}")
        elif args.action == "lose":
            gpu = lose_gpu(state, args.gpu, args.reason or DEFAULT_LOST_REASON)
            print(f"GPU {gpu.uuid} is lost ({gpu.lost})")
        else:
            gpu = recover_gpu(state, args.gpu)
            print(f"GPU {gpu.uuid} answers again and is declared healthy")
    except SimulatedStateError as exc:
        print(f"gpu-dra simulate {args.action}: {exc}", file=sys.stderr)
        return 2
    return 0
