"""Two real nodes on one machine, node-a (four H100s) and node-b (two L4s), each with its own kubelet,
containerd, runc and ``gpu-dra kubelet-plugin``, under one local control plane: what a cluster of several
nodes does to claims and pods, for real.

- draining node-b (cordon, then the eviction API as ``kubectl drain`` does) releases and unprepares its claims
  (their CDI specs and checkpoint entries on node-b gone) and the Deployment's pods run again on node-a;
- node-a's kubelet restarting does not stop node-b from starting pods, and node-a's pods and claims stay;
- node-b's plugin stopping touches nothing of node-a (no slice write, pods running, new pods served);
- a DaemonSet whose pods each get a claim from a template lands one pod per node, each on its node's GPU;
- stopping one node leaves the other running, then stopping both leaves the host as found.

Pods run the cuda-probe image (`testbed.podprobe`): the asserts are on what each container printed.
The tests run in file order and share the nodes; each puts back what it changed (cordons, plugins).
"""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from realnode_helpers import RealNode
from standin.workloads import complete_pool, node_slices, wait_until

from api.deviceclasses import device_classes
from api.names import DEFAULT_DRIVER_NAME
from kube.client import DEVICE_CLASSES, SLICES, ApiError, KubeApi
from testbed.hostplumbing import (
    NodeError,
    cgroup_dirs,
    cleanup_leftovers,
    first_missing_ancestor,
    read_record,
    read_sysctl,
    record_paths,
    records_dir,
)
from testbed.localcluster import ClusterError, LocalCluster
from testbed.localnode import HOST_PATHS, SYSCTLS, LocalNode, cuda_probe_image, install_driver_root
from testbed.nodeplugin import LocalNodePlugin, NodePluginError
from testbed.podprobe import ContainerView, for_local_node, parse_probe

pytestmark = pytest.mark.e2e

DRIVER = DEFAULT_DRIVER_NAME
GPU_CLASS = DRIVER   # whole GPUs: the class named after the driver
FLEET: dict[str, Any] = {"nodes": [
    {"name": "node-a", "gpus": [{"model": "H100-80GB", "count": 4}],
     "policy": {"default": {"wholeGpu": True, "mig": "none"}}},
    {"name": "node-b", "gpus": [{"model": "L4", "count": 2}], "policy": {"default": {"wholeGpu": True}}},
]}
H100_MIB, L4_MIB = 81559, 23034
DEPLOYMENTS = "/apis/apps/v1/namespaces/{ns}/deployments"
DAEMONSETS = "/apis/apps/v1/namespaces/{ns}/daemonsets"
TEMPLATES = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
PODS = "/api/v1/namespaces/{ns}/pods"
# The kubelet wipes a node's slices 30 s after its plugin went away; generous on a busy machine.
WIPE_TIMEOUT = 120.0


@dataclass
class Node:
    """One real node of the module and its plugin."""

    node: LocalNode
    plugin: LocalNodePlugin

    @property
    def name(self) -> str:
        return self.node.name


@dataclass
class Cluster:
    cluster: LocalCluster
    kube: KubeApi
    fleet: Path
    nodes: dict[str, Node] = field(default_factory=dict)
    host_before: dict[str, Any] = field(default_factory=dict)

    @property
    def a(self) -> Node:
        return self.nodes["node-a"]

    @property
    def b(self) -> Node:
        return self.nodes["node-b"]


def host_state() -> dict[str, Any]:
    """What a node may change on the host outside its work dir: sysctls, host paths, records."""
    return {"sysctls": {k: read_sysctl(k) for k in SYSCTLS},
            "paths": {p: first_missing_ancestor(p) is None for p in HOST_PATHS},
            "records": sorted(p.name for p in record_paths(records_dir())) if records_dir().is_dir() else []}


