"""The plugin on a node without a usable NVIDIA driver: one line naming the driver root and exit status 2, at
the default driver root (/) as at any other, never a pynvml traceback (a CPU-only node's DaemonSet pod would
crash-loop with one on every restart)."""
from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _plugin(tmp_path: Path, driver_root: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "NVIDIA_DRIVER_ROOT", "FLEET")}
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "kubelet-plugin", "--node-name", "cpu-node", "--driver-root", driver_root,
         "--registry-dir", str(tmp_path / "registry"), "--plugin-dir", str(tmp_path / "plugin"),
         "--state-dir", str(tmp_path / "state"), "--log-format", "text"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


@pytest.mark.parametrize("root", ["/", "empty"])
def test_no_driver_is_one_line_and_exit_2(tmp_path: Path, root: str) -> None:
    if root == "/" and ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has an NVIDIA driver at /: the case needs a node without one")
    driver_root = root if root == "/" else str(tmp_path / "empty")
    if root != "/":
        (tmp_path / "empty").mkdir()
    proc = _plugin(tmp_path, driver_root)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpu-dra kubelet-plugin: --driver-root"), lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    if root == "/":
        assert "--driver-root /: no usable NVIDIA driver" in lines[0], lines[0]


def test_the_fix_names_the_charts_placement_value_as_doctor_and_the_docs_do(tmp_path: Path) -> None:
    """One chart value places the plugin on GPU nodes (kubeletPlugin.gpuNodeLabels, docs/operations.md); the
    plugin's exit and `gpu-dra doctor` name that one."""
    from dra.node.nodeobjects import GPU_NODES_ONLY
    from ops.doctor import checks

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has an NVIDIA driver at /: the case needs a node without one")
    line = _plugin(tmp_path, "/").stderr.strip()
    assert "kubeletPlugin.gpuNodeLabels" in line and "kubeletPlugin.affinity" not in line, line
    assert "kubeletPlugin.gpuNodeLabels" in (REPO / "docs" / "operations.md").read_text()
    assert GPU_NODES_ONLY in line and checks.GPU_NODES_ONLY is GPU_NODES_ONLY
