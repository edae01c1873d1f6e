"""Prepare/unprepare on a simulated node: FakeNvml GPUs, simulated sharing tools, a fake driver root, claims
from a dict. Every effect is checked where it lands: NVML's MIG state, the sharing tools' records, the CDI
file, the checkpoint."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable

import pynvml
import pytest
from driver_node import CDI_KIND, DRIVER, NODE, Node, gpu_config, ok, opaque

from dra.model.devices import build_devices
from dra.model.policy import parse_node_policy
from dra.node import migdevices as mig
from dra.node.cdi import ClaimDevice
from dra.node.checkpoint import PREPARE_STARTED, ClaimRecord, MigUndo, UndoInfo
from dra.node.checkpoint import PreparedDevice as CheckpointDevice
from dra.node.inventory import discover
from dra.sim.fleet import nvml_for_node, parse_fleet
from kubeletplugin.driver import Driver
from kubeletplugin.transport.nodedriver import ClaimRef


@pytest.fixture
def whole(tmp_path):
    return Node(tmp_path, {"default": {"wholeGpu": True}})


# --------------------------------------------------------------------------------------------------- whole GPUs

def test_whole_gpu_prepare_writes_cdi_and_is_idempotent(whole):
    ref = whole.add_claim("c1", [{"request": "gpu/h100", "device": "gpu-1"}])
    reads = whole.claims.reads
    result = ok(whole.driver, ref)
    assert whole.claims.reads == reads + 1
    [dev] = result.devices
    assert (dev.request_names, dev.pool_name, dev.device_name) == (("gpu",), NODE, "gpu-1")
    assert dev.cdi_device_ids == (f"{CDI_KIND}={ref.uid}-gpu-1",)
    spec = whole.spec_of(ref)
    assert spec["kind"] == CDI_KIND
    [cdi_dev] = spec["devices"]
    assert cdi_dev["name"] == f"{ref.uid}-gpu-1"
    assert [n["path"] for n in cdi_dev["containerEdits"]["deviceNodes"]] == ["/dev/nvidia1"]
    assert f"NVIDIA_VISIBLE_DEVICES={whole.uuids[1]}" in cdi_dev["containerEdits"]["env"]
    record = whole.driver.checkpoint.get(ref.uid)
    assert record.completed and record.name == "c1" and [d.device for d in record.devices] == ["gpu-1"]

    # Again: same answer from the checkpoint, no API read, no rewrite.
    mtime = whole.driver.cdi.spec_path(ref.uid).stat().st_mtime_ns
    again = ok(whole.driver, ref)
    assert again.devices == result.devices
    assert whole.claims.reads == reads + 1
    assert whole.driver.cdi.spec_path(ref.uid).stat().st_mtime_ns == mtime

    assert whole.driver.unprepare([ref])[ref.uid].error == ""
    assert not whole.driver.cdi.spec_path(ref.uid).exists()
    assert whole.driver.checkpoint.get(ref.uid) is None
    # Unprepare is idempotent.
    assert whole.driver.unprepare([ref])[ref.uid].error == ""


def test_the_record_keeps_the_pods_the_claim_is_reserved_for(whole):
    # The per-claim metrics name a process's pod by its UID from these (kubeletplugin.claimmetrics).
    ref = whole.add_claim("c1", [{"request": "gpu", "device": "gpu-1"}])
    claim = whole.claims.get_claim(ref.namespace, ref.name, ref.uid)
    pod = claim["status"]["reservedFor"][0]
    claim["status"]["reservedFor"] += [
        {"resource": "pods", "name": "second", "uid": "0b9f2c3d-1111-2222-3333-444455556666"},
        {"apiGroup": "example.com", "resource": "jobs", "name": "not-a-pod", "uid": "1"},
        {"resource": "pods", "name": "../x", "uid": "2"}]
    ok(whole.driver, ref)
    expect = [(pod["name"], pod["uid"]), ("second", "0b9f2c3d-1111-2222-3333-444455556666")]
    assert [(p.name, p.uid) for p in whole.driver.checkpoint.get(ref.uid).reserved_for] == expect
    driver = whole.restart()
    assert [(p.name, p.uid) for p in driver.checkpoint.get(ref.uid).reserved_for] == expect


def test_a_record_of_an_older_plugin_without_reserved_for_loads():
    record = ClaimRecord.model_validate({"uid": "u1", "namespace": "default", "name": "c1",
                                         "state": "PrepareCompleted", "devices": [{"device": "gpu-1", "pool": NODE}]})
    assert record.completed and record.reserved_for == ()


def test_unprepare_of_unknown_claim_succeeds(whole):
    ref = ClaimRef("default", "never-prepared", "ghost")
    assert whole.driver.unprepare([ref]) == {ref.uid: whole.driver.unprepare([ref])[ref.uid]}
    assert whole.driver.unprepare([ref])[ref.uid].error == ""


def test_claim_problems_fail_only_that_claim(whole):
    good = whole.add_claim("good", [{"request": "gpu", "device": "gpu-0"}])
    replaced = whole.add_claim("replaced", [{"request": "gpu", "device": "gpu-1"}])
    stale = ClaimRef(replaced.namespace, "old-uid", replaced.name)
    whole.claims.put({"metadata": {"name": "unalloc", "namespace": "default", "uid": "u-unalloc"}, "status": {}})
    unalloc = ClaimRef("default", "u-unalloc", "unalloc")
    missing = ClaimRef("default", "u-missing", "missing")
    unknown_dev = whole.add_claim("unknown", [{"request": "gpu", "device": "gpu-7"}])
    out = whole.driver.prepare([good, stale, unalloc, missing, unknown_dev])
    assert out[good.uid].error == ""
    assert "has UID" in out[stale.uid].error and "re-created" in out[stale.uid].error
    assert "not allocated" in out[unalloc.uid].error
    assert "not found" in out[missing.uid].error
    assert "gpu-7 is not published" in out[unknown_dev.uid].error
    for bad in (stale, unalloc, missing, unknown_dev):
        assert whole.driver.checkpoint.get(bad.uid) is None
        assert not whole.driver.cdi.spec_path(bad.uid).exists()


def test_device_name_from_the_allocation_reaches_the_error_escaped(whole):
    """The allocation's device name is the claim's text: in the per-claim error it is one printable line, written
    with the same escapes as every other user-supplied text (``api.config.errors.printable``)."""
    forged = "gpu-9\nE0101 00:00:00 prepare succeeded \x1b[2K\u202egpu-0"
    ref = whole.add_claim("forged", [{"request": "gpu", "device": forged}])
    err = whole.driver.prepare([ref])[ref.uid].error
    assert err.isprintable(), err
    assert "device gpu-9\\nE0101 00:00:00 prepare succeeded \\x1b[2K\\u202egpu-0 is not published" in err, err


def test_results_of_other_drivers_and_pools_are_ignored(whole):
    ref = whole.add_claim("mixed", [
        {"request": "gpu", "device": "gpu-0"},
        {"request": "nic", "device": "eth0", "driver": "net.example.com"},
        {"request": "gpu", "device": "gpu-1", "pool": "other-node"},
    ])
    [dev] = ok(whole.driver, ref).devices
    assert dev.device_name == "gpu-0"


def test_device_is_not_handed_out_twice(whole):
    first = whole.add_claim("first", [{"request": "gpu", "device": "gpu-0"}])
    second = whole.add_claim("second", [{"request": "gpu", "device": "gpu-0"}])
    ok(whole.driver, first)
    err = whole.driver.prepare([second])[second.uid].error
    assert "already prepared for claim default/first" in err
    # Admin access watches a device in use: allowed.
    admin = whole.add_claim("admin", [{"request": "gpu", "device": "gpu-0", "adminAccess": True}])
    assert ok(whole.driver, admin).devices[0].device_name == "gpu-0"
    whole.driver.unprepare([first])
    assert whole.driver.prepare([second])[second.uid].error == ""


def test_admin_access_stays_watched_across_a_restart(whole):
    """An admin-access claim prepared before a plugin restart must still not block the claim that uses the device."""
    admin = whole.add_claim("admin", [{"request": "gpu", "device": "gpu-0", "adminAccess": True}])
    ok(whole.driver, admin)
    user = whole.add_claim("user", [{"request": "gpu", "device": "gpu-0"}])
    assert whole.restart().prepare([user])[user.uid].error == ""


def test_bad_config_fails_one_claim_only(whole):
    good = whole.add_claim("good", [{"request": "gpu", "device": "gpu-0"}],
                           [opaque(gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Long"}))])
    bad = whole.add_claim("bad", [{"request": "gpu", "device": "gpu-1"}],
                          [opaque(gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Forever"}))])
    typo = whole.add_claim("typo", [{"request": "gpu", "device": "gpu-1"}],
                           [opaque({**gpu_config(strategy="MPS"), "shareing": {}})])
    out = whole.driver.prepare([good, bad, typo])
    assert out[good.uid].error == ""
    assert "config[0].opaque.parameters.sharing.timeSlicing.interval" in out[bad.uid].error
    assert "Forever" in out[bad.uid].error
    assert "shareing: unknown field" in out[typo.uid].error
    assert whole.control.time_slices == {whole.uuids[0]: "Long"}
    assert whole.driver.checkpoint.get(bad.uid) is None


def test_claim_config_wins_over_class_config_and_specific_over_general(whole):
    ref = whole.add_claim("prec", [{"request": "a", "device": "gpu-0"}, {"request": "b", "device": "gpu-1"}], [
        opaque(gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Short"}), source="FromClass"),
        opaque(gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Medium"})),
        opaque(gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Long"}), requests=["b"]),
    ])
    ok(whole.driver, ref)
    assert whole.control.time_slices == {whole.uuids[0]: "Medium", whole.uuids[1]: "Long"}
    whole.driver.unprepare([ref])
    assert whole.control.time_slices == {whole.uuids[0]: "Default", whole.uuids[1]: "Default"}


def mps_env(node: Node, ref: ClaimRef) -> dict[str, str]:
    """The MPS client environment the claim's container gets (from its CDI spec)."""
    env = node.spec_of(ref)["devices"][0]["containerEdits"]["env"]
    return {k: v for k, _, v in (e.partition("=") for e in env) if k.startswith("CUDA_")}


