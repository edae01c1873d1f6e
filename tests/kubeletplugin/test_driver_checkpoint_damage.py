"""Checkpoint corruption variants under a node with prepared claims (dynamic MIG, MPS slot, whole GPU): each
damage is done to the files on disk, then a new plugin process starts on them. It must start (or refuse
loudly, for a newer plugin's checkpoint), keep every prepared claim's devices booked or adopted, and leave
nothing behind once every claim is unprepared. Prints tried / survived / leaked."""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest
from driver_node import Node, gpu_config, ok, opaque

from dra.node.checkpoint import SCHEMA_VERSION, CheckpointTooNew

stats: Counter[str] = Counter()


def _torn_snapshot(snap: Path, journal: Path) -> None:
    snap.write_bytes(snap.read_bytes()[:57])


def _garbage_snapshot(snap: Path, journal: Path) -> None:
    snap.write_bytes(b"\x00\xff not json")


def _directory_snapshot(snap: Path, journal: Path) -> None:
    snap.unlink()
    snap.mkdir()


def _torn_journal(snap: Path, journal: Path) -> None:
    with open(journal, "ab") as f:
        f.write(b'{"put": {"uid": "x", "state": "Prep')


def _garbage_journal_line(snap: Path, journal: Path) -> None:
    with open(journal, "ab") as f:
        f.write(b"][\n")


def _swapped_key(snap: Path, journal: Path) -> None:
    doc = json.loads(snap.read_text())
    uid = sorted(doc["claims"])[0]
    doc["claims"][uid]["uid"] = "00000000-0000-4000-8000-00000000beef"
    snap.write_text(json.dumps(doc))


def _one_record_unreadable(snap: Path, journal: Path) -> None:
    doc = json.loads(snap.read_text())
    doc["claims"][sorted(doc["claims"])[0]]["devices"] = "not a list"
    snap.write_text(json.dumps(doc))


def _journal_deleted(snap: Path, journal: Path) -> None:
    journal.unlink()


def _empty_files(snap: Path, journal: Path) -> None:
    snap.write_bytes(b"")
    journal.write_bytes(b"")


def _journal_linked_elsewhere(snap: Path, journal: Path) -> None:
    elsewhere = snap.parent.parent / "elsewhere.journal"
    elsewhere.write_bytes(b"")                # a write through the link would start a journal there
    journal.unlink()
    journal.symlink_to(elsewhere)


def _journal_fifo(snap: Path, journal: Path) -> None:
    journal.unlink()
    os.mkfifo(journal, 0o600)                 # a read would wait for a writer forever


def _journal_without_header(snap: Path, journal: Path) -> None:
    journal.write_bytes(journal.read_bytes().split(b"\n", 1)[1])


def _snapshot_of_another_user(snap: Path, journal: Path) -> None:
    os.chown(snap, 4242, 4242)


VARIANTS: dict[str, Callable[[Path, Path], None]] = {
    "torn snapshot": _torn_snapshot, "garbage snapshot": _garbage_snapshot,
    "directory in place of the snapshot": _directory_snapshot, "torn journal": _torn_journal,
    "garbage journal line": _garbage_journal_line, "record under another claim's key": _swapped_key,
    "one record unreadable": _one_record_unreadable, "journal deleted after compaction": _journal_deleted,
    "both files empty": _empty_files, "journal linked elsewhere": _journal_linked_elsewhere,
    "FIFO in place of the journal": _journal_fifo, "journal without its header": _journal_without_header,
    "snapshot of another user": _snapshot_of_another_user,
}


def _prepared_node(tmp_path: Path) -> tuple[Node, list]:
    node = Node(tmp_path, {"default": {"mig": "dynamic"},
                           "rules": [{"match": {"index": 1}, "slots": {"count": 2, "strategy": "mps"}}]},
                state_file=tmp_path / "gpus.json")
    refs = [node.add_claim("mig", [{"request": "r", "device": "gpu-0-mig-3g40gb-9-4"}]),
            node.add_claim("mps", [{"request": "r", "device": "gpu-1-slot-0"}],
                           [opaque(gpu_config(strategy="MPS", mps={"activeThreadPercentage": 30}))]),
            node.add_claim("other-mig", [{"request": "r", "device": "gpu-0-mig-1g10gb-19-0"}])]
    for ref in refs:
        ok(node.driver, ref)
    node.driver.close()                       # the plugin stops: every record in the snapshot
    return node, refs


@pytest.mark.timeout(120)                     # a FIFO read by mistake would hang the start
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_damaged_checkpoint_recovers_without_leaks(tmp_path: Path, variant: str) -> None:
    node, refs = _prepared_node(tmp_path)
    live_before = {m.uuid for m in node.mig_devices(0)}
    snap = node.state / "checkpoint.json"
    VARIANTS[variant](snap, snap.with_name(snap.name + ".journal"))
    driver = node.restart_process()
    stats["tried"] += 1
    assert {m.uuid for m in node.mig_devices(0)} == live_before          # nothing destroyed at start
    for ref in refs:                                                      # every claim still answers
        result = driver.prepare([ref])[ref.uid]
        assert "internal error" not in result.error
    thief = node.add_claim("thief", [{"request": "r", "device": "gpu-0-mig-3g40gb-9-4"}])
    assert driver.prepare([thief])[thief.uid].error != ""                 # its devices stay booked
    for ref in [*refs, thief]:
        assert driver.unprepare([ref])[ref.uid].error == ""
    driver = node.restart_process()                                       # a clean start removes leftovers
    leaked = [m.uuid for m in node.mig_devices(0)] + list(driver.checkpoint.claims()) \
        + list(driver.cdi.list_claim_specs()) + [p for p, d in node.control.daemons.items() if d.alive]
    stats["leaked"] += len(leaked)
    assert leaked == []
    assert not (tmp_path / "elsewhere.journal").exists() or (tmp_path / "elsewhere.journal").read_bytes() == b""
    stats["survived"] += 1


def test_a_newer_plugins_checkpoint_stops_the_start_and_is_kept(tmp_path: Path) -> None:
    node, _ = _prepared_node(tmp_path)
    snap = node.state / "checkpoint.json"
    doc = json.loads(snap.read_text())
    doc["schemaVersion"] = SCHEMA_VERSION + 1
    snap.write_text(json.dumps(doc))
    before = snap.read_bytes()
    with pytest.raises(CheckpointTooNew, match="newer plugin"):
        node.restart_process()
    assert snap.read_bytes() == before and len(node.mig_devices(0)) == 2
    stats["tried"] += 1
    stats["survived"] += 1


def test_checkpoint_report() -> None:
    print(f"\ncheckpoint damage: tried {stats['tried']}, survived {stats['survived']}, leaked {stats['leaked']}")
    assert stats["tried"] == len(VARIANTS) + 1 and stats["survived"] == stats["tried"] and stats["leaked"] == 0
