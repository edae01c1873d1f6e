"""`gpu-dra demo` (what `make demo` runs): a real local control plane, a simulated GPU fleet, every example
allocated by the real scheduler.

Steps: start LocalCluster (etcd, kube-apiserver, kube-scheduler, kube-controller-manager; no kubelet) →
register the fleet's nodes → publish their ResourceSlices with the in-process slice controller, then once
more with a second controller instance as a restart would (it must write nothing) → create the DeviceClasses
→ apply every examples/*/claim.yaml in one namespace → wait until every claim is allocated and every pod
bound (pods never run) → print the slices, the allocations and the write counts; where this build has the
kubelet plugin, prepare one allocated claim through it and print the CDI spec it wrote.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.names import DEFAULT_DRIVER_NAME

PROG = "gpu-dra demo"
_REPO = Path(__file__).resolve().parents[1]
DEFAULT_FLEET = _REPO / "examples" / "fleets" / "demo.yaml"
DEFAULT_EXAMPLES = _REPO / "examples"
DEFAULT_NAMESPACE = "gpu-demo"
DESCRIBE_DEVICES = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet", default=str(DEFAULT_FLEET), metavar="FILE",
                        help="fleet file with the simulated nodes (default examples/fleets/demo.yaml)")
    parser.add_argument("--examples", default=str(DEFAULT_EXAMPLES), metavar="DIR",
                        help="folder whose sub-folders hold a claim.yaml each (default examples/)")
    parser.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME, metavar="NAME",
                        help=f"DRA driver name (default {DEFAULT_DRIVER_NAME}); the examples are rewritten for it")
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE, help=f"namespace for the examples "
                                                                       f"(default {DEFAULT_NAMESPACE})")
    parser.add_argument("--keep", action="store_true",
                        help="leave the cluster running and print its kubeconfig and how to stop it")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for every claim to be allocated (default 60)")
    parser.add_argument("--describe-node", metavar="NODE",
                        help="node whose ResourceSlice is described (default: the fleet's last node)")
    parser.add_argument("--no-prepare", action="store_true",
                        help="skip preparing a claim through the kubelet plugin")
    parser.add_argument("--log-level", default="WARNING", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"])


@dataclass
class DemoResult:
    """What the demo observed; `run` prints it, tests can look at it."""

    first_writes: dict[str, int] = field(default_factory=dict)
    restart_writes: dict[str, int] = field(default_factory=dict)
    device_classes: list[str] = field(default_factory=list)
    claims: list[Any] = field(default_factory=list)        # cli.demo_examples.PodClaim
    pending: list[str] = field(default_factory=list)       # one line per unallocated claim, with the reason
    prepared: Any = None                                   # cli.demo_cdi.PreparedClaim
    describe_node: str | None = None
    prepare_error: str | None = None


class DemoError(RuntimeError):
    """The demo cannot go on; the message says what failed."""


# A hook that gets the allocated claims once allocation is complete (the node side of the demo).
PreparedClaimHook = Callable[["DemoContext", list[Any]], Any]


@dataclass
class DemoContext:
    """The running cluster and what every step needs; `out` prints one line."""

    cluster: Any
    api: Any
    fleet_path: Path
    driver: str
    namespace: str
    out: Callable[[str], None]
    slices: list[dict[str, Any]] = field(default_factory=list)


def _step(out: Callable[[str], None], text: str) -> None:
    out(f"==> {text}")


def _section(out: Callable[[str], None], title: str) -> None:
    out("")
    out(f"### {title}")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    from cli.demo_examples import ExampleError, load_examples
    from cli.localcluster import ClusterError, LocalCluster
    from cli.publish_cmd import desired_fleet_pools
    from dra.sim.fleet import FleetError, load_fleet
    from dra.model.slices import ApiFeatures

    driver = args.driver_name
    try:
        from api.deviceclasses import validate_driver_name

        validate_driver_name(driver)
        fleet = load_fleet(args.fleet)
        # Node policies that do not fit the hardware fail here, before anything is started.
        desired_fleet_pools(fleet, args.fleet, driver, ApiFeatures.all())
        examples = load_examples(args.examples, driver)
        if args.timeout <= 0:
            raise ValueError(f"--timeout {args.timeout}: must be positive")
        if args.describe_node and args.describe_node not in fleet.node_names:
            raise ValueError(f"--describe-node {args.describe_node}: not a node of {args.fleet} "
                             f"(nodes: {', '.join(fleet.node_names)})")
    except (FleetError, ExampleError, ValueError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2

    out = _printer()
    cluster = LocalCluster(keep_workdir=args.keep)
    _step(out, "starting the local control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager)")
    try:
        cluster.start()
    except ClusterError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    out(f"    ready in {cluster.times}")
    api = cluster.api_client()
    ctx = DemoContext(cluster, api, Path(args.fleet), driver, args.namespace, out)
    hook = None if args.no_prepare else prepare_one_claim
    try:
        result = run_demo(ctx, fleet, examples, timeout=args.timeout, describe_node=args.describe_node,
                          prepared_claim_hook=hook)
        report(ctx, result)
    except (DemoError, ClusterError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    finally:
        api.close()
        if args.keep:
            _print_keep(cluster, args.namespace, out)
        else:
            _step(out, "stopping the control plane")
            cluster.stop()
    if result.pending:
        print(f"{PROG}: {len(result.pending)} claim(s) not allocated within {args.timeout:.0f}s:", file=sys.stderr)
        for line in result.pending:
            print(f"  {line}", file=sys.stderr)
        return 1
    if result.prepare_error:
        print(f"{PROG}: preparing a claim through the kubelet plugin failed: {result.prepare_error}", file=sys.stderr)
        return 1
    return 0


def _printer() -> Callable[[str], None]:
    def out(text: str) -> None:
        print(text, flush=True)
    return out


def run_demo(ctx: DemoContext, fleet: Any, examples: list[Any], *, timeout: float,
             describe_node: str | None = None, prepared_claim_hook: PreparedClaimHook | None = None) -> DemoResult:
    """Everything after the control plane is up. Raises DemoError when a step fails."""
    from api.deviceclasses import device_classes
    from cli.demo_examples import apply_objects, create_namespace, describe_pending, wait_for_allocation
    from cli.publish_cmd import SIMULATED_LABEL, desired_fleet_pools
    from controller.cluster import ClusterController
    from kube.client import SLICES, ApiError, ApiUnavailable, KubeApi
    from kube.resourceslices import Owner, PoolSyncError, ResourceSliceController
    from kube.serverversion import api_features

    out, kube, result = ctx.out, KubeApi(ctx.api), DemoResult()
    try:
        _step(out, f"registering {len(fleet.nodes)} simulated node(s): {', '.join(fleet.node_names)}")
        for node in fleet.nodes:
            ctx.cluster.add_node(node.name, {SIMULATED_LABEL: "true"})

        features = api_features(ctx.api)
        pools = desired_fleet_pools(fleet, str(ctx.fleet_path), ctx.driver, features)
        _step(out, f"publishing ResourceSlices of {ctx.fleet_path.name} with the slice controller (first start)")
        first = ResourceSliceController(ctx.api, ctx.driver, Owner.cluster())
        first.update(pools)
        first.run_once(timeout=60)
        result.first_writes = first.writes_by_operation
        _step(out, "restarting the slice controller (a new instance, same fleet)")
        second = ResourceSliceController(ctx.api, ctx.driver, Owner.cluster())
        second.update(pools)
        second.run_once(timeout=60)
        result.restart_writes = second.writes_by_operation

        classes = device_classes(ctx.driver)
        ClusterController(ctx.api, ctx.driver, classes).run_until_success(30)
        result.device_classes = [c["metadata"]["name"] for c in classes]
        _step(out, f"DeviceClasses in place: {', '.join(result.device_classes)}")

        create_namespace(kube, ctx.namespace)
        _step(out, f"applying {len(examples)} example(s) in namespace {ctx.namespace}: "
                   f"{', '.join(e.name for e in examples)}")
        for example in examples:
            try:
                apply_objects(kube, example.objects, ctx.namespace)
            except ApiError as exc:
                raise DemoError(f"example {example.name} ({example.path}) was rejected: {exc.message}") from exc
        started = time.monotonic()
        state = wait_for_allocation(kube, examples, ctx.namespace, timeout)
        result.claims = state.claims
        if state.complete:
            _step(out, f"every claim allocated and every pod bound in {time.monotonic() - started:.1f}s "
                       "(pods stay Pending: there is no kubelet)")
        else:
            result.pending = describe_pending(kube, state, ctx.namespace)
        ctx.slices = kube.list(SLICES, field_selector=f"spec.driver={ctx.driver}")["items"]
        result.describe_node = describe_node or fleet.node_names[-1]
        if prepared_claim_hook is not None and state.complete:
            try:
                result.prepared = prepared_claim_hook(ctx, state.claims)
            except DemoError as exc:    # the report still shows what the cluster did
                result.prepare_error = str(exc)
    except (ApiError, ApiUnavailable, PoolSyncError) as exc:
        raise DemoError(f"API server: {exc}") from exc
    except DemoError:
        raise
    except (RuntimeError, ValueError) as exc:   # e.g. ClusterController giving up, a policy the fleet breaks
        raise DemoError(str(exc)) from exc
    return result


def _describe_slices(ctx: DemoContext, node: str) -> None:
    """`kubectl get resourceslices`, then `kubectl describe` of the node's first slice with devices, cut
    to its first few devices."""
    from cli.demo_report import trim_describe

    out = ctx.out
    _section(out, "kubectl get resourceslices")
    out(ctx.cluster.kubectl("get", "resourceslices").stdout.rstrip())
    ours = sorted((s for s in ctx.slices if s["spec"].get("nodeName") == node), key=lambda s: s["metadata"]["name"])
    with_devices = [s for s in ours if s["spec"].get("devices")]
    if not with_devices:
        out(f"(node {node} has no slice with devices)")
        return
    name = with_devices[0]["metadata"]["name"]
    _section(out, f"kubectl describe resourceslice {name}   (node {node}; first {DESCRIBE_DEVICES} devices)")
    out(trim_describe(ctx.cluster.kubectl("describe", "resourceslice", name).stdout.rstrip(), DESCRIBE_DEVICES))


def report(ctx: DemoContext, result: DemoResult) -> None:
    from cli.demo_report import allocation_rows, format_table, format_writes

    out = ctx.out
    if result.describe_node:
        _describe_slices(ctx, result.describe_node)
    _section(out, f"kubectl get resourceclaims -n {ctx.namespace}")
    out(ctx.cluster.kubectl("get", "resourceclaims", "-n", ctx.namespace).stdout.rstrip())
    _section(out, f"Allocations (namespace {ctx.namespace})")
    rows = allocation_rows(result.claims, ctx.slices)
    out(format_table(rows) if rows else "(nothing allocated)")
    _section(out, "ResourceSlice controller")
    out(format_writes("first start", result.first_writes))
    out(format_writes("restart with the same fleet (second controller instance)", result.restart_writes))
    if sum(result.restart_writes.values()):
        raise DemoError(f"the restarted slice controller wrote {result.restart_writes}; with an unchanged fleet "
                        "it must write nothing")
    if result.prepared is not None:
        p = result.prepared
        _section(out, f"CDI spec written by the kubelet plugin of {p.claim.node} for claim {p.claim.claim} "
                      f"({p.claim.example})")
        out(f"# {p.spec_path.name}   CDI devices: {', '.join(p.cdi_device_ids)}")
        out(p.spec_text.rstrip())


def prepare_one_claim(ctx: DemoContext, claims: list[Any]) -> Any:
    """The node side: if this build has the kubelet plugin, run it for the node of one allocated claim,
    prepare that claim over the DRA socket and return the CDI spec it wrote (None when there is no plugin).

    The fleet-wide publisher has finished by now (it ran once, then once more as a restart), so the plugin
    takes over its node's pool alone; it publishes the same slices from the same fleet file."""
    from cli.demo_cdi import NodePlugin, NodePluginError, node_plugin_available, pick_claim
    from cli.demo_report import device_index

    if not node_plugin_available():
        return None
    claim = pick_claim(claims, device_index(ctx.slices), ctx.driver)
    if claim is None or claim.node is None:
        return None
    _step(ctx.out, f"starting `gpu-dra kubelet-plugin --node-name {claim.node}` and preparing claim {claim.claim} "
                   "over its DRA socket, as the kubelet would")
    plugin = NodePlugin(claim.node, ctx.fleet_path, ctx.driver, ctx.cluster.kubeconfig)
    try:
        plugin.start()
        prepared = plugin.prepare(claim, ctx.namespace)
        error = plugin.unprepare(claim, ctx.namespace)
        if error:
            raise NodePluginError(f"NodeUnprepareResources for claim {claim.claim}: {error}")
        return prepared
    except NodePluginError as exc:
        raise DemoError(f"{exc}\n--- plugin log ---\n{plugin.log_tail()}") from exc
    finally:
        plugin.stop()


