"""The host plumbing of a `LocalNode` (testbed.localnode): what it reads of the host and what puts the host back.

A real kubelet changes the host outside the node's work dir: cgroups under a cgroup root of the node's own,
host sysctls and a few host directories. Host facts here (the node's address and name, cgroup hierarchies,
mounts, sysctls, processes) are read from ``/proc`` and ``/proc/sys``. The records directory holds one record
per running node of what it will change, written before it changes anything; `cleanup_record` undoes what one
record lists (processes killed, mounts under the work dir unmounted, cgroups removed, sysctls restored, host
paths that did not exist removed) and `cleanup_leftovers` does so for every node whose process died without
stopping it.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from api.k8snames import is_dns_subdomain
from testbed.localcluster import ClusterError

log = logging.getLogger(__name__)

RECORDS_ENV = "GPU_DRA_NODE_RECORDS"
# Outside any work dir and not on tmpfs: a record must outlive the test process and a reboot (the host
# paths it lists survive a reboot; processes, mounts and cgroups do not, and cleaning them is a no-op).
DEFAULT_RECORDS_DIR = Path("/var/tmp/gpu-dra-localnode")
_MNT_DETACH = 2


class NodeError(ClusterError):
    """The node could not be built, started, run or cleaned; the message says which part and why."""


# ---- host facts -----------------------------------------------------------------------------------


def node_ip() -> str:
    """The host's address towards its default route (the kubelet rejects a loopback --node-ip)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.255", 9))  # no packet is sent: this only asks for the route's source address
            addr = str(s.getsockname()[0])
        if not ipaddress.ip_address(addr).is_loopback:
            return addr
    except OSError:
        pass
    proc = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        m = re.search(r"\sinet\s+([0-9.]+)/", line)
        if m:
            return m.group(1)
    raise NodeError("no non-loopback IPv4 address on this host: the kubelet needs one for --node-ip")


def _local_addresses() -> set[str]:
    proc = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True)
    return {m.group(1) for m in re.finditer(r"\sinet6?\s+([0-9a-fA-F.:]+)/", proc.stdout)}


def local_hostname() -> str | None:
    """The host name if it is a valid node name and resolves to an address of this host, else None.

    The API server reaches a kubelet (``kubectl logs``, ``exec``) through the node's Hostname address, which
    is the node name: a node named so is reachable, any other name is not."""
    name = socket.gethostname().lower()
    if not is_dns_subdomain(name, 63):
        return None
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except OSError:
        return None
    local = _local_addresses()
    return name if addrs and all(ipaddress.ip_address(a).is_loopback or a in local for a in addrs) else None


def cgroup_hierarchies() -> list[Path]:
    """Mount points of every cgroup hierarchy (v1 controllers, named ones and a v2 unified mount)."""
    out = []
    for mnt in _mountinfo():
        if mnt["fstype"] in ("cgroup", "cgroup2"):
            out.append(Path(mnt["mountpoint"]))
    return sorted(set(out))


def cgroup_v2_only() -> bool:
    return [m["fstype"] for m in _mountinfo() if m["mountpoint"] == "/sys/fs/cgroup"] == ["cgroup2"]


def read_sysctl(key: str) -> str | None:
    try:
        return (Path("/proc/sys") / key.replace(".", "/")).read_text().strip()
    except OSError:
        return None


def _write_sysctl(key: str, value: str) -> None:
    (Path("/proc/sys") / key.replace(".", "/")).write_text(value + "\n")


