"""`gpu-dra webhook`: the validating admission webhook for ResourceClaims and ResourceClaimTemplates (TLS)."""
from __future__ import annotations

import argparse
import logging
import signal
import ssl
import sys
import threading

from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME
from cli.options import add_log_level

log = logging.getLogger("gpu-dra.webhook")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME,
                        help=f"DRA driver whose opaque configs are checked (default {DEFAULT_DRIVER_NAME})")
    parser.add_argument("--compat-nvidia", action="store_true",
                        help=f"NVIDIA compatibility mode: driver {NVIDIA_DRIVER_NAME}, NVIDIA's config types accepted")
    parser.add_argument("--address", default="0.0.0.0", help="address to serve on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8443, help="HTTPS port (default 8443; 0: any free port)")
    parser.add_argument("--tls-cert-file", required=True, help="serving certificate (PEM, with any intermediates)")
    parser.add_argument("--tls-private-key-file", required=True, help="its private key (PEM)")
    add_log_level(parser, "info")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from controller.webhook import serve

    driver = NVIDIA_DRIVER_NAME if args.compat_nvidia else args.driver_name
    try:
        server = serve(args.address, args.port, args.tls_cert_file, args.tls_private_key_file,
                       driver_name=driver, compat_nvidia=args.compat_nvidia)
    except (OSError, ssl.SSLError) as exc:
        print(f"gpu-dra webhook: cannot serve on {args.address}:{args.port} with {args.tls_cert_file} and "
              f"{args.tls_private_key_file}: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    host, port = server.server_address[:2]
    # Tests and wrappers read the port from this line when --port is 0.
    log.info("driver %s: validating ResourceClaim configs on https://%s:%d/validate", driver, host, port)
    try:
        stop.wait()
    finally:
        server.shutdown()
    return 0
