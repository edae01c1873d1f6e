"""`gpu-dra explain CLAIM|TEMPLATE|POD`: why a claim is pending (or where it would go), decided as
kube-scheduler decides it, from the live DeviceClasses, ResourceSlices and ResourceClaims."""
from __future__ import annotations

import argparse
import json
import sys

PROG = "gpu-dra explain"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="CLAIM|TEMPLATE|POD",
                        help="NAME (a claim, else a template, else a pod), or claim/NAME, template/NAME, pod/NAME")
    parser.add_argument("-n", "--namespace", default="default", help="namespace of the target (default: default)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG / ~/.kube/config)")
    parser.add_argument("-o", "--output", choices=["text", "json"], default="text", help="output format")


def run(args: argparse.Namespace) -> int:
    from dra.model.claimrequests import ClaimSpecError
    from dra.model.explain import CANNOT_EVALUATE, Target, explain, format_text
    from kube.client import ApiError, ApiUnavailable, KubeApi
    from kube.connect import ConnectError, api_client_from
    from kube.explainreads import ExplainTargetError, find_targets, read_cluster_state

    try:
        kube = KubeApi(api_client_from(args.kubeconfig))
        found = find_targets(kube, args.target, args.namespace)
        state = read_cluster_state(kube)
        result = explain([Target(n, c) for n, c in found.claims], state.classes, state.slices, state.claims,
                         state.taint_rules, state.nodes)
    except (ConnectError, ExplainTargetError, ClaimSpecError, ApiError, ApiUnavailable) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    result.notes = found.notes + result.notes
    if args.output == "json":
        print(json.dumps(result.to_dict(), indent=2))
    else:
        sys.stdout.write(format_text(result))
    # 0: allocatable or allocated, 1: not allocatable, 3: cannot be decided here.
    return 0 if result.allocatable else 3 if result.verdict == CANNOT_EVALUATE else 1
