"""The chart's RBAC and admission policies on the real API server, at the target release (1.37) and at the oldest
supported one (1.34, K8S_SKEW_VERSION), where the API server does not yet hold a node's plugin to its own claims.

`helm template` renders the chart; its ClusterRoles, bindings and ValidatingAdmissionPolicies are applied as they
are. Requests are then sent as the plugin's service account on a node (the admin impersonates it, with the node
name in the extra a pod-bound token carries) and as the controller's service account, and they are the driver's
own code paths: the plugin reads a claim, publishes its node's slices (watching them) and writes the claim's
status.devices; the controller keeps its DeviceClasses and removes the slices of a node that is gone. Each of
those must pass with the chart's grants alone, and what the identities must not do is refused: the plugin reads no
pods (the per-claim metrics need none), the controller creates, changes and deletes no other driver's DeviceClass,
deletes no other driver's ResourceSlice and posts no Event but its MPS tenancy Warnings on claims and pods (the
chart's controller policies, on both releases); with the pending-claim Events off it reads no claims at all."""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from api.deviceclasses import device_classes
from controller.cluster import DRIVER_LABEL, MANAGED_BY, MANAGED_BY_LABEL, ClusterController
from controller.clusterstate import ClusterState
from controller.pendingclaims import ACTION_ALLOCATE, MPS_TENANCY, PendingClaimEvents
from kube.client import DEVICE_CLASSES, NODES, RESOURCE_V1, SLICES, ApiError, KubeApi
from kube.events import KubernetesEventWriter, ObjectRef, claim_ref, event_body, micro_time
from kube.resourceslices import DesiredPool, Owner, ResourceSliceController
from kubeletplugin.claims import KubernetesClaimSource
from kubeletplugin.claimstatus import DeviceStatus, KubernetesClaimStatusWriter
from kubeletplugin.transport.nodedriver import ClaimRef
from testbed.demo_examples import create_namespace
from testbed.helmchart import render
from testbed.localcluster import ClusterError, LocalCluster, find_binaries, pinned_version

pytestmark = pytest.mark.e2e

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
APPLIED = {"ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
           "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
           "ValidatingAdmissionPolicy": "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
           "ValidatingAdmissionPolicyBinding": "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"}
OTHER_DRIVER = "other.example.com"
_numbers = itertools.count(1)


