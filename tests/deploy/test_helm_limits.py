"""What the chart bounds (rendered by the pinned Helm): default resources of every container, and NetworkPolicies
that let only the API server reach the webhook port and only monitoring namespaces reach the metrics ports."""
from __future__ import annotations

from typing import Any

import pytest

from testbed.helmchart import helm, render, template_args


def component(o: dict[str, Any]) -> str:
    return str(o["metadata"]["labels"]["app.kubernetes.io/component"])


def workloads(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {component(o): o for o in objects if o["kind"] in ("DaemonSet", "Deployment")}


def policies(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {component(o): o for o in objects if o["kind"] == "NetworkPolicy"}


@pytest.fixture(scope="module")
def default() -> list[dict[str, Any]]:
    return render()


def test_every_container_has_requests_and_a_memory_limit_by_default(default: list[dict[str, Any]]) -> None:
    found = workloads(default)
    assert set(found) == {"kubelet-plugin", "controller", "webhook"}
    for name, w in found.items():
        pod = w["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            resources = c["resources"]
            assert set(resources["requests"]) == {"cpu", "memory"}, (name, c["name"])
            assert resources["limits"]["memory"], (name, c["name"])
    [webhook] = found["webhook"]["spec"]["template"]["spec"]["containers"]
    assert webhook["resources"]["limits"]["memory"] == "512Mi"
    mine = workloads(render("--set", "webhook.resources.limits.memory=1Gi", "--set", "controller.resources=null"))
    assert mine["webhook"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] == "1Gi"
    assert "resources" not in mine["controller"]["spec"]["template"]["spec"]["containers"][0]


def test_network_policies_select_each_component_and_open_only_its_port(default: list[dict[str, Any]]) -> None:
    found, pods = policies(default), workloads(default)
    assert set(found) == set(pods)
    for name, policy in found.items():
        spec = policy["spec"]
        assert policy["metadata"]["namespace"] == "gpu-dra" and spec["policyTypes"] == ["Ingress"]
        template = pods[name]["spec"]["template"]
        selector = spec["podSelector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), name
        for other, w in pods.items():  # and no other component's pods
            if other != name:
                assert not selector.items() <= w["spec"]["template"]["metadata"]["labels"].items(), (name, other)
        [rule] = spec["ingress"]
        [port] = rule["ports"]
        [c] = template["spec"]["containers"]
        assert port["port"] in {p["name"] for p in c["ports"]} and port["protocol"] == "TCP", name
        assert rule["from"], f"{name}: an ingress rule without peers admits every source"


def test_only_the_api_servers_addresses_reach_the_webhook(default: list[dict[str, Any]]) -> None:
    rule = policies(default)["webhook"]["spec"]["ingress"][0]
    assert rule["ports"] == [{"port": "https", "protocol": "TCP"}]
    assert rule["from"] == [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}]
    narrowed = policies(render("--set-json", 'networkPolicy.webhook.apiServerCIDRs=["10.0.0.0/24","fd00:1::/64"]',
                               "--set-json", 'networkPolicy.webhook.exceptCIDRs=["10.0.0.128/25"]',
                               "--set-json", 'networkPolicy.webhook.extraFrom=[{"namespaceSelector": '
                                             '{"matchLabels": {"kubernetes.io/metadata.name": "konnectivity"}}}]'))
    assert narrowed["webhook"]["spec"]["ingress"][0]["from"] == [
        {"ipBlock": {"cidr": "10.0.0.0/24", "except": ["10.0.0.128/25"]}},  # an except only in its own family
        {"ipBlock": {"cidr": "fd00:1::/64"}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "konnectivity"}}}]
    # No source at all would render a rule that admits everyone: refused with the way out named.
    proc = helm(*template_args("--set-json", "networkPolicy.webhook.apiServerCIDRs=[]"))
    assert proc.returncode != 0 and "networkPolicy.webhook: name the API server's addresses" in proc.stderr


def test_metrics_ports_only_from_monitoring_namespaces(default: list[dict[str, Any]]) -> None:
    for name in ("controller", "kubelet-plugin"):
        rule = policies(default)[name]["spec"]["ingress"][0]
        assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
        assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    mine = policies(render("--set", r"networkPolicy.metrics.namespaceSelector.matchLabels.kubernetes\.io/metadata\.name=obs"))
    assert mine["controller"]["spec"]["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "obs"}}}]
    # No metrics port: the plugin's pods take no ingress at all.
    off = policies(render("--set", "kubeletPlugin.metricsPort=0"))
    assert off["kubelet-plugin"]["spec"]["ingress"] == []


def test_network_policies_can_be_turned_off() -> None:
    assert not policies(render("--set", "networkPolicy.enabled=false"))
    assert set(policies(render("--set", "webhook.enabled=false"))) == {"controller", "kubelet-plugin"}


@pytest.mark.parametrize(("args", "error"), [
    (["--set-json", 'networkPolicy.webhook.apiServerCIDRs=["everywhere"]'], "at '/networkPolicy/webhook/apiServerCIDRs/0'"),
    (["--set", "networkPolicy.webhook.from=x"], "at '/networkPolicy/webhook': additional properties 'from' not allowed"),
    (["--set", "webhook.resources.request.cpu=1"], "at '/webhook/resources': additional properties 'request' not allowed"),
    (["--set-json", 'controller.resources.limits={"memory": ["1Gi"]}'], "at '/controller/resources/limits/memory'"),
], ids=["cidr", "unknown-key", "resources-typo", "quantity-type"])
def test_values_schema_refuses_bad_limits_and_policies(args: list[str], error: str) -> None:
    proc = helm(*template_args(*args))
    assert proc.returncode != 0, f"helm template {args} succeeded"
    assert error in proc.stderr, proc.stderr
