"""Per-claim GPU metrics on the real node: two pods, each with its own claim on an MPS slot of the same GPU,
allocate different amounts through the CUDA stand-in (cuda-probe --alloc-mib); the plugin's /metrics shows two
series, one per pod, with those amounts and the labels of each pod's container, claim and device.

A claim shared by two pods, one of them with two containers using it: the two containers' processes cannot be
told apart, so their pod has one series naming both (container "cuda|side"); the pod that joined the claim after
it was prepared (the kubelet prepares a claim once, so the plugin's record does not name it) is found by reading
the claim's reservedFor again.

The path is the production one: the kubelet's PodResources socket (which container holds which claim device),
the claims' reservedFor (pod UID to pod), each process's cgroup (its pod UID), and NVML's process lists, here the
simulated NVML answering from what the stand-in's cuMemAlloc registered in the containers.

A real Prometheus (hack/build-prometheus.sh) scrapes the plugin as the chart's monitor does (honor_labels, the
plugin pod's namespace, pod and container as target labels) and answers every query of the chart's Grafana
dashboard, with its variables set, with the two MPS pods' series.
"""
from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from dashboard_check import check_the_dashboard
from prometheus_client.parser import text_string_to_metric_families
from realnode_helpers import RealNode
from standin.workloads import create, wait_until

from api.names import DEFAULT_DRIVER_NAME
from dra.sim.fleet import gpu_uuid as fleet_gpu_uuid
from testbed import prometheus
from testbed.helmchart import ROOT
from testbed.localnode import cuda_probe_image
from testbed.nodeplugin import LocalNodePlugin
from testbed.podprobe import for_local_node

pytestmark = pytest.mark.e2e

NAMESPACE = "claim-metrics"
MiB = 1 << 20
ALLOC = {"metrics-a": 300, "metrics-b": 700}      # MiB each pod allocates and holds


@pytest.fixture(scope="module")
def real() -> Iterator[RealNode]:
    with RealNode().running() as node:
        yield node


@pytest.fixture(scope="module")
def ours(real: RealNode) -> LocalNodePlugin:
    return real.start_metrics_plugin()


def mps_template(name: str, parent_uuid: str) -> dict[str, Any]:
    a = f"device.attributes['{DEFAULT_DRIVER_NAME}']"
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": f"slot.{DEFAULT_DRIVER_NAME}",
                    "selectors": [{"cel": {
                        "expression": f"{a}.sharing == 'mps' && {a}.parentUUID == '{parent_uuid}'"}}]}}],
                "config": [{"requests": ["gpu"], "opaque": {"driver": DEFAULT_DRIVER_NAME, "parameters": {
                    "apiVersion": f"{DEFAULT_DRIVER_NAME}/v1alpha1", "kind": "GpuConfig",
                    "sharing": {"strategy": "MPS"}}}}]}}}}


