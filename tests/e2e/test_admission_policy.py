"""The chart's ValidatingAdmissionPolicy on the real API server: a node's kubelet plugin may write only its own
node's ResourceSlices, in its own pool and under its own driver name.

The policy is rendered by `helm template` from deploy/helm/gpu-dra-driver/templates/validatingadmissionpolicy.yaml
(with the CEL it shares with the chart's other policies, templates/_admission.tpl). Requests are sent as the
plugin's service account with the node name in the token's extra, as a node-bound token carries it (the
admin impersonates that identity), so the API server compiles and runs the policy's CEL as in a cluster."""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kube.client import SLICES, ApiError, KubeApi
from testbed.helmchart import render

pytestmark = pytest.mark.e2e

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
POLICIES = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
BINDINGS = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"
CLUSTER_ROLES = "/apis/rbac.authorization.k8s.io/v1/clusterroles"
CLUSTER_ROLE_BINDINGS = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"


def render_policy(fullname: str, namespace: str, driver: str) -> list[dict[str, Any]]:
    """The chart's ResourceSlice policy and its binding as `helm template` renders them with these names."""
    objects = render("--set", f"driverName={driver}", "--set", f"fullnameOverride={fullname}",
                     release=fullname, namespace=namespace)
    return [o for o in objects if o["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
            and o["metadata"]["name"] == f"{fullname}-resourceslices"]


def as_plugin(cluster: Any, user: str, node: str) -> KubeApi:
    """A client that the API server sees as the plugin's service account on `node`."""
    client = cluster.api_client()
    client.set_default_header("Impersonate-User", user)
    client.set_default_header("Impersonate-Extra-" + NODE_NAME_EXTRA.replace("/", "%2F"), node)
    return KubeApi(client)


def slice_body(name: str, node: str, pool: str, driver: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}}]}}


def refused_by_the_policy(exc: ApiError) -> bool:
    # A failed validation without a `reason` of its own answers 422 Invalid.
    return exc.status == 422 and "ValidatingAdmissionPolicy" in exc.message


def denied(call: Any) -> str:
    """The API server's message for a request the policy must refuse."""
    with pytest.raises(ApiError) as err:
        call()
    assert refused_by_the_policy(err.value), err.value
    return err.value.message


