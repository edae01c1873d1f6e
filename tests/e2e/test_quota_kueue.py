"""GPU quota per team with Kueue (docs/quota.md): the manager built from its Go module at the pinned version,
run against the real control plane with the DeviceClass mappings of examples/quota/kueue-config.yaml, and Jobs
whose pods run on a real node (kubelet, containerd, runc) with ``gpu-dra kubelet-plugin`` and simulated GPUs.

The manifests are those of examples/quota/ as they are; the Jobs' pods are made runnable here (the cuda-probe
image, and a gate: each pod's container ends when the test creates a file in a directory of the host, so a Job
finishes when the test says). testbed/kueue.py says how Kueue runs out of a cluster (no webhooks: the Jobs are
created suspended with the queue-name label).
"""
from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from realnode_helpers import RealNode, load_objects
from standin.workloads import EXAMPLES, load_example, wait_until

from testbed.kueue import KueueError, LocalKueue
from testbed.localnode import cuda_probe_image
from testbed.podprobe import for_local_node

pytestmark = pytest.mark.e2e

QUOTA = EXAMPLES / "quota"
TEAM = "team-a"
KUEUE_API = "/apis/kueue.x-k8s.io/v1beta2"
GPUS, MIGS, MPS, SHARES = (f"gpu.dra-driver.io/{r}" for r in ("gpus", "mig-partitions", "mps-slots", "memory-shares"))
# GPU 0 whole only, GPU 1 four MPS slots only, GPU 2 two static MIG partitions, GPU 3 memory shares: what the
# ClusterQueues admit always fits the node, so a pod that does not run is this driver's or Kueue's doing.
STATIC_MIG = [{"profile": "2g.20gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]


def quota_fleet_node(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "gpus": [{"model": "H100-80GB", "count": 2},
                 {"model": "H100-80GB", "count": 1, "mig": {"enabled": True, "instances": STATIC_MIG}},
                 {"model": "H100-80GB", "count": 1}],
        "policy": {
            "default": {"wholeGpu": True, "mig": "none"},
            "rules": [
                {"match": {"index": 1}, "wholeGpu": False, "mig": "none", "slots": {"count": 4, "strategy": "mps"}},
                {"match": {"index": 2}, "wholeGpu": False, "mig": "static"},
                {"match": {"index": 3}, "wholeGpu": False, "mig": "none",
                 "memoryShares": {"minimum": "1Gi", "step": "1Gi"}},
            ],
        },
    }


class Bed:
    def __init__(self, real: RealNode, kueue: LocalKueue, gates: Path) -> None:
        self.real, self.kueue, self.gates = real, kueue, gates

    @property
    def kube(self) -> Any:
        assert self.real.kube is not None
        return self.real.kube

    def kubectl(self, *args: str) -> str:
        assert self.real.cluster is not None
        return self.real.cluster.kubectl(*args).stdout

    def runnable_job(self, job: dict[str, Any]) -> dict[str, Any]:
        """The Job with its pods made runnable on the node: the cuda-probe, then a wait for the Job's gate file
        (a hostPath directory) instead of the probe's endless sleep."""
        assert self.real.node is not None
        job = copy.deepcopy(job)
        name = job["metadata"]["name"]
        template = job["spec"]["template"]
        pod = for_local_node({"metadata": {"name": name}, "spec": template["spec"]}, cuda_probe_image(),
                             self.real.node.name)
        gate = self.gates / name
        gate.mkdir(parents=True, exist_ok=True)
        for c in pod["spec"]["containers"]:
            script = c["command"][-1]
            assert script.rstrip().endswith("exec sleep 86400"), script
            c["command"][-1] = script.rstrip().removesuffix("exec sleep 86400") + \
                "until [ -e /gate/done ]; do sleep 0.2; done\n"
            c["volumeMounts"] = [{"name": "gate", "mountPath": "/gate", "readOnly": True}]
        pod["spec"]["volumes"] = [{"name": "gate", "hostPath": {"path": str(gate), "type": "Directory"}}]
        template["spec"] = pod["spec"]
        return job

    def create_job(self, job: dict[str, Any]) -> None:
        self.kube.create(f"/apis/batch/v1/namespaces/{TEAM}/jobs", self.runnable_job(job))

    def finish(self, job: str) -> None:
        (self.gates / job / "done").touch()

    def workload(self, job: str) -> dict[str, Any] | None:
        """The Workload Kueue made for the Job (owned by it), once there is one."""
        for wl in self.kube.list(f"{KUEUE_API}/namespaces/{TEAM}/workloads")["items"]:
            if any(o.get("kind") == "Job" and o.get("name") == job for o in wl["metadata"].get("ownerReferences", [])):
                return wl  # type: ignore[no-any-return]
        return None

    def condition(self, job: str, kind: str) -> dict[str, Any] | None:
        wl = self.workload(job)
        return next((c for c in (wl or {}).get("status", {}).get("conditions") or [] if c["type"] == kind), None)

    def wait_condition(self, job: str, kind: str, status: str, timeout: float = 90.0) -> dict[str, Any]:
        def met() -> dict[str, Any] | None:
            self.kueue.check_running()
            cond = self.condition(job, kind)
            return cond if cond and cond["status"] == status else None

        try:
            return wait_until(met, timeout, f"Workload of Job {job}: {kind}={status}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nworkload: {json.dumps(self.workload(job), indent=1)[-2500:]}\n"
                                 f"--- kueue ---\n{self.kueue.log_tail(10)}") from None

    def job_pods(self, job: str) -> list[dict[str, Any]]:
        return list(self.kube.list(f"/api/v1/namespaces/{TEAM}/pods", label_selector=f"job-name={job}")["items"])

    def running_pods(self, job: str, count: int, timeout: float = 120.0) -> list[dict[str, Any]]:
        names = wait_until(lambda: len(p := self.job_pods(job)) == count and [x["metadata"]["name"] for x in p],
                           timeout, f"{count} pod(s) of Job {job}")
        return [self.real.wait_running(TEAM, n, timeout=timeout) for n in names]

    def job_status(self, job: str) -> dict[str, Any]:
        return self.kube.get(f"/apis/batch/v1/namespaces/{TEAM}/jobs/{job}")  # type: ignore[no-any-return]

    def reserved(self, queue: str = "gpus", resources: tuple[str, ...] = (GPUS, MIGS, MPS)) -> dict[str, str]:
        """What a ClusterQueue has reserved, per resource (its flavor's)."""
        cq = self.kube.get(f"{KUEUE_API}/clusterqueues/{queue}")
        flavors = cq.get("status", {}).get("flavorsReservation") or []
        totals = {r["name"]: str(r["total"]) for f in flavors for r in f.get("resources") or []}
        return {r: totals.get(r, "0") for r in resources}

    def wait_reserved(self, gpus: int, migs: int, mps: int) -> None:
        """Until the ClusterQueue's status (written after admissions, not with them) shows these reservations."""
        want = {GPUS: str(gpus), MIGS: str(migs), MPS: str(mps)}
        wait_until(lambda: self.reserved() == want, 30, f"ClusterQueue gpus to have reserved {want}")


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    real = RealNode()
    with real.running() as running:
        assert running.node is not None and running.fleet is not None and running.cluster is not None
        running.fleet.write_text(yaml.safe_dump({"nodes": [quota_fleet_node(running.node.name)]}, sort_keys=False))
        running.start_plugin(running.plugin())
        running.cluster.kubectl("apply", "-f", str(QUOTA / "kueue-mps-class.yaml"))
        config = yaml.safe_load((QUOTA / "kueue-config.yaml").read_text())
        # Memory shares mapped too (docs/quota.md: "map it"), for the test that shows how Kueue counts them.
        config["resources"]["deviceClassMappings"].append(
            {"name": SHARES, "deviceClassNames": ["shared.gpu.dra-driver.io"]})
        kueue = LocalKueue(running.cluster, config, tmp_path_factory.mktemp("kueue"))
        try:
            kueue.start()
        except KueueError as exc:
            pytest.fail(str(exc), pytrace=False)
        try:
            bed = Bed(running, kueue, tmp_path_factory.mktemp("gates"))
            running.namespace(TEAM)
            running.cluster.kubectl("apply", "-f", str(QUOTA / "kueue-queues.yaml"))
            wait_until(lambda: any(c["type"] == "Active" and c["status"] == "True" for c in bed.kube.get(
                f"{KUEUE_API}/clusterqueues/gpus").get("status", {}).get("conditions") or []), 60,
                "ClusterQueue gpus to be Active")
            yield bed
        finally:
            for gate in bed.gates.iterdir():          # let every pod end before the node stops
                (gate / "done").touch()
            kueue.stop()


def test_a_job_over_the_quota_waits_in_kueue_and_runs_when_another_finishes(bed: Bed) -> None:
    objects = load_objects(QUOTA / "kueue-jobs.yaml")
    for template in (o for o in objects if o["kind"] == "ResourceClaimTemplate"):
        bed.kube.create(f"/apis/resource.k8s.io/v1/namespaces/{TEAM}/resourceclaimtemplates", template)
    jobs = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Job"}
    for name in ("train-a", "tune-mig", "serve-mps"):
        bed.create_job(jobs[name])
    for name in ("train-a", "tune-mig", "serve-mps"):
        bed.wait_condition(name, "Admitted", "True")
    bed.create_job(jobs["train-b"])

    # train-b asks for a second whole GPU: Kueue keeps it, the Job stays suspended and has no pods.
    pending = bed.wait_condition("train-b", "QuotaReserved", "False")
    print(f"train-b: QuotaReserved=False {pending['reason']}: {pending['message']}")
    assert pending["reason"] == "Pending" and f"insufficient unused quota for {GPUS}" in pending["message"], pending
    bed.wait_reserved(1, 1, 2)

    # What was admitted runs on the node with the devices the quota counted.
    gpu_pod, = bed.running_pods("train-a", 1)
    view = bed.real.view(TEAM, gpu_pod["metadata"]["name"], "cuda")
    assert len(view.cuda) == 1 and not view.nvml_mig, view.summary()
    mig_pod, = bed.running_pods("tune-mig", 1)
    assert len(bed.real.view(TEAM, mig_pod["metadata"]["name"], "cuda").nvml_mig) == 1
    mps_pods = bed.running_pods("serve-mps", 2)
    for pod in mps_pods:
        mps_view = bed.real.view(TEAM, pod["metadata"]["name"], "cuda")
        # The limit of kueue-mps-class.yaml: the class's config reached the MPS client like a claim's would.
        assert mps_view.env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == "25", mps_view.summary()
        print(f"{pod['metadata']['name']}: {mps_view.summary()}")
    assert bed.job_status("train-b")["spec"]["suspend"] is True and bed.job_pods("train-b") == []
    assert bed.condition("train-b", "QuotaReserved")["status"] == "False"  # type: ignore[index]

    # train-a finishes: its GPU goes back to the quota and to the node, and train-b gets both.
    bed.finish("train-a")
    bed.wait_condition("train-a", "Finished", "True", timeout=120)
    bed.wait_condition("train-b", "Admitted", "True")
    b_pod, = bed.running_pods("train-b", 1)
    b_view = bed.real.view(TEAM, b_pod["metadata"]["name"], "cuda")
    print(f"train-b ran after train-a finished: {b_view.summary()}")
    assert [d.uuid for d in b_view.cuda] == [d.uuid for d in view.cuda], "the node's only whole GPU"
    bed.wait_reserved(1, 1, 2)
    for name in ("train-b", "tune-mig", "serve-mps"):
        bed.finish(name)
    for name in ("train-b", "tune-mig", "serve-mps"):
        bed.wait_condition(name, "Finished", "True", timeout=120)
    bed.wait_reserved(0, 0, 0)


# What Kueue v0.17 cannot count: the claim's form is refused (the Workload is inadmissible and says why), or
# the class is not mapped. docs/quota.md says what a team does instead.
UNCOUNTED = [
    ("mig-partition", "CEL selectors are not supported"),
    ("mps-slot", "device config is not supported"),
    ("first-available", "FirstAvailable device selection is not supported"),
]


@pytest.mark.parametrize("example, why", UNCOUNTED, ids=[e for e, _ in UNCOUNTED])
def test_claims_kueue_cannot_count_leave_the_job_inadmissible(bed: Bed, example: str, why: str) -> None:
    template, pod = load_example(example)
    name = f"uncounted-{example}"
    template["metadata"]["name"] = name
    bed.kube.create(f"/apis/resource.k8s.io/v1/namespaces/{TEAM}/resourceclaimtemplates", template)
    pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = name
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": TEAM}},
           "spec": {"suspend": True, "template": {"spec": pod["spec"]}}}
    bed.create_job(job)
    cond = bed.wait_condition(name, "QuotaReserved", "False")
    print(f"{example}: QuotaReserved=False {cond['reason']}: {cond['message']}")
    assert cond["reason"] == "Inadmissible" and why in cond["message"], cond
    assert bed.job_status(name)["spec"]["suspend"] is True and bed.job_pods(name) == []


def test_a_class_without_mapping_leaves_the_job_inadmissible(bed: Bed) -> None:
    name = "unmapped-slot"
    bed.kube.create(f"/apis/resource.k8s.io/v1/namespaces/{TEAM}/resourceclaimtemplates", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "slot", "exactly": {"deviceClassName": "slot.gpu.dra-driver.io"}}]}}}})
    bed.create_job(job_of(name, TEAM, {"name": "slot", "resourceClaimTemplateName": name}))
    cond = bed.wait_condition(name, "QuotaReserved", "False")
    print(f"{name}: QuotaReserved=False {cond['reason']}: {cond['message']}")
    assert cond["reason"] == "Inadmissible", cond
    assert "DeviceClass slot.gpu.dra-driver.io is not mapped in DRA configuration" in cond["message"], cond


