"""The plugin's state directory is tamper-evident: checkpoint snapshot, journal and device-taint file that are
links, FIFOs, devices, another user's files, or a journal that is empty, header-less or missing beside its
snapshot are damage (one log line naming the file, a start as after a lost checkpoint), never followed, read
to the end or trusted; two records holding one exclusive device are resolved with one line. The states the
plugin itself leaves behind (fresh, clean stop, crash during the first start or during compaction) are not
damage."""
from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest
from driver_node import Node, ok

from dra.node import checkpoint as checkpoint_module
from dra.node.checkpoint import (
    PREPARE_COMPLETED,
    BookingConflict,
    CheckpointStore,
    ClaimRecord,
    DeviceHeld,
    MigUndo,
    PreparedDevice,
    UndoInfo,
)
from dra.node.safefiles import UnsafeFile, open_regular, read_regular_file, write_regular_file
from dra.node.taintstore import SavedTaint, TaintStore
from kubeletplugin.transport.nodedriver import ClaimRef

BOOT = "7c1f3a52-0a4e-4b55-9f43-2d1f3e6b9a01"
OTHER_UID = 4242
DEVICE = "gpu-0-mig-1g10gb-19-0"


@pytest.fixture
def boot_file(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text(BOOT + "\n")
    return path


def store_at(tmp_path: Path, boot_file: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "state" / "checkpoint.json", boot_id_path=boot_file)


def record(uid: str, device: str = DEVICE, updated: float = 0.0) -> ClaimRecord:
    return ClaimRecord(uid=uid, namespace="ns", name=f"claim-{uid}", state=PREPARE_COMPLETED, updated=updated,
                       devices=(PreparedDevice(device=device, pool="node-1", requests=("r",), uuid=f"MIG-{uid}"),),
                       undo=UndoInfo(mig_devices=(MigUndo(device=device, parent_uuid="GPU-0", gi_id=7, ci_id=0,
                                                          mig_uuid=f"MIG-{uid}", profile_id=19, start=0),)))


def prepared_store(tmp_path: Path, boot_file: Path) -> CheckpointStore:
    """A store with one claim in the snapshot and one in the journal only (prepared since the last fold)."""
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(record("in-snapshot", "gpu-1"))
    store.compact()
    store.put(record("in-journal"))
    return store


def outside_file(tmp_path: Path, content: bytes = b"not the plugin's file\n" * 10) -> tuple[Path, bytes]:
    target = tmp_path / "outside" / "precious.conf"
    target.parent.mkdir()
    target.write_bytes(content)
    return target, content


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def damage_line(caplog: pytest.LogCaptureFixture, path: Path, problem: str) -> str:
    """The one error line, which names the file and what was wrong with it."""
    lines = errors(caplog)
    assert len(lines) == 1, lines
    assert str(path) in lines[0] and problem in lines[0], lines[0]
    return lines[0]


def replace_with(path: Path, kind: str, target: Path | None = None) -> None:
    path.unlink()
    if kind == "link":
        assert target is not None
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))     # what /dev/null is


# ----- the safe-open helper -------------------------------------------------------------------------------------
def test_safe_reads_refuse_links_fifos_devices_other_owners_and_oversize(tmp_path: Path) -> None:
    target, content = outside_file(tmp_path)
    (tmp_path / "link").symlink_to(target)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "foreign").write_bytes(b"{}")
    os.chown(tmp_path / "foreign", OTHER_UID, OTHER_UID)
    for name, problem in [("link", "symbolic link"), ("fifo", "is a FIFO"), ("foreign", f"owned by UID {OTHER_UID}")]:
        with pytest.raises(UnsafeFile, match=problem):
            read_regular_file(tmp_path / name, 1 << 20)
    with pytest.raises(UnsafeFile, match="character device"):
        read_regular_file("/dev/null", 1 << 20)
    with pytest.raises(UnsafeFile, match="more than the 10 allowed"):
        read_regular_file(target, 10)
    with pytest.raises(UnsafeFile, match="symbolic link"):          # O_CREAT never creates a link's target
        open_regular(tmp_path / "dangling", os.O_WRONLY | os.O_CREAT)
    assert not (tmp_path / "nowhere").exists() and target.read_bytes() == content
    assert read_regular_file(target, len(content)) == content


