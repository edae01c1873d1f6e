"""Pending claims that MPS tenancy keeps off the devices (controller.pendingclaims, ops.explain.verdict): explain
names the namespace a tenancy-tainted device's daemon serves; the controller's pass posts one Warning Event on
the claim and its pod with the same words, once per message, for due claims only and a bounded number per pass.
Everything is plain dicts: the API server is a scripted list of objects that the controller's caches load
(controller.clusterstate), the Event writer records; a pass itself reads nothing from the API server."""
from __future__ import annotations

import copy
from typing import Any

from claims import request, resource_claim

from api.deviceclasses import device_classes
from controller.clusterstate import CLAIMS, TAINT_RULES, ClusterState
from controller.pendingclaims import MPS_TENANCY, PendingClaimEvents, pending_groups, tenancy_note
from dra.model.tenancy import tenancy_taint, tenancy_toleration
from kube.client import DEVICE_CLASSES, NODES, SLICES
from ops.explain.verdict import ALLOCATABLE, NOT_ALLOCATABLE, Target, explain, format_text

D = "gpu.example.com"
CLASSES = device_classes(D)
CLASS_NAMES = [c["metadata"]["name"] for c in CLASSES]
SLOT = f"slot.{D}"


def slot_slices(node: str = "node-a", gpus: int = 2, slots: int = 2,
                tenants: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """A node's MPS slots, `slots` per GPU; the slots of GPU g tainted for namespace tenants[g]."""
    devices = []
    for g in range(gpus):
        for s in range(slots):
            dev: dict[str, Any] = {"name": f"gpu-{g}-slot-{s}", "attributes": {
                "type": {"string": "slot"}, "sharing": {"string": "mps"}, "parentUUID": {"string": f"GPU-{node}-{g}"}},
                "capacity": {"memory": {"value": "40Gi"}}}
            if tenants and g in tenants:
                dev["taints"] = [tenancy_taint(D, tenants[g])]
            devices.append(dev)
    return [{"metadata": {"name": f"{node}-slots"}, "spec": {
        "driver": D, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
        "devices": devices}}]


def slot_claim(name: str, ns: str = "team-b", pod: str | None = None, created: str = "2026-01-01T00:00:00Z",
               tolerate: bool = True, cls: str = SLOT) -> dict[str, Any]:
    """A claim for one slot, with the toleration for its own namespace the chart's admission policy adds."""
    meta: dict[str, Any] = {"creationTimestamp": created}
    if pod:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": f"uid-pod-{pod}",
                                    "controller": True, "blockOwnerDeletion": True}]
    tolerations = {"tolerations": [tenancy_toleration(D, ns)]} if tolerate else {}
    return resource_claim(name, ns, uid=f"uid-{ns}-{name}", metadata=meta, requests=[request("slot", cls, **tolerations)])


def allocated(claim: dict[str, Any], node: str, device: str) -> dict[str, Any]:
    out = copy.deepcopy(claim)
    out["status"] = {"allocation": {"devices": {"results": [
        {"request": "slot", "driver": D, "pool": node, "device": device}]}}}
    return out


def judge(claim: dict[str, Any], slices: list[dict[str, Any]], others: list[dict[str, Any]] = ()) -> Any:
    name = f"{claim['metadata']['namespace']}/{claim['metadata']['name']}"
    return explain([Target(name, claim)], CLASSES, slices, [*others, claim])


# ---------------------------------------------------------------------------------------------- explain

def test_explain_names_the_namespace_a_tainted_gpus_daemon_serves() -> None:
    exp = judge(slot_claim("x"), slot_slices(tenants={0: "team-a", 1: "team-a"}))
    assert exp.verdict == NOT_ALLOCATABLE
    assert (f"gpu-0-slot-0, gpu-0-slot-1 and 2 more are tainted {D}/mps-namespace=team-a:NoExecute, not tolerated "
            "(MPS daemon serves namespace team-a)") in format_text(exp)
    assert "(MPS daemon serves namespace team-a)" in format_text(exp)
    (rep,) = exp.nodes[0].requests
    assert rep.tenancy == {"team-a": ["GPU-node-a-0", "GPU-node-a-1"]}
    assert exp.to_dict()["nodes"][0]["requests"][0]["tenancy"] == rep.tenancy
    # The tenant's own claim tolerates its GPUs' taint.
    own = judge(slot_claim("y", ns="team-a"), slot_slices(tenants={0: "team-a", 1: "team-a"}))
    assert own.verdict == ALLOCATABLE and not own.nodes[0].requests[0].tenancy


