"""The driver against the oldest supported release: a real Kubernetes 1.34 control plane (K8S_SKEW_VERSION in
hack/versions.env), started next to the session's 1.37 one.

1.34 has no partitionable devices and no consumable capacity by default, so only whole GPUs and static MIG
partitions may be published, with one clear line saying so; the API server must accept every slice and
store it as sent (a restart then writes nothing), our DeviceClasses must be accepted and stay unchanged,
and the scheduler must allocate whole-GPU and static-MIG claims through them.
"""
from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from allocation_helpers import claim_with_pod, get_pod, wait_allocated
from e2e_helpers import run_publish, slices_of

from api.deviceclasses import device_classes
from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME
from cli.publish_cmd import desired_fleet_pools
from controller.cluster import ClusterController
from dra.model.slices import ApiFeatures
from dra.sim.fleet import load_fleet
from kube.client import DEVICE_CLASSES, RESOURCE_V1, KubeApi
from testbed.demo_examples import create_namespace
from testbed.localcluster import ClusterError, LocalCluster, find_binaries, pinned_version

pytestmark = pytest.mark.e2e

DRIVER = DEFAULT_DRIVER_NAME
NAMESPACE = "skew"
# The static GPU's MIG layout as the fleet creates it: (profile, start).
STATIC_LAYOUT = {("3g.40gb", 4), ("2g.20gb", 0), ("1g.10gb", 2)}
FLEET = {"nodes": [
    {"name": "skew-hgx",
     "gpus": [{"model": "H100-80GB", "count": 1,
               "mig": {"enabled": True, "instances": [{"profile": p, "start": s} for p, s in sorted(STATIC_LAYOUT)]}},
              {"model": "H100-80GB", "count": 4}],
     "policy": {"default": {"wholeGpu": True, "mig": "dynamic"},
                "rules": [{"match": {"index": 0}, "wholeGpu": False, "mig": "static"},
                          {"match": {"index": 2}, "slots": {"count": 4, "strategy": "mps"}},
                          {"match": {"index": 3}, "wholeGpu": False,
                           "memoryShares": {"minimum": "1Gi", "step": "1Gi"}},
                          {"match": {"index": 4}, "wholeGpu": True, "mig": "dynamic",
                           "dynamicMig": {"profiles": ["1g.10gb"], "layout": "capacity"}}]}},
    {"name": "skew-l4",
     "gpus": [{"model": "L4", "count": 2}],
     "policy": {"default": {"wholeGpu": True,
                            "slots": {"count": 4, "strategy": "time-slicing", "layout": "capacity"}}}},
]}
# What 1.34 gets: whole GPUs (not the static-MIG one, not the memory-share one) and the static MIG partitions.
WHOLE_GPUS = {"skew-hgx": {"gpu-1", "gpu-2", "gpu-4"}, "skew-l4": {"gpu-0", "gpu-1"}}
ONE_CLEAR_LINE = re.compile(r"API server is Kubernetes 1\.34 \(older than 1\.36\): publishing only whole GPUs "
                            r"and static MIG devices")


