"""`gpu-dra status` and `kubectl gpu` on the real control plane: a simulated fleet published, claims allocated by
the real scheduler for pods, then the command run as its own process, with the admin's kubeconfig and with a
read-only identity (a service account token that may only get and list slices, claims and pods)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from allocation_helpers import PublishedFleet, allocated_devices, claim_with_pod, temporary_namespace, wait_allocated
from standin.workloads import create

from kube.client import KubeApi

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RBAC = "/apis/rbac.authorization.k8s.io/v1"


def fleet_doc(node: str) -> dict[str, Any]:
    return {"nodes": [{"name": node, "gpus": [{"model": "H100-80GB", "count": 2}],
                       "policy": {"default": {"wholeGpu": True, "mig": "dynamic"}}}]}


def status(kubeconfig: Path, driver: str, *args: str, plugin: bool = False) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it: `gpu-dra status ...`, or the kubectl plugin `kubectl-gpu ...`."""
    entry = ["-m", "cli.kubectl_gpu"] if plugin else ["-m", "cli.main", "status"]
    return subprocess.run([sys.executable, *entry, *args, "--kubeconfig", str(kubeconfig), "--driver-name", driver],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def service_account_kubeconfig(cluster: Any, kube: KubeApi, namespace: str, name: str,
                               resources: list[str], workdir: Path) -> Path:
    """A kubeconfig with the token of a new service account that may get and list ``resources`` and nothing else."""
    kube.create(f"/api/v1/namespaces/{namespace}/serviceaccounts",
                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})
    role = f"{namespace}-{name}"
    groups = {"resourceslices": "resource.k8s.io", "resourceclaims": "resource.k8s.io", "pods": ""}
    kube.create(f"{RBAC}/clusterroles", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": role},
        "rules": [{"apiGroups": [groups[r]], "resources": [r], "verbs": ["get", "list"]} for r in resources]})
    kube.create(f"{RBAC}/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": role},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role}})
    token = kube.create(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": 3600}})["status"]["token"]
    path = workdir / f"{name}.kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": name,
        "clusters": [{"name": "local", "cluster": {"server": cluster.server, "certificate-authority": str(cluster.ca_file)}}],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": "local", "user": name}}]}))
    return path


@pytest.fixture
def fleet(cluster: Any, api_client: Any, driver_name: str, tmp_path: Path) -> Iterator[PublishedFleet]:
    node = f"{driver_name.split('.')[0]}-status"
    published = PublishedFleet(cluster, api_client, driver_name, fleet_doc(node), tmp_path).publish()
    yield published
    published.remove()
    for kind in ("clusterrolebindings", "clusterroles"):
        for o in KubeApi(api_client).list(f"{RBAC}/{kind}")["items"]:
            if o["metadata"]["name"].startswith(f"{node}-"):
                KubeApi(api_client).request("DELETE", f"{RBAC}/{kind}/{o['metadata']['name']}")


def test_status_shows_holders_free_capacity_and_the_mig_row_to_a_read_only_user(
        cluster: Any, api_client: Any, fleet: PublishedFleet, driver_name: str, tmp_path: Path) -> None:
    kube = KubeApi(api_client)
    [node] = fleet.node_names
    profile = f"device.attributes['{driver_name}'].profile == '%s'"
    with temporary_namespace(api_client, node) as ns:
        # One claim at a time, so the device order decides (docs/devices.md, "Device order").
        for name, cls, cel in (("big-mig", f"mig.{driver_name}", profile % "3g.40gb"),
                               ("small-mig", f"mig.{driver_name}", profile % "1g.10gb"),
                               ("whole", driver_name, None)):
            for obj in claim_with_pod(name, cls, cel):
                create(kube, ns, obj)
            wait_allocated(kube, ns, name)
        got = {name: allocated_devices(wait_allocated(kube, ns, name)) for name in ("big-mig", "small-mig", "whole")}
        assert got == {"big-mig": ["gpu-0-mig-3g40gb-9-4"], "small-mig": ["gpu-0-mig-1g10gb-19-3"], "whole": ["gpu-1"]}

        admin = status(cluster.kubeconfig, driver_name, node, "-o", "json")
        assert admin.returncode == 0, admin.stderr
        doc = json.loads(admin.stdout)
        [n] = doc["nodes"]
        g0, g1 = n["gpus"]
        held = {d["name"]: [(h["namespace"], h["claim"], h["pods"]) for h in d["holders"]]
                for g in (g0, g1) for d in g["devices"] if d["state"] == "held"}
        assert held == {"gpu-0-mig-1g10gb-19-3": [(ns, "small-mig", ["small-mig"])],
                        "gpu-0-mig-3g40gb-9-4": [(ns, "big-mig", ["big-mig"])],
                        "gpu-1": [(ns, "whole", ["whole"])]}
        assert g0["memorySlices"] == "[...|A|BBBB]"
        assert g0["migFree"] == {"1g.10gb": 3, "1g.10gb+me": 1, "1g.20gb": 1, "2g.20gb": 1}
        assert g0["wholeFree"] is False and g1["wholeFree"] is False and g1["migFree"] == {}
        assert doc["summary"] == {"nodes": 1, "gpus": 2, "wholeGpusFree": 0, "unhealthyGpus": 0, "slotsFree": 0,
                                  "slotsTotal": 0, "migPlaceable": {"1g.10gb": 3, "1g.10gb+me": 1, "1g.20gb": 1,
                                                                      "2g.20gb": 1}}

        # A user who may only read slices, claims and pods sees the same, through the kubectl plugin.
        reader = service_account_kubeconfig(cluster, kube, ns, "reader",
                                            ["resourceslices", "resourceclaims", "pods"], tmp_path)
        table = status(reader, driver_name, "status", node, plugin=True)
        assert table.returncode == 0, table.stderr
        assert f"NODE {node}: 2 GPUs, 0 whole free" in table.stdout
        assert "memory slices [...|A|BBBB]  (. = free)" in table.stdout
        assert f"A gpu-0-mig-1g10gb-19-3 (1g.10gb): {ns}/small-mig → small-mig" in table.stdout
        assert f"gpu-1  gpu                held    {ns}/whole → whole" in table.stdout
        assert status(reader, driver_name, node, plugin=True).stdout == table.stdout   # `kubectl gpu NODE`

        # As kubectl runs its plugins: `kubectl-gpu` found on PATH, the kubeconfig from $KUBECONFIG.
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "kubectl-gpu").write_text(f'#!/bin/sh\nexec {sys.executable} -m cli.kubectl_gpu "$@"\n')
        (bin_dir / "kubectl-gpu").chmod(0o755)
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "KUBECONFIG": str(reader)}
        via_kubectl = subprocess.run([str(cluster.bin_dir / "kubectl"), "gpu", node, "--driver-name", driver_name],
                                     cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert via_kubectl.returncode == 0, via_kubectl.stderr
        assert via_kubectl.stdout == table.stdout

        # The same identity may write nothing.
        as_reader = subprocess.run(
            [str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(reader), "auth", "can-i", "create", "resourceclaims",
             "-n", ns], capture_output=True, text=True, timeout=30)
        assert as_reader.stdout.strip() == "no"

        # Without the claims grant: one line, the API server's refusal as kubectl words it and what the command
        # needs; exit 7, the status of a refused request in every command (cli.failures).
        partial = service_account_kubeconfig(cluster, kube, ns, "partial", ["resourceslices", "pods"], tmp_path)
        refused = status(partial, driver_name, node)
        assert refused.returncode == 7 and refused.stdout == ""
        [line] = refused.stderr.strip().splitlines()
        assert line.startswith("gpu-dra status: error from server (Forbidden): resourceclaims.resource.k8s.io is "
                               f'forbidden: User "system:serviceaccount:{ns}:partial" cannot list resource'), line
        assert line.endswith("; gpu-dra status needs get and list on resourceslices, resourceclaims and pods"), line


def test_status_of_a_node_without_devices_says_so(cluster: Any, fleet: PublishedFleet, driver_name: str) -> None:
    out = status(cluster.kubeconfig, driver_name, "no-such-node")
    assert out.returncode == 1
    assert out.stderr.strip() == f"gpu-dra status: node 'no-such-node' publishes no devices of driver {driver_name}"
