"""`gpu-dra explain` agrees with kube-scheduler on the real control plane.

Every example folder and a set of made-up cases (pending ones included) are created; `explain` runs on the
claim while it is still unallocated (the template, a claim before its pod exists, or a pod the scheduler gave
up on), then the pod is created and the test waits until the scheduler has allocated its claims or keeps the
pod Pending as unschedulable. The test fails where the verdicts disagree: allocated → explain said
allocatable and named the node the scheduler used; pending → explain said not allocatable, and why.
"""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from allocation_helpers import EXAMPLES, FLEETS, PublishedFleet, renamed_fleet

from dra.scheduling.poolview import allocation_results
from kube.client import DEVICE_CLASSES, RESOURCE_V1, ApiError, KubeApi, namespaced_collection
from ops.explain.reads import explain_target
from ops.explain.verdict import ALLOCATABLE, FIRST_LINE_MAX, NOT_ALLOCATABLE, Explanation, format_text
from testbed.demo_examples import apply_objects, delete_namespace, load_example, load_examples

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_DRIVER = "examples.explain.dra-driver.io"
TAINT_RULES = f"{RESOURCE_V1}/devicetaintrules"
_numbers = itertools.count(1)


# --------------------------------------------------------------------------------- what the scheduler did

@dataclass
class Outcome:
    allocated: bool
    node: str = ""
    requests: list[str] = field(default_factory=list)   # allocation results' request names
    message: str = ""


