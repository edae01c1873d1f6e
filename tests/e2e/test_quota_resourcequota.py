"""GPU quota per namespace with Kubernetes' ResourceQuota (docs/quota.md), on the real API server and
controller-manager: the manifests of examples/quota/, with the test's own driver name.

The API server's quota admission charges every ResourceClaim when it is created, per DeviceClass
(``<class>.deviceclass.resource.k8s.io/devices``), and refuses the one that would go over; the resourceclaim
controller's claim for a pod's template is refused the same way, and the pod's events say so.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from standin.workloads import EXAMPLES, apply_device_classes, create, create_namespace, wait_until

from api.deviceclasses import device_classes
from api.names import DEFAULT_DRIVER_NAME
from kube.client import ApiError, KubeApi, namespaced_collection
from testbed.localcluster import ClusterError, LocalCluster, find_binaries, pinned_version

pytestmark = pytest.mark.e2e

QUOTA = EXAMPLES / "quota"
PER_CLASS = ".deviceclass.resource.k8s.io/devices"


def manifests(name: str, driver: str) -> list[dict[str, Any]]:
    """The objects of examples/quota/<name> with `driver`'s class names instead of the default driver's."""
    text = (QUOTA / name).read_text().replace(DEFAULT_DRIVER_NAME, driver)
    return [d for d in yaml.safe_load_all(text) if d]


def apply_quota(kube: KubeApi, namespace: str, quota: dict[str, Any]) -> dict[str, Any]:
    """Creates the ResourceQuota and waits for the controller's first count: until then the API server refuses
    every claim of the namespace ("status unknown for quota")."""
    quota = {**quota, "metadata": {**quota["metadata"], "namespace": namespace}}
    kube.create(f"/api/v1/namespaces/{namespace}/resourcequotas", quota)
    path = f"/api/v1/namespaces/{namespace}/resourcequotas/{quota['metadata']['name']}"
    return wait_until(lambda: (q := kube.get(path)).get("status", {}).get("hard") and q, 60,
                      f"the quota controller to count ResourceQuota {path}")


def used(kube: KubeApi, namespace: str, name: str = "gpus") -> dict[str, str]:
    status: dict[str, dict[str, str]] = kube.get(f"/api/v1/namespaces/{namespace}/resourcequotas/{name}")["status"]
    return status.get("used") or {}


def refused(kube: KubeApi, namespace: str, obj: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        create(kube, namespace, obj)
    print(f"the API server refused {obj['kind']} {obj['metadata']['name']}: {caught.value.message}")
    assert caught.value.status == 403, caught.value
    return caught.value


def fill_and_go_over(kube: KubeApi, namespace: str, driver: str) -> str:
    """examples/quota's quota and the claims that fill it admitted, the claim one over refused with the class's
    resource in the message; returns the whole-GPU resource name."""
    quota, = manifests("resourcequota.yaml", driver)
    hard = apply_quota(kube, namespace, quota)["status"]["hard"]
    # Every class of the driver is under the quota: none is a way around it.
    assert {f"{c}{PER_CLASS}" for c in kube_classes(driver)} == set(hard)
    for claim in manifests("claims.yaml", driver):
        create(kube, namespace, claim)
    gpu, mig, slot = (f"{c}{PER_CLASS}" for c in (driver, f"mig.{driver}", f"slot.{driver}"))
    assert {k: used(kube, namespace)[k] for k in (gpu, mig, slot)} == {gpu: "2", mig: "1", slot: "2"}
    one_more = manifests("over-quota.yaml", driver)[0]
    error = refused(kube, namespace, one_more)
    assert "exceeded quota: gpus" in error.message and f"requested: {gpu}=1" in error.message, error.message
    assert f"used: {gpu}=2" in error.message and f"limited: {gpu}=2" in error.message, error.message
    return gpu


def test_claims_up_to_the_quota_are_admitted_and_one_more_is_refused(
        kube: KubeApi, namespace: str, driver_name: str) -> None:
    gpu = fill_and_go_over(kube, namespace, driver_name)
    claims = manifests("claims.yaml", driver_name)
    _, template, pod = manifests("over-quota.yaml", driver_name)
    # Each kind by its own class: a third MPS slot, a second MIG partition, a Hopper GPU through its family class.
    for cls, hard_value in ((f"slot.{driver_name}", "2"), (f"mig.{driver_name}", "1"), (f"hopper.{driver_name}", "0")):
        claim = one_device_claim(f"one-more-{cls.split('.')[0]}", cls)
        error = refused(kube, namespace, claim)
        assert f"limited: {cls}{PER_CLASS}={hard_value}" in error.message, error.message

    # A pod is admitted, the claim of its template is not: the pod waits, its events say why.
    create(kube, namespace, template)
    create(kube, namespace, pod)
    name = pod["metadata"]["name"]

    def refusal() -> str | None:
        events = kube.list(f"/api/v1/namespaces/{namespace}/events",
                           field_selector=f"involvedObject.name={name}")["items"]
        return next((e["message"] for e in events if e.get("reason") == "FailedResourceClaimCreation"), None)

    message = wait_until(refusal, 60, f"a FailedResourceClaimCreation event of pod {name}")
    print(f"pod {name}'s event: FailedResourceClaimCreation: {message}")
    assert "exceeded quota: gpus" in message and f"requested: {gpu}=1" in message, message
    assert kube.get(f"{namespaced_collection('Pod', namespace)}/{name}")["status"].get("phase") == "Pending"
    assert len(kube.list(namespaced_collection("ResourceClaim", namespace))["items"]) == len(claims)


def test_what_a_claim_is_charged(kube: KubeApi, namespace: str, driver_name: str) -> None:
    """firstAvailable: the most each alternative could take, on every alternative's class (both charged);
    allocationMode All: 32 devices (the most one allocation holds), whatever the pool has; adminAccess: charged
    like any claim."""
    gpu, mig, slot = driver_name, f"mig.{driver_name}", f"slot.{driver_name}"
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus"},
             "spec": {"hard": {f"{gpu}{PER_CLASS}": "4", f"{slot}{PER_CLASS}": "4", f"{mig}{PER_CLASS}": "40"}}}
    apply_quota(kube, namespace, quota)
    # adminAccess needs the namespace's consent label.
    kube.request("PATCH", f"/api/v1/namespaces/{namespace}", body={
        "metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}},
        content_type="application/merge-patch+json")

    create(kube, namespace, claim_of("gpu-or-two-slots", [{"firstAvailable": [
        {"name": "gpu", "deviceClassName": gpu}, {"name": "slots", "deviceClassName": slot, "count": 2}]}]))
    assert charged(kube, namespace, gpu, slot, mig) == {gpu: "1", slot: "2", mig: "0"}

    create(kube, namespace, claim_of("every-mig", [{"exactly": {"deviceClassName": mig, "allocationMode": "All"}}]))
    assert charged(kube, namespace, gpu, slot, mig) == {gpu: "1", slot: "2", mig: "32"}
    error = refused(kube, namespace, claim_of("every-mig-again", [
        {"exactly": {"deviceClassName": mig, "allocationMode": "All"}}]))
    assert f"requested: {mig}{PER_CLASS}=32" in error.message, error.message

    create(kube, namespace, claim_of("monitor", [{"exactly": {"deviceClassName": gpu, "adminAccess": True}}]))
    assert charged(kube, namespace, gpu, slot, mig) == {gpu: "2", slot: "2", mig: "32"}


def charged(kube: KubeApi, namespace: str, *classes: str) -> dict[str, str]:
    now = used(kube, namespace)
    return {c: now.get(f"{c}{PER_CLASS}", "0") for c in classes}


def claim_of(name: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": f"r{i}", **r} for i, r in enumerate(requests)]}}}


def one_device_claim(name: str, cls: str) -> dict[str, Any]:
    return claim_of(name, [{"exactly": {"deviceClassName": cls}}])


def kube_classes(driver: str) -> list[str]:
    return [c["metadata"]["name"] for c in device_classes(driver)]



@pytest.fixture(scope="module")
def old_kube() -> Iterator[KubeApi]:
    """A control plane of the oldest supported release (K8S_SKEW_VERSION), for this module only."""
    version = pinned_version("K8S_SKEW_VERSION")
    try:
        cluster = LocalCluster(bin_dir=find_binaries(version=version)).start()
    except ClusterError as exc:
        pytest.fail(f"the Kubernetes {version} control plane could not be built or started: {exc}", pytrace=False)
    client = cluster.api_client()
    try:
        yield KubeApi(client)
    finally:
        client.close()
        cluster.stop()


def test_the_oldest_supported_release_charges_the_same_resource_names(old_kube: KubeApi) -> None:
    driver = DEFAULT_DRIVER_NAME
    create_namespace(old_kube, "team-a")
    apply_device_classes(old_kube, driver)
    fill_and_go_over(old_kube, "team-a", driver)
