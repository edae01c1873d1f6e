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
    CheckpointTooNew,
    CheckpointUnusable,
    ClaimRecord,
    DeviceHeld,
    MigUndo,
    MpsUse,
    PreparedDevice,
    TimeSliceUndo,
    UndoInfo,
)

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
            mps_devices=(MpsUse(device="GPU-1", gpu="GPU-1"),),
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
    store.compact()
    raw = json.loads(store.path.read_text())
    raw["futureTopLevel"] = {"x": 1}
    raw["claims"]["uid-1"]["futureField"] = [1, 2]
    raw["claims"]["uid-1"]["devices"][0]["metadata"] = {"k": "v"}
    store.path.write_text(json.dumps(raw))
    reopened = store_at(tmp_path, boot_file)
    assert reopened.load().claims == 1
    assert reopened.get("uid-1").devices[0].uuid == "MIG-1234"
    assert json.loads(store.path.read_text())["schemaVersion"] == SCHEMA_VERSION


@pytest.mark.parametrize("where", ["snapshot", "journal"])
def test_a_newer_plugins_checkpoint_is_refused_and_left_untouched(tmp_path, boot_file, where):
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(full_record())
    if where == "snapshot":
        store.compact()
        raw = json.loads(store.path.read_text())
        raw["schemaVersion"] = SCHEMA_VERSION + 1
        store.path.write_text(json.dumps(raw))
    else:
        with open(store.journal_path, "a") as journal:
            journal.write(json.dumps({"schemaVersion": SCHEMA_VERSION + 1}) + "\n")
    before = {p.name: p.read_bytes() for p in store.path.parent.iterdir()}
    with pytest.raises(CheckpointTooNew, match="newer plugin"):
        store_at(tmp_path, boot_file).load()
    assert {p.name: p.read_bytes() for p in store.path.parent.iterdir()} == before


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
    store.compact()
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


@pytest.mark.parametrize("failing", ["write", "fsync"])
def test_failed_write_keeps_memory_equal_to_disk(tmp_path, boot_file, monkeypatch, failing):
    if failing == "fsync":
        boot_file = tmp_path / "no-boot-id"      # only then are appends fsync'd
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(full_record("keep"))

    def boom(*args):
        raise OSError("read-only file system")

    monkeypatch.setattr(os, failing, boom)
    with pytest.raises(OSError):
        store.put(full_record("lost"))
    with pytest.raises(OSError):
        store.remove("keep")
    monkeypatch.undo()
    assert set(store.claims()) == {"keep"}
    reread = store_at(tmp_path, boot_file)
    reread.load()
    assert set(reread.claims()) == {"keep"}
    assert sorted(p.name for p in store.path.parent.iterdir()) == ["checkpoint.json", "checkpoint.json.journal"]


def test_appends_are_fsynced_only_without_a_boot_id(tmp_path, boot_file, monkeypatch):
    """A lost page cache is a reboot, which voids every record of the earlier boot: with a boot ID a change needs
    no fsync; without one nothing would tell the earlier boot's records apart, so changes are made durable."""
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    with_boot = store_at(tmp_path / "a", boot_file)
    with_boot.load()
    synced.clear()
    with_boot.put(full_record("u1"))
    with_boot.remove("u1")
    assert synced == []
    without = store_at(tmp_path / "b", tmp_path / "no-boot-id")
    without.load()
    synced.clear()
    without.put(full_record("u2"))
    without.remove("u2")
    assert len(synced) == 2


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


# ----- journal -----------------------------------------------------------------------------------------------
def test_changes_are_appended_not_rewritten(tmp_path, boot_file):
    store = store_at(tmp_path, boot_file)
    store.load()
    snapshot = store.path.read_bytes()
    store.put(full_record("a"))
    store.update("a", lambda r: r.model_copy(update={"state": PREPARE_STARTED}))
    store.remove("a")
    assert store.path.read_bytes() == snapshot          # the snapshot is not touched by a change
    lines = store.journal_path.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1]) == {"remove": "a"}
    reread = store_at(tmp_path, boot_file)
    reread.load()
    assert reread.claims() == {}


def test_a_torn_last_line_is_a_change_that_never_happened(tmp_path, boot_file, caplog):
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(full_record("a"))
    with open(store.journal_path, "ab") as journal:
        journal.write(b'{"put": {"uid": "b", "sta')          # the crash came in the middle of the append
    reread = store_at(tmp_path, boot_file)
    with caplog.at_level(logging.WARNING, logger="dra.node.checkpoint"):
        result = reread.load()
    assert set(reread.claims()) == {"a"} and not result.state_lost
    assert any("partly written" in r.getMessage() for r in caplog.records)


