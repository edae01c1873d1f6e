"""The plugin's life with a real kubelet: start-up while pods wait for it, deletes that unprepare, restarts of
the plugin and of the kubelet under running pods, device health in the pod status.

One real node (kubelet v1.37, containerd 2, runc) for the module, with the kubelet's default pod resync
period (one minute): a pod whose preparation failed waits that long for the next try, so a slow test here
means a missed event, not a slow machine.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from realnode_helpers import RealNode, simulate
from standin.workloads import for_driver, load_example, wait_until

from api.names import DEFAULT_DRIVER_NAME
from testbed.nodeplugin import LocalNodePlugin

pytestmark = pytest.mark.e2e

# The kubelet's default; LocalNode's own is 10 s, which would hide a missed prepare behind a quick retry.
KUBELET_SYNC = "1m"
PROMPT_S = 15.0
# The slice publisher repairs externally deleted slices after 30 s; a restarted kubelet's re-registration
# must not wait for that.
SLICES_BACK_S = 10.0


@pytest.fixture(scope="module")
def real() -> Iterator[RealNode]:
    with RealNode(kubelet_config={"syncFrequency": KUBELET_SYNC}).running(classes=False) as node:
        yield node


def test_a_pod_created_while_the_plugin_starts_runs_promptly(real: RealNode) -> None:
    """The pod exists before the plugin does, so the scheduler binds it the moment the plugin's slices appear.
    If they appeared before the kubelet had registered the plugin, the kubelet's prepare would fail ("driver
    not registered") and the pod would wait for the next resync, a minute later."""
    driver = "startup.e2e.dra-driver.io"     # a driver of its own: nothing of it is published yet
    real.add_classes(driver=driver)
    namespace = real.namespace("startup")
    plugin = real.plugin(driver)
    plugin.start()
    pod_name, = real.apply(namespace, [for_driver(o, driver) for o in load_example("gpu-by-family")])
    assert real.kube is not None
    t_slices = wait_until(lambda: real.wait_for_slices(plugin) and time.monotonic(), 60,
                          "the new plugin's slices")
    pod = real.wait_running(namespace, pod_name, timeout=90)
    took = time.monotonic() - t_slices
    events = real.events(namespace, pod_name)
    print(f"pod Running {took:.1f}s after the plugin's slices appeared; events:\n{events}")
    assert pod["spec"]["nodeName"] == real.node.name  # type: ignore[union-attr]
    assert "FailedPrepareDynamicResources" not in events, events
    assert took < PROMPT_S, f"pod took {took:.1f}s to run after the slices appeared; events:\n{events}"
    uid = real.claim_of(namespace, pod, "gpu")["metadata"]["uid"]
    real.delete_pod(namespace, pod_name)
    real.wait_unprepared(plugin, [uid])
    plugin.stop()


# ---- restarts under running pods ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ours(real: RealNode) -> LocalNodePlugin:
    real.add_classes()
    return real.start_plugin(real.plugin(DEFAULT_DRIVER_NAME))


def start_mig_and_mps_pods(real: RealNode, namespace: str) -> dict[str, dict[str, Any]]:
    """The dynamic-MIG and the MPS-slot examples running; pod name -> the pod, with what it holds."""
    real.namespace(namespace)
    pods = real.apply(namespace, load_example("mig-partition") + load_example("mps-slot"))
    return {p: real.wait_running(namespace, p) for p in pods}


def container_pid(real: RealNode, namespace: str, pod: str) -> int:
    assert real.node is not None
    cid = real.node.container_ids(namespace, pod)["cuda"]
    return real.node.running_tasks()[cid]


