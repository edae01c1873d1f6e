"""XID/ECC taints outlive a plugin restart: a new monitor over the same taint file starts with them, keeps
their timeAdded, and counts the quiet period from their last event (downtime included)."""
from __future__ import annotations

import json

import pytest

from dra.node.health import HealthDevice, HealthMonitor
from dra.node.taintstore import TaintStore
from dra.sim.fakenvml import FakeNvml, SimulatedGpu

GPU0 = "GPU-00000000-0000-4000-8000-00000000aaaa"
GPU1 = "GPU-00000000-0000-4000-8000-00000000bbbb"
DRIVER = "gpu.dra-driver.io"
XID = f"{DRIVER}/xid"
DEVICES = [HealthDevice("gpu-0", GPU0), HealthDevice("gpu-1", GPU1), HealthDevice("gpu-1-slot-0", GPU1)]


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Process:
    """One plugin process: its own NVML (events from before it started are history) and its own monotonic clock;
    the wall clock is shared, as on the node."""

    def __init__(self, path, wall: Clock, devices=DEVICES, quiet: float | None = 300.0, boot_id=None) -> None:
        self.nvml = FakeNvml([SimulatedGpu(model="L4", uuid=GPU0, minor=0, pci_bus_id="00000000:18:00.0"),
                              SimulatedGpu(model="L4", uuid=GPU1, minor=1, pci_bus_id="00000000:28:00.0")])
        self.nvml.nvmlInit()
        self.mono = Clock(50.0)          # a new process: monotonic time unrelated to the last one's
        self.changes: list = []
        self.monitor = HealthMonitor(self.nvml, DRIVER, devices, self.changes.append, store=TaintStore(path, boot_id),
                                     quiet_period_s=quiet, probe_interval_s=0.0, wait_timeout_ms=10,
                                     clock=self.mono, wall_clock=wall)
        self.monitor.start()

    def wire(self, device: str) -> list[tuple]:
        return [(t["key"], t.get("value"), t["effect"], t["timeAdded"]) for t in self.monitor.taints()[device]]


@pytest.fixture
def wall() -> Clock:
    return Clock(1_800_000_000.0)


def test_fatal_xid_stays_after_restart_until_its_quiet_period_ends(tmp_path, wall):
    path = tmp_path / "device-taints.json"
    first = Process(path, wall)
    first.nvml.inject_xid(GPU1, 79)
    first.monitor.poll_once()
    tainted = first.wire("gpu-1")
    assert [t[:3] for t in tainted] == [(XID, "79", "NoSchedule")]
    assert json.loads(path.read_text())["taints"][0]["device"] == "gpu-1"

    wall.now += 200          # the plugin is down for 200 s of the 300 s quiet period
    second = Process(path, wall)
    assert second.wire("gpu-1") == tainted and second.wire("gpu-1-slot-0") == tainted   # same timeAdded too
    assert second.wire("gpu-0") == []
    assert second.changes[0]["gpu-1"] == second.monitor.taints()["gpu-1"]    # the first notification has it
    second.mono.now += 99
    wall.now += 99
    second.monitor.poll_once()
    assert second.wire("gpu-1") == tainted                                  # 299 s since the XID
    second.mono.now += 1
    wall.now += 1
    second.monitor.poll_once()
    assert second.wire("gpu-1") == []                                       # 300 s: expired
    assert json.loads(path.read_text())["taints"] == []
    assert Process(path, wall).wire("gpu-1") == []


def test_a_newer_event_restarts_the_saved_clock_and_recover_clears_the_file(tmp_path, wall):
    path = tmp_path / "device-taints.json"
    first = Process(path, wall)
    first.nvml.inject_xid(GPU1, 79)
    first.monitor.poll_once()
    wall.now += 250
    first.mono.now += 250
    first.nvml.inject_xid(GPU1, 13)        # harmless, but it is a new event: the fatal taint's clock restarts
    first.monitor.poll_once()
    assert [t[:3] for t in first.wire("gpu-1")] == [(XID, "79", "NoSchedule")]
    wall.now += 100
    second = Process(path, wall)
    second.monitor.poll_once()
    assert [t[:3] for t in second.wire("gpu-1")] == [(XID, "79", "NoSchedule")]   # 100 s since the last event
    second.monitor.recover(GPU1)
    assert second.wire("gpu-1") == []
    assert Process(path, wall).wire("gpu-1") == []


def test_no_quiet_period_keeps_the_taint_over_any_downtime(tmp_path, wall):
    path = tmp_path / "device-taints.json"
    first = Process(path, wall, quiet=None)
    first.nvml.inject_xid(GPU0, 48)
    first.monitor.poll_once()
    wall.now += 7 * 24 * 3600
    second = Process(path, wall, quiet=None)
    second.monitor.poll_once()
    assert [t[:3] for t in second.wire("gpu-0")] == [(XID, "48", "NoSchedule")]


def test_unusable_file_or_unknown_devices_start_clean_with_one_line(tmp_path, wall, caplog):
    path = tmp_path / "device-taints.json"
    path.write_text('{"taints": [{"device": "gpu-0"')
    assert Process(path, wall).wire("gpu-0") == []
    assert [r.levelname for r in caplog.records if "device taints" in r.getMessage()] == ["ERROR"]

    first = Process(path, wall)
    first.nvml.inject_xid(GPU1, 79)
    first.monitor.poll_once()
    caplog.clear()
    later = Process(path, wall, devices=[HealthDevice("gpu-0", GPU0)])   # gpu-1 is not published any more
    assert later.monitor.taints() == {"gpu-0": []}
    [line] = [r.getMessage() for r in caplog.records if "restored" in r.getMessage()]
    assert "restored 0 device taint(s)" in line and "2 for devices no longer published dropped" in line


def test_a_reboot_resets_the_gpus_and_drops_their_taints(tmp_path, wall, caplog):
    path, boot = tmp_path / "device-taints.json", tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    first = Process(path, wall, quiet=None, boot_id=boot)
    first.nvml.inject_xid(GPU1, 79)
    first.monitor.poll_once()
    assert [t[:3] for t in Process(path, wall, quiet=None, boot_id=boot).wire("gpu-1")] == [(XID, "79", "NoSchedule")]
    boot.write_text("boot-2\n")
    assert Process(path, wall, quiet=None, boot_id=boot).wire("gpu-1") == []
    [line] = [r.getMessage() for r in caplog.records if "rebooted" in r.getMessage()]
    assert "boot ID boot-1, now boot-2" in line and "dropping 2 taint(s)" in line    # gpu-1 and its slot


def test_old_temporary_files_of_taint_writes_are_deleted_at_load_and_recent_ones_kept(tmp_path):
    """A crash between a write and its rename leaves a temporary file; the next load deletes it. One written in
    the last minute may be the rolling update's other plugin process saving its taints right now: kept."""
    import os
    import time

    path = tmp_path / "device-taints.json"
    old, recent = tmp_path / ".device-taints.json.a1b2c3.tmp", tmp_path / ".device-taints.json.d4e5f6.tmp"
    for leftover in (old, recent):
        leftover.write_text("{")
    os.utime(old, (time.time() - 120, time.time() - 120))
    assert TaintStore(path).load() == []
    assert not old.exists() and recent.exists()
