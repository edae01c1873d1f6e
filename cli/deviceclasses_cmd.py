"""`gpu-dra deviceclasses`: print this driver's DeviceClasses as YAML (pipe into `kubectl apply -f -`)."""
from __future__ import annotations

import argparse
import sys

from api.deviceclasses import device_classes, render_yaml
from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--driver-name", default=None, metavar="NAME",
                        help=f"DRA driver name the classes select (default {DEFAULT_DRIVER_NAME}, "
                             f"or {NVIDIA_DRIVER_NAME} with --compat-nvidia)")
    parser.add_argument("--compat-nvidia", action="store_true",
                        help="NVIDIA compatibility mode: driver gpu.nvidia.com and NVIDIA's class names")


def run(args: argparse.Namespace) -> int:
    default = NVIDIA_DRIVER_NAME if args.compat_nvidia else DEFAULT_DRIVER_NAME
    try:
        classes = device_classes(args.driver_name or default, compat_nvidia=args.compat_nvidia)
    except ValueError as exc:
        print(f"gpu-dra deviceclasses: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render_yaml(classes))
    return 0
