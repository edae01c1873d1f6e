"""hack/build-oci-tools.sh (crane, the distribution registry) and the arm64 nvidia-cdi-hook of
hack/build-cdi-tools.sh: bad pins are refused in one line, and a complete build in the cache is reused without Go."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PINS = dict(line.split("=", 1) for line in (ROOT / "hack" / "versions.env").read_text().splitlines()
            if "=" in line and not line.startswith("#"))


def _run(script: str, target: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "hack" / script), target], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


@pytest.mark.parametrize("key, version, says", [
    ("CRANE_VERSION", "0.22.1", "is not a go-containerregistry release"),
    ("DISTRIBUTION_VERSION", "v2.8.3", "is not a distribution v3 release"),
])
def test_a_bad_pin_is_refused(tmp_path: Path, key: str, version: str, says: str) -> None:
    proc = _run("build-oci-tools.sh", "all", {key: version, "GPU_DRA_CACHE": str(tmp_path)})
    assert proc.returncode != 0 and f"{key} '{version}' {says}" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name, reports", [("crane", "echo $CRANE_VERSION"),
                                           ("registry", "echo registry github.com/distribution/distribution/v3 "
                                                        "$DISTRIBUTION_VERSION")])
def test_a_complete_build_is_reused(tmp_path: Path, name: str, reports: str) -> None:
    key = "CRANE_VERSION" if name == "crane" else "DISTRIBUTION_VERSION"
    version = PINS[key]
    bin_dir = tmp_path / name / version / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / name).write_text(f"#!/bin/sh\n{reports.replace('$' + key, version)}\n")
    (bin_dir / name).chmod(0o755)
    (bin_dir.parent / ".complete").write_text(f"{version}\n")
    proc = _run("build-oci-tools.sh", name, {"GPU_DRA_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(bin_dir / name)


def test_an_arm64_hook_in_the_cache_is_reused_and_other_architectures_are_refused(tmp_path: Path) -> None:
    version = PINS["NVIDIA_CTK_VERSION"]
    hook = tmp_path / "cdi-hook" / f"{version}-arm64" / "bin" / "nvidia-cdi-hook"
    hook.parent.mkdir(parents=True)
    hook.write_bytes(b"\x7fELF")
    hook.chmod(0o755)
    (hook.parent.parent / ".complete").write_text(f"{version}\n")
    proc = _run("build-cdi-tools.sh", "hook", {"GPU_DRA_CACHE": str(tmp_path), "HOOK_ARCH": "arm64",
                                               "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == str(hook), proc.stderr
    proc = _run("build-cdi-tools.sh", "hook", {"GPU_DRA_CACHE": str(tmp_path), "HOOK_ARCH": "s390x"})
    assert proc.returncode != 0 and "HOOK_ARCH 's390x' is not amd64 or arm64" in proc.stderr, proc.stderr


def test_the_cross_compiler_pin_is_debians_gcc_12() -> None:
    assert PINS["AARCH64_CROSS_GCC_DEB_VERSION"].startswith("12.")