@pytest.fixture(scope="module", params=["target", "skew"])
def control_plane(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """The session's control plane, then a 1.34 one started for this module."""
    if request.param == "target":
        yield request.getfixturevalue("cluster")
        return
    version = pinned_version("K8S_SKEW_VERSION")
    try:
        old = LocalCluster(bin_dir=find_binaries(version=version)).start()
    except ClusterError as exc:   # a failure, never a skip: the oldest supported release must be tested
        pytest.fail(f"the Kubernetes {version} control plane could not be built or started: {exc}", pytrace=False)
    try:
        yield old
    finally:
        old.stop()


def minor(kube: KubeApi) -> int:
    return kube.server_version()[1]


def impersonating(cluster: LocalCluster, user: str, node: str | None = None) -> Any:
    client = cluster.api_client()
    client.set_default_header("Impersonate-User", user)
    if node:
        client.set_default_header("Impersonate-Extra-" + NODE_NAME_EXTRA.replace("/", "%2F"), node)
    return client


def refused(call: Callable[[], Any], *, by_policy: str | None = None, also: tuple[int, ...] = ()) -> ApiError:
    """The error of a call that must fail: refused by the named admission policy (422), or with one of `also`."""
    with pytest.raises(ApiError) as err:
        call()
    exc = err.value
    by_it = by_policy is not None and exc.status == 422 and f"ValidatingAdmissionPolicy '{by_policy}'" in exc.message
    assert by_it or exc.status in also, exc
    return exc


def claim_path(namespace: str, name: str = "") -> str:
    return f"{RESOURCE_V1}/namespaces/{namespace}/resourceclaims" + (f"/{name}" if name else "")


def allocation(driver: str, node: str, devices: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """An allocation of the claim's request on `node`: (driver, device) results from pool `node`."""
    return {"devices": {"results": [{"request": "gpu", "driver": d, "pool": node, "device": dev}
                                    for d, dev in (devices or [(driver, "gpu-0")])]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}


def merge_status(kube: KubeApi, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
    return kube.request("PATCH", claim_path(namespace, name) + "/status", body={"status": status},
                        content_type="application/merge-patch+json")


class Release:
    """The chart's RBAC and admission policies for one release, a node pair, and clients for its identities."""

    def __init__(self, cluster: LocalCluster, driver: str, *values: str) -> None:
        """`values`: more `--set` arguments for `helm template`."""
        n = next(_numbers)
        self.cluster, self.driver = cluster, driver
        self.kube = KubeApi(cluster.api_client())
        self.release, self.namespace = f"lp{n}", f"lp{n}-system"
        self.node_a, self.node_b = f"lp{n}-node-a", f"lp{n}-node-b"
        self.ns_a, self.ns_b = f"lp{n}-team-a", f"lp{n}-team-b"
        objects = render("--set", f"driverName={driver}", *values, release=self.release, namespace=self.namespace)
        self.objects = [o for o in objects if o["kind"] in APPLIED]
        self.fullname = next(o["metadata"]["name"] for o in self.objects if o["kind"] == "ClusterRole"
                             and o["metadata"]["name"].endswith("-kubelet-plugin")).removesuffix("-kubelet-plugin")
        plugin_sa = f"system:serviceaccount:{self.namespace}:{self.fullname}-kubelet-plugin"
        controller_sa = f"system:serviceaccount:{self.namespace}:{self.fullname}-controller"
        self.plugin_a_client = impersonating(cluster, plugin_sa, self.node_a)
        self.plugin_a = KubeApi(self.plugin_a_client)
        self.controller_client = impersonating(cluster, controller_sa)
        self.controller = KubeApi(self.controller_client)
        self.claims_policy = f"{self.fullname}-resourceclaim-status"
        self.classes_policy = f"{self.fullname}-controller-deviceclasses"
        self.slices_policy = f"{self.fullname}-controller-slice-deletes"
        self.events_policy = f"{self.fullname}-controller-events"
        self.foreign_slice = f"{self.release}-{OTHER_DRIVER}"

    def install(self) -> None:
        for name in (self.node_a, self.node_b):
            self.kube.create(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                                     "spec": {"unschedulable": True}})
        for ns in (self.ns_a, self.ns_b):
            create_namespace(self.kube, ns)
        for obj in self.objects:
            self.kube.create(APPLIED[obj["kind"]], obj)

    def claim(self, namespace: str, name: str, on_node: str | None = None,
              devices: list[tuple[str, str]] | None = None) -> dict[str, Any]:
        """A claim, allocated on `on_node` (by the admin, as the scheduler would) unless None."""
        self.kube.create(claim_path(namespace), {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": self.driver}}]}}})
        if on_node:
            merge_status(self.kube, namespace, name, {"allocation": allocation(self.driver, on_node, devices)})
        return self.kube.get(claim_path(namespace, name))

    def wait_until_enforced(self, own: dict[str, Any], timeout: float = 30.0) -> None:
        """RBAC and policies take effect asynchronously. Waits until the plugin may read its node's claim `own`
        but not drop its allocation, and the controller's deletes of a DeviceClass it did not make and of another
        driver's ResourceSlice are refused by the policies. (A probe that gets through is undone.)"""
        ns, name = own["metadata"]["namespace"], own["metadata"]["name"]
        probe = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                 "metadata": {"name": f"probe.{self.driver}"}, "spec": {}}
        self.kube.create(DEVICE_CLASSES, probe)
        self.kube.create(SLICES, self.slice_of(OTHER_DRIVER, self.foreign_slice))

        def plugin_held() -> bool:
            try:
                self.plugin_a.get(claim_path(ns, name))
            except ApiError:
                return False           # its RBAC is not in force yet
            try:
                merge_status(self.plugin_a, ns, name, {"allocation": None})
            except ApiError as exc:
                return exc.status in (403, 422)
            merge_status(self.kube, ns, name, {"allocation": own["status"]["allocation"]})
            return False

        def controller_held() -> bool:
            try:
                self.controller.delete(DEVICE_CLASSES, probe["metadata"]["name"])
            except ApiError as exc:
                return exc.status == 422 and self.classes_policy in exc.message
            self.kube.create(DEVICE_CLASSES, probe)
            return False

        def slices_held() -> bool:
            try:
                self.controller.delete(SLICES, self.foreign_slice)
            except ApiError as exc:
                return exc.status == 422 and self.slices_policy in exc.message
            self.kube.create(SLICES, self.slice_of(OTHER_DRIVER, self.foreign_slice))
            return False

        deadline = time.monotonic() + timeout
        while not (plugin_held() and controller_held() and slices_held()):
            assert time.monotonic() < deadline, "the chart's RBAC and admission policies were not enforced in time"
            time.sleep(0.3)

    def slice_of(self, driver: str, name: str) -> dict[str, Any]:
        """A slice of `driver` on a node that does not exist."""
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
                "spec": {"driver": driver, "nodeName": f"{self.release}-gone", "devices": [],
                         "pool": {"name": "gone", "generation": 1, "resourceSliceCount": 1}}}

    def remove(self) -> None:
        def quietly(method: str, path: str) -> None:
            try:
                self.kube.request(method, path)
            except ApiError:
                pass

        for obj in self.kube.list(SLICES, field_selector=f"spec.driver={self.driver}")["items"]:
            quietly("DELETE", f"{SLICES}/{obj['metadata']['name']}")
        quietly("DELETE", f"{SLICES}/{self.foreign_slice}")
        quietly("DELETE", f"{DEVICE_CLASSES}/foreign-{self.release}.example.com")
        for obj in self.kube.list(DEVICE_CLASSES)["items"]:
            if obj["metadata"]["name"].endswith(self.driver):
                quietly("DELETE", f"{DEVICE_CLASSES}/{obj['metadata']['name']}")
        for obj in reversed(self.objects):
            quietly("DELETE", f"{APPLIED[obj['kind']]}/{obj['metadata']['name']}")
        for ns in (self.ns_a, self.ns_b):
            quietly("DELETE", f"/api/v1/namespaces/{ns}")
        for name in (self.node_a, self.node_b):
            quietly("DELETE", f"{NODES}/{name}")
        for client in (self.plugin_a_client, self.controller_client, self.kube.api_client):
            client.close()


@pytest.fixture
def release(control_plane: LocalCluster, driver_name: str) -> Iterator[Release]:
    r = Release(control_plane, driver_name)
    try:
        r.install()
        yield r
    finally:
        r.remove()


def test_the_plugin_on_a_node_writes_only_its_own_claims_status_devices(release: Release) -> None:
    r, driver = release, release.driver
    own = r.claim(r.ns_a, "own", r.node_a, [(driver, "gpu-0"), (OTHER_DRIVER, "other-0")])
    theirs = r.claim(r.ns_b, "theirs", r.node_b)
    r.claim(r.ns_b, "unallocated")
    r.wait_until_enforced(own)
    old_server = minor(r.kube) < 36
    # 1.36+ refuses these itself (403, or 422 naming the permission the write lacks, before any admission
    # policy runs); before 1.36 only the policy stands in the way.
    api_refusal = () if old_server else (403, 422)

    # Allowed: its own entries in status.devices of a claim allocated on its node, through the plugin's writer.
    writer = KubernetesClaimStatusWriter(r.plugin_a_client, driver, r.node_a)
    ref = ClaimRef(namespace=r.ns_a, uid=own["metadata"]["uid"], name="own")
    writer.publish(ref, [DeviceStatus(pool=r.node_a, device="gpu-0")], time.time())
    stored = r.kube.get(claim_path(r.ns_a, "own"))
    assert [(d["driver"], d["pool"], d["device"]) for d in stored["status"]["devices"]] == [(driver, r.node_a, "gpu-0")]
    assert stored["status"]["allocation"] == own["status"]["allocation"]

    # The finding: the status of another namespace's claim, not allocated (or allocated elsewhere), rewritten
    # to an allocation of another driver.
    forged = allocation(OTHER_DRIVER, r.node_b, [(OTHER_DRIVER, "gpu-0")])
    message = refused(lambda: merge_status(r.plugin_a, r.ns_b, "unallocated", {"allocation": forged}),
                      by_policy=r.claims_policy, also=api_refusal).message
    if old_server:
        assert (f"the kubelet plugin on node {r.node_a} may only write the status of ResourceClaims allocated a "
                f"device of driver {driver} from its node, not of ResourceClaim {r.ns_b}/unallocated") in message
    refused(lambda: merge_status(r.plugin_a, r.ns_b, "theirs", {"allocation": None}),
            by_policy=r.claims_policy, also=api_refusal)
    entry = {"driver": driver, "pool": r.node_b, "device": "gpu-0"}
    refused(lambda: merge_status(r.plugin_a, r.ns_b, "theirs", {"devices": [entry]}),
            by_policy=r.claims_policy, also=api_refusal)
    assert "allocation" not in (r.kube.get(claim_path(r.ns_b, "unallocated")).get("status") or {})
    assert r.kube.get(claim_path(r.ns_b, "theirs"))["status"] == theirs["status"]

    # On its own node's claim: no allocation or reservedFor change, no entries of another driver.
    refused(lambda: merge_status(r.plugin_a, r.ns_a, "own", {"allocation": None}),
            by_policy=r.claims_policy, also=api_refusal)
    reserve = {"reservedFor": [{"resource": "pods", "name": "intruder", "uid": "0b6d9c3e-2c5e-4f7e-9a53-5d8a1c1f2e3d"}]}
    message = refused(lambda: merge_status(r.plugin_a, r.ns_a, "own", reserve),
                      by_policy=r.claims_policy, also=api_refusal).message
    if old_server:
        assert f"may not change status.reservedFor of ResourceClaim {r.ns_a}/own" in message
    foreign = {"driver": OTHER_DRIVER, "pool": r.node_a, "device": "other-0"}
    message = refused(lambda: r.plugin_a.request(
        "PATCH", claim_path(r.ns_a, "own") + "/status", query={"fieldManager": "intruder", "force": True},
        body={"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
              "metadata": {"name": "own", "namespace": r.ns_a}, "status": {"devices": [foreign]}},
        content_type="application/apply-patch+yaml"), by_policy=r.claims_policy, also=api_refusal).message
    if old_server:
        assert f"not of driver {OTHER_DRIVER} and pool {r.node_a}" in message
    after = r.kube.get(claim_path(r.ns_a, "own"))["status"]
    assert after["allocation"] == own["status"]["allocation"] and "reservedFor" not in after
    assert [d["driver"] for d in after["devices"]] == [driver]


def test_the_plugins_and_the_controllers_own_calls_pass_with_the_chart_rbac_alone(release: Release) -> None:
    r, driver = release, release.driver
    own = r.claim(r.ns_a, "own", r.node_a)
    r.wait_until_enforced(own)

    # The plugin: reads a claim by name (and nothing more), publishes and watches its node's slices, reports a
    # failed prepare as an Event.
    got = KubernetesClaimSource(r.plugin_a_client).get_claim(r.ns_a, "own", own["metadata"]["uid"])
    assert got["metadata"]["uid"] == own["metadata"]["uid"]
    pool = {r.node_a: DesiredPool(slices=[{"devices": [{"name": "gpu-0"}]}], node_name=r.node_a)}
    with ResourceSliceController(r.plugin_a_client, driver, Owner.node(r.node_a), sync_delay=0.2) as slices:
        slices.update(pool)
        assert slices.wait_for_sync(30), slices.errors
        pool[r.node_a].slices[0]["devices"].append({"name": "gpu-1"})
        slices.update(pool)                            # an update in place
        assert slices.wait_for_sync(30), slices.errors
        slices.update({})                              # and a delete
        assert slices.wait_for_sync(30), slices.errors
        assert slices.writes_by_operation == {"create": 1, "update": 1, "delete": 1}
    # A failed prepare's Warning Event on the claim: created, then its series patched.
    events = KubernetesEventWriter(r.plugin_a_client)
    event = event_body(claim_ref(r.ns_a, "own", own["metadata"]["uid"]), reason="PrepareFailed", note="probe",
                       controller=driver, instance=r.node_a, now=time.time())
    events.create(event)
    events.patch(r.ns_a, event["metadata"]["name"], {"series": {"count": 2, "lastObservedTime": micro_time(time.time())}})
    for what, call in (("list claims", lambda: r.plugin_a.list(claim_path(r.ns_a))),
                       ("list nodes", lambda: r.plugin_a.list(NODES)),
                       ("list pods", lambda: r.plugin_a.list("/api/v1/pods",
                                                             field_selector=f"spec.nodeName={r.node_a}")),
                       ("get a pod", lambda: r.plugin_a.get(f"/api/v1/namespaces/{r.ns_a}/pods/any")),
                       ("patch slices", lambda: r.plugin_a.request("PATCH", f"{SLICES}/x", body={},
                                                                   content_type="application/merge-patch+json"))):
        assert refused(call, also=(403,)).status == 403, what

    # The controller: its DeviceClasses (created, then one put back after an edit), a class it made that is no
    # longer wanted deleted, and the slices of a node that is gone.
    stale = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
             "metadata": {"name": f"retired.{driver}", "labels": {MANAGED_BY_LABEL: MANAGED_BY, DRIVER_LABEL: driver}},
             "spec": {}}
    r.kube.create(DEVICE_CLASSES, stale)
    r.kube.create(SLICES, r.slice_of(driver, f"gone-{driver}"))
    controller = ClusterController(r.controller_client, driver, device_classes(driver))
    controller.reconcile_once()
    wanted = {c["metadata"]["name"] for c in device_classes(driver)}
    names = {o["metadata"]["name"] for o in r.kube.list(DEVICE_CLASSES)["items"] if o["metadata"]["name"].endswith(driver)}
    assert names == wanted | {f"probe.{driver}"}
    assert not r.kube.list(SLICES, field_selector=f"spec.driver={driver}")["items"]
    edited = r.kube.get(f"{DEVICE_CLASSES}/{driver}")
    edited["spec"]["selectors"] = []
    r.kube.replace(DEVICE_CLASSES, edited)
    controller.reconcile_once()
    assert controller.writes_by_operation == {"deviceclass-create": len(wanted), "deviceclass-delete": 1,
                                              "slice-delete": 1, "deviceclass-update": 1}
    assert r.kube.get(f"{DEVICE_CLASSES}/{driver}")["spec"]["selectors"]

    # What the controller must not do: read or change a class that is not its own, delete one it did not make.
    refused(lambda: r.controller.get(f"{DEVICE_CLASSES}/probe.{driver}"), also=(403,))
    message = refused(lambda: r.controller.delete(DEVICE_CLASSES, f"probe.{driver}"), by_policy=r.classes_policy).message
    assert f"may only delete DeviceClasses it made for that driver, not DeviceClass probe.{driver}" in message

    # Its pass over pending claims: the caches (the claims, and the DeviceTaintRules on servers that have them,
    # besides the classes, slices and nodes) listed and watched, a waiting claim judged, and a Warning Event on a
    # claim and its pod.
    waiting = r.claim(r.ns_b, "waiting")
    state = ClusterState(KubeApi(r.controller_client), driver, wanted).start()
    try:
        assert state.wait_synced(60) and not state.problems(), state.problems()
        pending = PendingClaimEvents(state, driver, wanted, api_client=r.controller_client, min_age_s=0)
        assert pending.pass_once() == 1
    finally:
        state.stop()
    if minor(r.kube) >= 37:
        r.controller.list(f"{RESOURCE_V1}/devicetaintrules")
    pod = ObjectRef("v1", "Pod", r.ns_b, "waiting-pod", "0f8a7c6e-1111-4222-8333-444455556666")
    for regarding in (claim_ref(r.ns_b, "waiting", waiting["metadata"]["uid"]), pod):
        KubernetesEventWriter(r.controller_client).create(event_body(
            regarding, reason=MPS_TENANCY, note="probe", controller=f"{driver}/controller", instance="probe",
            now=time.time(), action=ACTION_ALLOCATE))
    # Nothing more of claims and pods than that list.
    refused(lambda: r.controller.get(claim_path(r.ns_b, "waiting")), also=(403,))
    refused(lambda: merge_status(r.controller, r.ns_b, "waiting", {"allocation": None}), also=(403,))
    refused(lambda: r.controller.list(f"/api/v1/namespaces/{r.ns_b}/pods"), also=(403,))

    # Nor create or change a DeviceClass that is not its own, nor delete another driver's slice: refused by the
    # chart's controller policies (RBAC cannot name what a create makes, nor whose slice a delete removes).
    foreign = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
               "metadata": {"name": f"foreign-{r.release}.example.com",
                            "labels": {MANAGED_BY_LABEL: MANAGED_BY, DRIVER_LABEL: driver}}, "spec": {}}
    message = refused(lambda: r.controller.create(DEVICE_CLASSES, foreign), by_policy=r.classes_policy).message
    assert (f"the controller of driver {driver} may only create or change the DeviceClasses of that driver, not "
            f"DeviceClass foreign-{r.release}.example.com") in message
    # One of its class names, but labelled as another driver's (as NVIDIA's class names are in compatibility
    # mode): neither its own writes nor its pass take it over.
    mig = r.kube.get(f"{DEVICE_CLASSES}/mig.{driver}")
    mig["metadata"]["labels"][DRIVER_LABEL] = OTHER_DRIVER
    mig = r.kube.replace(DEVICE_CLASSES, mig)
    edit = {**mig, "spec": {"selectors": []}}
    message = refused(lambda: r.controller.replace(DEVICE_CLASSES, edit), by_policy=r.classes_policy).message
    assert f"may not change or delete DeviceClass mig.{driver} of driver {OTHER_DRIVER}" in message
    refused(controller.reconcile_once, by_policy=r.classes_policy)
    assert r.kube.get(f"{DEVICE_CLASSES}/mig.{driver}")["metadata"]["labels"][DRIVER_LABEL] == OTHER_DRIVER
    # Created again without the labels that make it the controller's: refused; the controller's own create passes.
    r.kube.delete(DEVICE_CLASSES, f"mig.{driver}")
    bare = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": f"mig.{driver}"},
            "spec": {}}
    message = refused(lambda: r.controller.create(DEVICE_CLASSES, bare), by_policy=r.classes_policy).message
    assert f"may only write DeviceClasses labelled {DRIVER_LABEL}={driver}" in message
    controller.reconcile_once()
    assert r.kube.get(f"{DEVICE_CLASSES}/mig.{driver}")["metadata"]["labels"][DRIVER_LABEL] == driver
    message = refused(lambda: r.controller.delete(SLICES, r.foreign_slice), by_policy=r.slices_policy).message
    assert (f"the controller of driver {driver} may only delete ResourceSlices of that driver, not ResourceSlice "
            f"{r.foreign_slice} of driver {OTHER_DRIVER}") in message
    assert r.kube.get(f"{SLICES}/{r.foreign_slice}")["spec"]["driver"] == OTHER_DRIVER


