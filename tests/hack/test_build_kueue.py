"""hack/build-kueue.sh: a pin older than the DRA device class mappings' release is refused in one line, and a
complete build in the cache (manager and CRDs) is reused without Go."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "build-kueue.sh"


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_a_version_before_v0_17_or_not_a_release_is_refused(tmp_path: Path) -> None:
    for version in ("v0.16.2", "0.17.0", "v1.0.0", "main"):
        proc = _run({"KUEUE_VERSION": version, "GPU_DRA_CACHE": str(tmp_path)})
        assert proc.returncode != 0
        assert f"KUEUE_VERSION '{version}' is not a Kueue release >= v0.17.0" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_complete_build_is_reused(tmp_path: Path) -> None:
    out = tmp_path / "kueue" / "v0.17.0"
    (out / "bin").mkdir(parents=True)
    (out / "crd").mkdir()
    (out / "bin" / "kueue").write_text("#!/bin/sh\n")
    (out / "bin" / "kueue").chmod(0o755)
    (out / ".complete").write_text("v0.17.0\n")
    proc = _run({"KUEUE_VERSION": "v0.17.0", "GPU_DRA_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)


def test_an_incomplete_build_is_not_reused(tmp_path: Path) -> None:
    out = tmp_path / "kueue" / "v0.17.0"
    (out / "bin").mkdir(parents=True)
    (out / "bin" / "kueue").write_text("#!/bin/sh\n")
    (out / "bin" / "kueue").chmod(0o755)
    # No .complete and no CRDs; without Go on PATH the script must say so rather than reuse the half build.
    proc = _run({"KUEUE_VERSION": "v0.17.0", "GPU_DRA_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0 and "Go is not installed" in proc.stderr, proc.stderr