def _pod_claims(kube: KubeApi, ns: str, pod: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The pod's claims, or None while a template's claim is not generated yet."""
    made = {s["name"]: s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
    out = []
    for ref in pod["spec"].get("resourceClaims") or []:
        name = ref.get("resourceClaimName") or made.get(ref["name"])
        if not name:
            return None
        try:
            out.append(kube.get(f"{namespaced_collection('ResourceClaim', ns)}/{name}"))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
    return out


def scheduler_outcome(kube: KubeApi, ns: str, pod_name: str, timeout: float = 40.0, settle: float = 4.0) -> Outcome:
    """Waits until the pod is bound with every claim allocated, or has stayed unschedulable (PodScheduled False)
    for `settle` seconds after all its claims existed."""
    deadline = time.monotonic() + timeout
    pending_since: float | None = None
    while time.monotonic() < deadline:
        pod = kube.get(f"{namespaced_collection('Pod', ns)}/{pod_name}")
        claims = _pod_claims(kube, ns, pod)
        if pod["spec"].get("nodeName") and claims and all(allocation_results(c) for c in claims):
            return Outcome(True, pod["spec"]["nodeName"],
                           [r["request"] for c in claims for r in allocation_results(c)])
        cond = next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"), {})
        if claims is not None and cond.get("status") == "False" and not pod["spec"].get("nodeName"):
            pending_since = pending_since or time.monotonic()
            if time.monotonic() - pending_since >= settle:
                return Outcome(False, message=str(cond.get("message", "")))
        else:
            pending_since = None
        time.sleep(0.25)
    raise AssertionError(f"pod {ns}/{pod_name}: the scheduler neither allocated nor gave up within {timeout}s")


def assert_agree(exp: Explanation, outcome: Outcome, case: str) -> None:
    text = f"{case}: explain said {exp.sentence!r}; the scheduler "
    if outcome.allocated:
        assert exp.verdict == ALLOCATABLE, text + f"allocated on {outcome.node} ({outcome.requests})"
        assert outcome.node in exp.allocatable_nodes(), text + f"used node {outcome.node}"
    else:
        assert exp.verdict == NOT_ALLOCATABLE, text + f"left the pod pending: {outcome.message}"


# ------------------------------------------------------------------------------------------ the examples

@pytest.fixture(scope="module")
def demo_fleet(cluster: Any, api_client: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    doc = renamed_fleet(yaml.safe_load((FLEETS / "demo.yaml").read_text()), "xpex")
    fleet = PublishedFleet(cluster, api_client, EXAMPLE_DRIVER, doc, tmp_path_factory.mktemp("xpex")).publish()
    yield fleet
    fleet.remove()


def _create_namespace(kube: KubeApi, name: str, admin: bool = False) -> None:
    labels = {"resource.kubernetes.io/admin-access": "true"} if admin else {}
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                       "metadata": {"name": name, "labels": labels}})


def _explain_before_pods(kube: KubeApi, objects: list[dict[str, Any]], ns: str) -> Explanation:
    """Explains the first template or claim of `objects` (nothing allocated it yet: no pod exists)."""
    first = next(o for o in objects if o["kind"] in ("ResourceClaimTemplate", "ResourceClaim"))
    kind = "template" if first["kind"] == "ResourceClaimTemplate" else "claim"
    return explain_target(kube, f"{kind}/{first['metadata']['name']}", ns)


@pytest.mark.parametrize("example", sorted(e.name for e in load_examples(EXAMPLES, EXAMPLE_DRIVER)))
def test_explain_agrees_on_every_example(api_client: Any, demo_fleet: Any, example: str) -> None:
    kube = KubeApi(api_client)
    ex = load_example(EXAMPLES / example, EXAMPLE_DRIVER)
    ns = f"xpex-{next(_numbers)}"
    _create_namespace(kube, ns)
    try:
        apply_objects(kube, [o for o in ex.objects if o["kind"] != "Pod"], ns)
        exp = _explain_before_pods(kube, ex.objects, ns)
        apply_objects(kube, ex.pods, ns)
        for pod in ex.pods:
            outcome = scheduler_outcome(kube, ns, pod["metadata"]["name"])
            assert outcome.allocated, f"{example}: example not allocated: {outcome.message}"
            assert_agree(exp, outcome, example)
            if example == "first-available":
                assert any(k.endswith(": gpu/h100") for n in exp.nodes for k in n.chosen), exp.sentence
    finally:
        delete_namespace(kube, ns)


# ---------------------------------------------------------------------------------------------- the cases

H100 = [{"model": "H100-80GB", "count": 1}]
L4 = [{"model": "L4", "count": 1}]


def _exactly(cls: str, cel: str | None = None, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": cls, **kw}
    if cel:
        body["selectors"] = [{"cel": {"expression": cel}}]
    return body


def _spec(*requests: dict[str, Any], constraints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = constraints
    return {"devices": devices}


def _req(name: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "exactly": body}


GPU, MIG, SLOT, SHARED = "D", "mig.D", "slot.D", "shared.D"


@dataclass
class Case:
    name: str
    gpus: list[dict[str, Any]]
    claim: dict[str, Any]                                 # the ResourceClaimSpec under test
    allocated: bool                                       # what the scheduler is expected to do
    reason: str = ""                                      # words the pending verdict must contain
    policy: dict[str, Any] | None = None
    first: list[dict[str, Any]] = field(default_factory=list)   # claims allocated before, each with a pod
    taints: list[dict[str, Any]] = field(default_factory=list)  # DeviceTaintRules: {device, taint}
    template: bool = False
    admin: bool = False
    second_claim: dict[str, Any] | None = None            # the pod also uses this claim
    request: str = ""                                     # allocated request name the explain must pick too
    says: str = ""                                        # words explain's text must contain, whatever the verdict


def _sub(name: str, cls: str, cel: str | None = None) -> dict[str, Any]:
    return {"name": name, **_exactly(cls, cel)}


ONE = _spec(_req("gpu", _exactly(GPU)))
MIG_1G = _spec(_req("mig", _exactly(MIG, "device.attributes['D'].profile == '1g.10gb'")))
MIG_7G = _spec(_req("mig", _exactly(MIG, "device.attributes['D'].profile == '7g.80gb'")))
WHOLE_AND_MIG = {"default": {"wholeGpu": True, "mig": "dynamic"}}
MIG_ONLY = {"default": {"wholeGpu": False, "mig": "dynamic"}}
SOME_PROFILES = {"default": {"wholeGpu": True, "mig": "dynamic", "dynamicMig": {"profiles": ["1g.10gb", "3g.40gb"]}}}
TS_SLOTS = {"default": {"wholeGpu": True, "slots": {"count": 4, "strategy": "time-slicing"}}}
SLOTS_ONLY = {"default": {"wholeGpu": False, "slots": {"count": 4, "strategy": "time-slicing"}}}
SHARES = {"default": {"wholeGpu": False, "memoryShares": {"minimum": "1Gi", "step": "1Gi"}}}
# slots.layout: capacity: one slot device per GPU with capacity slots: 3, beside the whole GPU and 1g.10gb MIG.
SLOT_CAPACITY = {"default": {"wholeGpu": True, "mig": "dynamic", "dynamicMig": {"profiles": ["1g.10gb"]},
                             "slots": {"count": 3, "strategy": "mps", "layout": "capacity"}}}
A_SHARE = _spec(_req("slot", _exactly(SLOT)))
TWO_SLOTS = _spec(_req("slot", _exactly(SLOT, capacity={"requests": {"slots": "2"}})))
MIG_CAPACITY = {"default": {"wholeGpu": True, "mig": "dynamic",
                            "dynamicMig": {"profiles": ["1g.10gb"], "layout": "capacity"},
                            "slots": {"count": 3, "strategy": "mps", "layout": "capacity"}}}
SIX_1G = _spec(_req("mig", _exactly(MIG, "device.attributes['D'].profile == '1g.10gb'",
                                    capacity={"requests": {"instances": "6"}})))
TWO_1G = _spec(_req("mig", _exactly(MIG, "device.attributes['D'].profile == '1g.10gb'",
                                    capacity={"requests": {"instances": "2"}})))
NO_SCHEDULE = {"key": "example.com/maintenance", "value": "planned", "effect": "NoSchedule"}
FIRST_AVAILABLE = _spec({"name": "gpu", "firstAvailable": [
    _sub("h100", GPU, "device.attributes['D'].productName.startsWith('NVIDIA H100')"),
    _sub("big", GPU, "device.capacity['D'].memory.compareTo(quantity('20Gi')) >= 0")]})

TYPO_CONFIG = {"devices": {
    "requests": [{"name": "gpu", "exactly": {"deviceClassName": GPU}}],
    "config": [{"requests": ["gpu"], "opaque": {"driver": "D", "parameters": {
        "apiVersion": "gpu.dra-driver.io/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentge": 25}}}}}]}}

CASES = [
    Case("selector-matches-nothing", H100, _spec(_req("gpu", _exactly(GPU, "device.attributes['D'].productName == 'NVIDIA B300'"))),
         False, "matches the selectors"),
    Case("every-device-taken", L4, ONE, False, "is held by", first=[ONE]),
    Case("whole-gpu-holds-counters-mig-unavailable", H100, MIG_1G, False, "is used up by gpu-0 held by", policy=WHOLE_AND_MIG,
         first=[ONE]),
    Case("mig-beside-a-held-gpu", [{"model": "H100-80GB", "count": 2}], MIG_7G, True, policy=WHOLE_AND_MIG,
         first=[ONE]),
    Case("mig-all-slices-drawn", H100, MIG_1G, False, "is used up by gpu-0-mig-7g80gb", policy=MIG_ONLY,
         first=[MIG_7G]),
    Case("mig-fits-beside-mig", H100, MIG_1G, True, policy=MIG_ONLY, first=[MIG_1G, MIG_1G], template=True),
    Case("taint-not-tolerated", L4, ONE, False, "is tainted", taints=[{"device": "gpu-0", "taint": NO_SCHEDULE}]),
    Case("taint-tolerated", L4, _spec(_req("gpu", _exactly(GPU, tolerations=[
        {"key": "example.com/maintenance", "operator": "Exists", "effect": "NoSchedule"}]))), True,
         taints=[{"device": "gpu-0", "taint": NO_SCHEDULE}]),
    Case("taint-on-one-of-two", [{"model": "L4", "count": 2}], ONE, True,
         taints=[{"device": "gpu-0", "taint": NO_SCHEDULE}]),
    Case("match-attribute-unsatisfiable", [{"model": "H100-80GB", "count": 2}],
         _spec(_req("gpu", _exactly(GPU, count=2)),
               constraints=[{"matchAttribute": "resource.kubernetes.io/pcieRoot"}]), False, "constraint"),
    Case("match-attribute-across-requests", H100,
         _spec(_req("a", _exactly(MIG, "device.attributes['D'].profile == '1g.10gb'")),
               _req("b", _exactly(MIG, "device.attributes['D'].profile == '2g.20gb'")),
               constraints=[{"requests": ["a", "b"], "matchAttribute": "D/parentUUID"}]), True, policy=MIG_ONLY),
    Case("count-too-high", [{"model": "L4", "count": 2}], _spec(_req("gpu", _exactly(GPU, count=3))), False,
         "only 2 match"),
    Case("count-fits", [{"model": "L4", "count": 2}], _spec(_req("gpu", _exactly(GPU, count=2))), True),
    Case("first-available-second-subrequest", L4, FIRST_AVAILABLE, True, template=True, request="gpu/big"),
    Case("first-available-first-taken", [{"model": "H100-80GB", "count": 1}, {"model": "L4", "count": 1}],
         FIRST_AVAILABLE, True, first=[_spec(_req("gpu", _exactly(GPU, "device.attributes['D'].productName.startsWith('NVIDIA H100')")))],
         request="gpu/big"),
    Case("first-available-none-fits", L4, FIRST_AVAILABLE, False, "no alternative fits", first=[ONE]),
    Case("memory-share-capacity-exhausted", H100, _spec(_req("share", _exactly(SHARED, capacity={"requests": {"memory": "20Gi"}}))),
         False, "is short of memory", policy=SHARES, first=[_spec(_req("share", _exactly(SHARED, capacity={"requests": {"memory": "70Gi"}})))]),
    Case("memory-share-fits", H100, _spec(_req("share", _exactly(SHARED, capacity={"requests": {"memory": "5Gi"}}))),
         True, policy=SHARES, first=[_spec(_req("share", _exactly(SHARED, capacity={"requests": {"memory": "70Gi"}})))]),
    Case("all-mode", [{"model": "L4", "count": 2}], _spec(_req("gpu", _exactly(GPU, allocationMode="All"))), True),
    Case("all-mode-one-taken", [{"model": "L4", "count": 2}], _spec(_req("gpu", _exactly(GPU, allocationMode="All"))),
         False, "all 2 matching devices are needed", first=[ONE]),
    Case("admin-access-on-a-taken-device", L4, _spec(_req("gpu", _exactly(GPU, adminAccess=True))), True,
         first=[ONE], admin=True),
    Case("slots-held-by-whole-gpu", L4, _spec(_req("slot", _exactly(SLOT))), False, "is used up by gpu-0 held by",
         policy=TS_SLOTS,
         first=[ONE]),
    Case("slots-count-fits", L4, _spec(_req("slot", _exactly(SLOT, count=4))), True, policy=SLOTS_ONLY),
    Case("slots-count-too-high", L4, _spec(_req("slot", _exactly(SLOT, count=5))), False, "only 4 match",
         policy=SLOTS_ONLY),
    Case("semver-selector-satisfied", L4, _spec(_req("gpu", _exactly(GPU, "device.attributes['D'].driverVersion.isGreaterThan(semver('550.0.0'))"))),
         True),
    Case("semver-selector-too-new", L4, _spec(_req("gpu", _exactly(GPU, "device.attributes['D'].driverVersion.compareTo(semver('999.0.0')) >= 0"))),
         False, "matches the selectors"),
    Case("quantity-is-greater-than", H100, _spec(_req("gpu", _exactly(GPU, "device.capacity['D'].memory.isGreaterThan(quantity('80Gi'))"))),
         False, "matches the selectors"),
    Case("cel-runtime-error", L4, _spec(_req("gpu", _exactly(GPU, "device.attributes['D'].nosuch == 'x'"))), False,
         "CEL runtime error"),
    Case("capacity-floor-on-a-whole-gpu", L4, _spec(_req("gpu", _exactly(GPU, capacity={"requests": {"memory": "40Gi"}}))),
         False, "is too small: memory"),
    Case("class-does-not-exist", L4, _spec(_req("gpu", _exactly("nosuch.D"))), False, "does not exist"),
    Case("two-claims-one-gpu", L4, ONE, False, "together", second_claim=ONE),
    Case("two-claims-two-gpus", [{"model": "L4", "count": 2}], ONE, True, second_claim=ONE),
    # The claim limit of 32 devices: allocationMode All over 50 MIG placements, or requests adding up to 33.
    Case("claim-limit-all-mode", [{"model": "H100-80GB", "count": 2}], _spec(_req("mig", _exactly(MIG, allocationMode="All"))),
         False, "exceeds the claim limit of 32", policy=MIG_ONLY),
    Case("claim-limit-two-requests", [{"model": "H100-80GB", "count": 2}],
         _spec(_req("a", _exactly(MIG, count=17)), _req("b", _exactly(MIG, count=16))), False,
         "adding 16 devices exceeds the claim limit of 32, with 17 already accounted for", policy=MIG_ONLY),
    # Admin access does not skip shared counters: a slot of a GPU held whole stays unavailable.
    Case("admin-access-slot-of-a-held-gpu", L4, _spec(_req("slot", _exactly(SLOT, adminAccess=True))), False,
         "is used up by gpu-0 held by", policy=TS_SLOTS, first=[ONE], admin=True),
    # A CEL error on a device the scheduler never reaches (the first device fits) is no error; on the first
    # device it tries, it is, in the scheduler's words.
    Case("cel-error-on-a-device-never-reached", [{"model": "H100-80GB", "count": 1}, {"model": "L4", "count": 1}],
         _spec(_req("gpu", _exactly(GPU, "device.attributes['D'].productName.startsWith('NVIDIA H100') || "
                                         "device.attributes['D'].nosuch == 'x'"))), True),
    Case("cel-error-on-the-first-device", [{"model": "H100-80GB", "count": 1}, {"model": "L4", "count": 1}],
         _spec(_req("gpu", _exactly(GPU, "device.attributes['D'].productName.startsWith('NVIDIA L4') || "
                                         "device.attributes['D'].nosuch == 'x'"))), False,
         "CEL runtime error: no such key: nosuch"),
    # distinctAttribute on the parent GPU: more distinct values than there are GPUs, and as many.
    Case("distinct-parents-beyond-the-gpus", [{"model": "H100-80GB", "count": 3}],
         _spec(_req("mig", _exactly(MIG, "device.attributes['D'].profile == '1g.10gb'", count=4)),
               constraints=[{"distinctAttribute": "D/parentUUID"}]), False, "with distinct", policy=MIG_ONLY),
    # An MPS config with a typo: the scheduler allocates (it does not read opaque configs); explain agrees and
    # names what the node plugin and the webhook refuse.
    Case("opaque-config-typo", L4, TYPO_CONFIG, True,
         says="sharing.mps.activeThreadPercentge: unknown field (known fields: activeThreadPercentage"),
    # No MIG profile matches: the profiles there are named; a memory share beyond the request policy: its range.
    Case("mig-profile-that-does-not-exist", H100, _spec(_req("mig", _exactly(MIG, "device.attributes['D'].profile == '1g.12gb'"))),
         False, "MIG profiles there: ", policy=MIG_ONLY),
    Case("memory-share-beyond-the-range", H100, _spec(_req("share", _exactly(SHARED, capacity={"requests": {"memory": "200Gi"}}))),
         False, "(valid: ", policy=SHARES),
    # dynamicMig.profiles: a profile left out is no device at all; those named fit as usual.
    Case("mig-profile-left-out-of-the-policy", H100, MIG_7G, False, "(MIG profiles there: 1g.10gb, 3g.40gb)",
         policy=SOME_PROFILES),
    Case("mig-named-profile-beside-another", H100, MIG_1G, True, policy=SOME_PROFILES,
         first=[_spec(_req("mig", _exactly(MIG, "device.attributes['D'].profile == '3g.40gb'")))]),
    # Slots as capacity: the device's counters are charged once, by its first share; its slots bound the shares.
    Case("slot-share-beside-shares", H100, A_SHARE, True, policy=SLOT_CAPACITY, first=[A_SHARE, A_SHARE]),
    Case("slot-shares-used-up", H100, A_SHARE, False, "is short of slots", policy=SLOT_CAPACITY,
         first=[TWO_SLOTS, A_SHARE]),
    Case("two-slots-beside-one", H100, TWO_SLOTS, True, policy=SLOT_CAPACITY, first=[A_SHARE]),
    Case("whole-gpu-while-a-share-is-out", H100, ONE, False, "is used up by gpu-0-slots held by",
         policy=SLOT_CAPACITY, first=[A_SHARE]),
    Case("partition-while-a-share-is-out", H100, MIG_1G, False, "is used up by gpu-0-slots held by",
         policy=SLOT_CAPACITY, first=[A_SHARE]),
    Case("slot-share-of-a-held-gpu", H100, A_SHARE, False, "is used up by gpu-0 held by", policy=SLOT_CAPACITY,
         first=[ONE]),
    # One MIG profile as capacity: counters charged once by the first share; instances bound the shares.
    Case("mig-share-beside-shares", H100, MIG_1G, True, policy=MIG_CAPACITY, first=[MIG_1G, TWO_1G]),
    Case("mig-instances-used-up", H100, TWO_1G, False, "is short of instances", policy=MIG_CAPACITY,
         first=[SIX_1G]),
    Case("whole-gpu-while-a-mig-share-is-out", H100, ONE, False, "is used up by gpu-0-mig-1g10gb-19 held by",
         policy=MIG_CAPACITY, first=[MIG_1G]),
    Case("slot-share-while-a-mig-share-is-out", H100, A_SHARE, False,
         "is used up by gpu-0-mig-1g10gb-19 held by", policy=MIG_CAPACITY, first=[MIG_1G]),
    Case("mig-share-of-a-held-gpu", H100, MIG_1G, False, "is used up by gpu-0 held by", policy=MIG_CAPACITY,
         first=[ONE]),
    Case("mig-count-two-on-one-gpu", H100, _spec(_req("mig", _exactly(
        MIG, "device.attributes['D'].profile == '1g.10gb'", count=2))), False, "only 1 match", policy=MIG_CAPACITY),
    # count: 2 looks for a second device after the first: one GPU's slot device cannot serve both (slots: 2 can).
    Case("slot-count-two-on-one-gpu", H100, _spec(_req("slot", _exactly(SLOT, count=2))), False, "only 1 match",
         policy=SLOT_CAPACITY),
    Case("distinct-parents-one-per-gpu", [{"model": "H100-80GB", "count": 3}],
         _spec(_req("mig", _exactly(MIG, "device.attributes['D'].profile == '1g.10gb'", count=3)),
               constraints=[{"distinctAttribute": "D/parentUUID"}]), True, policy=MIG_ONLY),
]


def _driver_in(obj: Any, driver: str) -> Any:
    """The spec with the placeholder domain D (CEL domains, class names) replaced by the case's driver."""
    if isinstance(obj, dict):
        return {_driver_in(k, driver): _driver_in(v, driver) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_driver_in(v, driver) for v in obj]
    if isinstance(obj, str):
        return (obj.replace("['D']", f"['{driver}']").replace("D/", f"{driver}/")
                if obj not in ("D",) and not obj.endswith(".D") else obj[:-1] + driver)
    return obj


def _claim(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name}, "spec": spec}


