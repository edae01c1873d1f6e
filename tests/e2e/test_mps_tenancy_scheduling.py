"""MPS tenancy the scheduler sees, on the real control plane and the real node: a GPU whose MPS daemon serves one
namespace carries that namespace's tenancy taint on its MPS slots (dra.model.tenancy), claims carry the toleration
for their own namespace (the chart's MutatingAdmissionPolicy, rendered by `helm template` and applied here), and
so the scheduler places another namespace's claims elsewhere instead of on a GPU whose prepare would refuse them.

The node has two GPUs with two MPS slots each. Namespace tenant-a holds one slot of GPU 0 for the whole module.
- another namespace's pod lands on GPU 1 and runs; its CUDA probe sees that GPU;
- with a slot of every GPU held by tenant-a, another namespace's pod stays Pending and `gpu-dra explain` names
  the tenancy;
- two namespaces' ReplicaSets created at the same instant for the last free GPU: exactly one runs there and the
  other's pod ends Pending, never left retrying a refused prepare (20 rounds; the plugin's refusals and the
  evictions that resolved them are counted and printed).
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from realnode_helpers import REPO, RealNode
from standin.workloads import create, get, slice_devices, wait_until

from api.names import DEFAULT_DRIVER_NAME
from dra.model.tenancy import tenancy_taint, tenancy_toleration
from kube.client import namespaced_collection
from testbed.helmchart import render
from testbed.localnode import cuda_probe_image
from testbed.podprobe import for_local_node

pytestmark = pytest.mark.e2e

DRIVER = DEFAULT_DRIVER_NAME
HOLDER = "tenant-a"
RACE_ROUNDS = 20
MAP_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies"
MAP_BINDING_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicybindings"


def tenancy_fleet(node: str) -> dict[str, Any]:
    return {"nodes": [{"name": node, "gpus": [{"model": "H100-80GB", "count": 2}],
                       "policy": {"default": {"wholeGpu": False, "mig": "none",
                                              "slots": {"count": 2, "strategy": "mps"}}}}]}


def slot_template(gpu_uuid: str | None = None) -> dict[str, Any]:
    """A claim template for one MPS slot, on the GPU `gpu_uuid` if given."""
    a = f"device.attributes['{DRIVER}']"
    expression = f"{a}.sharing == 'mps'" + (f" && {a}.parentUUID == '{gpu_uuid}'" if gpu_uuid else "")
    name = "slot-" + (gpu_uuid[-8:].lower() if gpu_uuid else "any")
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": f"slot.{DRIVER}", "selectors": [{"cel": {"expression": expression}}]}}]}}}}


def preferring_template(first: str, then: str) -> dict[str, Any]:
    """A claim template for one MPS slot on GPU `first` if any fits, else on GPU `then` (firstAvailable: the
    scheduler tries the sub-requests in order), so that without the tenancy taint the claim lands on `first`."""
    a = f"device.attributes['{DRIVER}']"
    subs = [{"name": f"gpu{i}", "deviceClassName": f"slot.{DRIVER}",
             "selectors": [{"cel": {"expression": f"{a}.sharing == 'mps' && {a}.parentUUID == '{gpu}'"}}]}
            for i, gpu in enumerate((first, then))]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "prefer"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": subs}]}}}}


def pod_spec(name: str, template: str, node: str) -> dict[str, Any]:
    return for_local_node({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
                           "spec": {"containers": [{"name": "cuda", "image": "unused",
                                                    "resources": {"claims": [{"name": "gpu"}]}}],
                                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}]}},
                          cuda_probe_image(), node)


def replica_set(name: str, template: str, node: str) -> dict[str, Any]:
    pod = pod_spec(name, template, node)
    return {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": pod["metadata"]["labels"]}, "spec": pod["spec"]}}}


def create_replica_set(kube: Any, namespace: str, rs: dict[str, Any]) -> None:
    kube.create(f"/apis/apps/v1/namespaces/{namespace}/replicasets", rs | {"metadata": rs["metadata"] | {
        "namespace": namespace}})


class Tenancy:
    """The module's node, plugin and helpers."""

    def __init__(self, real: RealNode) -> None:
        assert real.kube is not None and real.node is not None and real.fleet is not None
        self.real, self.kube, self.node = real, real.kube, real.node.name
        real.fleet.write_text(yaml.safe_dump(tenancy_fleet(self.node), sort_keys=False))
        self.install_policy()
        self.plugin = real.start_plugin(real.plugin(DRIVER))
        devices = slice_devices(real.wait_for_slices(self.plugin))
        self.gpus = sorted({str(d["attributes"]["parentUUID"]["string"]) for d in devices})
        assert len(self.gpus) == 2, devices

    # ---- set-up -----------------------------------------------------------------------------------------
    def install_policy(self) -> None:
        objects = [o for o in render("--set", f"driverName={DRIVER}")
                   if o["kind"] in ("MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")]
        assert [o["kind"] for o in objects] == ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"], \
            "the chart renders no MPS tenancy MutatingAdmissionPolicy for Kubernetes 1.37"
        for obj in objects:
            self.kube.create(MAP_PATH if obj["kind"] == "MutatingAdmissionPolicy" else MAP_BINDING_PATH, obj)
        probe_ns = self.namespace("tenancy-probe")
        n = iter(range(1000))

        def mutated() -> bool:
            claim = create(self.kube, probe_ns, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                                 "metadata": {"name": f"probe-{next(n)}"},
                                                 "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                                                     "deviceClassName": f"slot.{DRIVER}"}}]}}})
            return bool(claim["spec"]["devices"]["requests"][0]["exactly"].get("tolerations"))

        wait_until(mutated, 60, "the MutatingAdmissionPolicy to take effect")   # policies load asynchronously

    def namespace(self, name: str) -> str:
        if not self.real.exists(f"/api/v1/namespaces/{name}"):
            self.real.namespace(name)
        return name

    # ---- reads ------------------------------------------------------------------------------------------
    def devices(self) -> dict[str, dict[str, Any]]:
        return {d["name"]: d for d in slice_devices(self.real.wait_for_slices(self.plugin))}

    def tenant_of(self, gpu: str) -> set[str]:
        """The tenancy taint values on the GPU's slots as published."""
        key = tenancy_taint(DRIVER, "")["key"]
        return {t.get("value", "") for d in self.devices().values()
                if d["attributes"]["parentUUID"]["string"] == gpu for t in d.get("taints") or [] if t["key"] == key}

    def wait_tenant(self, gpu: str, namespace: str | None, timeout: float = 30) -> None:
        want = {namespace} if namespace else set()
        wait_until(lambda: self.tenant_of(gpu) == want, timeout,
                   f"GPU {gpu}'s slots to carry tenancy taint(s) {want or 'none'} (now {self.tenant_of(gpu)})")

    def allocated_gpu(self, namespace: str, pod: dict[str, Any]) -> str:
        claim = self.real.claim_of(namespace, pod, "gpu")
        device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
        return str(self.devices()[device]["attributes"]["parentUUID"]["string"])

    def pods(self, namespace: str, app: str) -> list[dict[str, Any]]:
        return self.kube.list(namespaced_collection("Pod", namespace), label_selector=f"app={app}")["items"]

    def events(self, namespace: str) -> list[dict[str, Any]]:
        return self.kube.list(f"/api/v1/namespaces/{namespace}/events")["items"]

    def explain(self, namespace: str, target: str) -> subprocess.CompletedProcess[str]:
        assert self.real.cluster is not None
        return subprocess.run([sys.executable, "-m", "cli.main", "explain", target, "-n", namespace,
                               "--kubeconfig", str(self.real.cluster.kubeconfig)],
                              capture_output=True, text=True, timeout=60, cwd=REPO)

    # ---- workloads --------------------------------------------------------------------------------------
    def run_pod(self, namespace: str, name: str, gpu: str | None = None) -> dict[str, Any]:
        template = slot_template(gpu)
        if get(self.kube, "ResourceClaimTemplate", namespace, template["metadata"]["name"]) is None:
            create(self.kube, namespace, template)
        create(self.kube, namespace, pod_spec(name, template["metadata"]["name"], self.node))
        return self.kube.get(f"{namespaced_collection('Pod', namespace)}/{name}")

    def delete_replica_set(self, namespace: str, name: str) -> None:
        self.kube.request("DELETE", f"/apis/apps/v1/namespaces/{namespace}/replicasets/{name}",
                          body={"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Foreground"})
        wait_until(lambda: not self.pods(namespace, name) and not self.exists_rs(namespace, name), 60,
                   f"ReplicaSet {namespace}/{name} and its pods to be gone")

    def exists_rs(self, namespace: str, name: str) -> bool:
        return self.real.exists(f"/apis/apps/v1/namespaces/{namespace}/replicasets/{name}")


@pytest.fixture(scope="module")
def tenancy() -> Iterator[Tenancy]:
    with RealNode().running() as real:
        t = Tenancy(real)
        t.namespace(HOLDER)
        t.real.wait_running(HOLDER, t.run_pod(HOLDER, "holder-0", t.gpus[0])["metadata"]["name"])
        t.wait_tenant(t.gpus[0], HOLDER)
        yield t


def test_claims_get_the_toleration_of_their_own_namespace(tenancy: Tenancy) -> None:
    ns = tenancy.namespace("tolerations")
    mine = {"key": "example.com/other", "operator": "Exists", "effect": "NoSchedule"}
    claim = create(tenancy.kube, ns, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                      "metadata": {"name": "two-forms"}, "spec": {"devices": {"requests": [
                                          {"name": "plain", "exactly": {"deviceClassName": f"slot.{DRIVER}"}},
                                          {"name": "own", "exactly": {"deviceClassName": f"slot.{DRIVER}",
                                                                      "tolerations": [mine]}},
                                          {"name": "either", "firstAvailable": [
                                              {"name": "mps", "deviceClassName": f"slot.{DRIVER}"},
                                              {"name": "whole", "deviceClassName": f"gpu.{DRIVER}",
                                               "tolerations": [mine]}]}]}}})
    want = tenancy_toleration(DRIVER, ns)
    plain, own, either = claim["spec"]["devices"]["requests"]
    assert plain["exactly"]["tolerations"] == [want]
    assert own["exactly"]["tolerations"] == [mine, want]                   # theirs kept, ours appended
    assert [s["tolerations"] for s in either["firstAvailable"]] == [[want], [mine, want]]


