"""MPS between tenants who do not trust each other: what a container gets (a read-only pipe directory, no MPS
control programs), who may share a daemon (one namespace unless the node policy says otherwise), what a claim
config may ask of a slot (no more than its share), how a daemon is recognised (the process the plugin started,
never a look-alike) and what happens when its record on disk is damaged (rebuilt, never trusted)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from driver_node import SLOTS, Node, gpu_config, ok, opaque, slot_claim
from standin.node import kill_mps_daemons_under

from dra.model.policy import MpsNodePolicy
from dra.node import tmpfs
from dra.node.cdi import CdiSpecWriter
from dra.node.processidentity import ProcessIdentity, identify, is_alive, send_signal, wait_gone
from dra.node.sharing import MpsDaemons
from dra.node.sharingtools import NvidiaSmiSharingControl
from dra.sim.mpscontrol import STATE_ENV, write_simulated_mps_control
from dra.sim.sharingtools import SimulatedSharingControl


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path, {"default": SLOTS})


@pytest.fixture
def real_node(tmp_path: Path):
    """Daemons are real processes of the simulated nvidia-cuda-mps-control (it writes its PID file and log into
    the pipe directory, following links, as NVIDIA's does)."""
    node = Node(tmp_path, {"default": SLOTS}, state_file=tmp_path / "gpus.json")
    program = write_simulated_mps_control(tmp_path / "tools")
    node.control.mps = NvidiaSmiSharingControl(mps_control=str(program), env={STATE_ENV: str(tmp_path / "gpus.json")},
                                               timeout_s=10)
    node.driver = node.restart()
    yield node
    kill_mps_daemons_under(tmp_path)


# ----- what a client container gets ---------------------------------------------------------------------------------
def test_client_containers_get_the_pipe_directory_read_only_and_no_mps_control_program(node: Node) -> None:
    ref = slot_claim(node, "a", 0)
    ok(node.driver, ref)
    spec = node.spec_of(ref)
    paths = node.driver.mps.paths(node.uuids[0])
    mounts = {m["hostPath"]: m for m in spec["devices"][0]["containerEdits"]["mounts"]}
    assert "ro" in mounts[paths.pipe_dir]["options"] and "rw" not in mounts[paths.pipe_dir]["options"]
    assert "rw" in mounts[paths.shm_dir]["options"]           # clients create their shared memory there
    programs = {os.path.basename(m["containerPath"]) for m in spec["containerEdits"]["mounts"]}
    assert "nvidia-smi" in programs
    assert not programs & {"nvidia-cuda-mps-control", "nvidia-cuda-mps-server"}


def test_the_node_policy_can_give_containers_the_mps_control_program(tmp_path: Path) -> None:
    node = Node(tmp_path, {"default": SLOTS, "mps": {"controlInContainers": True}})
    node.driver.cdi = CdiSpecWriter(node.cdi_dir, node.tree.driver_root(),
                                    mps_tools=node.policy.mps.control_in_containers)   # as the plugin builds it
    ref = slot_claim(node, "a", 0)
    ok(node.driver, ref)
    programs = {os.path.basename(m["containerPath"]) for m in node.spec_of(ref)["containerEdits"]["mounts"]}
    assert "nvidia-cuda-mps-control" in programs


# ----- tenancy ------------------------------------------------------------------------------------------------------
def test_a_daemon_serves_one_namespace_and_another_namespace_waits_for_it(node: Node) -> None:
    a = slot_claim(node, "a", 0, namespace="team-a")
    ok(node.driver, a)
    b = slot_claim(node, "b", 1, namespace="team-b")
    error = node.driver.prepare([b])[b.uid].error
    assert "serves namespace 'team-a' (claim a)" in error and "mps.shareAcrossNamespaces" in error
    assert node.driver.checkpoint.get(b.uid) is None or not node.driver.checkpoint.get(b.uid).completed
    same = slot_claim(node, "a2", 2, namespace="team-a")
    ok(node.driver, same)                                     # the same namespace joins
    other_gpu = slot_claim(node, "b2", 0, namespace="team-b", gpu=1)
    ok(node.driver, other_gpu)                                # another GPU has its own daemon
    node.driver.unprepare([a, same])
    ok(node.driver, b)                                        # the kubelet's retry succeeds once A has left
    assert node.driver.mps.records()[node.uuids[0]].daemon is not None


def test_the_node_policy_can_share_a_daemon_across_namespaces(tmp_path: Path) -> None:
    node = Node(tmp_path, {"default": SLOTS, "mps": {"shareAcrossNamespaces": True}})
    ok(node.driver, slot_claim(node, "a", 0, namespace="team-a"))
    ok(node.driver, slot_claim(node, "b", 1, namespace="team-b"))
    assert len([d for d in node.control.daemons.values() if d.alive]) == 1


# ----- a slot's share -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mps, words", [
    ({"activeThreadPercentage": 100}, "activeThreadPercentage 100 exceeds the slot's share of 25 %"),
    ({"pinnedMemoryLimit": "80Gi"}, "pinned memory limit 81920Mi exceeds the slot's share of"),
])
def test_a_config_cannot_raise_a_slot_above_its_share(node: Node, mps: dict, words: str) -> None:
    ref = slot_claim(node, "greedy", 0, config=[opaque(gpu_config(strategy="MPS", mps=mps))])
    error = node.driver.prepare([ref])[ref.uid].error
    assert words in error and "config[0]" in error
    assert not [d for d in node.control.daemons.values() if d.alive]


