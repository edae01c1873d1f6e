"""What workload containers can write is never followed by the privileged plugin: every directory an MPS
claim's CDI spec mounts into its container is filled with symlinks to a victim file, hard junk and planted
names the plugin or the MPS tools use, and then the daemon is restarted, joined and stopped. The victim is
untouched, nothing appears outside the plugin's own directories, and the planted control socket is refused."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from driver_node import Node, gpu_config, ok, opaque
from standin.node import kill_mps_daemons_under, mps_daemons_under

from dra.node.sharingtools import NvidiaSmiSharingControl, SharingError
from dra.sim.mpscontrol import STATE_ENV, write_simulated_mps_control

PLANTED = ("control-start.out", "control.log", "control", "daemon.json", "nvidia-cuda-mps-control.pid", "log", "pipe")


@pytest.fixture
def node(tmp_path: Path):
    node = Node(tmp_path, {"default": {"wholeGpu": False, "slots": {"count": 2, "strategy": "mps"}}},
                state_file=tmp_path / "gpus.json")
    program = write_simulated_mps_control(tmp_path / "tools")
    node.control.mps = NvidiaSmiSharingControl(mps_control=str(program), env={STATE_ENV: str(tmp_path / "gpus.json")},
                                               timeout_s=10)
    node.driver = node.restart()
    yield node
    kill_mps_daemons_under(tmp_path)


def mounted_dirs(node: Node, ref) -> list[Path]:
    mounts = node.spec_of(ref)["devices"][0]["containerEdits"].get("mounts") or []
    return [Path(m["hostPath"]) for m in mounts if Path(m["hostPath"]).is_dir()]


def test_planted_links_and_junk_in_container_directories_are_never_followed(node: Node, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    ref = node.add_claim("a", [{"request": "s", "device": "gpu-0-slot-0"}],
                         [opaque(gpu_config(strategy="MPS", mps={"activeThreadPercentage": 50}))])
    ok(node.driver, ref)
    dirs = mounted_dirs(node, ref)
    assert dirs and all(node.state in d.parents for d in dirs)
    for directory in dirs:                                    # what a hostile container can do there
        for name in PLANTED:
            target = directory / name
            if target.is_socket():
                continue                                      # the daemon's live control socket stays
            if target.is_dir():
                continue
            target.unlink(missing_ok=True)
            target.symlink_to(victim)
        (directory / "junk").write_bytes(os.urandom(256))
        (directory / "subdir").mkdir()
        (directory / "subdir" / "escape").symlink_to(tmp_path)
    outside_before = sorted(p.name for p in tmp_path.iterdir())

    # The daemon dies; the supervisor starts it again (writing its start output), a second claim joins it,
    # and both claims leave (the daemon is stopped and its directories removed).
    kill_mps_daemons_under(tmp_path)
    assert node.driver.supervise_mps() == [node.uuids[0]]
    other = node.add_claim("b", [{"request": "s", "device": "gpu-0-slot-1"}])
    ok(node.driver, other)
    results = node.driver.unprepare([ref, other])
    assert [r.error for r in results.values()] == ["", ""]
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == outside_before
    assert mps_daemons_under(tmp_path) == {}
    assert not any((node.state / "mps").glob("*"))


def test_a_planted_control_socket_is_refused(node: Node, tmp_path: Path) -> None:
    ref = node.add_claim("a", [{"request": "s", "device": "gpu-0-slot-0"}])
    ok(node.driver, ref)
    pipe = Path(node.driver.mps.paths(node.uuids[0]).pipe_dir)
    (pipe / "control").unlink()
    (pipe / "control").symlink_to(tmp_path / "somewhere-else")
    with pytest.raises(SharingError, match="replaced"):
        node.control.mps.mps_command(str(pipe), "get_server_list")


def test_starting_a_daemon_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    """The attack as it was: a link planted where the plugin writes the daemon's start output (once a directory
    containers could write) must not truncate the file it points to."""
    victim = tmp_path / "checkpoint.json"
    victim.write_text("precious")
    log_dir, pipe_dir = tmp_path / "log", tmp_path / "pipe"
    log_dir.mkdir()
    pipe_dir.mkdir()
    (log_dir / "control-start.out").symlink_to(victim)
    tools = NvidiaSmiSharingControl(mps_control="/bin/true", timeout_s=0.5, isolate_shm=False)
    from dra.node.sharingtools import MpsDaemonSpec

    with pytest.raises(SharingError):
        tools.start_mps_daemon(MpsDaemonSpec(str(pipe_dir), str(log_dir), ("GPU-0",)))
    assert victim.read_text() == "precious"


def test_the_launcher_moves_the_daemon_out_of_the_plugin_cgroup_before_it_runs(tmp_path: Path) -> None:
    import subprocess
    import sys

    procs = tmp_path / "cgroup.procs"            # a cgroup's process list, as the kernel offers it
    procs.write_text("")
    out = tmp_path / "pid"
    done = subprocess.run([sys.executable, "-m", "dra.node.mpslaunch", "--cgroup-procs", str(procs), "--",
                           "sh", "-c", f"echo $$ > {out}"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert procs.read_text() == out.read_text().strip()      # the same process, moved, then the program ran
    bad = subprocess.run([sys.executable, "-m", "dra.node.mpslaunch", "--cgroup-procs", str(tmp_path / "no" / "x"),
                          "--", "true"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "cannot move into cgroup" in bad.stderr
