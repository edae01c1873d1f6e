"""Starts an MPS control daemon apart from the plugin: ``python -m dra.node.mpslaunch [--shm DIR]
[--cgroup-procs FILE]... -- PROGRAM ARGS...``.

It runs as its own, single-threaded process (the plugin is multi-threaded, where ``preexec_fn`` is unsafe):

* ``--cgroup-procs``: moves itself into the given cgroups (a ``cgroup.procs`` file per hierarchy), so that
  the daemon is not in the plugin container's cgroup and survives the container's restart or upgrade;
* ``--shm``: enters a private mount namespace whose ``/dev/shm`` is DIR, the directory the daemon's clients
  get as their ``/dev/shm`` (MPS server and clients share memory there);
* then executes PROGRAM, which forks the daemon into the background.

The plugin starts it in a new session (``setsid``), so the daemon leaves the plugin's process group too.
"""
from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNS = 0x00020000
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18


def _fail(message: str) -> int:
    print(f"mpslaunch: {message}", file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    if "--" not in argv:
        return _fail("usage: python -m dra.node.mpslaunch [--shm DIR] [--cgroup-procs FILE]... -- PROGRAM ARGS")
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1:]
    if not command:
        return _fail("no program to run")
    shm: str | None = None
    cgroups: list[str] = []
    it = iter(options)
    for opt in it:
        value = next(it, None)
        if value is None:
            return _fail(f"{opt} needs a value")
        if opt == "--shm":
            shm = value
        elif opt == "--cgroup-procs":
            cgroups.append(value)
        else:
            return _fail(f"unknown option {opt}")
    for procs in cgroups:
        try:
            with open(procs, "w") as out:
                out.write(str(os.getpid()))
        except OSError as err:
            return _fail(f"cannot move into cgroup {procs}: {err.strerror or err}")
    if shm is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNS) != 0:
            return _fail(f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}")
        if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
            return _fail(f"making / private: {os.strerror(ctypes.get_errno())}")
        if libc.mount(shm.encode(), b"/dev/shm", None, MS_BIND, None) != 0:
            return _fail(f"bind-mounting {shm} on /dev/shm: {os.strerror(ctypes.get_errno())}")
    try:
        os.execvp(command[0], command)
    except OSError as err:
        return _fail(f"cannot run {command[0]}: {err.strerror or err}")
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
