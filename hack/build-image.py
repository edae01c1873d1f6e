#!/usr/bin/env python3
"""Builds the driver image (`gpu-dra` with every sub-command) as an OCI archive, without a container engine,
a registry or root: Debian 12 packages unpacked into a root file system, the pinned PyPI wheels and the
project's own wheel installed next to them, packed by this script.

    build-image.py build [--repository R] [--tag T]   the archive (this machine's architecture); prints its path
    build-image.py index [--repository R] [--tag T] [--out DIR]
                                                       the image index of linux/amd64 and linux/arm64 as an OCI
                                                       layout directory (what `make release` pushes); prints the
                                                       name, the index's digest and the directory
    build-image.py rootfs --out DIR                    the same file system as a directory (deploy/Dockerfile)
    build-image.py lock                                re-resolves deploy/image/*.lock for both architectures
                                                       (needs apt, a Debian 12 host)

Three layers, each cached by a hash of its inputs under ~/.cache/gpu-dra/image (GPU_DRA_CACHE moves it):
  base  Debian packages of deploy/image/debian.lock: python3.11 and the libraries it and the wheels link
        (no shell, no package manager), /etc/passwd with the non-root user 65532, a dpkg status.d for scanners;
  deps  the wheels of deploy/image/requirements.lock, hash-checked, in /usr/local/lib/python3.11/dist-packages,
        and /usr/local/bin/nvidia-cdi-hook (hack/build-cdi-tools.sh, NVIDIA_CTK_VERSION; static), which the chart
        installs on each node for the CDI specs;
  app   the project's wheel (built with the setuptools of deploy/image/requirements-build.lock) and
        /usr/local/bin/gpu-dra.
Python files are byte-compiled with unchecked-hash pycs (they do not depend on file times, which the layers fix
at 0) by the image's own Python of the build machine's architecture: byte code is the same on every architecture
of one Python version, so the other architecture's layers are compiled by it too (the locks pin the same Python
for both), and the app layer, pure Python, is one layer shared by both images. Nothing of the other architecture
runs here: its packages are unpacked and its wheels installed with pip's --platform.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import lzma
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
HACK = REPO / "hack"
LOCK_DIR = REPO / "deploy" / "image"
DEBIAN_LOCK = LOCK_DIR / "debian.lock"
PYPI_LOCK = LOCK_DIR / "requirements.lock"
BUILD_LOCK = LOCK_DIR / "requirements-build.lock"
VERSIONS_FILE = HACK / "versions.env"

# Debian 12's Python; the wheels are chosen for it.
PYTHON = "3.11"
# What the image needs besides what these depend on: base-files for /etc/os-release (scanners identify the
# distribution by it), netbase for /etc/services and /etc/protocols, libstdc++6 for the grpcio and protobuf
# wheels' C++ extensions.
ROOT_PACKAGES = ["base-files", "netbase", f"python{PYTHON}-minimal", f"libpython{PYTHON}-stdlib", "libstdc++6"]
# Dependencies left unsatisfied on purpose: they serve a package manager or interactive configuration, which a
# container without dpkg never runs (readline-common's `dpkg | install-info` is for info pages; base-files
# pre-depends on awk for its maintainer scripts).
EXCLUDED = {"dpkg", "install-info", "debconf", "debconf-2.0", "awk", "mawk"}
# Paths not shipped (Debian's own recommendation for minimal systems, dpkg path-exclude): documentation except
# the copyright files, manuals, translations; glibc's iconv modules (Python's codecs do not use iconv).
TRIMMED = re.compile(r"^usr/share/(man|info|locale|lintian|linda|bug|doc-base|gdb|gcc)(/|$)"
                     r"|^usr/share/doc/[^/]+/(?!copyright$)"
                     r"|^usr/lib/[^/]+-linux-gnu[^/]*/gconv(/|$)")
# Not shipped from the wheels: the Kubernetes client's asyncio variant (kubernetes/aio, a third of the image),
# which the driver never imports; the image test imports every module of the project in the image.
TRIMMED_SITE = ["kubernetes/aio"]
UID = GID = 65532
USER = "gpu-dra"
SITE = f"usr/local/lib/python{PYTHON}/dist-packages"
ENTRYPOINT = "/usr/local/bin/gpu-dra"
# The driver's own CDI hook, copied onto each node by the chart's init container (deploy/helm: kubelet-plugin.yaml).
CDI_HOOK = "/usr/local/bin/nvidia-cdi-hook"
# The project's packages and data, as pyproject.toml's [tool.setuptools] selects them.
SOURCE_PACKAGES = ["api", "cli", "controller", "dra", "kube", "kubeletplugin", "ops"]
SOURCE_SUFFIXES = {".py", ".yaml", ".proto"}
# Debian's aliased directories: bookworm systems have merged /usr, packages still ship some files in /lib etc.
MERGED = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


@dataclass(frozen=True)
class Platform:
    """An architecture of the image, in each naming it needs."""
    deb: str       # Debian architecture (the lock, apt)
    triplet: str   # multiarch triplet: usr/lib/<triplet>
    machine: str   # uname -m, in manylinux wheel tags
    variant: str   # OCI platform variant

    @property
    def oci(self) -> dict[str, str]:
        return {"architecture": self.deb, "os": "linux", **({"variant": self.variant} if self.variant else {})}


PLATFORMS = {"amd64": Platform("amd64", "x86_64-linux-gnu", "x86_64", ""),
             # v8: the variant registries and containerd give arm64 images.
             "arm64": Platform("arm64", "aarch64-linux-gnu", "aarch64", "v8")}


class BuildError(Exception):
    """A failure the user can act on; printed as one line."""


def log(msg: str) -> None:
    print(f"[build-image {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _oci() -> ModuleType:
    """The OCI packing helpers of hack/build-oci-image.py (reproducible tar entries, gzip, digests)."""
    spec = importlib.util.spec_from_file_location("build_oci_image", HACK / "build-oci-image.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pinned(key: str) -> str:
    for line in VERSIONS_FILE.read_text().splitlines():
        if line.startswith(f"{key}="):
            return line.split("=", 1)[1].strip()
    raise BuildError(f"{key} is not pinned in {VERSIONS_FILE}")


def native() -> Platform:
    """This machine's architecture: the image's Python runs here only for it."""
    for plat in PLATFORMS.values():
        if plat.machine == platform.machine():
            return plat
    raise BuildError(f"unsupported build machine architecture {platform.machine()}")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def key_of(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()[:16]


def run(argv: list[str], what: str, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise BuildError(f"{what} failed (exit {proc.returncode}): {' | '.join(tail)}")
    return proc


# --- Debian packages ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Deb:
    name: str
    version: str
    arch: str
    url: str
    size: int
    sha256: str

    def line(self) -> str:
        return f"{self.name} {self.version} {self.arch} {self.url} {self.size} sha256:{self.sha256}"

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.version.replace(':', '%3a')}_{self.arch}.deb"


def read_debian_lock(deb_arch: str | None = None) -> list[Deb]:
    """The lock's packages of one image architecture (default: this machine's): its own and the `all` ones."""
    deb_arch = deb_arch or native().deb
    debs = []
    for n, line in enumerate(DEBIAN_LOCK.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        try:
            name, version, pkg_arch, url, size, digest = line.split()
        except ValueError:
            raise BuildError(f"{DEBIAN_LOCK}:{n}: expected 'name version arch url size sha256:hex'") from None
        if pkg_arch in (deb_arch, "all"):
            debs.append(Deb(name, version, pkg_arch, url, int(size), digest.removeprefix("sha256:")))
    if not any(d.arch == deb_arch for d in debs):
        raise BuildError(f"{DEBIAN_LOCK} lists no {deb_arch} packages; run `make image-lock`")
    return debs


def python_version(debs: list[Deb]) -> str:
    """The Debian version of the image's Python: the one that byte-compiles every architecture's layers."""
    found = [d.version for d in debs if d.name == f"python{PYTHON}-minimal"]
    if not found:
        raise BuildError(f"{DEBIAN_LOCK.name} has no python{PYTHON}-minimal")
    return found[0]


def _apt_record(name: str, version: str | None = None, apt: Sequence[str] = ()) -> dict[str, str]:
    spec = f"{name}={version}" if version else name
    out = run(["apt-cache", *apt, "show", "--no-all-versions", spec], f"apt-cache show {spec}").stdout
    record: dict[str, str] = {}
    field = ""
    for line in out.split("\n\n", 1)[0].splitlines():
        if line.startswith(" ") and field:
            record[field] += "\n" + line
        elif ":" in line:
            field, _, value = line.partition(":")
            record[field] = value.strip()
    return record


def _candidate(name: str, apt: Sequence[str] = ()) -> str | None:
    out = subprocess.run(["apt-cache", *apt, "policy", name], capture_output=True, text=True).stdout
    m = re.search(r"^\s*Candidate:\s*(\S+)", out, re.M)
    return m.group(1) if m and m.group(1) != "(none)" else None


def _uri(name: str, version: str, apt: Sequence[str] = ()) -> Deb:
    """The package `name` (arch-qualified or not) at `version`, with its URL, size and SHA256 from apt."""
    out = run(["apt-get", *apt, "download", "--print-uris", f"{name}={version}"],
              f"apt-get download --print-uris {name}").stdout
    m = re.search(r"^'(\S+)' \S+ (\d+) SHA256:([0-9a-f]{64})", out, re.M)
    if not m:
        raise BuildError(f"apt-get download --print-uris {name}={version} printed no URL with a SHA256")
    deb_arch = _apt_record(name, version, apt)["Architecture"]
    return Deb(name.split(":")[0], version, deb_arch, m.group(1), int(m.group(2)), m.group(3))


@contextmanager
def private_apt() -> Iterator[list[str]]:
    """apt options for a state of its own, updated now from the host's sources for every image architecture: one
    snapshot of the mirror for all of them (the same Python in each), and the host's apt lists left alone."""
    if shutil.which("apt-get") is None:
        raise BuildError("`lock` resolves Debian packages with apt: run it on a Debian 12 host")
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        for d in ("lists/partial", "cache/archives/partial"):
            (state / d).mkdir(parents=True)
        (state / "status").touch()  # nothing installed: the candidates are the mirror's newest
        os.chmod(tmp, 0o755)        # as root, apt downloads as the _apt user unless told otherwise
        apt = ["-o", f"Dir::State::Lists={state / 'lists'}", "-o", f"Dir::State::status={state / 'status'}",
               "-o", f"Dir::Cache={state / 'cache'}", "-o", "APT::Sandbox::User=root",
               "-o", "Acquire::Languages=none", "-o", f"APT::Architecture={native().deb}",
               *(a for plat in PLATFORMS.values() for a in ("-o", f"APT::Architectures::={plat.deb}"))]
        log("apt-get update into a private state for " + ", ".join(PLATFORMS))
        run(["apt-get", *apt, "-q", "update"], "apt-get update (private state)")
        yield apt


