"""Loading the real NVML library from the driver root.

pynvml opens ``libnvidia-ml.so.1`` by soname. In the plugin container the driver lives under a mounted
driver root (e.g. /driver-root), outside the loader's search path. Opening the library by its full path
first makes the later dlopen by soname return the same, already loaded library. The driver root is read with its
device and /proc roots (the node's ``--dev-root`` and ``--proc-root``): ``dra.node.nodeobjects`` builds it so.
"""
from __future__ import annotations

import ctypes
from pathlib import PurePosixPath

from dra.node.driverroot import DriverRoot

NVML_SONAME = "libnvidia-ml.so.1"


class NvmlLoadError(RuntimeError):
    """NVML could not be found or opened under the driver root."""


def preload_nvml(driver_root: DriverRoot) -> str | None:
    """Open NVML from ``driver_root``; returns the path opened, or None when the root is the system's own
    (the loader finds the library there by itself)."""
    if str(driver_root.root) in ("/", ""):
        return None
    files = driver_root.files()
    candidates = [link.resolved.container_path for link in files.soname_links
                  if PurePosixPath(link.container_path).name == NVML_SONAME]
    candidates += [lib.container_path for lib in files.libraries
                   if PurePosixPath(lib.container_path).name.startswith("libnvidia-ml.so.")]
    if not candidates:
        raise NvmlLoadError(f"driver root {driver_root.root}: no {NVML_SONAME} found; is the NVIDIA driver installed there?")
    path = str(driver_root.root).rstrip("/") + candidates[0]
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise NvmlLoadError(f"cannot open {path}: {exc}") from None
    return path