def held(real: RealNode, plugin: LocalNodePlugin, namespace: str, pods: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the running pods hold on the node: claim UIDs with their CDI specs, the dynamic MIG device, the
    running MPS control daemon (pid and pipe directory)."""
    uids = sorted(real.claim_of(namespace, p, p["spec"]["resourceClaims"][0]["name"])["metadata"]["uid"]
                  for p in pods.values())
    static = {a["uuid"] for a in real.devices(plugin).values() if a["type"] == "mig" and "uuid" in a}
    migs = [m.uuid for m in real.mig_devices(plugin) if m.uuid not in static]
    daemons = plugin.mps_daemons()
    assert len(daemons) == 1 and all(d.is_dir() for d in daemons.values()) and len(migs) == 1, (daemons, migs)
    assert all(real.cdi_files(u) for u in uids) and set(real.checkpoint_claims(plugin)) == set(uids)
    return {"uids": uids, "mps": daemons, "mig": migs[0]}


def registered_count(plugin: LocalNodePlugin) -> int:
    """How often a kubelet has confirmed this plugin process's registration (its log says so each time)."""
    return plugin.log_path.read_text(errors="replace").count("registered with the kubelet")


def assert_still_running(real: RealNode, namespace: str, pods: dict[str, dict[str, Any]],
                         pids: dict[str, int]) -> None:
    for name, before in pods.items():
        pod = real.pod(namespace, name)
        status, = pod["status"]["containerStatuses"]
        assert pod["status"]["phase"] == "Running" and pod["metadata"]["uid"] == before["metadata"]["uid"]
        assert status["restartCount"] == 0 and "running" in status["state"], status
        assert container_pid(real, namespace, name) == pids[name]


def delete_and_check_unprepared(real: RealNode, plugin: LocalNodePlugin, namespace: str,
                                pods: dict[str, dict[str, Any]], holding: dict[str, Any]) -> None:
    for name in pods:
        real.delete_pod(namespace, name)
    real.wait_unprepared(plugin, holding["uids"])
    assert holding["mig"] not in {m.uuid for m in real.mig_devices(plugin)}, "the dynamic MIG device was left"
    assert plugin.mps_daemons() == {}, "the MPS control daemon was left running"
    assert not [d for d in holding["mps"].values() if d.exists()], "the MPS daemon's directory was left"
    assert plugin.metrics()["gpu_dra_prepared_claims"] == 0


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_restarting_the_plugin_keeps_pods_running_and_a_later_delete_unprepares(
        real: RealNode, ours: LocalNodePlugin, how: str) -> None:
    namespace = f"plugin-restart-{how}"
    pods = start_mig_and_mps_pods(real, namespace)
    pids = {p: container_pid(real, namespace, p) for p in pods}
    holding = held(real, ours, namespace, pods)

    ours.kill() if how == "sigkill" else ours.stop()
    assert ours.mps_daemons() == holding["mps"], "the MPS daemon must outlive the plugin process"
    ours.start()
    ours.wait_registered()
    # The new process took the prepared claims and the daemon over; nothing was undone or restarted.
    assert ours.metrics()["gpu_dra_prepared_claims"] == 2
    assert held(real, ours, namespace, pods) == holding
    assert_still_running(real, namespace, pods, pids)

    delete_and_check_unprepared(real, ours, namespace, pods, holding)


def test_device_health_reaches_the_pod_status_and_clears_on_recovery(real: RealNode, ours: LocalNodePlugin) -> None:
    """An XID on the pod's GPU: the plugin's health stream tells the kubelet, which shows the device Unhealthy
    in the container's allocatedResourcesStatus (ResourceHealthStatus, on by default in 1.37); the operator's
    recovery makes it Healthy again."""
    namespace = real.namespace("health")
    gpu0 = real.devices(ours)["gpu-0"]["uuid"]
    cel = f"device.attributes['{DEFAULT_DRIVER_NAME}'].uuid == '{gpu0}'"
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "gpu0"},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": DEFAULT_DRIVER_NAME, "selectors": [{"cel": {"expression": cel}}]}}]}}}}
    pod = next(o for o in load_example("gpu-by-family") if o["kind"] == "Pod")
    pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = "gpu0"
    name, = real.apply(namespace, [template, pod])
    real.wait_running(namespace, name)

    def health() -> str:
        """The one device's health in the container's allocatedResourcesStatus ("" while it has none)."""
        status, = real.pod(namespace, name)["status"]["containerStatuses"]
        entries = status.get("allocatedResourcesStatus") or []
        resources = [r for e in entries for r in e.get("resources") or []]
        if not resources:
            return ""
        (entry,), (resource,) = entries, resources
        # The kubelet names the device by its CDI id (ours: k8s.<driver>/claim=<claim uid>-<device>).
        assert entry["name"] == "claim:gpu" and resource["resourceID"].endswith("-gpu-0"), entries
        return str(resource.get("health", ""))

    wait_until(lambda: health() == "Healthy", 30, "gpu-0 Healthy in the pod status")
    t0 = time.monotonic()
    simulate(ours, "xid", "--gpu", "0", "--xid", "79")
    wait_until(lambda: health() == "Unhealthy", 30, "gpu-0 Unhealthy in the pod status")
    print(f"XID 79 -> Unhealthy in the pod status after {time.monotonic() - t0:.1f}s: "
          f"{real.pod(namespace, name)['status']['containerStatuses'][0]['allocatedResourcesStatus']}")
    assert real.pod(namespace, name)["status"]["phase"] == "Running"   # reported, not evicted

    t0 = time.monotonic()
    simulate(ours, "recover", "--gpu", "0")
    wait_until(lambda: health() == "Healthy", 30, "gpu-0 Healthy again in the pod status")
    print(f"recover -> Healthy in the pod status after {time.monotonic() - t0:.1f}s")
    real.delete_pod(namespace, name)


def test_restarting_the_kubelet_keeps_pods_running_and_a_later_delete_unprepares(
        real: RealNode, ours: LocalNodePlugin) -> None:
    namespace = "kubelet-restart"
    pods = start_mig_and_mps_pods(real, namespace)
    pids = {p: container_pid(real, namespace, p) for p in pods}
    holding = held(real, ours, namespace, pods)
    assert real.node is not None
    unprepares = ours.metrics().get('gpu_dra_grpc_requests_total{method="NodeUnprepareResources",version="v1"}', 0)

    registrations = registered_count(ours)
    old_slices = {s["metadata"]["uid"] for s in real.wait_for_slices(ours)}
    real.node.restart_kubelet(downtime=2.0)
    ready = time.monotonic()
    # The new kubelet finds the plugin in its registry directory again and syncs the pods; neither it nor the
    # plugin may undo anything.
    wait_until(lambda: registered_count(ours) > registrations, 30, "the new kubelet to register the plugin")
    # It also deleted the node's slices when it started; the plugin publishes them again when re-registered.
    wait_until(lambda: not old_slices & {s["metadata"]["uid"] for s in real.wait_for_slices(ours)}, 60,
               "the slices deleted by the starting kubelet to be published again")
    back = time.monotonic() - ready
    print(f"slices published again {back:.1f}s after the restarted kubelet was Ready")
    assert back < SLICES_BACK_S, f"slices came back {back:.1f}s after the kubelet restart"
    time.sleep(3)
    assert_still_running(real, namespace, pods, pids)
    assert held(real, ours, namespace, pods) == holding
    assert ours.metrics().get('gpu_dra_grpc_requests_total{method="NodeUnprepareResources",version="v1"}', 0) \
        == unprepares

    delete_and_check_unprepared(real, ours, namespace, pods, holding)
