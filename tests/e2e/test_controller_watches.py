"""The controller reads the cluster through list+watch caches (controller.clusterstate), as the API server sees it.

On the real control plane, with a fleet's slices published and a pod kept Pending by MPS tenancy:

- `gpu-dra controller`, run as the local cluster's audited admin, makes one LIST of each resource it reads and
  then only watches: its pending-claims passes (counted on its /metrics) post their Events and make no LIST, as
  the API server's audit log shows;
- a watch the API server answers with 410 Gone (a resourceVersion older than it keeps) makes that cache list
  once more and go on watching; a pod that starts waiting afterwards still gets its Event.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from allocation_helpers import PublishedFleet
from standin.workloads import wait_until
from test_mps_tenancy_events import MPS_SLOTS, slot_template_and_pod, taint_slots, tenancy_events, unschedulable

from api.deviceclasses import device_classes
from controller.clusterstate import ClusterState
from controller.pendingclaims import PendingClaimEvents
from kube.client import KubeApi
from testbed.demo_examples import apply_objects, create_namespace, delete_namespace
from testbed.localcluster import LocalCluster, free_port

pytestmark = pytest.mark.e2e

RESOURCES = ("resourceslices", "resourceclaims", "deviceclasses", "devicetaintrules", "nodes")


def _resource(uri: str) -> str:
    return uri.split("?")[0].rstrip("/").rsplit("/", 1)[-1]


def audited_lists(cluster: Any) -> Counter[str]:
    """The audited LISTs by resource; the further pages of one LIST (a continue token) are not another."""
    return Counter(_resource(e["requestURI"]) for e in cluster.audited_requests()
                   if e.get("verb") == "list" and "continue=" not in e["requestURI"])


def passes(port: int, driver: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf'gpu_dra_pending_claim_passes_total{{driver="{re.escape(driver)}",result="ok"}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def fleet_doc(prefix: str, nodes: int) -> dict[str, Any]:
    return {"nodes": [{"name": f"{prefix}-w{i}", "gpus": [{"model": "H100-80GB", "count": 2}], "policy": MPS_SLOTS}
                      for i in range(nodes)]}


def test_the_controller_lists_once_then_watches_and_its_passes_make_no_list(cluster: Any, api_client: Any,
                                                                            driver_name: str, tmp_path: Path) -> None:
    kube = KubeApi(api_client)
    prefix = driver_name.split(".")[0]
    team_a, team_b = f"{prefix}-team-a", f"{prefix}-team-b"
    fleet = PublishedFleet(cluster, api_client, driver_name, fleet_doc(prefix, 6), tmp_path).publish()
    assert len(fleet.slices()) >= 6
    controller: subprocess.Popen[str] | None = None
    port = free_port()
    try:
        taint_slots(fleet, driver_name, team_a)
        create_namespace(kube, team_b)
        apply_objects(kube, slot_template_and_pod(driver_name, team_b), team_b)
        wait_until(lambda: unschedulable(kube, team_b, "infer"), 60, "the scheduler to give up on the pod")
        before = audited_lists(cluster)
        controller = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "controller", "--kubeconfig", str(cluster.audited_kubeconfig),
             "--driver-name", driver_name, "--metrics-port", str(port), "--metrics-address", "127.0.0.1",
             "--pending-interval", "1", "--interval", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

        def running() -> None:
            assert controller is not None and controller.poll() is None, "gpu-dra controller exited"

        def posted() -> bool:
            running()
            return {"Pod", "ResourceClaim"} <= tenancy_events(kube, team_b).keys()

        wait_until(posted, 90, "the MPSTenancy Events on the pod and its claim")
        started = audited_lists(cluster) - before
        assert set(started) == set(RESOURCES) and all(n == 1 for n in started.values()), started
        seen = passes(port, driver_name)
        wait_until(lambda: (running(), passes(port, driver_name) >= seen + 5)[1], 60, "five more pending passes")
        assert audited_lists(cluster) - before == started, "a pass listed"
    finally:
        out = ""
        if controller is not None:
            controller.send_signal(signal.SIGTERM)
            out, _ = controller.communicate(timeout=15)
        delete_namespace(kube, team_b)
        fleet.remove()
    assert controller.returncode == 0, out


@pytest.fixture
def uncached_claims(tmp_path: Path) -> Iterator[LocalCluster]:
    """A control plane of its own whose API server serves ResourceClaims from etcd (no watch cache), so that a
    watch from a compacted version is answered 410 Gone at once."""
    cluster = LocalCluster(workdir=tmp_path / "uncached", uncached=("resourceclaims.resource.k8s.io",))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_watch_answered_gone_lists_once_more_and_events_keep_coming(uncached_claims: LocalCluster, tmp_path: Path) -> None:
    cluster, driver = uncached_claims, "gone.e2e.dra-driver.io"
    api_client = cluster.api_client()
    kube = KubeApi(api_client)
    team_a, team_b = "gone-team-a", "gone-team-b"
    fleet = PublishedFleet(cluster, api_client, driver, fleet_doc("gone", 2), tmp_path).publish()
    names = [c["metadata"]["name"] for c in device_classes(driver)]
    state = ClusterState(kube, driver, names).start()
    try:
        taint_slots(fleet, driver, team_a)
        create_namespace(kube, team_b)
        assert state.wait_synced(60) and not state.problems(), state.problems()
        pending = PendingClaimEvents(state, driver, names, api_client=api_client, min_age_s=0)
        claims = state.claims
        lists = claims.lists
        # etcd forgets the history before now; the next watch of the claims starts from before that.
        create_namespace(kube, "gone-later")
        cluster.compact_etcd()
        claims.resource_version = "1"
        stream = claims._stream
        if stream is not None:
            stream.shutdown()
        wait_until(lambda: claims.lists == lists + 1 and claims.resource_version not in ("", "1") and
                   claims._stream is not None and claims.last_error is None, 60,
                   "the claims to be listed again and watched")

        apply_objects(kube, slot_template_and_pod(driver, team_b), team_b)
        wait_until(lambda: unschedulable(kube, team_b, "infer"), 60, "the scheduler to give up on the pod")
        wait_until(lambda: (pending.pass_once(), {"Pod", "ResourceClaim"} <= tenancy_events(kube, team_b).keys())[1],
                   60, "the MPSTenancy Events of the pod that started waiting after the relist")
        assert claims.lists == lists + 1
    finally:
        state.stop()
