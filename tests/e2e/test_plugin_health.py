"""Device health and claim device status of the kubelet plugin, end to end on the real control plane.

Faults are injected while the plugin runs, with ``gpu-dra simulate`` on the node's simulated-GPU state file, as
an operator's tool would: the plugin must turn them into device taints in its ResourceSlices (one slice write
per event), report them on the kubelet's health stream, and the real scheduler must respect them. Recovery,
by the operator's word or by the quiet period, must undo all of it.

After a prepare, the claim's ``status.devices`` must say which GPU or MIG device the plugin used; the unprepare
writes nothing, and the API server drops our entries when the claim is deallocated. The status test runs the plugin as the chart's service account, with a token
bound to a pod on the node, so the chart's RBAC is what the API server checks.
"""
from __future__ import annotations

import base64
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import yaml
from allocation_helpers import claim_with_pod, wait_unschedulable
from plugin_helpers import allocated_device, eventually, run_objects
from standin import resolve_cdi
from standin.node import REPO, SimulatedNode
from standin.workloads import (
    create,
    delete_pod,
    for_driver,
    get,
    load_example,
    pin_to_node,
    slice_devices,
    wait_for_scheduled_pod,
    wait_until,
)

from kube.client import SLICES, ApiError, KubeApi, iter_json_lines

pytestmark = pytest.mark.e2e

H100_PAIR = [{"model": "H100-80GB", "count": 2}]
# Every GPU also published as dynamic MIG partitions and two time-slicing slots: a GPU's fault must reach all.
PARTITIONED = {"default": {"mig": "dynamic", "slots": {"count": 2, "strategy": "time-slicing"}}}
SETTLE_S = 1.5          # after the expected state: time for any further (unwanted) slice write to show up
CHART_RBAC = REPO / "deploy" / "helm" / "gpu-dra-driver" / "templates" / "rbac-kubelet-plugin.yaml"


# --- helpers -----------------------------------------------------------------------------------------------

