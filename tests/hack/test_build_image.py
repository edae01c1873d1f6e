"""The driver image that `make image` builds (hack/build-image.py): a valid OCI archive, reproducible entries, a
non-root default user, and a root file system whose `gpu-dra` runs: --help, every module of the project imported
by the image's own Python, and the webhook serving a review over TLS from inside it."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import ssl
import stat
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tlscerts import make_serving_cert

from testbed.localcluster import free_port

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["api", "cli", "controller", "dra", "kube", "kubeletplugin", "ops"]
UID = 65532
# Compressed size budget: Python, its libraries, the wheels (the CEL runtime of `gpu-dra explain` among them) and the
# static nvidia-cdi-hook are about 60 MiB today.
MAX_ARCHIVE_MIB = 64


def _version() -> str:
    import tomllib

    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


@pytest.fixture(scope="module")
def archive() -> tuple[str, Path]:
    """(image name, archive path): built by hack/build-image.py on first use, reused from its cache after."""
    proc = subprocess.run([sys.executable, str(ROOT / "hack" / "build-image.py"), "build"], capture_output=True,
                          text=True, timeout=1800, env={**os.environ, "IMAGE_TAG": "", "IMAGE_REPOSITORY": ""})
    assert proc.returncode == 0, f"hack/build-image.py build failed:\n{proc.stderr[-3000:]}"
    name, path = proc.stdout.strip().splitlines()[-1].split()
    return name, Path(path)


@pytest.fixture(scope="module")
def blobs(archive: tuple[str, Path]) -> dict[str, Any]:
    """index.json, oci-layout and the blobs by digest, each checked against its name."""
    out: dict[str, Any] = {"blobs": {}}
    with tarfile.open(archive[1]) as tar:
        for m in tar:
            assert m.mtime == 0 and m.uid == 0 and m.gid == 0, f"{m.name}: not reproducible"
            if not m.isfile():
                continue
            data = tar.extractfile(m).read()  # type: ignore[union-attr]
            if m.name.startswith("blobs/sha256/"):
                hexd = m.name.rsplit("/", 1)[1]
                assert hashlib.sha256(data).hexdigest() == hexd, f"{m.name}: content does not match its digest"
                out["blobs"][f"sha256:{hexd}"] = data
            else:
                out[m.name] = json.loads(data)
    return out


def _manifest(blobs: dict[str, Any]) -> dict[str, Any]:
    [entry] = blobs["index.json"]["manifests"]
    return json.loads(blobs["blobs"][entry["digest"]])


def _config(blobs: dict[str, Any]) -> dict[str, Any]:
    return json.loads(blobs["blobs"][_manifest(blobs)["config"]["digest"]])


def test_the_archive_is_an_oci_image_layout_named_for_containerd(archive: tuple[str, Path],
                                                                  blobs: dict[str, Any]) -> None:
    name, path = archive
    assert name == f"registry.local/gpu-dra/driver:{_version()}"
    assert blobs["oci-layout"] == {"imageLayoutVersion": "1.0.0"}
    index = blobs["index.json"]
    assert index["schemaVersion"] == 2 and index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    [entry] = index["manifests"]
    assert entry["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert entry["size"] == len(blobs["blobs"][entry["digest"]])
    # `ctr images import` names the image after the full reference, skopeo and the OCI spec use the tag.
    assert entry["annotations"] == {"io.containerd.image.name": name,
                                    "org.opencontainers.image.ref.name": _version()}
    manifest = _manifest(blobs)
    assert manifest["schemaVersion"] == 2 and manifest["config"]["mediaType"] == \
        "application/vnd.oci.image.config.v1+json"
    config = _config(blobs)
    assert len(manifest["layers"]) == len(config["rootfs"]["diff_ids"]) == 3
    for layer, diff_id in zip(manifest["layers"], config["rootfs"]["diff_ids"]):
        assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
        data = blobs["blobs"][layer["digest"]]
        assert layer["size"] == len(data)
        assert "sha256:" + hashlib.sha256(gzip.decompress(data)).hexdigest() == diff_id
    assert set(blobs["blobs"]) == {entry["digest"], manifest["config"]["digest"],
                                   *(layer["digest"] for layer in manifest["layers"])}
    size = path.stat().st_size / 2**20
    assert size < MAX_ARCHIVE_MIB, f"the image archive is {size:.1f} MiB, over the {MAX_ARCHIVE_MIB} MiB budget"


def test_the_image_runs_gpu_dra_as_a_non_root_user(blobs: dict[str, Any]) -> None:
    config = _config(blobs)
    assert config["os"] == "linux" and config["architecture"] in ("amd64", "arm64")
    assert config["created"] == "1970-01-01T00:00:00Z"
    c = config["config"]
    assert c["User"] == f"{UID}:{UID}"
    assert c["Entrypoint"] == ["/usr/local/bin/gpu-dra"] and c["Cmd"] == ["--help"]
    assert "PATH=/usr/local/bin:/usr/bin:/bin" in c["Env"] and "PYTHONUNBUFFERED=1" in c["Env"]
    assert c["Labels"]["org.opencontainers.image.version"] == _version()


def test_the_dockerfile_gives_the_same_image_settings(blobs: dict[str, Any]) -> None:
    """deploy/Dockerfile copies the same root file system into an empty image; its settings must match."""
    c = _config(blobs)["config"]
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^FROM scratch$", text, re.M) and "hack/build-image.py rootfs --out /rootfs" in text
    assert re.search(rf"^USER {re.escape(c['User'])}$", text, re.M)
    assert re.search(r"^ENTRYPOINT " + re.escape(json.dumps(c["Entrypoint"])) + "$", text, re.M)
    assert re.search(r"^CMD " + re.escape(json.dumps(c["Cmd"])) + "$", text, re.M)
    env_line = re.search(r"^ENV (.+)$", text, re.M)
    assert env_line and env_line.group(1).split() == c["Env"]


@pytest.fixture(scope="module")
def rootfs(blobs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The layers unpacked in order, as a container runtime would (our layers have no whiteouts)."""
    root = tmp_path_factory.mktemp("image") / "rootfs"
    root.mkdir()
    for layer in _manifest(blobs)["layers"]:
        data = blobs["blobs"][layer["digest"]]
        # GNU tar: several times faster than tarfile here, and keeps modes such as /tmp's 1777.
        proc = subprocess.run(["tar", "-xzpf", "-", "-C", str(root)], input=data, capture_output=True, timeout=300)
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert not [n for _, _, names in os.walk(root) for n in names if n.startswith(".wh.")]
    return root


