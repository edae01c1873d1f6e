"""ResourceClaim status.devices: the entries the driver reports after prepare (an unprepare writes nothing: the
API server drops them at deallocation), and the server-side apply requests that carry them."""
from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import pytest
from driver_node import DRIVER, NODE, Node, ok

from kube.client import ApiError, ApiUnavailable
from kubeletplugin.claimstatus import (
    ClaimStatusError,
    DeviceStatus,
    KubernetesClaimStatusWriter,
    field_manager,
    status_entry,
)
from kubeletplugin.transport.nodedriver import ClaimRef

REF = ClaimRef(namespace="ns", uid="3f1c6a52-0000-4000-8000-000000000001", name="claim-a")


class RecordingStatus:
    """A ClaimStatusWriter that keeps what it was told; ``fail`` makes every call fail like an API error."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.entries: dict[str, tuple[list[DeviceStatus], float]] = {}
        self.publishes = 0

    def publish(self, ref: ClaimRef, devices: Sequence[DeviceStatus], ready_since: float) -> None:
        self.publishes += 1
        if self.fail:
            raise ClaimStatusError("writing status.devices: HTTP 403 Forbidden")
        self.entries[ref.uid] = (list(devices), ready_since)


def status_metric(node: Node, operation: str, result: str) -> float:
    value = node.metrics.registry.get_sample_value(
        "gpu_dra_claim_status_writes_total", {"operation": operation, "result": result})
    return value or 0.0


@pytest.fixture
def mixed(tmp_path):
    """GPU 0 published as dynamic MIG partitions, GPU 1 as time-slicing slots."""
    return Node(tmp_path, {"default": {"mig": "dynamic"},
                           "rules": [{"match": {"index": 1}, "wholeGpu": False,
                                      "slots": {"count": 2, "strategy": "time-slicing"}}]})


def test_prepared_devices_are_reported_with_the_uuid_actually_used(mixed):
    status = RecordingStatus()
    mixed.driver.status = status
    ref = mixed.add_claim("c", [{"request": "mig", "device": "gpu-0-mig-1g10gb-19-6"},
                                {"request": "slot", "device": "gpu-1-slot-0"}])
    ok(mixed.driver, ref)
    assert mixed.driver.reporter.flush()
    live, = mixed.mig_devices(0)
    devices, ready_since = status.entries[ref.uid]
    by_name = {d.device: d for d in devices}
    assert set(by_name) == {"gpu-0-mig-1g10gb-19-6", "gpu-1-slot-0"}
    assert all(d.pool == NODE and d.share_id is None for d in devices)
    assert by_name["gpu-0-mig-1g10gb-19-6"].data == {
        "uuid": live.uuid, "type": "mig", "parentUUID": mixed.uuids[0], "pciBusID": "0000:18:00.0",
        "migProfile": "1g.10gb", "gpuInstanceID": live.gi_id, "computeInstanceID": live.ci_id}
    slot = by_name["gpu-1-slot-0"].data
    assert slot["uuid"] == mixed.uuids[1] and slot["type"] == "slot" and "parentUUID" not in slot
    assert ready_since == mixed.driver.checkpoint.get(ref.uid).updated > 0

    # The kubelet asks again (e.g. after its restart): the stored answer, no second status write.
    ok(mixed.driver, ref)
    assert mixed.driver.reporter.flush()
    assert status.publishes == 1
    assert mixed.driver.unprepare([ref])[ref.uid].error == ""
    assert mixed.driver.reporter.flush()
    assert status.publishes == 1 and status_metric(mixed, "publish", "ok") == 1   # the unprepare wrote nothing
    # Prepared again after its unprepare (another pod of the claim on this node): reported again.
    ok(mixed.driver, ref)
    assert mixed.driver.reporter.flush()
    assert status.publishes == 2


def test_a_failed_status_write_never_fails_the_prepare(mixed):
    status = RecordingStatus(fail=True)
    mixed.driver.status = status
    mixed.driver.reporter.retry_delays = (0.0,)          # one retry, at once
    ref = mixed.add_claim("c", [{"request": "slot", "device": "gpu-1-slot-1"}])
    result = ok(mixed.driver, ref)
    assert [d.device_name for d in result.devices] == ["gpu-1-slot-1"]
    assert mixed.driver.cdi.spec_path(ref.uid).exists()
    assert mixed.driver.reporter.flush()
    assert status_metric(mixed, "publish", "error") == 2      # the write and its retry
    ok(mixed.driver, ref)                      # a repeated prepare tries the status again
    assert mixed.driver.reporter.flush()
    assert status.publishes == 4
    assert mixed.driver.unprepare([ref])[ref.uid].error == ""
    assert mixed.driver.reporter.flush()
    assert status.publishes == 4 and status_metric(mixed, "publish", "error") == 4
    assert mixed.driver.checkpoint.get(ref.uid) is None


def test_a_claim_status_is_written_again_by_a_new_plugin_process(mixed):
    first = RecordingStatus()
    mixed.driver.status = first
    ref = mixed.add_claim("c", [{"request": "gpu", "device": "gpu-0"}])
    ok(mixed.driver, ref)
    assert mixed.driver.reporter.flush()
    second = RecordingStatus()
    mixed.restart().status = second
    ok(mixed.driver, ref)
    assert mixed.driver.reporter.flush()
    assert second.entries[ref.uid] == first.entries[ref.uid]   # same entries, same Ready time: a no-op apply


def test_status_writes_are_retried_until_they_succeed_and_never_delay_the_answer(mixed):
    class SlowThenOk(RecordingStatus):
        def publish(self, ref: ClaimRef, devices: Sequence[DeviceStatus], ready_since: float) -> None:
            self.fail = self.publishes < 2          # fails twice, then the API server takes it
            time.sleep(0.2)
            super().publish(ref, devices, ready_since)

    status = SlowThenOk()
    mixed.driver.status = status
    mixed.driver.reporter.retry_delays = (0.0, 0.0, 0.0)
    ref = mixed.add_claim("c", [{"request": "slot", "device": "gpu-1-slot-1"}])
    started = time.monotonic()
    ok(mixed.driver, ref)
    answered = time.monotonic() - started
    assert ref.uid not in status.entries          # three attempts of 0.2 s each: the answer did not wait for them
    assert answered < 0.5
    assert mixed.driver.reporter.flush()
    assert ref.uid in status.entries and status.publishes == 3
    assert (status_metric(mixed, "publish", "error"), status_metric(mixed, "publish", "ok")) == (2, 1)


def test_an_unprepare_right_after_a_prepare_drops_a_waiting_status_write(mixed):
    status = RecordingStatus(fail=True)
    mixed.driver.status = status
    mixed.driver.reporter.retry_delays = (30.0,)       # the retry would wait long
    ref = mixed.add_claim("c", [{"request": "slot", "device": "gpu-1-slot-1"}])
    ok(mixed.driver, ref)
    deadline = time.monotonic() + 5
    while status.publishes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    status.fail = False
    assert mixed.driver.unprepare([ref])[ref.uid].error == ""
    assert mixed.driver.reporter.flush(timeout=5)       # no 30 s wait: the unprepare dropped the retry
    assert status.publishes == 1 and ref.uid not in status.entries


def test_an_unprepare_during_a_failing_status_write_stops_its_retries(mixed):
    entered, release = threading.Event(), threading.Event()

    class Blocking(RecordingStatus):
        def publish(self, ref: ClaimRef, devices: Sequence[DeviceStatus], ready_since: float) -> None:
            entered.set()
            assert release.wait(10)
            super().publish(ref, devices, ready_since)

    status = Blocking(fail=True)
    mixed.driver.status = status
    mixed.driver.reporter.retry_delays = (0.0, 0.0, 0.0)
    ref = mixed.add_claim("c", [{"request": "slot", "device": "gpu-1-slot-1"}])
    ok(mixed.driver, ref)
    assert entered.wait(10)                               # the write is under way
    assert mixed.driver.unprepare([ref])[ref.uid].error == ""
    release.set()                                         # ... and fails: no retry for an unprepared claim
    assert mixed.driver.reporter.flush(timeout=5)
    assert status.publishes == 1


def test_nothing_to_report_for_a_claim_without_our_devices(mixed):
    status = RecordingStatus()
    mixed.driver.status = status
    ref = mixed.add_claim("other", [{"request": "gpu", "device": "gpu-0", "driver": "other.example.com"}])
    assert ok(mixed.driver, ref).devices == ()
    assert mixed.driver.reporter.flush()
    assert status.publishes == 0


# --- the server-side apply requests ------------------------------------------------------------------------

class FakeKube:
    def __init__(self, error: Exception | None = None):
        self.error = error
        self.requests: list[dict[str, Any]] = []

    def request(self, method: str, path: str, query: dict[str, Any] | None = None, body: Any = None,
                content_type: str = "application/json", **_: Any) -> dict[str, Any]:
        self.requests.append({"method": method, "path": path, "query": query, "body": body,
                              "content_type": content_type})
        if self.error is not None:
            raise self.error
        return {}


def writer(kube: FakeKube) -> KubernetesClaimStatusWriter:
    w = KubernetesClaimStatusWriter(object(), DRIVER, NODE)
    w.kube = kube  # type: ignore[assignment]
    return w


def test_publish_applies_our_entries_to_the_status_subresource():
    kube = FakeKube()
    device = DeviceStatus(pool=NODE, device="gpu-0-shared", share_id="7d3c5a4e-1111-4222-8333-944455556666",
                          data={"uuid": "GPU-1", "type": "shared"})
    writer(kube).publish(REF, [device], ready_since=1_767_225_600.0)
    req, = kube.requests
    assert (req["method"], req["content_type"]) == ("PATCH", "application/apply-patch+yaml")
    assert req["path"] == "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/claim-a/status"
    assert req["query"] == {"fieldManager": f"{DRIVER}/{NODE}", "force": True}
    body = req["body"]
    assert body["metadata"] == {"name": "claim-a", "namespace": "ns", "uid": REF.uid}
    assert body["status"]["devices"] == [{
        "driver": DRIVER, "pool": NODE, "device": "gpu-0-shared", "shareID": device.share_id,
        "conditions": [{"type": "Ready", "status": "True", "reason": "Prepared",
                        "message": f"prepared on node {NODE}", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        "data": {"uuid": "GPU-1", "type": "shared"}}]


def test_refused_and_unanswered_writes_name_the_claim():
    gone = FakeKube(ApiError("PATCH", "/x", 404, '{"reason": "NotFound", "message": "not found"}'))
    forbidden = FakeKube(ApiError("PATCH", "/x", 403, '{"reason": "Forbidden", "message": "no associated-node:patch"}'))
    with pytest.raises(ClaimStatusError, match=r"writing status.devices of ResourceClaim ns/claim-a .*Forbidden"):
        writer(forbidden).publish(REF, [DeviceStatus(NODE, "gpu-0")], 0.0)
    down = FakeKube(ApiUnavailable("connection refused"))
    with pytest.raises(ClaimStatusError, match="writing status.devices.*connection refused"):
        writer(down).publish(REF, [DeviceStatus(NODE, "gpu-0")], 0.0)
    with pytest.raises(ClaimStatusError, match="404"):
        writer(gone).publish(REF, [DeviceStatus(NODE, "gpu-0")], 0.0)   # publishing to a deleted claim is not fine


def test_field_manager_fits_the_limit():
    assert field_manager(DRIVER, NODE) == f"{DRIVER}/{NODE}"
    long_node = "n" * 200
    name = field_manager(DRIVER, long_node)
    assert len(name) <= 128 and name.startswith(f"{DRIVER}/") and name != field_manager(DRIVER, "m" * 200)


def test_entry_without_share_or_data():
    entry = status_entry(DRIVER, NODE, DeviceStatus(NODE, "gpu-1"), 0.0)
    assert set(entry) == {"driver", "pool", "device", "conditions"}
