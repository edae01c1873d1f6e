"""Starts an MPS control daemon apart from the plugin: ``python -m dra.node.mpslaunch [--shm DIR]
[--cgroupns NSFILE] [--cgroup-root DIR --cgroup PATH] [--cgroup-procs FILE]... [--exec-env NAME=VALUE]...
-- PROGRAM ARGS...``.

It runs as its own, single-threaded process (the plugin is multi-threaded, where ``preexec_fn`` is unsafe):

* ``--cgroupns``: first enters the cgroup namespace of that file (``/proc/1/ns/cgroup``: the host's, where the
  plugin runs with the host's PID namespace) if it is not its own already. A container's private cgroup
  namespace (containerd's default on cgroup v2) hides every cgroup outside the container, and on a cgroup v2
  hierarchy mounted with ``nsdelegate`` (systemd's default) the kernel refuses, with ENOENT, a move whose source
  or destination is outside the writer's cgroup namespace. Where the file cannot be opened (no permission to
  inspect PID 1), the launcher stays in its own namespace, which is enough wherever that is the host's;
* ``--cgroup-root`` and ``--cgroup``: joins the cgroup PATH (relative to the cgroup root) in every hierarchy
  mounted at DIR (the host's ``/sys/fs/cgroup``: the unified hierarchy of cgroup v2, or each hierarchy of
  cgroup v1), creating it where missing;
* ``--cgroup-procs``: moves itself into the given cgroups (a ``cgroup.procs`` file per hierarchy);
  both, so that the daemon is not in the plugin container's cgroup and survives the container's restart or
  upgrade (the runtime ends every process of a container's cgroup when the container stops);
* ``--shm``: enters a private mount namespace whose ``/dev/shm`` is DIR, the directory the daemon's clients
  get as their ``/dev/shm`` (MPS server and clients share memory there);
* then executes PROGRAM, which forks the daemon into the background, with ``--exec-env`` added to its
  environment: the driver's LD_LIBRARY_PATH is for the driver's program, never for this Python, whose own
  libraries (libc, libm) would otherwise be looked up in the host's library folder first.

The plugin starts it in a new session (``setsid``), so the daemon leaves the plugin's process group too.
"""
from __future__ import annotations

import ctypes
import errno
import os
import sys
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18


class LaunchError(Exception):
    pass


def _fail(message: str) -> int:
    print(f"mpslaunch: {message}", file=sys.stderr)
    return 1


def enter_cgroup_namespace(ns_file: str) -> str:
    """Enter the cgroup namespace of ``ns_file`` unless it is this process's own. Returns a note for error
    messages ("" when entered or already there); raises LaunchError when setns refuses."""
    try:
        fd = os.open(ns_file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        return f"; the cgroup namespace {ns_file} could not be opened ({err.strerror}), so this ran in its own"
    try:
        theirs, ours = os.fstat(fd), os.stat("/proc/self/ns/cgroup")
        if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
            return ""
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWCGROUP) != 0:
            code = ctypes.get_errno()
            raise LaunchError(f"cannot enter the cgroup namespace {ns_file}: setns: {os.strerror(code)} "
                              "(needs CAP_SYS_ADMIN)")
        return ""
    finally:
        os.close(fd)


def cgroup_hierarchies(root: Path) -> list[Path]:
    """The hierarchies mounted at ``root``: the root itself on cgroup v2 (it has ``cgroup.procs``), else every
    directory under it that is one (cgroup v1 and a hybrid's ``unified``; the ``cpu,cpuacct`` style links to
    them are skipped)."""
    if (root / "cgroup.procs").is_file():
        return [root]
    return sorted(d for d in root.iterdir()
                  if not d.is_symlink() and d.is_dir() and (d / "cgroup.procs").is_file())


