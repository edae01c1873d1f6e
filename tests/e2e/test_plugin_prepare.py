"""The kubelet plugin end to end on the real control plane: the plugin publishes a simulated node's GPUs,
KCM creates claims from templates, the scheduler allocates and binds, and the kubelet stand-in prepares the
pod's claims on the plugin exactly as the kubelet would before starting containers. The CDI files are then
read the way a container runtime reads them. Deleting the pod and unpreparing must leave nothing behind.

Pods never run (there is no kubelet): scheduling + allocation + prepare is the path under test.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from plugin_helpers import allocated, container_edits, finish, published, run_example, run_objects
from standin import PodPrepareError
from standin.workloads import create, delete_pod, for_driver, wait_for_scheduled_pod

pytestmark = pytest.mark.e2e

H100 = {"model": "H100-80GB", "count": 2}


def test_whole_gpu(kube, namespace, make_node):
    node = make_node([H100])
    devices = published(node)
    pod, = run_example(kube, node, namespace, "gpu-by-family")
    prepared = node.kubelet.prepare_pod(pod)

    result, = allocated(kube, namespace, prepared.claims["gpu"].name)
    dev, = prepared.devices["gpu"]
    assert (dev.pool_name, dev.device_name, dev.request_names) == (node.name, result["device"], ("gpu",))
    minor = int(result["device"].removeprefix("gpu-"))
    edits = container_edits(node, prepared)
    assert f"/dev/nvidia{minor}" in edits.device_paths() and "/dev/nvidiactl" in edits.device_paths()
    assert edits.env_map()["NVIDIA_VISIBLE_DEVICES"] == devices[result["device"]]["uuid"]
    # the driver's libraries come from the (fake) driver root, as seen on the host
    libcuda = [m for m in edits.mounts if m["containerPath"].endswith("/libcuda.so.580.95.05")]
    assert libcuda and libcuda[0]["hostPath"].startswith(str(node.host.root))
    assert node.metrics()["gpu_dra_prepared_claims"] == 1

    finish(kube, node, namespace, pod)


def test_whole_gpu_through_v1beta1(kube, namespace, make_node):
    """A kubelet that speaks only the v1beta1 DRA service gets the same answer."""
    node = make_node([H100], dra_services=("v1beta1.DRAPlugin",))
    assert node.kubelet.watcher.plugin(node.driver).dra_service == "v1beta1.DRAPlugin"
    pod, = run_example(kube, node, namespace, "cel-memory")
    prepared = node.kubelet.prepare_pod(pod)
    assert "/dev/nvidiactl" in container_edits(node, prepared).device_paths()
    assert node.metrics()['gpu_dra_grpc_requests_total{method="NodePrepareResources",version="v1beta1"}'] == 1
    finish(kube, node, namespace, pod)


def test_static_mig(kube, namespace, make_node):
    gpus = [{"model": "H100-80GB", "count": 1,
             "mig": {"enabled": True, "instances": [{"profile": "1g.10gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]}}]
    node = make_node(gpus, {"default": {"wholeGpu": False, "mig": "static"}})
    devices = published(node)
    assert sorted(devices) == ["gpu-0-mig-1g10gb-19-0", "gpu-0-mig-3g40gb-9-4"]
    pod, = run_example(kube, node, namespace, "mig-partition")
    prepared = node.kubelet.prepare_pod(pod)

    dev, = prepared.devices["mig"]
    assert dev.device_name == "gpu-0-mig-1g10gb-19-0"
    edits = container_edits(node, prepared)
    assert edits.env_map()["NVIDIA_VISIBLE_DEVICES"] == devices[dev.device_name]["uuid"]
    paths = edits.device_paths()
    assert "/dev/nvidia0" in paths
    assert len([p for p in paths if p.startswith("/dev/nvidia-caps/")]) == 2  # GPU-instance and compute-instance caps

    finish(kube, node, namespace, pod, static_mig=True)
    # a static partition is the node's, not the claim's: it is still there and still published
    assert "gpu-0-mig-1g10gb-19-0" in published(node)


def test_dynamic_mig(kube, namespace, make_node):
    node = make_node([{"model": "H100-80GB", "count": 1}], {"default": {"mig": "dynamic"}})
    assert any("-mig-1g10gb-" in name for name in published(node))
    pod, = run_example(kube, node, namespace, "mig-partition")
    prepared = node.kubelet.prepare_pod(pod)

    dev, = prepared.devices["mig"]
    assert dev.device_name.startswith("gpu-0-mig-1g10gb-19-")
    edits = container_edits(node, prepared)
    assert edits.env_map()["NVIDIA_VISIBLE_DEVICES"].startswith("MIG-")
    assert len([p for p in edits.device_paths() if p.startswith("/dev/nvidia-caps/")]) == 2
    record, = node.checkpoint_claims().values()
    assert len(record["undo"]["migDevices"]) == 1, record  # the plugin created the partition for this claim

    finish(kube, node, namespace, pod)
    # The partition is gone from the GPU: the GPU can be prepared whole again, which the plugin refuses
    # while any MIG device exists on it.
    whole, = run_example(kube, node, namespace, "gpu-by-family")
    assert node.kubelet.prepare_pod(whole).devices["gpu"][0].device_name == "gpu-0"
    finish(kube, node, namespace, whole)


def mig_share_pod(name: str, instances: int | None) -> list[dict[str, Any]]:
    """A pod and its claim for a share of the one-profile MIG device: `instances` of it (None: the default)."""
    exactly: dict[str, Any] = {"deviceClassName": "mig.gpu.dra-driver.io", "selectors": [
        {"cel": {"expression": "device.attributes['gpu.dra-driver.io'].profile == '1g.10gb'"}}]}
    if instances is not None:
        exactly["capacity"] = {"requests": {"instances": str(instances)}}
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
             "spec": {"devices": {"requests": [{"name": "mig", "exactly": exactly}]}}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"restartPolicy": "Never",
                    "containers": [{"name": "cuda", "image": "cuda", "resources": {"claims": [{"name": "mig"}]}}],
                    "resourceClaims": [{"name": "mig", "resourceClaimName": name}]}}
    return [claim, pod]


def test_dynamic_mig_of_one_profile_as_capacity(kube, namespace, make_node):
    """Shares of the one 1g.10gb device: each container sees exactly the MIG devices made for its share."""
    node = make_node([{"model": "H100-80GB", "count": 1}], {"default": {
        "wholeGpu": False, "mig": "dynamic", "dynamicMig": {"profiles": ["1g.10gb"], "layout": "capacity"}}})
    assert list(published(node)) == ["gpu-0-mig-1g10gb-19"]
    pods = {k: run_objects(kube, node, namespace, [for_driver(o, node.driver) for o in
                                                   mig_share_pod(f"share-{k}", k if k > 1 else None)])[0]
            for k in (2, 1)}
    seen: dict[int, list[str]] = {}
    for k, pod in pods.items():
        prepared = node.kubelet.prepare_pod(pod)
        dev, = prepared.devices["mig"]
        assert dev.device_name == "gpu-0-mig-1g10gb-19"
        edits = container_edits(node, prepared)
        seen[k] = edits.env_map()["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert len(seen[k]) == k and all(u.startswith("MIG-") for u in seen[k]), seen
        assert len([p for p in edits.device_paths() if p.startswith("/dev/nvidia-caps/")]) == 2 * k
    # Exactly the MIG devices on the GPU, none seen by both shares, each recorded with its share.
    live = {m.uuid: m.start for m in node.mig_devices()}
    assert sorted(seen[1] + seen[2]) == sorted(live) and not set(seen[1]) & set(seen[2])
    assert sorted(live.values()) == [4, 5, 6]                        # free placements from the top
    records = node.checkpoint_claims().values()
    assert sorted(len(r["undo"]["migDevices"]) for r in records) == [1, 2]
    assert all(m["shareId"] for r in records for m in r["undo"]["migDevices"])
    delete_pod(kube, namespace, pods[2]["metadata"]["name"])
    node.kubelet.unprepare_pod(pods[2])
    assert [m.uuid for m in node.mig_devices()] == seen[1]          # only the other share's is left
    finish(kube, node, namespace, pods[1])


def test_time_slicing_slot(kube, namespace, make_node):
    node = make_node([H100], {"default": {"wholeGpu": False, "slots": {"count": 4, "strategy": "time-slicing"}}})
    devices = published(node)
    pod, = run_example(kube, node, namespace, "time-slicing-slot")
    prepared = node.kubelet.prepare_pod(pod)

    dev, = prepared.devices["slot"]
    assert "-slot-" in dev.device_name
    edits = container_edits(node, prepared)
    gpu_uuid = devices[dev.device_name]["parentUUID"]  # a slot is a share of this GPU
    assert edits.env_map()["NVIDIA_VISIBLE_DEVICES"] == gpu_uuid
    assert not any(m["containerPath"] == "/tmp/nvidia-mps" for m in edits.mounts)
    record, = node.checkpoint_claims().values()
    assert [ts["interval"] for ts in record["undo"]["timeSlices"]] == ["Long"], record

    finish(kube, node, namespace, pod)


def test_mps_slot(kube, namespace, make_node):
    node = make_node([H100], {"default": {"wholeGpu": False, "slots": {"count": 4, "strategy": "mps"}}})
    pod, = run_example(kube, node, namespace, "mps-slot")
    prepared = node.kubelet.prepare_pod(pod)

    edits = container_edits(node, prepared)
    env = edits.env_map()
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    mounts = {m["containerPath"]: m["hostPath"] for m in edits.mounts}
    assert {"/tmp/nvidia-mps", "/dev/shm"} <= set(mounts) and "/var/log/nvidia-mps" not in mounts
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"       # the slot's share, for this claim's clients
    record, = node.checkpoint_claims().values()
    use, = record["undo"]["mpsDevices"]
    daemon_dir = Path(mounts["/tmp/nvidia-mps"]).parent
    assert json.loads((daemon_dir / "daemon.json").read_text())["device"] == use["device"]

    finish(kube, node, namespace, pod)


def test_shared_claim_used_by_two_pods(kube, namespace, make_node):
    node = make_node([H100], {"default": {"wholeGpu": False, "slots": {"count": 2, "strategy": "time-slicing"}}})
    pod_a, pod_b = run_example(kube, node, namespace, "shared-claim")
    prepared_a = node.kubelet.prepare_pod(pod_a)
    prepared_b = node.kubelet.prepare_pod(pod_b)
    assert prepared_a.container_cdi_ids == prepared_b.container_cdi_ids
    calls = [c for c in node.kubelet.calls if c.method == "NodePrepareResources"]
    assert len(calls) == 1, calls  # the kubelet prepares a claim once, whichever pod comes first

    # A repeated prepare (e.g. after a kubelet restart) must give the same answer.
    claim = prepared_a.claims["slot"]
    again = node.kubelet.client(node.driver).prepare([claim])[claim.uid]
    assert again.devices == prepared_a.devices["slot"]

    delete_pod(kube, namespace, "shared-slot-a")
    assert node.kubelet.unprepare_pod(pod_a) == []  # still used by pod b
    assert len(node.cdi_spec_files()) == 1
    finish(kube, node, namespace, pod_b)


def bad_config_pod(driver: str, node: str) -> list[dict[str, Any]]:
    """One pod, two claims of one driver: a whole GPU, and a slot with a time-slicing interval that does not exist."""
    def template(name: str, device_class: str, config: dict[str, Any] | None) -> dict[str, Any]:
        spec: dict[str, Any] = {"devices": {"requests": [{"name": "dev", "exactly": {"deviceClassName": device_class}}]}}
        if config:
            spec["devices"]["config"] = [{"requests": ["dev"], "opaque": {"driver": driver, "parameters": config}}]
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
                "spec": {"spec": spec}}

    bad = {"apiVersion": "gpu.dra-driver.io/v1alpha1", "kind": "GpuConfig",
           "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Forever"}}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "two-claims"},
           "spec": {"restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": node},
                    "containers": [{"name": "cuda", "image": "busybox",
                                    "resources": {"claims": [{"name": "good"}, {"name": "bad"}]}}],
                    "resourceClaims": [{"name": "good", "resourceClaimTemplateName": "good"},
                                       {"name": "bad", "resourceClaimTemplateName": "bad"}]}}
    return [template("good", driver, None), template("bad", f"slot.{driver}", bad), pod]


def test_bad_config_fails_only_its_claim(kube, namespace, make_node):
    node = make_node([H100], {"default": {"slots": {"count": 2, "strategy": "time-slicing"}},
                              "rules": [{"match": {"index": 0}, "wholeGpu": True}]})
    for obj in bad_config_pod(node.driver, node.name):
        create(kube, namespace, obj)
    pod = wait_for_scheduled_pod(kube, namespace, "two-claims")

    with pytest.raises(PodPrepareError) as err:
        node.kubelet.prepare_pod(pod)
    bad_uid, = err.value.errors
    assert err.value.claims[bad_uid].name.startswith("two-claims-bad-")
    message = err.value.errors[bad_uid]
    assert "sharing.timeSlicing.interval" in message and "Forever" in message, message
    # the other claim of the same call is prepared, and only it
    good = next(c for c in node.kubelet.claim_cache.values() if c.ref.uid != bad_uid)
    assert good.is_prepared
    specs = node.cdi_spec_files()
    assert len(specs) == 1 and good.ref.uid in specs[0].name
    assert list(node.checkpoint_claims()) == [good.ref.uid]

    finish(kube, node, namespace, pod)


def test_health_stream_reports_published_devices(make_node):
    node = make_node([H100])
    plugin = node.kubelet.watcher.plugin(node.driver)
    assert plugin.health_service == "v1.DRAResourceHealth"
    with plugin.client.watch_health(plugin.health_service) as watch:
        update = watch.wait_for(lambda u: len(u.devices) == 2, timeout=15)
    assert {k: v[0] for k, v in update.devices.items()} == {(node.name, "gpu-0"): "HEALTHY", (node.name, "gpu-1"): "HEALTHY"}
