"""`kubectl gpu`: the kubectl plugin (the console script ``kubectl-gpu`` on PATH). ``kubectl gpu status [NODE]``,
or ``kubectl gpu [NODE]`` alone, is ``gpu-dra status``; kubectl hands the plugin its arguments and $KUBECONFIG."""
from __future__ import annotations

import sys

from cli.main import main as gpu_dra

COMMANDS = ("status",)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        command, rest = args[0], args[1:]
    else:
        command, rest = "status", args
    return gpu_dra([command, *rest])


if __name__ == "__main__":
    sys.exit(main())
