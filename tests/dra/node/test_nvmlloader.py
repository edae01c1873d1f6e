"""Loading NVML from a mounted driver root: the path is found through the soname link inside the root."""
from __future__ import annotations

import ctypes.util
import shutil
from pathlib import Path

import pytest
from fixtures.fake_driver_root import DRIVER_VERSION, LIB_DIR, build_fake_driver_root

from dra.node.driverroot import DriverRoot
from dra.node.nvmlloader import NvmlLoadError, preload_nvml


def test_system_root_needs_no_preload() -> None:
    assert preload_nvml(DriverRoot("/")) is None


def test_unloadable_library_is_named(tmp_path: Path) -> None:
    tree = build_fake_driver_root(tmp_path)
    with pytest.raises(NvmlLoadError, match=r"cannot open .*libnvidia-ml\.so\." + DRIVER_VERSION.replace(".", r"\.")):
        preload_nvml(tree.driver_root())


def test_missing_library_names_the_root(tmp_path: Path) -> None:
    tree = build_fake_driver_root(tmp_path)
    for p in (tmp_path / "driver" / LIB_DIR).glob("libnvidia-ml.so*"):
        p.unlink()
    with pytest.raises(NvmlLoadError, match="no libnvidia-ml.so.1 found"):
        preload_nvml(tree.driver_root())


def test_real_library_behind_the_soname_link_is_opened(tmp_path: Path) -> None:
    """A real shared object stands in for NVML's file, so dlopen succeeds on the path we resolved."""
    tree = build_fake_driver_root(tmp_path)
    stand_in = ctypes.util.find_library("m")
    assert stand_in, "libm is needed as a loadable stand-in"
    found = next(Path(d) / stand_in for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64")
                 if (Path(d) / stand_in).exists())
    real = tmp_path / "driver" / LIB_DIR / f"libnvidia-ml.so.{DRIVER_VERSION}"
    shutil.copyfile(found, real)
    opened = preload_nvml(tree.driver_root())
    assert opened == str(real)