def test_a_config_may_lower_a_slot_and_the_policy_may_allow_more(tmp_path: Path, node: Node) -> None:
    ref = slot_claim(node, "modest", 0, config=[opaque(gpu_config(strategy="MPS", mps={
        "activeThreadPercentage": 10, "pinnedMemoryLimit": "1Gi"}))])
    ok(node.driver, ref)
    generous = Node(tmp_path / "generous", {"default": SLOTS, "mps": {"limitsAboveShare": True}})
    big = slot_claim(generous, "big", 0, config=[opaque(gpu_config(strategy="MPS", mps={"activeThreadPercentage": 100}))])
    ok(generous.driver, big)


# ----- which process is the daemon ----------------------------------------------------------------------------------
def forged_daemon(pipe_dir: str) -> subprocess.Popen:
    """What any pod with the host's PID namespace can start: a process named like the daemon, with ``-d`` and our
    pipe directory in its environment (the GPU UUID, and so the directory, is public)."""
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir)
    return subprocess.Popen(["nvidia-cuda-mps-control", "-d", "-c", "import time; time.sleep(120)"],
                            executable=sys.executable, env=env)


def test_a_process_that_only_looks_like_the_daemon_is_ignored(real_node: Node) -> None:
    pipe = real_node.driver.mps.paths(real_node.uuids[0]).pipe_dir
    fake = forged_daemon(pipe)
    try:
        ref = slot_claim(real_node, "a", 0)
        ok(real_node.driver, ref)
        record = real_node.driver.mps.records()[real_node.uuids[0]]
        assert record.daemon is not None and record.daemon.pid != fake.pid and is_alive(record.daemon)
        assert real_node.control.compute_mode(real_node.uuids[0]) == "EXCLUSIVE_PROCESS"
        assert (Path(pipe) / "control").is_socket()
        started = time.monotonic()
        assert real_node.driver.unprepare([ref])[ref.uid].error == ""
        assert time.monotonic() - started < 10                  # no wait for a process that never quits
        assert not is_alive(record.daemon)
        assert fake.poll() is None                              # never signalled
    finally:
        fake.kill()
        fake.wait()