def _template(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": spec}}


def _pod(name: str, claims: list[tuple[str, str]]) -> dict[str, Any]:
    """A pod using each (pod claim name, "claim:<name>" or "template:<name>")."""
    refs = [{"name": n, ("resourceClaimName" if src.startswith("claim:") else "resourceClaimTemplateName"):
             src.split(":", 1)[1]} for n, src in claims]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "resourceClaims": refs,
                     "containers": [{"name": "c", "image": "example.invalid/none",
                                     "resources": {"claims": [{"name": n} for n, _ in claims]}}]}}


@pytest.fixture
def case_env(cluster: Any, api_client: Any, tmp_path: Path) -> Any:
    made: list[tuple[PublishedFleet, str, list[str]]] = []
    kube = KubeApi(api_client)

    def make(case: Case) -> tuple[str, str, str, str]:
        n = next(_numbers)
        driver, node, ns = f"x{n}.explain.dra-driver.io", f"xp{n}-node", f"xp-{n}"
        spec: dict[str, Any] = {"name": node, "gpus": case.gpus}
        if case.policy:
            spec["policy"] = case.policy
        workdir = tmp_path / str(n)
        workdir.mkdir()
        fleet = PublishedFleet(cluster, api_client, driver, {"nodes": [spec]}, workdir).publish()
        rules = []
        for i, t in enumerate(case.taints):
            rule = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": f"xp{n}-{i}"},
                    "spec": {"deviceSelector": {"driver": driver, "pool": node, "device": t["device"]},
                             "taint": t["taint"]}}
            kube.create(TAINT_RULES, rule)
            rules.append(rule["metadata"]["name"])
        made.append((fleet, ns, rules))
        _create_namespace(kube, ns, admin=case.admin)
        return driver, node, ns, str(n)

    yield make
    for fleet, ns, rules in made:
        delete_namespace(kube, ns)
        for r in rules:
            kube.request("DELETE", f"{TAINT_RULES}/{r}")
        fleet.remove()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_explain_agrees_with_the_scheduler(api_client: Any, case_env: Any, case: Case) -> None:
    kube = KubeApi(api_client)
    driver, node, ns, _ = case_env(case)
    for i, spec in enumerate(case.first):
        apply_objects(kube, [_claim(f"first-{i}", _driver_in(spec, driver)),
                             _pod(f"first-{i}", [("c", f"claim:first-{i}")])], ns)
        before = scheduler_outcome(kube, ns, f"first-{i}")
        assert before.allocated, f"{case.name}: claim first-{i} was meant to be allocated first: {before.message}"
    spec = _driver_in(case.claim, driver)
    if case.template:
        apply_objects(kube, [_template("under-test", spec)], ns)
        refs = [("c", "template:under-test")]
    else:
        apply_objects(kube, [_claim("under-test", spec)], ns)
        refs = [("c", "claim:under-test")]
    if case.second_claim is not None:
        apply_objects(kube, [_claim("second", _driver_in(case.second_claim, driver))], ns)
        refs.append(("d", "claim:second"))
    if case.second_claim is None:
        # Allocation needs a pod: explain the claim (or template) before the pod exists, so nothing holds it yet.
        exp = explain_target(kube, f"{'template' if case.template else 'claim'}/under-test", ns)
        apply_objects(kube, [_pod("under-test", refs)], ns)
    else:
        # Two claims are allocated together: explain the pod while a scheduling gate keeps the scheduler off it.
        gated = _pod("under-test", refs)
        gated["spec"]["schedulingGates"] = [{"name": "example.com/explain-first"}]
        apply_objects(kube, [gated], ns)
        exp = explain_target(kube, "pod/under-test", ns)
        kube.request("PATCH", f"{namespaced_collection('Pod', ns)}/under-test",
                     body={"spec": {"schedulingGates": None}}, content_type="application/merge-patch+json")
    outcome = scheduler_outcome(kube, ns, "under-test")
    assert outcome.allocated == case.allocated, \
        f"{case.name}: the scheduler {'allocated' if outcome.allocated else 'did not allocate'} ({outcome.message})"
    assert_agree(exp, outcome, case.name)
    assert len(exp.sentence) < FIRST_LINE_MAX, exp.sentence
    if not outcome.allocated:
        # The first line is short; the reason may be in the details below it.
        assert case.reason in format_text(exp), f"{case.name}: {format_text(exp)!r} does not say {case.reason!r}"
        # The pending pod itself (its claims through status.resourceClaimStatuses) gets the same verdict.
        of_pod = explain_target(kube, "pod/under-test", ns)
        assert_agree(of_pod, outcome, f"{case.name} (pod)")
        assert case.reason in format_text(of_pod), format_text(of_pod)
    assert case.says in format_text(exp), format_text(exp)
    if case.request:
        assert outcome.requests == [case.request], outcome.requests
        chosen = next(r for r in exp.nodes if r.node == outcome.node).chosen
        assert any(k.endswith(f": {case.request}") for k in chosen), (exp.sentence, chosen)


