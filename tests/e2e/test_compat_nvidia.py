"""NVIDIA compatibility mode end to end on the real control plane: objects written for NVIDIA's DRA driver
(classes gpu.nvidia.com / mig.nvidia.com, opaque configs resource.nvidia.com/v1beta1) and pods written for
NVIDIA's device plugin (``nvidia.com/gpu: 1`` in their limits) work unchanged against ``gpu-dra kubelet-plugin
--compat-nvidia``.

The real scheduler allocates from the plugin's slices (for extended resources it also makes the claim), the
kubelet stand-in prepares the pod's claims on the plugin, and the CDI files and the plugin's checkpoint show
what was done to the simulated GPUs. Pods never run: there is no kubelet.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from plugin_helpers import container_edits, finish, published, run_objects
from standin import EXTENDED_RESOURCE_CLAIM, PodPrepareError
from standin.node import SimulatedNode
from standin.workloads import create, delete_pod, get, pin_to_node, wait_for_scheduled_pod, wait_until

from api.names import NVIDIA_DRIVER_NAME
from kube.client import DEVICE_CLASSES, RESOURCE_V1

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nvidia-compat"
H100 = {"model": "H100-80GB", "count": 1}
NVIDIA_CONFIG = "resource.nvidia.com/v1beta1"


def load(file: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLE / file).read_text()) if d]


@pytest.fixture
def compat_nvidia() -> bool:
    """Every plugin here runs with ``--compat-nvidia`` under NVIDIA's driver name."""
    return True


def only_claim(node: SimulatedNode) -> dict[str, Any]:
    records = list(node.checkpoint_claims().values())
    assert len(records) == 1, records
    return records[0]


# --- tests ------------------------------------------------------------------------------------------------

