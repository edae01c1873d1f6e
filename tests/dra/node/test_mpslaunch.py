"""``dra.node.mpslaunch`` joining a host cgroup (``--cgroup-root``/``--cgroup``) on cgroup trees laid out as the
kernel offers them (v2: one hierarchy at the root; v1: one per directory, with ``cpu,cpuacct`` style links), and
what it does with ``--cgroupns``. The real kernel's side is proven on a real node (tests/e2e/test_helm_realnode.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dra.node.mpslaunch import LaunchError, cgroup_hierarchies, enter_cgroup_namespace, join_cgroup
from dra.node.sharingtools import MpsDaemonSpec, NvidiaSmiSharingControl


def launch(*options: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dra.node.mpslaunch", *options, "--", "sh", "-c", f"echo $$ > {out}"],
                          capture_output=True, text=True, timeout=30)


def v1_tree(root: Path) -> Path:
    for name in ("cpu", "cpuset", "memory", "systemd"):
        (root / name).mkdir(parents=True)
        (root / name / "cgroup.procs").write_text("")
    (root / "cpuset" / "cpuset.cpus").write_text("0-3\n")
    (root / "cpu,cpuacct").symlink_to("cpu")      # a link to a hierarchy, not one more
    (root / "not-a-hierarchy").mkdir()
    return root


def test_the_daemon_joins_the_cgroup_in_every_v1_hierarchy_created_where_missing(tmp_path: Path) -> None:
    root = v1_tree(tmp_path / "cgroup")
    assert [h.name for h in cgroup_hierarchies(root)] == ["cpu", "cpuset", "memory", "systemd"]
    (root / "memory" / "gpu-dra-mps").mkdir()                   # already there in one hierarchy: kept
    out = tmp_path / "pid"
    done = launch("--cgroup-root", str(root), "--cgroup", "/gpu-dra-mps", out=out)
    assert done.returncode == 0, done.stderr
    pid = out.read_text().strip()
    for hierarchy in ("cpu", "cpuset", "memory", "systemd"):
        assert (root / hierarchy / "gpu-dra-mps" / "cgroup.procs").read_text() == pid, hierarchy
    assert not (root / "not-a-hierarchy" / "gpu-dra-mps").exists()


def test_a_v1_cpuset_gets_its_parents_cpus_and_nested_cgroups_are_made(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    root = v1_tree(tmp_path / "cgroup")
    (root / "cpuset" / "cpuset.mems").write_text("0\n")
    real_mkdir = Path.mkdir
    made = []

    def mkdir(self: Path, *args: object, **kwargs: object) -> None:
        """As the kernel makes a cgroup: its files come with it, a v1 cpuset's CPUs and memory nodes empty."""
        real_mkdir(self, *args, **kwargs)   # type: ignore[arg-type]
        made.append(self)
        if (self.parent / "cpuset.cpus").exists():
            (self / "cpuset.cpus").write_text("")
            (self / "cpuset.mems").write_text("")
        (self / "cgroup.procs").write_text("")

    monkeypatch.setattr(Path, "mkdir", mkdir)
    join_cgroup(str(root), "node/gpu-dra-mps")
    monkeypatch.undo()
    assert (root / "cpuset" / "node" / "cpuset.cpus").read_text() == "0-3\n"
    assert (root / "cpuset" / "node" / "gpu-dra-mps" / "cpuset.cpus").read_text() == "0-3\n"
    assert (root / "cpuset" / "node" / "gpu-dra-mps" / "cpuset.mems").read_text() == "0\n"
    assert (root / "cpu" / "node" / "gpu-dra-mps" / "cgroup.procs").read_text() == str(os.getpid())
    assert (root / "cpu" / "node" / "cgroup.procs").read_text() == ""      # only the leaf holds the process
    assert len(made) == 8    # two levels in each of the four hierarchies


