"""Crash-safe file replacement.

Container runtimes read CDI specs and the plugin re-reads its checkpoint after a crash, so neither may ever
see a half-written file: write a temporary file in the same directory, rename it over the target (atomic on
POSIX within one file system). ``durable=True`` also fsyncs the file and the directory, so the new content
survives a power cut; files whose content a reboot makes meaningless anyway (CDI specs under /var/run, which
name devices that exist only until the reboot) skip that: a crash of the process alone never loses what
``write()`` handed to the kernel.
"""
from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

# Temporary files start with a dot and end in ".tmp": CDI loaders only read *.json / *.yaml, and
# cleanup code can recognise leftovers from a crash by this shape.
TEMP_SUFFIX = ".tmp"


def temp_prefix(target: Path) -> str:
    return f".{target.name}."


def write_atomic(path: Path | str, data: bytes, mode: int = 0o644, durable: bool = True,
                 before_replace: Callable[[], None] | None = None) -> None:
    """Replace ``path`` with ``data`` so that readers see either the old or the new content, never a mix.
    ``before_replace`` runs between the temporary file's write and its rename (a crash hook for tests)."""
    target = Path(path)
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    # mkstemp creates with O_EXCL|O_NOFOLLOW, and a rename replaces a link at ``target`` instead of following
    # it: no write here reaches a file a planted link points to.
    fd, tmp_name = tempfile.mkstemp(prefix=temp_prefix(target), suffix=TEMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)   # the file just written, not whatever the name now points to
            if durable:
                os.fsync(handle.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp_name, target)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    """Persist a rename or unlink in ``directory`` (a no-op where directories cannot be opened)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def remove_file(path: Path | str, durable: bool = True) -> bool:
    """Delete ``path`` (durably: the removal survives a power cut); a file that is already gone is fine.
    Returns whether a file was removed."""
    target = Path(path)
    try:
        target.unlink()
    except FileNotFoundError:
        return False
    if durable:
        fsync_dir(target.parent)
    return True


def leftover_temp_files(directory: Path | str, targets: Iterable[str] | None = None) -> list[Path]:
    """Temporary files a crashed ``write_atomic`` left behind in ``directory``: of any file, or of the files
    named ``targets`` only (where others write their own files in the same directory)."""
    base = Path(directory)
    if not base.is_dir():
        return []
    prefixes = tuple(f".{t}." for t in targets) if targets is not None else (".",)
    return sorted(p for p in base.iterdir() if p.name.startswith(prefixes) and p.name.endswith(TEMP_SUFFIX))


def remove_leftover_temp_files(directory: Path | str, targets: Iterable[str] | None = None,
                               older_than_s: float = 0.0) -> list[Path]:
    """Delete what ``leftover_temp_files`` finds (those modified at least ``older_than_s`` ago: where another
    process may be writing the same files right now); returns the files removed."""
    removed = []
    for path in leftover_temp_files(directory, targets):
        try:
            if older_than_s and time.time() - path.lstat().st_mtime < older_than_s:
                continue
        except FileNotFoundError:
            continue
        if remove_file(path, durable=False):
            removed.append(path)
    return removed


def set_aside(path: Path | str, now: float | None = None) -> Path:
    """Move an unreadable start-up file (or whatever is in its place) out of the way as
    ``<name>.corrupt-<UTC timestamp>[-n]``, keeping it for a post-mortem. Returns the new path; raises OSError
    when it cannot be moved."""
    source = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(time.time() if now is None else now))
    target = source.with_name(f"{source.name}.corrupt-{stamp}")
    n = 1
    while os.path.lexists(target):            # a dangling link there is taken too
        n += 1
        target = source.with_name(f"{source.name}.corrupt-{stamp}-{n}")
    source.rename(target)
    return target
