"""README's `gpu-dra doctor` sample is what `python -m testbed.doctor_demo DIR` builds and doctor then prints:
the roots are built by the command the README names, and the output block is compared line by line (DIR
written as the README's /tmp/doctor-demo)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAMPLE_DIR = "/tmp/doctor-demo"


def _readme_sample() -> tuple[str, str]:
    """(the command, its output) of the README's doctor block."""
    text = (REPO / "README.md").read_text()
    block = text.split("```text\n$ gpu-dra doctor ", 1)[1].split("```", 1)[0]
    command, _, output = block.partition("\n")
    return "gpu-dra doctor " + command, output.rstrip("\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="the sample's container check runs as root (a private mount namespace)")
def test_the_readme_doctor_sample_is_reproduced_by_its_command(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "testbed.doctor_demo", str(tmp_path)], capture_output=True,
                           text=True, timeout=900, cwd=REPO)
    assert built.returncode == 0, built.stderr
    command, expected = _readme_sample()
    printed = built.stdout.strip().replace(str(tmp_path), SAMPLE_DIR)
    assert printed == command, (printed, command)
    words = shlex.split(built.stdout.strip())
    assert words[:2] == ["gpu-dra", "doctor"]
    ran = subprocess.run([sys.executable, "-m", "cli.main", *words[1:]], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert ran.returncode == 1, ran.stdout + ran.stderr          # the sample has no hook: two checks fail
    assert ran.stdout.rstrip("\n").replace(str(tmp_path), SAMPLE_DIR) == expected