def test_safe_writes_replace_a_link_and_need_a_directory_only_the_plugin_writes(tmp_path: Path) -> None:
    target, content = outside_file(tmp_path)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "file").symlink_to(target)
    write_regular_file(state / "file", b"new")
    assert target.read_bytes() == content and not (state / "file").is_symlink()
    state.chmod(0o777)
    with pytest.raises(UnsafeFile, match="writable by other users"):
        write_regular_file(state / "file", b"newer")
    state.chmod(0o700)
    os.chown(state, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeFile, match=f"owned by UID {OTHER_UID}"):
        write_regular_file(state / "file", b"newer")


# ----- checkpoint journal ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"", b"key = value\n"], ids=["empty", "text"])
def test_a_journal_linked_outside_is_damage_and_the_outside_file_is_untouched(tmp_path, boot_file, caplog, content):
    store = prepared_store(tmp_path, boot_file)
    target, content = outside_file(tmp_path, content)
    replace_with(store.journal_path, "link", target)
    reread = store_at(tmp_path, boot_file)
    result = reread.load()
    reread.put(record("after"))
    reread.close()
    assert target.read_bytes() == content                      # neither truncated nor appended to
    assert result.state_lost and result.corrupt_file.is_symlink()   # the link itself was moved aside
    damage_line(caplog, store.journal_path, "symbolic link")
    assert reread.claims().keys() == {"after"}                # the stale snapshot is not trusted either


def test_a_dangling_journal_link_creates_nothing_and_is_damage(tmp_path, boot_file, caplog):
    store = prepared_store(tmp_path, boot_file)
    nowhere = tmp_path / "outside-nowhere"
    replace_with(store.journal_path, "link", nowhere)
    result = store_at(tmp_path, boot_file).load()
    assert result.state_lost and not os.path.lexists(nowhere)
    damage_line(caplog, store.journal_path, "symbolic link")


def test_a_dangling_journal_link_keeps_a_prepared_mig_device_and_its_claim(tmp_path: Path) -> None:
    """The claim was prepared after the last fold (its record only in the journal); the plugin crashes and the
    journal is replaced by a dangling link. The start must not forget the claim and destroy its MIG device."""
    node = Node(tmp_path, {"default": {"mig": "dynamic"}})
    ref = node.add_claim("mig", [{"request": "r", "device": "gpu-0-mig-3g40gb-9-4"}])
    ok(node.driver, ref)
    live = {m.uuid for m in node.mig_devices(0)}
    assert live
    journal = node.state / "checkpoint.json.journal"
    replace_with(journal, "link", tmp_path / "outside-nowhere")
    driver = node.new_driver()                                  # a new process; the old one crashed
    assert node.startup.conservative
    assert {m.uuid for m in node.mig_devices(0)} == live        # nothing destroyed
    assert driver.checkpoint.get(ref.uid) is not None           # adopted from its CDI spec
    assert not os.path.lexists(tmp_path / "outside-nowhere")
    thief = node.add_claim("thief", [{"request": "r", "device": "gpu-0-mig-3g40gb-9-4"}])
    assert "already prepared" in driver.prepare([thief])[thief.uid].error


@pytest.mark.parametrize("kind", ["link", "device"])
def test_dev_null_as_journal_is_damage_not_a_crash(tmp_path, boot_file, caplog, kind):
    store = prepared_store(tmp_path, boot_file)
    replace_with(store.journal_path, kind, Path("/dev/null"))
    result = store_at(tmp_path, boot_file).load()
    assert result.state_lost
    damage_line(caplog, store.journal_path, "symbolic link" if kind == "link" else "character device")
    assert stat.S_ISREG(os.stat(store.journal_path, follow_symlinks=False).st_mode)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("which", ["snapshot", "journal"])