def test_the_controller_posts_only_its_tenancy_warnings_on_claims_and_pods(release: Release) -> None:
    """RBAC lets the controller create any Event in any namespace; the chart's policy holds its Events to what
    controller.pendingclaims posts, so a stolen token cannot put words in another component's mouth."""
    r, driver = release, release.driver
    waiting = r.claim(r.ns_b, "waiting")
    claim = claim_ref(r.ns_b, "waiting", waiting["metadata"]["uid"])
    pod = ObjectRef("v1", "Pod", r.ns_b, "waiting-pod", "0f8a7c6e-1111-4222-8333-444455556666")
    events = KubernetesEventWriter(r.controller_client)

    def event(about: ObjectRef = claim, **changes: Any) -> dict[str, Any]:
        body = event_body(about, reason=MPS_TENANCY, note="probe", controller=f"{driver}/controller",
                          instance="probe", now=time.time(), action=ACTION_ALLOCATE)
        return {**body, **changes}

    deadline = time.monotonic() + 30
    while True:             # RBAC and the policy take effect asynchronously
        try:
            events.create(event(reason="Probe"))
        except ApiError as exc:
            if exc.status == 422 and r.events_policy in exc.message:
                break
        assert time.monotonic() < deadline, "the controller's Event policy was not enforced in time"
        time.sleep(0.3)

    # Its CEL type-checks against the Event schema (kube-controller-manager reports it in the status).
    policy = f"{APPLIED['ValidatingAdmissionPolicy']}/{r.events_policy}"
    deadline = time.monotonic() + 30
    while "typeChecking" not in (status := r.kube.get(policy).get("status") or {}):
        assert time.monotonic() < deadline, "the Event policy's CEL was not type-checked in time"
        time.sleep(0.3)
    assert not status["typeChecking"].get("expressionWarnings"), status

    # What it posts passes: on the claim, and on its pod with the claim as the related object.
    events.create(event())
    events.create(event(pod, related=claim.to_wire()))
    # Anything else is refused by the policy, naming the rule.
    secret = ObjectRef("v1", "Secret", r.ns_b, "db-password", "0f8a7c6e-2222-4222-8333-444455556666")
    for changes, words in (
            ({"reason": "FailedScheduling"}, "reason MPSTenancy"),
            ({"type": "Normal"}, "type Warning"),
            ({"action": "Scheduling"}, "action Allocate"),
            ({"reportingController": "default-scheduler"}, f"reportingController {driver}/controller"),
            ({"regarding": secret.to_wire()}, "about a ResourceClaim or a Pod"),
            ({"related": secret.to_wire()}, "about a ResourceClaim or a Pod")):
        message = refused(lambda: events.create(event(**changes)), by_policy=r.events_policy).message
        assert f"the controller of driver {driver} may only post Events" in message and words in message, message


