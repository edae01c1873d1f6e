"""`gpu-dra demo` (what `make demo` runs): a real local control plane, a simulated GPU fleet, every example
allocated by the real scheduler, and the pods on one node actually running.

Steps: start LocalCluster (etcd, kube-apiserver, kube-scheduler, kube-controller-manager) → start a real node
for the fleet's first node (`testbed.demo_node`: kubelet, containerd, runc; when it cannot start, one line says why
and the demo only schedules) → register the fleet's other nodes (no kubelet) → publish their ResourceSlices
with the in-process slice controller, then once more with a second controller instance as a restart would (it
must write nothing) → run `gpu-dra kubelet-plugin` for the real node (it registers with the kubelet, then
publishes that node's slices) → create the DeviceClasses → apply every examples/*/claim.yaml in one namespace,
pods made runnable on the real node (`testbed.podprobe`: busybox printing what the container sees) → wait until
every claim is allocated and every pod bound, then until the real node's pods run → print the slices, the
allocations with each pod's phase and what its container saw, the write counts and the CDI spec of one claim
(the kubelet had it prepared; without a real node the demo prepares it over the plugin's DRA socket).
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
from cli.options import add_log_level

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
    parser.add_argument("--real-node", metavar="NODE",
                        help="fleet node run by a real kubelet, containerd and runc (default: the fleet's first)")
    parser.add_argument("--no-real-node", action="store_true",
                        help="no real node: schedule only (pods stay Pending)")
    add_log_level(parser, "warning")


@dataclass
class DemoResult:
    """What the demo observed; `run` prints it, tests can look at it."""

    first_writes: dict[str, int] = field(default_factory=dict)
    restart_writes: dict[str, int] = field(default_factory=dict)
    device_classes: list[str] = field(default_factory=list)
    claims: list[Any] = field(default_factory=list)        # testbed.demo_examples.PodClaim
    pending: list[str] = field(default_factory=list)       # one line per unallocated claim, with the reason
    prepared: Any = None                                   # testbed.demo_cdi.PreparedClaim or demo_node.NodeCdiSpec
    describe_node: str | None = None
    prepare_error: str | None = None
    pods: dict[str, Any] = field(default_factory=dict)     # pod -> testbed.demo_node.PodRun
    not_running: list[str] = field(default_factory=list)   # one line per real-node pod that did not run


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
    real: Any = None                                       # testbed.demo_node.RealNode, or None: scheduling only


def _step(out: Callable[[str], None], text: str) -> None:
    out(f"==> {text}")


def _section(out: Callable[[str], None], title: str) -> None:
    out("")
    out(f"### {title}")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from cli.publish_cmd import desired_fleet_pools
    from dra.model.slices import ApiFeatures
    from dra.sim.fleet import FleetError, load_fleet
    from testbed.demo_examples import ExampleError, load_examples
    from testbed.localcluster import ClusterError, LocalCluster, set_build_progress

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
        if args.real_node and args.real_node not in fleet.node_names:
            raise ValueError(f"--real-node {args.real_node}: not a node of {args.fleet} "
                             f"(nodes: {', '.join(fleet.node_names)})")
    except (FleetError, ExampleError, ValueError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2

    out = _printer()
    # A cold build of the control plane or the node takes minutes: its scripts' log lines show it going on.
    set_build_progress(lambda line: out(f"    {line}"))
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
    if not args.no_real_node:
        ctx.real = start_real_node(cluster, args.real_node or fleet.node_names[0], out)
    hook = None if args.no_prepare else (spec_from_real_node if ctx.real is not None else prepare_one_claim)
    try:
        result = run_demo(ctx, fleet, examples, timeout=args.timeout, describe_node=args.describe_node,
                          prepared_claim_hook=hook)
        report(ctx, result)
    except (DemoError, ClusterError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    finally:
        api.close()
        if ctx.real is not None:
            _step(out, f"stopping the real node {ctx.real.name} (its pods, containerd, kubelet; the host as found)")
            try:
                ctx.real.stop()
            except ClusterError as exc:
                print(f"{PROG}: {exc}", file=sys.stderr)
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
    if result.not_running:
        print(f"{PROG}: {len(result.not_running)} pod(s) on the real node did not run within {args.timeout:.0f}s:",
              file=sys.stderr)
        for line in result.not_running:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


def start_real_node(cluster: Any, name: str, out: Callable[[str], None]) -> Any:
    """The real node for fleet node `name`, or None after one line saying why there is none."""
    from cli.publish_cmd import SIMULATED_LABEL
    from testbed.demo_node import RealNode, RealNodeUnavailable

    _step(out, f"starting a real node for {name}: kubelet, containerd and runc (built on first use: minutes)")
    try:
        real = RealNode.start(cluster, name, {SIMULATED_LABEL: "true"})
    except RealNodeUnavailable as exc:
        out(f"==> no real node ({exc}): scheduling only, the pods will stay Pending")
        return None
    out(f"    ready in {sum(real.node.times.values()):.1f}s")
    return real


def _printer() -> Callable[[str], None]:
    def out(text: str) -> None:
        print(text, flush=True)
    return out


def run_demo(ctx: DemoContext, fleet: Any, examples: list[Any], *, timeout: float,
             describe_node: str | None = None, prepared_claim_hook: PreparedClaimHook | None = None) -> DemoResult:
    """Everything after the control plane is up. Raises DemoError when a step fails."""
    from api.deviceclasses import device_classes
    from cli.publish_cmd import SIMULATED_LABEL, desired_fleet_pools
    from controller.cluster import ClusterController
    from kube.client import SLICES, ApiError, ApiUnavailable, KubeApi
    from kube.resourceslices import Owner, PoolSyncError, ResourceSliceController
    from kube.serverversion import api_features
    from testbed.demo_examples import apply_objects, create_namespace, describe_pending, wait_for_allocation
    from testbed.demo_node import wait_for_pods
    from testbed.localnode import cuda_probe_image
    from testbed.podprobe import for_local_node

    out, kube, result = ctx.out, KubeApi(ctx.api), DemoResult()
    real = ctx.real
    try:
        # A real node registered its Node itself (its kubelet) and publishes its slices itself (its plugin).
        others = [n.name for n in fleet.nodes if real is None or n.name != real.name]
        _step(out, f"registering {len(others)} simulated node(s) without a kubelet: {', '.join(others) or '-'}")
        for name in others:
            ctx.cluster.add_node(name, {SIMULATED_LABEL: "true"})

        features = api_features(ctx.api)
        pools = {name: pool for name, pool in desired_fleet_pools(fleet, str(ctx.fleet_path), ctx.driver,
                                                                   features).items() if name in others}
        _step(out, f"publishing ResourceSlices of {', '.join(others) or 'no node'} with the slice controller "
                   "(first start)")
        first = ResourceSliceController(ctx.api, ctx.driver, Owner.cluster())
        first.update(pools)
        first.run_once(timeout=60)
        result.first_writes = first.writes_by_operation
        _step(out, "restarting the slice controller (a new instance, same fleet)")
        second = ResourceSliceController(ctx.api, ctx.driver, Owner.cluster())
        second.update(pools)
        second.run_once(timeout=60)
        result.restart_writes = second.writes_by_operation
        if real is not None:
            _start_real_node_plugin(ctx, kube)

        classes = device_classes(ctx.driver)
        ClusterController(ctx.api, ctx.driver, classes).run_until_success(30)
        result.device_classes = [c["metadata"]["name"] for c in classes]
        _step(out, f"DeviceClasses in place: {', '.join(result.device_classes)}")

        create_namespace(kube, ctx.namespace)
        _step(out, f"applying {len(examples)} example(s) in namespace {ctx.namespace}: "
                   f"{', '.join(e.name for e in examples)}")
        for example in examples:
            objects = example.objects if real is None else [
                for_local_node(o, cuda_probe_image()) if o["kind"] == "Pod" else o for o in example.objects]
            try:
                apply_objects(kube, objects, ctx.namespace)
            except ApiError as exc:
                raise DemoError(f"example {example.name} ({example.path}) was rejected: {exc.message}") from exc
        started = time.monotonic()
        state = wait_for_allocation(kube, examples, ctx.namespace, timeout)
        result.claims = state.claims
        if state.complete:
            why = ("pods stay Pending: there is no kubelet" if real is None else
                   f"pods elsewhere than on {real.name} stay Pending: only {real.name} has a kubelet")
            _step(out, f"every claim allocated and every pod bound in {time.monotonic() - started:.1f}s ({why})")
        else:
            result.pending = describe_pending(kube, state, ctx.namespace)
        pods = [p["metadata"]["name"] for e in examples for p in e.pods]
        if real is not None and state.complete:
            started = time.monotonic()
            result.pods = wait_for_pods(kube, real, ctx.namespace, pods, timeout)
            result.not_running = _not_running(kube, ctx.namespace, real.name, result.pods)
            if not result.not_running:
                _step(out, f"the pods on {real.name} run, each printed what its container sees, in "
                           f"{time.monotonic() - started:.1f}s")
        else:
            result.pods = wait_for_pods(kube, real, ctx.namespace, pods, 0) if real is not None else {
                name: _pod_run(kube, ctx.namespace, name) for name in pods}
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


def _start_real_node_plugin(ctx: DemoContext, kube: Any) -> None:
    """`gpu-dra kubelet-plugin` for the real node; returns once the kubelet registered it and its slices are
    published (a complete pool)."""
    from kube.client import SLICES
    from testbed.demo_node import PLUGIN_TIMEOUT, NodePluginError

    real = ctx.real
    _step(ctx.out, f"starting `gpu-dra kubelet-plugin --node-name {real.name}`: it registers with the kubelet, "
                   f"then publishes {real.name}'s ResourceSlices")
    try:
        real.start_plugin(ctx.fleet_path, ctx.driver)
    except NodePluginError as exc:
        raise DemoError(str(exc)) from exc
    deadline = time.monotonic() + PLUGIN_TIMEOUT
    while True:
        slices = kube.list(SLICES, field_selector=f"spec.driver={ctx.driver},spec.nodeName={real.name}")["items"]
        if slices:
            newest = max(s["spec"]["pool"]["generation"] for s in slices)
            current = [s for s in slices if s["spec"]["pool"]["generation"] == newest]
            if len(current) == current[0]["spec"]["pool"]["resourceSliceCount"]:
                return
        if time.monotonic() > deadline:
            raise DemoError(f"the kubelet plugin of {real.name} published no complete pool within "
                            f"{PLUGIN_TIMEOUT:.0f}s\n--- plugin log ---\n{real.plugin.log_tail()}")
        time.sleep(0.2)


def _pod_run(kube: Any, namespace: str, name: str) -> Any:
    from testbed.demo_examples import collection
    from testbed.demo_node import PodRun

    pod = kube.get(f"{collection('Pod', namespace)}/{name}")
    return PodRun(pod.get("status", {}).get("phase", "Unknown"), pod["spec"].get("nodeName"))


def _not_running(kube: Any, namespace: str, node: str, runs: dict[str, Any]) -> list[str]:
    """One line per pod on the real node that is not Running with its probes done, with its last events."""
    lines = []
    for name, run in runs.items():
        if run.node != node or (run.phase == "Running" and all(v.complete for v in run.views.values())):
            continue
        events = kube.list(f"/api/v1/namespaces/{namespace}/events",
                           field_selector=f"involvedObject.kind=Pod,involvedObject.name={name}")["items"]
        last = "; ".join(f"{e.get('reason')}: {(e.get('message') or '').strip()}" for e in events[-2:])
        lines.append(f"pod {name}: {run.phase}" + (f" ({last})" if last else ""))
    return lines


def _describe_slices(ctx: DemoContext, node: str) -> None:
    """`kubectl get resourceslices`, then `kubectl describe` of the node's first slice with devices, cut
    to its first few devices."""
    from testbed.demo_report import trim_describe

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
    from testbed.demo_report import allocation_rows, container_lines, format_table, format_writes

    out = ctx.out
    if result.describe_node:
        _describe_slices(ctx, result.describe_node)
    _section(out, f"kubectl get resourceclaims -n {ctx.namespace}")
    out(ctx.cluster.kubectl("get", "resourceclaims", "-n", ctx.namespace).stdout.rstrip())
    _section(out, f"Allocations (namespace {ctx.namespace})")
    phases = {name: run.phase for name, run in result.pods.items()}
    rows = allocation_rows(result.claims, ctx.slices, phases)
    out(format_table(rows) if rows else "(nothing allocated)")
    if result.pods:
        out("")
        out("What each pod's container saw (its own ls /dev/nvidia* and env, from its log):")
        for line in container_lines(result.pods, ctx.real.name if ctx.real is not None else None):
            out(f"  {line}")
    _section(out, "ResourceSlice controller")
    out(format_writes("first start", result.first_writes))
    out(format_writes("restart with the same fleet (second controller instance)", result.restart_writes))
    if sum(result.restart_writes.values()):
        raise DemoError(f"the restarted slice controller wrote {result.restart_writes}; with an unchanged fleet "
                        "it must write nothing")
    if result.prepared is not None:
        p = result.prepared
        how = "prepared by the kubelet" if ctx.real is not None else "prepared over its DRA socket by the demo"
        _section(out, f"CDI spec written by the kubelet plugin of {p.claim.node} for claim {p.claim.claim} "
                      f"({p.claim.example}; {how})")
        out(f"# {p.spec_path.name}   CDI devices: {', '.join(p.cdi_device_ids)}")
        out(_readable_spec(p.spec_text))
    _status(ctx)


def _status(ctx: DemoContext) -> None:
    """`gpu-dra status` of the real node (else the fleet's first node): who holds which GPU, MIG rows drawn."""
    from cli.status_cmd import collect, render_node
    from ops.status.reads import StatusReadError

    nodes = sorted({(s.get("spec") or {}).get("nodeName", "") for s in ctx.slices} - {""})
    node = ctx.real.name if ctx.real is not None else (nodes[0] if nodes else None)
    if node is None:
        return
    _section(ctx.out, f"gpu-dra status {node}")
    try:
        nodes_status = collect(ctx.api, ctx.driver, node)
    except StatusReadError as exc:
        raise DemoError(f"gpu-dra status {node}: {exc}") from exc
    for n in nodes_status:
        render_node(n, ctx.out)


def _readable_spec(text: str) -> str:
    """A CDI spec as people read it: JSON specs (one line on disk) indented, YAML ones as they are."""
    import json

    try:
        return json.dumps(json.loads(text), indent=2)
    except ValueError:
        return text.rstrip()


def spec_from_real_node(ctx: DemoContext, claims: list[Any]) -> Any:
    """The CDI spec that the real node's plugin wrote when the kubelet prepared one of the node's claims (a MIG
    partition if there is one: it is created at prepare), or None."""
    from testbed.demo_cdi import pick_claim
    from testbed.demo_node import prepared_cdi_spec
    from testbed.demo_report import device_index

    claim = pick_claim([c for c in claims if c.node == ctx.real.name], device_index(ctx.slices), ctx.driver)
    return prepared_cdi_spec(ctx.real, claim) if claim is not None else None


def prepare_one_claim(ctx: DemoContext, claims: list[Any]) -> Any:
    """The node side: if this build has the kubelet plugin, run it for the node of one allocated claim,
    prepare that claim over the DRA socket and return the CDI spec it wrote (None when there is no plugin).

    The node's slices stay those of the fleet-wide publisher: with no kubelet to confirm its registration,
    the plugin publishes nothing."""
    from testbed.demo_cdi import NodePlugin, NodePluginError, node_plugin_available, pick_claim
    from testbed.demo_report import device_index

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
