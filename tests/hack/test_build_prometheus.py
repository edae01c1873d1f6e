"""hack/build-prometheus.sh: the pin maps to Prometheus' Go module version, a bad pin is refused in one line, and a
complete build in the cache is reused without Go."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "build-prometheus.sh"


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_a_version_that_is_not_prometheus_3_is_refused(tmp_path: Path) -> None:
    for version in ("v2.55.1", "v0.316.0", "3.16.0"):
        proc = _run({"PROMETHEUS_VERSION": version, "GPU_DRA_CACHE": str(tmp_path)})
        assert proc.returncode != 0
        assert f"PROMETHEUS_VERSION '{version}' is not a Prometheus 3 release" in proc.stderr, proc.stderr


def test_a_complete_build_is_reused(tmp_path: Path) -> None:
    bin_dir = tmp_path / "prometheus" / "v3.16.0" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("prometheus", "promtool"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    (bin_dir.parent / ".complete").write_text("v3.16.0\n")
    proc = _run({"PROMETHEUS_VERSION": "v3.16.0", "GPU_DRA_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(bin_dir)


def test_the_pin_is_a_prometheus_3_release() -> None:
    pins = dict(line.split("=", 1) for line in (ROOT / "hack" / "versions.env").read_text().splitlines()
                if "=" in line and not line.startswith("#"))
    assert pins["PROMETHEUS_VERSION"].startswith("v3.")
