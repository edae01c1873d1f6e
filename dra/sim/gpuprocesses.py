"""GPU processes of a simulated node: what the CUDA stand-in registers, found again by their host PIDs.

The stand-in's ``cuCtxCreate``/``cuMemAlloc`` (hack/cuda-standin/libcuda.c) write one file per context into the
node's process directory (``<state dir>/sim-procs``, mounted read-write at ``/run/nvidia-sim-procs`` into every
GPU container of a simulated node), one line::

    v1 <pid namespace inode> <pid in it> <start time, clock ticks after boot> <MPS client 0|1> <bytes> <uuid>

A container's PIDs are not the host's, so a registration names its process by what the host can check in
``/proc/<host pid>``: the inode of ``ns/pid``, the last ``NSpid`` entry of ``status`` and field 22 of ``stat``.
The simulated NVML (dra/sim/fakenvml.py) answers ``nvmlDeviceGetComputeRunningProcesses`` from these, with host
PIDs, as the real driver does. A registration whose process is gone (killed before ``cuCtxDestroy``) is
dropped and its file removed, as the driver frees a dead process's memory.

The directory is writable by every GPU container of a simulated node, so its files are untrusted input: read
with O_NOFOLLOW, regular files only, at most ``MAX_FILES`` files of ``MAX_LINE`` bytes, malformed ones skipped.
"""
from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from dra.node.processidentity import start_time

log = logging.getLogger(__name__)

PROCESS_CONTAINER_DIR = "/run/nvidia-sim-procs"
PROCESS_STATE_DIR = "sim-procs"          # under the plugin's state directory, beside the GPU listing
MAX_FILES = 4096
MAX_LINE = 512
_LINE = re.compile(r"v1 (\d{1,20}) (\d{1,10}) (\d{1,20}) ([01]) (\d{1,20}) ((?:GPU|MIG)-[0-9A-Za-z-]{1,80})\n?")


@dataclass(frozen=True)
class Registration:
    """One context of one process, as the stand-in wrote it."""

    pidns: int
    nspid: int
    start: int
    mps_client: bool
    used_bytes: int
    uuid: str                 # GPU or MIG device the context is on
    file: str                 # its file name in the directory

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.pidns, self.nspid, self.start)


@dataclass(frozen=True)
class GpuProcess:
    """A registered process as NVML reports it."""

    pid: int                  # in the host's PID namespace
    uuid: str
    used_bytes: int
    mps_client: bool


def parse_registration(text: str, file: str) -> Registration | None:
    m = _LINE.fullmatch(text)
    if not m:
        return None
    return Registration(int(m[1]), int(m[2]), int(m[3]), m[4] == "1", int(m[5]), m[6], file)


def read_registrations(directory: Path) -> list[Registration]:
    """Every well-formed registration in the directory (none when it does not exist)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    if len(names) > MAX_FILES:
        log.warning("simulated GPU process directory %s holds %d files; reading the first %d", directory,
                    len(names), MAX_FILES)
    out = []
    for name in names[:MAX_FILES]:
        if name.startswith(".") or name.endswith(".tmp"):
            continue
        try:
            fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            data = os.read(fd, MAX_LINE + 1)
        except OSError:
            continue
        finally:
            os.close(fd)
        reg = parse_registration(data.decode("ascii", "replace"), name) if len(data) <= MAX_LINE else None
        if reg is not None:
            out.append(reg)
    return out


def _identity(proc_root: Path, pid: int) -> tuple[int, int, int] | None:
    """(pid namespace inode, PID in it, start time) of a host process, or None when it is gone."""
    base = proc_root / str(pid)
    try:
        pidns = os.stat(base / "ns" / "pid").st_ino
        with open(base / "status", "rb") as f:
            status = f.read(8192)
    except OSError:
        return None
    m = re.search(rb"^NSpid:\s*([\d\s]+?)\s*$", status, re.M)
    start = start_time(pid, proc_root)
    if m is None or start is None:
        return None
    return (pidns, int(m[1].split()[-1]), start)


class HostPids:
    """Finds host PIDs by (pid namespace inode, PID in it, start time); remembers what it found and checks a
    remembered PID again before using it (a PID is reused only by a process with another start time)."""

    def __init__(self, proc_root: Path | str = "/proc") -> None:
        self.proc_root = Path(proc_root)
        self._known: dict[tuple[int, int, int], int] = {}

    def find(self, keys: set[tuple[int, int, int]]) -> dict[tuple[int, int, int], int]:
        found = {k: p for k, p in self._known.items() if k in keys and _identity(self.proc_root, p) == k}
        missing = keys - found.keys()
        if missing:
            for entry in os.scandir(self.proc_root):
                if entry.name.isdigit() and (ident := _identity(self.proc_root, int(entry.name))) in missing:
                    found[ident] = int(entry.name)
        self._known = dict(found)
        return found


class ProcessRegistry:
    """The node's registered GPU processes, with host PIDs (what the simulated NVML reports)."""

    def __init__(self, directory: Path | str, proc_root: Path | str = "/proc") -> None:
        self.directory = Path(directory)
        self.pids = HostPids(proc_root)

    def processes(self) -> list[GpuProcess]:
        regs = read_registrations(self.directory)
        pids = self.pids.find({r.key for r in regs})
        out = []
        for r in regs:
            pid = pids.get(r.key)
            if pid is None:
                self._forget(r)
                continue
            out.append(GpuProcess(pid, r.uuid, r.used_bytes, r.mps_client))
        return out

    def _forget(self, reg: Registration) -> None:
        try:
            os.unlink(self.directory / reg.file)
        except OSError:
            pass
