"""`gpu-dra explain CLAIM|TEMPLATE|POD`: why a claim is pending (or where it would go), decided as
kube-scheduler decides it, from the live DeviceClasses, ResourceSlices and ResourceClaims."""
from __future__ import annotations

import argparse
import sys

from cli.kubeflags import add_connection_arguments, dump, namespace_of

PROG = "gpu-dra explain"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="CLAIM|TEMPLATE|POD",
                        help="NAME (a claim, else a template, else a pod), or claim/NAME, template/NAME, pod/NAME")
    add_connection_arguments(parser, namespaced=True)
    parser.add_argument("-o", "--output", choices=["text", "json", "yaml"], default="text",
                        help="output format (default: text, the verdict first)")


def run(args: argparse.Namespace) -> int:
    from dra.scheduling.claimrequests import ClaimSpecError
    from kube.client import ApiError, ApiUnavailable, KubeApi
    from kube.connect import ConnectError, api_client_from
    from ops.explain.reads import ExplainTargetError, explain_target
    from ops.explain.verdict import CANNOT_EVALUATE, format_text

    try:
        namespace = namespace_of(args)
        result = explain_target(KubeApi(api_client_from(args.kubeconfig, args.context)), args.target, namespace)
    except (ConnectError, ExplainTargetError, ClaimSpecError, ApiError, ApiUnavailable) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.output in ("json", "yaml"):
        sys.stdout.write(dump(result.to_dict(), args.output))
    else:
        sys.stdout.write(format_text(result))
    # 0: allocatable or allocated, 1: not allocatable, 3: cannot be decided here.
    return 0 if result.allocatable else 3 if result.verdict == CANNOT_EVALUATE else 1
