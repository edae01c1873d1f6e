"""`gpu-dra controller`: the cluster controller (DeviceClasses, slices of vanished nodes, /healthz, /metrics) and
Warning Events for pending claims that MPS tenancy keeps off the devices (controller.pendingclaims)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME
from cli.options import add_log_level

log = logging.getLogger("gpu-dra.controller")
PROG = "gpu-dra controller"
# In --help (cli.main), with the statuses of cluster failures (cli.failures).
EXIT_STATUS = {0: "--once: the DeviceClasses in place; else stopped"}
USES_CLUSTER = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG / ~/.kube/config)")
    parser.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME, help=f"DRA driver name (default {DEFAULT_DRIVER_NAME})")
    parser.add_argument("--compat-nvidia", action="store_true",
                        help=f"NVIDIA compatibility mode: driver {NVIDIA_DRIVER_NAME} with NVIDIA's class names")
    parser.add_argument("--metrics-port", type=int, default=8080, help="port for /healthz and /metrics (0: any free port)")
    parser.add_argument("--metrics-address", default="0.0.0.0", help="address to serve /healthz and /metrics on")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between reconcile passes")
    parser.add_argument("--pending-interval", type=float, default=5.0,
                        help="seconds between passes over pending claims, which get a Warning Event when MPS tenancy "
                             "keeps them off the devices (0: none)")
    parser.add_argument("--once", action="store_true", help="one successful pass (retrying with back-off), then exit")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="--once: give up after this many seconds, whatever is in flight")
    add_log_level(parser, "info")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from api.deviceclasses import device_classes
    from cli.failures import EXIT_USAGE, report
    from controller.cluster import ClusterController
    from controller.clusterstate import ClusterState
    from controller.pendingclaims import PendingClaimEvents
    from kube.client import KubeApi
    from kube.connect import ConnectError, api_client_from
    from kube.httpserver import serve_health_and_metrics

    if args.pending_interval < 0 or not args.timeout > 0:
        print(f"{PROG}: --pending-interval must be 0 (off) or more seconds, --timeout more than 0", file=sys.stderr)
        return EXIT_USAGE
    try:
        classes = device_classes(args.driver_name, compat_nvidia=args.compat_nvidia)
        api = api_client_from(args.kubeconfig)
    except (ValueError, ConnectError) as exc:
        return report(PROG, exc)
    driver = NVIDIA_DRIVER_NAME if args.compat_nvidia else args.driver_name
    class_names = [c["metadata"]["name"] for c in classes]
    # The claims only for the pending-claims pass: without it the controller reads none (nor needs the right to).
    state = ClusterState(KubeApi(api), driver, class_names, claims=bool(args.pending_interval) and not args.once)
    ctl = ClusterController(api, driver, classes, interval=args.interval, state=state)
    if args.once:
        return _once(ctl, api, driver, len(classes), args.timeout)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = serve_health_and_metrics(args.metrics_port, ctl.healthy, args.metrics_address)
    host, port = server.server_address[:2]
    log.info("driver %s: serving /healthz and /metrics on %s:%d; %d DeviceClasses to keep", driver, host, port, len(classes))
    pending = None
    if args.pending_interval:
        pending = PendingClaimEvents(state, driver, class_names, api_client=api, interval=args.pending_interval)
    state.start()                      # one LIST of each resource, then watches: the passes read these caches
    ctl.start()
    if pending is not None:
        pending.start()
    try:
        stop.wait()
    finally:
        if pending is not None:
            pending.stop()
        ctl.stop()
        state.stop()
        server.shutdown()
    return 0


def _once(ctl: Any, api: Any, driver: str, classes: int, timeout: float) -> int:
    """One successful pass within `timeout`: the passes run beside this thread, which stops waiting at the
    deadline even while a request is still in flight (a server that accepts and never answers)."""
    from cli.failures import describe, no_answer

    outcome: list[bool] = []

    def passes() -> None:
        try:
            ctl.run_until_success(timeout=timeout)
        except RuntimeError:
            outcome.append(False)
        else:
            outcome.append(True)

    worker = threading.Thread(target=passes, name="controller-once", daemon=True)
    worker.start()
    worker.join(timeout)
    if outcome == [True]:
        print(f"driver {driver}: {classes} DeviceClasses in place; writes {ctl.writes_by_operation or 'none'}")
        return 0
    last = ctl.last_exception
    failure = (describe(last, api) if last is not None else None) or no_answer(api, timeout)
    print(f"{PROG}: {failure.line}", file=sys.stderr)
    return failure.code
