"""The image index `make release` pushes (hack/build-image.py index): linux/amd64 and linux/arm64 in one OCI image
index, and each platform's image made of that architecture's programs, not labelled so: every ELF file of the arm64
image (Python and its libraries, the wheels' extensions of grpcio, protobuf, pydantic-core, PyYAML, the CEL runtime,
the static nvidia-cdi-hook) is an aarch64 one, every one of the amd64 image an x86-64 one."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
# ELF e_machine of each platform, and the multiarch triplet of its libraries.
MACHINES = {"amd64": (62, "x86_64-linux-gnu"), "arm64": (183, "aarch64-linux-gnu")}
REPOSITORY = "registry.example.com/gpu-dra/gpu-dra-driver"


def _version() -> str:
    import tomllib

    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The layout directory, built on first use (the layers come from the image cache when they are there)."""
    out = tmp_path_factory.mktemp("index") / "layout"
    proc = subprocess.run([sys.executable, str(ROOT / "hack" / "build-image.py"), "index", "--repository", REPOSITORY,
                           "--tag", "9.9.9", "--out", str(out)], capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"hack/build-image.py index failed:\n{proc.stderr[-3000:]}"
    name, digest, where = proc.stdout.strip().splitlines()[-1].split()
    assert (name, Path(where)) == (f"{REPOSITORY}:9.9.9", out)
    assert json.loads((out / "index.json").read_text())["manifests"][0]["digest"] == digest
    return out


def blob(layout: Path, digest: str) -> bytes:
    data = (layout / "blobs" / "sha256" / digest.split(":", 1)[1]).read_bytes()
    assert "sha256:" + hashlib.sha256(data).hexdigest() == digest, f"{digest}: content does not match its digest"
    return data


def images(layout: Path) -> dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """architecture -> (its entry in the index, its manifest, its config)."""
    [top] = json.loads((layout / "index.json").read_text())["manifests"]
    index = json.loads(blob(layout, top["digest"]))
    out = {}
    for entry in index["manifests"]:
        manifest = json.loads(blob(layout, entry["digest"]))
        out[entry["platform"]["architecture"]] = (entry, manifest,
                                                  json.loads(blob(layout, manifest["config"]["digest"])))
    return out


def elf_files(layout: Path, manifest: dict[str, Any]) -> dict[str, int]:
    """Path in the image -> ELF machine, for every ELF file of the image's layers."""
    found = {}
    for layer in manifest["layers"]:
        with open(layout / "blobs/sha256" / layer["digest"][7:], "rb") as fh, tarfile.open(fileobj=fh, mode="r|gz") as tar:
            for member in tar:
                if not member.isfile() or member.size < 20:
                    continue
                head = tar.extractfile(member).read(20)  # type: ignore[union-attr]
                if head[:4] == b"\x7fELF":
                    # 64-bit little-endian objects; e_machine at offset 18.
                    assert head[4:6] == b"\x02\x01", f"{member.name}: not a 64-bit little-endian ELF file"
                    found[member.name] = int.from_bytes(head[18:20], "little")
    return found


def test_the_layout_holds_one_index_of_both_platforms(layout: Path) -> None:
    [top] = json.loads((layout / "index.json").read_text())["manifests"]
    assert top["mediaType"] == INDEX
    assert top["annotations"] == {"io.containerd.image.name": f"{REPOSITORY}:9.9.9",
                                  "org.opencontainers.image.ref.name": "9.9.9"}
    found = images(layout)
    assert set(found) == {"amd64", "arm64"}
    assert found["amd64"][0]["platform"] == {"architecture": "amd64", "os": "linux"}
    assert found["arm64"][0]["platform"] == {"architecture": "arm64", "os": "linux", "variant": "v8"}
    for arch, (entry, manifest, config) in found.items():
        assert entry["mediaType"] == manifest["mediaType"] == MANIFEST
        assert (config["architecture"], config["os"]) == (arch, "linux")
        assert config["config"]["Labels"]["org.opencontainers.image.version"] == _version()
        assert len(manifest["layers"]) == len(config["rootfs"]["diff_ids"]) == 3
    # The app layer is pure Python, compiled by one Python: the same blob in both images.
    assert found["amd64"][1]["layers"][2] == found["arm64"][1]["layers"][2]
    assert found["amd64"][1]["layers"][0] != found["arm64"][1]["layers"][0]


@pytest.mark.parametrize("arch", ["amd64", "arm64"])
def test_every_program_and_library_of_a_platform_is_built_for_it(layout: Path, arch: str) -> None:
    machine, triplet = MACHINES[arch]
    elves = elf_files(layout, images(layout)[arch][1])
    wrong = {path: m for path, m in elves.items() if m != machine}
    assert not wrong, f"{arch} image has ELF files of another machine: {dict(list(wrong.items())[:10])}"
    site = "usr/local/lib/python3.11/dist-packages"
    expected = [
        "usr/bin/python3.11", f"usr/lib/{triplet}/libc.so.6", f"usr/lib/{triplet}/libstdc++.so.6.0.30",
        "usr/local/bin/nvidia-cdi-hook",
        f"{site}/grpc/_cython/cygrpc.cpython-311-{triplet}.so",
        f"{site}/google/_upb/_message.abi3.so",
        f"{site}/pydantic_core/_pydantic_core.cpython-311-{triplet}.so",
        f"{site}/yaml/_yaml.cpython-311-{triplet}.so",
    ]
    missing = [p for p in expected if p not in elves]
    assert not missing, f"not in the {arch} image (or not ELF): {missing}; ELF files: {sorted(elves)[:40]}"
    cel = [p for p in elves if p.startswith(f"{site}/cel_expr_python/")]
    assert cel, f"no compiled CEL runtime in the {arch} image"


def _binfmt_runs_aarch64() -> str | None:
    """Why this machine cannot run arm64 programs (no binfmt_misc handler for aarch64 ELF), or None."""
    binfmt = Path("/proc/sys/fs/binfmt_misc")
    if not (binfmt / "status").exists():
        return "binfmt_misc is not mounted"
    for entry in binfmt.iterdir():
        try:
            text = entry.read_text()
        except OSError:
            continue
        # The aarch64 ELF magic's e_machine bytes, as qemu-user's registration writes them.
        if text.startswith("enabled") and "7f454c460201010000000000000000000200b700" in text.replace(" ", ""):
            return None
    return "no enabled binfmt_misc handler for aarch64 ELF programs (qemu-user)"


def test_the_arm64_image_runs_gpu_dra_under_qemu(layout: Path, tmp_path: Path) -> None:
    """Only where binfmt_misc hands aarch64 programs to qemu-user: otherwise the ELF headers above are the proof."""
    why = _binfmt_runs_aarch64()
    if why:
        pytest.skip(why)
    if os.geteuid() != 0 or shutil.which("chroot") is None:
        pytest.skip("running the arm64 image's Python needs chroot as root")
    root = tmp_path / "rootfs"
    root.mkdir()
    for layer in images(layout)["arm64"][1]["layers"]:
        subprocess.run(["tar", "-xzpf", str(layout / "blobs/sha256" / layer["digest"][7:]), "-C", str(root)],
                       check=True)
    proc = subprocess.run(["chroot", str(root), "/usr/local/bin/gpu-dra", "--version"], capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"})
    assert proc.returncode == 0 and proc.stdout.strip() == f"gpu-dra {_version()}", proc.stderr