def _print_keep(cluster: Any, namespace: str, out: Callable[[str], None]) -> None:
    pids = cluster.component_pids()
    if not pids or cluster.workdir is None:
        return
    stop = cluster.workdir / "stop.sh"
    stop.write_text(stop_script(pids, cluster.workdir))
    stop.chmod(0o755)
    _section(out, "The cluster keeps running")
    out(f"kubeconfig:  {cluster.kubeconfig}")
    out(f"try:         KUBECONFIG={cluster.kubeconfig} kubectl get resourceclaims -n {namespace}")
    out(f"kubectl:     {cluster.bin_dir / 'kubectl'}")
    out(f"stop it:     sh {stop}")


def stop_script(pids: dict[str, int], workdir: Path) -> str:
    """A POSIX shell script that stops the components in reverse start order, as LocalCluster.stop does
    (each leads its own process group: SIGTERM, up to five seconds, then SIGKILL), then removes the work
    directory."""
    groups = " ".join(str(pid) for pid in reversed(list(pids.values())))
    return (
        "#!/bin/sh\n"
        "# Stops the control plane left running by `gpu-dra demo --keep` and removes its files.\n"
        f"# Process groups: {', '.join(f'{name} {pid}' for name, pid in pids.items())}\n"
        # No work directory, no cluster: the ids may belong to other processes by now.
        f"[ -d '{workdir}' ] || {{ echo 'already stopped'; exit 0; }}\n"
        f"for g in {groups}; do\n"
        "  kill -TERM -$g 2>/dev/null || continue\n"
        "  i=0\n"
        "  while kill -0 -$g 2>/dev/null && [ $i -lt 25 ]; do sleep 0.2; i=$((i + 1)); done\n"
        "  kill -KILL -$g 2>/dev/null\n"
        "done\n"
        f"rm -rf '{workdir}'\n"
        "echo 'local control plane stopped'\n"
    )
