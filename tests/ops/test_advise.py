"""`gpu-dra advise` without a cluster: a workload's figures (a shared claim's pods added up), the rules that say
nothing (too little data, a limit hit, a time-sliced GPU, processes not told apart), the advice and what it frees,
owners found by the objects and by the names controllers give pods and claims, and the templates it writes, checked
by the admission webhook's rules."""
from __future__ import annotations

import json
from dataclasses import replace
from fractions import Fraction
from typing import Any

import pytest

from api.quantity import GIB, MIB
from controller.webhook import config_problems
from dra.model.catalog import CATALOG
from ops.advise.advice import (
    AT_LIMIT,
    KEEP,
    NOT_ATTRIBUTABLE,
    NOTHING_OFFERED,
    RESIZE,
    TOO_LITTLE_DATA,
    Group,
    Settings,
    advise,
    figures,
    ran_on,
)
from ops.advise.groups import group_series, request_of
from ops.advise.offers import Offer, PublishedDevice, ShareOffer, SlotOffer
from ops.advise.owners import (
    PodFacts,
    Workload,
    claim_source,
    generated_claim_prefix,
    oom_killed_containers,
    owner_by_name,
)
from ops.advise.templates import class_name, emit
from ops.advise.usage import SeriesUsage, gaps, series_from_exposition, series_from_vectors

D = "gpu.dra-driver.io"
H100 = CATALOG["H100-80GB"]
PRODUCT = H100.product_name
DAY = 86400.0
OFFER = Offer(PRODUCT, H100.memory_mib * MIB, 132, True, {p.name for p in H100.mig_profiles}, {SlotOffer(4)},
              {ShareOffer(GIB, GIB, 79 * GIB, "mps")})
SETTINGS = Settings(min_samples=10, min_span=3600)


def series(pod: str = "nb-7d4f9c8b6-x7k2p", *, peak: float = 6000 * MIB, p95: float | None = None,
           device: str = "gpu-0", sharing: str = "none", mig_profile: str = "", claim: str = "",
           samples: int = 2000, span: float = DAY, sm: float | None = None, request: str = "gpu",
           namespace: str = "ml", gpu_uuid: str = "GPU-0") -> SeriesUsage:
    return SeriesUsage(namespace, pod, "main", claim or f"{pod}-gpu-abcde", request, device, gpu_uuid, mig_profile,
                       sharing, "node-a", PRODUCT, peak, p95 if p95 is not None else peak * 0.9, samples, 1000.0,
                       1000.0 + span, sm, sm)


DEPLOYMENT = Workload("ml", "Deployment", "nb", {"resourceClaims": [{"name": "gpu",
                                                                     "resourceClaimTemplateName": "nb-gpu"}]})


def group(*members: SeriesUsage, oom: tuple[str, ...] = ()) -> Group:
    g = Group(DEPLOYMENT, claim_source(members[0].claim, members[0].pod, DEPLOYMENT.pod_spec), "gpu", PRODUCT,
              list(members))
    g.oom.extend(oom)
    return g


def whole(s: SeriesUsage) -> Any:
    return ran_on(s, H100, None)


# ---------------------------------------------------------------------------------------------------- figures

def test_a_shared_claims_pods_add_up_on_its_device_and_the_largest_device_counts() -> None:
    a = series("a", peak=3 * GIB, claim="shared", device="gpu-1-slot-0")
    b = series("b", peak=2 * GIB, claim="shared", device="gpu-1-slot-0")
    c = series("c", peak=4 * GIB, claim="c-gpu-x", device="gpu-2")
    # A container set that changed is a second series of one pod: the larger counts, not both.
    a2 = replace(a, container="main|side", memory_peak=GIB)
    f = figures([a, b, c, a2])
    assert f.peak == 5 * GIB and f.pods == 3 and f.samples == 4 * 2000
    assert figures([c]).peak == 4 * GIB


# ------------------------------------------------------------------------------------------------------ rules