def image_run(rootfs: Path, *argv: str, **kw: Any) -> subprocess.Popen[str] | subprocess.CompletedProcess[str]:
    """Runs a program of the image as its user: chroot as root; otherwise the image's own loader and Python
    (argv[0] must then be its Python or a Python script of it)."""
    if os.geteuid() == 0:
        chroot = shutil.which("chroot")
        assert chroot, "chroot is not installed (coreutils)"
        cmd = [chroot, f"--userspec={UID}:{UID}", str(rootfs), *argv]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               "HOME": "/nonexistent"}
    else:
        libdir = next((rootfs / "usr/lib").glob("*-linux-gnu"))
        loader = next(libdir.glob("ld-linux*.so.*"))
        script = [str(rootfs / argv[0].lstrip("/"))] if argv[0] != "/usr/bin/python3" else []
        cmd = [str(loader), "--library-path", str(libdir), str(rootfs / "usr/bin/python3.11"), *script, *argv[1:]]
        env = {"PYTHONHOME": str(rootfs / "usr"), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    if kw.pop("background", False):
        return subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)
    return subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=120, **kw)


def test_gpu_dra_help_runs_in_the_image(rootfs: Path) -> None:
    proc = image_run(rootfs, "/usr/local/bin/gpu-dra", "--help")
    assert isinstance(proc, subprocess.CompletedProcess)
    assert proc.returncode == 0, proc.stderr
    for command in ("kubelet-plugin", "controller", "webhook", "simulate"):
        assert command in proc.stdout


def test_every_project_module_imports_with_the_images_python(rootfs: Path) -> None:
    """Catches a missing shared library (C extensions of grpcio, pydantic-core, PyYAML, ssl) or a wheel the
    lock lacks, in the image rather than in a cluster."""
    code = ("import importlib, pkgutil, ssl, yaml, grpc, pydantic_core, kubernetes.client\n"
            "assert yaml.__with_libyaml__, 'PyYAML without libyaml'\n"
            f"names = []\nfor top in {PACKAGES!r}:\n"
            "    pkg = importlib.import_module(top)\n"
            "    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, top + '.')]\n"
            "for n in names:\n    importlib.import_module(n)\n"
            "import os\nprint(len(names), os.getuid(), ssl.OPENSSL_VERSION)\n")
    proc = image_run(rootfs, "/usr/bin/python3", "-c", code)
    assert isinstance(proc, subprocess.CompletedProcess)
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, uid, *_ = proc.stdout.split()
    assert int(count) > 50
    if os.geteuid() == 0:
        assert int(uid) == UID


def test_the_root_file_system_is_minimal_and_described(rootfs: Path) -> None:
    passwd = (rootfs / "etc/passwd").read_text()
    assert f"gpu-dra:x:{UID}:{UID}:" in passwd
    assert oct((rootfs / "tmp").stat().st_mode & 0o7777) == "0o1777"
    # No shell and no package manager: only Python and what it links.
    for absent in ("usr/bin/sh", "usr/bin/bash", "usr/bin/dpkg", "usr/bin/apt"):
        assert not (rootfs / absent).exists(), absent
    assert (rootfs / "bin").is_symlink() and os.readlink(rootfs / "bin") == "usr/bin"
    # Scanners find the Debian packages and their versions; they are the lock's.
    arch = (rootfs / "var/lib/dpkg/status.d/libc6").read_text().split("\nArchitecture: ", 1)[1].split()[0]
    lock = {f[0]: f[1] for f in (line.split() for line in (ROOT / "deploy/image/debian.lock").read_text().splitlines()
                                 if line and not line.startswith("#")) if f[2] in (arch, "all")}
    status = {p.name: p.read_text() for p in (rootfs / "var/lib/dpkg/status.d").iterdir()}
    assert set(status) == set(lock)
    for pkg, text in status.items():
        assert f"\nVersion: {lock[pkg]}\n" in text and "Status: install ok installed" in text, pkg
    assert "VERSION_CODENAME=bookworm" in (rootfs / "usr/lib/os-release").read_text()
    # Byte code made at build time, valid whatever the file times (unchecked-hash pycs).
    pyc = next((rootfs / "usr/local/lib/python3.11/dist-packages/controller/__pycache__").glob("webhook.*.pyc"))
    assert int.from_bytes(pyc.read_bytes()[4:8], "little") == 0b01  # flags: hash-based, unchecked
    assert list((rootfs / "usr/lib/python3.11/__pycache__").glob("os.*.pyc"))


