"""Warning Events for failed prepares (kube.events): one Event per claim and pod, deduplicated per claim and
reason with a counted series, bounded memory, never blocking the caller; the driver records one per failed
claim and none for a prepared one."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from claims import reserved, resource_claim
from driver_node import Node, gpu_config, opaque

from kube.events import MAX_NOTE, PREPARE_FAILED, ClaimEventRecorder, claim_ref, event_body, one_line

DRIVER = "gpu.dra-driver.io"
UID = "0f8a7c6e-1111-4222-8333-444455556666"


class FakeWriter:
    def __init__(self, claim: dict[str, Any] | None = None, block: threading.Event | None = None) -> None:
        self.claim_obj = claim
        self.block = block
        self.created: list[dict[str, Any]] = []
        self.patched: list[tuple[str, str, dict[str, Any]]] = []
        self.reads = 0

    def claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        if self.block is not None:
            self.block.wait(5)
        return self.claim_obj

    def create(self, event: dict[str, Any]) -> None:
        self.created.append(event)

    def patch(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.patched.append((namespace, name, patch))


def a_claim(uid: str = UID, pods: tuple[str, ...] = ("train-0", "train-1")) -> dict[str, Any]:
    return resource_claim("train", "team", uid=uid, reserved_for=reserved(*((p, f"uid-{p}") for p in pods)), typed=False)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def recorder(writer: FakeWriter, clock: Clock | None = None, **kw: Any) -> ClaimEventRecorder:
    return ClaimEventRecorder(writer, DRIVER, "node-a", clock=clock or Clock(), wall=lambda: 1767225600.25, **kw)


def test_a_failure_makes_one_warning_on_the_claim_and_each_reserving_pod() -> None:
    w = FakeWriter(a_claim())
    r = recorder(w)
    r.warn("team", "train", UID, PREPARE_FAILED, "claim team/train: sharing.timeSlicing.interval: 'Forever' is not one of ...")
    assert r.flush()
    assert [(e["regarding"]["kind"], e["regarding"]["name"], e["regarding"]["uid"]) for e in w.created] == [
        ("ResourceClaim", "train", UID), ("Pod", "train-0", "uid-train-0"), ("Pod", "train-1", "uid-train-1")]
    for e in w.created:
        assert e["apiVersion"] == "events.k8s.io/v1" and e["type"] == "Warning" and e["reason"] == "PrepareFailed"
        assert e["reportingController"] == DRIVER and e["reportingInstance"] == "node-a"
    # a pod's Event names the claim that failed (a pod may have several)
    assert [e["note"][:50] for e in w.created] == ["claim team/train: sharing.timeSlicing.interval: 'F",
                                                   "claim train: claim team/train: sharing.timeSlicing",
                                                   "claim train: claim team/train: sharing.timeSlicing"]
    for e in w.created:
        assert e["metadata"]["namespace"] == "team" and e["eventTime"] == "2026-01-01T00:00:00.250000Z"
        assert e["action"] and "series" not in e
    assert "related" not in w.created[0] and w.created[1]["related"]["name"] == "train"
    assert len({e["metadata"]["name"] for e in w.created}) == 3


def test_retries_only_count_and_the_series_is_patched_at_most_once_per_interval() -> None:
    w, clock = FakeWriter(a_claim()), Clock()
    r = recorder(w, clock, min_interval_s=60)
    for _ in range(50):                           # the kubelet retrying every few seconds
        r.warn("team", "train", UID, PREPARE_FAILED, "bad config")
        clock.now += 1
    assert r.flush()
    assert len(w.created) == 3 and w.reads == 1
    assert w.patched == []                      # 50 failures within a minute: nothing but the first Events
    for _ in range(20):
        r.warn("team", "train", UID, PREPARE_FAILED, "bad config, again")
        clock.now += 1
    assert r.flush()
    assert len(w.created) == 3
    assert len(w.patched) == 3
    assert {name for _, name, _ in w.patched} == {e["metadata"]["name"] for e in w.created}
    # the 61st failure, a minute after the first write, patches each Event's series once
    assert {p["series"]["count"] for _, _, p in w.patched} == {61}
    assert [p["note"] for _, _, p in w.patched] == ["bad config, again"] + ["claim train: bad config, again"] * 2


def test_reasons_and_claims_are_separate_and_a_prepared_claim_starts_afresh() -> None:
    w = FakeWriter(a_claim(pods=()))
    r = recorder(w)
    r.warn("team", "train", UID, PREPARE_FAILED, "one")
    r.warn("team", "train", UID, "OtherReason", "two")
    r.warn("team", "other", "aaaaaaaa-1111-4222-8333-444455556666", PREPARE_FAILED, "three")
    r.forget(UID)
    r.warn("team", "train", UID, PREPARE_FAILED, "four")
    assert r.flush()
    assert [e["note"] for e in w.created] == ["one", "two", "three", "four"]


def test_a_claim_that_is_gone_or_replaced_gets_the_event_without_pods() -> None:
    for claim in (None, a_claim(uid="ffffffff-1111-4222-8333-444455556666")):
        w = FakeWriter(claim)
        r = recorder(w)
        r.warn("team", "train", UID, PREPARE_FAILED, "gone")
        assert r.flush()
        assert [e["regarding"]["kind"] for e in w.created] == ["ResourceClaim"]


def test_warn_never_waits_for_the_api_server_and_a_full_queue_drops() -> None:
    gate = threading.Event()
    w = FakeWriter(a_claim(), block=gate)
    r = recorder(w, max_queued=2)
    start = time.perf_counter()
    for i in range(10):
        r.warn("team", f"c{i}", f"{i:08d}-1111-4222-8333-444455556666", PREPARE_FAILED, "x")
    assert time.perf_counter() - start < 0.5
    assert r.dropped >= 7
    gate.set()
    assert r.flush()
    r.close()


def test_what_is_tracked_is_bounded() -> None:
    w = FakeWriter(None)
    r = recorder(w, max_tracked=3)
    for i in range(10):
        r.warn("team", f"c{i}", f"{i:08d}-1111-4222-8333-444455556666", PREPARE_FAILED, "x")
    assert r.flush()
    assert len(r._series) == 3


def test_a_failed_write_is_logged_not_raised() -> None:
    class Refusing(FakeWriter):
        def create(self, event: dict[str, Any]) -> None:
            raise RuntimeError("403 forbidden")

    logged: list[dict[str, Any]] = []

    class Log:
        def warning(self, msg: str, **kw: Any) -> None:
            logged.append({"msg": msg, **kw})

    r = recorder(Refusing(a_claim()), log=Log())
    r.warn("team", "train", UID, PREPARE_FAILED, "x")
    assert r.flush()
    assert r.failed == 1 and logged[0]["msg"] == "event not written" and "403" in logged[0]["error"]


def test_the_note_is_one_printable_line_within_the_limit() -> None:
    assert one_line("a\nb\x1b[31m  c") == "a b\\x1b[31m c"
    long = one_line("x" * 5000)
    assert len(long) == MAX_NOTE and long.endswith("…")
    body = event_body(claim_ref("ns", "n" * 253, UID), reason="R", note="n", controller="c", instance="i", now=0)
    assert len(body["metadata"]["name"]) <= 253


# --------------------------------------------------------------------------------------------------- the driver

def test_the_driver_records_a_failed_prepare_and_not_a_good_one(tmp_path: Path) -> None:
    node = Node(tmp_path, {"default": {"wholeGpu": True}})
    seen: list[tuple[str, ...]] = []
    forgotten: list[str] = []

    class Recorder:
        def warn(self, *args: str) -> None:
            seen.append(args)

        def forget(self, uid: str) -> None:
            forgotten.append(uid)

        def close(self) -> None:
            pass

    node.driver.events = Recorder()
    good = node.add_claim("good", [{"request": "gpu", "device": "gpu-0"}])
    bad = node.add_claim("bad", [{"request": "gpu", "device": "gpu-1"}],
                         [opaque(gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Forever"}))])
    out = node.driver.prepare([good, bad])
    assert out[good.uid].error == "" and out[bad.uid].error
    assert seen == [("default", "bad", bad.uid, PREPARE_FAILED, out[bad.uid].error)]
    assert forgotten == [good.uid]
    node.driver.close()


def test_no_writer_records_nothing() -> None:
    r = ClaimEventRecorder(None, DRIVER, "node-a")
    r.warn("team", "train", UID, PREPARE_FAILED, "x")
    assert r._series == {} and r._thread is None
