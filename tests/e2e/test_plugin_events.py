"""Events for failed prepares on the real control plane: the kubelet stand-in has a pod's claims prepared by
`gpu-dra kubelet-plugin`, one claim's config is invalid, and the claim and the pod get a Warning Event
PrepareFailed with the plugin's reason (what `kubectl describe pod` shows). The kubelet's retries add no Events."""
from __future__ import annotations

import time
from typing import Any

import pytest
from standin import PodPrepareError
from standin.workloads import create, wait_for_scheduled_pod
from test_plugin_prepare import H100, bad_config_pod

from kube.client import KubeApi

pytestmark = pytest.mark.e2e


def prepare_failed_events(kube: KubeApi, namespace: str) -> list[dict[str, Any]]:
    return [e for e in kube.list(f"/apis/events.k8s.io/v1/namespaces/{namespace}/events")["items"]
            if e.get("reason") == "PrepareFailed"]


def test_a_failed_prepare_is_an_event_on_the_claim_and_its_pod_once(cluster, kube, namespace, make_node):
    node = make_node([H100], {"default": {"slots": {"count": 2, "strategy": "time-slicing"}},
                              "rules": [{"match": {"index": 0}, "wholeGpu": True}]})
    for obj in bad_config_pod(node.driver, node.name):
        create(kube, namespace, obj)
    pod = wait_for_scheduled_pod(kube, namespace, "two-claims")

    with pytest.raises(PodPrepareError) as err:
        node.kubelet.prepare_pod(pod)
    [(bad_uid, message)] = err.value.errors.items()
    bad_claim = err.value.claims[bad_uid].name

    deadline = time.monotonic() + 20
    while len(events := prepare_failed_events(kube, namespace)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    by_kind = {e["regarding"]["kind"]: e for e in events}
    assert sorted(by_kind) == ["Pod", "ResourceClaim"], events
    claim_event, pod_event = by_kind["ResourceClaim"], by_kind["Pod"]
    assert (claim_event["regarding"]["name"], claim_event["regarding"]["uid"]) == (bad_claim, bad_uid)
    assert (pod_event["regarding"]["name"], pod_event["regarding"]["uid"]) == ("two-claims", pod["metadata"]["uid"])
    assert claim_event["note"] == message and pod_event["note"] == f"claim {bad_claim}: {message}"
    for e in events:
        assert e["type"] == "Warning"
        assert "sharing.timeSlicing.interval" in e["note"] and "Forever" in e["note"]
        assert e["reportingController"] == node.driver and e["reportingInstance"] == node.name

    # What `kubectl describe pod` shows, read through core/v1 Events as kubectl does.
    described = cluster.kubectl("describe", "pod", "two-claims", "-n", namespace).stdout
    assert "PrepareFailed" in described and "Forever" in described, described

    # The kubelet retries every few seconds: the claim's failures add no Events.
    for _ in range(8):
        with pytest.raises(PodPrepareError):
            node.kubelet.prepare_pod(pod)
    time.sleep(2)
    again = prepare_failed_events(kube, namespace)
    assert sorted(e["metadata"]["name"] for e in again) == sorted(e["metadata"]["name"] for e in events)
    assert "event not written" not in node.plugin.log_tail(400)


def test_the_chart_lets_the_plugin_write_and_count_events(cluster, api_client, kube, namespace, driver_name):
    """The Event writes with the chart's plugin ClusterRole alone (impersonated), the series patch included; the
    API server takes the bodies as they are (names, MicroTime, series)."""
    from kube.events import PREPARE_FAILED, ClaimEventRecorder, KubernetesEventWriter
    from testbed.helmchart import render

    [role] = [o for o in render("--set", f"driverName={driver_name}")
              if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("-kubelet-plugin")]
    name, user = f"{namespace}-plugin", f"{namespace}-plugin-user"
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    kube.create(f"{rbac}/clusterroles", {**role, "metadata": {"name": name}})
    kube.create(f"{rbac}/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
        "subjects": [{"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}],
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name}})
    claim = kube.create(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c"},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": driver_name}}]}}})
    client = cluster.api_client()
    client.set_default_header("Impersonate-User", user)
    try:
        recorder = ClaimEventRecorder(KubernetesEventWriter(client), driver_name, "node-x", min_interval_s=0)
        for _ in range(3):
            recorder.warn(namespace, "c", claim["metadata"]["uid"], PREPARE_FAILED, "bad\nconfig")
        assert recorder.flush()
        assert recorder.failed == 0 and recorder.dropped == 0
        [event] = prepare_failed_events(kube, namespace)
        assert event["series"]["count"] == 3 and event["note"] == "bad config"
        assert event["regarding"]["uid"] == claim["metadata"]["uid"]
        recorder.close()
    finally:
        client.close()
        for kind in ("clusterrolebindings", "clusterroles"):
            kube.request("DELETE", f"{rbac}/{kind}/{name}")
