"""deploy/krew/gpu.yaml: a krew Plugin manifest that krew accepts. krew's own validation (its Go module's
ValidatePlugin, and validate-krew-manifest's platform checks) is not built here: validate-krew-manifest installs
each platform from its uri, which needs the published archive. Its rules are checked field by field instead,
and the archive hack/krew_manifest.py builds is the one the manifest's sha256 names."""
from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "krew" / "gpu.yaml"
sys.path.insert(0, str(REPO / "hack"))
import krew_manifest  # noqa: E402 - hack/ is no package: its path first

# krew's rules (internal/index/validation and cmd/validate-krew-manifest).
SAFE_NAME = re.compile(r"^[\w-]+$")
SHA256 = re.compile(r"^[a-f0-9]{64}$")
SEMVER_V = re.compile(r"^v(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")
SELECTOR_KEYS = {"os", "arch"}


def doc() -> dict[str, Any]:
    return dict(yaml.safe_load(MANIFEST.read_text()))


def test_the_manifest_follows_krews_rules() -> None:
    m = doc()
    assert m["apiVersion"] == "krew.googlecontainertools.github.com/v1alpha2" and m["kind"] == "Plugin"
    name = m["metadata"]["name"]
    assert name == MANIFEST.stem == "gpu" and SAFE_NAME.match(name)      # the file is named after the plugin
    spec = m["spec"]
    assert spec["shortDescription"] and "\n" not in spec["shortDescription"]
    assert SEMVER_V.match(spec["version"])
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert spec["version"] == f"v{version}"
    assert spec["platforms"]
    seen = set()
    for p in spec["platforms"]:
        assert p["uri"] and SHA256.match(p["sha256"]) and p["bin"]
        for f in p.get("files", [{"from": "x", "to": "x"}]):
            assert f["from"] and f["to"]
        labels = p["selector"]["matchLabels"]
        assert labels and set(labels) <= SELECTOR_KEYS and "matchExpressions" not in p["selector"]
        pair = (labels.get("os"), labels.get("arch"))
        assert pair not in seen, f"overlapping selectors for {pair}"
        seen.add(pair)


def test_the_manifest_names_the_archive_built_from_the_launcher() -> None:
    data = krew_manifest.archive_bytes()
    assert data == krew_manifest.archive_bytes()           # the same bytes every time
    assert {p["sha256"] for p in doc()["spec"]["platforms"]} == {hashlib.sha256(data).hexdigest()}, \
        "deploy/krew/gpu.yaml is stale: run python hack/krew_manifest.py"
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = tar.getmember("kubectl-gpu")
        assert member.mode & 0o111
    assert {p["bin"] for p in doc()["spec"]["platforms"]} == {"kubectl-gpu"}


def test_the_launcher_runs_the_plugin_or_says_what_is_missing(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    out = subprocess.run(["sh", str(REPO / "deploy/krew/kubectl-gpu"), "--help"], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: kubectl gpu status"), out.stdout + out.stderr
    (bindir / "python3").unlink()
    (bindir / "python3").write_text("#!/bin/sh\nexit 1\n")
    os.chmod(bindir / "python3", 0o755)
    env["PATH"] = str(bindir)
    missing = subprocess.run(["/bin/sh", str(REPO / "deploy/krew/kubectl-gpu")], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=60)
    assert missing.returncode == 2 and missing.stderr.strip() == \
        "kubectl gpu: needs the gpu-dra-driver Python package in python3 (pip install gpu-dra-driver)"
