"""The layer contracts of pyproject.toml ([tool.importlinter]), checked with import-linter: processes on top,
then the operator tools, the Kubernetes client and the simulation, node actions beside the scheduler replica,
the pure model, the API types at the bottom."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "controller", "kubeletplugin", "ops", "kube", "dra", "api")
LINT = str(Path(sys.executable).with_name("lint-imports"))


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LINT, "--config", str(tree / "pyproject.toml"), "--no-cache"], cwd=tree,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(tree), "PATH": ""})


def _copy_tree(dst: Path) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_the_layers_hold() -> None:
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize("module, forbidden", [
    ("dra/model/gpu.py", "import dra.node.cdi"),             # the pure model reaching for node actions
    ("dra/node/cdi.py", "import dra.sim.fakenvml"),          # node actions depending on the simulation
    ("dra/node/checkpoint.py", "import kubernetes"),         # the core talking to the API server
    ("kube/client.py", "import kubeletplugin.driver"),       # the client reaching up into a process
    ("kube/connect.py", "import http.client"),               # an HTTP/1.1 client of our own instead of urllib3
    ("kubeletplugin/plan.py", "import controller.cluster"),  # one process importing the other
    ("kubeletplugin/transport/server.py", "import kubeletplugin.driver"),  # the transport past its NodeDriver seam
    ("dra/scheduling/poolview.py", "import kube.client"),    # the scheduler replica reading the API itself
    ("dra/scheduling/occupancy.py", "import dra.node.inventory"),  # the replica reaching for node actions
    ("dra/model/tenancy.py", "import dra.scheduling.devicefit"),   # the driver model on an operator tool's replica
    ("ops/explain/verdict.py", "import kubernetes"),         # the pure verdict talking to the API server
    ("ops/advise/sizing.py", "import kubernetes"),           # advise's pure sizing talking to the API server
    ("kube/client.py", "import ops.explain.reads"),          # the client reaching up into an operator tool
    ("kubeletplugin/transport/grpcserver.py", "import socket"),  # the transport serving sockets itself, not grpcio
    ("kubeletplugin/transport/server.py", "import http.client"),  # ... or framing HTTP of its own
])
def test_a_forbidden_import_breaks_a_contract(tmp_path: Path, module: str, forbidden: str) -> None:
    tree = _copy_tree(tmp_path)
    path = tree / module
    path.write_text(path.read_text() + f"\n{forbidden}  # added by the test\n")
    done = _lint(tree)
    assert done.returncode != 0, f"{forbidden} in {module} was not caught:\n{done.stdout}"
    assert "BROKEN" in done.stdout and forbidden.split()[-1].rsplit(".", 1)[0] in done.stdout
