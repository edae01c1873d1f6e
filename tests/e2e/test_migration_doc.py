"""docs/migration.md, run: every ```sh test:<step>``` block of the guide, in order, with bash against the real
control plane and a real node whose labels say what the device plugin world had (nvidia.com/gpu.present, the
device plugin and MIG config labels), with the inputs of examples/migration/ in the cluster (the device plugin's
and mig-parted's ConfigMaps) and on disk (the workloads' manifests, made runnable here with the cuda-probe image).

Between blocks the test does what the guide's untested commands do (helm install: the DeviceClasses, and the
kubelet plugin once the node is labelled gpu-dra/enabled=true, with the converted values' node policy and the
MIG state of the converted mig config; helm's DaemonSet leaving the node: the plugin stops) and checks what the
guide says to check.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from realnode_helpers import EXAMPLES, REPO, RealNode
from standin.workloads import node_slices, wait_until
from test_convert_migration import fleet_from, runnable

from api.names import DEFAULT_DRIVER_NAME

pytestmark = pytest.mark.e2e

GUIDE = REPO / "docs" / "migration.md"
STEPS = ["collect", "convert", "installed", "switch", "check-node", "workloads", "check-workloads",
         "rollback-workloads", "rollback-node", "check-rollback"]
_BLOCK = re.compile(r"^```sh(?: (\S+))?\n(.*?)^```$", re.M | re.S)
MIGRATION = EXAMPLES / "migration"


def blocks() -> list[tuple[str | None, str]]:
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(GUIDE.read_text())]


def test_every_command_block_is_run_or_named_as_not_run() -> None:
    tagged = [t for t, _ in blocks() if t]
    assert tagged == [f"test:{s}" for s in STEPS]
    untested = [b for t, b in blocks() if not t]
    assert untested and all(b.lstrip().startswith("helm ") for b in untested), untested
    assert "helm install" in GUIDE.read_text().split("## Commands the test does not run")[1]


@pytest.fixture(scope="module")
def real() -> Iterator[RealNode]:
    labels = yaml.safe_load((MIGRATION / "nodes.yaml").read_text())["items"][0]["metadata"]["labels"]
    node = RealNode(labels={k: v for k, v in labels.items() if not k.startswith("nvidia.com/gpu.")
                            or k == "nvidia.com/gpu.present"})
    with node.running(classes=False) as running:
        yield running


def _cluster_as_today(real: RealNode, workdir: Path) -> None:
    assert real.cluster is not None
    for ns in ("gpu-operator", "team-a"):
        real.namespace(ns)
    real.cluster.kubectl("apply", "-f", str(MIGRATION / "device-plugin-configs.yaml"))
    real.cluster.kubectl("create", "configmap", "-n", "gpu-operator", "default-mig-parted-config",
                         f"--from-file=config.yaml={MIGRATION / 'mig-parted-config.yaml'}")
    manifests = workdir / "manifests"
    manifests.mkdir()
    docs = [d for d in yaml.safe_load_all((MIGRATION / "workloads.yaml").read_text()) if d]
    (manifests / "workloads.yaml").write_text(yaml.safe_dump_all([runnable(d) for d in docs], sort_keys=False))


def test_the_guide_runs_on_a_live_cluster(real: RealNode, tmp_path: Path) -> None:
    assert real.cluster is not None and real.node is not None and real.kube is not None and real.fleet is not None
    _cluster_as_today(real, tmp_path)
    env = {**os.environ, "KUBECONFIG": str(real.cluster.kubeconfig), "NODE": real.node.name,
           "PATH": f"{real.cluster.bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    code = {t.removeprefix("test:"): b for t, b in blocks() if t}
    plugin = None

    def step(name: str) -> str:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code[name]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, f"step {name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def node_labels() -> dict[str, str]:
        return real.kube.get(f"/api/v1/nodes/{real.node.name}")["metadata"].get("labels") or {}  # type: ignore

    step("collect")
    assert yaml.safe_load((tmp_path / "nodes.yaml").read_text())["items"][0]["metadata"]["name"] == real.node.name
    out = step("convert")
    assert "not-convertible" in out and "converted" in out
    real.add_classes()                                              # helm install: the DeviceClasses
    assert DEFAULT_DRIVER_NAME in step("installed")
    step("switch")
    labels = node_labels()
    assert labels.get("gpu-dra/enabled") == "true" and labels["nvidia.com/gpu.deploy.device-plugin"] == "false"
    # The DaemonSet's pod lands on the node: the plugin with the group's node policy, GPUs in the MIG state.
    real.fleet.write_text(yaml.safe_dump({"nodes": [fleet_from(tmp_path / "converted", real.node.name)]},
                                         sort_keys=False))
    plugin = real.start_plugin(real.plugin(DEFAULT_DRIVER_NAME))
    # 3 partitions and 12 slots; no nvidia.com/gpu in allocatable (jsonpath prints nothing, not even a newline).
    out = step("check-node")
    assert out == f"15\nnode/{real.node.name} uncordoned\n", out
    assert not node_labels().get("node.kubernetes.io/unschedulable") and \
        not real.kube.get(f"/api/v1/nodes/{real.node.name}")["spec"].get("unschedulable")
    step("workloads")
    out = step("check-workloads")
    claims = real.kube.list("/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims")["items"]
    assert len(claims) == 3 and all(c.get("status", {}).get("allocation") for c in claims), out
    published = real.devices(plugin)
    got = sorted((published[r["device"]]["type"], published[r["device"]].get("profile") or
                  published[r["device"]]["sharing"])
                 for c in claims for r in c["status"]["allocation"]["devices"]["results"])
    assert got == [("mig", "1g.10gb"), ("mig", "3g.40gb"), ("slot", "time-slicing")], got
    step("rollback-workloads")
    step("rollback-node")
    assert "gpu-dra/enabled" not in node_labels()
    plugin.stop()                                                   # the DaemonSet's pod leaves the node
    wait_until(lambda: not node_slices(real.kube, DEFAULT_DRIVER_NAME, real.node.name), 90,  # type: ignore
               "the kubelet to delete the node's slices after the plugin went away")
    out = step("check-rollback")
    assert "resourceslice" not in out and "deployment.apps/notebook" in out and "job.batch/batch-infer" in out