def simulate(node: SimulatedNode, *args: str) -> str:
    """``gpu-dra simulate ...`` on the node's state file, as its own process; its output."""
    proc = subprocess.run([sys.executable, "-m", "cli.main", "simulate", *args, "--sim-state", str(node.dirs.sim_state)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"gpu-dra simulate {' '.join(args)} failed:\n{proc.stderr}"
    return proc.stdout


def on_gpu(name: str, minor: int) -> bool:
    return name == f"gpu-{minor}" or name.startswith(f"gpu-{minor}-")


def published_taints(node: SimulatedNode) -> dict[str, list[tuple[str, str | None, str]]]:
    """Device name -> its taints as (key, value, effect), from the node's current, complete pool."""
    slices = node.wait_for_slices()
    return {d["name"]: sorted((t["key"], t.get("value"), t["effect"]) for t in d.get("taints") or [])
            for d in slice_devices(slices)}


def wait_for_taints(node: SimulatedNode, expected: Any, timeout: float = 20.0) -> dict[str, list]:
    """The published taints once ``expected(taints)`` holds."""
    def check() -> dict[str, list] | None:
        taints = published_taints(node)
        return taints if expected(taints) else None

    return wait_until(check, timeout, f"the taints of {node.name}'s devices to match")


def assert_updates_in_place(events: list[tuple[str, str, int]], generation: int, most: int = 1) -> None:
    """Up to ``most`` updates (at least one) of existing slices, all in the pool generation ``generation``:
    no slice created or deleted, no rewrite of the pool under a new generation."""
    assert 1 <= len(events) <= most and all(e[0] == "MODIFIED" and e[2] == generation for e in events), \
        f"expected at most {most} in-place slice update(s) in generation {generation}, got {events}"


class SliceWrites:
    """The ResourceSlice writes of one driver as the API server reports them (a watch from now on)."""

    def __init__(self, kube: KubeApi, driver: str):
        selector = f"spec.driver={driver}"
        rv = kube.list(SLICES, field_selector=selector)["resourceVersion"]
        self._resp = kube.request("GET", SLICES, query={"watch": "true", "fieldSelector": selector,
                                                         "resourceVersion": rv, "timeoutSeconds": 900},
                                  stream=True, timeout=960)
        self._lock = threading.Lock()
        self.events: list[tuple[str, str, int]] = []     # (type, slice name, pool generation)
        self._thread = threading.Thread(target=self._consume, daemon=True)
        self._thread.start()

    def _consume(self) -> None:
        try:
            for event in iter_json_lines(self._resp):
                if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                    obj = event["object"]
                    with self._lock:
                        self.events.append((event["type"], obj["metadata"]["name"],
                                            obj["spec"]["pool"]["generation"]))
        except Exception:  # noqa: BLE001 - the connection is closed at the end of the test
            pass

    def mark(self) -> int:
        with self._lock:
            return len(self.events)

    def since(self, mark: int) -> list[tuple[str, str, int]]:
        time.sleep(SETTLE_S)
        with self._lock:
            return self.events[mark:]

    def close(self) -> None:
        # Shut the socket down first: it interrupts the reading thread, which holds the stream until then.
        self._resp.shutdown()
        self._thread.join(timeout=10)
        self._resp.close()


def pool_generation(node: SimulatedNode) -> int:
    return max(s["spec"]["pool"]["generation"] for s in node.wait_for_slices())


def health_watch(node: SimulatedNode):
    plugin = node.kubelet.watcher.plugin(node.driver)
    return plugin.client.watch_health(plugin.health_service)


def health_after(watch: Any, since: float, expected: Any, timeout: float = 20.0) -> dict[str, str]:
    """Device -> health of the first stream message received after ``since`` that satisfies ``expected``."""
    update = watch.wait_for(lambda u: u.received > since and expected({k[1]: v[0] for k, v in u.devices.items()}),
                            timeout=timeout)
    return {k[1]: v[0] for k, v in update.devices.items()}


def whole_gpu_claim_and_pod(name: str, driver: str, node: str, cel: str | None = None) -> list[dict[str, Any]]:
    """A claim for one whole GPU of ``driver`` and a pod on ``node`` whose container ``cuda`` uses it."""
    claim, pod = claim_with_pod(name, driver, cel, request="gpu", container="cuda")
    return [claim, pin_to_node(pod, node)]


# --- device health -----------------------------------------------------------------------------------------

def test_critical_xid_taints_one_gpu_and_the_scheduler_avoids_it(kube, namespace, make_node):
    node = make_node(H100_PAIR, PARTITIONED, extra_args=("--health-quiet-period", "0"))
    xid_key = f"{node.driver}/xid"
    before = published_taints(node)
    gpu1 = sorted(n for n in before if on_gpu(n, 1))
    assert len(gpu1) > 10 and any("-mig-" in n for n in gpu1) and any("-slot-" in n for n in gpu1), gpu1
    assert all(t == [] for t in before.values())
    generation = pool_generation(node)
    writes = SliceWrites(kube, node.driver)
    watch = health_watch(node)
    pods: list[str] = []
    try:
        mark, t0 = writes.mark(), time.monotonic()
        out = simulate(node, "xid", "--gpu", "1", "--xid", "79")
        assert "XID 79" in out, out
        taints = wait_for_taints(node, lambda t: t["gpu-1"] != [])
        tainted_after = time.monotonic() - t0
        for name, ts in taints.items():
            assert ts == ([(xid_key, "79", "NoSchedule")] if on_gpu(name, 1) else []), (name, ts)
        events = writes.since(mark)
        print(f"XID 79 -> all {len(gpu1)} devices of gpu-1 tainted after {tainted_after:.2f}s "
              f"(including the simulate process); slice writes: {events}")
        assert_updates_in_place(events, generation)

        health = health_after(watch, t0, lambda h: h.get("gpu-1") == "UNHEALTHY")
        assert {n for n, h in health.items() if h == "UNHEALTHY"} == set(gpu1)
        assert all(h == "HEALTHY" for n, h in health.items() if on_gpu(n, 0))

        # The scheduler gives a whole-GPU claim the healthy GPU; a second one finds none.
        for pod in ("first", "second"):
            for obj in whole_gpu_claim_and_pod(pod, node.driver, node.name):
                create(kube, namespace, obj)
            pods.append(pod)
            if pod == "first":
                wait_for_scheduled_pod(kube, namespace, "first")
                assert allocated_device(kube, namespace, "first") == "gpu-0"
        message = wait_unschedulable(kube, namespace, "second")
        assert not (get(kube, "ResourceClaim", namespace, "second").get("status") or {}).get("allocation"), message

        # The operator declares the GPU healthy: the taints go, and the waiting pod gets gpu-1.
        mark, t0 = writes.mark(), time.monotonic()
        simulate(node, "recover", "--gpu", "1")
        wait_for_taints(node, lambda t: all(ts == [] for ts in t.values()))
        cleared_after = time.monotonic() - t0
        events = writes.since(mark)
        print(f"recover -> taints removed after {cleared_after:.2f}s; slice writes: {events}")
        assert_updates_in_place(events, generation)
        health = health_after(watch, t0, lambda h: h.get("gpu-1") == "HEALTHY")
        assert set(health.values()) == {"HEALTHY"}
        wait_for_scheduled_pod(kube, namespace, "second")
        assert allocated_device(kube, namespace, "second") == "gpu-1"
    finally:
        watch.close()
        writes.close()
        for pod in pods:
            delete_pod(kube, namespace, pod)


def test_application_xid_is_informational_and_taints_expire_after_the_quiet_period(kube, namespace, make_node):
    quiet = 8.0
    node = make_node(H100_PAIR, extra_args=("--health-quiet-period", str(quiet)))
    xid_key = f"{node.driver}/xid"
    generation = pool_generation(node)
    writes = SliceWrites(kube, node.driver)
    watch = health_watch(node)
    try:
        t0 = time.monotonic()
        simulate(node, "xid", "--gpu", "0", "--xid", "13")
        simulate(node, "xid", "--gpu", node.hardware().gpu_uuids[1], "--xid", "79")
        taints = wait_for_taints(node, lambda t: t["gpu-0"] != [] and t["gpu-1"] != [])
        assert taints == {"gpu-0": [(xid_key, "13", "None")], "gpu-1": [(xid_key, "79", "NoSchedule")]}
        health = health_after(watch, t0, lambda h: h.get("gpu-1") == "UNHEALTHY")
        assert health["gpu-0"] == "HEALTHY", "an application XID must not make the device unhealthy"

        # Effect None does not keep the scheduler away.
        gpu0 = node.hardware().gpu_uuids[0]
        for obj in whole_gpu_claim_and_pod("app-xid", node.driver, node.name,
                                           cel=f"device.attributes['{node.driver}'].uuid == '{gpu0}'"):
            create(kube, namespace, obj)
        try:
            wait_for_scheduled_pod(kube, namespace, "app-xid")
            assert allocated_device(kube, namespace, "app-xid") == "gpu-0"
            assert published_taints(node)["gpu-0"] == [(xid_key, "13", "None")], \
                "the taint expired before the allocation: raise the quiet period of this test"
        finally:
            delete_pod(kube, namespace, "app-xid")

        # No new event for `quiet` seconds: both taints go (each in the monitor round where its quiet period
        # ends: one write, or two when the two injections fell into different rounds), and the stream says
        # HEALTHY again.
        mark = writes.mark()
        wait_for_taints(node, lambda t: all(ts == [] for ts in t.values()), timeout=quiet + 15)
        cleared_after = time.monotonic() - t0
        assert cleared_after >= quiet, f"taints removed after {cleared_after:.1f}s, before the quiet period"
        events = writes.since(mark)
        print(f"quiet period {quiet}s -> taints removed after {cleared_after:.2f}s; slice writes: {events}")
        assert_updates_in_place(events, generation, most=2)
        health = health_after(watch, t0 + quiet, lambda h: h.get("gpu-1") == "HEALTHY")
        assert set(health.values()) == {"HEALTHY"}
    finally:
        watch.close()
        writes.close()


def test_lost_gpu_taints_all_its_devices_until_it_recovers(kube, namespace, make_node):
    node = make_node(H100_PAIR, PARTITIONED)
    lost_key = f"{node.driver}/gpu-lost"
    generation = pool_generation(node)
    writes = SliceWrites(kube, node.driver)
    watch = health_watch(node)
    try:
        mark, t0 = writes.mark(), time.monotonic()
        simulate(node, "lose", "--gpu", "1")
        taints = wait_for_taints(node, lambda t: t["gpu-1"] != [])
        lost_after = time.monotonic() - t0
        gpu1 = {n for n in taints if on_gpu(n, 1)}
        for name, ts in taints.items():
            assert ts == ([(lost_key, None, "NoSchedule")] if name in gpu1 else []), (name, ts)
        events = writes.since(mark)
        print(f"lost GPU -> {len(gpu1)} devices tainted after {lost_after:.2f}s; slice writes: {events}")
        assert_updates_in_place(events, generation)
        assert node.hardware().lost_reason(node.hardware().gpu_uuids[1]) is not None
        health = health_after(watch, t0, lambda h: h.get("gpu-1") == "UNHEALTHY")
        assert {n for n, h in health.items() if h == "UNHEALTHY"} == gpu1

        mark, t0 = writes.mark(), time.monotonic()
        simulate(node, "recover", "--gpu", "1")
        wait_for_taints(node, lambda t: all(ts == [] for ts in t.values()))
        cleared_after = time.monotonic() - t0
        events = writes.since(mark)
        print(f"lost GPU recovered -> taints removed after {cleared_after:.2f}s; slice writes: {events}")
        assert_updates_in_place(events, generation)
        assert set(health_after(watch, t0, lambda h: h.get("gpu-1") == "HEALTHY").values()) == {"HEALTHY"}
    finally:
        watch.close()
        writes.close()


def test_simulate_names_a_wrong_gpu(make_node):
    node = make_node([{"model": "H100-80GB", "count": 1}])
    proc = subprocess.run([sys.executable, "-m", "cli.main", "simulate", "xid", "--gpu", "7", "--xid", "79",
                           "--sim-state", str(node.dirs.sim_state)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "no GPU '7'" in proc.stderr and str(node.dirs.sim_state) in proc.stderr, proc.stderr
    assert published_taints(node) == {"gpu-0": []}


# --- claim device status -----------------------------------------------------------------------------------

def chart_cluster_role(driver: str, name: str) -> dict[str, Any]:
    """The chart's kubelet-plugin ClusterRole for ``driver`` (no helm needed: the driver name is the one value
    its rules take; template-only lines such as labels are dropped)."""
    role_text = CHART_RBAC.read_text().split("\n---\n")[0]
    role_text = role_text.replace('[{{ include "gpu-dra-driver.driverName" . | quote }}]', f'["{driver}"]')
    role = yaml.safe_load("\n".join(ln for ln in role_text.splitlines() if "{{" not in ln))
    role["metadata"] = {"name": name}
    assert any(r["resources"] == ["resourceclaims/driver"] and r.get("resourceNames") == [driver]
               for r in role["rules"]), role
    return role


class PluginIdentity:
    """The chart's kubelet-plugin service account and ClusterRole (optionally without some of its rules), and
    a kubeconfig with a token bound to a pod on the node, so the API server knows which node the plugin is on."""

    def __init__(self, cluster: Any, kube: KubeApi, namespace: str, node: SimulatedNode,
                 drop_resources: tuple[str, ...] = ()):
        self.kube, self.namespace, self.role = kube, namespace, f"{node.driver}-kubelet-plugin"
        sa = "kubelet-plugin"
        role = chart_cluster_role(node.driver, self.role)
        role["rules"] = [r for r in role["rules"] if not set(r["resources"]) & set(drop_resources)]
        kube.create(f"/api/v1/namespaces/{namespace}/serviceaccounts",
                    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}})
        kube.create("/apis/rbac.authorization.k8s.io/v1/clusterroles", role)
        kube.create("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": self.role},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": self.role}})
        pod = pin_to_node({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kubelet-plugin"},
                           "spec": {"serviceAccountName": sa, "containers": [{"name": "plugin", "image": "busybox"}]}},
                          node.name)
        create(kube, namespace, pod)

        def bound() -> dict[str, Any] | None:
            p = get(kube, "Pod", namespace, "kubelet-plugin")
            return p if p and p["spec"].get("nodeName") else None

        pod = wait_until(bound, 30, "the plugin's pod to be bound")
        token = kube.create(f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600,
                     "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": "kubelet-plugin",
                                        "uid": pod["metadata"]["uid"]}}})["status"]["token"]
        claims = token.split(".")[1]
        payload = yaml.safe_load(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))
        assert payload["kubernetes.io"]["node"]["name"] == node.name, payload
        self.kubeconfig = node.dirs.base / "plugin-kubeconfig.yaml"
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "plugin",
            "clusters": [{"name": "local", "cluster": {"server": cluster.server,
                                                       "certificate-authority": str(cluster.ca_file)}}],
            "users": [{"name": "plugin", "user": {"token": token}}],
            "contexts": [{"name": "plugin", "context": {"cluster": "local", "user": "plugin"}}]}))

    def delete(self) -> None:
        delete_pod(self.kube, self.namespace, "kubelet-plugin")
        for kind in ("clusterrolebindings", "clusterroles"):
            try:
                self.kube.request("DELETE", f"/apis/rbac.authorization.k8s.io/v1/{kind}/{self.role}")
            except ApiError:
                pass