def _delete_and_wait(kube: KubeApi, kind: str, ns: str, name: str, timeout: float = 30.0) -> None:
    """Delete an object at once and return when the API server no longer has it (finalizers included)."""
    body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0} if kind == "Pod" else None
    try:
        kube.request("DELETE", f"{namespaced_collection(kind, ns)}/{name}", body=body)
    except ApiError as exc:
        if not exc.not_found:
            raise
    deadline = time.monotonic() + timeout
    while any(o["metadata"]["name"] == name for o in kube.list(namespaced_collection(kind, ns))["items"]):
        assert time.monotonic() < deadline, f"{kind} {ns}/{name} was not deleted within {timeout:.0f} s"
        time.sleep(0.25)


@pytest.mark.parametrize("held", [False, True], ids=["free", "held"])
def test_explain_agrees_on_a_pods_extended_resource(api_client: Any, case_env: Any, held: bool) -> None:
    """A pod asking `<domain>/gpu: 1`, which a DeviceClass names as its extendedResourceName: explained before
    the scheduler made its claim (the claim it would make), and after (status.extendedResourceClaimStatus)."""
    kube = KubeApi(api_client)
    driver, node, ns, n = case_env(Case("extended", L4, ONE, not held))
    resource = f"x{n}.example.com/gpu"
    kube.request("PATCH", f"{DEVICE_CLASSES}/{driver}", body={"spec": {"extendedResourceName": resource}},
                 content_type="application/merge-patch+json")
    if held:
        apply_objects(kube, [_claim("first", _driver_in(ONE, driver)), _pod("first", [("c", "claim:first")])], ns)
        assert scheduler_outcome(kube, ns, "first").allocated
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ext"},
           "spec": {"restartPolicy": "Never", "schedulingGates": [{"name": "example.com/explain-first"}],
                    "containers": [{"name": "c", "image": "example.invalid/none",
                                    "resources": {"requests": {resource: "1"}, "limits": {resource: "1"}}}]}}
    apply_objects(kube, [pod], ns)
    exp = explain_target(kube, "pod/ext", ns)
    kube.request("PATCH", f"{namespaced_collection('Pod', ns)}/ext", body={"spec": {"schedulingGates": None}},
                 content_type="application/merge-patch+json")
    deadline = time.monotonic() + 40
    while True:
        current = kube.get(f"{namespaced_collection('Pod', ns)}/ext")
        cond = next((c for c in (current.get("status") or {}).get("conditions") or []
                     if c.get("type") == "PodScheduled"), {})
        # A gated pod is PodScheduled False too (SchedulingGated): wait for the scheduler's own answer.
        if current["spec"].get("nodeName") or (cond.get("status") == "False" and cond.get("reason") != "SchedulingGated"):
            break
        assert time.monotonic() < deadline, "the scheduler neither bound nor gave up on pod ext"
        time.sleep(0.25)
    outcome = Outcome(bool(current["spec"].get("nodeName")), current["spec"].get("nodeName", ""),
                      message=str(cond.get("message", "")))
    assert outcome.allocated == (not held), outcome
    assert_agree(exp, outcome, f"extended resource ({'held' if held else 'free'})")
    if held:
        assert "is held by" in format_text(exp), format_text(exp)
    else:
        made = (current.get("status") or {}).get("extendedResourceClaimStatus") or {}
        while not made.get("resourceClaimName"):
            assert time.monotonic() < deadline, "no extendedResourceClaimStatus on the bound pod"
            time.sleep(0.25)
            pod = kube.get(f"{namespaced_collection('Pod', ns)}/ext")
            made = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
        after = explain_target(kube, "pod/ext", ns)
        assert after.verdict == "allocated" and node in after.sentence, after.sentence


