"""How Prometheus finds the kubelet plugins' /metrics in the chart: a headless metrics Service on the plugin pods'
port, and a ServiceMonitor or PodMonitor only where prometheus-operator's API is served, with honorLabels (the
per-claim series' namespace, pod and container are the workload's); the dashboard averages utilisation."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from testbed.helmchart import CHART, ROOT, helm, render, template_args
from testbed.prometheus import promtool

PLUGIN = "gpu-dra-gpu-dra-driver-kubelet-plugin"
OPERATOR = ("--api-versions", "monitoring.coreos.com/v1")


def _find(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def _plugin_pod_labels(objects: list[dict[str, Any]]) -> dict[str, str]:
    ds, = [o for o in objects if o["kind"] == "DaemonSet" and o["metadata"]["name"] == PLUGIN]
    labels: dict[str, str] = ds["spec"]["template"]["metadata"]["labels"]
    return labels


def test_a_headless_metrics_service_selects_the_plugin_pods_port() -> None:
    objects = render()
    service, = [s for s in _find(objects, "Service") if s["metadata"]["name"] == f"{PLUGIN}-metrics"]
    assert service["spec"]["clusterIP"] == "None"
    selector = service["spec"]["selector"]
    assert selector.items() <= _plugin_pod_labels(objects).items()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 8080, "targetPort": "metrics",
                                         "protocol": "TCP"}]
    # Without prometheus-operator's API there is nothing to apply a monitor to.
    assert not _find(objects, "ServiceMonitor") and not _find(objects, "PodMonitor")


def test_a_service_monitor_where_the_operator_api_is_served() -> None:
    objects = render(*OPERATOR, "--set-string", "metrics.monitor.labels.release=kube-prometheus-stack",
                     "--set", "kubeletPlugin.metricsPort=9400")
    monitor, = _find(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    service, = [s for s in _find(objects, "Service") if s["metadata"]["name"] == f"{PLUGIN}-metrics"]
    # The monitor selects the metrics Service (and no other Service of the chart) in the release's namespace.
    selected = [s for s in _find(objects, "Service")
                if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert selected == [service]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["gpu-dra"]}
    endpoint, = monitor["spec"]["endpoints"]
    assert service["spec"]["ports"][0]["port"] == 9400
    assert (endpoint["port"], endpoint["path"], endpoint["honorLabels"]) == ("metrics", "/metrics", True)
    assert endpoint["interval"] == "30s"


def test_a_pod_monitor_selects_the_plugin_pods() -> None:
    objects = render(*OPERATOR, "--set", "metrics.monitor.kind=PodMonitor", "--set", "metrics.service.enabled=false")
    monitor, = _find(objects, "PodMonitor")
    assert not _find(objects, "ServiceMonitor")
    assert f"{PLUGIN}-metrics" not in {s["metadata"]["name"] for s in _find(objects, "Service")}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= _plugin_pod_labels(objects).items()
    endpoint, = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["honorLabels"]) == ("metrics", True)


def test_no_service_or_monitor_without_a_metrics_port_or_when_off() -> None:
    for args in (("--set", "kubeletPlugin.metricsPort=0"), ("--set", "metrics.monitor.enabled=false",
                                                             "--set", "metrics.service.enabled=false")):
        objects = render(*OPERATOR, *args)
        assert f"{PLUGIN}-metrics" not in {s["metadata"]["name"] for s in _find(objects, "Service")}, args
        assert not _find(objects, "ServiceMonitor") and not _find(objects, "PodMonitor"), args


def test_bad_monitor_values_are_refused_with_their_name() -> None:
    proc = helm(*template_args(*OPERATOR, "--set", "metrics.monitor.kind=Probe"))
    assert proc.returncode != 0 and "metrics/monitor/kind" in proc.stderr, proc.stderr
    proc = helm(*template_args(*OPERATOR, "--set", "metrics.service.enabled=false"))
    assert proc.returncode != 0 and "metrics.monitor.kind=ServiceMonitor" in proc.stderr, proc.stderr
    proc = helm(*template_args("--set", "metrics.monitor.interval=soon"))
    assert proc.returncode != 0 and "metrics/monitor/interval" in proc.stderr, proc.stderr


def test_the_dashboard_averages_utilisation_and_filters_by_node() -> None:
    dashboard = json.loads((CHART / "files" / "dashboards" / "gpu-dra-claims.json").read_text())
    panels = {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in dashboard["panels"]}
    # A pod on 8 busy GPUs is at 100 %, not 800 %: percentages are averaged over devices, never summed.
    for title in ("SM utilisation by namespace", "SM utilisation by pod", "Memory bandwidth utilisation by pod"):
        expr, = panels[title]
        assert expr.startswith("avg by ("), (title, expr)
    expr, = panels["SM utilisation by GPU"]
    assert expr.startswith("clamp_max(") and expr.endswith(", 100)"), expr
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"namespace", "pod", "node", "gpu"}
    for title, exprs in panels.items():
        for expr in exprs:
            if re.search(r"gpu_dra_claim_gpu_\w+\{", expr):
                assert 'Hostname=~"$node"' in expr, (title, expr)


def test_the_documented_scrape_config_is_one_prometheus_accepts(tmp_path: Path) -> None:
    # docs/operations.md's job for a Prometheus without the operator, as promtool (the pinned release) checks it.
    docs = (ROOT / "docs" / "operations.md").read_text()
    section = docs[docs.index("### Scraping the plugins"):]
    block, = re.findall(r"```yaml\n(scrape_configs:.*?)```", section, re.S)[:1]
    assert "honor_labels: true" in block
    path = tmp_path / "prometheus.yml"
    path.write_text(block)
    proc = promtool("check", "config", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # promtool does refuse a broken one: the check is not a formality.
    path.write_text(block.replace("role: pod", "role: pods"))
    assert promtool("check", "config", str(path)).returncode != 0