def resolve_debian(roots: Iterable[str], deb_arch: str, apt: Sequence[str]) -> list[Deb]:
    """The candidate versions for `deb_arch` of `roots` and everything they depend on (Depends, Pre-Depends); a
    dependency group naming an EXCLUDED package is left out, as are virtual packages' providers."""
    candidates: dict[str, str | None] = {}

    def candidate(spec: str) -> str | None:
        if spec not in candidates:
            candidates[spec] = _candidate(spec, apt)
        return candidates[spec]

    def qualified(name: str) -> str | None:
        """name:<arch>, or name:all for an architecture-independent package; None: no such real package."""
        return next((q for q in (f"{name}:{deb_arch}", f"{name}:all") if candidate(q) is not None), None)

    chosen: dict[str, tuple[str, str]] = {}
    todo = list(roots)
    while todo:
        name = todo.pop(0)
        if name in chosen or name in EXCLUDED:
            continue
        spec = qualified(name)
        version = candidate(spec) if spec else None
        if spec is None or version is None:
            raise BuildError(f"Debian package {name} has no {deb_arch} candidate version (a virtual package needs a "
                             "real one named in ROOT_PACKAGES or EXCLUDED)")
        chosen[name] = (spec, version)
        record = _apt_record(spec, version, apt)
        for field in ("Pre-Depends", "Depends"):
            for group in filter(None, (g.strip() for g in record.get(field, "").split(","))):
                names = [re.split(r"[\s(:]", alt.strip(), maxsplit=1)[0] for alt in group.split("|")]
                if any(n in EXCLUDED for n in names):
                    continue
                real = [n for n in names if n in chosen or qualified(n) is not None]
                if not real:
                    raise BuildError(f"{name} depends on {group!r}, which no real {deb_arch} package satisfies")
                todo.append(real[0])
    return [_uri(*chosen[name], apt) for name in sorted(chosen)]


