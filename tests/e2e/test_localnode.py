"""The real node: a kubelet, containerd and runc built from their Go modules run pods of the busybox test
image on a local control plane, keep them through a kubelet restart, stop them when they are deleted, and
leave the machine as found, after a clean stop and after the process that started the node was killed."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.hostplumbing import (
    cgroup_dirs,
    cgroup_pids,
    cleanup_leftovers,
    mounts_under,
    processes_mentioning,
    read_sysctl,
    records_dir,
)
from testbed.localcluster import ClusterError, LocalCluster
from testbed.localnode import HOST_PATHS, NODE_BINARIES, SYSCTLS, LocalNode, NodeError, find_node_binaries

pytestmark = pytest.mark.e2e

_REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def node_cluster() -> Iterator[LocalCluster]:
    """A control plane of this module's own: a real node runs any pod bound to it, so it stays apart from the
    session cluster's simulated nodes and their pods."""
    try:
        cleanup_leftovers()
        find_node_binaries()
        cluster = LocalCluster().start()
    except ClusterError as exc:  # NodeError included
        pytest.fail(f"cannot prepare the real-node tests: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


def start_node(cluster: LocalCluster, tmp_path: Path, **kw: Any) -> LocalNode:
    node = LocalNode(cluster, cdi_dirs=[tmp_path / "cdi"], **kw)
    try:
        node.start()
    except NodeError as exc:
        pytest.fail(f"the real node did not start: {exc}", pytrace=False)
    return node


def create_pod(cluster: LocalCluster, manifest: dict[str, Any]) -> None:
    ns = manifest["metadata"]["namespace"]
    cluster.request("POST", f"/api/v1/namespaces/{ns}/pods", manifest)


def delete_pod(cluster: LocalCluster, namespace: str, name: str) -> None:
    cluster.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}")


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def host_state() -> dict[str, Any]:
    """What a node may change on the host outside its work dir."""
    return {"sysctls": {k: read_sysctl(k) for k in SYSCTLS},
            "paths": {p: os.path.lexists(p) for p in (*HOST_PATHS, str(records_dir()))}}


def node_binary_processes() -> list[str]:
    """Processes running one of the node binaries (kubelet, containerd, shims, runc) from the build cache."""
    bins = {os.path.realpath(find_node_binaries(build=False) / b) for b in NODE_BINARIES}
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and pid_alive(int(entry.name)):
            try:
                exe = os.path.realpath(entry / "exe")
            except OSError:
                continue
            if exe in bins:
                found.append(f"{entry.name} {exe}")
    return found


def leftovers(workdir: Path, cgroup_root: str, task_pids: list[int]) -> list[str]:
    """Everything of a stopped node still on the machine, as readable lines (empty when clean)."""
    left = [f"process {p} mentions the work dir" for p in processes_mentioning(f"{workdir}/")]
    left += [f"node binary running: {p}" for p in node_binary_processes()]
    left += [f"container process {p} alive" for p in task_pids if pid_alive(p)]
    left += [f"mounted: {m}" for m in mounts_under(workdir)]
    left += [f"cgroup: {d}" for d in cgroup_dirs(cgroup_root)]
    left += [f"process {p} in the node's cgroups" for p in cgroup_pids(cgroup_root)]
    if workdir.exists():
        left.append(f"work dir {workdir} exists")
    return left


# ---- pods on a node shared by these tests -----------------------------------------------------------