def test_another_namespace_runs_on_another_gpu(tenancy: Tenancy) -> None:
    """tenant-b prefers GPU 0, where tenant-a's daemon runs and a slot is free: the taint makes the scheduler
    take its second choice (without it the claim would land on GPU 0 and its prepare be refused)."""
    ns = tenancy.namespace("tenant-b")
    create(tenancy.kube, ns, preferring_template(tenancy.gpus[0], tenancy.gpus[1]))
    create(tenancy.kube, ns, pod_spec("b-runs", "prefer", tenancy.node))
    pod = tenancy.real.wait_running(ns, "b-runs")
    gpu = tenancy.allocated_gpu(ns, pod)
    assert gpu == tenancy.gpus[1], f"tenant-b's claim was allocated on tenant-a's GPU {gpu}"
    seen = tenancy.real.view(ns, "b-runs", "cuda").cuda
    assert [d.uuid for d in seen] == [gpu], seen                             # its CUDA probe finds that GPU
    tenancy.wait_tenant(gpu, ns)
    tenancy.real.delete_pod(ns, "b-runs")
    tenancy.wait_tenant(gpu, None)                                           # daemon gone, taint gone


def test_with_every_gpu_held_another_namespace_is_pending_and_explain_says_why(tenancy: Tenancy) -> None:
    second = tenancy.real.wait_running(HOLDER, tenancy.run_pod(HOLDER, "holder-1", tenancy.gpus[1])["metadata"]["name"])
    tenancy.wait_tenant(tenancy.gpus[1], HOLDER)
    ns = tenancy.namespace("tenant-c")
    tenancy.run_pod(ns, "c-waits")

    def failed_scheduling() -> bool:
        return any(e.get("reason") == "FailedScheduling" for e in tenancy.events(ns))

    wait_until(failed_scheduling, 60, "the scheduler to report tenant-c's pod unschedulable")
    pod = tenancy.kube.get(f"{namespaced_collection('Pod', ns)}/c-waits")
    assert not pod["spec"].get("nodeName") and pod["status"]["phase"] == "Pending"
    out = tenancy.explain(ns, "pod/c-waits")
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.startswith("not allocatable"), out.stdout
    assert f"{tenancy_taint(DRIVER, HOLDER)['key']}={HOLDER}:NoExecute" in out.stdout, out.stdout
    assert not any(e.get("reason") == "FailedPrepareDynamicResources" for e in tenancy.events(ns))
    tenancy.real.delete_pod(ns, "c-waits")
    tenancy.real.delete_pod(HOLDER, second["metadata"]["name"])
    tenancy.wait_tenant(tenancy.gpus[1], None)