def test_other_taints_are_not_called_tenancy() -> None:
    slices = slot_slices(gpus=1)
    for dev in slices[0]["spec"]["devices"]:
        dev["taints"] = [{"key": "example.com/maintenance", "value": "team-a", "effect": "NoExecute"}]
    exp = judge(slot_claim("x"), slices)
    assert exp.verdict == NOT_ALLOCATABLE and "MPS daemon" not in exp.sentence
    assert not exp.nodes[0].requests[0].tenancy and tenancy_note(["team-b/x"], exp) is None


# ------------------------------------------------------------------------------------------- the message

def test_the_note_counts_the_gpus_per_node_and_namespace_and_names_the_other_devices() -> None:
    slices = slot_slices(gpus=3, tenants={0: "team-a", 1: "team-a"}) + slot_slices("node-b", gpus=1,
                                                                                    tenants={0: "team-c"})
    holders = [allocated(slot_claim(f"h{s}", ns="team-d"), "node-a", f"gpu-2-slot-{s}") for s in range(2)]
    exp = judge(slot_claim("x"), slices, holders)
    note = tenancy_note(["team-b/x"], exp)
    assert note == ("claim team-b/x cannot be allocated: the MPS slots and shares of 2 GPUs on node-a serve namespace "
                    "team-a, 1 GPU on node-b serve namespace team-c (an MPS daemon serves one namespace; node policy "
                    "mps.shareAcrossNamespaces); other devices: node-a: gpu-2-slot-0 is held by team-d/h0; "
                    "node-a: gpu-2-slot-1 is held by team-d/h1")


def test_no_note_when_the_claim_fits_or_tenancy_is_not_why() -> None:
    fits = judge(slot_claim("x"), slot_slices(tenants={0: "team-a"}))      # GPU 1 is free
    assert fits.verdict == ALLOCATABLE and tenancy_note(["team-b/x"], fits) is None
    holders = [allocated(slot_claim(f"h{s}", ns="team-d"), "node-a", f"gpu-0-slot-{s}") for s in range(2)]
    taken = judge(slot_claim("x"), slot_slices(gpus=1), holders)
    assert taken.verdict == NOT_ALLOCATABLE and tenancy_note(["team-b/x"], taken) is None


# -------------------------------------------------------------------------------------------- the groups

def test_pending_claims_of_this_driver_are_grouped_by_their_pod_oldest_first() -> None:
    claims = [
        slot_claim("late", pod="p2", created="2026-01-01T00:05:00Z"),
        slot_claim("a", pod="p1", created="2026-01-01T00:01:00Z"),
        slot_claim("b", pod="p1", created="2026-01-01T00:02:00Z"),
        slot_claim("alone", created="2026-01-01T00:03:00Z"),
        allocated(slot_claim("done", pod="p3"), "node-a", "gpu-0-slot-0"),
        slot_claim("other-driver", pod="p4", cls="gpu.other.example.com"),
        {**slot_claim("deleting", pod="p5"), "metadata": {**slot_claim("deleting")["metadata"],
                                                          "deletionTimestamp": "2026-01-01T00:00:09Z"}},
    ]
    groups = pending_groups(claims, CLASS_NAMES)
    assert [(g.key, g.names) for g in groups] == [
        ("uid-pod-p1", ["team-b/a", "team-b/b"]),
        ("uid-team-b-alone", ["team-b/alone"]),
        ("uid-pod-p2", ["team-b/late"]),
    ]
    assert groups[0].pod is not None and groups[0].pod.name == "p1" and groups[1].pod is None


# ---------------------------------------------------------------------------------------------- the pass

class ScriptedApi:
    """The LISTs the controller's caches make, over objects the test sets; counts them."""

    def __init__(self, slices: list[dict[str, Any]], claims: list[dict[str, Any]]) -> None:
        self.slices, self.claims = slices, claims
        self.lists: list[str] = []

    def request(self, method: str, path: str, query: dict[str, Any] | None = None, **_: Any) -> dict[str, Any]:
        assert method == "GET" and not (query or {}).get("watch")
        self.lists.append(path)
        if path == NODES:
            return {"items": [{"metadata": {"name": n}} for n in ("node-a", "node-b")], "metadata": {}}
        items = {DEVICE_CLASSES: CLASSES, SLICES: self.slices, CLAIMS: self.claims, TAINT_RULES: []}[path]
        return {"items": copy.deepcopy(items), "metadata": {"resourceVersion": "1"}}


