"""`gpu-dra publish`: publish the ResourceSlices of every node of a simulated fleet and keep them exact.

Each node's GPUs come from its simulated NVML library, through the same inventory, device-model and slice code
as on a real node; one ResourceSlice controller serves all the fleet's pools. It owns only the slices it created,
which carry the label PUBLISHER_LABEL: those of pools no longer in the fleet are deleted; pools that node plugins
publish (no label) are never read, changed or deleted, and a fleet node whose pool a plugin already publishes is
refused. Without --once it keeps running, restores slices changed by others and re-publishes when the fleet file
changes. --dry-run says what it would write and delete, and writes nothing.

Nodes are handed to the controller as a stream: a node's slices are being written while the next nodes are
computed, `--workers` pools are synced at once (that many writes in flight), and no more than a few pools per
worker wait computed but unwritten. With `--jobs` above 1 (the default on a machine with several CPUs, for
fleets of at least MIN_NODES_PER_JOB nodes a job) the nodes are computed in that many processes, each handing
back the pool in its compact, prepared form (`kube.resourceslices.prepare_pool`: tens of kilobytes, not the
megabyte of dicts): an unchanged restart is CPU-bound on exactly that computation.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME
from cli.options import add_log_level

log = logging.getLogger("gpu-dra.publish")
PROG = "gpu-dra publish"
SIMULATED_LABEL = "gpu.dra-driver.io/simulated"
# On every ResourceSlice this command creates: what it owns, and all it ever lists, changes or deletes.
PUBLISHER_LABEL = ("gpu.dra-driver.io/published-by", "gpu-dra-publish")
# Shown by --help above the example (cli.main).
HELP_NOTE = ("It changes only the ResourceSlices it created (label gpu.dra-driver.io/published-by=gpu-dra-publish): "
             "slices of nodes that leave the fleet are deleted; pools that node plugins publish are never touched, "
             "and a fleet node whose pool a plugin publishes is refused. Try --dry-run first.")
# In --help (cli.main), with the statuses of cluster failures (cli.failures).
EXIT_STATUS = {0: "slices in line (--once), the plan printed (--dry-run), or stopped",
               1: "--once: not every pool in line within --timeout"}
USES_CLUSTER = True
# A worker process costs about a second to start (imports); below this many nodes per job it does not pay.
MIN_NODES_PER_JOB = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet", required=True, metavar="FILE", help="fleet file with the simulated nodes")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG / ~/.kube/config)")
    parser.add_argument("--driver-name", default=None, metavar="NAME",
                        help=f"DRA driver name (default {DEFAULT_DRIVER_NAME}, or {NVIDIA_DRIVER_NAME} with --compat-nvidia)")
    parser.add_argument("--compat-nvidia", action="store_true", help=f"publish as {NVIDIA_DRIVER_NAME}")
    parser.add_argument("--once", action="store_true", help="bring the slices in line once (with retries), then exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="print which pools would be created, updated or deleted (and which foreign pools are "
                             "left alone), write nothing, exit")
    parser.add_argument("--create-nodes", action="store_true",
                        help="register missing fleet nodes as simulated Node objects (Ready, no kubelet)")
    parser.add_argument("--sync-delay", type=float, default=5.0,
                        help="seconds between noticing a foreign change and repairing it (default 5)")
    parser.add_argument("--timeout", type=float, default=120.0, help="--once: give up after this many seconds")
    parser.add_argument("--workers", type=int, default=8, metavar="N",
                        help="pools synced at once, so at most N writes in flight (default 8)")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), metavar="N",
                        help="processes computing the nodes' slices (default: the CPUs, at most 4; one process for "
                             f"fleets under {MIN_NODES_PER_JOB} nodes a job)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve /healthz and /metrics on this port (default: not served)")
    parser.add_argument("--metrics-address", default="0.0.0.0", help="address for /healthz and /metrics")
    add_log_level(parser, "info")


def iter_fleet_pools(fleet: Any, fleet_path: str, driver: str, features: Any) -> Iterator[tuple[str, Any]]:
    """(node name, DesiredPool) for each node of the fleet in turn (simulated NVML -> inventory -> slices),
    computed only when the next one is asked for."""
    for node in fleet.nodes:
        pool, lines = _node_pool(node, fleet_path, driver, features)
        _log_lines(node.name, lines)
        yield node.name, pool


def iter_prepared_fleet_pools(fleet: Any, fleet_path: str, driver: str, features: Any,
                              jobs: int) -> Iterator[tuple[str, Any]]:
    """(node name, PreparedPool) for each node of the fleet in order, computed by `jobs` processes (in this one
    when jobs is 1 or the fleet is small), at most two nodes a job ahead of what was taken."""
    from kube.resourceslices import prepare_pool

    jobs = min(jobs, len(fleet.nodes) // MIN_NODES_PER_JOB)
    if jobs <= 1:
        for name, pool in iter_fleet_pools(fleet, fleet_path, driver, features):
            yield name, prepare_pool(driver, name, pool)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the controller's threads may hold locks a forked child would inherit held.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool_of_jobs:
        pending: deque[tuple[str, Future[Any]]] = deque()
        nodes = iter(fleet.nodes)
        try:
            while True:
                while len(pending) < 2 * jobs:
                    node = next(nodes, None)
                    if node is None:
                        break
                    pending.append((node.name, pool_of_jobs.submit(_prepared_node_pool, node, fleet_path, driver,
                                                                  features)))
                if not pending:
                    return
                name, future = pending.popleft()
                prepared, lines = future.result()
                _log_lines(name, lines)
                yield name, prepared
        finally:
            for _, future in pending:
                future.cancel()


def _node_pool(node: Any, fleet_path: str, driver: str, features: Any) -> tuple[Any, list[str]]:
    """One node's DesiredPool and the warnings and notes a human should see."""
    from dra.model.policy import parse_node_policy
    from dra.model.slices import plan_pool
    from dra.node.inventory import discover_once
    from dra.sim.fleet import nvml_for_node
    from kube.resourceslices import DesiredPool

    policy = parse_node_policy(node.policy, source=f"{fleet_path}: node {node.name}: policy")
    plan = plan_pool(discover_once(nvml_for_node(node)), policy, driver, node.name, features)
    return DesiredPool.from_slice_specs(plan.slices, node.name), [*plan.warnings, *plan.notes]


