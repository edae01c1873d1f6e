"""`make release` as a maintainer runs it, for the tests: in a clean repository holding this working tree's files
(a release refuses a dirty tree, and a test must not touch the checkout it runs from), into a LocalRegistry, with
dist/ served over HTTP as a release's download page is."""
from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from oci_registry import LocalRegistry

from testbed.localcluster import free_port

ROOT = Path(__file__).resolve().parents[2]
# The path under the registry host that releases go to: <host>/gpu-dra/gpu-dra-driver, <host>/gpu-dra/charts/...
REGISTRY_PATH = "gpu-dra"


def clean_copy(src: Path, dest: Path) -> Path:
    """The tree's tracked and untracked (not ignored) files, committed in a repository of their own at dest."""
    listed = subprocess.run(["git", "-C", str(src), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        path = src / rel
        if not path.exists() and not path.is_symlink():
            continue    # deleted in the tree, not yet in git
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            (dest / rel).symlink_to(os.readlink(path))
        else:
            shutil.copy2(path, dest / rel)
    for argv in (["init", "-q"], ["add", "-A"],
                 ["-c", "user.name=release-test", "-c", "user.email=release-test@example.com", "commit", "-q",
                  "-m", "the tree under test"]):
        subprocess.run(["git", "-C", str(dest), *argv], capture_output=True, check=True)
    return dest


class Releaser:
    """Releases of the tree into `registry`; `url` serves their dist/ (the krew manifests' uris point there)."""

    def __init__(self, registry: LocalRegistry, workdir: Path) -> None:
        self.registry = registry
        self.repo = clean_copy(ROOT, workdir / "repo")
        self.dist = self.repo / "dist"
        self.dist.mkdir()
        handler = functools.partial(_QuietHandler, directory=str(self.dist))
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def prefix(self) -> str:
        return f"{self.registry.host}/{REGISTRY_PATH}"

    @property
    def image(self) -> str:
        return f"{self.prefix}/gpu-dra-driver"

    @property
    def chart(self) -> str:
        return f"oci://{self.prefix}/charts/gpu-dra-driver"

    def make_release(self, version: str) -> subprocess.CompletedProcess[str]:
        """`make release` of the copy with this test run's virtualenv, whose install stamp make is told to leave
        alone (-o): it must never install the copy into it."""
        venv = Path(sys.executable).parent.parent
        crc = subprocess.run(["cksum"], input=(self.repo / "pyproject.toml").read_bytes(), capture_output=True,
                             check=True).stdout.split()[0].decode()
        return subprocess.run(
            ["make", "-C", str(self.repo), "--no-print-directory", "-o", f"{venv}/.installed-{crc}", "release",
             f"VERSION={version}", f"REGISTRY={self.prefix}", f"DOWNLOAD_URL={self.url}", f"VENV={venv}"],
            capture_output=True, text=True, timeout=1800, env={**os.environ, **self.registry.client_env()})

    def release(self, version: str) -> dict[str, Any]:
        """A release that must succeed; its dist/release-<version>.json."""
        proc = self.make_release(version)
        assert proc.returncode == 0, f"make release VERSION={version} failed:\n{proc.stderr[-4000:]}"
        return dict(json.loads((self.dist / f"release-{version}.json").read_text()))

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        pass
