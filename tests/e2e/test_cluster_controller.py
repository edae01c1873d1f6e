"""The cluster controller, the `gpu-dra controller` command, kubectl on our slices, and the scheduler
allocating a claim from slices built by the real slice builder."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from typing import Any

import gpu_fixtures as g
import pytest
from e2e_helpers import gpu_devices, slices_of
from standin.workloads import wait_until

from api.deviceclasses import device_classes
from controller.cluster import DRIVER_LABEL, ClusterController
from controller.clusterstate import ClusterState
from dra.model.policy import parse_node_policy
from dra.model.slices import desired_pool_slices
from kube.client import DEVICE_CLASSES, SLICES, ApiError, KubeApi
from kube.resourceslices import DesiredPool, Owner, ResourceSliceController
from kube.serverversion import api_features
from testbed.localcluster import free_port

pytestmark = pytest.mark.e2e


def _class_names(api_client: Any, driver: str) -> set[str]:
    items = KubeApi(api_client).list(DEVICE_CLASSES, label_selector=f"{DRIVER_LABEL}={driver}")["items"]
    return {c["metadata"]["name"] for c in items}


def test_device_classes_are_created_kept_and_restored(api_client: Any, driver_name: str) -> None:
    kube = KubeApi(api_client)
    classes = device_classes(driver_name)
    ctl = ClusterController(api_client, driver_name, classes)
    ctl.reconcile_once()
    assert ctl.writes_by_operation == {"deviceclass-create": len(classes)}
    assert _class_names(api_client, driver_name) == {c["metadata"]["name"] for c in classes}
    stored = kube.get(f"{DEVICE_CLASSES}/{driver_name}")
    assert stored["spec"]["selectors"] == classes[0]["spec"]["selectors"]

    ctl.reconcile_once()   # nothing changed: nothing written
    assert ctl.writes == len(classes)

    # Someone edits a class and deletes another: both come back, nothing else is touched.
    stored["spec"]["selectors"] = [{"cel": {"expression": "true"}}]
    kube.replace(DEVICE_CLASSES, stored)
    kube.delete(DEVICE_CLASSES, f"mig.{driver_name}")
    ctl.reconcile_once()
    assert ctl.writes_by_operation == {"deviceclass-create": len(classes) + 1, "deviceclass-update": 1}
    assert kube.get(f"{DEVICE_CLASSES}/{driver_name}")["spec"]["selectors"] == classes[0]["spec"]["selectors"]

    # Classes this driver no longer wants are removed (only ours, by label).
    fewer = ClusterController(api_client, driver_name, classes[:2])
    fewer.reconcile_once()
    assert fewer.writes_by_operation == {"deviceclass-delete": len(classes) - 2}
    assert _class_names(api_client, driver_name) == {c["metadata"]["name"] for c in classes[:2]}


def test_classes_installed_by_helm_keep_helms_label(api_client: Any, driver_name: str) -> None:
    """The chart's classes carry Helm's app.kubernetes.io/managed-by: the controller adds its driver label once and
    leaves Helm's (taking it over made every `helm upgrade` fail with an apply conflict), and never deletes them."""
    kube = KubeApi(api_client)
    classes = device_classes(driver_name)
    for cls in classes:
        kube.create(DEVICE_CLASSES, {**cls, "metadata": {**cls["metadata"], "labels": {
            **(cls["metadata"].get("labels") or {}), "app.kubernetes.io/managed-by": "Helm"}}})
    try:
        ctl = ClusterController(api_client, driver_name, classes)
        ctl.reconcile_once()
        assert ctl.writes_by_operation == {"deviceclass-update": len(classes)}
        ctl.reconcile_once()
        assert ctl.writes == len(classes)
        for cls in classes:
            labels = kube.get(f"{DEVICE_CLASSES}/{cls['metadata']['name']}")["metadata"]["labels"]
            assert (labels["app.kubernetes.io/managed-by"], labels[DRIVER_LABEL]) == ("Helm", driver_name)
        fewer = ClusterController(api_client, driver_name, classes[:2])
        fewer.reconcile_once()
        assert fewer.writes == 0
    finally:
        for cls in classes:
            kube.request("DELETE", f"{DEVICE_CLASSES}/{cls['metadata']['name']}")


