"""The showcase app's CUDA stand-in switch (examples/showcase-stable-diffusion/standin.py): off unless
SD_STANDIN=cuda-probe; on, it reports the probe's output and the claim's MPS limits, or why the probe did not
run. The app itself needs Streamlit and torch (pinned in requirements.txt, not installed here): it is only
checked to parse and to take the stand-in branch before importing torch."""
from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SHOWCASE = Path(__file__).resolve().parents[2] / "examples" / "showcase-stable-diffusion"


def _standin() -> ModuleType:
    spec = importlib.util.spec_from_file_location("showcase_standin", SHOWCASE / "standin.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_switch_is_off_unless_asked_for() -> None:
    s = _standin()
    assert not s.standin_enabled({}) and not s.standin_enabled({"SD_STANDIN": "yes"})
    assert s.standin_enabled({"SD_STANDIN": "cuda-probe"})


def test_report_has_the_probe_output_and_mps_limits(tmp_path: Path) -> None:
    probe = tmp_path / "cuda-probe"
    probe.write_text(f"#!{sys.executable}\nprint('cuda: device 0 GPU-1 20389 MiB NVIDIA H100 80GB HBM3')\n")
    probe.chmod(0o755)
    env = {"CUDA_PROBE": str(probe), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "PATH": "/usr/bin:/bin"}
    assert _standin().probe_report(env) == ["cuda: device 0 GPU-1 20389 MiB NVIDIA H100 80GB HBM3",
                                            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"]
    missing = _standin().probe_report({"CUDA_PROBE": str(tmp_path / "none")})
    assert len(missing) == 1 and "none" in missing[0]


def test_app_takes_the_standin_branch_before_torch() -> None:
    tree = ast.parse((SHOWCASE / "app.py").read_text())
    branch = next(n for n in tree.body if isinstance(n, ast.If))
    assert ast.unparse(branch.test) == "standin_enabled()"
    top_imports = {a.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert "torch" not in top_imports
    assert any(isinstance(n, ast.Import) and n.names[0].name == "torch" for n in ast.walk(branch))
