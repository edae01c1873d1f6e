"""Prepare/unprepare failure paths the driver handles but that the main driver tests do not reach: claims
that hold nothing of this node's, undo steps that fail and resume, start-up cleanup of CDI specs, NVML
errors and MIG overlaps met during a prepare, and an unexpected exception inside one claim.

Faults are injected where they would arise: NVML calls of the simulated GPUs answer with pynvml's error
codes (a process holding a MIG device makes ``nvmlComputeInstanceDestroy`` answer IN_USE), and the node's
CDI writer raises for one claim only."""
from __future__ import annotations

from typing import Any, Callable

import pynvml
import pytest

from dra.node import migdevices as mig
from dra.node.cdi import ClaimDevice
from dra.node.checkpoint import PREPARE_STARTED, ClaimRecord, MigUndo, UndoInfo
from dra.node.checkpoint import PreparedDevice as CheckpointDevice
from test_kubeletplugin_driver import NODE, Node, gpu_config, ok, opaque


@pytest.fixture
def whole(tmp_path) -> Node:
    return Node(tmp_path, {"default": {"wholeGpu": True}})


@pytest.fixture
def dynamic(tmp_path) -> Node:
    return Node(tmp_path, {"default": {"mig": "dynamic", "slots": {"count": 2, "strategy": "mps"}}})


class ProcessHoldsMig:
    """A process holds MIG devices: ``nvmlComputeInstanceDestroy`` answers NVML_ERROR_IN_USE for them, ``times``
    times in all, then the process is gone and destroying works again."""

    def __init__(self, nvml: Any, mig_uuids: set[str], times: int = 1) -> None:
        self.nvml = nvml
        self.mig_uuids = set(mig_uuids)
        self.left = times
        self.refused: list[str] = []
        self._destroy = nvml.nvmlComputeInstanceDestroy
        nvml.nvmlComputeInstanceDestroy = self

    def __call__(self, ci: Any) -> Any:
        uuid = self.nvml.nvmlDeviceGetUUID(self.nvml.nvmlComputeInstanceGetInfo(ci).device)
        if self.left > 0 and uuid in self.mig_uuids:
            self.left -= 1
            self.refused.append(uuid)
            raise pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE)
        return self._destroy(ci)

    def leave(self) -> None:
        self.nvml.nvmlComputeInstanceDestroy = self._destroy


def started_record(uid: str, name: str, device: str, live: mig.MigLive, profile_id: int, start: int) -> ClaimRecord:
    """A PrepareStarted record that says a MIG device was created (a prepare died or failed half-way)."""
    return ClaimRecord(
        uid=uid, namespace="default", name=name, state=PREPARE_STARTED,
        devices=(CheckpointDevice(device=device, pool=NODE, requests=("m",)),),
        undo=UndoInfo(mig_devices=(MigUndo(device=device, parent_uuid=live.parent_uuid, gi_id=live.gi_id,
                                           ci_id=live.ci_id, mig_uuid=live.uuid, profile_id=profile_id,
                                           start=start),)))


