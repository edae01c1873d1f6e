"""The built nvidia-cdi-hook, run as runc runs createContainer hooks (the container's root file system a mount, the
spec's library mounts bound into it, the OCI state on stdin, a private mount namespace), for a spec the driver
writes in each driver layout: a Debian/Ubuntu image's loader cache then resolves ``libcuda.so.1`` to the
mounted library, which without the hook it does not for the RHEL-style and single-folder layouts. Needs root
(mounts) like the other real-node tests; nothing skips."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dra.node.cdi import ClaimDevice, build_claim_spec
from dra.node.driverroot import DriverRoot
from testbed.nodeplugin import find_cdi_hook

pytestmark = pytest.mark.e2e

VERSION = "580.95.05"
GPU0 = ClaimDevice(name="gpu-0", uuid="GPU-aaaa", gpu_minor=0, gpu_index=0, requests=("gpu",))
# (layout, library folder and tools folder inside the driver root)
LAYOUTS = [("host-debian", "usr/lib/x86_64-linux-gnu", "usr/bin"), ("host-rhel", "usr/lib64", "usr/bin"),
           ("single-folder", "lib64", "bin")]


def shared_object(path: Path, soname: str) -> None:
    """A real (empty) ELF shared library with the driver library's soname: ldconfig caches only real ones."""
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-shared", "-nostdlib", f"-Wl,-soname,{soname}", "-o", str(path), "-x", "c", "/dev/null"],
                   check=True, capture_output=True)


def driver_tree(root: Path, lib_dir: str, bin_dir: str) -> None:
    for name, soname in (("libcuda.so", "libcuda.so.1"), ("libnvidia-ml.so", "libnvidia-ml.so.1")):
        shared_object(root / lib_dir / f"{name}.{VERSION}", soname)
        os.symlink(f"{name}.{VERSION}", root / lib_dir / soname)
    (root / bin_dir).mkdir(parents=True, exist_ok=True)
    (root / bin_dir / "nvidia-smi").write_text("#!/bin/sh\n")
    (root / "dev").mkdir()
    (root / "dev" / "nvidiactl").write_text("")
    (root / "dev" / "nvidia0").write_text("")


def debian_rootfs(root: Path, with_etc: bool = True) -> None:
    """What a Debian/Ubuntu image's loader needs to decide: its ld.so.conf and the multiarch folders."""
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "tmp").mkdir()
    if with_etc:
        (root / "etc/ld.so.conf.d").mkdir(parents=True)
        (root / "etc/debian_version").write_text("12.0\n")
        (root / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
        (root / "etc/ld.so.conf.d/x86_64-linux-gnu.conf").write_text("/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n")


def run_like_runc(bundle: Path, spec: dict, hooks: bool = True) -> subprocess.CompletedProcess[str]:
    """Bind the spec's mounts into the bundle's rootfs and run its createContainer hooks, in a private mount
    namespace that ends with the script (nothing stays mounted)."""
    rootfs = bundle / "rootfs"
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.2.0", "root": {"path": "rootfs"}}))
    state = json.dumps({"ociVersion": "1.2.0", "id": "hook-test", "status": "creating", "pid": os.getpid(),
                        "bundle": str(bundle)})
    (bundle / "state.json").write_text(state)
    lines = ["set -e", f"mount --bind {rootfs} {rootfs}"]
    for m in spec["containerEdits"]["mounts"]:
        target = rootfs / m["containerPath"].lstrip("/")
        lines += [f"mkdir -p {target.parent}", f"touch {target}", f"mount --bind {m['hostPath']} {target}"]
    if hooks:
        for h in spec["containerEdits"]["hooks"]:
            assert h["hookName"] == "createContainer"
            lines.append(f"{h['path']} {' '.join(h['args'][1:])} < {bundle / 'state.json'}")
    lines.append(f"ldconfig -p -C {rootfs}/etc/ld.so.cache || true")
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", "\n".join(lines)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("layout, lib_dir, bin_dir", LAYOUTS, ids=[la[0] for la in LAYOUTS])
def test_a_debian_image_finds_libcuda_in_every_layout(tmp_path: Path, layout: str, lib_dir: str, bin_dir: str) -> None:
    driver = tmp_path / "driver"
    driver_tree(driver, lib_dir, bin_dir)
    hook = find_cdi_hook()
    root = DriverRoot(driver, dev_root=driver, proc_root=tmp_path, hook_path=str(hook))
    spec, _ = build_claim_spec("0b5c3f2a-9d1e-4f7a-8c6b-2e4d1a7f9c30", [GPU0], root)
    bundle = tmp_path / "bundle"
    debian_rootfs(bundle / "rootfs")
    proc = run_like_runc(bundle, spec)
    assert proc.returncode == 0, proc.stderr
    folder = "/" + lib_dir
    # libcuda.so.1 is in the container's loader cache, at the library folder the spec mounts it in.
    assert f"libcuda.so.1 (libc6,x86-64) => {folder}/libcuda.so.1" in proc.stdout, proc.stdout
    assert f"libnvidia-ml.so.1 (libc6,x86-64) => {folder}/libnvidia-ml.so.1" in proc.stdout, proc.stdout
    assert os.readlink(bundle / "rootfs" / lib_dir / "libcuda.so.1") == f"libcuda.so.{VERSION}"
    added = [p.read_text() for p in (bundle / "rootfs/etc/ld.so.conf.d").glob("00-nvcr-*.conf")]
    # Debian images search /usr/lib/x86_64-linux-gnu already; the other folders are added for them.
    assert added == ([] if lib_dir == "usr/lib/x86_64-linux-gnu" else [f"{folder}\n"])


def test_without_the_hook_a_debian_image_does_not_find_a_single_folder_libcuda(tmp_path: Path) -> None:
    """What the H200 node showed: the libraries mounted at /lib64 are invisible to a Debian/Ubuntu loader."""
    driver = tmp_path / "driver"
    driver_tree(driver, "lib64", "bin")
    spec, _ = build_claim_spec("0b5c3f2a-9d1e-4f7a-8c6b-2e4d1a7f9c30", [GPU0],
                               DriverRoot(driver, dev_root=driver, proc_root=tmp_path, hook_path=str(find_cdi_hook())))
    bundle = tmp_path / "bundle"
    debian_rootfs(bundle / "rootfs")
    subprocess.run(["ldconfig", "-r", str(bundle / "rootfs")], check=True, capture_output=True)   # the image's cache
    proc = run_like_runc(bundle, spec, hooks=False)
    assert proc.returncode == 0, proc.stderr
    assert "libcuda.so.1" not in proc.stdout


def test_an_image_without_etc_fails_update_ldcache(tmp_path: Path) -> None:
    """The hook writes the container's /etc/ld.so.conf: an image without /etc cannot start with libraries to add."""
    driver = tmp_path / "driver"
    driver_tree(driver, "lib64", "bin")
    spec, _ = build_claim_spec("0b5c3f2a-9d1e-4f7a-8c6b-2e4d1a7f9c30", [GPU0],
                               DriverRoot(driver, dev_root=driver, proc_root=tmp_path, hook_path=str(find_cdi_hook())))
    bundle = tmp_path / "bundle"
    debian_rootfs(bundle / "rootfs", with_etc=False)
    proc = run_like_runc(bundle, spec)
    assert proc.returncode != 0 and "ld.so.conf" in proc.stderr, proc.stderr