@pytest.fixture
def node_as_plugin_account(cluster, kube, namespace, make_node):
    """Start a node whose plugin runs as the chart's service account; GPU 0 whole, GPU 1 as dynamic MIG."""
    identities: list[PluginIdentity] = []

    def make(drop_resources: tuple[str, ...] = ()) -> SimulatedNode:
        node = make_node(H100_PAIR, {"rules": [{"match": {"index": 1}, "mig": "dynamic", "wholeGpu": False}]},
                         start=False)
        cluster.add_node(node.name)
        identity = PluginIdentity(cluster, kube, namespace, node, drop_resources)
        identities.append(identity)
        node.plugin.kubeconfig = identity.kubeconfig
        return node.start()

    yield make
    for identity in identities:
        identity.delete()


def our_entries(kube: KubeApi, namespace: str, claim: str, driver: str) -> list[dict[str, Any]]:
    obj = get(kube, "ResourceClaim", namespace, claim)
    assert obj is not None, f"ResourceClaim {claim} is gone"
    return [e for e in (obj.get("status") or {}).get("devices") or [] if e["driver"] == driver]


def schedule_whole_and_mig(kube: KubeApi, namespace: str, node: SimulatedNode) -> list[dict[str, Any]]:
    """A pod with a whole-GPU claim and one with a dynamic MIG partition (the mig-partition example)."""
    objects = whole_gpu_claim_and_pod("whole", node.driver, node.name)
    objects += [for_driver(obj, node.driver) for obj in load_example("mig-partition")]
    return run_objects(kube, node, namespace, objects)