def test_two_namespaces_racing_for_the_last_free_gpu_end_with_one_there(tenancy: Tenancy) -> None:
    """Each round: ReplicaSets of tenant-x and tenant-y created at the same instant; GPU 1 is the only GPU
    they may use. One runs there; the other's pod ends Pending (evicted and recreated if it was allocated on
    GPU 1 before the winner's taint), and no pod is left retrying a refused prepare."""
    last = tenancy.gpus[1]
    spaces = [tenancy.namespace("tenant-x"), tenancy.namespace("tenant-y")]
    for ns in spaces:
        create(tenancy.kube, ns, slot_template())
    outcomes: Counter[str] = Counter()
    settle: list[float] = []
    for round_no in range(RACE_ROUNDS):
        name = f"race-{round_no}"
        start = time.monotonic()
        threads = [threading.Thread(target=create_replica_set,
                                    args=(tenancy.kube, ns, replica_set(name, "slot-any", tenancy.node)))
                   for ns in spaces]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        def settled() -> tuple[str, str] | None:
            """(winner, loser) once one namespace runs on GPU 1 and the other's only pod is unscheduled."""
            state = {}
            for ns in spaces:
                pods = [p for p in tenancy.pods(ns, name) if not p["metadata"].get("deletionTimestamp")]
                if len(pods) != 1:
                    return None
                state[ns] = pods[0]
            running = [ns for ns, p in state.items() if p["status"].get("phase") == "Running"]
            pending = [ns for ns, p in state.items() if not p["spec"].get("nodeName")
                       and any(c.get("type") == "PodScheduled" and c.get("status") == "False"
                               for c in p["status"].get("conditions") or [])]
            if len(running) == 1 and len(pending) == 1:
                return running[0], pending[0]
            return None

        try:
            winner, loser = wait_until(settled, 90, f"round {round_no}: one namespace running, the other pending")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + "\n".join(
                f"{ns}: " + "; ".join(f"{e.get('reason')}: {e.get('message')}" for e in tenancy.events(ns))
                for ns in spaces) + f"\n--- plugin ---\n{tenancy.plugin.log_tail(20)}") from None
        settle.append(time.monotonic() - start)
        won = [p for p in tenancy.pods(winner, name) if p["status"].get("phase") == "Running"][0]
        assert tenancy.allocated_gpu(winner, won) == last
        tenancy.wait_tenant(last, winner)
        refusals = [e for e in tenancy.events(loser) if e.get("involvedObject", {}).get("kind") == "Pod"
                    and str(e["involvedObject"].get("name", "")).startswith(name)
                    and "serves namespace" in str(e.get("message"))]
        evicted = [e for e in tenancy.events(loser) if e.get("reason") == "DeviceTaintManagerEviction"
                   and str(e.get("involvedObject", {}).get("name", "")).startswith(name)]
        outcomes["refused at prepare, evicted, recreated pending" if evicted else
                 "kept off GPU 1 by the taint"] += 1
        outcomes["plugin tenancy refusals"] += len(refusals)
        for ns in spaces:
            tenancy.delete_replica_set(ns, name)
        tenancy.wait_tenant(last, None)
    settle.sort()
    print(f"\n{RACE_ROUNDS} races: {dict(outcomes)}; settled in p50 {settle[len(settle) // 2]:.1f} s, "
          f"max {settle[-1]:.1f} s")
    assert sum(v for k, v in outcomes.items() if k != "plugin tenancy refusals") == RACE_ROUNDS
