"""`python -m bench --peer-bin` (the side-by-side benchmark on the real node) refuses a binary it cannot run with a
clear error and exit status 2, before it starts a control plane or a node; it needs no reference driver here."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_a_missing_peer_binary_is_named_with_how_to_build_it(tmp_path: Path) -> None:
    proc = bench("--peer-bin", str(tmp_path / "dra-example-kubeletplugin"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--peer-bin {tmp_path}/dra-example-kubeletplugin: no such file" in proc.stderr
    assert "hack/build-peer-driver.sh" in proc.stderr


def test_a_peer_binary_that_is_not_executable_is_refused(tmp_path: Path) -> None:
    plugin = tmp_path / "dra-example-kubeletplugin"
    plugin.write_bytes(b"\x7fELF")
    plugin.chmod(0o644)
    proc = bench("--peer-bin", str(plugin))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not executable" in proc.stderr and str(plugin) in proc.stderr


def test_the_peer_benchmark_without_its_binary_says_what_it_needs() -> None:
    proc = bench("--only", "peer")
    assert proc.returncode != 0
    assert "peer needs --peer-bin PATH" in proc.stderr