def test_cli_explains_a_pending_pod_and_an_allocatable_template(cluster: Any, api_client: Any, case_env: Any) -> None:
    """`gpu-dra explain` as a process: the text verdict first (exit 1) for a pod the scheduler left pending,
    JSON (exit 0) for a template it then allocates."""
    kube = KubeApi(api_client)
    driver, node, ns, _ = case_env(Case("cli", L4, ONE, False))
    apply_objects(kube, [_claim("first", _driver_in(ONE, driver)), _pod("first", [("c", "claim:first")])], ns)
    assert scheduler_outcome(kube, ns, "first").allocated
    apply_objects(kube, [_claim("late", _driver_in(ONE, driver)), _pod("late", [("c", "claim:late")])], ns)
    assert not scheduler_outcome(kube, ns, "late").allocated

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cli.main", "explain", *args, "-n", ns, "--kubeconfig",
                               str(cluster.kubeconfig)], capture_output=True, text=True, timeout=60, cwd=REPO)

    text = cli("pod/late")
    assert text.returncode == 1, text.stderr
    # The verdict first; the reason may be cut from the first line (200 characters) with other tests' nodes about.
    assert text.stdout.startswith("not allocatable on any node:"), text.stdout
    assert f"node {node}: not allocatable" in text.stdout and "gpu-0 is held by" in text.stdout, text.stdout
    assert f"{ns}/first (pod {ns}/first)" in text.stdout, text.stdout

    # The late pod and its claim go first, and the test waits until they are gone: while the late pod exists,
    # freeing gpu-0 lets the scheduler allocate claim late to it, and the template would then find gpu-0 held.
    for kind, name in (("Pod", "late"), ("ResourceClaim", "late"), ("Pod", "first"), ("ResourceClaim", "first")):
        _delete_and_wait(kube, kind, ns, name)
    apply_objects(kube, [_template("tpl", _driver_in(ONE, driver))], ns)
    out = cli("template/tpl", "-o", "json")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["allocatable"] is True and doc["verdict"] == "allocatable", doc["sentence"]
    assert [n["node"] for n in doc["nodes"] if n["verdict"] == "allocatable"] == [node]
    apply_objects(kube, [_pod("from-tpl", [("c", "template:tpl")])], ns)
    outcome = scheduler_outcome(kube, ns, "from-tpl")
    assert outcome.allocated and outcome.node == node

    missing = cli("template/nosuch")
    assert missing.returncode == 2 and missing.stderr.strip() == \
        f"gpu-dra explain: no template named nosuch in namespace {ns}", missing.stderr


