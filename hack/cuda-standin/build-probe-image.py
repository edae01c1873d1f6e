#!/usr/bin/env python3
"""Builds the cuda-probe test image as an OCI archive: Debian 12's glibc (libc6, its libgcc-s1, and libc-bin
for ldconfig, which the CDI hook's update-ldcache runs in the container), Debian's static busybox with a
link per applet (the pod probe script of testbed/podprobe.py is a shell script) and the dynamically linked
cuda-probe in /usr/local/bin. No driver library is in the image: a container gets them from its CDI spec.

    build-probe-image.py --probe BIN --busybox BIN --name REF --out ARCHIVE [--cache DIR]

The Debian packages come from deploy/image/debian.lock (the driver image's own pins, SHA256-checked);
libc-bin, which the driver image does not ship, at libc6's version from apt. Unpacked with the driver
image's machinery (hack/build-image.py: merged /usr, documentation trimmed) and packed by
hack/build-oci-image.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

HACK = Path(__file__).resolve().parents[1]
PACKAGES_FROM_LOCK = ("libc6", "libgcc-s1")
PROBE_PATH = "usr/local/bin/cuda-probe"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _module(file: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, HACK / file)
    assert spec and spec.loader
    if name in sys.modules:
        return sys.modules[name]
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def packages(image: ModuleType) -> list:
    """The lock's libc6 and libgcc-s1, and libc-bin at libc6's version (same source package)."""
    lock = {d.name: d for d in image.read_debian_lock()}
    missing = [p for p in PACKAGES_FROM_LOCK if p not in lock]
    if missing:
        raise image.BuildError(f"{image.DEBIAN_LOCK} lacks {', '.join(missing)}")
    debs = [lock[p] for p in PACKAGES_FROM_LOCK]
    try:
        debs.append(image._uri("libc-bin", lock["libc6"].version))
    except image.BuildError as err:
        raise image.BuildError(f"libc-bin {lock['libc6'].version} (libc6's version in {image.DEBIAN_LOCK.name}) is "
                               f"not known to apt: {err} (apt-get update?)") from None
    return debs


def build_rootfs(image: ModuleType, root: Path, probe: Path, busybox: Path, cache: Path) -> None:
    for d in image.MERGED:
        (root / "usr" / d).mkdir(parents=True, exist_ok=True)
        (root / d).symlink_to(f"usr/{d}")
    for deb in packages(image):
        image.unpack_deb(image.fetch_deb(deb, cache), root)
    for d in image.MERGED:
        if not any((root / "usr" / d).iterdir()):
            (root / d).unlink()
            (root / "usr" / d).rmdir()
    if not (root / "usr/sbin/ldconfig").is_file():
        raise image.BuildError("libc-bin did not provide /usr/sbin/ldconfig")
    bin_dir = root / "usr/bin"
    shutil.copy2(busybox, bin_dir / "busybox")
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True).stdout.split()
    for applet in applets:
        link = bin_dir / applet
        if applet != "busybox" and not link.exists() and not (root / "usr/sbin" / applet).exists():
            link.symlink_to("busybox")
    dest = root / PROBE_PATH
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(probe, dest)
    dest.chmod(0o755)
    for d in ("tmp", "var/tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d).chmod(0o1777)
    for d in ("proc", "sys", "dev", "run", "root"):
        (root / d).mkdir(exist_ok=True)
    etc = root / "etc"
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    (etc / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    for f in ("passwd", "group"):
        (etc / f).chmod(0o644)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", required=True, type=Path, help="the built cuda-probe")
    ap.add_argument("--busybox", required=True, type=Path, help="a static busybox")
    ap.add_argument("--name", required=True, help="image reference, e.g. registry.local/gpu-dra/cuda-probe:1")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache/gpu-dra/debs",
                    help="where downloaded .deb files are kept")
    args = ap.parse_args(argv)
    for what, path in (("--probe", args.probe), ("--busybox", args.busybox)):
        if not path.is_file():
            print(f"build-probe-image: {what} {path} is not a file", file=sys.stderr)
            return 1
    oci = _module("build-oci-image.py", "build_oci_image")
    image = _module("build-image.py", "build_image")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "rootfs"
        root.mkdir()
        try:
            build_rootfs(image, root, args.probe, args.busybox, args.cache)
        except image.BuildError as err:
            print(f"build-probe-image: {err}", file=sys.stderr)
            return 1
        data = oci.build(root, args.name, [], [f"/{PROBE_PATH}"], [f"PATH={PATH}"])
    tmp_out = args.out.with_name(args.out.name + ".tmp")
    tmp_out.write_bytes(data)
    tmp_out.replace(args.out)
    print(f"{args.out} {args.name} {oci.digest(data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
