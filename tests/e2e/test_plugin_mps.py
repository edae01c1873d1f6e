"""MPS end to end on the real control plane with a simulated node: the plugin process drives real daemon
processes (the simulated ``nvidia-cuda-mps-control``) through the same code as on real GPUs. Four MPS slot
claims of one GPU share one daemon, each claim's clients get their own limits, the daemon outlives a killed
plugin untouched, and the last unprepare stops it and gives the GPU its compute mode back. With the slots as
one capacity device (slots.layout: capacity), each share's clients get the limits of the slots it holds."""
from __future__ import annotations

from typing import Any

from plugin_helpers import assert_nothing_left, container_edits, run_objects
from standin.node import SimulatedNode, kill_mps_daemons_under
from standin.workloads import for_driver

from kube.client import KubeApi

H100 = {"model": "H100-80GB", "count": 1}
SLOTS = {"default": {"wholeGpu": False, "slots": {"count": 4, "strategy": "mps"}}}


def slot_pod(name: str, threads: int | None, memory: str | None, slots: int | None = None) -> list[dict[str, Any]]:
    """A pod and its claim for one MPS slot, with its own limits (None: the slot's), and `slots` of a slot
    device with capacity."""
    exactly: dict[str, Any] = {"deviceClassName": "slot.gpu.dra-driver.io"}
    if slots is not None:
        exactly["capacity"] = {"requests": {"slots": str(slots)}}
    devices: dict[str, Any] = {"requests": [{"name": "slot", "exactly": exactly}]}
    if threads is not None and memory is not None:
        devices["config"] = [{"requests": ["slot"], "opaque": {"driver": "gpu.dra-driver.io", "parameters": {
            "apiVersion": "gpu.dra-driver.io/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": threads,
                                                   "pinnedMemoryLimit": memory}}}}}]
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
             "spec": {"devices": devices}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"restartPolicy": "Never",
                    "containers": [{"name": "cuda", "image": "cuda", "resources": {"claims": [{"name": "slot"}]}}],
                    "resourceClaims": [{"name": "slot", "resourceClaimName": name}]}}
    return [claim, pod]


def compute_mode(node: SimulatedNode) -> int:
    hw = node.hardware()
    return hw.nvmlDeviceGetComputeMode(hw.nvmlDeviceGetHandleByUUID(hw.gpu_uuids[0]))


def test_mps_slots_share_one_daemon_that_outlives_the_plugin(kube: KubeApi, namespace: str, make_node: Any) -> None:
    node = make_node([H100], SLOTS)
    limits = {"a": (10, "8Gi"), "b": (20, "16Gi"), "c": (15, "4Gi"), "d": (25, "1Gi")}   # within a 25 % share
    pods = {}
    for name, (threads, memory) in limits.items():
        pod, = run_objects(kube, node, namespace,
                           [for_driver(o, node.driver) for o in slot_pod(f"mps-{name}", threads, memory)])
        pods[name] = pod
    envs = {}
    for name, pod in pods.items():
        env = container_edits(node, node.kubelet.prepare_pod(pod)).env_map()
        envs[name] = (env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"])
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    # Each claim's clients carry their own limits; one daemon serves all four.
    assert envs == {"a": ("10", "0=8192M"), "b": ("20", "0=16384M"), "c": ("15", "0=4096M"), "d": ("25", "0=1024M")}
    daemons = node.mps_daemons()
    assert len(daemons) == 1, daemons
    (pid, pipe), = daemons.items()
    hw = node.hardware()
    assert compute_mode(node) == hw.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS

    node.restart_plugin(crash=True)                               # SIGKILL: no chance to clean up
    assert node.mps_daemons() == {pid: pipe}                      # the same process, untouched
    for name, pod in pods.items():                                # the kubelet asks again after the restart
        env = container_edits(node, node.kubelet.prepare_pod(pod)).env_map()
        assert (env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == envs[name]
    assert node.mps_daemons() == {pid: pipe}

    for name in ("a", "b", "c"):
        node.kubelet.unprepare_pod(pods[name])
        assert node.mps_daemons() == {pid: pipe}                  # still serving the last claim
    node.kubelet.unprepare_pod(pods["d"])
    assert node.mps_daemons() == {}
    assert compute_mode(node) == hw.NVML_COMPUTEMODE_DEFAULT
    assert_nothing_left(node)


def test_a_daemon_that_died_with_its_claims_prepared_is_started_again(kube: KubeApi, namespace: str,
                                                                      make_node: Any) -> None:
    node = make_node([H100], SLOTS)
    pod, = run_objects(kube, node, namespace, [for_driver(o, node.driver) for o in slot_pod("mps-one", 25, "2Gi")])
    node.kubelet.prepare_pod(pod)
    (pid, _), = node.mps_daemons().items()
    node.plugin.stop()
    kill_mps_daemons_under(node.dirs.base)                        # the node lost the daemon meanwhile
    node.restart_plugin()
    daemons = node.mps_daemons()
    assert len(daemons) == 1 and pid not in daemons               # a new daemon for the prepared claim
    node.kubelet.unprepare_pod(pod)
    assert_nothing_left(node)


def test_shares_of_a_slot_device_with_capacity_get_their_slots_worth(kube: KubeApi, namespace: str,
                                                                     make_node: Any) -> None:
    node = make_node([H100], {"default": {"wholeGpu": False,
                                          "slots": {"count": 4, "strategy": "mps", "layout": "capacity"}}})
    wanted = {"one": (None, None, None), "two": (None, None, 2), "tuned": (10, "2Gi", None)}
    pods = {name: run_objects(kube, node, namespace, [for_driver(o, node.driver) for o in
                                                      slot_pod(f"share-{name}", threads, memory, slots)])[0]
            for name, (threads, memory, slots) in wanted.items()}
    hw = node.hardware()
    quarter_mib = (hw.nvmlDeviceGetMemoryInfo(hw.nvmlDeviceGetHandleByUUID(hw.gpu_uuids[0])).total >> 20) // 4
    envs, shares = {}, set()
    for name, pod in pods.items():
        prepared = node.kubelet.prepare_pod(pod)
        (dev,) = prepared.devices["slot"]
        assert dev.device_name == "gpu-0-slots", dev
        shares.add(dev.cdi_device_ids)
        env = container_edits(node, prepared).env_map()
        envs[name] = (env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"])
    # One slot: a quarter of the GPU; two slots: half; a config lowers its share's limits.
    assert envs == {"one": ("25", f"0={quarter_mib}M"), "two": ("50", f"0={2 * quarter_mib}M"),
                    "tuned": ("10", "0=2048M")}
    assert len(shares) == 3                                       # one CDI device per share
    assert len(node.mps_daemons()) == 1                           # one daemon serves the GPU's shares
    for pod in pods.values():
        node.kubelet.unprepare_pod(pod)
    assert node.mps_daemons() == {}
    assert compute_mode(node) == hw.NVML_COMPUTEMODE_DEFAULT
    assert_nothing_left(node)