def test_claim_status_reports_the_prepared_devices(kube, namespace, node_as_plugin_account):
    node = node_as_plugin_account()
    pods = schedule_whole_and_mig(kube, namespace, node)
    try:
        hardware = node.hardware()
        claims = []
        for pod in pods:
            prepared = node.kubelet.prepare_pod(pod)
            (ref,) = prepared.claims.values()
            claims.append(ref.name)
            (device,), = prepared.devices.values()
            entries = eventually(lambda: our_entries(kube, namespace, ref.name, node.driver), bool)
            assert [(e["pool"], e["device"]) for e in entries] == [(node.name, device.device_name)], entries
            entry, = entries
            ready, = entry["conditions"]
            assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared"), ready
            # data.uuid is the device the container gets: the same UUID the CDI spec hands it
            visible = resolve_cdi([node.dirs.cdi], prepared.container_cdi_ids["cuda"]).env_map()["NVIDIA_VISIBLE_DEVICES"]
            assert entry["data"]["uuid"] == visible, (entry, visible)
            if device.device_name == "gpu-0":
                assert entry["data"]["type"] == "gpu" and visible == hardware.gpu_uuids[0]
            else:
                mig, = [m for m in node.mig_devices() if m.uuid == visible]   # the partition made for this claim
                assert entry["data"]["type"] == "mig" and visible.startswith("MIG-")
                assert entry["data"]["parentUUID"] == hardware.gpu_uuids[1]
                assert (entry["data"]["gpuInstanceID"], entry["data"]["computeInstanceID"]) == (mig.gi_id, mig.ci_id)
                assert entry["data"]["migProfile"] == "1g.10gb"
            managers = [m for m in get(kube, "ResourceClaim", namespace, ref.name)["metadata"]["managedFields"]
                        if m.get("subresource") == "status" and m["operation"] == "Apply"]
            assert [m["manager"] for m in managers] == [f"{node.driver}/{node.name}"], managers

        # The kubelet unprepares before the pod object goes; the plugin writes nothing then. Once the pods are
        # gone the claims are deallocated, and the API server drops our entries with the allocation.
        for pod in pods:
            node.kubelet.unprepare_pod(pod)
        metrics = node.metrics()
        assert metrics['gpu_dra_claim_status_writes_total{operation="publish",result="ok"}'] == 2
        assert metrics.get('gpu_dra_claim_status_writes_total{operation="publish",result="error"}', 0) == 0
        for pod in ("whole", "mig-1g10gb"):
            delete_pod(kube, namespace, pod)
        for claim in claims:
            left = eventually(lambda: get(kube, "ResourceClaim", namespace, claim),
                              lambda c: c is None or not (c.get("status") or {}).get("allocation"), timeout=90)
            assert left is None or not (left.get("status") or {}).get("devices"), left
    finally:
        for pod in ("whole", "mig-1g10gb"):
            delete_pod(kube, namespace, pod)