def test_explain_counts_init_containers_as_the_scheduler_does(api_client: Any, case_env: Any) -> None:
    """A pod asking `<domain>/gpu: 3` in an init container and 1 in its app container, on a node with two GPUs:
    the scheduler needs three GPUs (the init container's beyond what the app container gets) and leaves the pod
    pending; explain says so, and allocatable once the init container asks for two."""
    kube = KubeApi(api_client)
    driver, node, ns, n = case_env(Case("init-containers", [{"model": "L4", "count": 2}], ONE, False))
    resource = f"x{n}.example.com/gpu"
    kube.request("PATCH", f"{DEVICE_CLASSES}/{driver}", body={"spec": {"extendedResourceName": resource}},
                 content_type="application/merge-patch+json")

    def pod(name: str, init_gpus: int) -> dict[str, Any]:
        def container(cname: str, gpus: int) -> dict[str, Any]:
            return {"name": cname, "image": "example.invalid/none",
                    "resources": {"requests": {resource: str(gpus)}, "limits": {resource: str(gpus)}}}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                "spec": {"restartPolicy": "Never", "schedulingGates": [{"name": "example.com/explain-first"}],
                         "initContainers": [container("init", init_gpus)], "containers": [container("app", 1)]}}

    for name, init_gpus, fits in (("too-many", 3, False), ("fits", 2, True)):
        apply_objects(kube, [pod(name, init_gpus)], ns)
        exp = explain_target(kube, f"pod/{name}", ns)           # before the scheduler makes a claim of it
        kube.request("PATCH", f"{namespaced_collection('Pod', ns)}/{name}", body={"spec": {"schedulingGates": None}},
                     content_type="application/merge-patch+json")
        outcome = _scheduled_or_not(kube, ns, name)
        assert outcome.allocated == fits, outcome
        assert_agree(exp, outcome, f"init container asking {init_gpus}")
        if not fits:
            assert "container-0-request-0" in format_text(exp), format_text(exp)
        _delete_and_wait(kube, "Pod", ns, name)


