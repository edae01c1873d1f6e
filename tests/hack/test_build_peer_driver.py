"""hack/build-peer-driver.sh: a pin that is not a full commit is refused in one line, a complete build in the cache
is reused without Go or git, and a source clone without the commit is named."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "build-peer-driver.sh"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_a_pin_that_is_not_a_full_commit_is_refused(tmp_path: Path) -> None:
    for pin in ("v0.1.0", "31914ce", "main"):
        proc = _run({"PEER_DRIVER_COMMIT": pin, "GPU_DRA_CACHE": str(tmp_path)})
        assert proc.returncode != 0
        assert f"PEER_DRIVER_COMMIT '{pin}' is not a full 40-hex commit" in proc.stderr, proc.stderr


def test_a_complete_build_is_reused(tmp_path: Path) -> None:
    bin_dir = tmp_path / "peer" / COMMIT / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "dra-example-kubeletplugin").write_text("#!/bin/sh\n")
    (bin_dir / "dra-example-kubeletplugin").chmod(0o755)
    (bin_dir.parent / ".complete").write_text(COMMIT + "\n")
    proc = _run({"PEER_DRIVER_COMMIT": COMMIT, "GPU_DRA_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(bin_dir / "dra-example-kubeletplugin")


def test_a_source_without_the_commit_is_named(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    subprocess.run(["git", "init", "-q", str(clone)], check=True)
    proc = _run({"PEER_DRIVER_COMMIT": COMMIT, "GPU_DRA_CACHE": str(tmp_path / "cache")}, str(clone))
    assert proc.returncode != 0
    assert f"{clone} has no commit {COMMIT}" in proc.stderr, proc.stderr


def test_the_pin_is_a_full_commit() -> None:
    pins = dict(line.split("=", 1) for line in (ROOT / "hack" / "versions.env").read_text().splitlines()
                if "=" in line and not line.startswith("#"))
    commit = pins["PEER_DRIVER_COMMIT"]
    assert len(commit) == 40 and all(c in "0123456789abcdef" for c in commit), commit