def test_a_whole_gpu_at_6gib_gets_the_smallest_device_and_what_it_frees() -> None:
    s = series()
    a = advise(group(s), whole(s), H100, OFFER, SETTINGS)
    assert a.verdict == RESIZE and a.recommendation is not None
    assert a.recommendation.describe() == "share 8Gi" and a.need is not None and a.need.memory_bytes == 7200 * MIB
    assert a.frees == 1 - Fraction(8 * GIB, H100.memory_mib * MIB)
    assert "peak 5.86 GiB" in a.why and "+ 20% = 7.03 GiB" in a.why and "2000 samples over 1d" in a.why
    mig = advise(group(s), whole(s), H100, OFFER, replace(SETTINGS, kinds=("mig",)))
    assert mig.recommendation is not None and mig.recommendation.describe() == "mig 1g.10gb"
    assert mig.frees == Fraction(6, 7) and "frees 0.86 of a GPU" in mig.why


def test_too_little_data_says_what_is_missing() -> None:
    for s in (series(samples=5), series(span=600)):
        a = advise(group(s), whole(s), H100, OFFER, SETTINGS)
        assert a.verdict == TOO_LITTLE_DATA and a.recommendation is None
        assert "--min-samples 10 over --min-span 1h needed" in a.why
    snap = series(samples=1, span=0)
    assert advise(group(snap), whole(snap), H100, OFFER, replace(SETTINGS, snapshot=True)).verdict == RESIZE


def test_an_oom_killed_container_is_advised_up_not_down() -> None:
    s = series(peak=GIB)
    a = advise(group(s, oom=("nb-7d4f9c8b6-x7k2p/main",)), whole(s), H100, OFFER, SETTINGS)
    assert a.verdict == AT_LIMIT and a.recommendation is None
    assert "OOM-killed (nb-7d4f9c8b6-x7k2p/main)" in a.why and "advised up, not down" in a.why


def test_memory_at_its_devices_ceiling_names_the_next_larger_device() -> None:
    s = series(peak=9700 * MIB, device="gpu-0-mig-1g10gb-19-6", mig_profile="1g.10gb")
    a = advise(group(s), ran_on(s, H100, None), H100, OFFER, replace(SETTINGS, kinds=("mig",)))
    assert a.verdict == AT_LIMIT and a.recommendation is None
    assert "97% of its mig 1g.10gb's 9.75 GiB" in a.why and "next larger: mig 1g.20gb" in a.why
    share = series(peak=9.9 * GIB, device="gpu-3-shared", sharing="share")
    ran = ran_on(share, H100, None, {"memory": 10 * GIB})
    assert ran.label == "share 10.00 GiB" and ran.fraction == Fraction(10 * GIB, H100.memory_mib * MIB)
    assert advise(group(share), ran, H100, OFFER, SETTINGS).verdict == AT_LIMIT


def test_near_the_ceiling_but_below_it_the_headroom_advises_a_larger_device() -> None:
    s = series(peak=9 * GIB, device="gpu-0-mig-1g10gb-19-6", mig_profile="1g.10gb")
    a = advise(group(s), ran_on(s, H100, None), H100, OFFER, replace(SETTINGS, kinds=("mig",)))
    assert a.verdict == RESIZE and a.recommendation is not None and a.recommendation.profile == "1g.20gb"
    assert a.frees is not None and a.frees < 0 and "takes 0.11 more" in a.why


def test_a_time_sliced_gpu_shared_with_others_cannot_be_attributed() -> None:
    s = series(device="gpu-2-slot-1", sharing="time-slicing")
    published = PublishedDevice("node-a", "gpu-2-slot-1", "slot", PRODUCT, "time-slicing", slot_count=4)
    ran = ran_on(s, H100, published)
    assert ran.label == "time-slicing slot (1 of 4)" and ran.fraction == Fraction(1, 4)
    a = advise(group(s), ran, H100, OFFER, SETTINGS, shared_with=["ml/other"])
    assert a.verdict == NOT_ATTRIBUTABLE and "time-sliced with 1 other pod(s)" in a.why
    b = advise(group(s), ran, H100, OFFER, SETTINGS, unattributed=2)
    assert b.verdict == NOT_ATTRIBUTABLE and "2 process(es) in no claim's pod" in b.why
    alone = advise(group(s), ran, H100, OFFER, SETTINGS)
    assert alone.verdict == RESIZE


def test_processes_not_told_apart_between_devices() -> None:
    s = series(device="gpu-1-slot-0|gpu-1-slot-1", sharing="mps")
    a = advise(group(s), ran_on(s, H100, None), H100, OFFER, SETTINGS)
    assert a.verdict == NOT_ATTRIBUTABLE and "gpu-1-slot-0|gpu-1-slot-1" in a.why


