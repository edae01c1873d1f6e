"""Wake a waiting thread when another process replaces or rewrites one file (Linux inotify, through libc).

A simulated node's NVML event wait (dra.sim.fakenvml) must notice another process's change of the state file
(``gpu-dra simulate xid``) while it waits. Looking at the file every fraction of a second kept an idle plugin
waking several times a second; a watch wakes only when something in the file's directory changes, and
calls ``on_change`` only for the file itself. ``FileWatch.start`` returns None where inotify is not available
(not Linux, the per-user limit of watches reached): the caller then looks at the file on a timer.
"""
from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
from pathlib import Path
from typing import Callable

_IN_CLOSE_WRITE = 0x008
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_CLOEXEC = os.O_CLOEXEC
_IN_NONBLOCK = os.O_NONBLOCK
_EVENT = struct.Struct("iIII")     # wd, mask, cookie, len; then len bytes of NUL-padded name

_libc: ctypes.CDLL | None = None
_libc_lock = threading.Lock()


def _inotify() -> ctypes.CDLL | None:
    global _libc
    with _libc_lock:
        if _libc is None:
            try:
                lib = ctypes.CDLL(None, use_errno=True)    # the process's own symbols: libc's among them
                lib.inotify_init1, lib.inotify_add_watch   # noqa: B018 - AttributeError where libc has none
            except (OSError, AttributeError):
                return None
            _libc = lib
        return _libc


class FileWatch:
    """One file's changes, watched from a daemon thread until ``stop``."""

    def __init__(self, path: Path, on_change: Callable[[], None], fd: int) -> None:
        self.path = path
        self._on_change = on_change
        self._fd = fd
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="sim-state-watch", daemon=True)

    @classmethod
    def start(cls, path: Path, on_change: Callable[[], None]) -> FileWatch | None:
        lib = _inotify()
        if lib is None:
            return None
        fd = lib.inotify_init1(_IN_CLOEXEC | _IN_NONBLOCK)
        if fd < 0:
            return None
        mask = _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
        if lib.inotify_add_watch(fd, os.fsencode(path.parent), mask) < 0:
            os.close(fd)
            return None
        watch = cls(path, on_change, fd)
        watch._thread.start()
        return watch

    def _run(self) -> None:
        name = os.fsencode(self.path.name)
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        try:
            while True:
                ready = {fd for fd, _ in poller.poll()}
                if self._stop_r in ready:
                    return
                try:
                    data = os.read(self._fd, 64 * 1024)
                except BlockingIOError:
                    continue
                if any(event_name == name for event_name in _names(data)):
                    self._on_change()
        finally:
            os.close(self._fd)
            os.close(self._stop_r)

    def stop(self) -> None:
        """End the watch; returns once its thread is gone (it never runs ``on_change`` after that)."""
        try:
            os.write(self._stop_w, b"x")
        finally:
            os.close(self._stop_w)
        if self._thread is not threading.current_thread():
            self._thread.join()


def _names(data: bytes) -> list[bytes]:
    names, at = [], 0
    while at + _EVENT.size <= len(data):
        _, _, _, length = _EVENT.unpack_from(data, at)
        at += _EVENT.size
        names.append(data[at:at + length].rstrip(b"\0"))
        at += length
    return names