def test_signals_reach_only_the_recorded_process(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ident = identify(child.pid)
        assert ident is not None and is_alive(ident)
        reused = ProcessIdentity(pid=child.pid, start_time=ident.start_time - 1)   # the PID, another life
        assert not is_alive(reused) and send_signal(reused, signal.SIGKILL) is False
        assert child.poll() is None
        assert send_signal(ident, signal.SIGTERM) and wait_gone(ident, 10)
    finally:
        child.kill()
        child.wait()


# ----- damaged records ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["garbage", "deleted", "link", "other-device", "no-process"])
def test_a_damaged_daemon_record_is_never_trusted_and_its_daemon_restarted(node: Node, tmp_path: Path,
                                                                           damage: str) -> None:
    """A record that is not ours, names another device or names no process: the daemon of its directory is
    stopped through its control socket and started again, with its identity recorded; the other device's daemon
    and the file a link points at are untouched."""
    gpu0, gpu1 = node.uuids
    a, b = slot_claim(node, "a", 0), slot_claim(node, "b", 0, gpu=1)
    ok(node.driver, a)
    ok(node.driver, b)
    mps = node.driver.mps
    record = mps.paths(gpu0).record
    victim = tmp_path / "victim"
    victim.write_text("precious")
    if damage == "garbage":
        record.write_bytes(b"\x00not json")
    elif damage == "deleted":
        record.unlink()
    elif damage == "link":
        record.unlink()
        record.symlink_to(victim)
    elif damage == "other-device":                            # names GPU 1: its daemon must not be stopped for A
        record.write_bytes(mps.paths(gpu1).record.read_bytes())
    else:                                                     # an older release's record, or a start cut short
        record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "daemon"}))
    pipe0, pipe1 = mps.paths(gpu0).pipe_dir, mps.paths(gpu1).pipe_dir
    daemon0, daemon1 = (node.control.daemons[p].identity for p in (pipe0, pipe1))
    assert node.driver.supervise_mps() == [gpu0]
    restarted = mps.records()[gpu0].daemon
    assert restarted is not None and restarted != daemon0 and node.control.mps_daemon_running(pipe0, restarted)
    assert not node.control.mps_daemon_running(pipe0, daemon0)
    assert node.control.mps_daemon_running(pipe1, daemon1)
    assert node.driver.supervise_mps() == []                 # the new record is trusted
    assert victim.read_text() == "precious"
    assert node.driver.unprepare([a])[a.uid].error == ""
    assert not node.control.mps_daemon_running(pipe0, restarted)
    assert node.control.compute_mode(gpu0) == "DEFAULT"     # back from EXCLUSIVE_PROCESS
    assert mps.records()[gpu1].daemon == daemon1 and node.control.mps_daemon_running(pipe1, daemon1)
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("damage", ["missing", "foreign"])
def test_a_missing_or_foreign_record_is_one_log_line_as_documented(node: Node, caplog: pytest.LogCaptureFixture,
                                                                   damage: str) -> None:
    """docs/failure-modes.md quotes the line; the plugin logs exactly that, once."""
    gpu0, gpu1 = node.uuids
    ok(node.driver, slot_claim(node, "a", 0))
    ok(node.driver, slot_claim(node, "b", 0, gpu=1))
    mps = node.driver.mps
    record = mps.paths(gpu0).record
    if damage == "missing":
        record.unlink()
        problem = "is missing"
    else:
        record.write_bytes(mps.paths(gpu1).record.read_bytes())
        problem = f"names device {gpu1!r}, whose daemon directory is not {mps.paths(gpu0).base.name}"
    caplog.clear()
    with caplog.at_level("INFO", logger="dra.node.sharing"):
        assert node.driver.supervise_mps() == [gpu0]
    lines = [r.getMessage() for r in caplog.records if r.name == "dra.node.sharing"]
    assert lines == [f"MPS daemon record {record} {problem}: not trusted, no process is taken for its daemon; "
                     "the daemon is started again"], lines
    documented = lines[0].replace(str(record), "<state dir>/mps/<device hash>/daemon.json").replace(
        mps.paths(gpu0).base.name, "<device hash>").replace(gpu1, "<other device>")
    docs = (Path(__file__).resolve().parents[3] / "docs" / "failure-modes.md").read_text()
    assert f"`{documented}`" in docs, documented


