"""Checkpoint store: round trip, tolerance, corruption, reboot detection, concurrency."""
from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest

from dra.node.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    SCHEMA_VERSION,
    CheckpointStore,
    ClaimRecord,
    MigUndo,
    MpsUndo,
    PreparedDevice,
    TimeSliceUndo,
    UndoInfo,
)
from dra.node.migdevices import MigLive
from dra.node.sharing import MpsDaemon

BOOT_A = "7c1f3a52-0a4e-4b55-9f43-2d1f3e6b9a01"
BOOT_B = "e2b1d9c4-5f6a-4c3b-8e7d-1a2b3c4d5e6f"


@pytest.fixture
def boot_file(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text(BOOT_A + "\n")
    return path


def store_at(tmp_path: Path, boot_file: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "state" / "checkpoint.json", boot_id_path=boot_file,
                           clock=lambda: 1_700_000_000.0)


def full_record(uid: str = "uid-1") -> ClaimRecord:
    return ClaimRecord(
        uid=uid, namespace="team-a", name="train", state=PREPARE_COMPLETED,
        devices=(PreparedDevice(device="gpu-0-mig-1g10gb-19-0", pool="node-1", requests=("mig",),
                                cdi_device_ids=(f"k8s.gpu.dra-driver.io/claim={uid}-gpu-0-mig-1g10gb-19-0",),
                                uuid="MIG-1234"),
                 PreparedDevice(device="gpu-1-shared", pool="node-1", requests=("mem",), share_id="ab12")),
        undo=UndoInfo(
            mig_devices=(MigUndo(device="gpu-0-mig-1g10gb-19-0", parent_uuid="GPU-0", gi_id=7, ci_id=0,
                                 mig_uuid="MIG-1234", profile_id=19, start=0),),
            time_slices=(TimeSliceUndo(gpu_uuids=("GPU-1",), interval="Long", previous="Default"),),
            mps_daemons=(MpsUndo(daemon_id=f"{uid}-abc", gpu_uuids=("GPU-1",), pipe_dir="/s/pipe", log_dir="/s/log",
                                 shm_dir="/s/shm", compute_mode_set=("GPU-1",), active_thread_percentage=50,
                                 pinned_memory_limit_mib={"GPU-1": 4096}),),
        ),
    )


def test_round_trip_and_camel_case_on_disk(tmp_path, boot_file):
    store = store_at(tmp_path, boot_file)
    assert store.load().claims == 0
    store.put(full_record())
    reopened = store_at(tmp_path, boot_file)
    result = reopened.load()
    assert result.claims == 1 and result.dropped_claims == () and result.corrupt_file is None
    assert reopened.get("uid-1") == full_record().model_copy(update={"updated": 1_700_000_000.0})
    raw = json.loads(store.path.read_text())
    assert raw["schemaVersion"] == SCHEMA_VERSION
    assert raw["nodeBootId"] == BOOT_A
    claim = raw["claims"]["uid-1"]
    assert claim["state"] == "PrepareCompleted"
    assert claim["undo"]["migDevices"][0]["giId"] == 7
    assert claim["devices"][0]["cdiDeviceIds"] == ["k8s.gpu.dra-driver.io/claim=uid-1-gpu-0-mig-1g10gb-19-0"]
    assert oct(store.path.stat().st_mode & 0o777) == oct(0o600)


def test_missing_file_starts_empty_and_creates_it(tmp_path, boot_file):
    store = store_at(tmp_path, boot_file)
    assert store.load().claims == 0
    assert store.path.exists()
    assert store.claims() == {}


def test_unknown_fields_are_tolerated(tmp_path, boot_file):
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(full_record())
    raw = json.loads(store.path.read_text())
    raw["futureTopLevel"] = {"x": 1}
    raw["claims"]["uid-1"]["futureField"] = [1, 2]
    raw["claims"]["uid-1"]["devices"][0]["metadata"] = {"k": "v"}
    raw["schemaVersion"] = SCHEMA_VERSION + 1
    store.path.write_text(json.dumps(raw))
    reopened = store_at(tmp_path, boot_file)
    assert reopened.load().claims == 1
    assert reopened.get("uid-1").devices[0].uuid == "MIG-1234"
    # Rewritten in this version's schema.
    assert json.loads(store.path.read_text())["schemaVersion"] == SCHEMA_VERSION


@pytest.mark.parametrize("content", [b"{not json", b"", b"\xff\xfe\x00", b"[1, 2]", b'{"claims": {}}',
                                     b'{"schemaVersion": "one"}'])
def test_corrupt_file_is_moved_aside_with_one_log_line(tmp_path, boot_file, caplog, content):
    store = store_at(tmp_path, boot_file)
    store.path.parent.mkdir(parents=True)
    store.path.write_bytes(content)
    with caplog.at_level(logging.ERROR, logger="dra.node.checkpoint"):
        result = store.load()
    assert result.claims == 0
    assert result.corrupt_file is not None and result.corrupt_file.name.startswith("checkpoint.json.corrupt-")
    assert result.corrupt_file.read_bytes() == content
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "moved it to" in errors[0].getMessage()
    # A fresh, valid file replaces it and further writes work.
    store.put(full_record())
    assert store_at(tmp_path, boot_file).load().claims == 1


def test_second_corruption_in_same_second_gets_distinct_name(tmp_path, boot_file):
    for _ in range(2):
        store = store_at(tmp_path, boot_file)
        store.path.parent.mkdir(parents=True, exist_ok=True)
        store.path.write_text("garbage")
        store.load()
    assert len(list(store.path.parent.glob("checkpoint.json.corrupt-*"))) == 2


def test_one_unreadable_claim_does_not_cost_the_others(tmp_path, boot_file):
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(full_record("good"))
    store.put(full_record("bad"))
    raw = json.loads(store.path.read_text())
    raw["claims"]["bad"]["state"] = "SomethingNew"
    store.path.write_text(json.dumps(raw))
    reopened = store_at(tmp_path, boot_file)
    result = reopened.load()
    assert result.unreadable_claims == ("bad",)
    assert set(reopened.claims()) == {"good"}


def test_reboot_drops_stale_claims_and_reports_them(tmp_path, boot_file, caplog):
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(full_record("a"))
    store.put(full_record("b").model_copy(update={"state": PREPARE_STARTED}))
    boot_file.write_text(BOOT_B)
    reopened = store_at(tmp_path, boot_file)
    with caplog.at_level(logging.WARNING, logger="dra.node.checkpoint"):
        result = reopened.load()
    assert [c.uid for c in result.dropped_claims] == ["a", "b"]
    assert result.dropped_claims[0].undo.mig_devices[0].gi_id == 7
    assert reopened.claims() == {}
    assert any("rebooted" in r.getMessage() for r in caplog.records)
    assert json.loads(reopened.path.read_text())["nodeBootId"] == BOOT_B
    assert store_at(tmp_path, boot_file).load().dropped_claims == ()


def test_legacy_file_without_boot_id_is_kept_and_stamped(tmp_path, boot_file):
    path = tmp_path / "state" / "checkpoint.json"
    path.parent.mkdir(parents=True)
    record = full_record().model_dump(mode="json", by_alias=True)
    path.write_text(json.dumps({"schemaVersion": 1, "claims": {"uid-1": record}}))
    store = store_at(tmp_path, boot_file)
    result = store.load()
    assert result.claims == 1 and result.boot_id_stamped
    assert json.loads(path.read_text())["nodeBootId"] == BOOT_A


def test_unreadable_boot_id_disables_reboot_check(tmp_path, boot_file):
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(full_record())
    missing = CheckpointStore(store.path, boot_id_path=tmp_path / "nope")
    assert missing.load().claims == 1


def test_update_remove_and_idempotence(tmp_path, boot_file):
    store = store_at(tmp_path, boot_file)
    store.load()
    started = ClaimRecord(uid="u", namespace="ns", name="c", state=PREPARE_STARTED)
    store.put(started)
    mig = MigUndo(device="d", parent_uuid="GPU-0", gi_id=1, ci_id=0, profile_id=9, start=4)
    store.update("u", lambda r: r.model_copy(update={"undo": r.undo.model_copy(update={"mig_devices": (mig,)})}))
    store.update("u", lambda r: r.model_copy(update={"state": PREPARE_COMPLETED}))
    reread = store_at(tmp_path, boot_file)
    reread.load()
    assert reread.get("u").completed and reread.get("u").undo.mig_devices == (mig,)
    assert store.remove("u") is True
    assert store.remove("u") is False
    with pytest.raises(KeyError, match="not in the checkpoint"):
        store.update("u", lambda r: r)


def test_failed_write_keeps_memory_equal_to_disk(tmp_path, boot_file, monkeypatch):
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(full_record("keep"))

    def boom(src, dst):
        raise OSError("read-only file system")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        store.put(full_record("lost"))
    with pytest.raises(OSError):
        store.remove("keep")
    monkeypatch.undo()
    assert set(store.claims()) == {"keep"}
    assert [p.name for p in store.path.parent.iterdir()] == ["checkpoint.json"]


def test_writes_before_load_are_refused(tmp_path, boot_file):
    with pytest.raises(RuntimeError, match="load"):
        store_at(tmp_path, boot_file).put(full_record())


def test_records_are_immutable():
    record = full_record()
    with pytest.raises(Exception):
        record.state = PREPARE_STARTED  # type: ignore[misc]


def test_parallel_puts_lose_nothing(tmp_path, boot_file):
    store = store_at(tmp_path, boot_file)
    store.load()

    def worker(k: int) -> None:
        for i in range(10):
            uid = f"claim-{k}-{i}"
            store.put(ClaimRecord(uid=uid, state=PREPARE_STARTED))
            store.update(uid, lambda r: r.model_copy(update={"state": PREPARE_COMPLETED}))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reread = store_at(tmp_path, boot_file)
    reread.load()
    claims = reread.claims()
    assert len(claims) == 60 and all(c.completed for c in claims.values())


def test_mps_daemon_converts_to_and_from_its_undo_record():
    daemon = MpsDaemon(daemon_id="c-1234", claim_uid="c", gpu_uuids=("MIG-9",), pipe_dir="/p", log_dir="/l",
                       shm_dir="/s", compute_mode_set=(), active_thread_percentage=20,
                       pinned_memory_limit_mib={"MIG-9": 512})
    assert MpsDaemon.from_undo("c", daemon.undo()) == daemon