def _prepared_node_pool(node: Any, fleet_path: str, driver: str, features: Any) -> tuple[Any, list[str]]:
    """In a job process: the node's pool, prepared (what crosses back is its compact form)."""
    from kube.resourceslices import prepare_pool

    pool, lines = _node_pool(node, fleet_path, driver, features)
    return prepare_pool(driver, node.name, pool), lines


def _log_lines(node: str, lines: list[str]) -> None:
    for line in lines:
        log.warning("node %s: %s", node, line)


def desired_fleet_pools(fleet: Any, fleet_path: str, driver: str, features: Any) -> dict[str, Any]:
    """node name -> DesiredPool for every node of the fleet, all at once (for callers that need the whole map)."""
    return dict(iter_fleet_pools(fleet, fleet_path, driver, features))


def missing_nodes(api: Any, names: list[str]) -> list[str]:
    from kube.client import NODES, KubeApi

    existing = {n["metadata"]["name"] for n in KubeApi(api).list_metadata(NODES)["items"]}
    return [n for n in names if n not in existing]


def register_missing_nodes(api: Any, names: list[str]) -> list[str]:
    """Creates simulated Node objects for the names that have none; returns the names created."""
    from kube.client import NODES, ApiError, KubeApi
    from testbed.localcluster import simulated_node

    kube = KubeApi(api)
    created = []
    for name in missing_nodes(api, names):
        try:
            node = kube.create(NODES, simulated_node(name, {SIMULATED_LABEL: "true"}))
        except ApiError as exc:
            if exc.conflict:
                continue
            raise
        if node.get("spec", {}).get("taints"):
            kube.request("PATCH", f"{NODES}/{name}", body={"spec": {"taints": None}},
                         content_type="application/merge-patch+json")
        created.append(name)
    return created


