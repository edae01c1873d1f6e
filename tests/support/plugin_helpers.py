"""Helpers of the kubelet-plugin end-to-end tests: objects scheduled onto a simulated node, what the node
publishes and what the scheduler allocated from it, the container edits of a prepared pod, and the check that
an unprepare left nothing behind."""
from __future__ import annotations

import time
from typing import Any, Callable

from standin import ContainerEdits, PreparedPod, resolve_cdi
from standin.node import SimulatedNode
from standin.workloads import (
    create,
    delete_pod,
    for_driver,
    load_example,
    pin_to_node,
    slice_devices,
    wait_for_scheduled_pod,
)

from kube.client import KubeApi, namespaced_collection


def run_objects(kube: KubeApi, node: SimulatedNode, namespace: str,
                objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Create the objects (pods pinned to the node); return the pods once scheduled with allocated claims."""
    pods = []
    for obj in objects:
        if obj["kind"] == "Pod":
            obj = pin_to_node(obj, node.name)
            pods.append(obj["metadata"]["name"])
        create(kube, namespace, obj)
    return [wait_for_scheduled_pod(kube, namespace, p) for p in pods]


def run_example(kube: KubeApi, node: SimulatedNode, namespace: str, folder: str) -> list[dict[str, Any]]:
    """An example's objects for the node's driver, run as ``run_objects`` does."""
    return run_objects(kube, node, namespace, [for_driver(obj, node.driver) for obj in load_example(folder)])


def published(node: SimulatedNode) -> dict[str, dict[str, Any]]:
    """Published devices by name, with attributes flattened to plain values."""
    return {d["name"]: {k: next(iter(v.values())) for k, v in (d.get("attributes") or {}).items()}
            for d in slice_devices(node.wait_for_slices())}


def allocated(kube: KubeApi, namespace: str, claim_name: str) -> list[dict[str, Any]]:
    """The claim's allocation results."""
    claim = kube.get(f"{namespaced_collection('ResourceClaim', namespace)}/{claim_name}")
    return claim["status"]["allocation"]["devices"]["results"]


def allocated_device(kube: KubeApi, namespace: str, claim_name: str) -> str:
    """The one device allocated to the claim."""
    results = allocated(kube, namespace, claim_name)
    assert len(results) == 1, results
    return results[0]["device"]


def container_edits(node: SimulatedNode, prepared: PreparedPod, container: str = "cuda") -> ContainerEdits:
    """What a container runtime applies to the container: its CDI devices (all of the node's driver) resolved
    against the node's CDI spec files."""
    ids = prepared.container_cdi_ids[container]
    assert ids, f"container {container} got no CDI devices"
    for cdi_id in ids:
        assert cdi_id.startswith(f"k8s.{node.driver}/claim="), cdi_id
    return resolve_cdi([node.dirs.cdi], ids)


def finish(kube: KubeApi, node: SimulatedNode, namespace: str, pod: dict[str, Any], *,
           static_mig: bool = False) -> None:
    """Delete the pod, unprepare like the kubelet, and check that nothing is left on the node."""
    delete_pod(kube, namespace, pod["metadata"]["name"])
    node.kubelet.unprepare_pod(pod)
    assert_nothing_left(node, static_mig=static_mig)


def assert_nothing_left(node: SimulatedNode, *, static_mig: bool = False) -> None:
    """No CDI spec, checkpointed claim, MIG device, prepared device or cached claim is left on the node.
    ``static_mig``: the node has static MIG partitions, which belong to the node and stay."""
    assert node.cdi_spec_files() == [], "CDI specs left behind"
    assert node.checkpoint_claims() == {}, "claims left in the plugin's checkpoint"
    if not static_mig:
        assert node.mig_devices() == [], "MIG devices left on the GPUs"
    assert node.mps_daemons() == {}, "MPS daemons left running"
    assert not any((node.dirs.state / "mps").glob("*")), "MPS daemon directories left behind"
    hardware = node.hardware()
    modes = {u: hardware.nvmlDeviceGetComputeMode(hardware.nvmlDeviceGetHandleByUUID(u)) for u in hardware.gpu_uuids}
    assert set(modes.values()) <= {hardware.NVML_COMPUTEMODE_DEFAULT}, f"compute modes not restored: {modes}"
    metrics = node.metrics()
    assert metrics["gpu_dra_prepared_claims"] == 0
    assert metrics["gpu_dra_dynamic_mig_devices"] == 0
    assert metrics['gpu_dra_devices{state="prepared"}'] == 0
    assert node.kubelet.claim_cache == {}


def eventually(probe: Callable[[], Any], done: Callable[[Any], bool], timeout: float = 15.0) -> Any:
    """The first value of ``probe()`` that ``done`` accepts (the plugin writes claim status after answering the
    kubelet), else the last one once ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.1)
