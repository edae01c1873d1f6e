"""`kubectl gpu`: the kubectl plugin (the console script ``kubectl-gpu`` on PATH; deploy/krew/gpu.yaml is its
krew manifest). ``kubectl gpu status [NODE]``, or ``kubectl gpu [NODE]`` alone, is ``gpu-dra status``;
``kubectl gpu explain TARGET`` is ``gpu-dra explain``; ``kubectl gpu advise`` is ``gpu-dra advise``. As with
kubectl, flags go anywhere: before the command (``kubectl gpu --kubeconfig K status node-b``) as well as after
it. kubectl hands the plugin its arguments and $KUBECONFIG."""
from __future__ import annotations

import sys

from cli.main import main as gpu_dra

PROG = "kubectl gpu"
COMMANDS = ("status", "explain", "advise")
# The flags of those commands that take a value: the word after one is its value, not the command.
VALUE_FLAGS = ("--kubeconfig", "--context", "-n", "--namespace", "-o", "--output", "--driver-name",
               "--prometheus", "--window", "--prometheus-user", "--prometheus-password-file", "--prometheus-token-file",
               "--prometheus-ca-file", "--http-config", "--from-node", "--metrics-url", "--headroom", "--min-samples",
               "--min-span", "--max-gap", "--kinds", "--emit")


def command_and_rest(args: list[str]) -> tuple[str, list[str]]:
    """The command (the first word that is neither a flag nor a flag's value; "status" when that word is no
    command, a node name then) and the other words in their order."""
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            break
        if word.startswith("-"):
            i += 2 if word in VALUE_FLAGS else 1
            continue
        if word in COMMANDS:
            return word, args[:i] + args[i + 1:]
        break
    return "status", list(args)


def main(argv: list[str] | None = None) -> int:
    command, rest = command_and_rest(list(sys.argv[1:] if argv is None else argv))
    return gpu_dra([command, *rest], prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
