"""Opening the plugin's own state files without trusting whatever is in their place.

The plugin runs as root and its state directories are on the host, so a file it reads back may have been
replaced: by a symbolic link to a file elsewhere (a write would then change that file), by a FIFO or a device
(a read would hang or never end), or by a file another user wrote. Every open here therefore

* never follows a link in the last path component (``O_NOFOLLOW``; with ``dir_fd`` the name is resolved in a
  directory the caller already holds open, so the directory cannot be swapped between checks),
* never blocks in ``open`` (``O_NONBLOCK``, cleared again once the file is known to be regular),
* refuses anything that ``fstat`` does not show as a regular file owned by the plugin's effective UID,
* and reads at most ``max_bytes``.

A refusal raises ``UnsafeFile`` (an OSError, so callers that treat an unreadable file as damage need no new
case) whose message names the file and what was wrong; a missing file raises FileNotFoundError as usual.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from dra.node.atomicfile import write_atomic

_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class UnsafeFile(OSError):
    """A state file is not a regular file owned by the plugin (or is too large); ``str()`` is one line."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path} {problem}")
        self.path, self.problem = Path(path), problem

    def __str__(self) -> str:
        return str(self.args[0])


def file_kind(mode: int) -> str:
    """'a FIFO', 'a character device', ... for a log line."""
    for test, kind in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return kind
    return f"of unknown type {stat.S_IFMT(mode):o}"


def check_regular(st: os.stat_result, path: Path | str, owner: int | None = None) -> None:
    """Raise UnsafeFile unless ``st`` is a regular file owned by ``owner`` (default: the effective UID)."""
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(path, f"is {file_kind(st.st_mode)}, not a regular file")
    uid = os.geteuid() if owner is None else owner
    if st.st_uid != uid:
        raise UnsafeFile(path, f"is owned by UID {st.st_uid}, not by UID {uid} that writes it")


def open_regular(path: Path | str, flags: int = os.O_RDONLY, mode: int = 0o600, *, dir_fd: int | None = None,
                 owner: int | None = None) -> int:
    """Open ``path`` (a name in ``dir_fd`` when given) as a regular file owned by ``owner`` (default: the
    effective UID) and return the descriptor, in blocking mode. ``flags`` may add O_CREAT, O_APPEND, O_WRONLY,
    O_RDWR (O_CREAT creates the file, never the target of a dangling link). Raises UnsafeFile for a link, a
    non-regular file or another owner; other OSErrors (FileNotFoundError, PermissionError) as ``os.open``."""
    try:
        fd = os.open(path, flags | _OPEN_FLAGS, mode, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENODEV, errno.EOPNOTSUPP):
            # ELOOP: a link (O_NOFOLLOW); ENXIO: a FIFO/socket nobody reads (write, O_NONBLOCK); EISDIR...
            try:
                st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                raise err from None
            if stat.S_ISLNK(st.st_mode):
                raise UnsafeFile(path, "is a symbolic link; state files are never opened through links") from None
            raise UnsafeFile(path, f"is {file_kind(st.st_mode)}, not a regular file") from None
        raise
    try:
        check_regular(os.fstat(fd), path, owner)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_file(path: Path | str, max_bytes: int, *, dir_fd: int | None = None,
                      owner: int | None = None) -> bytes:
    """The content of ``path`` (a name in ``dir_fd`` when given), opened as ``open_regular`` does; a file
    larger than ``max_bytes`` raises UnsafeFile (nothing beyond that is read)."""
    fd = open_regular(path, os.O_RDONLY, dir_fd=dir_fd, owner=owner)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise UnsafeFile(path, f"is {size} bytes, more than the {max_bytes} allowed")
        chunks: list[bytes] = []
        total = 0
        while total <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:                # grew while being read
            raise UnsafeFile(path, f"is more than the {max_bytes} bytes allowed")
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_owned_dir(directory: Path | str, owner: int | None = None) -> None:
    """Raise UnsafeFile unless ``directory`` is a directory owned by ``owner`` (default: the effective UID) that
    no other user may write: only then can nobody else put a file or link under a name the plugin writes."""
    st = os.stat(directory)
    uid = os.geteuid() if owner is None else owner
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFile(directory, f"is {file_kind(st.st_mode)}, not a directory")
    if st.st_uid != uid:
        raise UnsafeFile(directory, f"is owned by UID {st.st_uid}, not by UID {uid} that writes in it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeFile(directory, f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})")


def write_regular_file(path: Path | str, data: bytes, mode: int = 0o600, durable: bool = True) -> None:
    """Replace ``path`` atomically (``write_atomic``: a new file created with O_EXCL|O_NOFOLLOW, renamed over
    the name, which replaces a link rather than following it) in a directory the plugin owns alone (created
    when missing). Raises UnsafeFile when the directory is not such a directory."""
    target = Path(path)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_owned_dir(target.parent)
    write_atomic(target, data, mode=mode, durable=durable)
