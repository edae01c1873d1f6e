#!/usr/bin/env python3
"""One release, from the commit checked out: `make release VERSION=X.Y.Z REGISTRY=host[:port]/path`.

    REGISTRY/gpu-dra-driver:X.Y.Z            the driver image: an index of linux/amd64 and linux/arm64 (crane push)
    oci://REGISTRY/charts/gpu-dra-driver     the chart X.Y.Z, appVersion X.Y.Z, that image pinned by digest (helm push)
    dist/gpu_dra_driver-X.Y.Z-py3-none-any.whl, dist/gpu_dra_driver-X.Y.Z.tar.gz
                                             the Python distribution (`gpu-dra`, `kubectl-gpu`)
    dist/gpu-dra-driver-X.Y.Z.tgz            the packaged chart (what was pushed)
    dist/kubectl-gpu-X.Y.Z.tar.gz, dist/krew-gpu-X.Y.Z.yaml
                                             krew's archive and its manifest, uri DOWNLOAD_URL/kubectl-gpu-X.Y.Z.tar.gz
    dist/release-X.Y.Z.json                  what was published, with digests

Everything is built from `git archive HEAD` with X.Y.Z stamped into its pyproject.toml, so a release is its commit
and nothing else. Refused before anything is pushed: a tree with changes or untracked files, a VERSION that is not
semver, a chart version the registry has, an image tag the registry has under another digest (under the same
digest, the image of a run that stopped before the chart, it is not pushed again).

crane and helm find the registry's credentials in Docker's config (`crane auth login`, `docker login`;
DOCKER_CONFIG moves it) and trust the system's CAs (SSL_CERT_FILE names another bundle). DOWNLOAD_URL (`{version}`
is replaced) is where dist/ gets published; by default the GitHub release of the `origin` remote.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = Path("deploy/helm/gpu-dra-driver")
IMAGE_NAME = "gpu-dra-driver"
CHARTS = "charts"
# Where a released chart records its image's digest (templates/_helpers.tpl reads it).
DIGEST_ANNOTATION = "gpu.dra-driver.io/image-digest"
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?$")
REGISTRY = re.compile(r"^[A-Za-z0-9.-]+(:\d+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$")


class ReleaseError(Exception):
    """A refusal or a failed step, printed as one line."""


def log(msg: str) -> None:
    print(f"[release {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(argv: list[str], what: str, progress: bool = False, **kw: object) -> str:
    """The command's output; a failure as one line with its last words. With `progress` its stderr goes to the
    terminal as it comes (the builds' progress lines) and only stdout is returned."""
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=None if progress else subprocess.PIPE, text=True,
                          **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
        raise ReleaseError(f"{what} failed (exit {proc.returncode}){': ' if tail else ''}{' | '.join(tail)}")
    return str(proc.stdout) + str(proc.stderr or "")


def tool(script: str, *args: str) -> str:
    """A program built (or reused) by a hack/build-*.sh script, which prints its path last."""
    return run(["bash", str(REPO / "hack" / script), *args], f"hack/{script}", progress=True).strip().splitlines()[-1]


# --- refusals ----------------------------------------------------------------------------------------------

def check_version(version: str) -> None:
    if not SEMVER.match(version):
        raise ReleaseError(f"VERSION {version!r} is not a semantic version like 1.2.3 (Helm and krew need one)")


def check_registry(registry: str) -> None:
    if not REGISTRY.match(registry):
        raise ReleaseError(f"REGISTRY {registry!r} is not host[:port][/path] (no scheme, lower-case path)")


def check_clean(repo: Path) -> str:
    """HEAD's commit, when the tree has no changes and no untracked files (they would not be in the release)."""
    status = run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=normal"], "git status")
    if status.strip():
        paths = [line[3:] for line in status.splitlines()[:5]]
        raise ReleaseError(f"the tree is not clean ({', '.join(paths)}...): commit or stash first; a release is a "
                           "commit")
    return run(["git", "-C", str(repo), "rev-parse", "HEAD"], "git rev-parse HEAD").strip()


def download_url(given: str, version: str, repo: Path) -> str:
    """Where dist/ is published: `given`, else the GitHub release of the origin remote."""
    if not given:
        origin = subprocess.run(["git", "-C", str(repo), "remote", "get-url", "origin"], capture_output=True,
                                text=True).stdout.strip()
        m = re.match(r"^(?:https://github\.com/|git@github\.com:)([^/]+/[^/]+?)(?:\.git)?$", origin)
        if not m:
            raise ReleaseError("set DOWNLOAD_URL=https://.../v{version}: where dist/ is published (krew's uri); "
                               "without it, only a GitHub origin remote gives one")
        given = f"https://github.com/{m.group(1)}/releases/download/v{{version}}"
    return given.replace("{version}", version).rstrip("/")


def tags(crane: str, repository: str) -> set[str]:
    """The repository's tags; none when the registry does not know the repository (NAME_UNKNOWN)."""
    proc = subprocess.run([crane, "ls", repository], capture_output=True, text=True)
    if proc.returncode == 0:
        return set(proc.stdout.split())
    if "NAME_UNKNOWN" in proc.stderr:
        return set()
    raise ReleaseError(f"crane ls {repository}: {proc.stderr.strip().splitlines()[-1:]} (credentials: "
                       "`crane auth login`; the registry's CA: SSL_CERT_FILE)")


# --- building ----------------------------------------------------------------------------------------------

def stage(repo: Path, commit: str, dest: Path, version: str) -> Path:
    """The commit's files in dest/src, with `version` in pyproject.toml."""
    src = dest / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit], capture_output=True)
    if archive.returncode != 0 or subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout).returncode:
        raise ReleaseError(f"git archive {commit} did not unpack: {archive.stderr.decode().strip()}")
    pyproject = src / "pyproject.toml"
    text, n = re.subn(r'^version = "[^"]*"$', f'version = "{version}"', pyproject.read_text(), count=1, flags=re.M)
    if n != 1:
        raise ReleaseError("pyproject.toml has no `version = \"...\"` line to stamp")
    pyproject.write_text(text)
    return src