@pytest.mark.parametrize("cut_short", [False, True], ids=["stale-pid-file", "start-cut-short"])
def test_a_record_without_a_process_never_adopts_a_look_alike(real_node: Node, cut_short: bool) -> None:
    """A record that names no process (an older release's, or one whose start was cut short before the identity
    was written): the PID file in the pipe directory names a process that looks like the daemon (a PID reused
    after the daemon died, by a process any pod with the host's PID namespace can start). It is never taken for
    the daemon: the daemon is started again, and the look-alike is never signalled."""
    gpu0 = real_node.uuids[0]
    ok(real_node.driver, slot_claim(real_node, "a", 0))
    mps = real_node.driver.mps
    paths = mps.paths(gpu0)
    before = mps.records()[gpu0].daemon
    assert before is not None
    paths.record.write_text(json.dumps({k: v for k, v in json.loads(paths.record.read_text()).items()
                                        if k != "daemon"}))
    if not cut_short:
        assert send_signal(before, signal.SIGKILL) and wait_gone(before, 10)
    fake = forged_daemon(paths.pipe_dir)
    try:
        # The PID file names the look-alike (the daemon's PID, reused); with the start cut short, the daemon
        # still runs beside it.
        (Path(paths.pipe_dir) / "nvidia-cuda-mps-control.pid").write_text(str(fake.pid))
        assert real_node.driver.supervise_mps() == [gpu0]
        after = mps.records()[gpu0].daemon
        assert after is not None and after.pid not in (fake.pid, before.pid) and is_alive(after)
        assert not is_alive(before)                           # quit through its control socket when it ran
        assert fake.poll() is None                            # never signalled
        assert real_node.driver.supervise_mps() == []
    finally:
        fake.kill()
        fake.wait()


def test_a_dead_daemon_with_a_damaged_record_is_restarted(node: Node) -> None:
    ref = slot_claim(node, "a", 0)
    ok(node.driver, ref)
    paths = node.driver.mps.paths(node.uuids[0])
    node.control.kill_mps_daemon(paths.pipe_dir)
    paths.record.write_text("{}")
    assert node.driver.supervise_mps() == [node.uuids[0]]
    assert node.driver.mps.running(node.uuids[0])


def test_an_unknown_daemon_directory_is_removed_at_start(node: Node) -> None:
    stray = node.driver.mps.root / "0123456789ab"
    (stray / "pipe").mkdir(parents=True)
    (stray / "daemon.json").write_text(json.dumps({"device": "GPU-elsewhere", "gpu": "GPU-elsewhere",
                                                   "computeModeSet": True}))
    node.restart()
    assert not stray.exists()


# ----- shared memory --------------------------------------------------------------------------------------------
def test_each_daemon_gets_a_size_limited_tmpfs_as_shm(tmp_path: Path) -> None:
    control = SimulatedSharingControl()
    mps = MpsDaemons(control, tmp_path, policy=MpsNodePolicy(shm_size="8Mi"), mount_shm=True)
    gpu = "GPU-00000000-0000-0000-0000-000000000001"
    paths = mps.paths(gpu)
    try:
        mps.ensure(gpu, gpu)
        assert tmpfs.is_mountpoint(paths.shm_dir)
        fs = os.statvfs(paths.shm_dir)
        assert fs.f_blocks * fs.f_frsize == 8 << 20
        (Path(paths.shm_dir) / "left-by-a-client").write_text("x")
        control.kill_mps_daemon(paths.pipe_dir)
        assert mps.supervise({gpu: gpu}) == [gpu]
        assert tmpfs.is_mountpoint(paths.shm_dir)            # the same mount: running containers keep it
        assert list(Path(paths.shm_dir).iterdir()) == []     # emptied before the new daemon
        mps.release(gpu, gpu)
        assert not paths.base.exists()
    finally:
        if tmpfs.is_mountpoint(paths.shm_dir):
            tmpfs.unmount(paths.shm_dir)
