"""Reading ResourceClaims from a real API server (``KubernetesClaimSource``) when the claim is not what the
kubelet's request says: gone (404), deleted and re-created under the same name (another UID), or not
allocated. Each fails only its own claim with a clear message, through the driver as the kubelet reaches it."""
from __future__ import annotations

from typing import Any

import pytest
from claims import request, resource_claim
from driver_node import Node, ok
from standin.workloads import create

from api.deviceclasses import device_classes
from kube.client import KubeApi
from kubeletplugin.claims import ClaimError, KubernetesClaimSource
from kubeletplugin.transport.nodedriver import ClaimRef

pytestmark = pytest.mark.e2e


def gpu_claim(name: str, driver: str) -> dict[str, Any]:
    gpu_class = device_classes(driver)[0]["metadata"]["name"]
    return resource_claim(name, None, requests=[request("gpu", gpu_class)])


def claims_path(namespace: str) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"


@pytest.fixture
def node(tmp_path, api_client) -> Node:
    """A simulated node whose driver reads its claims from the API server."""
    n = Node(tmp_path, {"default": {"wholeGpu": True}})
    n.driver.claims = KubernetesClaimSource(api_client)
    return n


def prepare_error(node: Node, ref: ClaimRef) -> str:
    return node.driver.prepare([ref])[ref.uid].error


def test_missing_claim_is_not_found(api_client: Any, namespace: str, node: Node) -> None:
    source = KubernetesClaimSource(api_client)
    with pytest.raises(ClaimError) as caught:
        source.get_claim(namespace, "no-such-claim", "u-1")
    assert str(caught.value) == f"ResourceClaim {namespace}/no-such-claim not found"

    ref = ClaimRef(namespace, "u-1", "no-such-claim")
    assert prepare_error(node, ref) == f"ResourceClaim {namespace}/no-such-claim not found"
    assert node.metrics.prepare_errors.labels(reason="claim")._value.get() == 1
    assert node.driver.checkpoint.get(ref.uid) is None


def test_claim_re_created_under_the_same_name_has_another_uid(kube: KubeApi, namespace: str, driver_name: str,
                                                              node: Node) -> None:
    old = create(kube, namespace, gpu_claim("again", driver_name))["metadata"]["uid"]
    kube.request("DELETE", f"{claims_path(namespace)}/again")
    new = create(kube, namespace, gpu_claim("again", driver_name))["metadata"]["uid"]
    assert new != old

    ref = ClaimRef(namespace, old, "again")          # what the kubelet still asks for
    assert prepare_error(node, ref) == (f"ResourceClaim {namespace}/again has UID {new!r}, expected {old!r} "
                                        "(it was deleted and re-created)")
    assert node.metrics.prepare_errors.labels(reason="claim")._value.get() == 1
    assert node.driver.checkpoint.get(old) is None


def test_unallocated_claim_fails_alone(kube: KubeApi, namespace: str, driver_name: str, node: Node) -> None:
    pending = create(kube, namespace, gpu_claim("pending", driver_name))
    ref = ClaimRef(namespace, pending["metadata"]["uid"], "pending")
    # A claim the kubelet may prepare: allocated to this node's gpu-1 (status written as the scheduler would).
    ready = create(kube, namespace, gpu_claim("ready", driver_name))
    ready["status"] = {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": node.driver.driver_name, "pool": node.driver.pool_name, "device": "gpu-1"}]}}}
    kube.request("PUT", f"{claims_path(namespace)}/ready/status", body=ready)
    ready_ref = ClaimRef(namespace, ready["metadata"]["uid"], "ready")

    out = node.driver.prepare([ref, ready_ref])
    assert out[ref.uid].error == f"ResourceClaim {namespace}/pending is not allocated"
    assert out[ready_ref.uid].error == ""
    assert [d.device_name for d in out[ready_ref.uid].devices] == ["gpu-1"]
    assert node.metrics.prepare_errors.labels(reason="claim")._value.get() == 1
    assert node.driver.checkpoint.get(ref.uid) is None
    assert ok(node.driver, ready_ref).devices == out[ready_ref.uid].devices