def start_plugin(cl: Cluster, n: Node) -> None:
    n.plugin.start()
    try:
        n.plugin.wait_registered(60)
    except NodePluginError as exc:
        pytest.fail(str(exc), pytrace=False)
    wait_until(lambda: complete_pool(node_slices(cl.kube, DRIVER, n.name)), 60, f"the slices of {n.name}")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cleanup_leftovers()
    before = host_state()
    cluster = LocalCluster().start()
    api_client = cluster.api_client()
    kube = KubeApi(api_client)
    fleet = tmp_path_factory.mktemp("multinode") / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET, sort_keys=False))
    cl = Cluster(cluster, kube, fleet, host_before=before)
    nodes = [LocalNode(cluster, name=spec["name"]) for spec in FLEET["nodes"]]
    try:
        # Both at once, as the demo starts them.
        with ThreadPoolExecutor(len(nodes)) as pool:
            errors = [e for e in pool.map(start_node, nodes) if e]
        if errors:
            raise NodeError("\n".join(errors))
        for node in nodes:
            plugin = LocalNodePlugin(node, fleet, DRIVER, log_level="info")
            install_driver_root(plugin.driver_root, node.bin_dir, "host", fleet=fleet, node_name=node.name)
            cl.nodes[node.name] = Node(node, plugin)
            start_plugin(cl, cl.nodes[node.name])
        for cls in device_classes(DRIVER):
            kube.create(DEVICE_CLASSES, cls)
    except BaseException as exc:  # a failed start (NodeError, a plugin that does not register) too
        stop_all(cl, nodes)
        if isinstance(exc, ClusterError):
            pytest.fail(f"the two real nodes did not start: {exc}", pytrace=False)
        raise
    try:
        yield cl
    finally:
        api_client.close()
        stop_all(cl, nodes)


def start_node(node: LocalNode) -> str | None:
    try:
        node.start()
    except ClusterError as exc:
        return str(exc)
    return None


def stop_all(cl: Cluster, nodes: list[LocalNode]) -> None:
    """Plugins, nodes (those a test stopped already are skipped), then the control plane."""
    try:
        for n in cl.nodes.values():
            n.plugin.stop()
        for node in nodes:
            node.stop()
    finally:
        cl.cluster.stop()


# ---- helpers ------------------------------------------------------------------------------------------