def build_python(src: Path, dist: Path, python: str, cache: Path) -> list[Path]:
    """sdist and wheel by setuptools' PEP 517 hooks, with the setuptools of deploy/image/requirements-build.lock
    (the one the image's wheel is built with): the same files from the same commit."""
    wheels = cache / "image" / "wheels"
    run([python, "-m", "pip", "--disable-pip-version-check", "download", "-q", "--no-deps", "--require-hashes",
         "-r", str(src / "deploy/image/requirements-build.lock"), "-d", str(wheels)], "pip download of setuptools")
    lock = (src / "deploy/image/requirements-build.lock").read_text()
    version = re.search(r"^setuptools==(\S+)", lock, re.M)
    if not version:
        raise ReleaseError("deploy/image/requirements-build.lock pins no setuptools")
    backend = src.parent / "backend"
    with zipfile.ZipFile(next(wheels.glob(f"setuptools-{version.group(1)}-*.whl"))) as zf:
        zf.extractall(backend)
    out = src.parent / "python-dist"
    # The directory is read once: setuptools' hooks rewrite sys.argv for the setup commands they run.
    hooks = ("import sys\nfrom setuptools import build_meta as b\nout = sys.argv[1]\n"
             "print(b.build_sdist(out))\nprint(b.build_wheel(out))\n")
    run([python, "-c", hooks, str(out)], "building the sdist and the wheel", cwd=src,
        env={**os.environ, "PYTHONPATH": str(backend), "SOURCE_DATE_EPOCH": "315532800"})
    built = sorted(out.iterdir())
    if sorted(f.suffix for f in built) != [".gz", ".whl"]:
        raise ReleaseError(f"the Python build made {[f.name for f in built]}, not an sdist and a wheel")
    for f in built:
        shutil.copyfile(f, dist / f.name)
    return [dist / f.name for f in built]


def build_image_index(src: Path, python: str, repository: str, version: str, out: Path) -> str:
    """The two-platform image index of the staged sources as an OCI layout at `out`; its digest."""
    line = run([python, str(src / "hack/build-image.py"), "index", "--repository", repository, "--tag", version,
                "--out", str(out)], "hack/build-image.py index", progress=True).strip().splitlines()[-1]
    name, digest, _ = line.split()
    assert name == f"{repository}:{version}", line
    return digest


def package_chart(helm: str, src: Path, repository: str, digest: str, version: str, dist: Path) -> Path:
    """The chart of the staged sources with the release's image repository and digest, packaged into dist/."""
    chart = src / CHART
    values = chart / "values.yaml"
    default = f"  repository: {pinned(src, 'DRIVER_IMAGE_REPOSITORY')}\n"
    if values.read_text().count(default) != 1:
        raise ReleaseError(f"{CHART}/values.yaml has no single `{default.strip()}` line to point at the release")
    values.write_text(values.read_text().replace(default, f"  repository: {repository}\n"))
    meta = chart / "Chart.yaml"
    if "annotations" in yaml.safe_load(meta.read_text()):
        raise ReleaseError(f"{CHART}/Chart.yaml has annotations: the release cannot add its digest to them")
    meta.write_text(meta.read_text().rstrip("\n") + f"\nannotations:\n  {DIGEST_ANNOTATION}: {digest}\n")
    run([helm, "package", str(chart), "--version", version, "--app-version", version, "-d", str(dist)],
        "helm package")
    package = dist / f"gpu-dra-driver-{version}.tgz"
    rendered = run([helm, "template", "check", str(package), "--kube-version", pinned(src, "K8S_VERSION")],
                   "helm template of the packaged chart")
    images = set(re.findall(r"^\s+image: (\S+)$", rendered, re.M))
    if images != {f"{repository}:{version}@{digest}"}:
        raise ReleaseError(f"the packaged chart renders the images {sorted(images)}, not the release's")
    return package


