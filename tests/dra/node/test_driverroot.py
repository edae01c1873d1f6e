"""Driver library discovery in every layout a node may have, with fake trees, and the CDI spec each gets: the
hook refreshes the container's loader cache with the layout's own library folder (a Debian or Ubuntu image
searches none but its own), and the reference library loads every spec. A driver root without libcuda names the
flag and the roots on the node that have it."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import cdivalidate
import pytest
from fixtures.fake_driver_root import FakeDriverTree, build_fake_driver_root

from dra.node.cdi import ClaimDevice, build_claim_spec
from dra.node.driverroot import KNOWN_DRIVER_ROOTS, DriverRoot, DriverRootError, find_driver_roots

GPU0 = ClaimDevice(name="gpu-0", uuid="GPU-aaaa", gpu_minor=0, gpu_index=0, requests=("gpu",))
HOOK = "/var/lib/kubelet/plugins/gpu.dra-driver.io/bin/nvidia-cdi-hook"


@dataclass(frozen=True)
class Layout:
    name: str
    host_root: str          # where the host has the driver (the chart's driverRoot)
    lib_dir: str            # library folder inside the root
    bin_dir: str
    merged_usr: bool        # lib -> usr/lib (Debian) or lib64 -> usr/lib64 (RHEL)


LAYOUTS = [
    Layout("host-debian", "/", "usr/lib/x86_64-linux-gnu", "usr/bin", True),
    Layout("host-rhel", "/", "usr/lib64", "usr/bin", True),
    Layout("gpu-operator", "/run/nvidia/driver", "usr/lib/x86_64-linux-gnu", "usr/bin", True),
    Layout("single-folder", "/home/kubernetes/bin/nvidia", "lib64", "bin", False),
]


def build(tmp_path: Path, layout: Layout) -> tuple[FakeDriverTree, DriverRoot]:
    tree = build_fake_driver_root(tmp_path / "node", lib_dir=layout.lib_dir, bin_dir=layout.bin_dir,
                                  merged_usr=layout.merged_usr, with_firmware=layout.bin_dir != "bin")
    if layout.lib_dir == "usr/lib64":
        os.symlink("usr/lib64", tree.root / "lib64")   # RHEL's merged /usr: the same folder twice
    hook = tmp_path / HOOK.lstrip("/")
    hook.parent.mkdir(parents=True)
    hook.write_text("#!/bin/sh\n")
    hook.chmod(0o755)
    # The plugin sees the hook at its host path; here the test's copy stands for it.
    root = DriverRoot(tree.root, host_root=layout.host_root, dev_root=tree.dev_root, host_dev_root="/",
                      proc_root=tree.proc_root, hook_path=str(hook))
    return tree, root


@pytest.mark.parametrize("layout", LAYOUTS, ids=[la.name for la in LAYOUTS])
def test_libraries_tools_and_spec_in_every_layout(tmp_path: Path, layout: Layout) -> None:
    tree, root = build(tmp_path, layout)
    files = root.files()
    folder = "/" + layout.lib_dir
    assert files.lib_folders == (folder,)
    assert sorted(Path(lib.container_path).name for lib in files.libraries) == sorted(
        f"{n}.{tree.version}" for n in
        ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so", "libnvidia-nvvm.so"))
    for lib in files.libraries:   # each library once, in the layout's folder, by its host path
        assert lib.container_path.startswith(folder + "/")
        assert lib.host_path == os.path.join(layout.host_root, lib.container_path.lstrip("/"))
    assert {Path(link.container_path).name for link in files.soname_links} >= {"libcuda.so.1", "libnvidia-ml.so.1"}
    smi = next(b for b in files.binaries if b.container_path.endswith("/nvidia-smi"))
    assert smi.container_path == "/" + layout.bin_dir + "/nvidia-smi"
    assert files.version == tree.version

    spec, _ = build_claim_spec("0b5c3f2a-9d1e-4f7a-8c6b-2e4d1a7f9c30", [GPU0], root)
    hooks = {h["args"][1]: h for h in spec["containerEdits"]["hooks"]}
    assert set(hooks) == {"create-symlinks", "update-ldcache", "disable-device-node-modification"}
    assert {h["path"] for h in hooks.values()} == {str(tmp_path / HOOK.lstrip("/"))}
    assert hooks["update-ldcache"]["args"][2:] == ["--folder", folder]
    assert f"libcuda.so.{tree.version}::{folder}/libcuda.so.1" in hooks["create-symlinks"]["args"]
    mounts = {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}
    assert mounts[f"{folder}/libcuda.so.{tree.version}"] == os.path.join(
        layout.host_root, layout.lib_dir, f"libcuda.so.{tree.version}")
    assert f"{folder}/libcuda.so.1" not in mounts   # the hook makes the link
    cdivalidate.check_specs([spec])


def fake_host(tmp_path: Path, layout: Layout) -> Path:
    """A host file system with the layout's driver at its host path, seen through <proc>/1/root."""
    host = tmp_path / "host-fs"
    tree = build_fake_driver_root(tmp_path / "src", lib_dir=layout.lib_dir, bin_dir=layout.bin_dir,
                                  merged_usr=layout.merged_usr)
    target = host / layout.host_root.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        shutil.rmtree(target)
    shutil.move(str(tree.root), str(target))
    return host