def test_compat_classes_are_nvidias(kube, nvidia_classes):
    """The classes users' claims name exist under NVIDIA's names; gpu.nvidia.com serves nvidia.com/gpu (as the
    API server stored it: a server without the field would drop it)."""
    gpu, mig = (kube.get(f"{DEVICE_CLASSES}/{name}") for name in ("gpu.nvidia.com", "mig.nvidia.com"))
    assert gpu["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert "extendedResourceName" not in mig["spec"]
    assert gpu["spec"]["selectors"][0]["cel"]["expression"] == (
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'")


def test_nvidia_gpu_claim_with_time_slicing(kube, namespace, make_node):
    """An NVIDIA-driver claim template (productName/type CEL, GpuConfig TimeSlicing Long) is allocated by the
    scheduler and prepared by our plugin: right CDI edits, and the GPU got the Long time-slice interval."""
    node = make_node([H100])
    devices = published(node)
    assert devices["gpu-0"]["productName"] == "NVIDIA H100 80GB HBM3" and devices["gpu-0"]["type"] == "gpu"
    pod, = run_objects(kube, node, namespace, load("gpu-time-slicing.yaml"))

    claim = get(kube, "ResourceClaim", namespace, pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"])
    result, = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"], result["device"]) == (NVIDIA_DRIVER_NAME, node.name, "gpu-0")
    config, = claim["status"]["allocation"]["devices"]["config"]
    assert config["opaque"]["parameters"]["apiVersion"] == NVIDIA_CONFIG  # passed through untouched

    prepared = node.kubelet.prepare_pod(pod)
    dev, = prepared.devices["gpu"]
    assert (dev.pool_name, dev.device_name, dev.request_names) == (node.name, "gpu-0", ("gpu",))
    edits = container_edits(node, prepared)
    assert edits.env_map()["NVIDIA_VISIBLE_DEVICES"] == devices["gpu-0"]["uuid"]
    assert {"/dev/nvidia0", "/dev/nvidiactl"} <= set(edits.device_paths())
    assert not any(m["containerPath"] == "/tmp/nvidia-mps" for m in edits.mounts)  # time-slicing, not MPS

    record = only_claim(node)
    time_slice, = record["undo"]["timeSlices"]
    assert time_slice["interval"] == "Long", record      # timeSlicingConfig.interval, mapped and applied
    assert time_slice["gpuUuids"] == [devices["gpu-0"]["uuid"]]
    assert record["undo"]["mpsDevices"] == []

    finish(kube, node, namespace, pod)


def test_nvidia_mig_claim_with_mps(kube, namespace, make_node):
    """A mig.nvidia.com claim with an NVIDIA MigDeviceConfig (MPS, defaultActiveThreadPercentage,
    defaultPinnedDeviceMemoryLimit) on an H100 with dynamic MIG: the partition is created for the claim and an
    MPS daemon with the mapped limits serves it."""
    node = make_node([H100], {"default": {"mig": "dynamic"}})
    assert any("-mig-1g10gb-" in name for name in published(node))
    pod, = run_objects(kube, node, namespace, load("mig-mps.yaml"))

    prepared = node.kubelet.prepare_pod(pod)
    dev, = prepared.devices["mig"]
    assert dev.device_name.startswith("gpu-0-mig-1g10gb-19-")
    edits = container_edits(node, prepared)
    env = edits.env_map()
    mig_uuid = env["NVIDIA_VISIBLE_DEVICES"]
    assert mig_uuid.startswith("MIG-")
    assert len([p for p in edits.device_paths() if p.startswith("/dev/nvidia-caps/")]) == 2
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"

    record = only_claim(node)
    mig, = record["undo"]["migDevices"]                  # created for this claim (dynamic MIG)
    assert mig["device"] == dev.device_name
    use, = record["undo"]["mpsDevices"]
    assert use["device"] == mig_uuid                     # the daemon serves the new MIG device
    env = edits.env_map()
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"           # defaultActiveThreadPercentage
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"       # defaultPinnedDeviceMemoryLimit: 4Gi
    assert {m["containerPath"]: m["hostPath"] for m in edits.mounts}["/tmp/nvidia-mps"] == \
        str(node.dirs.state / "mps" / hashlib.sha256(mig_uuid.encode()).hexdigest()[:12] / "pipe")

    finish(kube, node, namespace, pod)


def test_device_plugin_style_pod_gets_a_gpu_through_dra(kube, namespace, make_node):
    """A pod with ``nvidia.com/gpu: 1`` in its limits and no resourceClaims: the scheduler serves the extended
    resource through the DeviceClass's extendedResourceName on a node that does not advertise it, makes the
    claim, records it in the pod status, and the plugin prepares it like any claim."""
    node = make_node([H100])
    devices = published(node)
    node_obj = kube.get(f"/api/v1/nodes/{node.name}")
    assert "nvidia.com/gpu" not in node_obj["status"]["allocatable"]  # no device plugin on this node
    objects = load("extended-resource.yaml")
    pod_spec, = objects
    assert "resourceClaims" not in pod_spec["spec"]
    assert pod_spec["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    pod_name = pod_spec["metadata"]["name"]
    create(kube, namespace, pin_to_node(pod_spec, node.name))

    def claimed() -> dict[str, Any] | None:
        pod = get(kube, "Pod", namespace, pod_name) or {}
        status = (pod.get("status") or {}).get("extendedResourceClaimStatus")
        if not pod.get("spec", {}).get("nodeName") or not status:
            return None
        claim = get(kube, "ResourceClaim", namespace, status["resourceClaimName"]) or {}
        reserved = (claim.get("status") or {}).get("reservedFor") or []
        return pod if any(r.get("uid") == pod["metadata"]["uid"] for r in reserved) else None

    try:
        pod = wait_until(claimed, 60, f"pod {pod_name} bound with its extended-resource claim")
    except AssertionError as exc:
        pod = get(kube, "Pod", namespace, pod_name) or {}
        raise AssertionError(f"{exc}; pod conditions: {pod.get('status', {}).get('conditions')}") from None
    assert pod["spec"]["nodeName"] == node.name
    status = pod["status"]["extendedResourceClaimStatus"]
    mapping, = status["requestMappings"]
    assert (mapping["containerName"], mapping["resourceName"]) == ("cuda", "nvidia.com/gpu")

    claim = get(kube, "ResourceClaim", namespace, status["resourceClaimName"])
    assert "resource.kubernetes.io/extended-resource-claim" in (claim["metadata"].get("annotations") or {})
    request, = claim["spec"]["devices"]["requests"]
    assert request["name"] == mapping["requestName"]
    assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    result, = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"], result["device"]) == (NVIDIA_DRIVER_NAME, node.name, "gpu-0")

    prepared = node.kubelet.prepare_pod(pod)
    dev, = prepared.devices[EXTENDED_RESOURCE_CLAIM]
    assert (dev.device_name, dev.request_names) == ("gpu-0", (mapping["requestName"],))
    edits = container_edits(node, prepared)
    assert edits.env_map()["NVIDIA_VISIBLE_DEVICES"] == devices["gpu-0"]["uuid"]
    assert "/dev/nvidia0" in edits.device_paths()
    assert only_claim(node)["undo"]["timeSlices"] == []  # no config: the GPU's settings are left alone

    finish(kube, node, namespace, pod)


def test_node_with_a_device_plugin_keeps_serving_nvidia_gpu_itself(kube, namespace, make_node, cluster):
    """Where the kubelet advertises nvidia.com/gpu (NVIDIA's device plugin still runs), the scheduler counts the
    pod against that allocatable and makes no claim: DRA serves the extended resource only on other nodes."""
    node = make_node([H100])
    cluster.request("PATCH", f"/api/v1/nodes/{node.name}/status",
                    {"status": {"capacity": {"nvidia.com/gpu": "1"}, "allocatable": {"nvidia.com/gpu": "1"}}},
                    content_type="application/merge-patch+json")
    pod_spec, = load("extended-resource.yaml")
    create(kube, namespace, pin_to_node(pod_spec, node.name))
    pod = wait_until(lambda: (p := get(kube, "Pod", namespace, pod_spec["metadata"]["name"])) and
                     p["spec"].get("nodeName") and p, 60, "the pod to be bound")
    assert "extendedResourceClaimStatus" not in pod.get("status", {})
    assert kube.list(f"{RESOURCE_V1}/namespaces/{namespace}/resourceclaims")["items"] == []
    delete_pod(kube, namespace, pod["metadata"]["name"])


def nvidia_claim_pod(node: str, configs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One pod with one claim per entry: a whole GPU from gpu.nvidia.com with that NVIDIA opaque config."""
    templates = []
    for name, parameters in configs.items():
        spec = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
                            "config": [{"requests": ["gpu"],
                                        "opaque": {"driver": NVIDIA_DRIVER_NAME, "parameters": parameters}}]}}
        templates.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                          "metadata": {"name": name}, "spec": {"spec": spec}})
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "nvidia-configs"},
           "spec": {"restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": node},
                    "containers": [{"name": "cuda", "image": "busybox",
                                    "resources": {"claims": [{"name": n} for n in configs]}}],
                    "resourceClaims": [{"name": n, "resourceClaimTemplateName": n} for n in configs]}}
    return [*templates, pod]


def test_unsupported_nvidia_config_fails_only_its_claim(kube, namespace, make_node):
    """NVIDIA settings this driver does not implement (multi-user MPS, VFIO passthrough) fail their own claim
    with a message naming the field; a supported NVIDIA config in the same pod is prepared."""
    node = make_node([{"model": "H100-80GB", "count": 3}])
    good = {"apiVersion": NVIDIA_CONFIG, "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}}
    multi_user = {"apiVersion": NVIDIA_CONFIG, "kind": "GpuConfig",
                  "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50,
                                                               "multiUser": True}}}
    vfio = {"apiVersion": NVIDIA_CONFIG, "kind": "VfioDeviceConfig",
            "iommu": {"backendPolicy": "LegacyOnly", "enableAPIDevice": False}}
    for obj in nvidia_claim_pod(node.name, {"good": good, "multi-user": multi_user, "vfio": vfio}):
        create(kube, namespace, obj)
    pod = wait_for_scheduled_pod(kube, namespace, "nvidia-configs")

    with pytest.raises(PodPrepareError) as err:
        node.kubelet.prepare_pod(pod)
    by_claim = {err.value.claims[uid].name.rsplit("-", 1)[0]: message for uid, message in err.value.errors.items()}
    assert set(by_claim) == {"nvidia-configs-multi-user", "nvidia-configs-vfio"}, by_claim

    message = by_claim["nvidia-configs-multi-user"]
    assert "sharing.mpsConfig.multiUser" in message and "not supported" in message, message
    assert NVIDIA_CONFIG in message and "GpuConfig" in message, message
    message = by_claim["nvidia-configs-vfio"]
    assert "kind" in message and "VfioDeviceConfig" in message and "GpuConfig, MigDeviceConfig" in message, message

    good_claim, = [c for c in node.kubelet.claim_cache.values() if c.ref.uid not in err.value.errors]
    assert good_claim.is_prepared
    assert list(node.checkpoint_claims()) == [good_claim.ref.uid]
    time_slice, = node.checkpoint_claims()[good_claim.ref.uid]["undo"]["timeSlices"]
    assert time_slice["interval"] == "Short"

    finish(kube, node, namespace, pod)