def test_keep_when_it_already_has_the_smallest_and_nothing_when_nothing_is_offered() -> None:
    s = series(peak=7 * GIB, device="gpu-0-mig-1g10gb-19-6", mig_profile="1g.10gb")
    a = advise(group(s), ran_on(s, H100, None), H100, OFFER, replace(SETTINGS, kinds=("mig",)))
    assert a.verdict == KEEP and a.frees is None and "already the smallest" in a.why
    big = series(peak=75 * GIB)
    kept = advise(group(big), whole(big), H100, OFFER, SETTINGS)
    assert kept.verdict == KEEP and "keep the whole GPU" in kept.why
    assert advise(group(s), whole(s), H100, None, SETTINGS).verdict == NOTHING_OFFERED


def test_sm_use_is_a_share_of_the_device_it_was_measured_on() -> None:
    s = series(peak=GIB, sm=30.0)                       # 30% of 132 SMs = 39.6, + 20% = 47.5 SMs
    a = advise(group(s), whole(s), H100, OFFER, replace(SETTINGS, kinds=("mig", "slot")))
    assert a.need is not None and round(a.need.sms, 1) == 47.5
    assert a.recommendation is not None and a.recommendation.profile == "3g.40gb"
    assert "SM p95 30% of 132 = 47.5 SMs" in a.why
    mig = series(peak=GIB, sm=50.0, device="gpu-0-mig-1g20gb-15-6", mig_profile="1g.20gb")   # of 26 SMs
    b = advise(group(mig), ran_on(mig, H100, None), H100, OFFER, replace(SETTINGS, kinds=("mig",)))
    assert b.need is not None and round(b.need.sms, 1) == 15.6 and b.recommendation is not None
    assert b.recommendation.profile == "1g.10gb"


# ------------------------------------------------------------------------------------------- usage and gaps

def test_series_from_prometheus_vectors_and_from_a_scrape() -> None:
    labels = {"namespace": "ml", "pod": "p", "container": "main", "claim": "p-gpu-x", "request": "gpu",
              "device": "gpu-0", "gpu_uuid": "GPU-0", "mig_profile": "", "sharing": "none", "Hostname": "node-a",
              "gpu": "0", "UUID": "GPU-0", "modelName": PRODUCT, "instance": "10.0.0.1:8080"}

    def vec(v: float) -> list[dict[str, Any]]:
        return [{"metric": labels, "value": [1.0, str(v)]}]

    got = series_from_vectors({"peak": vec(5e9), "p95": vec(4e9), "samples": vec(100), "first": vec(10),
                               "last": vec(3610), "sm_peak": vec(40), "sm_p95": vec(20)})
    assert len(got) == 1 and got[0].memory_peak == 5e9 and got[0].samples == 100 and got[0].sm_p95 == 20
    assert got[0].node == "node-a" and got[0].model == PRODUCT
    assert series_from_vectors({"peak": vec(5e9)}) == []          # no count: not a series of the window
    short, = series_from_vectors({"peak": vec(5e9), "p95": vec(5e9), "samples": vec(2)})
    assert short.first == short.last                              # too short for the subquery: a span of 0
    text = ("# TYPE gpu_dra_claim_gpu_memory_used_bytes gauge\n"
            'gpu_dra_claim_gpu_memory_used_bytes{namespace="ml",pod="p",container="main",claim="c",request="gpu",'
            'device="gpu-0",gpu_uuid="GPU-0",mig_profile="",sharing="none",Hostname="node-a",gpu="0",UUID="GPU-0",'
            f'modelName="{PRODUCT}"}} 1.5e+09\n')
    snap, = series_from_exposition(text, 99.0)
    assert (snap.memory_peak, snap.samples, snap.first, snap.sm_p95) == (1.5e9, 1, 99.0, None)


def test_gaps_inside_a_plugins_samples_and_at_the_end() -> None:
    def points(*ranges: tuple[int, int]) -> list[list[Any]]:
        return [[float(t), "1"] for a, b in ranges for t in range(a, b, 10)]

    matrix = [{"metric": {"instance": "a:8080"}, "values": points((0, 500), (900, 1000))},
              {"metric": {"instance": "b:8080"}, "values": points((300, 1000))}]      # b came later: no gap
    found = gaps(matrix, 0, 1000, 10, 120)
    assert [(g.instance, g.start, g.end) for g in found] == [("a:8080", 500.0, 900.0)]
    assert gaps(matrix, 0, 1000, 10, 500) == []
    assert gaps([], 0, 1000, 10, 120) == []            # no plugin series kept by the scrape: nothing to tell
    stopped = gaps([{"metric": {"instance": "a"}, "values": points((0, 400))}], 0, 1000, 10, 120)
    assert [(g.instance, g.start, g.end) for g in stopped] == [("", 400.0, 1000)]