def errors(node: Node, operation: str = "prepare") -> dict[str, float]:
    counter = node.metrics.prepare_errors if operation == "prepare" else node.metrics.unprepare_errors
    return {s.labels["reason"]: s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")}


# --------------------------------------------------------------------------------------------------- claim content

def test_claim_with_only_other_pools_results_succeeds_with_no_devices(whole):
    ref = whole.add_claim("elsewhere", [
        {"request": "gpu", "device": "gpu-0", "pool": "node-b"},
        {"request": "gpu", "device": "gpu-1", "pool": "node-c"},
        {"request": "nic", "device": "gpu-1", "driver": "net.example.com"},
    ])
    result = whole.driver.prepare([ref])[ref.uid]
    assert result.error == "" and result.devices == ()
    assert whole.driver.checkpoint.get(ref.uid) is None           # nothing booked on this node
    assert not whole.driver.cdi.spec_path(ref.uid).exists()
    # gpu-0 and gpu-1 of this node are still free for a claim that has them.
    mine = whole.add_claim("mine", [{"request": "gpu", "device": "gpu-0"}, {"request": "gpu", "device": "gpu-1"}])
    assert [d.device_name for d in ok(whole.driver, mine).devices] == ["gpu-0", "gpu-1"]


def test_same_device_twice_in_one_claim_fails_that_claim(whole):
    twice = whole.add_claim("twice", [{"request": "a", "device": "gpu-0"}, {"request": "b", "device": "gpu-0"}])
    fine = whole.add_claim("fine", [{"request": "gpu", "device": "gpu-1"}])
    out = whole.driver.prepare([twice, fine])
    assert out[twice.uid].error == "request 'b': device gpu-0 is allocated twice in the claim"
    assert out[fine.uid].error == ""
    assert whole.driver.checkpoint.get(twice.uid) is None
    assert not whole.driver.cdi.spec_path(twice.uid).exists()
    assert errors(whole)["plan"] == 1


def test_admin_access_to_a_dynamic_mig_placement_nobody_created_fails(dynamic):
    device = "gpu-0-mig-1g10gb-19-3"
    admin = dynamic.add_claim("watcher", [{"request": "m", "device": device, "adminAccess": True}])
    err = dynamic.driver.prepare([admin])[admin.uid].error
    assert err == (f"device {device}: admin access to a dynamic MIG placement needs a claim that has it created; "
                   "none has")
    assert dynamic.mig_devices(0) == []                           # the watcher creates nothing
    assert dynamic.driver.checkpoint.get(admin.uid) is None
    assert errors(dynamic)["prepare_devices"] == 1
    # Once a claim has created it, the same admin claim watches that very MIG device.
    user = dynamic.add_claim("user", [{"request": "m", "device": device}])
    ok(dynamic.driver, user)
    [live] = dynamic.mig_devices(0)
    ok(dynamic.driver, admin)
    assert f"NVIDIA_VISIBLE_DEVICES={live.uuid}" in dynamic.spec_of(admin)["devices"][0]["containerEdits"]["env"]


# --------------------------------------------------------------------------------------------------- failing undo

def test_failing_rollback_at_start_keeps_the_record_and_start_up_continues(dynamic):
    live = mig.create_mig_device(dynamic.nvml, dynamic.uuids[0], 19, 3)
    dynamic.driver.checkpoint.put(started_record("stuck", "stuck", "gpu-0-mig-1g10gb-19-3", live, 19, 3))
    other = mig.create_mig_device(dynamic.nvml, dynamic.uuids[1], 19, 0)
    dynamic.driver.checkpoint.put(started_record("other", "other", "gpu-1-mig-1g10gb-19-0", other, 19, 0))
    holder = ProcessHoldsMig(dynamic.nvml, {live.uuid})

    dynamic.restart()
    report = dynamic.startup
    assert report.rollback_failed == ("stuck",)
    assert report.rolled_back == ("other",)                       # the failure did not stop the others
    assert holder.refused == [live.uuid]
    record = dynamic.driver.checkpoint.get("stuck")
    assert record is not None and record.state == PREPARE_STARTED
    assert [m.mig_uuid for m in record.undo.mig_devices] == [live.uuid]
    assert dynamic.mig_devices(0) == [live]                       # kept: still owned by the record, not an orphan
    assert dynamic.mig_devices(1) == []

    # The process is gone; the kubelet's retry rolls back and prepares afresh.
    ref = dynamic.add_claim("stuck", [{"request": "m", "device": "gpu-0-mig-1g10gb-19-3"}], uid="stuck")
    ok(dynamic.driver, ref)
    [again] = dynamic.mig_devices(0)
    assert again.start == 3 and again.uuid != live.uuid


def test_failing_rollback_before_a_retry_fails_the_retry_and_keeps_the_record(dynamic):
    device = "gpu-0-mig-1g10gb-19-5"
    ref = dynamic.add_claim("retry", [{"request": "m", "device": device}])
    stale = mig.create_mig_device(dynamic.nvml, dynamic.uuids[0], 19, 5)
    dynamic.driver.checkpoint.put(started_record(ref.uid, ref.name, device, stale, 19, 5))
    ProcessHoldsMig(dynamic.nvml, {stale.uuid})

    err = dynamic.driver.prepare([ref])[ref.uid].error
    assert err.startswith(f"claim {ref.describe()}: rolling back an earlier incomplete prepare failed: ")
    assert "a process still uses the MIG device" in err
    record = dynamic.driver.checkpoint.get(ref.uid)
    assert record is not None and record.state == PREPARE_STARTED
    assert [m.mig_uuid for m in record.undo.mig_devices] == [stale.uuid]
    assert dynamic.mig_devices(0) == [stale]
    assert errors(dynamic)["prepare_devices"] == 1

    ok(dynamic.driver, ref)                                       # the next retry gets through
    [live] = dynamic.mig_devices(0)
    assert live.start == 5 and live.uuid != stale.uuid


def test_unprepare_failing_part_way_resumes_on_retry(dynamic):
    ref = dynamic.add_claim("held", [{"request": "s", "device": "gpu-0-slot-0"},
                                     {"request": "m", "device": "gpu-1-mig-1g10gb-19-0"},
                                     {"request": "m", "device": "gpu-1-mig-1g10gb-19-1"}])
    ok(dynamic.driver, ref)
    first, second = dynamic.mig_devices(1)
    assert (first.start, second.start) == (0, 1)
    [daemon] = [d for d in dynamic.control.daemons.values() if d.alive]
    holder = ProcessHoldsMig(dynamic.nvml, {second.uuid})         # a CUDA process still runs on the second

    err = dynamic.driver.unprepare([ref])[ref.uid].error
    assert err.startswith(f"unprepare of claim {ref.describe()}: GPU {dynamic.uuids[1]}: MIG device GI ")
    assert err.endswith("a process still uses the MIG device")
    assert errors(dynamic, "unprepare") == {"MigError": 1}
    # Done steps are gone from the record; only the refused one is left to do.
    record = dynamic.driver.checkpoint.get(ref.uid)
    assert record is not None
    assert record.undo.mps_devices == ()
    assert [m.mig_uuid for m in record.undo.mig_devices] == [second.uuid]
    assert not daemon.alive
    assert dynamic.mig_devices(1) == [second]
    assert dynamic.driver.cdi.spec_path(ref.uid).exists()         # the pod may still be using it

    holder.leave()
    assert dynamic.driver.unprepare([ref])[ref.uid].error == ""
    assert dynamic.mig_devices(1) == []
    assert dynamic.driver.checkpoint.get(ref.uid) is None
    assert not dynamic.driver.cdi.spec_path(ref.uid).exists()


# --------------------------------------------------------------------------------------------------- start-up

def test_orphan_cdi_specs_are_removed_at_start(whole):
    kept = whole.add_claim("kept", [{"request": "gpu", "device": "gpu-0"}])
    ok(whole.driver, kept)
    orphan_uid = "0000-orphan"
    whole.driver.cdi.write_claim_spec(orphan_uid, [ClaimDevice(name="gpu-1", uuid=whole.uuids[1], gpu_minor=1)])
    assert set(whole.driver.cdi.list_claim_specs()) == {kept.uid, orphan_uid}

    whole.restart()
    assert whole.startup.cdi_removed == (orphan_uid,)
    assert set(whole.driver.cdi.list_claim_specs()) == {kept.uid}
    assert ok(whole.driver, kept).devices[0].device_name == "gpu-0"   # the prepared claim is untouched


def test_cdi_specs_of_claims_dropped_after_a_reboot_are_deleted(whole):
    ref = whole.add_claim("before-reboot", [{"request": "gpu", "device": "gpu-1"}])
    ok(whole.driver, ref)
    assert whole.driver.cdi.spec_path(ref.uid).exists()

    whole.boot_id.write_text("boot-2\n")
    whole.restart()
    assert [r.uid for r in whole.startup.checkpoint.dropped_claims] == [ref.uid]
    assert not whole.driver.cdi.spec_path(ref.uid).exists()
    assert whole.startup.cdi_removed == ()        # deleted as a dropped claim, not found later as an orphan
    assert whole.driver.checkpoint.claims() == {}
    ok(whole.driver, ref)                         # the kubelet prepares the claim afresh after the reboot
    assert whole.driver.cdi.spec_path(ref.uid).exists()


# --------------------------------------------------------------------------------------------------- hardware

def test_nvml_error_during_prepare_fails_the_claim_and_undoes_it(dynamic, monkeypatch):
    broken = dynamic.uuids[1]
    compute_capability = dynamic.nvml.nvmlDeviceGetCudaComputeCapability

    def get_compute_capability(handle: Any) -> tuple[int, int]:
        if dynamic.nvml.nvmlDeviceGetUUID(handle) == broken:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return compute_capability(handle)

    monkeypatch.setattr(dynamic.nvml, "nvmlDeviceGetCudaComputeCapability", get_compute_capability)
    ref = dynamic.add_claim("nvml", [{"request": "m", "device": "gpu-0-mig-1g10gb-19-0"},
                                     {"request": "m", "device": "gpu-1-mig-1g10gb-19-0"}])
    err = dynamic.driver.prepare([ref])[ref.uid].error
    assert err == f"claim {ref.describe()}: NVML: {pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)}"
    assert errors(dynamic) == {"prepare_devices": 1}
    assert dynamic.mig_devices(0) == []           # the first device, created before the error, is gone again
    assert dynamic.driver.checkpoint.get(ref.uid) is None
    assert not dynamic.driver.cdi.spec_path(ref.uid).exists()


def test_mig_overlap_reached_through_a_claim_fails_cleanly(dynamic):
    holder = dynamic.add_claim("holder", [{"request": "m", "device": "gpu-0-mig-3g40gb-9-4"}])
    ok(dynamic.driver, holder)
    [held] = dynamic.mig_devices(0)
    # A stale or wrong allocation: slice 5 of GPU 0 lies inside the 3g device at 4..7.
    clash = dynamic.add_claim("clash", [{"request": "m", "device": "gpu-1-mig-1g10gb-19-0"},
                                        {"request": "m", "device": "gpu-0-mig-1g10gb-19-5"}])
    err = dynamic.driver.prepare([clash])[clash.uid].error
    assert err.startswith(f"claim {clash.describe()}: GPU {dynamic.uuids[0]}: MIG profile 19 at start 5: "
                          "creating the GPU instance failed: ")
    assert err.endswith("(the memory slices overlap an existing MIG device, or the profile's instance limit is "
                        "reached)")
    assert dynamic.mig_devices(0) == [held]       # the holder's device is untouched
    assert dynamic.mig_devices(1) == []           # the clashing claim's first device was undone
    assert dynamic.driver.checkpoint.get(clash.uid) is None
    assert dynamic.driver.checkpoint.get(holder.uid).completed


def test_in_use_on_destroy_is_a_mig_error_and_leaves_the_device(dynamic):
    live = mig.create_mig_device(dynamic.nvml, dynamic.uuids[0], 19, 2)
    holder = ProcessHoldsMig(dynamic.nvml, {live.uuid})
    with pytest.raises(mig.MigError, match="a process still uses the MIG device") as caught:
        mig.destroy_mig_device(dynamic.nvml, live.parent_uuid, live.gi_id, live.ci_id, live.uuid)
    assert caught.value.code == pynvml.NVML_ERROR_IN_USE
    assert dynamic.mig_devices(0) == [live]       # neither the compute nor the GPU instance went
    assert holder.refused == [live.uuid]
    assert mig.destroy_mig_device(dynamic.nvml, live.parent_uuid, live.gi_id, live.ci_id, live.uuid)
    assert dynamic.mig_devices(0) == []


# --------------------------------------------------------------------------------------------------- sharing

def test_one_claim_asking_two_intervals_for_one_gpu_fails(tmp_path):
    node = Node(tmp_path, {"default": {"slots": {"count": 2, "strategy": "time-slicing"}}})
    ref = node.add_claim("two", [{"request": "a", "device": "gpu-1-slot-0"},
                                 {"request": "a", "device": "gpu-0-slot-0"},
                                 {"request": "b", "device": "gpu-0-slot-1"}], [
        opaque(gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Short"}), requests=["a"]),
        opaque(gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Long"}), requests=["b"]),
    ])
    err = node.driver.prepare([ref])[ref.uid].error
    assert err == (f"claim {ref.describe()}: GPU {node.uuids[0]} would get time-slice intervals Short and Long from "
                   "different requests; use one interval per GPU")
    assert node.control.time_slices == {}         # not even GPU 1, whose interval alone was fine
    assert node.driver.checkpoint.get(ref.uid) is None
    assert not node.driver.cdi.spec_path(ref.uid).exists()


# --------------------------------------------------------------------------------------------------- internal error

class Bug(Exception):
    """Stands for a programming error deep inside a prepare."""


def test_unexpected_exception_fails_only_its_claim_as_internal(dynamic):
    bad = dynamic.add_claim("bad", [{"request": "m", "device": "gpu-1-mig-1g10gb-19-0"}])
    good = dynamic.add_claim("good", [{"request": "m", "device": "gpu-0-mig-1g10gb-19-0"}])
    write: Callable[..., Any] = dynamic.driver.cdi.write_claim_spec

    def buggy_write(uid: str, devices: Any) -> Any:
        if uid == bad.uid:
            raise Bug("no such thing")
        return write(uid, devices)

    dynamic.driver.cdi.write_claim_spec = buggy_write
    out = dynamic.driver.prepare([bad, good])
    assert out[bad.uid].error == f"internal error preparing claim {bad.describe()}: no such thing"
    assert out[good.uid].error == "" and out[good.uid].devices[0].device_name == "gpu-0-mig-1g10gb-19-0"
    assert errors(dynamic) == {"internal": 1}
    assert dynamic.mig_devices(1) == []           # what the bad claim had done is undone
    assert dynamic.driver.checkpoint.get(bad.uid) is None
    assert len(dynamic.mig_devices(0)) == 1 and dynamic.driver.checkpoint.get(good.uid).completed
