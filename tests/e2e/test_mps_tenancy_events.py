"""A pod whose claim MPS tenancy keeps off every device stays Pending with a Warning Event that names the tenancy.

On the real control plane: a node whose GPUs' MPS slots are all tainted ``<driver>/mps-namespace=<team-a>``
(as the plugin taints them while their daemons serve team-a), a pod of team-b whose claim comes from a template
and asks for a slot. The scheduler leaves the pod Pending ("cannot allocate all claims"); `gpu-dra controller`
posts an ``MPSTenancy`` Warning Event on the pod and on its claim naming team-a, in the words `gpu-dra explain`
uses for those devices."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from allocation_helpers import PublishedFleet
from standin.workloads import wait_until

from controller.pendingclaims import MPS_TENANCY
from dra.model.tenancy import tenancy_reason, tenancy_taint, tenancy_toleration
from kube.client import KubeApi, namespaced_collection
from kube.events import EVENTS_V1
from ops.explain.reads import explain_target
from ops.explain.verdict import NOT_ALLOCATABLE, format_text
from testbed.demo_examples import apply_objects, create_namespace, delete_namespace

pytestmark = pytest.mark.e2e

MPS_SLOTS = {"default": {"wholeGpu": False, "slots": {"count": 2, "strategy": "mps"}}}


def taint_slots(fleet: PublishedFleet, driver: str, namespace: str) -> int:
    """Publishes the fleet again with every MPS slot tainted for `namespace`; returns how many."""
    tainted = 0
    for pool in fleet.pools.values():
        for part in pool.slices:
            for dev in part.get("devices") or []:
                if (dev.get("attributes") or {}).get("type") == {"string": "slot"}:
                    dev["taints"] = [tenancy_taint(driver, namespace)]
                    tainted += 1
    assert fleet.controller is not None
    fleet.controller.update(fleet.pools)
    fleet.controller.run_once(timeout=30)
    return tainted


def slot_template_and_pod(driver: str, namespace: str) -> list[dict[str, Any]]:
    """A template for one MPS slot (with the toleration for its own namespace the chart's admission policy adds)
    and a pod that uses it."""
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "slot"},
                "spec": {"spec": {"devices": {"requests": [{"name": "slot", "exactly": {
                    "deviceClassName": f"slot.{driver}", "tolerations": [tenancy_toleration(driver, namespace)]}}]}}}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "infer"},
           "spec": {"restartPolicy": "Never", "resourceClaims": [{"name": "slot", "resourceClaimTemplateName": "slot"}],
                    "containers": [{"name": "c", "image": "example.invalid/none",
                                    "resources": {"claims": [{"name": "slot"}]}}]}}
    return [template, pod]


def unschedulable(kube: KubeApi, ns: str, name: str) -> bool:
    pod = kube.get(f"{namespaced_collection('Pod', ns)}/{name}")
    assert not pod["spec"].get("nodeName"), f"pod {ns}/{name} was bound to {pod['spec']['nodeName']}"
    cond = next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"), {})
    return cond.get("status") == "False" and cond.get("reason") == "Unschedulable"


def tenancy_events(kube: KubeApi, ns: str) -> dict[str, dict[str, Any]]:
    """The MPSTenancy Events of the namespace by the kind of object they are about."""
    items = kube.list(f"{EVENTS_V1}/namespaces/{ns}/events")["items"]
    return {e["regarding"]["kind"]: e for e in items if e.get("reason") == MPS_TENANCY}


def test_a_pending_pod_gets_an_event_naming_the_namespace_its_gpus_serve(cluster: Any, api_client: Any,
                                                                        driver_name: str, tmp_path: Path) -> None:
    kube = KubeApi(api_client)
    prefix = driver_name.split(".")[0]
    node, team_a, team_b = f"{prefix}-mps-node", f"{prefix}-team-a", f"{prefix}-team-b"
    fleet = PublishedFleet(cluster, api_client, driver_name,
                           {"nodes": [{"name": node, "gpus": [{"model": "H100-80GB", "count": 2}], "policy": MPS_SLOTS}]},
                           tmp_path).publish()
    controller: subprocess.Popen[str] | None = None
    try:
        assert taint_slots(fleet, driver_name, team_a) == 4
        create_namespace(kube, team_b)
        apply_objects(kube, slot_template_and_pod(driver_name, team_b), team_b)
        wait_until(lambda: unschedulable(kube, team_b, "infer"), 60, "the scheduler to give up on the pod")

        controller = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "controller", "--kubeconfig", str(cluster.kubeconfig),
             "--driver-name", driver_name, "--metrics-port", "0", "--metrics-address", "127.0.0.1",
             "--pending-interval", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

        def posted() -> bool:
            assert controller is not None and controller.poll() is None, "gpu-dra controller exited"
            return {"Pod", "ResourceClaim"} <= tenancy_events(kube, team_b).keys()

        wait_until(posted, 60, "the MPSTenancy Events on the pod and its claim")
        events = tenancy_events(kube, team_b)
        on_pod, on_claim = events["Pod"], events["ResourceClaim"]
        assert on_pod["type"] == "Warning" and on_pod["regarding"]["name"] == "infer"
        claim_name = on_claim["regarding"]["name"]
        assert on_pod["note"] == on_claim["note"]
        assert on_pod["note"].startswith(
            f"claim {team_b}/{claim_name} cannot be allocated: the MPS slots and shares of 2 GPUs on {node} serve "
            f"namespace {team_a} (an MPS daemon serves one namespace; node policy mps.shareAcrossNamespaces)"), on_pod
        assert unschedulable(kube, team_b, "infer")

        # `gpu-dra explain` on the pod says the same of those devices.
        exp = explain_target(kube, "pod/infer", team_b)
        # The first line is cut at 200 characters on a cluster with many nodes: the reason is in the full text.
        assert exp.verdict == NOT_ALLOCATABLE and f"({tenancy_reason(team_a)})" in format_text(exp), format_text(exp)
    finally:
        out = ""
        if controller is not None:
            controller.send_signal(signal.SIGTERM)
            out, _ = controller.communicate(timeout=15)
        delete_namespace(kube, team_b)
        fleet.remove()
    assert controller.returncode == 0, out
