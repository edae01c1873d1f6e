"""Processes the plugin started and must find again, recognised by what no other process can forge.

A process name, command line or environment can be copied by any process on the node (a pod with ``hostPID``
sees every process). What identifies a process for its whole life is its PID together with its start time
(``/proc/<pid>/stat`` field 22, clock ticks after boot): a PID that is reused belongs to a process with a later
start time. The plugin records both when it starts a process and afterwards acts only on that pair.

Signals go through a pidfd opened *before* the start time is checked again, so the PID cannot be reused by
another process between the check and the signal: a pidfd keeps referring to the process it was opened for.
"""
from __future__ import annotations

import errno
import os
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_STAT_START_TIME = 19       # field 22 of /proc/<pid>/stat, counted from the field after ``(comm)``


@dataclass(frozen=True)
class ProcessIdentity:
    """One process for its whole life: its PID and its start time."""

    pid: int
    start_time: int

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "startTime": self.start_time}

    @classmethod
    def from_json(cls, doc: Any) -> ProcessIdentity | None:
        """The identity in a record, or None where it is absent or malformed."""
        if not isinstance(doc, dict):
            return None
        pid, start = doc.get("pid"), doc.get("startTime")
        if type(pid) is not int or type(start) is not int or pid <= 0 or start < 0:
            return None
        return cls(pid=pid, start_time=start)


def start_time(pid: int, proc_root: Path | str = "/proc") -> int | None:
    """The start time of process ``pid``, or None when there is no such process (or it cannot be read)."""
    try:
        with open(os.path.join(str(proc_root), str(pid), "stat"), "rb") as f:
            stat = f.read(4096)
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields follow its last ')'.
    fields = stat.rpartition(b")")[2].split()
    try:
        return int(fields[_STAT_START_TIME])
    except (IndexError, ValueError):
        return None


def identify(pid: int, proc_root: Path | str = "/proc") -> ProcessIdentity | None:
    started = start_time(pid, proc_root)
    return ProcessIdentity(pid=pid, start_time=started) if started is not None else None


def is_alive(ident: ProcessIdentity, proc_root: Path | str = "/proc") -> bool:
    """Whether the process of ``ident`` still runs (a zombie counts as gone)."""
    if start_time(ident.pid, proc_root) != ident.start_time:
        return False
    try:
        with open(os.path.join(str(proc_root), str(ident.pid), "stat"), "rb") as f:
            state = f.read(4096).rpartition(b")")[2].split()[:1]
    except OSError:
        return False
    return state != [b"Z"]


def _pidfd(ident: ProcessIdentity) -> int | None:
    """A pidfd for the process of ``ident``, or None when it is gone. The start time is checked after the pidfd
    is opened, in this process's own /proc (the pidfd's PID namespace)."""
    try:
        fd = os.pidfd_open(ident.pid)
    except ProcessLookupError:
        return None
    if start_time(ident.pid) != ident.start_time:
        os.close(fd)
        return None
    return fd


def send_signal(ident: ProcessIdentity, sig: int) -> bool:
    """Signal the process of ``ident`` through a pidfd; False when it is gone (never another process)."""
    fd = _pidfd(ident)
    if fd is None:
        return False
    try:
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def wait_gone(ident: ProcessIdentity, timeout_s: float) -> bool:
    """Wait until the process of ``ident`` has exited; True when it has within ``timeout_s``."""
    fd = _pidfd(ident)
    if fd is None:
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            # A pidfd is readable once its process has exited; a zombie (a child of ours) counts as gone.
            if poller.poll(max(0, int((deadline - time.monotonic()) * 1000))) or not is_alive(ident):
                return True
            if time.monotonic() >= deadline:
                return False
    except OSError as err:
        if err.errno == errno.EINTR:
            return not is_alive(ident)
        raise
    finally:
        os.close(fd)
