"""Our plugin as the image runs it, for measurements that compare it with another driver's binary.

The development virtualenv is not what a node runs: it holds the dev tools' packages too (import-linter pulls in
`rich`, which structlog imports whenever it is installed: ~4.7 MiB of RSS and tens of ms of start-up), and an
editable install whose path finder runs at every interpreter start. The image holds only the wheels of
deploy/image/requirements.lock. So the side-by-side benchmark runs ours on exactly those wheels, installed once
per lock into ~/.cache/gpu-dra/bench-runtime/<lock hash>/site (from the image build's wheel cache, downloaded
with their hashes checked when absent), by this machine's Python 3.11 with `-S` (no site-packages at all) and
the checkout's code from the working directory.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from testbed.localcluster import CACHE_ENV

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "deploy" / "image" / "requirements.lock"


class ImageRuntimeError(RuntimeError):
    """The image's wheels could not be installed; the message says which step failed."""


def _cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gpu-dra")


def image_site() -> Path:
    """The directory holding the image's locked wheels, installed (reused when present)."""
    key = hashlib.sha256(LOCK.read_bytes()).hexdigest()[:16]
    site = _cache() / "bench-runtime" / key / "site"
    if (site.parent / "done").exists():
        return site
    wheels = _cache() / "image" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    for what, argv in (
            ("download", [*pip, "download", "--no-deps", "--require-hashes", "-r", str(LOCK), "-d", str(wheels)]),
            ("install", [*pip, "install", "--no-deps", "--no-index", "--find-links", str(wheels), "--require-hashes",
                         "--target", str(site), "-r", str(LOCK)])):
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ImageRuntimeError(f"pip {what} of {LOCK.relative_to(REPO)} failed (exit {proc.returncode}):\n"
                                + "\n".join(proc.stderr.strip().splitlines()[-15:]))
    _drop_cached_pages(site)
    (site.parent / "done").write_text(LOCK.name + "\n")
    return site


def _drop_cached_pages(site: Path) -> None:
    """Just written, the libraries sit in the page cache in large folios, which a process that maps them takes
    into its RSS whole (grpc's alone: 13 instead of 7 MiB). Dropped once, they are read back as a node reads
    its image's files, and RSS compares with the development virtualenv's."""
    for root, _, files in os.walk(site):
        for name in files:
            if ".so" in name:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def image_python() -> tuple[list[str], dict[str, str]]:
    """The interpreter argv prefix and the environment that run `-m cli.main` (from the checkout, the working
    directory) on the image's wheels alone."""
    return [sys.executable, "-S"], {"PYTHONPATH": str(image_site())}