@pytest.fixture
def release_without_pending_events(control_plane: LocalCluster, driver_name: str) -> Iterator[Release]:
    r = Release(control_plane, driver_name, "--set", "controller.pendingClaimEvents=false")
    try:
        r.install()
        yield r
    finally:
        r.remove()


def test_without_pending_claim_events_the_controller_reads_no_claims(release_without_pending_events: Release) -> None:
    """controller.pendingClaimEvents=false: the controller's token may not list a ResourceClaim, nor post an
    Event, and the controller keeps its DeviceClasses and slices all the same."""
    r, driver = release_without_pending_events, release_without_pending_events.driver
    r.wait_until_enforced(r.claim(r.ns_a, "own", r.node_a))
    controller = ClusterController(r.controller_client, driver, device_classes(driver),
                                   state=ClusterState(KubeApi(r.controller_client), driver,
                                                      [c["metadata"]["name"] for c in device_classes(driver)],
                                                      claims=False))
    controller.reconcile_once()
    assert controller.writes_by_operation["deviceclass-create"] == len(device_classes(driver))
    refused(lambda: r.controller.list(f"{RESOURCE_V1}/resourceclaims"), also=(403,))
    refused(lambda: r.controller.list(f"{RESOURCE_V1}/devicetaintrules"), also=(403, 404))
    refused(lambda: KubernetesEventWriter(r.controller_client).create(event_body(
        claim_ref(r.ns_a, "own", "0f8a7c6e-1111-4222-8333-444455556666"), reason=MPS_TENANCY, note="probe",
        controller=f"{driver}/controller", instance="probe", now=time.time(), action=ACTION_ALLOCATE)),
        also=(403,))