def test_whole_gpu_mps_switches_compute_mode_and_back(whole):
    ref = whole.add_claim("mps", [{"request": "gpu", "device": "gpu-0"}],
                          [opaque(gpu_config(strategy="MPS", mps={"activeThreadPercentage": 30,
                                                                  "pinnedMemoryLimit": "10Gi"}))])
    ok(whole.driver, ref)
    assert whole.control.compute_mode(whole.uuids[0]) == "EXCLUSIVE_PROCESS"
    [daemon] = [d for d in whole.control.daemons.values() if d.alive]
    assert daemon.spec.visible_devices == (whole.uuids[0],)
    assert mps_env(whole, ref) == {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                   "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
                                   "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M"}
    whole.driver.unprepare([ref])
    assert not daemon.alive
    assert whole.control.compute_mode(whole.uuids[0]) == "DEFAULT"


def test_claims_prepare_in_parallel(tmp_path):
    node = Node(tmp_path, {"default": {"wholeGpu": True}}, gpus=[{"model": "L4", "count": 8}])
    refs = [node.add_claim(f"c{i}", [{"request": "gpu", "device": f"gpu-{i}"}]) for i in range(8)]
    seen = set()
    lock = threading.Lock()
    barrier = threading.Barrier(4, timeout=5)
    original = node.claims.get_claim

    def slow_get(ns, name, uid):
        with lock:
            seen.add(threading.get_ident())
        if name in ("c0", "c1", "c2", "c3"):
            barrier.wait()  # only passes if four claims are being prepared at the same time
        return original(ns, name, uid)

    node.claims.get_claim = slow_get
    out = node.driver.prepare(refs)
    assert all(r.error == "" for r in out.values()), out
    assert len(seen) >= 4
    assert node.metrics.prepared_claims._value.get() == 8


