"""`gpu-dra controller`: the cluster controller (DeviceClasses, slices of vanished nodes, /healthz, /metrics) and
Warning Events for pending claims that MPS tenancy keeps off the devices (controller.pendingclaims)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME
from cli.options import add_log_level

log = logging.getLogger("gpu-dra.controller")


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
    add_log_level(parser, "info")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from api.deviceclasses import device_classes
    from controller.cluster import ClusterController
    from controller.clusterstate import ClusterState
    from controller.pendingclaims import PendingClaimEvents
    from kube.client import KubeApi
    from kube.connect import ConnectError, api_client_from
    from kube.httpserver import serve_health_and_metrics

    try:
        classes = device_classes(args.driver_name, compat_nvidia=args.compat_nvidia)
        api = api_client_from(args.kubeconfig)
    except (ValueError, ConnectError) as exc:
        print(f"gpu-dra controller: {exc}", file=sys.stderr)
        return 2
    driver = NVIDIA_DRIVER_NAME if args.compat_nvidia else args.driver_name
    class_names = [c["metadata"]["name"] for c in classes]
    state = ClusterState(KubeApi(api), driver, class_names)
    ctl = ClusterController(api, driver, classes, interval=args.interval, state=state)
    if args.pending_interval < 0:
        print("gpu-dra controller: --pending-interval must be 0 (off) or more seconds", file=sys.stderr)
        return 2
    if args.once:
        try:
            ctl.run_until_success(timeout=max(60.0, 4 * args.interval))
        except RuntimeError as exc:
            print(f"gpu-dra controller: {exc}", file=sys.stderr)
            return 1
        print(f"driver {driver}: {len(classes)} DeviceClasses in place; writes {ctl.writes_by_operation or 'none'}")
        return 0

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