@pytest.fixture
def webhook_in_image(rootfs: Path) -> Iterator[tuple[int, Path]]:
    certs = make_serving_cert(rootfs / "tmp" / "tls-test")
    for f in (certs.cert, certs.key):
        f.chmod(0o644)  # readable by the image's user
    port = free_port()
    paths = [str(p) if os.geteuid() != 0 else "/" + str(p.relative_to(rootfs)) for p in (certs.cert, certs.key)]
    proc = image_run(rootfs, "/usr/local/bin/gpu-dra", "webhook", "--address", "127.0.0.1", "--port", str(port),
                     "--tls-cert-file", paths[0], "--tls-private-key-file", paths[1], background=True)
    assert isinstance(proc, subprocess.Popen)
    try:
        yield port, certs.ca
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
        shutil.rmtree(rootfs / "tmp" / "tls-test")
        if proc.returncode not in (0, -15):
            pytest.fail(f"the webhook in the image exited {proc.returncode}: {out[-2000:]}")


def test_the_webhook_serves_reviews_over_tls_from_the_image(webhook_in_image: tuple[int, Path]) -> None:
    port, ca = webhook_in_image
    ctx = ssl.create_default_context(cafile=str(ca))
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u1", "operation": "CREATE", "resource": {"group": "resource.k8s.io", "version": "v1",
                                                         "resource": "resourceclaims"},
        "object": {"spec": {"devices": {"config": [{"opaque": {"driver": "gpu.dra-driver.io", "parameters": {
            "apiVersion": "gpu.dra-driver.io/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 150}}}}}]}}}}}
    deadline = time.monotonic() + 30
    while True:
        try:
            req = urllib.request.Request(f"https://127.0.0.1:{port}/validate", data=json.dumps(review).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                answer = json.loads(resp.read())
            break
        except OSError:
            assert time.monotonic() < deadline, "the webhook in the image never answered"
            time.sleep(0.2)
    assert answer["response"]["allowed"] is False
    assert "spec.devices.config[0].opaque.parameters.sharing.mps.activeThreadPercentage: must be between 1 and " \
        "100, got 150" in answer["response"]["status"]["message"]


# --- the nvidia-cdi-hook in the image -------------------------------------------------------------------------------
# The driver image carries the driver's nvidia-cdi-hook where the chart's init container takes it from, and that
# init container's command installs it with the image's own Python.

HOOK = "usr/local/bin/nvidia-cdi-hook"


def pinned_version() -> str:
    match = re.search(r"^NVIDIA_CTK_VERSION=v(\S+)$", (ROOT / "hack/versions.env").read_text(), re.M)
    assert match, "NVIDIA_CTK_VERSION is not pinned in hack/versions.env"
    return match.group(1)


def test_the_image_has_the_pinned_static_hook(rootfs: Path) -> None:
    hook = rootfs / HOOK
    assert stat.S_IMODE(hook.stat().st_mode) == 0o755
    head = hook.read_bytes()[:4096]
    assert head[:4] == b"\x7fELF" and b"ld-linux" not in head, "the hook must not need the host's loader"
    # Static: it runs here as it does from any host's file system.
    proc = subprocess.run([str(hook), "--version"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == f"NVIDIA CDI Hook version {pinned_version()}", proc
    for sub in ("create-symlinks", "update-ldcache", "disable-device-node-modification"):
        assert subprocess.run([str(hook), sub, "--help"], capture_output=True, timeout=30).returncode == 0, sub


def test_the_init_containers_command_installs_it(rootfs: Path) -> None:
    target = "/tmp/plugins/gpu.dra-driver.io/bin/nvidia-cdi-hook"
    proc = image_run(rootfs, "/usr/bin/python3", "-m", "dra.node.hookinstall", "/" + HOOK, target)
    assert isinstance(proc, subprocess.CompletedProcess)
    assert proc.returncode == 0 and proc.stdout == f"installed: {target}\n", proc.stderr
    installed = rootfs / target.lstrip("/")
    assert installed.read_bytes() == (rootfs / HOOK).read_bytes()
    assert stat.S_IMODE(installed.stat().st_mode) == 0o755