def test_a_fifo_in_place_of_a_checkpoint_file_does_not_hang_the_start(tmp_path, boot_file, caplog, which):
    store = prepared_store(tmp_path, boot_file)
    path = store.path if which == "snapshot" else store.journal_path
    replace_with(path, "fifo")
    result = store_at(tmp_path, boot_file).load()
    assert result.state_lost and stat.S_ISFIFO(os.stat(result.corrupt_file).st_mode)
    assert "is a FIFO" in errors(caplog)[0] and str(path) in errors(caplog)[0]


@pytest.mark.parametrize("damage", ["zero-length", "header-less", "missing"])
def test_a_journal_without_its_header_beside_a_snapshot_is_damage(tmp_path, boot_file, caplog, damage):
    store = prepared_store(tmp_path, boot_file)
    lines = store.journal_path.read_bytes().splitlines(keepends=True)
    if damage == "zero-length":
        store.journal_path.write_bytes(b"")
    elif damage == "header-less":
        store.journal_path.write_bytes(b"".join(lines[1:]))    # the change, without the header line
    else:
        store.journal_path.unlink()
    caplog.clear()
    reread = store_at(tmp_path, boot_file)
    result = reread.load()
    assert result.state_lost and result.corrupt
    problem = {"zero-length": "is empty", "header-less": "does not start with its header",
               "missing": "is missing beside the snapshot"}[damage]
    line = damage_line(caplog, store.journal_path, problem)
    assert "lost checkpoint" in line
    # The snapshot is stale by an unknown number of changes: it is kept for a post-mortem, not trusted.
    assert reread.claims() == {}
    assert any(p.name.startswith("checkpoint.json.corrupt-") for p in store.path.parent.iterdir())


def test_a_journal_of_another_snapshot_is_damage(tmp_path, boot_file, caplog):
    store = prepared_store(tmp_path, boot_file)
    stale = store.journal_path.read_bytes()
    store.put(record("later", "gpu-2"))
    store.compact()                                            # two folds later the old journal is foreign
    store.compact()
    store.journal_path.write_bytes(stale)
    caplog.clear()
    assert store_at(tmp_path, boot_file).load().state_lost
    damage_line(caplog, store.journal_path, "the snapshot beside it is continued by journal")


def test_a_journal_with_changes_but_no_snapshot_is_damage(tmp_path, boot_file, caplog):
    store = prepared_store(tmp_path, boot_file)
    store.path.unlink()
    caplog.clear()
    assert store_at(tmp_path, boot_file).load().state_lost
    damage_line(caplog, store.journal_path, "without the snapshot checkpoint.json")


@pytest.mark.parametrize("which", ["snapshot", "journal"])
def test_a_checkpoint_file_of_another_owner_is_not_trusted(tmp_path, boot_file, caplog, which):
    store = prepared_store(tmp_path, boot_file)
    path = store.path if which == "snapshot" else store.journal_path
    os.chown(path, OTHER_UID, OTHER_UID)
    caplog.clear()
    reread = store_at(tmp_path, boot_file)
    result = reread.load()
    assert result.state_lost and reread.claims() == {}
    assert f"owned by UID {OTHER_UID}" in errors(caplog)[0] and str(path) in errors(caplog)[0]


def test_a_snapshot_linked_outside_is_not_read(tmp_path, boot_file, caplog):
    store = prepared_store(tmp_path, boot_file)
    store.close()
    planted = tmp_path / "outside" / "planted.json"
    planted.parent.mkdir()
    planted.write_bytes(store.path.read_bytes())               # a valid checkpoint, but not at the name
    content = planted.read_bytes()
    replace_with(store.path, "link", planted)
    caplog.clear()
    reread = store_at(tmp_path, boot_file)
    result = reread.load()
    assert result.state_lost and reread.claims() == {}
    assert "symbolic link" in errors(caplog)[0] and str(store.path) in errors(caplog)[0]
    reread.put(record("after"))
    reread.close()
    assert planted.read_bytes() == content and not store.path.is_symlink()


# ----- states the plugin leaves behind are not damage ----------------------------------------------------------
def test_fresh_start_and_clean_stop_are_not_damage(tmp_path, boot_file, caplog):
    store = prepared_store(tmp_path, boot_file)
    store.close()
    reread = store_at(tmp_path, boot_file)
    assert not reread.load().state_lost and reread.claims().keys() == {"in-snapshot", "in-journal"}
    assert errors(caplog) == []


