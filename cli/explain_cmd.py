"""`gpu-dra explain CLAIM|TEMPLATE|POD`: why a claim is pending (or where it would go), decided as
kube-scheduler decides it, from the live DeviceClasses, ResourceSlices and ResourceClaims."""
from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

from cli.kubeflags import add_connection_arguments, dump, namespace_of

PROG = "gpu-dra explain"
# In --help (cli.main), with the statuses of cluster failures (cli.failures). A pre-flight script gates on these:
# a claim that cannot run is never 0.
EXIT_STATUS = {0: "allocatable (or allocated), and the node plugin will prepare it",
               1: "cannot run: not allocatable, or the node plugin will not prepare its config",
               2: "bad arguments, or no such claim, template or pod",
               3: "cannot evaluate (a CEL function outside Kubernetes' own)"}
USES_CLUSTER = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="CLAIM|TEMPLATE|POD",
                        help="NAME (a claim, else a template, else a pod), or claim/NAME, template/NAME, pod/NAME")
    add_connection_arguments(parser, namespaced=True)
    parser.add_argument("-o", "--output", choices=["text", "json", "yaml"], default="text",
                        help="output format (default: text, the verdict first)")


def run(args: argparse.Namespace) -> int:
    # A short-lived command that parses a cluster's slices page by page: the cycle collector would scan the
    # millions of objects each page makes again and again (half the time at 1000 nodes), and none form cycles.
    gc.disable()
    from cli.failures import EXIT_USAGE, report
    from dra.scheduling.claimrequests import ClaimSpecError
    from kube.client import ApiError, ApiUnavailable, KubeApi
    from kube.connect import ConnectError, api_client_from
    from ops.explain.reads import ExplainTargetError, explain_target
    from ops.explain.verdict import format_text

    api = None
    try:
        namespace = namespace_of(args)
        api = api_client_from(args.kubeconfig, args.context)
        result = explain_target(KubeApi(api), args.target, namespace)
    except (ConnectError, ExplainTargetError, ClaimSpecError, ApiError, ApiUnavailable) as exc:
        return report(PROG, exc, api, default=EXIT_USAGE)
    if args.output in ("json", "yaml"):
        sys.stdout.write(dump(result.to_dict(), args.output))
    else:
        sys.stdout.write(format_text(result))
    return exit_status(result)


def exit_status(result: Any) -> int:
    """EXIT_STATUS of an explanation (ops.explain.verdict.Explanation)."""
    from ops.explain.verdict import CANNOT_EVALUATE

    if result.config_problems:      # the scheduler would place it; the plugin then refuses to prepare it
        return 1
    return 0 if result.allocatable else 3 if result.verdict == CANNOT_EVALUATE else 1
