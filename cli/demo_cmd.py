"""`gpu-dra demo` (what `make demo` runs): a real local control plane, a simulated GPU fleet, every example
allocated by the real scheduler, and every example pod actually running on the node the scheduler picked.

Steps: start LocalCluster (etcd, kube-apiserver, kube-scheduler, kube-controller-manager) → start a real node
for each fleet node (`--real-nodes`; `testbed.demo_node`: kubelet, containerd, runc per node, started at once;
when one cannot start, one line says why and its pods stay Pending) → register the fleet's other nodes (no
kubelet) → publish their ResourceSlices with the in-process slice controller, then once more with a second
controller instance as a restart would (it must write nothing) → run `gpu-dra kubelet-plugin` for each real
node (it registers with its kubelet, then publishes that node's slices) → create the DeviceClasses → apply
every examples/*/claim.yaml in one namespace, pods made runnable on the real nodes (`testbed.podprobe`: the
cuda-probe image printing what the container sees) → wait until every claim is allocated and every pod bound,
then until the real nodes' pods run → print the slices, the allocations with each pod's phase and what its
container saw (and whether the pods of a shared claim see the same GPU), the write counts and the CDI spec of
one claim (the kubelet had it prepared; without a real node the demo prepares it over the plugin's DRA socket).
Exits non-zero when a pod on a real node does not run, or the pods of a shared claim see different GPUs.
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
# A real node (kubelet, containerd, the plugin, the pods' shims) takes a few hundred MiB: below this much
# available memory the demo runs one real node unless --real-nodes says otherwise.
SMALL_MACHINE_MIB = 3072


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
    parser.add_argument("--real-nodes", type=int, metavar="N",
                        help="how many fleet nodes run a real kubelet, containerd, runc and kubelet plugin, so "
                             "their pods run (default: every node of the fleet, or those --real-node names; 1 "
                             f"with less than {SMALL_MACHINE_MIB} MiB of memory available; 0: schedule only, "
                             "the pods stay Pending)")
    parser.add_argument("--real-node", metavar="NODE", action="append",
                        help="a fleet node to run for real, before the others (repeatable)")
    parser.add_argument("--no-real-node", action="store_true", help="the same as --real-nodes 0")
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
    shared: list[Any] = field(default_factory=list)        # testbed.demo_report.SharedClaim


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
    reals: list[Any] = field(default_factory=list)         # testbed.demo_node.RealNode; none: scheduling only

    @property
    def real_names(self) -> list[str]:
        return [r.name for r in self.reals]


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
        real_names = real_node_names(fleet.node_names, args.real_node or [],
                                     0 if args.no_real_node else args.real_nodes, args.fleet)
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
    try:
        ctx.reals, failed_nodes = start_real_nodes(cluster, small_machine_cap(real_names, args,
                                                                              available_memory_mib(), out), out)
        hook = None if args.no_prepare else (spec_from_real_node if ctx.reals else prepare_one_claim)
        result = run_demo(ctx, fleet, examples, timeout=args.timeout, describe_node=args.describe_node,
                          prepared_claim_hook=hook)
        report(ctx, result)
    except (DemoError, ClusterError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    finally:
        api.close()
        if ctx.reals:
            _step(out, f"stopping the real node{'s' if len(ctx.reals) > 1 else ''} {', '.join(ctx.real_names)} "
                       "(pods, plugin, containerd, kubelet; the host as found)")
            for problem in stop_real_nodes(ctx.reals):
                print(f"{PROG}: {problem}", file=sys.stderr)
        if args.keep:
            _print_keep(cluster, args.namespace, out)
        else:
            _step(out, "stopping the control plane")
            cluster.stop()
    _closing(ctx, result)
    if result.pending:
        print(f"{PROG}: {len(result.pending)} claim(s) not allocated within {args.timeout:.0f}s:", file=sys.stderr)
        for line in result.pending:
            print(f"  {line}", file=sys.stderr)
        return 1
    if result.prepare_error:
        print(f"{PROG}: preparing a claim through the kubelet plugin failed: {result.prepare_error}", file=sys.stderr)
        return 1
    if result.not_running:
        print(f"{PROG}: {len(result.not_running)} pod(s) on a real node did not run within {args.timeout:.0f}s:",
              file=sys.stderr)
        for line in result.not_running:
            print(f"  {line}", file=sys.stderr)
        return 1
    different = [s.line() for s in result.shared if not s.same_gpu]
    if different:
        for line in different:
            print(f"{PROG}: {line}", file=sys.stderr)
        return 1
    if failed_nodes:
        # Some real nodes ran and others could not start: their pods stayed Pending, which is a failure
        # (only a machine where no node can start at all runs the demo as scheduling only).
        print(f"{PROG}: real node(s) {', '.join(failed_nodes)} could not start: their pods stayed Pending",
              file=sys.stderr)
        return 1
    return 0


def _closing(ctx: DemoContext, result: DemoResult) -> None:
    from testbed.demo_report import closing_line

    _step(ctx.out, closing_line(result.pods, ctx.real_names))


def real_node_names(fleet_nodes: list[str], named: list[str], count: int | None, fleet_file: str) -> list[str]:
    """The fleet nodes that run for real: those `named` first, then the fleet's others in order, `count` of
    them (default: the named ones, or else every node). Raises ValueError naming a bad option."""
    for name in named:
        if name not in fleet_nodes:
            raise ValueError(f"--real-node {name}: not a node of {fleet_file} (nodes: {', '.join(fleet_nodes)})")
    if count is not None and not 0 <= count <= len(fleet_nodes):
        raise ValueError(f"--real-nodes {count}: must be between 0 and the fleet's {len(fleet_nodes)} node(s)")
    order = list(dict.fromkeys([*named, *fleet_nodes]))
    return order[:count if count is not None else (len(named) or len(fleet_nodes))]


def available_memory_mib() -> int | None:
    """MemAvailable of /proc/meminfo in MiB (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def small_machine_cap(names: list[str], args: argparse.Namespace, available_mib: int | None,
                      out: Callable[[str], None]) -> list[str]:
    """`names`, cut to one on a machine with less than SMALL_MACHINE_MIB available, unless the real nodes
    were asked for (--real-nodes, --real-node); says so in one line."""
    if len(names) <= 1 or args.real_nodes is not None or args.real_node or available_mib is None \
            or available_mib >= SMALL_MACHINE_MIB:
        return names
    out(f"==> one real node ({names[0]}): this machine has {available_mib} MiB of memory available, under "
        f"{SMALL_MACHINE_MIB} MiB; --real-nodes {len(names)} runs all of them")
    return names[:1]


def start_real_nodes(cluster: Any, names: list[str], out: Callable[[str], None]) -> tuple[list[Any], list[str]]:
    """The real nodes for fleet nodes `names`, started at once, and the names of those that could not start
    while others did; one line for each that could not start, saying why (its pods stay Pending). When none
    can start for one reason (not root, no cgroups) the demo schedules only: no failed names."""
    from cli.publish_cmd import SIMULATED_LABEL
    from testbed.demo_node import RealNodeUnavailable, start_real_nodes

    if not names:
        return [], []
    _step(out, f"starting a real node for {', '.join(names)}: kubelet, containerd and runc each "
               "(built on first use: minutes)")
    started = start_real_nodes(cluster, names, {SIMULATED_LABEL: "true"})
    failed = {name: str(r) for name, r in started.items() if isinstance(r, RealNodeUnavailable)}
    reals = [r for r in started.values() if not isinstance(r, RealNodeUnavailable)]
    if failed and not reals and len(set(failed.values())) == 1:
        out(f"==> no real node ({next(iter(failed.values()))}): scheduling only, the pods will stay Pending")
        return [], []
    for name, why in failed.items():
        out(f"==> no real node for {name} ({why}): its pods will stay Pending")
    for real in reals:
        out(f"    {real.name} ready in {sum(real.node.times.values()):.1f}s")
    return reals, list(failed)


def stop_real_nodes(reals: list[Any]) -> list[str]:
    """Stops the real nodes at once; what could not be cleaned, one entry per node."""
    from concurrent.futures import ThreadPoolExecutor

    from testbed.localcluster import ClusterError

    def stop(real: Any) -> str | None:
        try:
            real.stop()
        except ClusterError as exc:
            return str(exc)
        return None

    with ThreadPoolExecutor(max_workers=len(reals)) as pool:
        return [p for p in pool.map(stop, reals) if p]


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
    from testbed.demo_report import shared_claims
    from testbed.localnode import cuda_probe_image
    from testbed.podprobe import for_local_node

    out, kube, result = ctx.out, KubeApi(ctx.api), DemoResult()
    reals = ctx.reals
    try:
        # A real node registered its Node itself (its kubelet) and publishes its slices itself (its plugin).
        others = [n.name for n in fleet.nodes if n.name not in ctx.real_names]
        if others:
            _step(out, f"registering {len(others)} simulated node(s) without a kubelet: {', '.join(others)}")
        for name in others:
            ctx.cluster.add_node(name, {SIMULATED_LABEL: "true"})

        features = api_features(ctx.api)
        pools = {name: pool for name, pool in desired_fleet_pools(fleet, str(ctx.fleet_path), ctx.driver,
                                                                   features).items() if name in others}
        _step(out, f"publishing ResourceSlices of {', '.join(others)} with the slice controller (first start)"
              if others else "every node of the fleet has a kubelet and a kubelet plugin, which publishes its "
                             "slices: the slice controller has nothing to publish (first start)")
        first = ResourceSliceController(ctx.api, ctx.driver, Owner.cluster())
        first.update(pools)
        first.run_once(timeout=60)
        result.first_writes = first.writes_by_operation
        _step(out, "restarting the slice controller (a new instance, same fleet)")
        second = ResourceSliceController(ctx.api, ctx.driver, Owner.cluster())
        second.update(pools)
        second.run_once(timeout=60)
        result.restart_writes = second.writes_by_operation
        if reals:
            _start_real_node_plugins(ctx, kube)

        classes = device_classes(ctx.driver)
        ClusterController(ctx.api, ctx.driver, classes).run_until_success(30)
        result.device_classes = [c["metadata"]["name"] for c in classes]
        _step(out, f"DeviceClasses in place: {', '.join(result.device_classes)}")

        create_namespace(kube, ctx.namespace)
        _step(out, f"applying {len(examples)} example(s) in namespace {ctx.namespace}: "
                   f"{', '.join(e.name for e in examples)}")
        for example in examples:
            objects = example.objects if not reals else [
                for_local_node(o, cuda_probe_image()) if o["kind"] == "Pod" else o for o in example.objects]
            try:
                apply_objects(kube, objects, ctx.namespace)
            except ApiError as exc:
                raise DemoError(f"example {example.name} ({example.path}) was rejected: {exc.message}") from exc
        started = time.monotonic()
        state = wait_for_allocation(kube, examples, ctx.namespace, timeout)
        result.claims = state.claims
        idle = sorted({c.node for c in state.claims if c.node and c.node not in ctx.real_names})
        if state.complete:
            why = ("pods stay Pending: there is no kubelet" if not reals else
                   f"pods on {', '.join(idle)} stay Pending: no kubelet there" if idle else "")
            _step(out, f"every claim allocated and every pod bound in {time.monotonic() - started:.1f}s"
                       + (f" ({why})" if why else ""))
        else:
            result.pending = describe_pending(kube, state, ctx.namespace)
        pods = [p["metadata"]["name"] for e in examples for p in e.pods]
        if reals and state.complete:
            started = time.monotonic()
            result.pods = wait_for_pods(kube, reals, ctx.namespace, pods, timeout)
            result.not_running = _not_running(kube, ctx.namespace, ctx.real_names, result.pods)
            if not result.not_running:
                _step(out, f"the pods on {', '.join(ctx.real_names)} run, each printed what its container sees, "
                           f"in {time.monotonic() - started:.1f}s")
        else:
            result.pods = wait_for_pods(kube, reals, ctx.namespace, pods, 0) if reals else {
                name: _pod_run(kube, ctx.namespace, name) for name in pods}
        result.shared = shared_claims(state.claims, result.pods)
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


def _start_real_node_plugins(ctx: DemoContext, kube: Any) -> None:
    """`gpu-dra kubelet-plugin` for each real node, started at once; returns once each node's kubelet
    registered its plugin and its slices are published (a complete pool)."""
    from concurrent.futures import ThreadPoolExecutor

    from kube.client import SLICES
    from testbed.demo_node import PLUGIN_TIMEOUT, NodePluginError

    for real in ctx.reals:
        _step(ctx.out, f"starting `gpu-dra kubelet-plugin --node-name {real.name}`: it registers with the "
                       f"kubelet of {real.name}, then publishes {real.name}'s ResourceSlices")

    def start(real: Any) -> str | None:
        try:
            real.start_plugin(ctx.fleet_path, ctx.driver)
        except NodePluginError as exc:
            return str(exc)
        return None

    with ThreadPoolExecutor(max_workers=len(ctx.reals)) as pool:
        errors = [e for e in pool.map(start, ctx.reals) if e]
    if errors:
        raise DemoError("\n".join(errors))
    deadline = time.monotonic() + PLUGIN_TIMEOUT
    for real in ctx.reals:
        while True:
            slices = kube.list(SLICES, field_selector=f"spec.driver={ctx.driver},spec.nodeName={real.name}")["items"]
            if slices:
                newest = max(s["spec"]["pool"]["generation"] for s in slices)
                current = [s for s in slices if s["spec"]["pool"]["generation"] == newest]
                if len(current) == current[0]["spec"]["pool"]["resourceSliceCount"]:
                    break
            if time.monotonic() > deadline:
                raise DemoError(f"the kubelet plugin of {real.name} published no complete pool within "
                                f"{PLUGIN_TIMEOUT:.0f}s\n--- plugin log ---\n{real.plugin.log_tail()}")
            time.sleep(0.2)


def _pod_run(kube: Any, namespace: str, name: str) -> Any:
    from kube.client import namespaced_collection
    from testbed.demo_node import PodRun

    pod = kube.get(f"{namespaced_collection('Pod', namespace)}/{name}")
    return PodRun(pod.get("status", {}).get("phase", "Unknown"), pod["spec"].get("nodeName"))


def _not_running(kube: Any, namespace: str, nodes: list[str], runs: dict[str, Any]) -> list[str]:
    """One line per pod on a real node that is not Running with its probes done, with its last events."""
    lines = []
    for name, run in runs.items():
        if run.node not in nodes or (run.phase == "Running" and all(v.complete for v in run.views.values())):
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
        for line in container_lines(result.pods, ctx.real_names):
            out(f"  {line}")
    for shared in result.shared:
        out("")
        out(shared.line())
    _section(out, "ResourceSlice controller")
    out(format_writes("first start", result.first_writes))
    out(format_writes("restart with the same fleet (second controller instance)", result.restart_writes))
    if sum(result.restart_writes.values()):
        raise DemoError(f"the restarted slice controller wrote {result.restart_writes}; with an unchanged fleet "
                        "it must write nothing")
    if result.prepared is not None:
        p = result.prepared
        how = "prepared by the kubelet" if ctx.reals else "prepared over its DRA socket by the demo"
        _section(out, f"CDI spec written by the kubelet plugin of {p.claim.node} for claim {p.claim.claim} "
                      f"({p.claim.example}; {how})")
        out(f"# {p.spec_path.name}   CDI devices: {', '.join(p.cdi_device_ids)}")
        out(_readable_spec(p.spec_text))
    _status(ctx)


def _status(ctx: DemoContext) -> None:
    """`gpu-dra status` of each real node (else the fleet's first node): who holds which GPU, MIG rows drawn."""
    from cli.status_cmd import collect, render_node
    from ops.status.reads import StatusReadError

    nodes = sorted({(s.get("spec") or {}).get("nodeName", "") for s in ctx.slices} - {""})
    for node in ctx.real_names or nodes[:1]:
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
    """The CDI spec that a real node's plugin wrote when its kubelet prepared one of the node's claims (a MIG
    partition if there is one: it is created at prepare), or None."""
    from testbed.demo_cdi import pick_claim
    from testbed.demo_node import prepared_cdi_spec
    from testbed.demo_report import device_index

    by_name = {r.name: r for r in ctx.reals}
    claim = pick_claim([c for c in claims if c.node in by_name], device_index(ctx.slices), ctx.driver)
    return prepared_cdi_spec(by_name[claim.node], claim) if claim is not None and claim.node else None


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