# ---------------------------------------------------------------------------------------------------- owners

def test_a_gone_pod_is_found_by_the_names_controllers_give_pods() -> None:
    names = {"ReplicaSet": ["web-7d4f9c8b6", "web-1-5b6c7d8f9"], "StatefulSet": ["db"], "Job": ["train"],
             "DaemonSet": ["agent"], "Deployment": ["api"], "CronJob": ["nightly"]}
    assert owner_by_name("web-7d4f9c8b6-x7k2p", names) == ("ReplicaSet", "web-7d4f9c8b6")
    assert owner_by_name("web-1-5b6c7d8f9-x7k2p", names) == ("ReplicaSet", "web-1-5b6c7d8f9")
    assert owner_by_name("db-12", names) == ("StatefulSet", "db")
    assert owner_by_name("train-x7k2p", names) == ("Job", "train")
    assert owner_by_name("train-3-x7k2p", names) == ("Job", "train")
    assert owner_by_name("agent-x7k2p", names) == ("DaemonSet", "agent")
    assert owner_by_name("api-5b6c7d8f9-x7k2p", names) == ("Deployment", "api")      # its ReplicaSet is gone
    assert owner_by_name("nightly-29441380-x7k2p", names) == ("CronJob", "nightly")
    assert owner_by_name("db-x7k2p", names) is None and owner_by_name("other", names) is None


def test_which_claim_entry_a_series_claim_came_from() -> None:
    spec = {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "nb-gpu"},
                               {"name": "scratch", "resourceClaimTemplateName": "nb-scratch"},
                               {"name": "shared", "resourceClaimName": "team-slot"}]}
    by_status = claim_source("nb-0-gpu-q8z4w", "nb-0", spec,
                             [{"name": "gpu", "resourceClaimName": "nb-0-gpu-q8z4w"}])
    assert by_status is not None and (by_status.entry, by_status.kind, by_status.name, by_status.index) == \
        ("gpu", "ResourceClaimTemplate", "nb-gpu", 0)
    by_name = claim_source("nb-0-scratch-q8z4w", "nb-0", spec)
    assert by_name is not None and by_name.name == "nb-scratch"
    named = claim_source("team-slot", "nb-0", spec)
    assert named is not None and (named.kind, named.index) == ("ResourceClaim", 2)
    # Past 57 characters the controller cuts both names in proportion.
    pod, entry = "a-very-long-statefulset-name-for-training-workers-0", "accelerator-claim"
    prefix = generated_claim_prefix(pod, entry)
    assert len(prefix) <= 57 and prefix.startswith(pod[:30]) and "-accelerator" in prefix
    long_spec = {"resourceClaims": [{"name": entry, "resourceClaimTemplateName": "t"},
                                    {"name": "other", "resourceClaimTemplateName": "u"}]}
    found = claim_source(prefix + "x7k2p", pod, long_spec)
    assert found is not None and found.name == "t"


def test_oom_killed_containers_of_a_pod() -> None:
    pod = {"status": {"containerStatuses": [
        {"name": "main", "lastState": {"terminated": {"reason": "OOMKilled"}}, "state": {"running": {}}},
        {"name": "side", "state": {"terminated": {"reason": "Completed"}}}]}}
    assert oom_killed_containers(pod) == ["main"]


def test_series_group_by_workload_template_request_and_model() -> None:
    a, b = series("nb-1-x7k2p", claim="nb-1-x7k2p-gpu-aaaaa"), series("nb-2-q8z4w", claim="nb-2-q8z4w-gpu-bbbbb")
    sub = series("nb-3-zzzzz", claim="nb-3-zzzzz-gpu-ccccc", request="gpu/h100")
    pods = {("ml", s.pod): PodFacts(DEPLOYMENT, DEPLOYMENT.pod_spec) for s in (a, b, sub)}
    grouped = group_series([a, b, sub], pods, oom=[("ml", "nb-2-q8z4w", "main")])
    assert len(grouped) == 1 and request_of(sub) == "gpu"
    g, = grouped
    assert g.source is not None and g.source.name == "nb-gpu" and len(g.series) == 3 and g.oom == ["nb-2-q8z4w/main"]