def _unescape_mount(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _mountinfo() -> list[dict[str, str]]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        out.append({"mountpoint": _unescape_mount(fields[4]), "fstype": rfields[0] if rfields else ""})
    return out


def mounts_under(path: Path | str) -> list[str]:
    """Mount points at or below `path`, deepest last."""
    root = os.path.realpath(path)
    return [m["mountpoint"] for m in _mountinfo()
            if m["mountpoint"] == root or m["mountpoint"].startswith(root.rstrip("/") + "/")]


def _proc_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def proc_start(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return ""


def _proc_environ(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def processes_mentioning(text: str, environ: bool = False) -> list[int]:
    """Live (not zombie) processes whose command line (or, with `environ`, environment) contains `text`, e.g.
    a path in a node's work dir."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            pid = int(entry.name)
            if (text in _proc_cmdline(pid) or (environ and text in _proc_environ(pid))) \
                    and _proc_state(pid) not in ("Z", "X", ""):
                pids.append(pid)
    return pids


def cgroup_dirs(cgroup_root: str) -> list[Path]:
    """The node's cgroup directories in every hierarchy that has them, deepest first."""
    found: list[Path] = []
    for hier in cgroup_hierarchies():
        top = hier / cgroup_root.strip("/")
        if top.is_dir():
            found.extend(p for p in top.rglob("*") if p.is_dir())
            found.append(top)
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def cgroup_pids(cgroup_root: str) -> set[int]:
    pids: set[int] = set()
    for d in cgroup_dirs(cgroup_root):
        try:
            pids.update(int(x) for x in (d / "cgroup.procs").read_text().split())
        except (OSError, ValueError):
            pass
    return pids


# ---- the record of what a node changes outside its work dir ---------------------------------------


def records_dir() -> Path:
    return Path(os.environ.get(RECORDS_ENV) or DEFAULT_RECORDS_DIR)


@contextmanager
def records_lock() -> Iterator[Path]:
    """Serialises record changes between processes. The last record's removal removes the directory and its
    lock file, so a lock taken on a file that has since been unlinked is retried on the new one."""
    d = records_dir()
    while True:
        d.mkdir(parents=True, exist_ok=True)
        with open(d / ".lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                same = os.fstat(fh.fileno()).st_ino == os.stat(d / ".lock").st_ino
            except FileNotFoundError:
                same = False
            if same:
                try:
                    yield d
                finally:
                    if not record_paths(d):
                        (d / ".lock").unlink(missing_ok=True)
                        try:
                            d.rmdir()
                        except OSError:
                            pass
                return


def read_record(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def write_record(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(path)


def record_paths(d: Path) -> list[Path]:
    return sorted(d.glob("*.json"))


def _owner_alive(record: dict[str, Any]) -> bool:
    pid = int(record.get("owner_pid", 0))
    return pid > 0 and proc_start(pid) == record.get("owner_start")


def first_missing_ancestor(path: str) -> str | None:
    """The topmost component of `path` that does not exist (what creating `path` would create), or None."""
    p = Path(path)
    if p.exists() or p.is_symlink():
        return None
    while not p.parent.exists() and p.parent != p:
        p = p.parent
    return str(p)


def cleanup_leftovers() -> list[str]:
    """Cleans up after nodes whose process died without stopping them (killed test runs, crashes): for each
    record whose owner is gone, what `cleanup_record` does. Call it before starting nodes, e.g. at the start
    of a test session. Returns the names of the nodes cleaned; raises NodeError if one could not be."""
    cleaned, problems = [], []
    d = records_dir()
    if not d.is_dir():
        return []
    for path in record_paths(d):
        record = read_record(path)
        if record is None or _owner_alive(record):
            continue
        log.warning("cleaning up after node %s (work dir %s), left by process %s",
                    record.get("name"), record.get("workdir"), record.get("owner_pid"))
        problems += cleanup_record(path)
        cleaned.append(str(record.get("name")))
    if problems:
        raise NodeError("leftovers of earlier nodes could not all be cleaned:\n" + "\n".join(problems))
    return cleaned


def cleanup_record(path: Path | str) -> list[str]:
    """Forcibly undoes what the node of record `path` did: kills its kubelet, containerd, shims and
    containers, unmounts everything under its work dir, removes its cgroups, restores the sysctls and removes
    the host paths it created (both handed over to another node's record instead while one exists, since
    that node still relies on them), removes its work dir if it made it, and finally the record.
    Returns what could not be done (empty when everything was)."""
    path = Path(path)
    record = read_record(path)
    if record is None:
        return []
    problems: list[str] = []
    workdir = str(record["workdir"])
    cgroup_root = str(record["cgroup_root"])
    for pid in _kill_node_processes(workdir, cgroup_root, [int(p) for p in record.get("pids", {}).values()]):
        problems.append(f"{record['name']}: process {pid} survived SIGKILL: {_proc_cmdline(pid)[:200]}")
    for mnt in _unmount_all(workdir):
        problems.append(f"{record['name']}: still mounted: {mnt}")
    for cg in _remove_cgroups(cgroup_root):
        problems.append(f"{record['name']}: cgroup not removed: {cg}")
    with records_lock() as d:
        others = [p for p in record_paths(d) if p != path and read_record(p) is not None]
        if others:
            # Another node started after this one inherited its view of the host; hand over.
            heir_path = min(others, key=lambda p: float((read_record(p) or {}).get("created", 0)))
            heir = read_record(heir_path) or {}
            for key, value in record.get("sysctls", {}).items():
                heir.setdefault("sysctls", {}).setdefault(key, value)
            paths = set(heir.get("created_paths", [])) | set(record.get("created_paths", []))
            heir["created_paths"] = sorted(paths)
            write_record(heir_path, heir)
        else:
            problems += _restore_sysctls(record.get("sysctls", {}))
            problems += _remove_created_paths(record.get("created_paths", []))
        if record.get("created_workdir") and Path(workdir).exists():
            left = mounts_under(workdir)
            if left:  # never delete through a mount: it could reach host files
                problems.append(f"{record['name']}: work dir {workdir} kept: mounts remain: {', '.join(left)}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
                if Path(workdir).exists():
                    problems.append(f"{record['name']}: work dir {workdir} could not be removed")
        if not problems:
            path.unlink(missing_ok=True)
    return problems


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    try:  # our own children (kubelet, containerd of this process): reap them
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _kill_node_processes(workdir: str, cgroup_root: str, known: Sequence[int], timeout: float = 10.0) -> list[int]:
    """SIGKILLs the kubelet first (so it restarts nothing), then every process in the node's cgroups
    (containers, pause), then whatever names the work dir in its command line or environment (containerd,
    shims, a kubelet plugin and the daemons it started with state in the work dir, such as simulated MPS
    control daemons, which run in their own session). Returns the survivors."""
    for pid in known:
        if workdir in _proc_cmdline(pid):
            _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while True:
        victims = (cgroup_pids(cgroup_root) | set(processes_mentioning(workdir.rstrip("/") + "/", environ=True))) \
            - {os.getpid()}
        victims = {p for p in victims if _proc_state(p) not in ("Z", "X", "")}
        if not victims or time.monotonic() > deadline:
            return sorted(victims)
        log.info("killing processes of the node in %s: %s", workdir,
                 ", ".join(f"{p} ({_proc_cmdline(p)[:80].strip()})" for p in sorted(victims)))
        for pid in victims:
            _signal(pid, signal.SIGKILL)
        time.sleep(0.1)


_libc: ctypes.CDLL | None = None


def _umount(path: str) -> int:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.umount2(os.fsencode(path), _MNT_DETACH) == 0:
        return 0
    return ctypes.get_errno()


def _unmount_all(workdir: str) -> list[str]:
    """Detaches every mount at or below `workdir`, deepest first; returns those that remain."""
    for _ in range(20):
        mounts = mounts_under(workdir)
        if not mounts:
            return []
        # Reverse mount order unmounts stacked mounts top first; sort by depth for nested ones.
        for mnt in sorted(reversed(mounts), key=lambda m: m.count("/"), reverse=True):
            err = _umount(mnt)
            if err not in (0, errno.EINVAL, errno.ENOENT):
                log.warning("umount %s: %s", mnt, os.strerror(err))
    return mounts_under(workdir)


def _remove_cgroups(cgroup_root: str, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for d in cgroup_dirs(cgroup_root):
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                left.append(d)
        if not left or time.monotonic() > deadline:
            return [str(d) for d in left]
        for pid in cgroup_pids(cgroup_root):
            _signal(pid, signal.SIGKILL)
        time.sleep(0.1)


def _restore_sysctls(saved: dict[str, str | None]) -> list[str]:
    problems = []
    for key, value in saved.items():
        if value is None or read_sysctl(key) == value:
            continue
        try:
            _write_sysctl(key, value)
        except OSError as exc:
            problems.append(f"sysctl {key}: cannot restore {value}: {exc}")
    return problems


def _remove_created_paths(paths: Sequence[str]) -> list[str]:
    problems = []
    for p in sorted(paths, key=lambda s: s.count("/"), reverse=True):
        if not (os.path.exists(p) or os.path.islink(p)):
            continue
        if mounts_under(p):
            problems.append(f"{p} kept: mounts remain: {', '.join(mounts_under(p))}")
            continue
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        except OSError as exc:
            problems.append(f"cannot remove {p}: {exc}")
    return problems