def _relative(path: str) -> Path:
    parts = [p for p in path.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise LaunchError(f"cgroup {path!r}: must name a cgroup below the root, without '.' or '..'")
    return Path(*parts)


def _make_cgroup(hierarchy: Path, relative: Path) -> Path:
    """Creates ``relative`` under the hierarchy's root where missing. A new cgroup v1 cpuset starts with no CPUs
    and memory nodes and takes no process: it gets its parent's."""
    current = hierarchy
    for part in relative.parts:
        parent, current = current, current / part
        try:
            current.mkdir()
        except FileExistsError:
            continue
        if not (current / "cgroup.controllers").exists():    # v1
            for name in ("cpuset.cpus", "cpuset.mems"):
                mine = current / name
                if mine.exists() and not mine.read_text().strip():
                    mine.write_text((parent / name).read_text())
    return current


def join_cgroup(root: str, path: str, note: str = "") -> None:
    """Moves this process into cgroup ``path`` in every hierarchy mounted at ``root``."""
    relative = _relative(path)
    top = Path(root)
    try:
        hierarchies = cgroup_hierarchies(top)
    except OSError as err:
        raise LaunchError(f"cgroup root {root}: {err.strerror or err}") from None
    if not hierarchies:
        raise LaunchError(f"cgroup root {root}: no cgroup hierarchy is mounted there (is the host's /sys/fs/cgroup "
                          "mounted at this path?)")
    for hierarchy in hierarchies:
        try:
            target = _make_cgroup(hierarchy, relative)
        except OSError as err:
            raise LaunchError(f"cannot create cgroup {hierarchy / relative}: {err.strerror or err}") from None
        subtree = target / "cgroup.subtree_control"
        if subtree.exists() and subtree.read_text().split():
            # cgroup v2's "no internal processes" rule: a cgroup that hands controllers to children cannot hold
            # processes itself (the kernel answers EBUSY).
            raise LaunchError(f"cgroup {target} enables controllers for child cgroups ({subtree.read_text().strip()}) "
                              "and so cannot hold processes (cgroup v2's no-internal-processes rule); name a leaf "
                              "cgroup")
        _write_procs(target / "cgroup.procs", note)


def _write_procs(procs: Path | str, note: str = "") -> None:
    try:
        with open(procs, "w") as out:
            out.write(str(os.getpid()))
    except OSError as err:
        hint = ""
        if err.errno == errno.ENOENT and Path(procs).parent.is_dir():
            hint = (" (cgroup v2 with nsdelegate moves a process only between cgroups inside the writer's cgroup "
                    "namespace: run the plugin with the host's PID namespace, so that /proc/1/ns/cgroup is the "
                    f"host's{note})")
        elif err.errno == errno.EBUSY:
            hint = " (the cgroup enables controllers for children: cgroup v2's no-internal-processes rule)"
        raise LaunchError(f"cannot move into cgroup {procs}: {err.strerror or err}{hint}") from None


def main(argv: list[str]) -> int:
    if "--" not in argv:
        return _fail("usage: python -m dra.node.mpslaunch [--shm DIR] [--cgroupns NSFILE] "
                     "[--cgroup-root DIR --cgroup PATH] [--cgroup-procs FILE]... [--exec-env NAME=VALUE]... "
                     "-- PROGRAM ARGS")
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1:]
    if not command:
        return _fail("no program to run")
    shm: str | None = None
    cgroupns: str | None = None
    cgroup_root, cgroup = "/sys/fs/cgroup", ""
    cgroups: list[str] = []
    exec_env: dict[str, str] = {}
    it = iter(options)
    for opt in it:
        value = next(it, None)
        if value is None:
            return _fail(f"{opt} needs a value")
        if opt == "--shm":
            shm = value
        elif opt == "--cgroupns":
            cgroupns = value
        elif opt == "--cgroup-root":
            cgroup_root = value
        elif opt == "--cgroup":
            cgroup = value
        elif opt == "--cgroup-procs":
            cgroups.append(value)
        elif opt == "--exec-env":
            name, eq, text = value.partition("=")
            if not eq or not name:
                return _fail(f"--exec-env {value!r}: must be NAME=VALUE")
            exec_env[name] = text
        else:
            return _fail(f"unknown option {opt}")
    try:
        # Before any cgroup file is opened: the kernel judges a write by the namespace it was opened in.
        note = enter_cgroup_namespace(cgroupns) if cgroupns else ""
        if cgroup:
            join_cgroup(cgroup_root, cgroup, note)
        for procs in cgroups:
            _write_procs(procs, note)
    except LaunchError as err:
        return _fail(str(err))
    if shm is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNS) != 0:
            return _fail(f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}")
        if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
            return _fail(f"making / private: {os.strerror(ctypes.get_errno())}")
        if libc.mount(shm.encode(), b"/dev/shm", None, MS_BIND, None) != 0:
            return _fail(f"bind-mounting {shm} on /dev/shm: {os.strerror(ctypes.get_errno())}")
    try:
        os.execvpe(command[0], command, {**os.environ, **exec_env})
    except OSError as err:
        return _fail(f"cannot run {command[0]}: {err.strerror or err}")
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