def foreign_pools(api: Any, driver: str) -> dict[str, int]:
    """Pools of the driver that this command did not create: pool name -> slices (metadata-only reads; the pool
    is the slice's node, from its owner reference, else the name's `<pool>-<driver>-<index>` form)."""
    from kube.client import SLICES, KubeApi

    out: dict[str, int] = {}
    listed = KubeApi(api).list_metadata(SLICES, field_selector=f"spec.driver={driver}",
                                        label_selector=f"!{PUBLISHER_LABEL[0]}")
    for item in listed["items"]:
        pool = _pool_of(item["metadata"], driver)
        out[pool] = out.get(pool, 0) + 1
    return out


def _pool_of(meta: dict[str, Any], driver: str) -> str:
    nodes = [r.get("name", "") for r in meta.get("ownerReferences") or [] if r.get("kind") == "Node"]
    if nodes:
        return str(nodes[0])
    name, marker = str(meta.get("name", "")), f"-{driver}-"
    return name.rsplit(marker, 1)[0] if marker in name else name


def dry_run_report(api: Any, driver: str, fleet: Any, fleet_path: str, features: Any,
                   foreign: dict[str, int]) -> str:
    """What a run would do, pool by pool: create (no slices yet), update or keep (slices of ours exist; what
    would change is decided when writing), delete (ours, not in the fleet); foreign pools are listed as left
    alone."""
    from kube.client import SLICES, KubeApi

    ours: dict[str, int] = {}
    listed = KubeApi(api).list_metadata(SLICES, field_selector=f"spec.driver={driver}",
                                        label_selector="=".join(PUBLISHER_LABEL))
    for item in listed["items"]:
        pool = _pool_of(item["metadata"], driver)
        ours[pool] = ours.get(pool, 0) + 1
    lines = [f"driver {driver}: dry run, nothing is written"]
    for name, pool in iter_fleet_pools(fleet, fleet_path, driver, features):
        have = ours.get(name, 0)
        verb = "create" if not have else "update (if changed)"
        lines.append(f"{verb:20} pool {name}: {len(pool.slices)} slice(s) desired, {have} published")
    for name in sorted(set(ours) - set(fleet.node_names)):
        lines.append(f"{'delete':20} pool {name}: {ours[name]} slice(s) (not in the fleet)")
    for name in sorted(foreign):
        lines.append(f"{'leave alone':20} pool {name}: {foreign[name]} slice(s) not published by gpu-dra publish")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cli.failures import report
    from dra.model.devices import DeviceModelError
    from dra.model.policy import PolicyError
    from dra.sim.fleet import FleetError, load_fleet
    from kube.client import ApiError, ApiUnavailable
    from kube.connect import ConnectError, api_client_from
    from kube.resourceslices import InvalidPoolError, Owner, PoolSyncError, ResourceSliceController
    from kube.serverversion import api_features

    if args.compat_nvidia and args.driver_name and args.driver_name != NVIDIA_DRIVER_NAME:
        print(f"{PROG}: --compat-nvidia publishes as {NVIDIA_DRIVER_NAME}; it cannot be combined with "
              f"--driver-name {args.driver_name}", file=sys.stderr)
        return 2
    driver = NVIDIA_DRIVER_NAME if args.compat_nvidia else (args.driver_name or DEFAULT_DRIVER_NAME)
    if args.workers < 1 or args.jobs < 1:
        print(f"{PROG}: --workers and --jobs must be at least 1", file=sys.stderr)
        return 2
    api = None
    try:
        fleet = load_fleet(args.fleet)
        api = api_client_from(args.kubeconfig)
        features = api_features(api, timeout=args.timeout)
        foreign = foreign_pools(api, driver)
        clash = sorted(set(fleet.node_names) & set(foreign))
        if clash:
            print(f"{PROG}: pool(s) {', '.join(clash)} of driver {driver} are published by someone else (slices "
                  f"without the label {'='.join(PUBLISHER_LABEL)}: a node plugin, or an older gpu-dra publish); "
                  "they are left alone: remove those nodes from the fleet, or delete those slices first",
                  file=sys.stderr)
            return 2
        if args.dry_run:
            print(dry_run_report(api, driver, fleet, args.fleet, features, foreign))
            return 0
        if args.create_nodes:
            created = register_missing_nodes(api, fleet.node_names)
            if created:
                log.info("registered simulated nodes: %s", ", ".join(created))
        else:
            missing = missing_nodes(api, fleet.node_names)
            if missing:
                print(f"{PROG}: no Node objects for {', '.join(missing)}: node-local slices need their Node "
                      "(register them, or pass --create-nodes for simulated ones)", file=sys.stderr)
                return 2
        ctl = ResourceSliceController(api, driver, Owner.labelled(*PUBLISHER_LABEL), sync_delay=args.sync_delay,
                                      workers=args.workers)
        pools = iter_prepared_fleet_pools(fleet, args.fleet, driver, features, args.jobs)
        if args.once:
            # Nodes are computed while the earlier ones are written; a node that cannot be computed stops the
            # stream, and then no pool is deleted (the fleet is not known in full).
            ctl.run_once(timeout=args.timeout, pools=pools)
            writes = ctl.writes_by_operation
            print(f"driver {driver}: {len(fleet.nodes)} pool(s), {ctl.desired_slices} ResourceSlice(s) in line; "
                  f"writes: {', '.join(f'{k} {v}' for k, v in sorted(writes.items())) or 'none'}")
            return 0
    except (ValueError, OSError, ConnectError, FleetError, PolicyError, DeviceModelError, InvalidPoolError,
            ApiError, ApiUnavailable) as exc:
        return report(PROG, exc, api)
    except PoolSyncError as exc:
        return report(PROG, exc, api, default=1)
    return _serve(args, ctl, pools, fleet, driver, features)