def merged_debian_lock(per_arch: dict[str, list[Deb]]) -> list[Deb]:
    """One lock for every architecture: each one's own packages, and the `all` ones once, which must be the same
    for all (the lock cannot say that an `all` package belongs to one architecture only)."""
    shared = {arch: {d for d in debs if d.arch == "all"} for arch, debs in per_arch.items()}
    first = next(iter(shared.values()))
    for arch, debs in shared.items():
        if debs != first:
            raise BuildError(f"the architectures need different `all` packages ({arch}: "
                             f"{sorted(d.name for d in debs ^ first)}): the lock's format cannot hold that")
    return sorted({d for debs in per_arch.values() for d in debs}, key=lambda d: (d.name, d.arch))


def fetch_deb(deb: Deb, cache: Path) -> Path:
    """The package file, from the cache or downloaded and checked against the lock's SHA256. A version the
    mirror no longer has (Debian drops superseded security updates) falls back to apt's current candidate."""
    path = cache / deb.filename
    if path.exists() and sha256_file(path) == deb.sha256:
        return path
    mirror = os.environ.get("GPU_DRA_DEBIAN_MIRROR")
    url = deb.url.replace("http://deb.debian.org", mirror.rstrip("/")) if mirror else deb.url
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    try:
        with urllib.request.urlopen(url, timeout=60) as resp, open(tmp, "wb") as out:
            shutil.copyfileobj(resp, out)
    except (urllib.error.URLError, OSError) as err:
        tmp.unlink(missing_ok=True)
        return _fallback_deb(deb, cache, f"{url}: {err}")
    if sha256_file(tmp) != deb.sha256:
        tmp.unlink()
        raise BuildError(f"{url}: SHA256 differs from {DEBIAN_LOCK.name} (mirror changed the file?)")
    tmp.replace(path)
    return path


def _fallback_deb(deb: Deb, cache: Path, why: str) -> Path:
    if shutil.which("apt-get") is None:
        raise BuildError(f"{why}; the pinned {deb.name} {deb.version} is gone and there is no apt-get to fetch the "
                         "current one: regenerate the lock on a Debian 12 host (make image-lock)")
    log(f"WARNING: {deb.name} {deb.version} is not on the mirror any more ({why}); using apt's current candidate. "
        "Run `make image-lock` to pin it")
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)  # apt downloads as the _apt user
        run(["apt-get", "-q", "-o", "APT::Sandbox::User=root", "download", deb.name], f"apt-get download {deb.name}",
            cwd=tmp)
        got = next(Path(tmp).glob("*.deb"))
        dest = cache / f"fallback-{got.name}"
        shutil.move(str(got), dest)
    return dest