class RecordingWriter:
    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []

    def claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        raise AssertionError("the pass knows its claims")

    def create(self, event: dict[str, Any]) -> None:
        self.created.append(event)

    def patch(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        raise AssertionError("a changed message is a new Event")


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


CREATED = "2026-01-01T00:00:00Z"
T0 = 1767225600.0          # CREATED as a Unix time


class Pass:
    """A pass after the caches loaded what the scripted API server holds now (a watch would have brought it)."""

    def __init__(self, api: ScriptedApi, loop: PendingClaimEvents) -> None:
        self.api, self.loop = api, loop

    def __call__(self) -> int:
        self.loop.state.load()
        before = len(self.api.lists)
        evaluated = self.loop.pass_once()
        assert len(self.api.lists) == before, "a pass read the API server"
        return evaluated


def events_pass(api: ScriptedApi, **kw: Any) -> tuple[PendingClaimEvents, RecordingWriter, Clock, Pass]:
    writer, clock = RecordingWriter(), Clock(T0 + 1)
    state = ClusterState(api, D, CLASS_NAMES)   # type: ignore[arg-type]
    loop = PendingClaimEvents(state, D, CLASS_NAMES, writer=writer, instance="ctl-0", clock=clock,
                              wall=clock, min_age_s=5, recheck_s=30, **kw)
    return loop, writer, clock, Pass(api, loop)


def test_a_pass_posts_one_event_on_the_claim_and_its_pod_and_again_only_when_the_message_changes() -> None:
    api = ScriptedApi(slot_slices(tenants={0: "team-a", 1: "team-a"}), [slot_claim("x", pod="p", created=CREATED)])
    loop, writer, clock, run = events_pass(api)

    assert run() == 0 and not writer.created            # one second old: the scheduler's turn
    clock.now = T0 + 6
    assert run() == 1
    note = ("claim team-b/x cannot be allocated: the MPS slots and shares of 2 GPUs on node-a serve namespace team-a "
            "(an MPS daemon serves one namespace; node policy mps.shareAcrossNamespaces)")
    assert [(e["regarding"]["kind"], e["regarding"]["name"], e["regarding"]["uid"], e["type"], e["reason"], e["note"])
            for e in writer.created] == [("ResourceClaim", "x", "uid-team-b-x", "Warning", MPS_TENANCY, note),
                                         ("Pod", "p", "uid-pod-p", "Warning", MPS_TENANCY, note)]
    assert writer.created[1]["related"]["name"] == "x"
    assert writer.created[0]["reportingController"] == f"{D}/controller"
    assert writer.created[0]["reportingInstance"] == "ctl-0"

    clock.now += 5
    assert run() == 0                                    # not due again before recheck_s
    clock.now += 30
    assert run() == 1 and len(writer.created) == 2       # due, same message: nothing posted
    api.slices = slot_slices(gpus=3, tenants={0: "team-a", 1: "team-a", 2: "team-c"})
    clock.now += 30
    assert run() == 1 and len(writer.created) == 4
    assert "2 GPUs on node-a serve namespace team-a, 1 GPU on node-a serve namespace team-c" in writer.created[-1]["note"]

    # Allocated after all (the tenant left): forgotten, so its memory follows the pending claims.
    api.claims = [allocated(slot_claim("x", pod="p", created=CREATED), "node-a", "gpu-0-slot-0")]
    clock.now += 30
    assert run() == 0 and not loop._seen


def test_a_pass_evaluates_at_most_max_per_pass_groups_longest_waiting_first() -> None:
    claims = [slot_claim(f"c{i}", pod=f"p{i}", created=f"2026-01-01T00:00:0{i}Z") for i in range(3)]
    api = ScriptedApi(slot_slices(tenants={0: "team-a", 1: "team-a"}), claims)
    loop, writer, clock, run = events_pass(api, max_per_pass=2)
    clock.now = T0 + 60
    assert run() == 2
    assert [e["regarding"]["name"] for e in writer.created if e["regarding"]["kind"] == "Pod"] == ["p0", "p1"]
    assert run() == 1                                    # the third one's turn
    assert [e["regarding"]["name"] for e in writer.created if e["regarding"]["kind"] == "Pod"][-1] == "p2"
    # All three are due again, and a new claim: it is not starved by them, it goes first.
    api.claims.append(slot_claim("c3", pod="p3", created="2026-01-01T00:00:50Z"))
    clock.now += 30
    seen = {k: v.checked for k, v in loop._seen.items()}
    assert run() == 2
    assert loop._seen["uid-pod-p3"].checked == clock.now and loop._seen["uid-pod-p0"].checked == clock.now
    assert loop._seen["uid-pod-p1"].checked == seen["uid-pod-p1"]


def test_an_allocatable_claim_gets_no_event() -> None:
    api = ScriptedApi(slot_slices(tenants={0: "team-a"}), [slot_claim("x", pod="p", created=CREATED)])
    loop, writer, clock, run = events_pass(api)
    clock.now = T0 + 60
    assert run() == 1 and not writer.created
