#!/usr/bin/env python3
"""Packs a directory into a one-layer OCI image archive (an OCI image layout in a tar) that
`ctr images import` reads and names after the image reference given here; no registry or daemon needed.

The output is reproducible: entries sorted, owners root, mtimes fixed, gzip without name or time.

    build-oci-image.py --rootfs DIR --name registry.local/gpu-dra/busybox:1 --out busybox.oci.tar \
        [--entrypoint /bin/sh] [--cmd ARG ...] [--env K=V ...]
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import stat
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

EPOCH = 0
CREATED = "1970-01-01T00:00:00Z"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
INDEX = "application/vnd.oci.image.index.v1+json"
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}


def _info(name: str, st: os.stat_result | None, kind: bytes, size: int = 0, link: str = "",
          mode: int = 0o755) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.size = size
    ti.linkname = link
    ti.mode = stat.S_IMODE(st.st_mode) if st is not None else mode
    ti.mtime = EPOCH
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def layer_tar(rootfs: Path) -> bytes:
    """The uncompressed layer: every file, directory and symlink under rootfs, sorted, owned by root."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        paths = sorted(p for p in rootfs.rglob("*"))
        for path in paths:
            rel = path.relative_to(rootfs).as_posix()
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                tar.addfile(_info(rel, st, tarfile.SYMTYPE, link=os.readlink(path)))
            elif stat.S_ISDIR(st.st_mode):
                tar.addfile(_info(rel, st, tarfile.DIRTYPE))
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as fh:
                    tar.addfile(_info(rel, st, tarfile.REGTYPE, size=st.st_size), fh)
            else:
                raise SystemExit(f"build-oci-image: {path}: only files, directories and symlinks are supported")
    return buf.getvalue()


def gzip_bytes(data: bytes) -> bytes:
    out = io.BytesIO()
    # No file name and a fixed time in the gzip header, so equal input gives an equal digest.
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6, mtime=EPOCH, filename="") as gz:
        gz.write(data)
    return out.getvalue()


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _tag(name: str) -> str:
    _, sep, tag = name.rpartition(":")
    return tag if sep and "/" not in tag else "latest"


def image_manifest(config: bytes, layers: list[dict[str, Any]]) -> bytes:
    """The image manifest of a config and its gzip'd layers (each {"digest", "size"})."""
    return canonical({
        "schemaVersion": 2, "mediaType": MANIFEST,
        "config": {"mediaType": CONFIG, "digest": digest(config), "size": len(config)},
        "layers": [{"mediaType": LAYER, "digest": m["digest"], "size": m["size"]} for m in layers],
    })


def layout_tar(index: bytes, small: list[bytes], big: dict[str, Path]) -> bytes:
    """An OCI image layout in a tar (what `ctr images import` reads): index.json, the `small` blobs (manifests,
    configs) and the `big` ones (digest -> file), entries sorted and dated 0."""
    blobs: dict[str, bytes | Path] = {**{digest(b): b for b in small}, **big}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs", "blobs/sha256"):
            tar.addfile(_info(d, None, tarfile.DIRTYPE))
        for name in sorted(blobs):
            body = blobs[name]
            path = f"blobs/sha256/{name.split(':', 1)[1]}"
            if isinstance(body, bytes):
                tar.addfile(_info(path, None, tarfile.REGTYPE, len(body), mode=0o644), io.BytesIO(body))
            else:
                with open(body, "rb") as fh:
                    tar.addfile(_info(path, None, tarfile.REGTYPE, body.stat().st_size, mode=0o644), fh)
        for fname, data in (("index.json", index), ("oci-layout", canonical({"imageLayoutVersion": "1.0.0"}))):
            tar.addfile(_info(fname, None, tarfile.REGTYPE, len(data), mode=0o644), io.BytesIO(data))
    return out.getvalue()


def write_layout(out: Path, index: bytes, small: list[bytes], big: dict[str, Path]) -> None:
    """The same layout as a directory (what `crane push DIR` reads); the big blobs hard-linked when they can be."""
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    for body in small:
        (blobs / digest(body).split(":", 1)[1]).write_bytes(body)
    for name, path in big.items():
        dest = blobs / name.split(":", 1)[1]
        try:
            os.link(path, dest)
        except OSError:
            shutil.copyfile(path, dest)
    (out / "oci-layout").write_bytes(canonical({"imageLayoutVersion": "1.0.0"}))
    (out / "index.json").write_bytes(index)


def build(rootfs: Path, name: str, entrypoint: list[str], cmd: list[str], env: list[str]) -> bytes:
    """The OCI archive as bytes."""
    arch = _ARCH.get(platform.machine(), platform.machine())
    raw = layer_tar(rootfs)
    layer = gzip_bytes(raw)
    config = canonical({
        "created": CREATED, "architecture": arch, "os": "linux",
        "config": {"Env": env, "Entrypoint": entrypoint or None, "Cmd": cmd or None, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [digest(raw)]},
        "history": [{"created": CREATED, "created_by": "hack/build-oci-image.py"}],
    })
    manifest = image_manifest(config, [{"digest": digest(layer), "size": len(layer)}])
    index = canonical({
        "schemaVersion": 2, "mediaType": INDEX,
        "manifests": [{
            "mediaType": MANIFEST, "digest": digest(manifest), "size": len(manifest),
            "platform": {"architecture": arch, "os": "linux"},
            # `ctr images import` names the image after io.containerd.image.name (the full reference);
            # the OCI annotation holds only the tag, as the OCI spec and containerd's own exports have it.
            "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": _tag(name)},
        }],
    })
    with tempfile.TemporaryDirectory() as tmp:
        blob = Path(tmp) / "layer"
        blob.write_bytes(layer)
        return layout_tar(index, [config, manifest], {digest(layer): blob})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rootfs", required=True, type=Path)
    ap.add_argument("--name", required=True, help="full image reference, e.g. registry.local/gpu-dra/pause:1")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--entrypoint", action="append", default=[])
    ap.add_argument("--cmd", action="append", default=[])
    ap.add_argument("--env", action="append", default=[])
    args = ap.parse_args(argv)
    if not args.rootfs.is_dir():
        print(f"build-oci-image: {args.rootfs} is not a directory", file=sys.stderr)
        return 1
    env = args.env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    data = build(args.rootfs, args.name, args.entrypoint, args.cmd, env)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(args.out)
    print(f"{args.out} {args.name} {digest(data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