def test_a_corrupt_journal_line_sets_the_journal_aside_and_says_state_was_lost(tmp_path, boot_file):
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(full_record("a"))
    with open(store.journal_path, "ab") as journal:
        journal.write(b"garbage\n")
        journal.write(json.dumps({"remove": "a"}).encode() + b"\n")
    result = store_at(tmp_path, boot_file).load()
    assert result.state_lost and result.corrupt_file.name.startswith("checkpoint.json.journal.corrupt-")


def test_replaying_the_journal_over_a_newer_snapshot_changes_nothing(tmp_path, boot_file):
    """A crash after the snapshot was written and before the journal was emptied."""
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(full_record("a"))
    store.put(full_record("b"))
    store.remove("b")
    journal = store.journal_path.read_bytes()
    store.compact()
    store.journal_path.write_bytes(journal)
    reread = store_at(tmp_path, boot_file)
    reread.load()
    assert set(reread.claims()) == {"a"}


def test_a_large_journal_is_folded_into_the_snapshot(tmp_path, boot_file):
    store = CheckpointStore(tmp_path / "state" / "checkpoint.json", boot_id_path=boot_file, compact_bytes=8192)
    store.load()
    for i in range(40):
        store.put(full_record(f"c{i}"))
    assert store.journal_path.stat().st_size <= 8192 + 4096
    assert len(json.loads(store.path.read_text())["claims"]) >= 30
    reread = store_at(tmp_path, boot_file)
    reread.load()
    assert len(reread.claims()) == 40


def test_a_record_under_another_claims_key_is_unreadable(tmp_path, boot_file):
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(full_record("real"))
    store.compact()
    raw = json.loads(store.path.read_text())
    raw["claims"]["real"]["uid"] = "other"
    store.path.write_text(json.dumps(raw))
    reread = store_at(tmp_path, boot_file)
    result = reread.load()
    assert result.unreadable_claims == ("real",) and result.state_lost
    assert reread.claims() == {}


def test_a_directory_in_place_of_the_checkpoint_is_set_aside(tmp_path, boot_file):
    store = store_at(tmp_path, boot_file)
    store.path.mkdir(parents=True)
    result = store.load()
    assert result.corrupt and result.corrupt_file.is_dir()
    store.put(full_record())
    assert store_at(tmp_path, boot_file).load().claims == 1


def test_an_unreadable_checkpoint_that_cannot_be_moved_is_a_clear_error(tmp_path, boot_file, monkeypatch):
    store = store_at(tmp_path, boot_file)
    store.path.mkdir(parents=True)
    monkeypatch.setattr(Path, "rename", lambda self, target: (_ for _ in ()).throw(PermissionError("denied")))
    with pytest.raises(CheckpointUnusable, match="cannot be moved aside"):
        store.load()


def test_booking_refuses_a_device_another_claim_holds(tmp_path, boot_file):
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(full_record("a"), exclusive=[("node-1", "gpu-0-mig-1g10gb-19-0")])
    with pytest.raises(DeviceHeld, match="already prepared for claim team-a/train"):
        store.put(ClaimRecord(uid="b", state=PREPARE_STARTED), exclusive=[("node-1", "gpu-0-mig-1g10gb-19-0")])
    assert store.get("b") is None
    store.put(full_record("a"), exclusive=[("node-1", "gpu-0-mig-1g10gb-19-0")])   # its own device: fine
    assert store.holders("node-1", "gpu-0-mig-1g10gb-19-0") == {"a"}
    store.remove("a")
    assert store.holders("node-1", "gpu-0-mig-1g10gb-19-0") == set()


def test_refresh_reads_what_another_process_wrote(tmp_path, boot_file):
    one, two = store_at(tmp_path, boot_file), store_at(tmp_path, boot_file)
    one.load()
    two.load()                       # rewrites the snapshot: a change for ``one``
    assert one.refresh() is True
    assert one.refresh() is False
    two.put(full_record("from-two"))
    assert one.refresh() is True and set(one.claims()) == {"from-two"}
    assert one.refresh() is False


def test_temporary_files_of_its_own_writes_are_deleted_at_load_and_no_others(tmp_path, boot_file):
    """A crash between a snapshot's (or a journal's) write and its rename leaves a temporary file; the next load
    deletes it and says which. Temporary files of other files in the directory (the simulated GPUs' state,
    written by another process) are not the checkpoint's to delete."""
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(full_record("a"))
    state = store.path.parent
    ours = [state / ".checkpoint.json.k2j4h1.tmp", state / ".checkpoint.json.journal.x9a8b7.tmp"]
    other = state / ".simulated-gpus.json.q1w2e3.tmp"
    for path in (*ours, other):
        path.write_text("half")
    reread = store_at(tmp_path, boot_file)
    assert sorted(reread.load().temp_files_removed) == sorted(ours)
    assert not any(p.exists() for p in ours) and other.exists()
    assert set(reread.claims()) == {"a"}