def test_claim_status_refused_by_rbac_does_not_fail_the_prepare(kube, namespace, node_as_plugin_account):
    """Without the chart's rule for resourceclaims/driver the API server refuses our status.devices entries
    (so the rule is needed); the claims are prepared all the same, and the refusal is counted."""
    node = node_as_plugin_account(drop_resources=("resourceclaims/driver",))
    pods = schedule_whole_and_mig(kube, namespace, node)
    try:
        names = []
        for pod in pods:
            prepared = node.kubelet.prepare_pod(pod)
            (ref,) = prepared.claims.values()
            names.append(ref.name)
            assert prepared.container_cdi_ids["cuda"], "the prepare must succeed without the status"
        metrics = eventually(node.metrics, lambda m: m.get(
            'gpu_dra_claim_status_writes_total{operation="publish",result="error"}') == 2)
        for name in names:
            assert our_entries(kube, namespace, name, node.driver) == []
        assert metrics['gpu_dra_claim_status_writes_total{operation="publish",result="error"}'] == 2
        assert metrics.get('gpu_dra_claim_status_writes_total{operation="publish",result="ok"}', 0) == 0
        assert metrics["gpu_dra_prepared_claims"] == 2
        refusals = [ln for ln in node.plugin.log_path.read_text().splitlines() if "claim status not written" in ln]
        assert len(refusals) == 2 and all("resourceclaims/driver" in ln for ln in refusals), refusals
        print(refusals[0])
        for pod in pods:
            node.kubelet.unprepare_pod(pod)
        assert node.checkpoint_claims() == {}
    finally:
        for pod in ("whole", "mig-1g10gb"):
            delete_pod(kube, namespace, pod)
