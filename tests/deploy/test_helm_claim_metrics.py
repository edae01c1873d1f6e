"""The chart's side of the per-claim GPU metrics: the plugin gets the kubelet's PodResources directory and the host's
PID namespace, and no right to read pods (the node says which pod a process is in); the Grafana dashboard ConfigMap parses and asks only for metrics the
plugin exports."""
from __future__ import annotations

import json
import re
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from kubeletplugin.claimmetrics import ClaimMetricsCollector
from testbed.helmchart import render

PLUGIN = "gpu-dra-gpu-dra-driver-kubelet-plugin"


def exported_metric_names() -> set[str]:
    """What the plugin's collector exposes (a counter as <name>_total)."""
    return {f.name + "_total" if f.type == "counter" else f.name for f in ClaimMetricsCollector._families()}


def _find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def _plugin(objects: list[dict[str, Any]]) -> dict[str, Any]:
    ds, = _find(objects, "DaemonSet", PLUGIN)
    return ds["spec"]["template"]["spec"]


def _pods_rule(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    role, = _find(objects, "ClusterRole", PLUGIN)
    return [r for r in role["rules"] if "pods" in r["resources"]]


def test_plugin_reads_the_kubelets_pod_resources_directory_by_default() -> None:
    objects = render()
    spec = _plugin(objects)
    container, = [c for c in spec["containers"] if c["name"] == "plugin"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["POD_RESOURCES_SOCKET"] == "/var/lib/kubelet/pod-resources/kubelet.sock"
    mount, = [m for m in container["volumeMounts"] if m["name"] == "pod-resources"]
    assert (mount["mountPath"], mount.get("readOnly")) == ("/var/lib/kubelet/pod-resources", True)
    volume, = [v for v in spec["volumes"] if v["name"] == "pod-resources"]
    assert volume["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    assert spec["hostPID"] is True
    assert _pods_rule(objects) == []       # a node's token cannot read the cluster's pod specs
    assert not _find(objects, "ConfigMap", "gpu-dra-gpu-dra-driver-grafana-dashboard")


def test_the_socket_follows_kubelet_dir() -> None:
    spec = _plugin(render("--set", "kubeletDir=/data/kubelet"))
    container, = [c for c in spec["containers"] if c["name"] == "plugin"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["POD_RESOURCES_SOCKET"] == "/data/kubelet/pod-resources/kubelet.sock"


def test_off_means_no_socket_no_host_pids_no_pod_list() -> None:
    objects = render("--set", "claimMetrics.enabled=false", "--set", "mps.daemonCgroup=",
                     "--set", "claimMetrics.grafanaDashboard.enabled=true")
    spec = _plugin(objects)
    container, = [c for c in spec["containers"] if c["name"] == "plugin"]
    assert "POD_RESOURCES_SOCKET" not in {e["name"] for e in container["env"]}
    assert "pod-resources" not in {v["name"] for v in spec["volumes"]}
    assert not spec.get("hostPID")
    assert _pods_rule(objects) == []
    assert not _find(objects, "ConfigMap", "gpu-dra-gpu-dra-driver-grafana-dashboard")


def test_dashboard_configmap_parses_and_asks_only_for_exported_metrics() -> None:
    objects = render("--set", "claimMetrics.grafanaDashboard.enabled=true")
    cm, = _find(objects, "ConfigMap", "gpu-dra-gpu-dra-driver-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "gpu-dra"
    dashboard = json.loads(cm["data"]["gpu-dra-claims.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    assert exprs
    used = {m for e in exprs for m in re.findall(r"\b(gpu_dra_[a-z_]+)", e)}
    assert used and used <= exported_metric_names(), used - exported_metric_names()
    # Every panel's query is about a metric (none is left empty), and the views the operators asked for exist.
    assert all(re.search(r"gpu_dra_", t["expr"]) for p in dashboard["panels"] for t in p.get("targets", []))
    groupings = " ".join(exprs)
    for by in ("by (namespace)", "by (namespace, pod, container)", "by (gpu_uuid"):
        assert by in groupings, by
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_labels_and_namespace_can_be_set() -> None:
    objects = render("--set", "claimMetrics.grafanaDashboard.enabled=true",
                     "--set", "claimMetrics.grafanaDashboard.namespace=monitoring",
                     "--set-string", "claimMetrics.grafanaDashboard.labels.grafana_dashboard=yes")
    cm, = _find(objects, "ConfigMap", "gpu-dra-gpu-dra-driver-grafana-dashboard")
    assert (cm["metadata"]["namespace"], cm["metadata"]["labels"]["grafana_dashboard"]) == ("monitoring", "yes")


def test_the_collector_exports_what_the_names_say() -> None:
    # The names the chart test checks against are the collector's own, as a scrape shows them.
    registry = CollectorRegistry()
    ClaimMetricsCollector(nvml=None, registry=registry, claim_devices=lambda: [], pod_resources=lambda: [],
                          read_claim=None)
    text = generate_latest(registry).decode()
    for name in exported_metric_names():
        assert re.search(rf"^# HELP {name} ", text, re.M), name