def _serve(args: argparse.Namespace, ctl: Any, pools: Iterator[tuple[str, Any]], fleet: Any, driver: str,
           features: Any) -> int:
    from dra.sim.fleet import load_fleet
    from kube.httpserver import serve_health_and_metrics

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = None
    if args.metrics_port:
        server = serve_health_and_metrics(
            args.metrics_port, lambda: (not ctl.errors, "; ".join(f"{k}: {v}" for k, v in ctl.errors.items()) or "ok"),
            args.metrics_address)
    ctl.start()
    try:
        ctl.update_from(pools)
    except ValueError as exc:   # a node that cannot be computed: what was written stays, nothing is removed
        ctl.stop()
        if server is not None:
            server.shutdown()
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if ctl.wait_for_sync(args.timeout):
        log.info("driver %s: %d pool(s) published; writes %s", driver, len(fleet.nodes), ctl.writes_by_operation or "none")
    else:
        log.warning("driver %s: not all pools published yet: %s", driver, ctl.errors)
    mtime = _mtime(args.fleet)
    try:
        while not stop.wait(2.0):
            now = _mtime(args.fleet)
            if now == mtime:
                continue
            mtime = now
            try:
                fleet = load_fleet(args.fleet)
                log.info("fleet file changed: re-publishing %d pool(s)", len(fleet.nodes))
                ctl.update_from(iter_prepared_fleet_pools(fleet, args.fleet, driver, features, args.jobs))
            except ValueError as exc:   # FleetError, PolicyError, InvalidPoolError are ValueErrors
                log.error("fleet file changed but cannot be used, keeping the previous state: %s", exc)
    finally:
        ctl.stop()
        if server is not None:
            server.shutdown()
    return 0


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0
