"""`gpu-dra convert`: from NVIDIA's device plugin (+ GFD, mig-parted) to this driver, as YAML.

Inputs (`-f FILE`, repeatable; `-f -` reads standard input) are told apart by their shape: device plugin config
files (or the ConfigMap holding them, one per key), mig-parted configs, Nodes (for the node groups their
`nvidia.com/device-plugin.config` and `nvidia.com/mig.config` labels form) and workloads. The output is chart
values per node group (the node policy), the MIG state per mig-parted config, and the workloads with
ResourceClaimTemplates; on standard output as one YAML stream (each file's name in a comment), or as files with
`--output-dir`. The report, one line per input field (converted, kept, not-convertible, with the reason), goes
to standard error and `report.txt`: a summary, then the lines by severity. Only the MIG states of configs
that a given Node uses are written (`--all-configs`: every one). Nothing talks to a cluster. Exit status:
EXIT_CODES.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME

PROG = "gpu-dra convert"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", action="append", required=True, metavar="FILE",
                        help="device plugin config, mig-parted config, Nodes or workloads (YAML; a directory: its "
                             "YAML files; - for stdin); repeatable")
    parser.add_argument("--dynamic-mig", action="store_true",
                        help="MIG GPUs get mig: dynamic (partitions made per claim) instead of static, publishing the "
                             "profiles each mig-parted entry names (dynamicMig.profiles)")
    parser.add_argument("--mig-capacity", action="store_true",
                        help="with --dynamic-mig: a mig-parted entry that names one profile publishes it as one "
                             "device per GPU with instances capacity (dynamicMig.layout: capacity, Kubernetes "
                             "1.36+) instead of one device per placement; entries of several profiles keep those")
    parser.add_argument("--default-config", metavar="NAME",
                        help="the device plugin config of nodes without the nvidia.com/device-plugin.config label "
                             "(default: the only one given)")
    parser.add_argument("--extended-resource", action="store_true",
                        help="keep whole-GPU requests (nvidia.com/gpu) in pod "
                             f"specs: NVIDIA compatibility mode, driver {NVIDIA_DRIVER_NAME}, whose DeviceClass "
                             "serves the extended resource")
    parser.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME, metavar="NAME",
                        help=f"DRA driver name in classes and selectors (default {DEFAULT_DRIVER_NAME})")
    parser.add_argument("--all-configs", action="store_true",
                        help="write the MIG state of every mig-parted config (default: only those a given Node's "
                             "nvidia.com/mig.config label names, when Nodes are given)")
    parser.add_argument("--output-dir", metavar="DIR", help="write one file per output instead of standard output")


EXIT_CODES = ("exit status: 0 converted, nothing refused and nothing changed in meaning; 2 input that cannot be "
              "read (nothing written); 3 written, but some fields change meaning (the report's 'changed' lines); "
              "4 written, but fields, nodes or workloads were refused and left out (its 'not-convertible' lines)")
HELP_NOTE = EXIT_CODES      # in --help before the example (cli.main)


def _read(name: str) -> list[tuple[str, object]]:
    if name != "-" and Path(name).is_dir():   # like kubectl -f DIR: its YAML files, in name order
        files = sorted(p for p in Path(name).iterdir() if p.suffix in (".yaml", ".yml", ".json") and p.is_file())
        return [d for p in files for d in _read(str(p))]
    try:
        text = sys.stdin.read() if name == "-" else Path(name).read_text()
    except OSError as exc:
        raise ValueError(f"{name}: {exc.strerror or exc}") from None
    where = "stdin" if name == "-" else name
    try:
        return [(where, d) for d in yaml.safe_load_all(text)]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{where}:{at} not YAML: {getattr(exc, 'problem', exc)}") from None


def run(args: argparse.Namespace) -> int:
    from api.deviceclasses import validate_driver_name
    from ops.convert.conversion import Options, convert, output_files
    from ops.convert.deviceplugin import ConvertError

    driver = NVIDIA_DRIVER_NAME if args.extended_resource else args.driver_name
    try:
        if args.extended_resource and args.driver_name not in (DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME):
            raise ValueError(f"--extended-resource uses driver {NVIDIA_DRIVER_NAME} (compatibility mode), "
                             f"not --driver-name {args.driver_name}")
        validate_driver_name(driver)
        if args.mig_capacity and not args.dynamic_mig:
            raise ValueError("--mig-capacity applies to dynamic MIG only; give --dynamic-mig too")
        documents = [d for name in args.filename for d in _read(name)]
        opts = Options(driver=driver, dynamic_mig=args.dynamic_mig, mig_capacity=args.mig_capacity,
                       extended_resource=args.extended_resource,
                       default_config=args.default_config, all_configs=args.all_configs)
        result = convert(documents, opts)
    except (ConvertError, ValueError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    files = output_files(result, opts)
    report = files.pop("report.txt")
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, text in {**files, "report.txt": report}.items():
            (out / name).write_text(text)
        print(f"{PROG}: wrote {', '.join(sorted([*files, 'report.txt']))} to {out}", file=sys.stderr)
    else:
        sys.stdout.write("".join(f"# file: {name}\n{text}" for name, text in files.items()))
    sys.stderr.write(report)
    return result.exit_code()
