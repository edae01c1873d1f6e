"""The driver's LD_LIBRARY_PATH reaches the driver's MPS control program only, never the image's Python that
launches it: a host whose library folder holds its own libc or libm (another version than the image's) would
otherwise break the launcher before the daemon starts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.fake_driver_root import LIB_DIR, build_fake_driver_root

from dra.node.mpslaunch import main as mpslaunch_main
from dra.node.sharingtools import MpsDaemonSpec, NvidiaSmiSharingControl, SharingError


def host_with_foreign_libm(tmp_path: Path):
    """A driver root whose library folder also holds a libm.so.6 the image's Python cannot load (as a host's libm
    of another version would be); /bin/sh needs only libc, so the driver's (shell) programs still run."""
    tree = build_fake_driver_root(tmp_path / "host")
    libs = tree.root / LIB_DIR
    (libs / "libc.so.6").unlink()
    (libs / "libm.so.6").write_bytes(b"\x7fELF not this image's libm")
    seen = tmp_path / "program-env"
    program = tree.root / "usr/bin/nvidia-cuda-mps-control"
    program.write_text(f"#!/bin/sh\necho \"LD_LIBRARY_PATH=$LD_LIBRARY_PATH\" > {seen}\n")
    program.chmod(0o755)
    return tree, seen


def test_launcher_runs_without_the_driver_library_path_and_the_program_gets_it(tmp_path: Path) -> None:
    tree, seen = host_with_foreign_libm(tmp_path)
    # The foreign libm is fatal to the image's Python under that path (what the launcher used to run with).
    broken = subprocess.run([sys.executable, "-c", "pass"], env={"LD_LIBRARY_PATH": str(tree.root / LIB_DIR)},
                            capture_output=True, text=True)
    assert broken.returncode != 0 and "libm.so.6" in broken.stderr
    # cgroup_procs makes the start go through the launcher without privileges (a plain file takes the PID); an
    # empty /proc shows no daemon.
    (tmp_path / "no-proc").mkdir()
    control = NvidiaSmiSharingControl.from_driver_root(
        tree.driver_root(), isolate_shm=False, cgroup_procs=[str(tmp_path / "cgroup.procs")],
        proc_root=str(tmp_path / "no-proc"), timeout_s=1.0)
    assert control.extra_env["LD_LIBRARY_PATH"] == str(tree.root / LIB_DIR)
    (tmp_path / "pipe").mkdir()
    (tmp_path / "log").mkdir()
    spec = MpsDaemonSpec(pipe_dir=str(tmp_path / "pipe"), log_dir=str(tmp_path / "log"), visible_devices=("GPU-0",))
    # The stand-in program exits without starting a daemon: the start fails only for that, after the program ran.
    with pytest.raises(SharingError, match="did not come up"):
        control.start_mps_daemon(spec)
    assert seen.read_text().strip() == f"LD_LIBRARY_PATH={tree.root / LIB_DIR}"
    assert (tmp_path / "cgroup.procs").read_text().strip().isdigit()     # the launcher ran


def test_launcher_sets_exec_env_for_the_program_only(tmp_path: Path, capfd) -> None:
    out = tmp_path / "out"
    rc = subprocess.run([sys.executable, "-m", "dra.node.mpslaunch", "--exec-env", "GPU_DRA_PROBE=x=1", "--",
                         "/bin/sh", "-c", f"echo \"$GPU_DRA_PROBE\" > {out}"], env={"PATH": "/usr/bin:/bin"},
                        cwd=Path(__file__).resolve().parents[3]).returncode
    assert rc == 0 and out.read_text().strip() == "x=1"


def test_launcher_refuses_a_malformed_exec_env(capsys) -> None:
    assert mpslaunch_main(["--exec-env", "NOVALUE", "--", "/bin/true"]) == 1
    assert "--exec-env 'NOVALUE': must be NAME=VALUE" in capsys.readouterr().err