def test_no_libcuda_names_the_flag_and_the_roots_that_have_it(tmp_path: Path) -> None:
    single = next(la for la in LAYOUTS if la.name == "single-folder")
    host = fake_host(tmp_path, single)
    (host / "usr/local").mkdir(parents=True)
    os.symlink("/home/kubernetes/bin/nvidia", host / "usr/local/nvidia")   # as GKE shows it to containers
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    os.symlink(host, proc / "1" / "root")
    empty = tmp_path / "driver-root"
    (empty / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    with pytest.raises(DriverRootError) as err:
        DriverRoot(empty, host_root="/", proc_root=proc).files()
    message = str(err.value)
    assert "\n" not in message
    assert f"driver root {empty} (host /) has no libcuda.so.*" in message
    assert "--driver-root" in message and "driverRoot" in message
    assert message.endswith("driver roots with libcuda.so.* on this node: /usr/local/nvidia, /home/kubernetes/bin/nvidia")


@pytest.mark.parametrize("layout", LAYOUTS, ids=[la.name for la in LAYOUTS])
def test_find_driver_roots_finds_each_layout_at_its_host_path(tmp_path: Path, layout: Layout) -> None:
    host = fake_host(tmp_path, layout)
    assert find_driver_roots(host) == [layout.host_root]


def test_no_driver_anywhere_says_so(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (tmp_path / "empty-host").mkdir()
    os.symlink(tmp_path / "empty-host", proc / "1" / "root")
    with pytest.raises(DriverRootError, match=r"none of " + ", ".join(KNOWN_DRIVER_ROOTS) + " on this node"):
        DriverRoot(tmp_path / "nothing", proc_root=proc).files()


def test_an_unreadable_host_view_is_said_not_mistaken_for_no_driver(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    os.symlink(tmp_path / "loop", proc / "1" / "root")
    os.symlink("loop", tmp_path / "loop")   # ELOOP: unreadable like /proc/1/root without ptrace access
    with pytest.raises(DriverRootError, match=r"cannot be looked at through .*/proc/1/root \(") as err:
        DriverRoot(tmp_path / "nothing", proc_root=proc).files()
    assert "none of" not in str(err.value)


def test_libraries_without_a_version_say_what_is_wrong_not_an_internal_parameter(tmp_path: Path) -> None:
    lib = tmp_path / "driver-root/usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libcuda.so.1").write_bytes(b"\x7fELF")          # a soname file with no versioned file behind it
    with pytest.raises(DriverRootError) as err:
        DriverRoot(tmp_path / "driver-root", proc_root=tmp_path / "proc").files()
    message = str(err.value)
    assert "cannot tell the driver version" in message and "libcuda.so.580.95.05" in message
    assert "driver_version" not in message, message