# --------------------------------------------------------------------------------------------------- dynamic MIG

@pytest.fixture
def dynamic(tmp_path):
    return Node(tmp_path, {"default": {"mig": "dynamic", "slots": {"count": 2, "strategy": "mps"}}})


def test_dynamic_mig_created_at_placement_and_destroyed(dynamic):
    assert dynamic.mig_devices() == []
    ref = dynamic.add_claim("mig", [{"request": "mig", "device": "gpu-0-mig-1g10gb-19-6"},
                                    {"request": "mig", "device": "gpu-0-mig-2g20gb-14-2"}])
    devices = ok(dynamic.driver, ref).devices
    live = dynamic.mig_devices()
    assert sorted((m.profile_id, m.start) for m in live) == [(14, 2), (19, 6)]
    record = dynamic.driver.checkpoint.get(ref.uid)
    assert {(m.device, m.mig_uuid) for m in record.undo.mig_devices} == {
        ("gpu-0-mig-1g10gb-19-6", next(m.uuid for m in live if m.start == 6)),
        ("gpu-0-mig-2g20gb-14-2", next(m.uuid for m in live if m.start == 2))}
    assert {d.uuid for d in record.devices} == {m.uuid for m in live}
    spec = dynamic.spec_of(ref)
    by_name = {d["name"]: d for d in spec["devices"]}
    one = by_name[f"{ref.uid}-gpu-0-mig-1g10gb-19-6"]["containerEdits"]
    paths = [n["path"] for n in one["deviceNodes"]]
    assert paths[0] == "/dev/nvidia0" and all(p.startswith("/dev/nvidia-caps/") for p in paths[1:]) and len(paths) == 3
    assert devices[0].cdi_device_ids == (f"{CDI_KIND}={ref.uid}-gpu-0-mig-1g10gb-19-6",)

    assert dynamic.driver.unprepare([ref])[ref.uid].error == ""
    assert dynamic.mig_devices() == []
    handle = dynamic.nvml.nvmlDeviceGetHandleByUUID(dynamic.uuids[0])
    assert not mig.mig_enabled(dynamic.nvml, handle)  # Hopper: switched back off with no MIG device left