@pytest.mark.parametrize("stop", ["clean", "crash"])
def test_files_of_a_plugin_before_journal_ids_are_not_damage(tmp_path, boot_file, caplog, stop):
    """An upgrade: snapshot without journal IDs, journal whose header has none, as the earlier plugin left them
    after a clean stop (header only) or a crash (changes after the header)."""
    state = tmp_path / "state"
    state.mkdir()
    snap = {"schemaVersion": 2, "nodeBootId": BOOT,
            "claims": {"a": record("a", "gpu-1").model_dump(mode="json", by_alias=True)}}
    (state / "checkpoint.json").write_text(json.dumps(snap))
    journal = b'{"schemaVersion": 2}\n'
    if stop == "crash":
        journal += json.dumps({"put": record("b").model_dump(mode="json", by_alias=True)}).encode() + b"\n"
    (state / "checkpoint.json.journal").write_bytes(journal)
    store = store_at(tmp_path, boot_file)
    assert not store.load().state_lost and errors(caplog) == []
    assert store.claims().keys() == ({"a"} if stop == "clean" else {"a", "b"})
    assert json.loads((state / "checkpoint.json").read_text())["journalId"]


def test_a_crash_during_the_first_start_is_not_damage(tmp_path, boot_file, monkeypatch, caplog):
    """The first load puts a header-only journal in place before the first snapshot; a crash between them."""
    monkeypatch.setattr(checkpoint_module, "write_regular_file",
                        lambda *a, **k: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError, match="crash"):
        store_at(tmp_path, boot_file).load()
    monkeypatch.undo()
    assert not (tmp_path / "state" / "checkpoint.json").exists()
    assert not store_at(tmp_path, boot_file).load().state_lost and errors(caplog) == []


def test_a_crash_between_snapshot_and_journal_rename_is_not_damage(tmp_path, boot_file, monkeypatch, caplog):
    """Compaction wrote the snapshot naming a new journal, then crashed before renaming that journal into
    place: the old journal is already in the snapshot and is skipped."""
    store = prepared_store(tmp_path, boot_file)
    store.remove("in-snapshot")
    real_replace = os.replace

    def crash_on_journal(src, dst, *args, **kwargs):
        if str(dst).endswith(".journal"):
            raise OSError("crash")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.os, "replace", crash_on_journal)
    with pytest.raises(OSError, match="crash"):
        store.compact()
    monkeypatch.undo()
    reread = store_at(tmp_path, boot_file)
    assert not reread.load().state_lost and reread.claims().keys() == {"in-journal"}
    assert errors(caplog) == []


def test_a_failed_journal_rename_does_not_lose_later_changes(tmp_path, boot_file, monkeypatch):
    """The snapshot already names a journal that is not in place: the next change folds again first."""
    store = prepared_store(tmp_path, boot_file)
    real_replace = os.replace
    calls = {"n": 0}

    def fail_once(src, dst, *args, **kwargs):
        if str(dst).endswith(".journal") and calls["n"] == 0:
            calls["n"] += 1
            raise OSError("no space")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.os, "replace", fail_once)
    with pytest.raises(OSError):
        store.compact()
    store.put(record("after-failure", "gpu-3"))
    reread = store_at(tmp_path, boot_file)
    assert not reread.load().state_lost and "after-failure" in reread.claims()


def test_a_damaged_journal_after_a_reboot_is_void_like_the_rest_of_that_boot(tmp_path, boot_file, caplog):
    """A reboot resets what the records describe: the start drops them as after any reboot, not carefully."""
    store = prepared_store(tmp_path, boot_file)
    store.journal_path.write_bytes(b"")
    boot_file.write_text("e2b1d9c4-5f6a-4c3b-8e7d-1a2b3c4d5e6f\n")
    result = store_at(tmp_path, boot_file).load()
    assert not result.state_lost and [r.uid for r in result.dropped_claims] == ["in-snapshot"]
    assert "is empty" in errors(caplog)[0]


