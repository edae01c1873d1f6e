"""`gpu-dra publish` for a simulated fleet against the real API server."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_helpers import run_publish, slices_of
from standin.workloads import wait_until

from kube.client import NODES, SLICES, KubeApi

pytestmark = pytest.mark.e2e


def _fleet(path: Path, prefix: str, h100_count: int = 2, with_l4_node: bool = True) -> None:
    nodes: list[dict[str, Any]] = [{"name": f"{prefix}-hgx", "gpus": [{"model": "H100-80GB", "count": h100_count}],
                                    "policy": {"rules": [{"match": {"index": 0}, "mig": "dynamic"}]}}]
    if with_l4_node:
        nodes.append({"name": f"{prefix}-l4", "gpus": [{"model": "L4", "count": 1}]})
    path.write_text(yaml.safe_dump({"nodes": nodes}))


def _devices_by_node(api_client: Any, driver: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for s in slices_of(api_client, driver):
        out.setdefault(s["spec"]["nodeName"], []).extend(d["name"] for d in s["spec"].get("devices", []))
    return out


def test_publish_once_creates_nodes_and_slices_and_a_rerun_writes_nothing(cluster: Any, api_client: Any,
                                                                           driver_name: str, tmp_path: Path) -> None:
    prefix = driver_name.split(".")[0]
    fleet = tmp_path / "fleet.yaml"
    _fleet(fleet, prefix)
    first = run_publish(cluster, fleet, driver_name, "--once", "--create-nodes")
    assert first.returncode == 0, first.stderr
    assert "writes: create " in first.stdout
    nodes = {n["metadata"]["name"] for n in KubeApi(api_client).list(NODES)["items"]}
    assert {f"{prefix}-hgx", f"{prefix}-l4"} <= nodes
    devices = _devices_by_node(api_client, driver_name)
    assert set(devices) == {f"{prefix}-hgx", f"{prefix}-l4"}
    assert devices[f"{prefix}-l4"] == ["gpu-0"]
    assert "gpu-1" in devices[f"{prefix}-hgx"]
    assert any(d.startswith("gpu-0-mig-7g80gb-") for d in devices[f"{prefix}-hgx"])

    again = run_publish(cluster, fleet, driver_name, "--once")
    assert again.returncode == 0, again.stderr
    assert "writes: none" in again.stdout

    # One node leaves the fleet, the other loses a GPU: its slices go, the rest follows.
    _fleet(fleet, prefix, h100_count=1, with_l4_node=False)
    third = run_publish(cluster, fleet, driver_name, "--once")
    assert third.returncode == 0, third.stderr
    devices = _devices_by_node(api_client, driver_name)
    assert set(devices) == {f"{prefix}-hgx"} and "gpu-1" not in devices[f"{prefix}-hgx"]


def test_publish_reports_bad_fleet_files_and_unregistered_nodes(cluster: Any, driver_name: str,
                                                                 tmp_path: Path) -> None:
    fleet = tmp_path / "bad.yaml"
    fleet.write_text(yaml.safe_dump({"nodes": [{"name": "n", "gpus": [{"model": "NoSuchGPU", "count": 1}]}]}))
    proc = run_publish(cluster, fleet, driver_name, "--once")
    assert proc.returncode == 2
    assert "NoSuchGPU" in proc.stderr
    prefix = driver_name.split(".")[0]
    _fleet(fleet, prefix)
    proc = run_publish(cluster, fleet, driver_name, "--once")
    assert proc.returncode == 2
    assert f"no Node objects for {prefix}-hgx, {prefix}-l4" in proc.stderr and "--create-nodes" in proc.stderr


def test_publish_keeps_running_repairs_and_follows_the_fleet_file(cluster: Any, api_client: Any,
                                                                  driver_name: str, tmp_path: Path) -> None:
    prefix = driver_name.split(".")[0]
    fleet = tmp_path / "fleet.yaml"
    _fleet(fleet, prefix, with_l4_node=True)
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "publish", "--fleet", str(fleet), "--kubeconfig",
                             str(cluster.kubeconfig), "--driver-name", driver_name, "--create-nodes",
                             "--sync-delay", "0.3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: set(_devices_by_node(api_client, driver_name)) == {f"{prefix}-hgx", f"{prefix}-l4"},
                   60, "both nodes' slices")
        l4_slice = next(s for s in slices_of(api_client, driver_name) if s["spec"]["nodeName"] == f"{prefix}-l4")
        KubeApi(api_client).delete(SLICES, l4_slice["metadata"]["name"])
        wait_until(lambda: f"{prefix}-l4" in _devices_by_node(api_client, driver_name), 15,
                   "the deleted slice to come back")
        _fleet(fleet, prefix, with_l4_node=False)
        wait_until(lambda: set(_devices_by_node(api_client, driver_name)) == {f"{prefix}-hgx"}, 15,
                   "the removed node's slices to go")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0, out
    assert "fleet file changed" in out


def test_publish_never_touches_pools_a_node_plugin_publishes(cluster: Any, api_client: Any, driver_name: str,
                                                             tmp_path: Path) -> None:
    """A node plugin's pool (slices without publish's label) next to a fleet: --dry-run says what would be written
    and leaves the plugin's pool alone, a run creates only the fleet's pools, a smaller fleet deletes only publish's
    own, and a fleet naming the plugin's node is refused."""
    from kube.resourceslices import DesiredPool, Owner, ResourceSliceController
    from testbed.localcluster import simulated_node

    prefix = driver_name.split(".")[0]
    plugin_node = f"{prefix}-plugin"
    kube = KubeApi(api_client)
    kube.create(NODES, simulated_node(plugin_node, {}))
    plugin = ResourceSliceController(api_client, driver_name, Owner.node(plugin_node))
    plugin.update({plugin_node: DesiredPool(slices=[{"devices": [{"name": "gpu-0"}]}], node_name=plugin_node)})
    plugin.run_once(timeout=30)

    def plugin_slices() -> list[tuple[str, str]]:
        return [(s["metadata"]["uid"], s["metadata"]["resourceVersion"]) for s in slices_of(api_client, driver_name)
                if s["spec"]["pool"]["name"] == plugin_node]

    before = plugin_slices()
    assert len(before) == 1
    fleet = tmp_path / "fleet.yaml"
    _fleet(fleet, prefix)
    dry = run_publish(cluster, fleet, driver_name, "--once", "--create-nodes", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"create               pool {prefix}-hgx:" in dry.stdout, dry.stdout
    assert f"leave alone          pool {plugin_node}: 1 slice(s)" in dry.stdout, dry.stdout
    assert {s["spec"]["pool"]["name"] for s in slices_of(api_client, driver_name)} == {plugin_node}
    assert f"{prefix}-hgx" not in {n["metadata"]["name"] for n in kube.list(NODES)["items"]}

    first = run_publish(cluster, fleet, driver_name, "--once", "--create-nodes")
    assert first.returncode == 0, first.stderr
    assert set(_devices_by_node(api_client, driver_name)) == {f"{prefix}-hgx", f"{prefix}-l4", plugin_node}
    assert all(s["metadata"]["labels"] == {"gpu.dra-driver.io/published-by": "gpu-dra-publish"}
               for s in slices_of(api_client, driver_name) if s["spec"]["pool"]["name"] != plugin_node)
    _fleet(fleet, prefix, with_l4_node=False)
    shrink = run_publish(cluster, fleet, driver_name, "--once")
    assert shrink.returncode == 0, shrink.stderr
    assert set(_devices_by_node(api_client, driver_name)) == {f"{prefix}-hgx", plugin_node}
    assert plugin_slices() == before

    fleet.write_text(yaml.safe_dump({"nodes": [{"name": plugin_node, "gpus": [{"model": "L4", "count": 1}]}]}))
    clash = run_publish(cluster, fleet, driver_name, "--once")
    assert clash.returncode == 2 and f"pool(s) {plugin_node} of driver {driver_name} are published by someone else" \
        in clash.stderr, clash.stderr
    assert plugin_slices() == before
