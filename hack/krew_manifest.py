"""Builds the krew plugin archive of `kubectl gpu` (deploy/krew/kubectl-gpu, the launcher, packed the same way
every time so its sha256 is stable) and writes deploy/krew/gpu.yaml, the krew Plugin manifest pointing at it.

    python hack/krew_manifest.py [--uri URL] [--archive dist/kubectl-gpu.tar.gz] [--manifest deploy/krew/gpu.yaml]

`make release` writes a release's pair into dist/ with the uri it is published at (hack/release.py).

Install from a checkout: `kubectl krew install --manifest=deploy/krew/gpu.yaml --archive=dist/kubectl-gpu.tar.gz`
(krew checks the archive against the manifest's sha256 and does not fetch the uri then)."""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "deploy" / "krew" / "kubectl-gpu"
MANIFEST = REPO / "deploy" / "krew" / "gpu.yaml"
# Where a release puts the archive; --uri replaces it.
DEFAULT_URI = "kubectl-gpu.tar.gz"
PLATFORMS = [("linux", "amd64"), ("linux", "arm64"), ("darwin", "amd64"), ("darwin", "arm64")]


def archive_bytes() -> bytes:
    """The launcher in a tar.gz with fixed owner, mode and times: the same bytes from the same launcher."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        data = LAUNCHER.read_bytes()
        info = tarfile.TarInfo("kubectl-gpu")
        info.size, info.mode, info.mtime, info.uid, info.gid, info.uname, info.gname = len(data), 0o755, 0, 0, 0, "", ""
        tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, filename="") as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def manifest(sha256: str, uri: str = DEFAULT_URI) -> dict[str, Any]:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return {
        "apiVersion": "krew.googlecontainertools.github.com/v1alpha2",
        "kind": "Plugin",
        "metadata": {"name": "gpu"},
        "spec": {
            "version": f"v{version}",
            "shortDescription": "Show who holds which GPU and why a GPU claim is pending",
            "description": "kubectl gpu [NODE] shows, per node and GPU of the gpu-dra-driver DRA driver, who holds "
                           "which device, what is free and each MIG GPU's memory slices.\n"
                           "kubectl gpu explain CLAIM|TEMPLATE|POD says why a claim is (not) allocatable, node by "
                           "node, as kube-scheduler decides it.\n",
            "caveats": "The plugin runs the gpu-dra-driver Python package: install it with\n"
                       "  pip install gpu-dra-driver\n"
                       "It only reads: status lists resourceslices, resourceclaims and pods; explain also "
                       "deviceclasses, devicetaintrules and nodes.\n",
            "platforms": [{"selector": {"matchLabels": {"os": os_name, "arch": arch}}, "uri": uri, "sha256": sha256,
                           "bin": "kubectl-gpu", "files": [{"from": "kubectl-gpu", "to": "."}]}
                          for os_name, arch in PLATFORMS],
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--uri", default=DEFAULT_URI, help="where the archive is published")
    parser.add_argument("--archive", default=str(REPO / "dist" / "kubectl-gpu.tar.gz"), help="archive to write")
    parser.add_argument("--manifest", default=str(MANIFEST), help="manifest to write")
    args = parser.parse_args(argv)
    data = archive_bytes()
    Path(args.archive).parent.mkdir(parents=True, exist_ok=True)
    Path(args.archive).write_bytes(data)
    doc = manifest(hashlib.sha256(data).hexdigest(), args.uri)
    Path(args.manifest).write_text("# Written by hack/krew_manifest.py: edit that, not this.\n"
                                   + yaml.safe_dump(doc, sort_keys=False, width=1000))
    print(f"{args.archive}\n{args.manifest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