# ------------------------------------------------------------------------------------------------- templates

TEMPLATE = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "nb-gpu", "namespace": "ml", "uid": "u", "resourceVersion": "7",
                         "labels": {"team": "ml"}},
            "spec": {"spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": D, "count": 2}},
                             {"name": "nic", "exactly": {"deviceClassName": "nic.example.com"}}],
                "config": [{"requests": ["gpu"], "opaque": {"driver": D, "parameters": {
                    "apiVersion": "gpu.dra-driver.io/v1alpha1", "kind": "GpuConfig",
                    "sharing": {"strategy": "TimeSlicing"}}}},
                           {"opaque": {"driver": "nic.example.com", "parameters": {"mtu": 9000}}}]}}}}


@pytest.mark.parametrize("kinds, expect", [
    (("mig",), "mig.gpu.dra-driver.io"), (("slot",), "slot.gpu.dra-driver.io"),
    (("share",), "shared.gpu.dra-driver.io")])
def test_the_template_asks_for_the_advised_device_and_keeps_the_rest(kinds: tuple[str, ...], expect: str) -> None:
    s = series(claim="nb-7d4f9c8b6-x7k2p-gpu-abcde")
    a = advise(group(s), whole(s), H100, OFFER, replace(SETTINGS, kinds=kinds))
    assert a.recommendation is not None
    out = emit(DEPLOYMENT, a.group.source, TEMPLATE, [a], D)
    obj = out.obj
    tail = {"mig": "1g10gb", "slot": "mps-slot", "share": "share-8gi"}[kinds[0]]
    assert obj["kind"] == "ResourceClaimTemplate"
    assert obj["metadata"] == {"name": f"nb-gpu-{tail}", "namespace": "ml", "labels": {"team": "ml"}}
    devices = obj["spec"]["spec"]["devices"]
    gpu, nic = devices["requests"]
    assert nic == {"name": "nic", "exactly": {"deviceClassName": "nic.example.com"}}
    assert gpu["exactly"]["deviceClassName"] == expect and gpu["exactly"]["count"] == 2
    cel = gpu["exactly"]["selectors"][0]["cel"]["expression"]
    assert f"device.attributes['{D}'].productName == '{PRODUCT}'" in cel
    # The old whole-GPU config of the request is gone; the other driver's config applies to the other request only.
    kinds_of = [c["opaque"]["parameters"].get("kind") for c in devices["config"]]
    assert devices["config"][0] == {"opaque": {"driver": "nic.example.com", "parameters": {"mtu": 9000}},
                                    "requests": ["nic"]}
    assert "TimeSlicing" not in json.dumps(devices["config"])
    if kinds == ("slot",):
        assert kinds_of[-1] == "GpuConfig" and devices["config"][-1]["opaque"]["parameters"]["sharing"] == {
            "strategy": "MPS", "mps": {"activeThreadPercentage": 25}}
    if kinds == ("share",):
        assert gpu["exactly"]["capacity"] == {"requests": {"memory": "8Gi"}}
    assert config_problems(obj, out.resource, driver_name=D, compat_nvidia=False) == []
    assert out.switch.startswith("then: kubectl -n ml patch deployment/nb --type=json -p ")
    assert '"path": "/spec/template/spec/resourceClaims/0/resourceClaimTemplateName"' in out.switch
    assert out.why[0].startswith("ml/deployment/nb request gpu on NVIDIA H100 80GB HBM3: peak 5.86 GiB")