def test_mig_with_mps_config_runs_daemon_on_mig_uuid(dynamic):
    ref = dynamic.add_claim("migmps", [{"request": "m", "device": "gpu-1-mig-3g40gb-9-4"}], [opaque({
        "apiVersion": "gpu.dra-driver.io/v1alpha1", "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 40}}})])
    ok(dynamic.driver, ref)
    [live] = dynamic.mig_devices(1)
    [daemon] = [d for d in dynamic.control.daemons.values() if d.alive]
    assert daemon.spec.visible_devices == (live.uuid,)
    assert mps_env(dynamic, ref)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert dynamic.control.compute_mode(dynamic.uuids[1]) == "DEFAULT"     # a MIG device has no compute mode
    dynamic.driver.unprepare([ref])
    assert not daemon.alive and dynamic.mig_devices(1) == []


def test_failure_midway_undoes_what_was_done(tmp_path):
    node = Node(tmp_path, {"default": {"mig": "dynamic", "slots": {"count": 2, "strategy": "time-slicing"}}},
                time_slice_unsupported=True)
    ref = node.add_claim("partial", [{"request": "m", "device": "gpu-0-mig-1g10gb-19-0"},
                                     {"request": "s", "device": "gpu-1-slot-0"}],
                         [opaque(gpu_config(strategy="TimeSlicing"), requests=["s"])])
    err = node.driver.prepare([ref])[ref.uid].error
    assert "not supported" in err
    assert node.mig_devices(0) == []          # the MIG device created first was destroyed again
    assert node.driver.checkpoint.get(ref.uid) is None
    assert not node.driver.cdi.spec_path(ref.uid).exists()
    assert node.metrics.prepare_errors.labels(reason="prepare_devices")._value.get() == 1


def test_restart_between_prepare_and_unprepare(dynamic):
    ref = dynamic.add_claim("survivor", [{"request": "mig", "device": "gpu-1-mig-1g20gb-15-4"},
                                         {"request": "slot", "device": "gpu-0-slot-1"}])
    before = ok(dynamic.driver, ref).devices
    [live] = dynamic.mig_devices(1)
    daemons = {k for k, d in dynamic.control.daemons.items() if d.alive}
    driver = dynamic.restart()
    assert dynamic.mig_devices(1) == [live]         # owned by a completed claim: kept at start-up
    assert ok(driver, ref).devices == before        # same answer from the new process
    dynamic.claims.delete(ref.namespace, ref.name)  # the claim may be gone by the time of unprepare
    assert driver.unprepare([ref])[ref.uid].error == ""
    assert dynamic.mig_devices(1) == []
    assert not any(dynamic.control.daemons[k].alive for k in daemons)
    assert not driver.cdi.spec_path(ref.uid).exists()


def test_dynamic_mig_outlives_the_plugin_process_on_persistent_hardware(tmp_path):
    node = Node(tmp_path, {"default": {"mig": "dynamic"}}, state_file=tmp_path / "gpus.json")
    ref = node.add_claim("kept", [{"request": "mig", "device": "gpu-1-mig-3g40gb-9-4"}])
    before = ok(node.driver, ref).devices
    [live] = node.mig_devices(1)
    assert node.metrics.dynamic_mig_devices._value.get() == 1
    driver = node.restart_process()
    assert node.mig_devices(1) == [live]            # read from the file by a new NVML: adopted, not destroyed
    assert node.startup.mig_destroyed == () and node.startup.rolled_back == ()
    assert node.metrics.dynamic_mig_devices._value.get() == 1
    assert ok(driver, ref).devices == before
    assert driver.unprepare([ref])[ref.uid].error == ""
    assert node.mig_devices(1) == []
    assert node.metrics.dynamic_mig_devices._value.get() == 0
    node.restart_process()
    assert node.mig_devices(1) == []                # the destroy reached the file too


def test_orphan_of_a_dead_process_is_destroyed_by_the_next(tmp_path):
    node = Node(tmp_path, {"default": {"mig": "dynamic"}}, state_file=tmp_path / "gpus.json")
    orphan = mig.create_mig_device(node.nvml, node.uuids[0], 19, 3)   # created, then the process died
    assert orphan.uuid
    node.restart_process()
    assert node.startup.mig_destroyed == (f"{node.uuids[0]}/gi{orphan.gi_id}/ci{orphan.ci_id}",)
    assert node.mig_devices(0) == []


def test_fault_hook_setting_is_checked():
    from kubeletplugin.driver import FAULT_ENV

    for value, step in (("", None), ("crash-after:mig-created", "mig-created"),
                        ("crash-after:cdi-written", "cdi-written")):
        assert crash_step_from_env_with(value) == step
    for bad in ("crash-after:nowhere", "mig-created", "crash:cdi-written"):
        with pytest.raises(ValueError, match=f"{FAULT_ENV}='{bad}'.*checkpoint-started"):
            crash_step_from_env_with(bad)


def crash_step_from_env_with(value: str):
    import os
    from unittest import mock

    from kubeletplugin.driver import FAULT_ENV, crash_step_from_env

    with mock.patch.dict(os.environ, {FAULT_ENV: value}):
        return crash_step_from_env()


def test_half_done_prepare_is_rolled_back_at_start(dynamic):
    # A crash after creating a MIG device and recording it, before PrepareCompleted.
    live = mig.create_mig_device(dynamic.nvml, dynamic.uuids[0], 19, 3)
    dynamic.driver.checkpoint.put(ClaimRecord(
        uid="crashed", namespace="default", name="crashed", state=PREPARE_STARTED,
        devices=(CheckpointDevice(device="gpu-0-mig-1g10gb-19-3", pool=NODE, requests=("m",)),),
        undo=UndoInfo(mig_devices=(MigUndo(device="gpu-0-mig-1g10gb-19-3", parent_uuid=dynamic.uuids[0],
                                           gi_id=live.gi_id, ci_id=live.ci_id, mig_uuid=live.uuid,
                                           profile_id=19, start=3),))))
    # And one created but never recorded (crash between creation and checkpoint write).
    orphan = mig.create_mig_device(dynamic.nvml, dynamic.uuids[1], 14, 0)
    report = dynamic.restart().checkpoint.claims()
    assert report == {}
    assert dynamic.mig_devices(0) == [] and dynamic.mig_devices(1) == []
    assert orphan.uuid != live.uuid


def test_half_done_prepare_is_rolled_back_before_retry(dynamic):
    ref = dynamic.add_claim("retry", [{"request": "m", "device": "gpu-0-mig-1g10gb-19-5"}])
    stale = mig.create_mig_device(dynamic.nvml, dynamic.uuids[0], 19, 5)
    dynamic.driver.checkpoint.put(ClaimRecord(
        uid=ref.uid, namespace=ref.namespace, name=ref.name, state=PREPARE_STARTED,
        undo=UndoInfo(mig_devices=(MigUndo(device="gpu-0-mig-1g10gb-19-5", parent_uuid=dynamic.uuids[0],
                                           gi_id=stale.gi_id, ci_id=stale.ci_id, mig_uuid=stale.uuid,
                                           profile_id=19, start=5),))))
    ok(dynamic.driver, ref)
    [live] = dynamic.mig_devices(0)
    assert live.start == 5 and live.uuid != stale.uuid   # the stale one was destroyed, a new one created


def test_static_mig_is_never_destroyed_at_start(tmp_path):
    node = Node(tmp_path, {"default": {"mig": "static"}},
                gpus=[{"model": "H100-80GB", "count": 1,
                       "mig": {"enabled": True, "instances": [{"profile": "3g.40gb", "start": 0}]}}])
    before = node.mig_devices()
    assert len(before) == 1
    node.restart()
    assert node.mig_devices() == before
    name = next(d.name for d in node.model.devices if d.kind == "mig")
    ref = node.add_claim("static", [{"request": "m", "device": name}])
    spec_dev = None
    ok(node.driver, ref)
    spec_dev = node.spec_of(ref)["devices"][0]
    assert f"NVIDIA_VISIBLE_DEVICES={before[0].uuid}" in spec_dev["containerEdits"]["env"]
    node.driver.unprepare([ref])
    assert node.mig_devices() == before          # static partitions survive unprepare


# --------------------------------------------------------------------------------------------------- slots and shares

def test_time_slicing_slots_share_interval_until_last_claim_leaves(tmp_path):
    node = Node(tmp_path, {"default": {"slots": {"count": 4, "strategy": "time-slicing"}}})
    cfg = [opaque(gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Long"}))]
    a = node.add_claim("a", [{"request": "s", "device": "gpu-0-slot-0"}], cfg)
    b = node.add_claim("b", [{"request": "s", "device": "gpu-0-slot-1"}], cfg)
    c = node.add_claim("c", [{"request": "s", "device": "gpu-0-slot-2"}],
                       [opaque(gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Short"}))])
    plain = node.add_claim("plain", [{"request": "s", "device": "gpu-0-slot-3"}])
    ok(node.driver, a)
    ok(node.driver, b)
    assert "interval Long" in node.driver.prepare([c])[c.uid].error
    ok(node.driver, plain)                               # no config: leaves the interval alone
    assert node.control.time_slices[node.uuids[0]] == "Long"
    node.driver.unprepare([a])
    assert node.control.time_slices[node.uuids[0]] == "Long"
    node.driver.unprepare([b])
    assert node.control.time_slices[node.uuids[0]] == "Default"
    mps = node.add_claim("wrong", [{"request": "s", "device": "gpu-0-slot-0"}],
                         [opaque(gpu_config(strategy="MPS"))])
    assert "MPS does not apply to a time-slicing slot" in node.driver.prepare([mps])[mps.uid].error


def test_mps_slots_of_one_gpu_share_one_daemon_each_with_its_own_limits(dynamic):
    ref = dynamic.add_claim("slot", [{"request": "s", "device": "gpu-1-slot-0"}])
    ok(dynamic.driver, ref)
    [daemon] = [d for d in dynamic.control.daemons.values() if d.alive]
    slot = dynamic.model.by_name()["gpu-1-slot-0"]
    assert mps_env(dynamic, ref)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert mps_env(dynamic, ref)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={slot.mps_memory_limit_mib}M"
    assert dynamic.control.compute_mode(dynamic.uuids[1]) == "EXCLUSIVE_PROCESS"   # only the MPS server holds it
    edits = dynamic.spec_of(ref)["devices"][0]["containerEdits"]
    mounted = {m["hostPath"] for m in edits["mounts"]}
    assert daemon.spec.pipe_dir in mounted and daemon.spec.shm_dir in mounted
    assert daemon.spec.log_dir not in mounted                              # the daemon's log stays private
    # A second claim on the other slot of the same GPU joins the same daemon, with its own limits.
    other = dynamic.add_claim("slot2", [{"request": "s", "device": "gpu-1-slot-1"}],
                              [opaque(gpu_config(strategy="MPS", mps={"activeThreadPercentage": 20}))])
    ok(dynamic.driver, other)
    assert [d for d in dynamic.control.daemons.values() if d.alive] == [daemon]
    assert mps_env(dynamic, other)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
    dynamic.driver.unprepare([ref])
    assert daemon.alive                                                     # still used by the other claim
    dynamic.driver.unprepare([other])
    assert not any(d.alive for d in dynamic.control.daemons.values())
    assert not Path(daemon.spec.pipe_dir).exists()
    assert dynamic.control.compute_mode(dynamic.uuids[1]) == "DEFAULT"


def test_memory_share_limit_is_consumed_capacity_and_share_id_returned(tmp_path):
    node = Node(tmp_path, {"default": {"memoryShares": {"minimum": "1Gi", "step": "1Gi", "strategy": "mps"}}})
    a = node.add_claim("a", [{"request": "mem", "device": "gpu-0-shared", "shareID": "s-1",
                              "consumedCapacity": {"memory": "8Gi"}}])
    b = node.add_claim("b", [{"request": "mem", "device": "gpu-0-shared", "shareID": "s-2",
                              "consumedCapacity": {"memory": "4Gi"}}])
    [da] = ok(node.driver, a).devices
    [db] = ok(node.driver, b).devices           # shared device: no double-allocation refusal
    assert (da.share_id, db.share_id) == ("s-1", "s-2")
    assert da.cdi_device_ids == (f"{CDI_KIND}={a.uid}-gpu-0-shared-s-1",)
    assert len([d for d in node.control.daemons.values() if d.alive]) == 1    # one daemon serves both shares
    assert mps_env(node, a)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"    # each share enforced on its own
    assert mps_env(node, b)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    too_big = node.add_claim("big", [{"request": "mem", "device": "gpu-0-shared", "shareID": "s-3",
                                      "consumedCapacity": {"memory": "2Gi"}}],
                             [opaque(gpu_config(strategy="MPS", mps={"pinnedMemoryLimit": "3Gi"}))])
    assert "exceeds the 2Gi" in node.driver.prepare([too_big])[too_big.uid].error


def test_dead_mps_daemon_is_restarted(dynamic):
    ref = dynamic.add_claim("mps", [{"request": "s", "device": "gpu-0-slot-0"}])
    ok(dynamic.driver, ref)
    [(pipe, daemon)] = [(k, d) for k, d in dynamic.control.daemons.items() if d.alive]
    dynamic.control.kill_mps_daemon(pipe)
    assert dynamic.driver.supervise_mps() == [dynamic.uuids[0]]
    assert dynamic.driver.mps.paths(dynamic.uuids[0]).pipe_dir == pipe
    again = dynamic.control.daemons[pipe]
    assert again.alive and again is not daemon and again.spec == daemon.spec


def test_whole_gpu_on_dynamic_mig_gpu_needs_mig_mode_off(dynamic):
    handle = dynamic.nvml.nvmlDeviceGetHandleByUUID(dynamic.uuids[0])
    dynamic.nvml.nvmlDeviceSetMigMode(handle, dynamic.nvml.NVML_DEVICE_MIG_ENABLE)   # left on, no MIG device: switched off
    whole = dynamic.add_claim("whole", [{"request": "g", "device": "gpu-0"}])
    ok(dynamic.driver, whole)
    assert not mig.mig_enabled(dynamic.nvml, handle)
    dynamic.driver.unprepare([whole])
    stray = mig.create_mig_device(dynamic.nvml, dynamic.uuids[0], 19, 0)   # someone else's MIG device
    err = dynamic.driver.prepare([whole])[whole.uid].error
    assert "in MIG mode with MIG devices present" in err
    assert stray.uuid in {m.uuid for m in dynamic.mig_devices(0)}          # not touched


def test_nvidia_configs_only_in_compat_mode():
    from kubeletplugin.plan import PlanError, plan_claim

    gpu = build_devices(discover(_l4_nvml()), parse_node_policy({}, "p"), driver="gpu.nvidia.com").by_name()
    claim = {"metadata": {"name": "c", "namespace": "ns", "uid": "u"}, "status": {"allocation": {"devices": {
        "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0"}],
        "config": [opaque({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                           "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 25}}},
                          driver="gpu.nvidia.com")]}}}}
    [plan] = plan_claim(claim, driver_name="gpu.nvidia.com", pool_name=NODE, devices=gpu, compat_nvidia=True)
    assert plan.mps is not None and plan.mps.thread_percentage == 25
    with pytest.raises(PlanError, match="compatibility mode"):
        plan_claim(claim, driver_name="gpu.nvidia.com", pool_name=NODE, devices=gpu, compat_nvidia=False)


def _l4_nvml():
    fleet = parse_fleet({"nodes": [{"name": NODE, "gpus": [{"model": "L4", "count": 1}]}]})
    nvml = nvml_for_node(fleet.node(NODE))
    nvml.nvmlInit()
    return nvml


# --------------------------------------------------------------------------------------------------- lost state

class Crash(BaseException):
    """The fault hook's exit, raised instead so the test run survives it (not an Exception: nothing catches it)."""


def armed(node: Node, monkeypatch, step: str) -> Driver:
    """A new plugin process on the node with GPU_DRA_FAULT=crash-after:<step>; reaching the step ends it like a
    SIGKILL: nothing after it runs, not even the undo of a failed prepare."""
    from kubeletplugin import driver as driver_module

    monkeypatch.setenv(driver_module.FAULT_ENV, f"crash-after:{step}")
    driver = node.restart()
    monkeypatch.delenv(driver_module.FAULT_ENV)

    def die(code: int) -> None:
        raise Crash(code)

    monkeypatch.setattr(driver_module.os, "_exit", die)
    monkeypatch.setattr(driver, "_undo_after_failure", lambda ref, log: None)
    return driver


def test_crash_after_a_time_slice_change_is_rolled_back_at_start(tmp_path, monkeypatch):
    node = Node(tmp_path, {"default": {"slots": {"count": 3, "strategy": "time-slicing"}}})
    long = [opaque(gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Long"}))]
    gpu0, gpu1 = node.uuids
    alone = node.add_claim("alone", [{"request": "s", "device": "gpu-0-slot-0"}], long)
    driver = armed(node, monkeypatch, "timeslice-applied")
    with pytest.raises(Crash):
        driver.prepare([alone])
    assert node.control.time_slices[gpu0] == "Long"               # applied, then the process died
    [intent] = driver.checkpoint.get(alone.uid).undo.time_slices  # recorded before it was applied
    assert (intent.interval, intent.previous) == ("Long", "Default")
    node.restart()
    assert node.startup.rolled_back == (alone.uid,)
    assert node.control.time_slices[gpu0] == "Default"            # back to the interval before the claim
    assert node.driver.checkpoint.claims() == {}

    # A claim joining a GPU another claim holds: its rollback must leave the holder's interval alone.
    holder = node.add_claim("holder", [{"request": "s", "device": "gpu-1-slot-0"}], long)
    ok(node.driver, holder)
    joiner = node.add_claim("joiner", [{"request": "s", "device": "gpu-1-slot-1"}], long)
    driver = armed(node, monkeypatch, "timeslice-applied")
    with pytest.raises(Crash):
        driver.prepare([joiner])
    node.restart()
    assert node.startup.rolled_back == (joiner.uid,)
    assert node.control.time_slices[gpu1] == "Long"

    # The kubelet's retries prepare both from scratch; the GPUs return to Default when the last holder leaves.
    ok(node.driver, alone)
    ok(node.driver, joiner)
    node.driver.unprepare([alone, joiner])
    assert node.control.time_slices == {gpu0: "Default", gpu1: "Long"}
    node.driver.unprepare([holder])
    assert node.control.time_slices == {gpu0: "Default", gpu1: "Default"}


def lose_checkpoint(node: Node, how: str, uid: str) -> None:
    node.driver.close()                       # the plugin stops (its journal folded into the snapshot), then the damage
    path = node.state / "checkpoint.json"
    if how == "torn file":
        path.write_bytes(path.read_bytes()[:40])
    else:  # the claim's own record cannot be read; the rest of the file can
        doc = json.loads(path.read_text())
        doc["claims"][uid]["state"] = "SomethingNewer"
        path.write_text(json.dumps(doc))


@pytest.mark.parametrize("how", ["torn file", "one record"])
def test_lost_checkpoint_destroys_nothing_and_adopts_claims_from_their_cdi_specs(tmp_path, how):
    from structlog.testing import capture_logs

    node = Node(tmp_path, {"default": {"mig": "dynamic"}}, state_file=tmp_path / "gpus.json")
    in_use = node.add_claim("in-use", [{"request": "mig", "device": "gpu-1-mig-3g40gb-9-4"},
                                       {"request": "gpu", "device": "gpu-0"}])
    before = ok(node.driver, in_use).devices
    [live] = node.mig_devices(1)
    spec_file = node.driver.cdi.spec_path(in_use.uid)
    stray = mig.create_mig_device(node.nvml, node.uuids[1], 19, 0)    # nobody's: normally destroyed at start
    lose_checkpoint(node, how, in_use.uid)

    with capture_logs() as logs:
        driver = node.restart_process()
    report = node.startup
    assert report.conservative and report.mig_destroyed == () and report.cdi_removed == ()
    assert sorted(m.uuid for m in node.mig_devices(1)) == sorted([live.uuid, stray.uuid])   # both kept
    assert spec_file.exists()
    assert report.adopted_from_cdi == (in_use.uid,)
    lines = [e for e in logs if "prepared-claim state was lost" in e["event"]]
    assert len(lines) == 1 and lines[0]["log_level"] == "warning", logs
    assert "destroys no MIG device and deletes no CDI spec" in lines[0]["event"]
    assert lines[0]["adopted_claims"] == [in_use.uid]
    assert lines[0]["unowned_mig_kept"] == [f"{node.uuids[1]}/gi{stray.gi_id}/ci{stray.ci_id}"]
    record = driver.checkpoint.get(in_use.uid)
    assert record.completed and record.recovered
    assert [(m.mig_uuid, m.gi_id) for m in record.undo.mig_devices] == [(live.uuid, live.gi_id)]

    # Its devices stay booked: another claim cannot have them.
    thief = node.add_claim("thief", [{"request": "gpu", "device": "gpu-0"}])
    assert f"already prepared for claim with UID {in_use.uid}" in driver.prepare([thief])[thief.uid].error
    # A repeated prepare gets the same answer as before the loss (request names come from the claim).
    assert ok(driver, in_use).devices == before
    assert not driver.checkpoint.get(in_use.uid).recovered
    # Unprepare undoes it all, and the placement can be prepared again.
    assert driver.unprepare([in_use])[in_use.uid].error == ""
    assert [m.uuid for m in node.mig_devices(1)] == [stray.uuid] and not spec_file.exists()
    again = node.add_claim("again", [{"request": "mig", "device": "gpu-1-mig-3g40gb-9-4"}])
    ok(driver, again)
    assert driver.unprepare([again])[again.uid].error == ""
    # Conservative for that one start only: the next start cleans up as usual.
    node.restart_process()
    assert not node.startup.conservative
    assert node.startup.mig_destroyed == (f"{node.uuids[1]}/gi{stray.gi_id}/ci{stray.ci_id}",)
    assert node.mig_devices(1) == []


def test_adopted_claim_whose_allocation_differs_is_refused_not_redone(tmp_path):
    node = Node(tmp_path, {"default": {"wholeGpu": True}})
    ref = node.add_claim("c", [{"request": "gpu", "device": "gpu-1"}])
    ok(node.driver, ref)
    lose_checkpoint(node, "torn file", ref.uid)
    driver = node.restart()
    assert node.startup.adopted_from_cdi == (ref.uid,)
    node.add_claim("c", [{"request": "gpu", "device": "gpu-0"}], uid=ref.uid)   # not what the spec says
    err = driver.prepare([ref])[ref.uid].error
    assert "adopted from its CDI spec" in err and "gpu-1" in err and "gpu-0" in err
    assert driver.cdi.spec_path(ref.uid).exists()
    assert driver.unprepare([ref])[ref.uid].error == ""
    assert not driver.cdi.spec_path(ref.uid).exists()


def test_cdi_device_names_split_into_device_and_share():
    from kubeletplugin.recovery import split_cdi_device_name

    def catalog(policy: dict) -> dict:
        return build_devices(discover(_l4_nvml()), parse_node_policy({"default": policy}, "p"), driver=DRIVER).by_name()

    shared = {**catalog({"wholeGpu": True, "slots": {"count": 2}}),
              **catalog({"memoryShares": {"minimum": "1Gi", "step": "1Gi"}})}
    assert {"gpu-0", "gpu-0-slot-1", "gpu-0-shared"} <= set(shared)
    assert split_cdi_device_name("u-1", "u-1-gpu-0", shared) == ("gpu-0", None)
    assert split_cdi_device_name("u-1", "u-1-gpu-0-slot-1", shared) == ("gpu-0-slot-1", None)
    assert split_cdi_device_name("u-1", "u-1-gpu-0-shared-s-7", shared) == ("gpu-0-shared", "s-7")
    assert split_cdi_device_name("u-1", "u-1-gpu-9", shared) == ("gpu-9", None)     # no longer published
    with pytest.raises(ValueError, match="claim UID"):
        split_cdi_device_name("u-1", "u-2-gpu-0", shared)


# --- failure paths --------------------------------------------------------------------------------------------------
# Prepare/unprepare failure paths the driver handles but that the main driver tests do not reach: claims
# that hold nothing of this node's, undo steps that fail and resume, start-up cleanup of CDI specs, NVML
# errors and MIG overlaps met during a prepare, and an unexpected exception inside one claim.
# 
# Faults are injected where they would arise: NVML calls of the simulated GPUs answer with pynvml's error
# codes (a process holding a MIG device makes ``nvmlComputeInstanceDestroy`` answer IN_USE), and the node's
# CDI writer raises for one claim only.

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


def test_slot_capacity_shares_get_their_slots_worth_of_mps_limits(tmp_path):
    node = Node(tmp_path, {"default": {"slots": {"count": 4, "strategy": "mps", "layout": "capacity"}}})
    slots = node.model.by_name()["gpu-0-slots"]
    one = node.add_claim("one", [{"request": "s", "device": "gpu-0-slots", "shareID": "s-1",
                                  "consumedCapacity": {"slots": "1"}}])
    two = node.add_claim("two", [{"request": "s", "device": "gpu-0-slots", "shareID": "s-2",
                                  "consumedCapacity": {"slots": "2"}}])
    [d1] = ok(node.driver, one).devices
    ok(node.driver, two)
    assert d1.cdi_device_ids == (f"{CDI_KIND}={one.uid}-gpu-0-slots-s-1",)
    assert len([d for d in node.control.daemons.values() if d.alive]) == 1      # one daemon for the GPU's shares
    assert mps_env(node, one)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert mps_env(node, one)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={slots.mps_memory_limit_mib}M"
    assert mps_env(node, two)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert mps_env(node, two)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={2 * slots.mps_memory_limit_mib}M"
    # A config may lower a share's limits but not raise them above its slots.
    greedy = node.add_claim("greedy", [{"request": "s", "device": "gpu-0-slots", "shareID": "s-3",
                                        "consumedCapacity": {"slots": "1"}}],
                            [opaque(gpu_config(strategy="MPS", mps={"activeThreadPercentage": 40}))])
    assert "exceeds the slot's share of 25 % (one of 4 slots" in node.driver.prepare([greedy])[greedy.uid].error
    node.driver.unprepare([one])
    assert any(d.alive for d in node.control.daemons.values())
    node.driver.unprepare([two])
    assert not any(d.alive for d in node.control.daemons.values())


@pytest.mark.parametrize("consumed, words", [({}, "no consumedCapacity for slots"),
                                             ({"slots": "5"}, "from 1 to 4"),
                                             ({"slots": "two"}, "not a quantity")])
def test_slot_capacity_share_without_a_valid_slot_count_is_refused(tmp_path, consumed, words):
    node = Node(tmp_path, {"default": {"slots": {"count": 4, "strategy": "time-slicing", "layout": "capacity"}}})
    ref = node.add_claim("c", [{"request": "s", "device": "gpu-0-slots", "shareID": "s-1",
                                "consumedCapacity": consumed}])
    error = node.driver.prepare([ref])[ref.uid].error
    assert words in error and "gpu-0-slots" in error


# ------------------------------------------------------------------------------------- one MIG profile as capacity

MIG_CAPACITY = {"default": {"mig": "dynamic", "dynamicMig": {"profiles": ["1g.10gb"], "layout": "capacity"},
                            "slots": {"count": 4, "strategy": "time-slicing", "layout": "capacity"}}}
ONE_G = "gpu-0-mig-1g10gb-19"


def mig_share(share: str, instances: str | None = "1") -> dict[str, Any]:
    consumed = {"instances": instances} if instances is not None else {}
    return {"request": "m", "device": ONE_G, "shareID": share, "consumedCapacity": consumed}


def test_mig_capacity_shares_get_free_placements_highest_first_and_exactly_their_mig_devices(tmp_path):
    node = Node(tmp_path, MIG_CAPACITY)
    one = node.add_claim("one", [mig_share("s-1")])
    three = node.add_claim("three", [mig_share("s-2", "3")])
    [d1] = ok(node.driver, one).devices
    assert d1.cdi_device_ids == (f"{CDI_KIND}={one.uid}-{ONE_G}-s-1",)
    assert [m.start for m in node.mig_devices(0)] == [6]
    ok(node.driver, three)
    live = {m.start: m for m in node.mig_devices(0)}
    assert sorted(live) == [3, 4, 5, 6]
    record = node.driver.checkpoint.get(three.uid)
    assert sorted((m.device, m.share_id, m.start) for m in record.undo.mig_devices) == [
        (ONE_G, "s-2", 3), (ONE_G, "s-2", 4), (ONE_G, "s-2", 5)]
    # One CDI device for the share: the GPU's node plus the caps of exactly its three MIG devices.
    [spec_device] = node.spec_of(three)["devices"]
    edits = spec_device["containerEdits"]
    assert f"NVIDIA_VISIBLE_DEVICES={','.join(live[s].uuid for s in (5, 4, 3))}" in edits["env"]
    paths = [n["path"] for n in edits["deviceNodes"]]
    assert paths[0] == "/dev/nvidia0" and len(paths) == 1 + 3 * 2
    from kubeletplugin.claimstatus import status_devices
    [status] = status_devices(record, node.model.by_name(), NODE)
    assert status.share_id == "s-2" and [m["placementStart"] for m in status.data["migDevices"]] == [5, 4, 3]
    assert {m["uuid"] for m in status.data["migDevices"]} == {live[s].uuid for s in (3, 4, 5)}
    # Unprepare destroys exactly the share's MIG devices; the other share's stays.
    assert node.driver.unprepare([three])[three.uid].error == ""
    assert [m.start for m in node.mig_devices(0)] == [6]
    again = node.add_claim("again", [mig_share("s-3", "2")])
    ok(node.driver, again)
    assert sorted(m.start for m in node.mig_devices(0)) == [4, 5, 6]
    node.driver.unprepare([one, again])
    assert node.mig_devices(0) == []


def test_mig_capacity_share_that_finds_no_free_placement_is_a_clear_claim_error(tmp_path):
    node = Node(tmp_path, MIG_CAPACITY)
    big = node.add_claim("big", [mig_share("s-1", "6")])
    ok(node.driver, big)
    over = node.add_claim("over", [mig_share("s-2", "2")])      # the scheduler would never allow this
    error = node.driver.prepare([over])[over.uid].error
    assert f"device {ONE_G} (request 'm'): no free placement for the share of 2 instance(s)" in error
    assert "1g.10gb: 2 more instance(s) do not fit next to the 6" in error and "free placements: 0" in error
    assert len(node.mig_devices(0)) == 6 and node.driver.checkpoint.get(over.uid) is None


@pytest.mark.parametrize("consumed, words", [(None, "no consumedCapacity for instances"),
                                             ("8", "from 1 to 7"), ("two", "not a quantity")])
def test_mig_capacity_share_without_a_valid_instance_count_is_refused(tmp_path, consumed, words):
    node = Node(tmp_path, MIG_CAPACITY)
    ref = node.add_claim("c", [mig_share("s-1", consumed)])
    error = node.driver.prepare([ref])[ref.uid].error
    assert words in error and ONE_G in error and node.mig_devices(0) == []


def test_mig_capacity_shares_survive_a_restart_and_a_lost_checkpoint(tmp_path):
    node = Node(tmp_path, MIG_CAPACITY, state_file=tmp_path / "gpus.json")
    two = node.add_claim("two", [mig_share("s-1", "2")])
    one = node.add_claim("one", [mig_share("s-2", "1")])
    before = ok(node.driver, two).devices
    ok(node.driver, one)
    owned = {m.uuid for m in node.mig_devices(0)}
    driver = node.restart()
    assert {m.uuid for m in node.mig_devices(0)} == owned and ok(driver, two).devices == before
    lose_checkpoint(node, "torn file", two.uid)
    driver = node.restart_process()
    assert set(node.startup.adopted_from_cdi) == {two.uid, one.uid}
    record = driver.checkpoint.get(two.uid)
    assert sorted(m.start for m in record.undo.mig_devices) == [5, 6]
    assert {m.share_id for m in record.undo.mig_devices} == {"s-1"}
    assert [m.start for m in driver.checkpoint.get(one.uid).undo.mig_devices] == [4]
    assert driver.unprepare([two])[two.uid].error == ""
    assert [m.start for m in node.mig_devices(0)] == [4]
    assert driver.unprepare([one])[one.uid].error == ""
    assert node.mig_devices(0) == []


def test_mig_capacity_share_with_mps_takes_one_instance(tmp_path):
    node = Node(tmp_path, MIG_CAPACITY)
    mps = opaque({"apiVersion": "gpu.dra-driver.io/v1alpha1", "kind": "MigDeviceConfig",
                  "sharing": {"strategy": "MPS"}})
    ref = node.add_claim("c", [mig_share("s-1", "2")], [mps])
    assert "MPS serves one MIG device per daemon; a share of 2 instances" in node.driver.prepare([ref])[ref.uid].error
    single = node.add_claim("single", [mig_share("s-2", "1")], [mps])
    ok(node.driver, single)
    [live] = node.mig_devices(0)
    [daemon] = [d for d in node.control.daemons.values() if d.alive]
    assert daemon.spec.visible_devices == (live.uuid,)
    node.driver.unprepare([single])