def test_v2_the_root_is_the_one_hierarchy_and_a_cgroup_with_child_controllers_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.procs").write_text("")
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "cpu").mkdir()                      # a cgroup named like a v1 hierarchy is not one here
    (root / "cpu" / "cgroup.procs").write_text("")
    assert cgroup_hierarchies(root) == [root]
    out = tmp_path / "pid"
    done = launch("--cgroup-root", str(root), "--cgroup", "gpu-dra-mps", out=out)
    assert done.returncode == 0, done.stderr
    assert (root / "gpu-dra-mps" / "cgroup.procs").read_text() == out.read_text().strip()
    # "No internal processes": a cgroup that enables controllers for its children cannot hold the daemon.
    (root / "busy").mkdir()
    (root / "busy" / "cgroup.subtree_control").write_text("memory\n")
    done = launch("--cgroup-root", str(root), "--cgroup", "busy", out=tmp_path / "never")
    assert done.returncode == 1 and "no-internal-processes rule" in done.stderr, done.stderr
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("path", ["", "/", "../x", "a/./b", "a/../../b"])
def test_a_cgroup_outside_or_at_the_root_is_refused(tmp_path: Path, path: str) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.procs").write_text("")
    with pytest.raises(LaunchError, match="must name a cgroup below the root"):
        join_cgroup(str(root), path)
    assert sorted(p.name for p in root.iterdir()) == ["cgroup.procs"]


def test_a_root_without_hierarchies_says_so(tmp_path: Path) -> None:
    done = launch("--cgroup-root", str(tmp_path), "--cgroup", "gpu-dra-mps", out=tmp_path / "never")
    assert done.returncode == 1 and "no cgroup hierarchy is mounted there" in done.stderr, done.stderr


def test_the_cgroup_namespace_is_entered_only_when_it_is_another(tmp_path: Path) -> None:
    # Its own namespace: nothing to do (no setns, no privilege needed).
    assert enter_cgroup_namespace("/proc/self/ns/cgroup") == ""
    # A namespace file that cannot be opened: it goes on in its own, and says so for a later error message.
    note = enter_cgroup_namespace(str(tmp_path / "missing"))
    assert "could not be opened" in note and "ran in its own" in note
    # ... and the launcher still joins the cgroup.
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.procs").write_text("")
    out = tmp_path / "pid"
    done = launch("--cgroupns", str(tmp_path / "missing"), "--cgroup-root", str(root), "--cgroup", "mps", out=out)
    assert done.returncode == 0, done.stderr
    assert (root / "mps" / "cgroup.procs").read_text() == out.read_text().strip()


def test_the_plugin_tells_the_launcher_the_cgroup_and_pid_1s_namespace(tmp_path: Path) -> None:
    calls = []

    def runner(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 1, "", "")

    control = NvidiaSmiSharingControl(mps_control="mps", cgroup="gpu-dra-mps", cgroup_root="/host/sys/fs/cgroup",
                                      proc_root=str(tmp_path), runner=runner, isolate_shm=False)
    (tmp_path / "log").mkdir()
    with pytest.raises(Exception, match="exited with 1"):
        control.start_mps_daemon(MpsDaemonSpec(str(tmp_path / "pipe"), str(tmp_path / "log"), ("GPU-0",)))
    argv, = calls
    assert argv[1:] == ["-I", "-m", "dra.node.mpslaunch", "--cgroupns", f"{tmp_path}/1/ns/cgroup",
                        "--cgroup-root", "/host/sys/fs/cgroup", "--cgroup", "gpu-dra-mps", "--", "mps", "-d"]
    # Without a cgroup the daemon is started as before: no launcher options about cgroups.
    calls.clear()
    plain = NvidiaSmiSharingControl(mps_control="mps", proc_root=str(tmp_path), runner=runner, isolate_shm=False)
    with pytest.raises(Exception, match="exited with 1"):
        plain.start_mps_daemon(MpsDaemonSpec(str(tmp_path / "pipe"), str(tmp_path / "log"), ("GPU-0",)))
    assert calls == [["mps", "-d"]]
