"""Installs the driver's own ``nvidia-cdi-hook`` on the node: the chart's init container copies it from the image
to the host path the plugin names in every CDI spec (``--cdi-hook-path``), so nodes need no NVIDIA Container
Toolkit.

    python3 -m dra.node.hookinstall SOURCE TARGET

The copy is atomic (a temporary file in TARGET's directory, renamed over it): runc may exec the hook for a
starting container at any moment, and a rename never shows it a half-written program; a running hook keeps the
file it started from. An identical TARGET is left as it is, so a restart of the plugin pod changes nothing.
"""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from dra.node.atomicfile import write_atomic

HOOK_MODE = 0o755


def install_hook(source: Path | str, target: Path | str) -> bool:
    """Copy ``source`` to ``target`` (mode 0755, root-owned as the caller); returns whether it was written."""
    data = Path(source).read_bytes()
    target = Path(target)
    try:
        st = target.lstat()
        # Only an executable regular file with the same bytes counts as installed; a link is replaced, not followed.
        if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == HOOK_MODE and target.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    write_atomic(target, data, mode=HOOK_MODE, durable=True)
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not os.path.isabs(args[1]):
        print("usage: python3 -m dra.node.hookinstall SOURCE /ABSOLUTE/TARGET", file=sys.stderr)
        return 2
    try:
        written = install_hook(args[0], args[1])
    except OSError as err:
        print(f"hookinstall: cannot install {args[0]} as {args[1]}: {err.strerror or err}", file=sys.stderr)
        return 1
    print(f"{'installed' if written else 'unchanged'}: {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