@pytest.fixture(scope="class")
def node(node_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    """A node named after the host (when its name resolves here) for the tests of one class; stopped after."""
    node = start_node(node_cluster, tmp_path_factory.mktemp("pods"))
    yield node
    node.stop()


class TestPods:
    def test_a_pod_runs_and_its_container_output_is_readable(self, node_cluster: LocalCluster, node: LocalNode) -> None:
        create_pod(node_cluster, node.pod_manifest(
            "hello", ["sh", "-c", "echo hello from busybox; ls /dev; env"], env={"GREETING": "from-the-pod-spec"}))
        pod = node.wait_pod("default", "hello", {"Succeeded"})
        assert pod["spec"]["nodeName"] == node.name
        out = node.container_log("default", "hello")
        lines = out.splitlines()
        assert lines[0] == "hello from busybox"
        assert {"null", "zero", "urandom", "termination-log"} <= set(lines)
        assert "GREETING=from-the-pod-spec" in lines
        assert "KUBERNETES_SERVICE_HOST=10.0.0.1" in lines
        if node.serves_logs:
            # The node is named after a host name that resolves here: the API server reaches the kubelet.
            assert node_cluster.kubectl("logs", "hello").stdout == out
        delete_pod(node_cluster, "default", "hello")
        node.wait_pod_gone("default", "hello")

    def test_a_deleted_pod_is_gone_and_its_containers_stopped(self, node_cluster: LocalCluster,
                                                              node: LocalNode) -> None:
        before = node.running_tasks()
        create_pod(node_cluster, node.pod_manifest("sleeper", ["sleep", "3600"]))
        node.wait_pod("default", "sleeper", {"Running"})
        cid = node.container_ids("default", "sleeper")["main"]
        tasks = node.running_tasks()
        new = {t: p for t, p in tasks.items() if t not in before}
        assert cid in new and len(new) == 2, f"expected the container and its sandbox, got {new}"
        assert all(pid_alive(p) for p in new.values())
        assert Path(f"/proc/{new[cid]}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"3600"]

        delete_pod(node_cluster, "default", "sleeper")
        node.wait_pod_gone("default", "sleeper")
        assert not set(new) & set(node.running_tasks())
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in new.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in new.values() if pid_alive(p)]

    def test_restarting_the_kubelet_keeps_pods_running(self, node_cluster: LocalCluster, node: LocalNode) -> None:
        create_pod(node_cluster, node.pod_manifest("survivor", ["sleep", "3600"]))
        pod = node.wait_pod("default", "survivor", {"Running"})
        cid = node.container_ids("default", "survivor")["main"]
        pid = node.running_tasks()[cid]
        old_kubelet = node.kubelet_pid

        node.restart_kubelet(downtime=2.0)
        assert node.kubelet_pid not in (None, old_kubelet)
        # Give the new kubelet a few pod syncs to act on the pod if it wanted to.
        time.sleep(12)
        after = node_cluster.request("GET", "/api/v1/namespaces/default/pods/survivor")
        assert after["status"]["phase"] == "Running"
        assert after["metadata"]["uid"] == pod["metadata"]["uid"]
        status = after["status"]["containerStatuses"][0]
        assert status["restartCount"] == 0 and "running" in status["state"]
        assert status["containerID"] == f"containerd://{cid}"
        assert node.running_tasks().get(cid) == pid and pid_alive(pid)

        # The new kubelet owns the pod: deleting it stops the container.
        delete_pod(node_cluster, "default", "survivor")
        node.wait_pod_gone("default", "survivor")
        assert cid not in node.running_tasks()


# ---- teardown ---------------------------------------------------------------------------------------


def test_stop_leaves_the_machine_as_found(node_cluster: LocalCluster, tmp_path: Path) -> None:
    before = host_state()
    assert not node_binary_processes(), "a node from elsewhere is running: the comparison would be meaningless"
    node = start_node(node_cluster, tmp_path, name="teardown-node")
    workdir, cgroup_root, record = node.workdir, node.cgroup_root, node.record_path
    assert workdir is not None and record is not None and record.is_file()
    create_pod(node_cluster, node.pod_manifest("teardown-sleeper", ["sleep", "3600"]))
    node.wait_pod("default", "teardown-sleeper", {"Running"})
    task_pids = list(node.running_tasks().values())
    assert task_pids and mounts_under(workdir) and cgroup_dirs(cgroup_root)
    # The kubelet tunes the kernel at start-up (these values are its own) unless they already were so.
    assert read_sysctl("kernel.panic") == "10" and read_sysctl("vm.overcommit_memory") == "1"

    node.stop()
    assert leftovers(workdir, cgroup_root, task_pids) == []
    assert host_state() == before
    assert not record.exists()
    with pytest.raises(ClusterError, match="HTTP 404"):
        node_cluster.request("GET", "/api/v1/nodes/teardown-node")
    node_cluster.request("DELETE", "/api/v1/namespaces/default/pods/teardown-sleeper?gracePeriodSeconds=0")


_ABANDON = r"""
import json, sys, time
from pathlib import Path
from testbed.localcluster import LocalCluster
from testbed.localnode import LocalNode

spec = json.loads(sys.argv[1])
# The parent's running control plane, reached through its work dir, token and port.
cluster = LocalCluster(bin_dir=spec["bin_dir"], workdir=spec["workdir"])
cluster.workdir, cluster.token, cluster.ports = Path(spec["workdir"]), spec["token"], spec["ports"]
node = LocalNode(cluster, name="abandoned-node", cdi_dirs=[spec["cdi"]]).start()
cluster.request("POST", "/api/v1/namespaces/default/pods", node.pod_manifest("orphan", ["sleep", "3600"]))
node.wait_pod("default", "orphan", {"Running"})
print(json.dumps({"workdir": str(node.workdir), "cgroup_root": node.cgroup_root, "record": str(node.record_path),
                  "tasks": list(node.running_tasks().values())}), flush=True)
time.sleep(3600)
"""


def test_leftovers_of_a_killed_test_process_are_cleaned(node_cluster: LocalCluster, tmp_path: Path) -> None:
    before = host_state()
    spec = {"bin_dir": str(node_cluster.bin_dir), "workdir": str(node_cluster.workdir), "token": node_cluster.token,
            "ports": node_cluster.ports, "cdi": str(tmp_path / "cdi")}
    errors = tmp_path / "child.log"
    with open(errors, "w") as err:
        child = subprocess.Popen([sys.executable, "-c", _ABANDON, json.dumps(spec)], cwd=_REPO, text=True,
                                 stdout=subprocess.PIPE, stderr=err)
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 180)
        line = child.stdout.readline() if ready else ""
        if not line:
            pytest.fail(f"the node in the child process did not start:\n{errors.read_text()[-4000:]}", pytrace=False)
        info = json.loads(line)
    finally:
        # What a killed pytest leaves: the node's processes run on, nothing stopped them.
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        if child.stdout:
            child.stdout.close()
    workdir, cgroup_root, record = Path(info["workdir"]), info["cgroup_root"], Path(info["record"])
    try:
        assert record.is_file() and record.parent == records_dir()
        assert processes_mentioning(f"{workdir}/") and mounts_under(workdir) and cgroup_dirs(cgroup_root)
        assert all(pid_alive(p) for p in info["tasks"])

        assert cleanup_leftovers() == ["abandoned-node"]
        assert leftovers(workdir, cgroup_root, info["tasks"]) == []
        assert host_state() == before
        assert not record.exists()
        assert cleanup_leftovers() == []
    finally:
        # Cleaning up after a crash is about the machine; the API objects are the test's to remove.
        for path in ("/api/v1/nodes/abandoned-node", "/api/v1/namespaces/default/pods/orphan?gracePeriodSeconds=0"):
            try:
                node_cluster.request("DELETE", path)
            except ClusterError:
                pass