def test_a_job_or_a_bare_pod_is_created_again_and_a_shared_claim_gets_a_claim() -> None:
    s = series(claim="team-slot")
    spec = {"resourceClaims": [{"name": "gpu", "resourceClaimName": "team-slot"}]}
    job = Workload("ml", "Job", "train", spec)
    g = Group(job, claim_source("team-slot", s.pod, spec), "gpu", PRODUCT, [s])
    a = advise(g, whole(s), H100, OFFER, replace(SETTINGS, kinds=("mig",)))
    out = emit(job, g.source, None, [a], D)
    assert out.obj["kind"] == "ResourceClaim" and out.resource == "resourceclaims"
    assert out.obj["metadata"]["name"] == "team-slot-1g10gb"
    assert out.obj["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "mig.gpu.dra-driver.io"
    assert "create ml/job/train again with resourceClaims[0] (gpu) resourceClaimName: team-slot-1g10gb" in out.switch
    assert config_problems(out.obj, out.resource, driver_name=D, compat_nvidia=False) == []


def test_class_names_follow_the_driver_and_nvidia_compatibility() -> None:
    assert class_name("gpu.example.com", "mig") == "mig.gpu.example.com"
    assert class_name("gpu.nvidia.com", "gpu") == "gpu.nvidia.com" and class_name("gpu.nvidia.com", "mig") == \
        "mig.nvidia.com"
    assert class_name(D, "shared") == "shared.gpu.dra-driver.io"


# ------------------------------------------------------------------------------------------------------ reads

class FakeKube:
    """Objects by API path; lists of names by collection path; a 404 for anything else."""

    def __init__(self, objects: dict[str, dict[str, Any]], names: dict[str, list[str]]) -> None:
        self.objects, self.names, self.gets = objects, names, []

    def get(self, path: str) -> dict[str, Any]:
        from kube.client import ApiError

        self.gets.append(path)
        if path not in self.objects:
            raise ApiError("GET", path, 404, json.dumps({"reason": "NotFound"}))
        return self.objects[path]

    def list_metadata(self, path: str) -> dict[str, Any]:
        return {"items": [{"metadata": {"name": n}} for n in self.names.get(path, [])]}


def _owned(kind: str, name: str) -> dict[str, Any]:
    return {"metadata": {"ownerReferences": [{"kind": kind, "name": name, "controller": True}]}}


def test_owners_up_the_chain_and_by_name() -> None:
    from ops.advise.reads import Owners, consumed

    job_spec = {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "nightly-gpu"}]}
    kube = FakeKube({
        "/api/v1/namespaces/ml/pods/nightly-29441380-x7k2p": {**_owned("Job", "nightly-29441380"), "spec": {},
                                                              "status": {"containerStatuses": [
                                                                  {"name": "main", "lastState": {"terminated": {
                                                                      "reason": "OOMKilled"}}}]}},
        "/apis/batch/v1/namespaces/ml/jobs/nightly-29441380": _owned("CronJob", "nightly"),
        "/apis/batch/v1/namespaces/ml/cronjobs/nightly": {"spec": {"jobTemplate": {"spec": {"template": {
            "spec": job_spec}}}}},
        "/api/v1/namespaces/ml/pods/ray-worker-1": {**_owned("RayCluster", "ray"), "spec": {"containers": []}},
        "/apis/apps/v1/namespaces/ml/replicasets/web-5b6c7d8f9": _owned("Deployment", "web"),
    }, {"/apis/apps/v1/namespaces/ml/replicasets": ["web-5b6c7d8f9"]})
    owners = Owners(kube)  # type: ignore[arg-type]
    cron = owners.pod("ml", "nightly-29441380-x7k2p")
    assert (cron.workload.kind, cron.workload.name, cron.workload.pod_spec) == ("CronJob", "nightly", job_spec)
    assert cron.oom == ("main",) and cron.workload.spec_path == "/spec/jobTemplate/spec/template/spec"
    ray = owners.pod("ml", "ray-worker-1")
    assert (ray.workload.kind, ray.workload.name, ray.workload.pod_spec) == ("RayCluster", "ray", {"containers": []})
    # A gone pod of a ReplicaSet that is still there, whose Deployment is gone: the ReplicaSet is the workload.
    web = owners.pod("ml", "web-5b6c7d8f9-q8z4w")
    assert (web.workload.kind, web.workload.name, web.workload.gone) == ("ReplicaSet", "web-5b6c7d8f9", False)
    lost = owners.pod("ml", "someone-else")
    assert (lost.workload.kind, lost.workload.name, lost.workload.gone) == ("Pod", "someone-else", True)
    gets = len(kube.gets)
    owners.pod("ml", "nightly-29441380-x7k2p")
    assert len(kube.gets) == gets                     # each object read once
    claim = {"status": {"allocation": {"devices": {"results": [
        {"device": "gpu-3-shared", "consumedCapacity": {"memory": "10Gi"}}]}}}}
    assert consumed(claim, "gpu-3-shared") == {"memory": 10 * GIB} and consumed(claim, "gpu-0") == {}