def _ar_members(path: Path) -> Iterator[tuple[str, bytes]]:
    """Members of a .deb (an ar archive)."""
    data = path.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise BuildError(f"{path} is not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        yield name, data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)


def _deb_tar(path: Path, prefix: str) -> tarfile.TarFile:
    for name, body in _ar_members(path):
        if name.startswith(prefix):
            if name.endswith(".zst"):
                raise BuildError(f"{path}: zstd-compressed {name} is not supported (Debian uses xz)")
            raw = lzma.decompress(body) if name.endswith(".xz") else body
            return tarfile.open(fileobj=io.BytesIO(raw), mode="r:*")
    raise BuildError(f"{path} has no {prefix}* member")


def _merged(name: str) -> str:
    first, _, rest = name.partition("/")
    return f"usr/{first}/{rest}".rstrip("/") if first in MERGED else name


def _member_path(name: str) -> str:
    """A package member's path inside the root ('' for the root itself), with merged /usr applied."""
    path = os.path.normpath(name).lstrip("/")
    if path == ".":
        return ""
    if path == ".." or path.startswith("../"):
        raise BuildError(f"package member {name!r} points outside the root")
    return _merged(path)


def unpack_deb(path: Path, root: Path) -> str:
    """Unpacks the package's files into root (merged /usr; trimmed paths left out), like dpkg without its
    maintainer scripts. Returns the control stanza for the dpkg status database."""
    with _deb_tar(path, "control.tar") as tar:
        member = tar.extractfile("./control")
        assert member is not None
        control = member.read().decode().strip()
    with _deb_tar(path, "data.tar") as tar:
        for m in tar:
            name = _member_path(m.name)
            if not name or TRIMMED.match(name):
                continue
            dest = root / name
            if m.isdir():
                dest.mkdir(parents=True, exist_ok=True)
                dest.chmod(m.mode & 0o7777)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.is_symlink() or dest.exists():
                dest.unlink()
            if m.issym():
                dest.symlink_to(m.linkname)
            elif m.islnk():
                os.link(root / _member_path(m.linkname), dest)
            elif m.isfile():
                src = tar.extractfile(m)
                assert src is not None
                with open(dest, "wb") as out:
                    shutil.copyfileobj(src, out)
                dest.chmod(m.mode & 0o7777)
            else:
                raise BuildError(f"{path}: {m.name}: device nodes and fifos are not supported in the image")
    return control


def build_base(root: Path, cache: Path, plat: Platform, python_root: Path | None) -> None:
    """The base of `plat`; its standard library compiled by python_root's Python (None: its own)."""
    debs = read_debian_lock(plat.deb)
    triplet = plat.triplet
    for d in MERGED:
        (root / "usr" / d).mkdir(parents=True, exist_ok=True)
        (root / d).symlink_to(f"usr/{d}")
    status = root / "var/lib/dpkg/status.d"
    status.mkdir(parents=True)
    for deb in debs:
        control = unpack_deb(fetch_deb(deb, cache / "debs"), root)
        # distroless' layout: one stanza per package, so that scanners (trivy, grype, syft) see the versions.
        (status / deb.name).write_text(f"{control}\nStatus: install ok installed\n")
    for d in MERGED:  # empty aliases (lib32 etc. on amd64) are not worth shipping
        if not any((root / "usr" / d).iterdir()):
            (root / d).unlink()
            (root / "usr" / d).rmdir()
    (root / "usr/bin/python3").symlink_to(f"python{PYTHON}")
    for d in ("tmp", "var/tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d).chmod(0o1777)
    for d in ("proc", "sys", "dev", "run", "root"):
        (root / d).mkdir(exist_ok=True)
    (root / "root").chmod(0o700)
    etc = root / "etc"
    (etc / "passwd").write_text(f"root:x:0:0:root:/root:/sbin/nologin\n"
                                f"{USER}:x:{UID}:{GID}:{USER}:/nonexistent:/sbin/nologin\n")
    (etc / "group").write_text(f"root:x:0:\n{USER}:x:{GID}:\n")
    # Without it glibc asks DNS before /etc/hosts.
    (etc / "nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files dns\n")
    for f in ("passwd", "group", "nsswitch.conf"):
        (etc / f).chmod(0o644)
    if not (root / "usr/lib" / triplet / "libc.so.6").exists():
        raise BuildError(f"the base has no usr/lib/{triplet}/libc.so.6: is {DEBIAN_LOCK.name} for this architecture?")
    # Debian compiles the standard library when installing (py3compile); without pycs every start of the
    # read-only container would compile what it imports.
    compile_pycs(python_root or root, root, f"usr/lib/python{PYTHON}")


def rootfs_python(root: Path) -> tuple[list[str], dict[str, str]]:
    """argv prefix and environment that run the image's Python of this machine's architecture (a base layer
    unpacked at `root`) outside the image: its own dynamic loader and libraries, its own standard library (no
    chroot, no root needed)."""
    libdir = root / "usr/lib" / native().triplet
    loader = next(iter(sorted(libdir.glob("ld-linux*.so.*"))), None)
    if loader is None:
        raise BuildError(f"no dynamic loader in {libdir}")
    env = {"PATH": "/usr/bin:/bin", "PYTHONHOME": str(root / "usr"), "PYTHONDONTWRITEBYTECODE": "1",
           "LC_ALL": "C.UTF-8", "PYTHONNOUSERSITE": "1"}
    return [str(loader), "--library-path", str(libdir), str(root / "usr/bin" / f"python{PYTHON}")], env


def compile_pycs(python_root: Path, tree: Path, under: str) -> None:
    """Byte-compiles tree/under with the image's Python (python_root, this machine's architecture), recording
    image paths (/under/...)."""
    argv, env = rootfs_python(python_root)
    # unchecked-hash: valid whatever the file times (the layers set them to 0) and never rewritten at run time.
    run([*argv, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash",
         "-s", str(tree), "-p", "/", "-x", r"/(lib2to3/tests|test|tests)/", str(tree / under)],
        f"byte-compiling {under} with the image's Python", env=env)


# --- wheels ------------------------------------------------------------------------------------------------

def _glibc(debs: list[Deb]) -> tuple[int, int]:
    libc = next((d for d in debs if d.name == "libc6"), None)
    m = re.match(r"(\d+)\.(\d+)", libc.version) if libc else None
    if not m:
        raise BuildError(f"{DEBIAN_LOCK.name} has no libc6: cannot tell which manylinux wheels fit")
    return int(m.group(1)), int(m.group(2))


def pip_target_flags(debs: list[Deb], plat: Platform) -> list[str]:
    """pip options selecting wheels for the image's Python, glibc and architecture, not this machine's."""
    major, minor = _glibc(debs)
    machine = plat.machine
    platforms = [f"manylinux_{major}_{m}_{machine}" for m in range(minor, 4, -1)]
    platforms += [f"manylinux2014_{machine}", f"manylinux2010_{machine}", f"manylinux1_{machine}"]
    flags = ["--only-binary=:all:", "--implementation", "cp", "--python-version", PYTHON,
             "--abi", f"cp{PYTHON.replace('.', '')}", "--abi", "abi3", "--abi", "none"]
    for p in platforms:
        flags += ["--platform", p]
    return flags


def pip(python: str, *args: str, what: str) -> None:
    run([python, "-m", "pip", "--disable-pip-version-check", "--no-input", *args], what)


def cdi_hook_binary(given: Path | None, plat: Platform) -> Path:
    """The nvidia-cdi-hook of `plat` to ship: `given` (--cdi-hook, this machine's architecture only), else
    hack/build-cdi-tools.sh's (built or reused; cross-compiled for the other architecture)."""
    if given is not None and plat == native():
        if not given.is_file():
            raise BuildError(f"--cdi-hook {given}: no such file")
        return given
    proc = subprocess.run(["bash", str(HACK / "build-cdi-tools.sh"), "hook"], capture_output=True, text=True,
                          env={**os.environ, "HOOK_ARCH": plat.deb})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise BuildError(f"hack/build-cdi-tools.sh hook failed: {last[0]} (or pass --cdi-hook PATH)")
    return Path(lines[-1])


def build_deps(root: Path, base: Path, cache: Path, python: str, debs: list[Deb], hook: Path, plat: Platform) -> None:
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    flags = pip_target_flags(debs, plat)
    pip(python, "download", "--no-deps", "--require-hashes", "-r", str(PYPI_LOCK), "-d", str(wheels), *flags,
        what=f"pip download of {PYPI_LOCK.name}")
    pip(python, "install", "--no-deps", "--require-hashes", "-r", str(PYPI_LOCK), "--no-index", "--find-links",
        str(wheels), "--target", str(root / SITE), "--no-compile", *flags, what=f"pip install of {PYPI_LOCK.name}")
    _tidy_target(root)
    compile_pycs(base, root, SITE)
    target = root / CDI_HOOK.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(hook, target)
    target.chmod(0o755)


def _tidy_target(root: Path) -> None:
    """pip --target writes console scripts with this machine's interpreter in bin/: not usable in the image."""
    shutil.rmtree(root / SITE / "bin", ignore_errors=True)
    for path in TRIMMED_SITE:
        shutil.rmtree(root / SITE / path, ignore_errors=True)


def source_files() -> list[Path]:
    """What setuptools puts in the wheel (packages with an __init__.py, their *.py and package data *.yaml and
    *.proto, pyproject.toml's settings), found the same way: the app layer's key. build_app checks the two agree."""
    files = [REPO / "pyproject.toml"]
    for pkg in SOURCE_PACKAGES:
        for d, subdirs, names in os.walk(REPO / pkg):
            subdirs[:] = sorted(s for s in subdirs if (Path(d) / s / "__init__.py").is_file())
            files += sorted(Path(d) / n for n in names
                            if Path(n).suffix in SOURCE_SUFFIXES and not n.startswith("."))
    return files


def build_app(root: Path, base: Path, cache: Path, python: str, debs: list[Deb], out_wheel_dir: Path) -> None:
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip(python, "download", "--no-deps", "--require-hashes", "-r", str(BUILD_LOCK), "-d", str(wheels),
        what=f"pip download of {BUILD_LOCK.name}")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        for f in source_files():  # a clean copy: setuptools writes build/ and *.egg-info next to the sources
            dest = src / f.relative_to(REPO)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest)
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("".join(line.split("--hash")[0].strip() + "\n"
                                       for line in BUILD_LOCK.read_text().splitlines()
                                       if line.strip() and not line.startswith("#")))
        env = {**os.environ, "PIP_CONSTRAINT": str(constraints), "SOURCE_DATE_EPOCH": "315532800"}
        run([python, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-deps", "--no-index", "--find-links",
             str(wheels), "-w", str(out_wheel_dir), str(src)], "building the project's wheel", env=env)
    wheel = next(out_wheel_dir.glob("gpu_dra_driver-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        packed = {n for n in zf.namelist() if ".dist-info/" not in n}
    selected = {str(f.relative_to(REPO)) for f in source_files()} - {"pyproject.toml"}
    if packed != selected:
        raise BuildError(f"the wheel and source_files() disagree (the app layer's cache key would be wrong): "
                         f"only in the wheel {sorted(packed - selected)[:5]}, only selected {sorted(selected - packed)[:5]}")
    pip(python, "install", "--no-deps", "--no-index", "--target", str(root / SITE), "--no-compile",
        *pip_target_flags(debs, native()), str(wheel), what="pip install of the project's wheel")
    _tidy_target(root)
    # pip records where the wheel was installed from: a path on the build machine, different in every cache.
    for dist_info in (root / SITE).glob("gpu_dra_driver-*.dist-info"):
        (dist_info / "direct_url.json").unlink(missing_ok=True)
        record = dist_info / "RECORD"
        record.write_text("".join(line for line in record.read_text().splitlines(keepends=True)
                                  if not line.startswith(f"{dist_info.name}/direct_url.json,")))
    compile_pycs(base, root, SITE)
    script = root / ENTRYPOINT.lstrip("/")
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(f"#!/usr/bin/python{PYTHON}\nimport sys\n\nfrom cli.main import main\n\nsys.exit(main())\n")
    script.chmod(0o755)


# --- layers and the archive --------------------------------------------------------------------------------

@dataclass
class Layer:
    kind: str
    key: str
    blob: Path  # gzip'd layer tar

    @property
    def meta(self) -> dict[str, str]:
        return json.loads(self.blob.with_name("layer.json").read_text())


def cached_layer(cache: Path, kind: str, key: str, build: object) -> Layer:
    """The layer of `kind` for `key`: reused when present, else build(root_dir) fills a directory that is packed."""
    where = cache / "layers" / f"{kind}-{key}"
    blob = where / "layer.tar.gz"
    if blob.exists() and (where / "layer.json").exists():
        log(f"reusing the {kind} layer {key}")
        os.utime(where)  # recently used: kept by prune()
        return Layer(kind, key, blob)
    oci = _oci()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        build(root)  # type: ignore[operator]
        raw = oci.layer_tar(root)
        gz = oci.gzip_bytes(raw)
        where.mkdir(parents=True, exist_ok=True)
        tmp_blob = where / "layer.tar.gz.tmp"
        tmp_blob.write_bytes(gz)
        (where / "layer.json").write_text(json.dumps({
            "diff_id": oci.digest(raw), "digest": oci.digest(gz), "size": len(gz), "uncompressed": len(raw),
            "seconds": round(time.monotonic() - start, 1)}))
        tmp_blob.replace(blob)
    log(f"built the {kind} layer {key} in {time.monotonic() - start:.0f}s ({len(gz) >> 20} MiB compressed)")
    return Layer(kind, key, blob)


def extract_layer(blob: Path, dest: Path) -> None:
    """Unpacks one of our layers as it is (modes like /tmp's 1777 included: Python's safer filters drop them)."""
    trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
    with tarfile.open(blob, "r:gz") as tar:
        tar.extractall(dest, **trusted)  # type: ignore[arg-type]


def prune(cache: Path, keep: int = 3) -> None:
    """Keeps the `keep` most recently used archives and index layouts, and twice as many layers of each kind (two
    architectures; an app layer per version); each code change makes new ones."""
    groups: dict[str, list[Path]] = {}
    for d in [*(cache / "archives").glob("*"), *(cache / "indexes").glob("*"), *(cache / "layers").glob("*-*")]:
        groups.setdefault(d.parent.name + d.name.split("-")[0] * (d.parent.name == "layers"), []).append(d)
    for group, dirs in groups.items():
        kept = keep * 2 if group.startswith("layers") else keep
        for old in sorted(dirs, key=lambda p: p.stat().st_mtime, reverse=True)[kept:]:
            shutil.rmtree(old, ignore_errors=True)


def image_config(layers: list[Layer], version: str, plat: Platform) -> bytes:
    oci = _oci()
    created = oci.CREATED
    return bytes(oci.canonical({
        "created": created, **plat.oci,
        "config": {
            "User": f"{UID}:{GID}",
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", "PYTHONUNBUFFERED=1",
                    "PYTHONDONTWRITEBYTECODE=1"],
            "Entrypoint": [ENTRYPOINT], "Cmd": ["--help"], "WorkingDir": "/",
            "Labels": {"org.opencontainers.image.title": "gpu-dra-driver",
                       "org.opencontainers.image.version": version,
                       "org.opencontainers.image.base.name": "debian:bookworm (packages: /var/lib/dpkg/status.d)"},
        },
        "rootfs": {"type": "layers", "diff_ids": [layer.meta["diff_id"] for layer in layers]},
        "history": [{"created": created, "created_by": f"hack/build-image.py: {layer.kind} layer"} for layer in layers],
    }))


def image_blobs(layers: list[Layer], version: str, plat: Platform) -> tuple[bytes, list[bytes], dict[str, Path]]:
    """(manifest, [config], {digest: layer file}) of one architecture's image."""
    oci = _oci()
    config = image_config(layers, version, plat)
    metas = [layer.meta for layer in layers]
    manifest = oci.image_manifest(config, metas)
    return manifest, [config], {m["digest"]: layer.blob for m, layer in zip(metas, layers)}


def pack(layers: list[Layer], name: str, version: str) -> bytes:
    """The OCI archive of this machine's image: an image layout in a tar, named after `name` for `ctr images
    import`."""
    oci = _oci()
    plat = native()
    manifest, small, big = image_blobs(layers, version, plat)
    index = oci.canonical({
        "schemaVersion": 2, "mediaType": oci.INDEX,
        "manifests": [{
            "mediaType": oci.MANIFEST, "digest": oci.digest(manifest), "size": len(manifest), "platform": plat.oci,
            "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": oci._tag(name)},
        }],
    })
    return bytes(oci.layout_tar(index, [manifest, *small], big))


def write_index_layout(images: dict[Platform, list[Layer]], name: str, version: str, out: Path) -> str:
    """The image index of every architecture in `images`, as an OCI layout directory at `out` whose index.json
    names that index (`crane push DIR REF` pushes it as it is); returns the index's digest."""
    oci = _oci()
    small: list[bytes] = []
    big: dict[str, Path] = {}
    entries = []
    for plat, layers in images.items():
        manifest, configs, blobs = image_blobs(layers, version, plat)
        small += [manifest, *configs]
        big.update(blobs)
        entries.append({"mediaType": oci.MANIFEST, "digest": oci.digest(manifest), "size": len(manifest),
                        "platform": plat.oci})
    index = oci.canonical({"schemaVersion": 2, "mediaType": oci.INDEX, "manifests": entries})
    top = oci.canonical({
        "schemaVersion": 2, "mediaType": oci.INDEX,
        "manifests": [{"mediaType": oci.INDEX, "digest": oci.digest(index), "size": len(index),
                       "annotations": {"io.containerd.image.name": name,
                                       "org.opencontainers.image.ref.name": oci._tag(name)}}],
    })
    oci.write_layout(out, top, [index, *small], big)
    return str(oci.digest(index))


def project_version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def build_layers(cache: Path, python: str, plat: Platform, hook: Path) -> list[Layer]:
    """base, deps and app of `plat`. This machine's base layer is built in any case: its Python compiles the
    others; the app layer is the same for every architecture."""
    here = native()
    script = Path(__file__).read_bytes() + (HACK / "build-oci-image.py").read_bytes()
    debs, native_debs = read_debian_lock(plat.deb), read_debian_lock(here.deb)
    if python_version(debs) != python_version(native_debs):
        raise BuildError(f"{DEBIAN_LOCK.name} pins python{PYTHON} {python_version(debs)} for {plat.deb} but "
                         f"{python_version(native_debs)} for {here.deb}: one Python compiles both (make image-lock)")

    def base_key(p: Platform) -> str:
        return key_of(script, DEBIAN_LOCK.read_bytes(), p.machine)

    deps_key = key_of(base_key(plat), PYPI_LOCK.read_bytes(), sha256_file(hook))
    app_key = key_of(script, python_version(debs), BUILD_LOCK.read_bytes(),
                     *(str(f.relative_to(REPO)) + "\0" + f.read_text() for f in source_files()))

    def missing(kind: str, key: str) -> bool:
        return not (cache / "layers" / f"{kind}-{key}" / "layer.json").exists()

    native_base = cached_layer(cache, "base", base_key(here), lambda root: build_base(root, cache, here, None))
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        python_root = Path(tmp) / "base"
        if missing("deps", deps_key) or missing("app", app_key) or (plat != here and missing("base", base_key(plat))):
            extract_layer(native_base.blob, python_root)  # its Python compiles the pycs of the others
        base = native_base if plat == here else cached_layer(
            cache, "base", base_key(plat), lambda root: build_base(root, cache, plat, python_root))
        deps = cached_layer(cache, "deps", deps_key,
                            lambda root: build_deps(root, python_root, cache, python, debs, hook, plat))
        app_dir = cache / "layers" / f"app-{app_key}"
        app = cached_layer(cache, "app", app_key,
                           lambda root: build_app(root, python_root, cache, python, native_debs, app_dir / "wheel"))
    return [base, deps, app]


def image_cache() -> Path:
    cache = Path(os.environ.get("GPU_DRA_CACHE", Path.home() / ".cache/gpu-dra")) / "image"
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def image_name(args: argparse.Namespace) -> str:
    return f"{args.repository or pinned('DRIVER_IMAGE_REPOSITORY')}:{args.tag or project_version()}"


def cmd_build(args: argparse.Namespace) -> int:
    cache = image_cache()
    version = project_version()
    name = image_name(args)
    layers = build_layers(cache, args.python, native(), cdi_hook_binary(args.cdi_hook, native()))
    key = key_of(name, *(layer.key for layer in layers), Path(__file__).read_bytes())
    out = cache / "archives" / key / "gpu-dra-driver.oci.tar"
    if not out.exists():
        data = pack(layers, name, version)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(out)
        (out.parent / "image.json").write_text(json.dumps({
            "name": name, "size": len(data), "layers": {layer.kind: layer.meta for layer in layers}}, indent=1))
        log(f"wrote {out} ({len(data) >> 20} MiB)")
    else:
        log(f"reusing {out}")
        os.utime(out.parent)
    prune(cache)
    info = json.loads((out.parent / "image.json").read_text())
    log(f"{name}: {info['size'] / 2**20:.1f} MiB archive; layers (compressed/unpacked MiB): " + ", ".join(
        f"{kind} {m['size'] / 2**20:.1f}/{m['uncompressed'] / 2**20:.0f}" for kind, m in info["layers"].items()))
    latest = cache / "latest.oci.tar"
    latest.unlink(missing_ok=True)
    latest.symlink_to(out)
    print(f"{name} {out}")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    cache = image_cache()
    version = project_version()
    name = image_name(args)
    images = {plat: build_layers(cache, args.python, plat, cdi_hook_binary(args.cdi_hook, plat))
              for plat in PLATFORMS.values()}
    key = key_of(name, *(layer.key for layers in images.values() for layer in layers), Path(__file__).read_bytes())
    out = args.out or cache / "indexes" / key
    if args.out or not (out / "index.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        digest = write_index_layout(images, name, version, tmp)
        tmp.replace(out)
        log(f"wrote the image index {digest} of {', '.join(p.deb for p in images)} to {out}")
    else:
        log(f"reusing {out}")
        os.utime(out)
    if not args.out:
        prune(cache)
    top = json.loads((out / "index.json").read_text())
    print(f"{name} {top['manifests'][0]['digest']} {out}")
    return 0


def cmd_rootfs(args: argparse.Namespace) -> int:
    cache = image_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    for layer in build_layers(cache, args.python, native(), cdi_hook_binary(args.cdi_hook, native())):
        extract_layer(layer.blob, args.out)
    print(args.out)
    return 0


def lock_wheels(python: str, reqs: list[str], flags_of: dict[Platform, list[str]], what: str) -> list[str]:
    """Lock lines of `reqs` resolved for each platform's flags: one version of each distribution for all of them,
    with the hash of every platform's wheel (pip --require-hashes takes any of a line's hashes)."""
    found: dict[str, dict[str, set[str]]] = {}
    for plat, flags in flags_of.items():
        with tempfile.TemporaryDirectory() as tmp:
            pip(python, "download", "-d", tmp, *flags, *reqs, what=f"resolving {what} for {plat.deb}")
            for wheel in Path(tmp).glob("*.whl"):
                dist, ver = wheel.name.split("-")[:2]
                found.setdefault(dist.replace("_", "-").lower(), {}).setdefault(ver, set()).add(sha256_file(wheel))
    lines = []
    for dist, versions in sorted(found.items()):
        if len(versions) != 1:
            raise BuildError(f"{what}: {dist} resolves to {sorted(versions)} on different architectures")
        (ver, hashes), = versions.items()
        lines.append(f"{dist}=={ver}" + "".join(f" --hash=sha256:{h}" for h in sorted(hashes)) + "\n")
    return lines


def cmd_lock(args: argparse.Namespace) -> int:
    with private_apt() as apt:
        per_arch = {plat.deb: resolve_debian(ROOT_PACKAGES, plat.deb, apt) for plat in PLATFORMS.values()}
    debs = merged_debian_lock(per_arch)
    header = ("# Debian packages of the image, resolved by `hack/build-image.py lock` (make image-lock) for "
              f"{', '.join(PLATFORMS)} from\n# the host's apt sources (bookworm, bookworm-updates, bookworm-security). "
              "Each architecture takes its own\n# packages and the `all` ones. Do not edit.\n"
              f"# roots: {' '.join(ROOT_PACKAGES)}\n# left out: {' '.join(sorted(EXCLUDED))}\n")
    DEBIAN_LOCK.write_text(header + "".join(d.line() + "\n" for d in debs))
    log(f"{DEBIAN_LOCK}: {len(debs)} packages")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    runtime = lock_wheels(args.python, pyproject["project"]["dependencies"],
                          {p: pip_target_flags(per_arch[p.deb], p) for p in PLATFORMS.values()},
                          "runtime dependencies of pyproject.toml")
    build = lock_wheels(args.python, pyproject["build-system"]["requires"],
                        {native(): ["--only-binary=:all:"]}, "the build backend")
    for path, lines, what in ((PYPI_LOCK, runtime, "runtime dependencies of pyproject.toml"),
                              (BUILD_LOCK, build, "the build backend")):
        path.write_text(f"# {what.capitalize()}, for the image: resolved by `hack/build-image.py lock` "
                        f"(make image-lock). Do not edit.\n" + "".join(lines))
        log(f"{path}: {len(lines)} wheels")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="the Python whose pip downloads and installs wheels")
    ap.add_argument("--cdi-hook", type=Path, default=os.environ.get("CDI_HOOK") or None,
                    help="the nvidia-cdi-hook binary to ship in this machine's image (default: built or reused by "
                         "hack/build-cdi-tools.sh, which also cross-compiles the other architecture's)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the OCI archive of this machine's architecture (cached)")
    i = sub.add_parser("index", help="build the image index of linux/amd64 and linux/arm64 as an OCI layout")
    for p in (b, i):
        p.add_argument("--repository", default=os.environ.get("IMAGE_REPOSITORY"),
                       help="image repository (default: DRIVER_IMAGE_REPOSITORY in hack/versions.env)")
        p.add_argument("--tag", default=os.environ.get("IMAGE_TAG"), help="image tag (default: the project version)")
    i.add_argument("--out", type=Path, help="the layout directory, replaced (default: one in the cache)")
    r = sub.add_parser("rootfs", help="write the image's file system into a directory")
    r.add_argument("--out", type=Path, required=True)
    sub.add_parser("lock", help="re-resolve deploy/image/*.lock from apt and PyPI")
    args = ap.parse_args(argv)
    os.umask(0o022)
    try:
        return {"build": cmd_build, "index": cmd_index, "rootfs": cmd_rootfs, "lock": cmd_lock}[args.cmd](args)
    except BuildError as err:
        print(f"build-image: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