def build_krew(src: Path, python: str, url: str, version: str, dist: Path) -> tuple[Path, Path]:
    archive, manifest = dist / f"kubectl-gpu-{version}.tar.gz", dist / f"krew-gpu-{version}.yaml"
    run([python, str(src / "hack/krew_manifest.py"), "--uri", f"{url}/{archive.name}", "--archive", str(archive),
         "--manifest", str(manifest)], "hack/krew_manifest.py")
    return archive, manifest


def pinned(src: Path, key: str) -> str:
    for line in (src / "hack/versions.env").read_text().splitlines():
        if line.startswith(f"{key}="):
            return line.split("=", 1)[1].strip()
    raise ReleaseError(f"{key} is not pinned in hack/versions.env")


# --- publishing --------------------------------------------------------------------------------------------

def push_image(crane: str, layout: Path, ref: str, digest: str) -> bool:
    """Pushes the layout's index as `ref`; False when the registry has it already under this digest."""
    repository, tag = ref.rsplit(":", 1)
    if tag in tags(crane, repository):
        have = run([crane, "digest", ref], f"crane digest {ref}").strip()
        if have != digest:
            raise ReleaseError(f"{ref} is already pushed, as {have} (this build: {digest}): a version is pushed once")
        log(f"{ref} is in the registry already with this build's digest: not pushed again")
        return False
    with tempfile.NamedTemporaryFile("r") as refs:
        run([crane, "push", str(layout), ref, "--image-refs", refs.name], f"crane push {ref}")
        pushed = refs.read().strip()
    if pushed.rpartition("@")[2] != digest:   # crane names the repository its way (docker.io: index.docker.io)
        raise ReleaseError(f"crane pushed {pushed}, not {repository}@{digest}")
    return True


def push_chart(helm: str, package: Path, registry: str) -> str:
    out = run([helm, "push", str(package), f"oci://{registry}/{CHARTS}"], "helm push")
    m = re.search(r"^Digest: (sha256:[0-9a-f]{64})$", out, re.M)
    if not m:
        raise ReleaseError(f"helm push printed no digest: {out.strip()}")
    return m.group(1)


@dataclass
class Release:
    version: str
    registry: str
    url: str
    python: str
    dist: Path

    @property
    def image(self) -> str:
        return f"{self.registry}/{IMAGE_NAME}"

    @property
    def chart(self) -> str:
        return f"{self.registry}/{CHARTS}/gpu-dra-driver"


def release(r: Release, repo: Path) -> dict[str, object]:
    commit = check_clean(repo)
    helm, crane = tool("build-helm.sh"), tool("build-oci-tools.sh", "crane")
    if r.version in tags(crane, r.chart):
        raise ReleaseError(f"the chart {r.version} is already in oci://{r.chart}: a version is pushed once")
    cache = Path(os.environ.get("GPU_DRA_CACHE", Path.home() / ".cache/gpu-dra"))
    r.dist.mkdir(parents=True, exist_ok=True)
    (cache / "release").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache / "release") as tmp:  # beside the image cache: layers hard-link
        src = stage(repo, commit, Path(tmp), r.version)
        log(f"building {r.version} from {commit[:12]}")
        python_files = build_python(src, r.dist, r.python, cache)
        digest = build_image_index(src, r.python, r.image, r.version, Path(tmp) / "layout")
        package = package_chart(helm, src, r.image, digest, r.version, r.dist)
        krew = build_krew(src, r.python, r.url, r.version, r.dist)
        log(f"pushing {r.image}:{r.version} ({digest})")
        push_image(crane, Path(tmp) / "layout", f"{r.image}:{r.version}", digest)
    log(f"pushing the chart to oci://{r.chart}")
    chart_digest = push_chart(helm, package, r.registry)
    log(f"released: helm install gpu-dra oci://{r.chart} --version {r.version}")
    summary: dict[str, object] = {
        "version": r.version, "commit": commit,
        "image": {"reference": f"{r.image}:{r.version}@{digest}", "platforms": ["linux/amd64", "linux/arm64"]},
        "chart": {"reference": f"oci://{r.chart}", "version": r.version, "digest": chart_digest},
        "files": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in [*python_files, package, *krew]},
        "krew": {"uri": f"{r.url}/{krew[0].name}"},
    }
    (r.dist / f"release-{r.version}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", required=True, help="X.Y.Z")
    ap.add_argument("--registry", required=True, help="host[:port][/path] of the image and the chart")
    ap.add_argument("--download-url", default="", help="where dist/ is published ({version} replaced)")
    ap.add_argument("--dist", type=Path, default=REPO / "dist")
    ap.add_argument("--python", default=sys.executable, help="the Python whose pip and setuptools build")
    args = ap.parse_args(argv)
    try:
        check_version(args.version)
        check_registry(args.registry)
        r = Release(args.version, args.registry, download_url(args.download_url, args.version, REPO), args.python,
                    args.dist)
        summary = release(r, REPO)
    except ReleaseError as err:
        print(f"release: error: {err}", file=sys.stderr)
        return 1
    print(f"released {args.version}: {json.dumps(summary, indent=1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