# ----- one exclusive device, two records -------------------------------------------------------------------------
def test_two_records_holding_one_exclusive_device_are_reported_and_both_kept(tmp_path, boot_file, caplog):
    """The store cannot tell a phantom from the real holder: it keeps both bookings (so no third claim gets the
    device) and reports the conflict; ``resolve`` drops the others' bookings durably."""
    store = store_at(tmp_path, boot_file)
    store.load()
    store.put(record("older"))
    store.close()
    doc = json.loads(store.path.read_text())
    doc["claims"]["newer"] = record("newer", updated=doc["claims"]["older"]["updated"] + 5).model_dump(
        mode="json", by_alias=True)
    doc["claims"]["older"]["devices"].append(PreparedDevice(device="gpu-1", pool="node-1").model_dump(
        mode="json", by_alias=True))
    store.path.write_text(json.dumps(doc))
    reread = store_at(tmp_path, boot_file)
    result = reread.load()
    conflict = BookingConflict("node-1", DEVICE, ("newer", "older"))
    assert result.conflicts == (conflict,) and reread.conflicts() == (conflict,) and result.claims == 2
    assert reread.holders("node-1", DEVICE) == {"newer", "older"}
    assert reread.conflict_of("older") == conflict and reread.conflict_of("other") is None
    with pytest.raises(DeviceHeld):
        reread.put(record("third"), exclusive=[("node-1", DEVICE)])
    reread.resolve(conflict, "older")
    assert reread.holders("node-1", DEVICE) == {"older"} and reread.conflicts() == ()
    newer = store_at(tmp_path, boot_file)
    assert newer.load().conflicts == ()                        # resolved on disk too
    assert newer.get("newer").devices == () and newer.get("newer").undo.mig_devices == ()
    assert [d.device for d in newer.get("older").devices] == [DEVICE, "gpu-1"]
    assert newer.get("older").undo.mig_devices
    assert errors(caplog) == []                                # the caller says what it did, in one line


def planted(node: Node, uid: str, name: str, device: str) -> None:
    """A journal line that books ``device`` for a claim the API server does not allocate it to, appended to the
    checkpoint of a stopped plugin (a damaged or edited state directory)."""
    node.driver.close()
    phantom = ClaimRecord(uid=uid, namespace="default", name=name, state=PREPARE_COMPLETED, updated=2e9,
                          devices=(PreparedDevice(device=device, pool="node-a", requests=("gpu",),
                                                  cdi_device_ids=(f"k8s.gpu.dra-driver.io/claim={uid}-{device}",)),))
    journal = node.state / "checkpoint.json.journal"
    with open(journal, "a") as out:
        out.write(json.dumps({"put": phantom.model_dump(mode="json", by_alias=True)}) + "\n")


def conflict_lines(logs: list[dict]) -> list[dict]:
    return [e for e in logs if "both hold exclusive device" in e["event"]]


def test_a_planted_booking_never_wins_over_the_claim_the_api_server_allocates(tmp_path):
    """A phantom record written after the real one books its device: the API server allocates the device to the
    real claim only, so the real claim keeps it and the phantom's booking is dropped, in one log line; the
    phantom, left with no device, is rolled back at that start, so the real claim's unprepare leaves nothing."""
    from structlog.testing import capture_logs

    node = Node(tmp_path, {"default": {"wholeGpu": True}})
    real = node.add_claim("real", [{"request": "gpu", "device": "gpu-0"}])
    before = ok(node.driver, real).devices
    phantom_uid = "0badc0de-0000-4000-8000-000000000001"
    planted(node, phantom_uid, "phantom", "gpu-0")
    with capture_logs() as logs:
        driver = node.new_driver()
    node.driver = driver
    assert driver.checkpoint.holders("node-a", "gpu-0") == {real.uid}
    [line] = conflict_lines(logs)
    assert line["log_level"] == "error" and real.uid in line["event"] and phantom_uid in line["event"]
    assert f"the API server allocates it to claim {real.uid} only, which keeps it" in line["event"], line
    assert set(driver.checkpoint.claims()) == {real.uid} and phantom_uid in node.startup.rolled_back
    assert f"record(s) left with no device are rolled back now: {phantom_uid}" in line["event"], line
    assert ok(driver, real).devices == before                  # the real claim's answer is unchanged
    assert driver.unprepare([real])[real.uid].error == ""
    assert driver.checkpoint.claims() == {} and node.metrics.prepared_claims._value.get() == 0
    nxt = node.add_claim("next", [{"request": "gpu", "device": "gpu-0"}])
    ok(driver, nxt)                                            # the phantom holds nothing


