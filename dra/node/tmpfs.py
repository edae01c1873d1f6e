"""Size-limited tmpfs mounts for directories the plugin shares with workload containers.

An MPS daemon and its clients share memory through their ``/dev/shm``: a directory on the host that clients get
read-write. As a plain host directory it has no size limit and is not counted as any pod's ephemeral storage,
so one client could fill the node's disk; a tmpfs of a fixed size bounds it. The plugin's state directory is
mounted with Bidirectional propagation in the chart, so a mount made here reaches the host and the containers.
"""
from __future__ import annotations

import ctypes
import os

MNT_DETACH = 2
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8


class MountError(OSError):
    """A mount or unmount the kernel refused; the message names the path and the reason."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def is_mountpoint(path: str) -> bool:
    return os.path.ismount(path)


def mount_tmpfs(path: str, size_bytes: int, mode: int = 0o1777) -> None:
    """Mount a tmpfs of ``size_bytes`` at ``path`` (nosuid, nodev, noexec)."""
    if size_bytes <= 0:
        raise MountError(f"tmpfs at {path}: size must be positive, got {size_bytes}")
    data = f"size={size_bytes},mode={mode:o}".encode()
    if _libc().mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, data) != 0:
        code = ctypes.get_errno()
        raise MountError(code, f"mounting a tmpfs of {size_bytes} bytes at {path}: {os.strerror(code)}")


def unmount(path: str) -> None:
    """Detach the mount at ``path`` (lazily: a client still holding a file keeps it until it exits)."""
    if _libc().umount2(path.encode(), MNT_DETACH) != 0:
        code = ctypes.get_errno()
        raise MountError(code, f"unmounting {path}: {os.strerror(code)}")