def namespace(cl: Cluster, name: str) -> str:
    cl.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def gpu_template(cl: Cluster, ns: str, name: str = "one-gpu") -> str:
    cl.kube.create(TEMPLATES.format(ns=ns), {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": GPU_CLASS}}]}}}})
    return name


def gpu_pod(name: str, template: str, node: str | None = None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod with one GPU from `template` that runs the probe here (pinned to `node` when given)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": dict(labels or {})},
           "spec": {"containers": [{"name": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}]}}
    return for_local_node(pod, cuda_probe_image(), node)


def create_pod(cl: Cluster, ns: str, pod: dict[str, Any]) -> None:
    cl.kube.create(PODS.format(ns=ns), pod)


def pods(cl: Cluster, ns: str, selector: str) -> list[dict[str, Any]]:
    return list(cl.kube.list(PODS.format(ns=ns), label_selector=selector)["items"])


def pod(cl: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    try:
        return cl.kube.get(f"{PODS.format(ns=ns)}/{name}")
    except ApiError as exc:
        if exc.not_found:
            return None
        raise


def view(cl: Cluster, ns: str, p: dict[str, Any]) -> ContainerView:
    """What the pod's container printed, read on the node it runs on."""
    n = cl.nodes[p["spec"]["nodeName"]]
    try:
        return parse_probe(n.node.container_log(ns, p["metadata"]["name"], "cuda"))
    except NodeError:
        return ContainerView()


def running(cl: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    """The pod once Running with its probe done, else None."""
    p = pod(cl, ns, name)
    if p is None or p.get("status", {}).get("phase") != "Running" or not view(cl, ns, p).complete:
        return None
    return p


def wait_running(cl: Cluster, ns: str, name: str, node: str, timeout: float = 90.0) -> dict[str, Any]:
    try:
        p = wait_until(lambda: running(cl, ns, name), timeout, f"pod {ns}/{name} Running with its probe done")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{pods_report(cl, ns)}") from None
    assert p["spec"]["nodeName"] == node, f"pod {name} runs on {p['spec']['nodeName']}, not {node}"
    return p


def claim_of(cl: Cluster, ns: str, p: dict[str, Any]) -> dict[str, Any]:
    name = next(s["resourceClaimName"] for s in p["status"]["resourceClaimStatuses"] if s["name"] == "gpu")
    return dict(cl.kube.get(f"{CLAIMS.format(ns=ns)}/{name}"))


def cdi_specs(n: Node, uid: str) -> list[Path]:
    return [p for p in Path(n.node.cdi_dirs[0]).iterdir() if p.is_file() and uid in p.name]


def prepared_on(n: Node, uid: str) -> bool:
    """The claim is prepared on the node: a CDI spec and a checkpoint entry."""
    return bool(cdi_specs(n, uid)) and uid in RealNode.checkpoint_claims(n.plugin)


def unprepared_on(n: Node, uid: str) -> bool:
    return not cdi_specs(n, uid) and uid not in RealNode.checkpoint_claims(n.plugin)


def node_devices(cl: Cluster, node: str) -> dict[str, dict[str, Any]]:
    """The node's published devices by name, attributes flattened to plain values."""
    return {d["name"]: {k: next(iter(v.values())) for k, v in (d.get("attributes") or {}).items()}
            for s in node_slices(cl.kube, DRIVER, node) for d in s["spec"].get("devices") or []}


def seen_gpu(cl: Cluster, ns: str, p: dict[str, Any]) -> tuple[str, int]:
    """(UUID, MiB) of the one GPU the container's cuda-probe saw; it must be its claim's device."""
    v = view(cl, ns, p)
    assert len(v.cuda) == 1, f"pod {p['metadata']['name']} saw {v.cuda} ({v.cuda_error})"
    (result,) = claim_of(cl, ns, p)["status"]["allocation"]["devices"]["results"]
    node = p["spec"]["nodeName"]
    assert result["pool"] == node, result
    assert v.cuda[0].uuid == node_devices(cl, node)[result["device"]]["uuid"], (v.cuda, result)
    return v.cuda[0].uuid, v.cuda[0].memory_mib


def registered_count(plugin: LocalNodePlugin) -> int:
    """How often a kubelet has confirmed the plugin process's registration (its log says so each time)."""
    return plugin.log_path.read_text(errors="replace").count("registered with the kubelet")


def set_unschedulable(cl: Cluster, node: str, value: bool) -> None:
    cl.kube.request("PATCH", f"/api/v1/nodes/{node}", body={"spec": {"unschedulable": value}},
                    content_type="application/merge-patch+json")


def evict(cl: Cluster, ns: str, name: str) -> None:
    """What ``kubectl drain`` does per pod: an Eviction through the pod's eviction subresource."""
    cl.kube.request("POST", f"{PODS.format(ns=ns)}/{name}/eviction", body={
        "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns}})


def delete_all(cl: Cluster, ns: str) -> None:
    """The namespace's workloads and pods deleted, and gone (their claims unprepared by then)."""
    for path in (DEPLOYMENTS, DAEMONSETS):
        for obj in cl.kube.list(path.format(ns=ns))["items"]:
            cl.kube.request("DELETE", f"{path.format(ns=ns)}/{obj['metadata']['name']}",
                            body={"propagationPolicy": "Foreground"})
    for p in cl.kube.list(PODS.format(ns=ns))["items"]:
        try:
            cl.kube.request("DELETE", f"{PODS.format(ns=ns)}/{p['metadata']['name']}")
        except ApiError as exc:
            if not exc.not_found:
                raise
    wait_until(lambda: not cl.kube.list(PODS.format(ns=ns))["items"], 90, f"the pods of {ns} to be gone")


def slice_versions(cl: Cluster, node: str) -> dict[str, str]:
    return {s["metadata"]["name"]: s["metadata"]["resourceVersion"]
            for s in cl.kube.list(SLICES, field_selector=f"spec.driver={DRIVER},spec.nodeName={node}")["items"]}


# ---- the tests ----------------------------------------------------------------------------------------

def test_two_nodes_run_side_by_side_each_with_its_own_plugin(two: Cluster) -> None:
    a, b = two.a.node, two.b.node
    assert a.workdir != b.workdir and a.cgroup_root != b.cgroup_root
    assert a.containerd_socket != b.containerd_socket and a.plugins_registry_dir != b.plugins_registry_dir
    assert set(a.ports.values()).isdisjoint(b.ports.values())
    assert a.cdi_dirs != b.cdi_dirs
    for n in (a, b):
        n.check_running()
        assert cgroup_dirs(n.cgroup_root), f"no cgroup root {n.cgroup_root} for {n.name}"
    records = [read_record(p) or {} for p in record_paths(records_dir())]
    assert sorted(r["cgroup_root"] for r in records) == sorted([a.cgroup_root, b.cgroup_root]), records
    models = {name: {d["productName"] for d in node_devices(two, name).values()} for name in two.nodes}
    assert models == {"node-a": {"NVIDIA H100 80GB HBM3"}, "node-b": {"NVIDIA L4"}}, models


def test_draining_node_b_unprepares_its_claims_and_reschedules_the_pods_onto_node_a(two: Cluster) -> None:
    ns = namespace(two, "drain")
    template = gpu_template(two, ns)
    pod_spec = gpu_pod("drain", template, labels={"app": "drain"})
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "drain"},
                  "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "drain"}},
                           "template": {"metadata": {"labels": {"app": "drain"}}, "spec": pod_spec["spec"]}}}
    try:
        # Start on node-b: node-a is cordoned while the Deployment's pods are scheduled.
        set_unschedulable(two, "node-a", True)
        two.kube.create(DEPLOYMENTS.format(ns=ns), deployment)
        first = wait_all_running(two, ns, "app=drain", 2)
        assert len(first) == 2 and {p["spec"]["nodeName"] for p in first} == {"node-b"}, first
        uids = {p["metadata"]["name"]: claim_of(two, ns, p)["metadata"]["uid"] for p in first}
        assert all(prepared_on(two.b, uid) for uid in uids.values())
        assert {seen_gpu(two, ns, p)[1] for p in first} == {L4_MIB}
        set_unschedulable(two, "node-a", False)

        # kubectl drain node-b: cordon, then evict every pod on it.
        set_unschedulable(two, "node-b", True)
        for name in uids:
            evict(two, ns, name)

        # The old claims are released (deleted with their pods) and unprepared on node-b.
        def released() -> bool:
            left = {c["metadata"]["uid"] for c in two.kube.list(CLAIMS.format(ns=ns))["items"]}
            return not left & set(uids.values())

        wait_until(released, 90, "the evicted pods' claims to be deleted")
        wait_until(lambda: all(unprepared_on(two.b, uid) for uid in uids.values()), 60,
                   "node-b's CDI specs and checkpoint entries of the evicted pods' claims to be gone")

        # The ReplicaSet's new pods run on node-a's free GPUs.
        second = wait_all_running(two, ns, "app=drain", 2, fresh=frozenset(uids))
        assert {p["spec"]["nodeName"] for p in second} == {"node-a"}, second
        seen = [seen_gpu(two, ns, p) for p in second]
        assert {mib for _, mib in seen} == {H100_MIB} and len({u for u, _ in seen}) == 2, seen
        assert all(prepared_on(two.a, claim_of(two, ns, p)["metadata"]["uid"]) for p in second)
        assert not node_pods(two, "node-b", ns), "node-b still has pods after the drain"
    finally:
        set_unschedulable(two, "node-a", False)
        set_unschedulable(two, "node-b", False)
        delete_all(two, ns)


def all_running(cl: Cluster, ns: str, selector: str, count: int) -> list[dict[str, Any]] | None:
    """The `count` pods of `selector`, once there are that many and each is Running with its probe done."""
    now = pods(cl, ns, selector)
    ok = [p for p in (running(cl, ns, q["metadata"]["name"]) for q in now) if p is not None]
    return ok if len(now) == len(ok) == count else None


def wait_all_running(cl: Cluster, ns: str, selector: str, count: int, timeout: float = 120.0,
                     fresh: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """`all_running`, waited for; none of the pods named in `fresh` may be among them. Fails with every pod's
    phase, node and last events."""
    def ready() -> list[dict[str, Any]] | None:
        now = all_running(cl, ns, selector, count)
        return now if now and not {p["metadata"]["name"] for p in now} & fresh else None

    try:
        return wait_until(ready, timeout, f"{count} pod(s) {selector} Running")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{pods_report(cl, ns)}") from None


def pods_report(cl: Cluster, ns: str) -> str:
    """Every pod of the namespace with its phase, node and last events."""
    lines = []
    for p in cl.kube.list(PODS.format(ns=ns))["items"]:
        name = p["metadata"]["name"]
        events = cl.kube.list(f"/api/v1/namespaces/{ns}/events", field_selector=f"involvedObject.name={name}")
        last = "; ".join(f"{e.get('reason')}: {e.get('message')}" for e in events["items"][-3:])
        lines.append(f"  {name} on {p['spec'].get('nodeName')}: {p.get('status', {}).get('phase')} ({last})")
    return "\n".join(lines)


def node_pods(cl: Cluster, node: str, ns: str) -> list[str]:
    return [p["metadata"]["name"] for p in
            cl.kube.list(PODS.format(ns=ns), field_selector=f"spec.nodeName={node}")["items"]]


def test_node_a_kubelet_restarting_while_node_b_serves(two: Cluster) -> None:
    ns = namespace(two, "kubelet-restart")
    template = gpu_template(two, ns)
    try:
        create_pod(two, ns, gpu_pod("steady", template, "node-a"))
        steady = wait_running(two, ns, "steady", "node-a")
        cid = steady["status"]["containerStatuses"][0]["containerID"]
        claim = claim_of(two, ns, steady)
        uid = claim["metadata"]["uid"]
        assert prepared_on(two.a, uid)

        old_slices = {x["metadata"]["uid"] for x in node_slices(two.kube, DRIVER, "node-a")}
        two.a.node.stop_kubelet()
        assert two.a.node.kubelet_pid is None
        # node-b starts a pod while node-a has no kubelet.
        create_pod(two, ns, gpu_pod("during", template, "node-b"))
        during = wait_running(two, ns, "during", "node-b")
        assert seen_gpu(two, ns, during)[1] == L4_MIB
        assert two.a.node.kubelet_pid is None, "node-a's kubelet came back before node-b's pod ran"

        registrations = registered_count(two.a.plugin)
        two.a.node.start_kubelet()
        # The new kubelet registers node-a's plugin again and its slices are published again.
        wait_until(lambda: registered_count(two.a.plugin) > registrations, 60,
                   "node-a's new kubelet to register the plugin")
        # The starting kubelet wiped node-a's slices; the plugin publishes them again once registered.
        def republished() -> bool:
            now = node_slices(two.kube, DRIVER, "node-a")
            return complete_pool(now) and not old_slices & {x["metadata"]["uid"] for x in now}

        wait_until(republished, 60, "node-a's slices published again")

        # node-a's pod kept running in the same container, its claim allocated, reserved and prepared.
        after = wait_running(two, ns, "steady", "node-a")
        status = after["status"]["containerStatuses"][0]
        assert status["containerID"] == cid and status["restartCount"] == 0, status
        assert "running" in status["state"], status
        claim_after = claim_of(two, ns, after)
        assert claim_after["metadata"]["uid"] == uid
        assert claim_after["status"]["allocation"] == claim["status"]["allocation"]
        assert [r["uid"] for r in claim_after["status"]["reservedFor"]] == [after["metadata"]["uid"]]
        assert prepared_on(two.a, uid)
        assert running(two, ns, "during"), "node-b's pod stopped while node-a's kubelet restarted"
    finally:
        if two.a.node.kubelet_pid is None:
            two.a.node.start_kubelet()
        delete_all(two, ns)


def test_stopping_node_b_plugin_leaves_node_a_untouched(two: Cluster) -> None:
    ns = namespace(two, "plugin-stop")
    template = gpu_template(two, ns)
    try:
        create_pod(two, ns, gpu_pod("before", template, "node-a"))
        before = wait_running(two, ns, "before", "node-a")
        uid = claim_of(two, ns, before)["metadata"]["uid"]
        versions = slice_versions(two, "node-a")
        assert versions

        assert two.b.plugin.stop() == 0
        # node-a's plugin still serves: a pod created now runs there.
        create_pod(two, ns, gpu_pod("after", template, "node-a"))
        wait_running(two, ns, "after", "node-a")
        # node-b's kubelet notices its plugin is gone and, after its grace period, wipes node-b's slices.
        wait_until(lambda: not node_slices(two.kube, DRIVER, "node-b"), WIPE_TIMEOUT,
                   "node-b's kubelet to wipe node-b's slices")

        assert slice_versions(two, "node-a") == versions, "node-a's slices were written"
        assert running(two, ns, "before") and prepared_on(two.a, uid)
        assert pod(two, ns, "before")["status"]["containerStatuses"][0]["restartCount"] == 0  # type: ignore[index]
    finally:
        if not two.b.plugin.alive:
            start_plugin(two, two.b)
        delete_all(two, ns)


def test_a_daemonset_gets_one_claim_per_node_and_each_pod_its_nodes_gpu(two: Cluster) -> None:
    ns = namespace(two, "per-node")
    template = gpu_template(two, ns, "node-gpu")
    spec = gpu_pod("per-node", template)["spec"]
    spec["restartPolicy"] = "Always"
    ds = {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "per-node"},
          "spec": {"selector": {"matchLabels": {"app": "per-node"}},
                   "template": {"metadata": {"labels": {"app": "per-node"}}, "spec": spec}}}
    try:
        two.kube.create(DAEMONSETS.format(ns=ns), ds)

        ran = wait_all_running(two, ns, "app=per-node", 2)
        by_node = {p["spec"]["nodeName"]: p for p in ran}
        assert set(by_node) == {"node-a", "node-b"}, [p["spec"]["nodeName"] for p in ran]
        claims = {claim_of(two, ns, p)["metadata"]["name"] for p in ran}
        assert len(claims) == 2, claims
        assert seen_gpu(two, ns, by_node["node-a"])[1] == H100_MIB
        assert seen_gpu(two, ns, by_node["node-b"])[1] == L4_MIB
        # Each pod's container runs under its own node's cgroup root.
        for node, p in by_node.items():
            n = two.nodes[node].node
            cid = p["status"]["containerStatuses"][0]["containerID"].partition("://")[2]
            pid = n.running_tasks()[cid]
            assert n.cgroup_root in Path(f"/proc/{pid}/cgroup").read_text(), (node, n.cgroup_root)
    finally:
        delete_all(two, ns)


def test_stopping_one_node_leaves_the_other_then_both_leave_the_host_as_found(two: Cluster) -> None:
    ns = namespace(two, "stop-one")
    template = gpu_template(two, ns)
    b_root, b_record = two.b.node.cgroup_root, two.b.node.record_path
    assert b_record is not None
    b_workdir = two.b.node.workdir
    both_running = host_state()
    two.b.plugin.stop()
    two.b.node.stop()
    assert not cgroup_dirs(b_root) and not b_record.exists() and b_workdir is not None and not b_workdir.exists()
    with pytest.raises(ApiError, match="404"):
        two.kube.get("/api/v1/nodes/node-b")
    # node-a runs on: the host paths and sysctls it relies on stay as they were, and it starts pods.
    two.a.node.check_running()
    one_running = host_state()
    assert one_running["paths"] == both_running["paths"] and one_running["sysctls"] == both_running["sysctls"]
    assert len(one_running["records"]) == 1
    create_pod(two, ns, gpu_pod("still", template, "node-a"))
    wait_running(two, ns, "still", "node-a")
    delete_all(two, ns)
    a_root = two.a.node.cgroup_root
    two.a.plugin.stop()
    two.a.node.stop()
    assert not cgroup_dirs(a_root)
    after = host_state()
    assert after == two.host_before, f"the host was not left as found:\nbefore {two.host_before}\nafter  {after}"