@pytest.fixture(scope="module")
def old_cluster() -> Iterator[LocalCluster]:
    version = pinned_version("K8S_SKEW_VERSION")
    try:
        cluster = LocalCluster(bin_dir=find_binaries(version=version)).start()
    except ClusterError as exc:
        problem = str(exc)
    else:
        problem = ""
    if problem:   # a failure, never a skip: the oldest supported release must be tested
        pytest.fail(f"the Kubernetes {version} control plane could not be built or started: {problem}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def old_api(old_cluster: LocalCluster) -> Iterator[Any]:
    client = old_cluster.api_client()
    yield client
    client.close()


def _publish(cluster: LocalCluster, fleet: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_publish(cluster, fleet, DRIVER, "--once", *extra)


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("skew") / "fleet.yaml"
    path.write_text(yaml.safe_dump(FLEET, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def first_publish(old_cluster: LocalCluster, fleet_file: Path) -> subprocess.CompletedProcess[str]:
    return _publish(old_cluster, fleet_file, "--create-nodes")


def _devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for s in slices:
        for d in s["spec"].get("devices") or []:
            out.setdefault(s["spec"]["nodeName"], {})[d["name"]] = d
    return out


def _type(device: dict[str, Any]) -> str:
    return str(device["attributes"]["type"]["string"])


# ---------------------------------------------------------------------------------------------------- tests

def test_the_old_control_plane_is_the_pinned_1_34_release(old_cluster: LocalCluster) -> None:
    version = old_cluster.request("GET", "/version")
    assert version["gitVersion"] == pinned_version("K8S_SKEW_VERSION")
    assert (version["major"], version["minor"]) == ("1", "34")
    old_cluster.check_running()


def test_the_fleet_uses_every_policy_that_needs_a_newer_server(fleet_file: Path) -> None:
    # Against 1.37 the same fleet publishes counters, dynamic MIG, slots and memory shares: the 1.34
    # checks below are about leaving them out, not about a fleet that never had them.
    pools = desired_fleet_pools(load_fleet(fleet_file), str(fleet_file), DRIVER, ApiFeatures.for_server(37))
    parts = [part for pool in pools.values() for part in pool.slices]
    devices = [d for part in parts for d in part.get("devices", [])]
    assert any(part.get("sharedCounters") for part in parts)
    assert {"gpu", "mig", "slot", "shared"} <= {_type(d) for d in devices}
    # Slots in both layouts: N slot devices (skew-hgx GPU 2) and one slot device with capacity (skew-l4).
    assert any(d["name"] == "gpu-2-slot-3" for d in devices)
    assert any(_type(d) == "slot" and d.get("allowMultipleAllocations") and "slots" in d["capacity"] for d in devices)
    assert sum(1 for d in devices if d["name"].startswith("gpu-1-mig-")) > 10     # dynamic MIG on GPU 1
    # Dynamic MIG in both layouts: a device per placement (GPU 1) and one profile as capacity (GPU 4).
    assert [d["name"] for d in devices if d["name"].startswith("gpu-4-mig-")] == ["gpu-4-mig-1g10gb-19"]
    assert any(d["name"] == "gpu-4-mig-1g10gb-19" and d.get("allowMultipleAllocations")
               and "instances" in d["capacity"] for d in devices)


def test_publish_is_accepted_and_offers_only_whole_gpus_and_static_mig(
        old_api: Any, first_publish: subprocess.CompletedProcess[str]) -> None:
    assert first_publish.returncode == 0, first_publish.stderr
    assert "writes: create " in first_publish.stdout
    # Any slice the server rejected fails the command; any field it dropped is logged as an ERROR.
    assert not [line for line in first_publish.stderr.splitlines() if " ERROR " in line], first_publish.stderr
    assert len(ONE_CLEAR_LINE.findall(first_publish.stderr)) == 1, first_publish.stderr

    slices = slices_of(old_api, DRIVER)
    assert slices and not any(s["spec"].get("sharedCounters") for s in slices)
    devices = _devices(slices)
    assert set(devices) == {"skew-hgx", "skew-l4"}
    for node, by_name in devices.items():
        for name, d in by_name.items():
            assert _type(d) in ("gpu", "mig"), f"{node}/{name}"
            for field in ("consumesCounters", "allowMultipleAllocations", "taints"):
                assert field not in d, f"{node}/{name} has {field}"
            assert all("requestPolicy" not in c for c in d.get("capacity", {}).values()), f"{node}/{name}"
    assert {n for n, d in devices["skew-l4"].items() if _type(d) == "gpu"} == WHOLE_GPUS["skew-l4"]
    assert set(devices["skew-l4"]) == WHOLE_GPUS["skew-l4"]
    hgx = devices["skew-hgx"]
    assert {n for n, d in hgx.items() if _type(d) == "gpu"} == WHOLE_GPUS["skew-hgx"]
    mig = {n: d for n, d in hgx.items() if _type(d) == "mig"}
    assert all(n.startswith("gpu-0-mig-") for n in mig), sorted(mig)     # none from the dynamic GPUs 1 and 4
    layout = {(d["attributes"]["profile"]["string"], int(n.rsplit("-", 1)[1])) for n, d in mig.items()}
    assert layout == STATIC_LAYOUT
    assert all("uuid" in d["attributes"] for d in mig.values())          # existing partitions
    # The per-node notes say what was left out, and why.
    assert "dynamic MIG partitions and shared slots need partitionable devices" in first_publish.stderr
    assert "memory-share devices need consumable capacity" in first_publish.stderr


def test_device_classes_are_accepted_and_written_once(old_api: Any, caplog: pytest.LogCaptureFixture) -> None:
    kube = KubeApi(old_api)
    ours = device_classes(DRIVER)
    ctl = ClusterController(old_api, DRIVER, ours)
    ctl.run_until_success(30)
    ctl.reconcile_once()
    assert ctl.writes_by_operation == {"deviceclass-create": len(ours)}
    for cls in ours:
        stored = kube.get(f"{DEVICE_CLASSES}/{cls['metadata']['name']}")
        assert stored["spec"]["selectors"] == cls["spec"]["selectors"]

    # NVIDIA compatibility: 1.34 drops extendedResourceName; the controller leaves it out, says so once,
    # and does not rewrite the class on every pass.
    compat = device_classes(compat_nvidia=True)
    with caplog.at_level(logging.WARNING, logger="controller.cluster"):
        nvidia = ClusterController(old_api, NVIDIA_DRIVER_NAME, compat)
        nvidia.reconcile_once()
        nvidia.reconcile_once()
    assert nvidia.writes_by_operation == {"deviceclass-create": len(compat)}
    assert "extendedResourceName" not in kube.get(f"{DEVICE_CLASSES}/{NVIDIA_DRIVER_NAME}")["spec"]
    lines = [r.getMessage() for r in caplog.records if "extendedResourceName" in r.getMessage()]
    assert len(lines) == 1 and "Kubernetes 1.34" in lines[0]


def _wait_allocated(kube: KubeApi, name: str, timeout: float = 60.0) -> tuple[dict[str, Any], str]:
    """The claim's one allocation result and the pod's node, once the scheduler has done both."""
    claim = wait_allocated(kube, NAMESPACE, name, timeout)
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 1, results
    return results[0], get_pod(kube, NAMESPACE, name)["spec"]["nodeName"]


def test_the_scheduler_allocates_whole_gpu_and_static_mig_claims(
        old_api: Any, first_publish: subprocess.CompletedProcess[str]) -> None:
    assert first_publish.returncode == 0, first_publish.stderr
    kube = KubeApi(old_api)
    ClusterController(old_api, DRIVER, device_classes(DRIVER)).run_until_success(30)
    create_namespace(kube, NAMESPACE)
    claims, pods = f"{RESOURCE_V1}/namespaces/{NAMESPACE}/resourceclaims", f"/api/v1/namespaces/{NAMESPACE}/pods"
    whole = claim_with_pod("whole", DRIVER, f"device.attributes['{DRIVER}'].productName.startsWith('NVIDIA H100')")
    part = claim_with_pod("static-mig", f"mig.{DRIVER}", f"device.attributes['{DRIVER}'].profile == '3g.40gb'")
    for claim, pod in (whole, part):
        kube.create(claims, claim)
        kube.create(pods, pod)

    result, node = _wait_allocated(kube, "whole")
    assert (result["driver"], result["pool"], node) == (DRIVER, "skew-hgx", "skew-hgx")
    assert result["device"] in WHOLE_GPUS["skew-hgx"]

    result, node = _wait_allocated(kube, "static-mig")
    assert (result["driver"], result["pool"], node) == (DRIVER, "skew-hgx", "skew-hgx")
    assert re.fullmatch(r"gpu-0-mig-3g40gb-\d+-4", result["device"]), result["device"]


def test_a_restart_writes_nothing(old_cluster: LocalCluster, old_api: Any, fleet_file: Path,
                                  first_publish: subprocess.CompletedProcess[str]) -> None:
    assert first_publish.returncode == 0, first_publish.stderr
    before = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in slices_of(old_api, DRIVER)}
    again = _publish(old_cluster, fleet_file)
    assert again.returncode == 0, again.stderr
    assert "writes: none" in again.stdout, again.stdout + again.stderr
    assert len(ONE_CLEAR_LINE.findall(again.stderr)) == 1, again.stderr
    assert {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in slices_of(old_api, DRIVER)} == before

    # The cluster controller after a restart: every class is in place, nothing to write.
    for driver, classes in ((DRIVER, device_classes(DRIVER)), (NVIDIA_DRIVER_NAME, device_classes(compat_nvidia=True))):
        ClusterController(old_api, driver, classes).run_until_success(30)
        ctl = ClusterController(old_api, driver, classes)
        ctl.reconcile_once()
        assert ctl.writes == 0, (driver, ctl.writes_by_operation)