@pytest.mark.parametrize("api", ["neither", "unavailable"])
def test_a_double_booking_the_api_server_does_not_settle_keeps_the_device_out_of_use(tmp_path, monkeypatch, api):
    """Two records book one device and the API server allocates it to neither (or cannot be asked): both
    bookings stand, one line says so, the prepare of either claim fails naming the conflict and no other claim
    gets the device."""
    from structlog.testing import capture_logs

    from kubeletplugin.claims import ClaimError

    node = Node(tmp_path, {"default": {"wholeGpu": True}})
    first = node.add_claim("first", [{"request": "gpu", "device": "gpu-1"}])
    ok(node.driver, first)
    second_uid = "0badc0de-0000-4000-8000-000000000002"
    planted(node, second_uid, "second", "gpu-1")
    if api == "neither":                                       # the claim was re-allocated meanwhile
        node.add_claim("first", [{"request": "gpu", "device": "gpu-0"}], uid=first.uid)
    else:
        def unavailable(namespace: str, name: str, uid: str) -> dict:
            raise ClaimError(f"reading ResourceClaim {namespace}/{name}: the API server is unavailable",
                             reason="unavailable")
        monkeypatch.setattr(node.claims, "get_claim", unavailable)
    with capture_logs() as logs:
        driver = node.new_driver()
    node.driver = driver
    assert driver.checkpoint.holders("node-a", "gpu-1") == {first.uid, second_uid}
    [line] = conflict_lines(logs)
    assert first.uid in line["event"] and second_uid in line["event"] and "both bookings stand" in line["event"]
    assert ("allocates it to none of them" if api == "neither" else "could not be asked") in line["event"]
    for uid, name in ((first.uid, "first"), (second_uid, "second")):
        ref = ClaimRef("default", uid, name)
        err = driver.prepare([ref])[uid].error
        assert f"claims {' and '.join(sorted([first.uid, second_uid]))} both hold exclusive device gpu-1" in err, err
    monkeypatch.undo()
    third = node.add_claim("third", [{"request": "gpu", "device": "gpu-1"}])
    assert "already prepared for claim" in driver.prepare([third])[third.uid].error


# ----- device taints -----------------------------------------------------------------------------------------------
def saved_taints(path: Path) -> bytes:
    store = TaintStore(path)
    assert store.save([SavedTaint("gpu-0", "gpu.dra-driver.io/xid", "48", "NoSchedule", 1.0, 2.0)])
    return path.read_bytes()


def test_a_taint_file_linked_outside_is_set_aside_not_read(tmp_path, caplog):
    state = tmp_path / "state"
    planted = tmp_path / "outside" / "taints.json"
    planted.parent.mkdir()
    content = saved_taints(planted)
    state.mkdir()
    (state / "device-taints.json").symlink_to(planted)
    store = TaintStore(state / "device-taints.json")
    assert store.load() == []
    damage_line(caplog, state / "device-taints.json", "symbolic link")
    assert store.save([]) and planted.read_bytes() == content


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["fifo", "foreign"])
def test_a_taint_file_that_is_a_fifo_or_another_users_is_set_aside(tmp_path, caplog, kind):
    path = tmp_path / "device-taints.json"
    saved_taints(path)
    if kind == "fifo":
        replace_with(path, "fifo")
    else:
        os.chown(path, OTHER_UID, OTHER_UID)
    assert TaintStore(path).load() == []
    damage_line(caplog, path, "is a FIFO" if kind == "fifo" else f"owned by UID {OTHER_UID}")
    assert not os.path.lexists(path)                           # moved aside for a post-mortem