def test_a_named_claim_leaves_the_job_inadmissible(bed: Bed) -> None:
    """examples/shared-claim's form: pods naming one ResourceClaim (Kueue counts templates only)."""
    claim, *_ = load_example("shared-claim")
    bed.kube.create(f"/apis/resource.k8s.io/v1/namespaces/{TEAM}/resourceclaims", claim)
    name = "named-claim"
    bed.create_job(job_of(name, TEAM, {"name": "gpu", "resourceClaimName": claim["metadata"]["name"]}))
    cond = bed.wait_condition(name, "QuotaReserved", "False")
    print(f"{name}: QuotaReserved=False {cond['reason']}: {cond['message']}")
    assert cond["reason"] == "Inadmissible", cond
    assert "does not support use of resource claims" in cond["message"], cond


def test_memory_shares_count_one_each_whatever_their_size(bed: Bed) -> None:
    """With the shared class mapped, a 10 GiB share and a 40 GiB share are one `memory-shares` each: a quota
    of one share admits either, never both, and says nothing of GiB."""
    assert bed.real.cluster is not None
    queues = [{"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "shares"},
               "spec": {"namespaceSelector": {}, "resourceGroups": [{"coveredResources": [SHARES], "flavors": [
                   {"name": "gpu-nodes", "resources": [{"name": SHARES, "nominalQuota": 1}]}]}]}},
              {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
               "metadata": {"name": "shares", "namespace": TEAM}, "spec": {"clusterQueue": "shares"}}]
    bed.kube.create(f"{KUEUE_API}/clusterqueues", queues[0])
    bed.kube.create(f"{KUEUE_API}/namespaces/{TEAM}/localqueues", queues[1])
    template, _ = load_example("memory-share")
    for size in ("10Gi", "40Gi"):
        t = copy.deepcopy(template)
        t["metadata"]["name"] = f"share-{size.lower()}"
        t["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"] = size
        bed.kube.create(f"/apis/resource.k8s.io/v1/namespaces/{TEAM}/resourceclaimtemplates", t)
        bed.create_job(job_of(t["metadata"]["name"], "shares",
                              {"name": "share", "resourceClaimTemplateName": t["metadata"]["name"]}))
    bed.wait_condition("share-10gi", "Admitted", "True")
    pending = bed.wait_condition("share-40gi", "QuotaReserved", "False")
    print(f"share-40gi: QuotaReserved=False {pending['reason']}: {pending['message']}")
    assert f"insufficient unused quota for {SHARES}" in pending["message"], pending
    wait_until(lambda: bed.reserved("shares", (SHARES,)) == {SHARES: "1"}, 30, "one share reserved")
    pod, = bed.running_pods("share-10gi", 1)
    print(f"share-10gi: {bed.real.view(TEAM, pod['metadata']['name'], 'cuda').summary()}")
    bed.finish("share-10gi")
    bed.wait_condition("share-40gi", "Admitted", "True", timeout=120)
    wait_until(lambda: bed.reserved("shares", (SHARES,)) == {SHARES: "1"}, 30, "one share reserved, 40 GiB")
    bed.running_pods("share-40gi", 1)
    bed.finish("share-40gi")


def job_of(name: str, queue: str, pod_claim: dict[str, str]) -> dict[str, Any]:
    """A suspended Job in `queue` whose one pod holds `pod_claim`, written like examples/quota/kueue-jobs.yaml."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": queue}},
            "spec": {"suspend": True, "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "cuda", "image": "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
                                "command": ["nvidia-smi", "-L"],
                                "resources": {"claims": [{"name": pod_claim["name"]}]}}],
                "resourceClaims": [pod_claim]}}}}