class Setup:
    def __init__(self, cluster: Any, kube: KubeApi, driver: str) -> None:
        prefix = driver.split(".")[0]
        self.kube, self.driver = kube, driver
        self.fullname, self.namespace = f"{prefix}-vap", f"{prefix}-gpu-dra"
        self.node_a, self.node_b = f"{prefix}-node-a", f"{prefix}-node-b"
        user = f"system:serviceaccount:{self.namespace}:{self.fullname}-kubelet-plugin"
        self.plugin_a = as_plugin(cluster, user, self.node_a)
        self.plugin_b = as_plugin(cluster, user, self.node_b)
        self.created: list[tuple[str, str]] = []

    def create(self, collection: str, obj: dict[str, Any]) -> None:
        self.kube.create(collection, obj)
        self.created.append((collection, obj["metadata"]["name"]))

    def install(self) -> None:
        """The plugin's RBAC on ResourceSlices (as the chart grants it) and the rendered policy and binding."""
        self.create(CLUSTER_ROLES, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                                    "metadata": {"name": self.fullname}, "rules": [{
                                        "apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
                                        "verbs": ["create", "get", "list", "watch", "update", "delete"]}]})
        self.create(CLUSTER_ROLE_BINDINGS, {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": self.fullname},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": self.fullname},
            "subjects": [{"kind": "ServiceAccount", "name": f"{self.fullname}-kubelet-plugin",
                          "namespace": self.namespace}]})
        policy, binding = render_policy(self.fullname, self.namespace, self.driver)
        self.create(POLICIES, policy)
        self.create(BINDINGS, binding)

    def wait_until_enforced(self, timeout: float = 30.0) -> None:
        """The API server picks up new policies asynchronously: probe with a write the policy refuses."""
        probe = slice_body(f"{self.node_a}-probe", self.node_b, self.node_b, self.driver)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.plugin_a.create(SLICES, probe)
            except ApiError as exc:
                if refused_by_the_policy(exc):
                    return
                if exc.status != 403:     # 403: not yet allowed by RBAC either, wait
                    raise
            else:
                self.kube.delete(SLICES, probe["metadata"]["name"])
            assert time.monotonic() < deadline, "the admission policy was not enforced in time"
            time.sleep(0.2)

    def type_checking(self, timeout: float = 30.0) -> dict[str, Any]:
        """The policy's status.typeChecking, once kube-controller-manager has checked its CEL."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.kube.get(f"{POLICIES}/{self.fullname}-resourceslices").get("status") or {}
            if "typeChecking" in status:
                return status["typeChecking"]
            assert time.monotonic() < deadline, f"the policy's CEL was not type-checked in time: {status}"
            time.sleep(0.2)

    def remove(self) -> None:
        for obj in self.kube.list(SLICES, field_selector=f"spec.nodeName={self.node_a}")["items"] + \
                self.kube.list(SLICES, field_selector=f"spec.nodeName={self.node_b}")["items"]:
            self.kube.delete(SLICES, obj["metadata"]["name"])
        for collection, name in reversed(self.created):
            self.kube.request("DELETE", f"{collection}/{name}")
        for client in (self.plugin_a, self.plugin_b):
            client.api_client.close()


@pytest.fixture
def policy(cluster: Any, api_client: Any, driver_name: str) -> Iterator[Setup]:
    setup = Setup(cluster, KubeApi(api_client), driver_name)
    try:
        setup.install()
        setup.wait_until_enforced()
        yield setup
    finally:
        setup.remove()


def test_a_plugin_writes_only_its_own_nodes_pool_and_driver(policy: Setup) -> None:
    a, b, driver = policy.node_a, policy.node_b, policy.driver
    assert policy.type_checking().get("expressionWarnings") in (None, [])

    # Its own slices: create, update, delete.
    own = policy.plugin_a.create(SLICES, slice_body(f"{a}-own", a, a, driver))
    own["spec"]["devices"].append({"name": "gpu-1", "attributes": {"type": {"string": "gpu"}}})
    own = policy.plugin_a.replace(SLICES, own)
    policy.plugin_a.delete(SLICES, own["metadata"]["name"], uid=own["metadata"]["uid"])

    # On its own node, but in node B's pool or under another driver's name: refused, saying why.
    message = denied(lambda: policy.plugin_a.create(SLICES, slice_body(f"{a}-in-b", a, b, driver)))
    assert f"may only write ResourceSlices of pool {a} (its node), not of pool {b}" in message
    other = "other.example.com"
    message = denied(lambda: policy.plugin_a.create(SLICES, slice_body(f"{a}-other", a, a, other)))
    assert f"of driver {driver} may only write ResourceSlices of that driver, not of driver {other}" in message
    # On node B: refused, as before.
    message = denied(lambda: policy.plugin_a.create(SLICES, slice_body(f"{a}-on-b", b, b, driver)))
    assert f"on node {a} may only write ResourceSlices of its own node, not slices of node {b}" in message

    # Device taints under its driver's keys (health, MPS tenancy): accepted; under another key: refused.
    tainted = slice_body(f"{a}-tainted", a, a, driver)
    tainted["spec"]["devices"][0]["taints"] = [{"key": f"{driver}/mps-namespace", "value": "team-a",
                                                "effect": "NoExecute"}]
    policy.plugin_a.delete(SLICES, policy.plugin_a.create(SLICES, tainted)["metadata"]["name"])
    tainted["spec"]["devices"][0]["taints"].append({"key": "example.com/maintenance", "effect": "NoExecute"})
    message = denied(lambda: policy.plugin_a.create(SLICES, tainted))
    assert f"may only set device taints with keys {driver}/..., not on device gpu-0" in message

    # Node B's slices: node A's plugin can neither change nor delete them; node B's plugin can.
    theirs = policy.plugin_b.create(SLICES, slice_body(f"{b}-own", b, b, driver))
    theirs["metadata"]["labels"] = {"changed-by": "node-a"}
    denied(lambda: policy.plugin_a.replace(SLICES, theirs))
    denied(lambda: policy.plugin_a.delete(SLICES, theirs["metadata"]["name"]))
    policy.plugin_b.delete(SLICES, theirs["metadata"]["name"])

    # Its own slice handed to another pool or another driver's name on update: refused (the API may also hold
    # the field immutable; either refusal will do, as long as nothing changed).
    own = policy.plugin_a.create(SLICES, slice_body(f"{a}-own", a, a, driver))
    for field, value in (("pool", {"name": b, "generation": 1, "resourceSliceCount": 1}), ("driver", other)):
        changed = {**own, "spec": {**own["spec"], field: value}}
        with pytest.raises(ApiError) as err:
            policy.plugin_a.replace(SLICES, changed)
        assert err.value.status == 422, err.value
    assert policy.kube.get(f"{SLICES}/{a}-own")["spec"] == own["spec"]

    # Someone else (here the admin) is not affected by the policy.
    policy.kube.create(SLICES, slice_body(f"{a}-by-admin", a, b, other))
