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
    from dra.scheduling.claimrequests import ClaimSpecError
    from kube.client import ApiError, ApiUnavailable, KubeApi
    from kube.connect import ConnectError, api_client_from
    from ops.explain.reads import ExplainTargetError, explain_target
    from ops.explain.verdict import CANNOT_EVALUATE, format_text

    try:
        result = explain_target(KubeApi(api_client_from(args.kubeconfig)), args.target, args.namespace)
    except (ConnectError, ExplainTargetError, ClaimSpecError, ApiError, ApiUnavailable) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.output == "json":
        print(json.dumps(result.to_dict(), indent=2))
    else:
        sys.stdout.write(format_text(result))
    # 0: allocatable or allocated, 1: not allocatable, 3: cannot be decided here.
    return 0 if result.allocatable else 3 if result.verdict == CANNOT_EVALUATE else 1
