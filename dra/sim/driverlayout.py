"""The CUDA stand-in (hack/cuda-standin) installed into a simulated node's driver root, laid out as a real
driver install is, so that the plugin's own library discovery (``dra.node.driverroot``) builds the CDI specs.

Three layouts, each with regular library files named after the driver version and soname links to them:

* ``host``: the driver installed on a Debian/Ubuntu host (driver root ``/``): ``usr/lib/<triplet>/`` and
  ``usr/bin/nvidia-smi``, real directories.
* ``operator``: the GPU operator's driver container (driver root ``/run/nvidia/driver``): the same files in a
  merged-/usr tree (``lib``, ``bin`` and ``lib64`` are links into ``usr``) whose soname links are absolute, so
  they resolve only inside the root.
* ``single-folder``: one folder for everything, as GKE's ``/usr/local/nvidia``: ``lib64/`` and ``bin/``.

The built stand-in directory has ``lib/libcuda.so.<built version>``, ``lib/libnvidia-ml.so.<built version>``
and ``bin/nvidia-smi``; the files are installed under the node's driver version whatever version they were
built with (the libraries do not depend on it).
"""
from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

LAYOUTS: tuple[str, ...] = ("host", "operator", "single-folder")
LIBRARIES: dict[str, str] = {"libcuda.so": "libcuda.so.1", "libnvidia-ml.so": "libnvidia-ml.so.1"}
BINARIES: tuple[str, ...] = ("nvidia-smi",)
_TRIPLETS = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu", "arm64": "aarch64-linux-gnu"}


class DriverLayoutError(ValueError):
    """The layout or the built stand-in cannot be used; the message names which and why."""


def triplet() -> str:
    machine = platform.machine()
    if machine not in _TRIPLETS:
        raise DriverLayoutError(f"no multiarch library folder known for machine {machine!r}")
    return _TRIPLETS[machine]


def _built_library(standin: Path, base: str) -> Path:
    found = sorted((standin / "lib").glob(f"{base}.*"))
    files = [p for p in found if p.is_file() and not p.is_symlink() and p.name != LIBRARIES[base]]
    if len(files) != 1:
        raise DriverLayoutError(f"{standin / 'lib'}: expected one built {base}.<version>, found "
                                f"{[p.name for p in files] or 'none'} (run hack/build-node.sh)")
    return files[0]


def _folders(layout: str) -> tuple[str, str]:
    """(library folder, binary folder) relative to the driver root."""
    if layout in ("host", "operator"):
        return f"usr/lib/{triplet()}", "usr/bin"
    if layout == "single-folder":
        return "lib64", "bin"
    raise DriverLayoutError(f"driver root layout {layout!r} is not one of {', '.join(LAYOUTS)}")


def install_standin(root: Path, standin: Path, layout: str, driver_version: str) -> list[str]:
    """Installs the stand-in's libraries and programs under ``root`` in ``layout``; returns the paths created
    (relative to root). ``root`` may exist; files of an earlier install are replaced."""
    lib_dir, bin_dir = _folders(layout)
    root = Path(root)
    created: list[str] = []
    if layout == "operator":
        for alias in ("lib", "bin", "lib64"):
            (root / "usr" / alias).mkdir(parents=True, exist_ok=True)
            link = root / alias
            if not link.is_symlink():
                link.symlink_to(f"usr/{alias}")
                created.append(alias)
    for d in (lib_dir, bin_dir):
        (root / d).mkdir(parents=True, exist_ok=True)
    for base, soname in LIBRARIES.items():
        src = _built_library(standin, base)
        name = f"{base}.{driver_version}"
        _copy(src, root / lib_dir / name)
        # The operator's links are absolute: they point into the root, not into the plugin's own /usr.
        target = f"/{lib_dir}/{name}" if layout == "operator" else name
        _link(root / lib_dir / soname, target)
        created += [f"{lib_dir}/{name}", f"{lib_dir}/{soname}"]
    for program in BINARIES:
        src = standin / "bin" / program
        if not src.is_file():
            raise DriverLayoutError(f"{src} is missing (run hack/build-node.sh)")
        _copy(src, root / bin_dir / program)
        created.append(f"{bin_dir}/{program}")
    return created


def _copy(src: Path, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.copyfile(src, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)


def _link(link: Path, target: str) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)
