"""`gpu-dra`: one console command, one sub-command per job. Each sub-command lives in its own module
and is imported only when used, so `gpu-dra slices` never loads gRPC and `gpu-dra inventory` never
loads the Kubernetes client."""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import Any

# sub-command -> (module under cli/, one-line help). Each module offers add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "inventory": ("cli.inventory_cmd", "show the GPUs found through NVML or in a simulated fleet"),
    "slices": ("cli.slices_cmd", "print the ResourceSlices that would be published, as YAML"),
    "deviceclasses": ("cli.deviceclasses_cmd", "print the DeviceClasses of this driver, as YAML"),
    "controller": ("cli.controller_cmd", "run the cluster controller (DeviceClasses, stale slices, metrics)"),
    "publish": ("cli.publish_cmd", "publish ResourceSlices for a simulated fleet and keep them exact"),
    "kubelet-plugin": ("cli.kubeletplugin_cmd", "run the node plugin: register with the kubelet, prepare claims"),
    "webhook": ("cli.webhook_cmd", "serve the validating admission webhook for ResourceClaim configs (TLS)"),
    "doctor": ("cli.doctor_cmd", "check that this node can run GPU containers with this driver (read-only)"),
    "status": ("cli.status_cmd", "who holds which GPU device, what is free, MIG memory slices drawn (read-only)"),
    "explain": ("cli.explain_cmd", "say why a claim, template or pod's claims are (not) allocatable, node by node"),
    "advise": ("cli.advise_cmd", "from what each workload used to what it should claim (MIG profile, share, slot)"),
    "convert": ("cli.convert_cmd", "convert NVIDIA device plugin, mig-parted configs and workloads to this driver"),
    "simulate": ("cli.simulate_cmd", "inject faults (XIDs, lost GPUs, recoveries) into a simulated node's GPUs"),
    "demo": ("cli.demo_cmd", "start a local control plane with a simulated fleet and allocate the examples"),
}


# sub-command -> an example shown at the end of its --help.
EXAMPLES: dict[str, str] = {
    "inventory": "gpu-dra inventory --fleet examples/fleets/demo.yaml --node node-a",
    "slices": "gpu-dra slices --fleet examples/fleets/demo.yaml --node node-b",
    "deviceclasses": "gpu-dra deviceclasses --compat-nvidia",
    "controller": "gpu-dra controller --kubeconfig ~/.kube/config --metrics-port 8080",
    "publish": "gpu-dra publish --fleet examples/fleets/demo.yaml --kubeconfig ~/.kube/config --once --dry-run",
    "kubelet-plugin": "gpu-dra kubelet-plugin --node-name node-a --driver-root /run/nvidia/driver",
    "webhook": "gpu-dra webhook --tls-cert-file tls.crt --tls-private-key-file tls.key",
    "doctor": "gpu-dra doctor --driver-root /run/nvidia/driver",
    "status": "gpu-dra status node-a -o yaml",
    "explain": "gpu-dra explain pod/training-0 -n team-a",
    "advise": "gpu-dra advise --prometheus http://prometheus.monitoring:9090 --window 7d -n ml --emit templates",
    "convert": "gpu-dra convert -f examples/migration/device-plugin-configs.yaml --output-dir converted/",
    "simulate": "gpu-dra simulate xid --sim-state /var/lib/kubelet/plugins/gpu.dra-driver.io/simulated-gpus.json "
                "--gpu 0 --xid 79",
    "demo": "gpu-dra demo --keep",
}


def version() -> str:
    """This build's version: the installed distribution's, else the source tree's pyproject.toml."""
    from importlib import metadata

    try:
        return metadata.version("gpu-dra-driver")
    except metadata.PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            return str(tomllib.loads(pyproject.read_text())["project"]["version"])
        except (OSError, KeyError, ValueError):
            return "unknown"


class _VersionAction(argparse.Action):
    """--version, with the version looked up only when asked for: the lookup (importlib.metadata) costs every
    command's start tens of milliseconds, the plugin's start → first kubelet call among them."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0,
                         help="show program's version number and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"gpu-dra {version()}")
        parser.exit()


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help line, before its "[env NAME]": `--help` is where a flag's default is
    looked up (on a node the docs are not at hand). A help text that already names its default stays as written."""

    _ENV = re.compile(r" \[env \w+\]$")

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or "default" in text or default is None or default is False \
                or default == argparse.SUPPRESS:
            return text
        if isinstance(default, float) and default.is_integer():
            default = int(default)
        shown = f"default {default if default != '' else 'empty'}".replace("%", "%%")   # help is %-formatted
        env = self._ENV.search(text)
        head, tail = (text[:env.start()], text[env.start():]) if env else (text, "")
        # "(0: off)" becomes "(0: off; default 5)"; other texts get "(default 5)".
        head = f"{head[:-1]}; {shown})" if head.endswith(")") else f"{head} ({shown})"
        return head + tail


def _example(name: str, prog: str) -> str:
    """The sub-command's example as ``prog`` runs it (``kubectl gpu status …`` under the kubectl plugin)."""
    return f"example:\n  {prog}{EXAMPLES[name].removeprefix('gpu-dra')}"


def _epilog(name: str, module: object | None, prog: str) -> str:
    import textwrap

    note = getattr(module, "HELP_NOTE", "")
    return (textwrap.fill(note, 100) + "\n\n" if note else "") + _exit_status(module) + _example(name, prog)


def _exit_status(module: object | None) -> str:
    """The command's EXIT_STATUS and, for one that talks to the cluster, the status of each kind of cluster failure
    (the same in every command)."""
    from cli.failures import CLUSTER_EXIT_STATUS, EXIT_USAGE

    own: dict[int, str] = dict(getattr(module, "EXIT_STATUS", {}))
    if not own:
        return ""
    own.setdefault(EXIT_USAGE, "bad arguments or input")
    if getattr(module, "USES_CLUSTER", False):
        own.update(CLUSTER_EXIT_STATUS)
    return "exit status:\n" + "".join(f"  {code}  {text}\n" for code, text in sorted(own.items())) + "\n"


def build_parser(only: str | None = None, prog: str = "gpu-dra") -> argparse.ArgumentParser:
    """The parser of every sub-command; with ``only``, that sub-command's arguments alone are loaded (the others
    keep their help line), so starting one command does not import every other's modules. ``prog``: the name
    the help and usage lines give the command (``kubectl gpu`` for the kubectl plugin)."""
    parser = argparse.ArgumentParser(prog=prog, description="Kubernetes DRA driver for NVIDIA GPUs",
                                     epilog="example:\n  gpu-dra status\n  gpu-dra explain claim/my-claim -n team-a",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=_example(name, prog),
                           formatter_class=_HelpFormatter)
        p.set_defaults(_module=module_name)
        if only is not None and name != only:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            p.set_defaults(_missing=True)
            continue
        p.epilog = _epilog(name, module, prog)
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None, prog: str = "gpu-dra") -> int:
    words = sys.argv[1:] if argv is None else argv
    if words == ["--version"]:          # without loading every sub-command's parser
        print(f"gpu-dra {version()}")
        return 0
    # The sub-command is the first word (the top level has no options of its own besides --help and --version).
    args = build_parser(words[0] if words and words[0] in SUBCOMMANDS else None, prog).parse_args(argv)
    if getattr(args, "_missing", False):
        print(f"gpu-dra: sub-command {args.command!r} is not available in this build", file=sys.stderr)
        return 2
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
