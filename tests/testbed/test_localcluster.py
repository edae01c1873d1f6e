"""Pinned control-plane versions: one file read by the build script, the Makefile and the local cluster."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from testbed.localcluster import (
    BIN_ENV,
    CACHE_ENV,
    COMPONENTS,
    VERSIONS_FILE,
    ClusterError,
    LocalCluster,
    find_binaries,
    k8s_bin_dir,
    pinned_version,
)

ROOT = Path(__file__).resolve().parents[2]
RELEASE = re.compile(r"^v1\.\d+\.\d+$")


def test_the_pins_are_plain_releases_and_the_skew_version_is_the_supported_floor() -> None:
    target, skew = pinned_version("K8S_VERSION"), pinned_version("K8S_SKEW_VERSION")
    assert RELEASE.match(target) and RELEASE.match(skew)
    assert target.startswith("v1.37.") and skew.startswith("v1.34.")
    assert re.match(r"^v3\.\d+\.\d+$", pinned_version("ETCD_VERSION"))
    assert pinned_version() == target
    with pytest.raises(ClusterError, match="no K8S_NEXT_VERSION="):
        pinned_version("K8S_NEXT_VERSION")


def test_make_builds_both_pinned_releases_for_the_tests() -> None:
    out = subprocess.run(["make", "-n", "control-plane", "test"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    for key in ("K8S_VERSION", "K8S_SKEW_VERSION"):
        assert f"K8S_VERSION={pinned_version(key)} " in out, out


def test_the_build_script_refuses_a_version_it_cannot_map_to_staging_modules(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(ROOT / "hack" / "build-control-plane.sh")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "K8S_VERSION": "1.34"})
    assert proc.returncode == 1
    assert "K8S_VERSION '1.34' is not a Kubernetes release like v1.37.2" in proc.stderr
    assert str(VERSIONS_FILE) in proc.stderr


def _fake_bin_dir(root: Path, version: str, complete: bool) -> Path:
    bin_dir = root / "k8s" / version / "bin"
    bin_dir.mkdir(parents=True)
    for c in COMPONENTS:
        (bin_dir / c).write_text("#!/bin/sh\n")
        (bin_dir / c).chmod(0o755)
    if complete:
        (bin_dir.parent / ".complete").touch()
    return bin_dir


def test_cached_binaries_of_any_version_are_found_without_building(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(BIN_ENV, raising=False)
    done = _fake_bin_dir(tmp_path, "v1.34.4", complete=True)
    _fake_bin_dir(tmp_path, "v1.35.0", complete=False)
    assert k8s_bin_dir("v1.34.4") == done
    assert find_binaries(build=False, version="v1.34.4") == done
    with pytest.raises(ClusterError, match=r"no Kubernetes v1\.35\.0 binaries .* K8S_VERSION=v1\.35\.0 bash"):
        find_binaries(build=False, version="v1.35.0")


def test_the_bin_dir_override_serves_only_the_target_release(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    target = _fake_bin_dir(tmp_path / "override", pinned_version(), complete=False)
    skew = _fake_bin_dir(tmp_path / "cache", pinned_version("K8S_SKEW_VERSION"), complete=True)
    monkeypatch.setenv(BIN_ENV, str(target))
    assert find_binaries(build=False) == target
    assert find_binaries(build=False, version=pinned_version("K8S_SKEW_VERSION")) == skew


def test_build_scripts_show_their_log_lines_while_they_run(tmp_path: Path) -> None:
    """`gpu-dra demo` prints a cold build's progress: each log line of a hack/build-*.sh script reaches the
    receiver while the script still runs (this script goes on only once its first line was shown)."""
    from testbed.localcluster import ClusterError, bin_dir_from_script, set_build_progress

    shown = tmp_path / "shown"
    script = tmp_path / "build-fake.sh"
    script.write_text(f"""
printf '[build-fake.sh 12:00:00] building kubelet v1.37.2\\n' >&2
echo 'go: downloading k8s.io/api v0.37.2' >&2
for i in $(seq 600); do [ -e {shown} ] && break; sleep 0.1; done
[ -e {shown} ] || exit 7
printf '[build-fake.sh 12:00:09] node binaries ready\\n' >&2
echo {tmp_path}
""")
    lines: list[str] = []

    def show(line: str) -> None:
        lines.append(line)
        shown.touch()

    set_build_progress(show)
    try:
        bin_dir = bin_dir_from_script(script, {"PATH": "/usr/bin:/bin"}, lambda _: [], ClusterError)
    finally:
        set_build_progress(None)
    assert bin_dir == tmp_path
    assert lines == ["[build-fake.sh 12:00:00] building kubelet v1.37.2", "[build-fake.sh 12:00:09] node binaries ready"]


def test_client_limits_must_be_positive() -> None:
    with pytest.raises(ClusterError, match="client_qps=0"):
        LocalCluster(client_qps=0)
    with pytest.raises(ClusterError, match="client_burst=0"):
        LocalCluster(client_burst=0)


def test_the_schedulers_debug_endpoints_need_debug_access() -> None:
    with pytest.raises(ClusterError, match="debug_access=True"):
        LocalCluster().scheduler_get("/metrics")