def _scheduled_or_not(kube: KubeApi, ns: str, name: str, timeout: float = 40.0) -> Outcome:
    """Bound, or given up on by the scheduler (a pod with extended resources only has no claim before)."""
    deadline = time.monotonic() + timeout
    while True:
        current = kube.get(f"{namespaced_collection('Pod', ns)}/{name}")
        cond = next((c for c in (current.get("status") or {}).get("conditions") or []
                     if c.get("type") == "PodScheduled"), {})
        if current["spec"].get("nodeName") or (cond.get("status") == "False" and cond.get("reason") != "SchedulingGated"):
            return Outcome(bool(current["spec"].get("nodeName")), current["spec"].get("nodeName", ""),
                           message=str(cond.get("message", "")))
        assert time.monotonic() < deadline, f"the scheduler neither bound nor gave up on pod {name}"
        time.sleep(0.25)


def test_a_claim_that_cannot_be_created_is_the_verdict(api_client: Any, case_env: Any) -> None:
    """A template asking for admin access, made while the namespace had the admin-access label; the label is then
    removed. The claim controller cannot create the pod's claim (FailedResourceClaimCreation) and the pod stays
    Pending: explain says not allocatable and why, for the pod and for the template alone."""
    kube = KubeApi(api_client)
    driver, node, ns, _ = case_env(Case("uncreatable", L4, ONE, False, admin=True))
    apply_objects(kube, [_template("watch", _driver_in(_spec(_req("gpu", _exactly(GPU, adminAccess=True))), driver))],
                  ns)
    kube.request("PATCH", f"/api/v1/namespaces/{ns}", body={"metadata": {"labels": {
        "resource.kubernetes.io/admin-access": None}}}, content_type="application/merge-patch+json")
    apply_objects(kube, [_pod("watcher", [("gpu", "template:watch")])], ns)

    def refused() -> bool:
        events = kube.list(f"/api/v1/namespaces/{ns}/events")["items"]
        return any(e.get("reason") == "FailedResourceClaimCreation" for e in events)

    deadline = time.monotonic() + 40
    while not refused():
        assert time.monotonic() < deadline, "no FailedResourceClaimCreation Event for the pod"
        time.sleep(0.25)
    pod = kube.get(f"{namespaced_collection('Pod', ns)}/watcher")
    assert not pod["spec"].get("nodeName") and not (pod.get("status") or {}).get("resourceClaimStatuses")
    for target in ("pod/watcher", "template/watch"):
        exp = explain_target(kube, target, ns)
        assert exp.verdict == NOT_ALLOCATABLE, (target, exp.sentence)
        assert "cannot be created" in exp.sentence or "cannot create" in exp.sentence, (target, exp.sentence)
    assert "admin" in explain_target(kube, "template/watch", ns).sentence