def mps_claim(name: str, parent_uuid: str) -> dict[str, Any]:
    """A ResourceClaim of one MPS slot on the GPU `parent_uuid`, for pods to share."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": mps_template(name, parent_uuid)["spec"]["spec"]}


def sharing_pod(name: str, claim: str, allocs: dict[str, int], node_name: str) -> dict[str, Any]:
    """A pod whose containers (name → MiB) each use claim `claim` and allocate and hold that much on its GPU."""
    pod = for_local_node({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                          "spec": {"restartPolicy": "Never",
                                   "containers": [{"name": c, "image": "unused",
                                                   "resources": {"claims": [{"name": "gpu"}]}} for c in allocs],
                                   "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]}},
                         cuda_probe_image(), node_name)
    for c in pod["spec"]["containers"]:
        c["command"] = ["cuda-probe", "--alloc-mib", str(allocs[c["name"]])]
    return pod


def allocating_pod(name: str, template: str, mib: int, node_name: str) -> dict[str, Any]:
    """A pod whose container runs cuda-probe --alloc-mib: it allocates `mib` on its GPU and holds it."""
    pod = for_local_node({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                          "spec": {"restartPolicy": "Never",
                                   "containers": [{"name": "cuda", "image": "unused",
                                                   "resources": {"claims": [{"name": "gpu"}]}}],
                                   "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}]}},
                         cuda_probe_image(), node_name)
    pod["spec"]["containers"][0]["command"] = ["cuda-probe", "--alloc-mib", str(mib)]
    return pod


def gpu_labels(real: RealNode, plugin: LocalNodePlugin, gpu_uuid: str) -> dict[str, str]:
    """The DCGM exporter's labels of the GPU `gpu_uuid`: the node, the GPU's NVML index (the simulated fleet's UUIDs
    derive from node and index), its UUID and product name as published."""
    assert real.node is not None
    gpu, = [a for a in real.devices(plugin).values() if a["type"] == "gpu" and a["uuid"] == gpu_uuid]
    index = next(i for i in range(64) if fleet_gpu_uuid(real.node.name, i) == gpu_uuid)
    return {"Hostname": real.node.name, "gpu": str(index), "UUID": gpu_uuid, "modelName": gpu["productName"]}


def claim_series(plugin: LocalNodePlugin) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The plugin's per-claim series: metric name → labels → value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{plugin.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(("gpu_dra_claim_", "gpu_dra_gpu_unattributed")):
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_two_pods_on_mps_slots_of_one_gpu_show_up_as_two_series(real: RealNode, ours: LocalNodePlugin) -> None:
    two_pods_on_mps_slots_are_two_series(real, ours, NAMESPACE)


def two_pods_on_mps_slots_are_two_series(real: RealNode, plugin: LocalNodePlugin, namespace: str) -> None:
    """The scenario, for any plugin of the node (this module's process, or the chart's pod)."""
    assert real.node is not None and real.kube is not None
    slots = [a for a in real.devices(plugin).values() if a["type"] == "slot" and a.get("sharing") == "mps"]
    assert slots, "the node publishes no MPS slot"
    parent = slots[0]["parentUUID"]
    real.namespace(namespace)
    for pod, mib in ALLOC.items():
        create(real.kube, namespace, mps_template(pod, parent))
        create(real.kube, namespace, allocating_pod(pod, pod, mib, real.node.name))
    expected: dict[tuple[tuple[str, str], ...], float] = {}
    for pod, mib in ALLOC.items():
        wait_until(lambda: f"alloc: {mib} MiB on device 0" in _log(real, namespace, pod), 90,
                   f"pod {namespace}/{pod} to allocate {mib} MiB")
        claim = real.claim_of(namespace, real.pod(namespace, pod), "gpu")
        result, = claim["status"]["allocation"]["devices"]["results"]
        labels = {"namespace": namespace, "pod": pod, "container": "cuda", "claim": claim["metadata"]["name"],
                  "request": "gpu", "device": result["device"], "gpu_uuid": parent, "mig_profile": "",
                  "sharing": "mps", **gpu_labels(real, plugin, parent)}
        expected[tuple(sorted(labels.items()))] = mib * MiB
    assert len({dict(k)["device"] for k in expected}) == 2, "the two pods got one slot"

    def both() -> dict[str, Any] | None:
        series = claim_series(plugin)
        return series if series.get("gpu_dra_claim_gpu_memory_used_bytes") == expected else None

    try:
        series = wait_until(both, 30, "two per-claim memory series with the pods' allocations")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nexpected {expected}\ngot {claim_series(plugin)}\n--- plugin ---\n"
                             f"{plugin.log_tail(20)}") from None
    assert series["gpu_dra_claim_gpu_processes"] == {k: 1 for k in expected}
    assert set(series["gpu_dra_claim_gpu_sm_utilization_percent"]) == set(expected)
    # Each pod's process was found through its own container: none is left over on the GPU.
    assert series["gpu_dra_gpu_unattributed_processes"] == {
        tuple(sorted({"gpu_uuid": parent, **gpu_labels(real, plugin, parent)}.items())): 0}
    assert series["gpu_dra_claim_metrics_errors_total"] == {
        (("source", s),): 0 for s in ("apiserver", "nvml", "podresources")}

    # One pod goes: its series go with its claim; the other's stay as they were.
    real.delete_pod(namespace, "metrics-a")
    remaining = {k: v for k, v in expected.items() if dict(k)["pod"] == "metrics-b"}
    wait_until(lambda: claim_series(plugin).get("gpu_dra_claim_gpu_memory_used_bytes") == remaining, 30,
               "only metrics-b's series after metrics-a is deleted")
    real.delete_pod(namespace, "metrics-b")


def test_a_claim_shared_by_two_pods_one_with_two_containers(real: RealNode, ours: LocalNodePlugin) -> None:
    assert real.node is not None and real.kube is not None
    namespace = "claim-metrics-shared"
    slots = [a for a in real.devices(ours).values() if a["type"] == "slot" and a.get("sharing") == "mps"]
    parent = slots[0]["parentUUID"]
    real.namespace(namespace)
    create(real.kube, namespace, mps_claim("shared", parent))
    pods = {"metrics-c": {"cuda": 100, "side": 50}, "metrics-d": {"cuda": 60}}
    for pod, allocs in pods.items():      # metrics-d only once the claim is prepared for metrics-c
        create(real.kube, namespace, sharing_pod(pod, "shared", allocs, real.node.name))
        for container, mib in allocs.items():
            wait_until(lambda: f"alloc: {mib} MiB on device 0" in _log(real, namespace, pod, container), 90,
                       f"container {namespace}/{pod}/{container} to allocate {mib} MiB")
    claim = real.claim_of(namespace, real.pod(namespace, "metrics-d"), "gpu")
    assert {r["name"] for r in claim["status"]["reservedFor"]} == set(pods)
    result, = claim["status"]["allocation"]["devices"]["results"]

    def labels(pod: str, container: str) -> tuple[tuple[str, str], ...]:
        return tuple(sorted({"namespace": namespace, "pod": pod, "container": container, "claim": "shared",
                             "request": "gpu", "device": result["device"], "gpu_uuid": parent, "mig_profile": "",
                             "sharing": "mps", **gpu_labels(real, ours, parent)}.items()))

    expected = {labels("metrics-c", "cuda|side"): 150 * MiB, labels("metrics-d", "cuda"): 60 * MiB}

    def of_namespace(name: str) -> dict[tuple[tuple[str, str], ...], float]:
        series = claim_series(ours).get(name, {})
        return {k: v for k, v in series.items() if ("namespace", namespace) in k}

    try:
        wait_until(lambda: of_namespace("gpu_dra_claim_gpu_memory_used_bytes") == expected, 30,
                   "one series per pod of the shared claim, with the pods' allocations")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nexpected {expected}\ngot {claim_series(ours)}\n--- plugin ---\n"
                             f"{ours.log_tail(20)}") from None
    assert of_namespace("gpu_dra_claim_gpu_processes") == {labels("metrics-c", "cuda|side"): 2,
                                                            labels("metrics-d", "cuda"): 1}
    series = claim_series(ours)
    unattributed = {"gpu_uuid": parent, **gpu_labels(real, ours, parent)}
    assert series["gpu_dra_gpu_unattributed_processes"][tuple(sorted(unattributed.items()))] == 0
    assert series["gpu_dra_claim_metrics_errors_total"][(("source", "apiserver"),)] == 0
    for pod in pods:
        real.delete_pod(namespace, pod)


def _log(real: RealNode, namespace: str, pod: str, container: str = "cuda") -> str:
    assert real.node is not None
    try:
        return real.node.container_log(namespace, pod, container)
    except Exception:  # noqa: BLE001 - no log file yet
        return ""



MEMORY = "gpu_dra_claim_gpu_memory_used_bytes"


def test_prometheus_scrapes_the_plugin_and_every_dashboard_query_shows_the_two_mps_pods(
        real: RealNode, ours: LocalNodePlugin) -> None:
    """The dashboard as Grafana runs it, on a real Prometheus scraping the plugin: its variables (namespace, pod,
    node, GPU) list the pods' values, and each panel's query answers with the two pods' series (or, grouped by
    namespace or GPU, with theirs), the namespace filter matching the pods' namespace, not the plugin's."""
    assert real.node is not None and real.kube is not None
    namespace = "claim-metrics-prometheus"
    slots = [a for a in real.devices(ours).values() if a["type"] == "slot" and a.get("sharing") == "mps"]
    parent = slots[0]["parentUUID"]
    real.namespace(namespace)
    for pod, mib in ALLOC.items():
        create(real.kube, namespace, mps_template(pod, parent))
        create(real.kube, namespace, allocating_pod(pod, pod, mib, real.node.name))
    for pod, mib in ALLOC.items():
        wait_until(lambda: f"alloc: {mib} MiB on device 0" in _log(real, namespace, pod), 90,
                   f"pod {namespace}/{pod} to allocate {mib} MiB")
    # As the chart's ServiceMonitor has it: the target carries the plugin pod's namespace, pod and container, and
    # honor_labels keeps the workload's on the per-claim series.
    plugin_pod = {"namespace": "gpu-dra", "pod": "gpu-dra-kubelet-plugin-x7k2p", "container": "plugin"}
    config = {"global": {"scrape_interval": "5s", "scrape_timeout": "5s", "evaluation_interval": "5s"},
              "scrape_configs": [{"job_name": "gpu-dra-kubelet-plugin", "honor_labels": True,
                                  "static_configs": [{"targets": [f"127.0.0.1:{ours.metrics_port}"],
                                                      "labels": {**plugin_pod, "node": real.node.name}}]}]}
    node = gpu_labels(real, ours, parent)["Hostname"]
    with prometheus.running(config) as prom:
        def up() -> list[dict[str, Any]]:
            return [t for t in prom.targets() if t["health"] == "up"]

        wait_until(up, 60, "the plugin's target up")
        # Both pods' allocations scraped, and two samples of every series (for the rate() of the error counters).
        selector = f"{MEMORY}{{namespace='{namespace}'}}"

        def scraped() -> bool:
            total = prom.query(f"sum({selector})")
            return (bool(total) and float(total[0]["value"][1]) == sum(ALLOC.values()) * MiB
                    and len(prom.query(f"count_over_time({selector}[1m]) >= 2")) == len(ALLOC))

        wait_until(scraped, 60, "both pods' allocations in two scrapes")
        # The plugin's own series keep the target's labels (honor_labels only keeps labels a series has).
        registered, = prom.query("gpu_dra_kubelet_registered")
        assert {k: registered["metric"][k] for k in plugin_pod} == plugin_pod
        check_the_dashboard(prom, namespace=namespace, node=node, gpu_uuid=parent, pods=set(ALLOC),
                            memory=sum(ALLOC.values()) * MiB)
        # The queries docs/operations.md shows parse and run (the DCGM exporter's series are not here: empty).
        docs = (ROOT / "docs" / "operations.md").read_text()
        for expr in re.findall(r"```promql\n(.*?)```", docs, re.S):
            prom.query(expr)
    for pod in ALLOC:
        real.delete_pod(namespace, pod)