def test_slices_of_vanished_nodes_are_removed(api_client: Any, cluster: Any, driver_name: str) -> None:
    kube = KubeApi(api_client)
    prefix = driver_name.split(".")[0]
    kept, vanishing = f"{prefix}-kept", f"{prefix}-vanishing"
    for n in (kept, vanishing):
        cluster.add_node(n)
    publisher = ResourceSliceController(api_client, driver_name, Owner.cluster())
    publisher.update({n: DesiredPool(node_name=n, slices=[gpu_devices("gpu", 1)]) for n in (kept, vanishing)})
    publisher.run_once(timeout=30)
    # A slice for a node that never existed (no owner reference, so only the cluster controller removes it).
    kube.create(SLICES, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                         "metadata": {"name": f"{prefix}-ghost"},
                         "spec": {"driver": driver_name, "nodeName": f"{prefix}-ghost-node",
                                  "pool": {"name": f"{prefix}-ghost-node", "generation": 1, "resourceSliceCount": 1},
                                  **gpu_devices("gpu", 1)}})
    # Another driver's slice on the ghost node is not ours to remove.
    other_driver = "other." + driver_name
    kube.create(SLICES, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                         "metadata": {"name": f"{prefix}-other-driver"},
                         "spec": {"driver": other_driver, "nodeName": f"{prefix}-ghost-node",
                                  "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1}}})

    # One pass on a synchronous load (slices listed before Nodes): the ghost's slice goes at once.
    ctl = ClusterController(api_client, driver_name, [])
    ctl.state.load()
    assert ctl.remove_stale_slices(at_once=True) == [f"{prefix}-ghost"]
    assert {s["spec"]["nodeName"] for s in slices_of(api_client, driver_name)} == {kept, vanishing}

    # Watching: a node that goes is missed at one pass and its slices deleted at the next.
    watching = ClusterController(api_client, driver_name, [], state=ClusterState(kube, driver_name, []).start())
    try:
        assert watching.state.wait_synced(30)
        assert watching.remove_stale_slices() == []
        cluster.delete_node(vanishing)
        wait_until(lambda: watching.remove_stale_slices() is not None and
                   {s["spec"]["nodeName"] for s in slices_of(api_client, driver_name)} == {kept}, 15,
                   "the vanished node's slices to be gone")
    finally:
        watching.state.stop()
    assert len(slices_of(api_client, other_driver)) == 1
    kube.delete(SLICES, f"{prefix}-other-driver")


def test_controller_command_serves_health_and_metrics(cluster: Any, api_client: Any, driver_name: str) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "controller", "--kubeconfig", str(cluster.kubeconfig),
         "--driver-name", driver_name, "--metrics-port", str(port), "--metrics-address", "127.0.0.1",
         "--interval", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        def healthz() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                return False

        wait_until(healthz, 30, "/healthz to answer 200")
        assert _class_names(api_client, driver_name) == {c["metadata"]["name"] for c in device_classes(driver_name)}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        assert (f'gpu_dra_deviceclass_writes_total{{driver="{driver_name}",operation="create"}} '
                f'{float(len(device_classes(driver_name)))}') in metrics
        assert f'gpu_dra_cluster_reconciles_total{{driver="{driver_name}",result="ok"}}' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0, out
    assert "serving /healthz and /metrics" in out


def test_kubectl_describes_our_slices(cluster: Any, api_client: Any, driver_name: str) -> None:
    node = driver_name.split(".")[0] + "-node"
    cluster.add_node(node)
    ctl = ResourceSliceController(api_client, driver_name, Owner.node(node))
    ctl.update({node: DesiredPool(node_name=node, slices=[gpu_devices("gpu", 2)])})
    ctl.run_once(timeout=30)
    got = cluster.kubectl("get", "resourceslices", "--field-selector", f"spec.driver={driver_name}",
                          "-o", "wide").stdout
    assert node in got and driver_name in got
    name = slices_of(api_client, driver_name)[0]["metadata"]["name"]
    described = cluster.kubectl("describe", "resourceslice", name).stdout
    for field, value in (("Name", name), ("Driver", driver_name), ("Node Name", node), ("Generation", "1"),
                         ("Resource Slice Count", "1"), ("Name", "gpu-0"), ("Name", "gpu-1"),
                         ("String", "NVIDIA H100 80GB HBM3"), ("Value", "80Gi")):
        assert re.search(rf"^\s*{field}:\s+{re.escape(value)}$", described, re.M), \
            f"{field}: {value} missing from:\n{described}"
    assert cluster.kubectl("describe", "resourceslices").returncode == 0


def test_scheduler_allocates_a_claim_from_published_slices(cluster: Any, api_client: Any, driver_name: str) -> None:
    """The slice builder's output, published by the controller, is what kube-scheduler allocates from."""
    kube = KubeApi(api_client)
    node = driver_name.split(".")[0] + "-gpu-node"
    cluster.add_node(node)
    policy = parse_node_policy({"rules": [{"match": {"index": 1}, "mig": "dynamic"}]}, "test policy")
    specs = desired_pool_slices(g.inventory(g.h100(0), g.h100(1)), policy, driver_name, node, api_features(api_client))
    slices = ResourceSliceController(api_client, driver_name, Owner.node(node))
    slices.update({node: DesiredPool.from_slice_specs(specs)})
    slices.run_once(timeout=30)
    ClusterController(api_client, driver_name, device_classes(driver_name)).reconcile_once()

    ns = "default"
    claim = f"{node}-claim"
    kube.create(f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": claim},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": {
            "deviceClassName": f"mig.{driver_name}",
            "selectors": [{"cel": {"expression": f"device.attributes['{driver_name}'].profile == '3g.40gb'"}}]}}]}}})
    kube.create(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": claim},
        "spec": {"containers": [{"name": "c", "image": "registry.invalid/none",
                                 "resources": {"claims": [{"name": "gpu"}]}}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]}})
    try:
        def allocated() -> Any:
            return kube.get(f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{claim}").get(
                "status", {}).get("allocation")

        allocation = wait_until(allocated, 30, "the scheduler to allocate the claim")
        (result,) = allocation["devices"]["results"]
        assert result["driver"] == driver_name and result["pool"] == node
        assert result["device"].startswith("gpu-1-mig-3g40gb-")
        assert wait_until(lambda: kube.get(f"/api/v1/namespaces/{ns}/pods/{claim}")["spec"].get("nodeName"), 15,
                          "the pod to be bound") == node
    finally:
        for path in (f"/api/v1/namespaces/{ns}/pods/{claim}",
                     f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{claim}"):
            try:
                kube.request("DELETE", path, query={"gracePeriodSeconds": 0})
            except ApiError:
                pass
