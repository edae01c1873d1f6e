"""The local control plane itself: components up, simulated nodes schedulable, clean teardown, loud failures."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as kclient

from testbed.localcluster import BIN_ENV, COMPONENTS, ClusterError, LocalCluster, find_binaries, pinned_version

pytestmark = pytest.mark.e2e


def test_components_run_and_simulated_nodes_are_ready_and_untainted(cluster: Any, driver_name: str) -> None:
    cluster.check_running()
    name = driver_name.split(".")[0] + "-plain"
    cluster.add_node(name, {"example.com/rack": "r1"})
    node = kclient.CoreV1Api(cluster.api_client()).read_node(name)
    assert not node.spec.taints
    assert node.status.allocatable == {"cpu": "64", "memory": "512Gi", "pods": "110"}
    assert [(c.type, c.status) for c in node.status.conditions] == [("Ready", "True")]
    assert node.metadata.labels["example.com/rack"] == "r1"
    assert name in cluster.kubectl("get", "nodes", "-o", "name").stdout
    assert kclient.VersionApi(cluster.api_client()).get_code().git_version == pinned_version("K8S_VERSION")


def test_teardown_kills_every_component_and_removes_the_work_dir(cluster: Any) -> None:
    second = LocalCluster(bin_dir=cluster.bin_dir).start()
    pids = [c.proc.pid for c in second._components.values()]
    workdir = second.workdir
    assert workdir is not None and workdir.is_dir() and len(pids) == 4
    second.stop()
    assert not workdir.exists()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_failing_component_is_reported_with_its_log(cluster: Any, tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    for c in COMPONENTS:
        if c != "etcd":
            (fake / c).symlink_to(cluster.bin_dir / c)
    (fake / "etcd").write_text("#!/bin/sh\necho 'etcd: simulated start-up failure' >&2\nexit 3\n")
    (fake / "etcd").chmod(0o755)
    broken = LocalCluster(bin_dir=fake)
    with pytest.raises(ClusterError, match=r"(?s)etcd exited with 3.*simulated start-up failure"):
        broken.start()
    assert broken.workdir is None


def test_missing_binaries_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(BIN_ENV, str(tmp_path))
    with pytest.raises(ClusterError, match="lacks executables: etcd, kube-apiserver, kube-scheduler, "
                                           "kube-controller-manager, kubectl"):
        find_binaries()
