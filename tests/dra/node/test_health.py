"""Health monitor: NVML events → device taints, with the fake NVML."""
from __future__ import annotations

import threading
import time

import pynvml
import pytest

from dra.node.health import HealthDevice, HealthMonitor
from dra.node.migdevices import create_mig_device
from dra.sim.fakenvml import FakeNvml, SimulatedGpu

GPU0 = "GPU-00000000-0000-4000-8000-00000000aaaa"
GPU1 = "GPU-00000000-0000-4000-8000-00000000bbbb"
DRIVER = "gpu.dra-driver.io"


@pytest.fixture
def nvml() -> FakeNvml:
    fake = FakeNvml([
        SimulatedGpu(model="H100-80GB", uuid=GPU0, minor=0, pci_bus_id="00000000:18:00.0", mig_enabled=True),
        SimulatedGpu(model="L4", uuid=GPU1, minor=1, pci_bus_id="00000000:28:00.0"),
    ])
    fake.nvmlInit()
    return fake


DEVICES = [
    HealthDevice("gpu-0-mig-1g10gb-19-0", GPU0, gi_id=7, ci_id=0),
    HealthDevice("gpu-0-mig-1g10gb-19-1", GPU0, gi_id=8, ci_id=0),
    HealthDevice("gpu-1", GPU1),
    HealthDevice("gpu-1-slot-0", GPU1),
]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def monitor(nvml, changes: list, **kwargs) -> HealthMonitor:
    kwargs.setdefault("probe_interval_s", 0.0)
    m = HealthMonitor(nvml, DRIVER, DEVICES, changes.append, wait_timeout_ms=50, **kwargs)
    m.start()
    return m


def keys(taints: list[dict]) -> list[tuple]:
    return [(t["key"], t.get("value"), t["effect"]) for t in taints]


def test_starts_healthy_and_reports_full_map(nvml):
    changes: list = []
    m = monitor(nvml, changes)
    assert changes == [{d.name: [] for d in DEVICES}]
    assert m.poll_once(10) is False  # nothing new: no second notification
    assert len(changes) == 1


def test_fatal_xid_on_whole_gpu_taints_all_its_devices(nvml):
    changes: list = []
    m = monitor(nvml, changes)
    nvml.inject_xid(GPU1, 79)
    assert m.poll_once() is True
    latest = changes[-1]
    assert keys(latest["gpu-1"]) == [(f"{DRIVER}/xid", "79", "NoSchedule")]
    assert keys(latest["gpu-1-slot-0"]) == [(f"{DRIVER}/xid", "79", "NoSchedule")]
    assert latest["gpu-0-mig-1g10gb-19-0"] == [] and latest["gpu-0-mig-1g10gb-19-1"] == []


def test_application_xid_is_informational(nvml):
    changes: list = []
    m = monitor(nvml, changes)
    nvml.inject_xid(GPU1, 13)
    m.poll_once()
    assert keys(m.taints()["gpu-1"]) == [(f"{DRIVER}/xid", "13", "None")]


def test_configured_extra_xid_is_informational(nvml):
    m = monitor(nvml, [], ignored_xids=[94])
    nvml.inject_xid(GPU1, 94)
    m.poll_once()
    assert m.taints()["gpu-1"][0]["effect"] == "None"


def test_later_harmless_xid_does_not_clear_a_fatal_one(nvml):
    m = monitor(nvml, [])
    nvml.inject_xid(GPU1, 48)
    m.poll_once()
    nvml.inject_xid(GPU1, 31)
    m.poll_once()
    assert keys(m.taints()["gpu-1"]) == [(f"{DRIVER}/xid", "48", "NoSchedule")]


def test_mig_scoped_xid_taints_only_that_partition(nvml):
    m = monitor(nvml, [])
    nvml.inject_xid(GPU0, 43, gi=8, ci=0)
    m.poll_once()
    taints = m.taints()
    assert keys(taints["gpu-0-mig-1g10gb-19-1"]) == [(f"{DRIVER}/xid", "43", "None")]
    assert taints["gpu-0-mig-1g10gb-19-0"] == []
    nvml.inject_xid(GPU0, 94, gi=3)  # a GI no published device lives in: nobody is tainted
    m.poll_once()
    assert m.taints()["gpu-0-mig-1g10gb-19-0"] == []


def test_gpu_lost_and_recovered(nvml):
    changes: list = []
    m = monitor(nvml, changes)
    nvml.inject_xid(GPU1, 79)
    m.poll_once()
    nvml.lose_gpu(GPU1)
    m.poll_once()
    taints = m.taints()
    assert (f"{DRIVER}/gpu-lost", None, "NoSchedule") in keys(taints["gpu-1"])
    assert (f"{DRIVER}/gpu-lost", None, "NoSchedule") in keys(taints["gpu-1-slot-0"])
    assert taints["gpu-0-mig-1g10gb-19-0"] == []
    m.poll_once(10)
    assert (f"{DRIVER}/gpu-lost", None, "NoSchedule") in keys(m.taints()["gpu-1"])  # still lost
    nvml.recover_gpu(GPU1)
    assert m.poll_once(10) is True
    assert m.taints()["gpu-1"] == [] and m.taints()["gpu-1-slot-0"] == []
    # Events flow again after recovery.
    nvml.inject_xid(GPU1, 62)
    m.poll_once()
    assert keys(m.taints()["gpu-1"]) == [(f"{DRIVER}/xid", "62", "NoSchedule")]


def test_quiet_period_removes_xid_taints(nvml):
    clock = Clock()
    m = monitor(nvml, [], quiet_period_s=60, clock=clock)
    nvml.inject_xid(GPU1, 79)
    m.poll_once()
    clock.now += 59
    nvml.inject_xid(GPU1, 79)  # a repeat restarts the quiet period
    m.poll_once()
    clock.now += 30
    m.poll_once(1)
    assert m.taints()["gpu-1"] != []
    clock.now += 31
    assert m.poll_once(1) is True
    assert m.taints()["gpu-1"] == []


def test_no_quiet_period_keeps_taints_until_recover(nvml):
    clock = Clock()
    m = monitor(nvml, [], quiet_period_s=None, clock=clock)
    nvml.inject_xid(GPU1, 79)
    m.poll_once()
    clock.now += 10_000
    m.poll_once(1)
    assert m.taints()["gpu-1"] != []
    m.recover(GPU1)
    assert m.taints()["gpu-1"] == []


class PickyNvml:
    """FakeNvml whose second GPU offers no XID events."""

    def __init__(self, inner: FakeNvml):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def nvmlDeviceGetSupportedEventTypes(self, handle):
        if self._inner.nvmlDeviceGetUUID(handle) == GPU1:
            return pynvml.nvmlEventTypeSingleBitEccError
        return self._inner.nvmlDeviceGetSupportedEventTypes(handle)


def test_gpu_without_events_is_unmonitored(nvml):
    m = HealthMonitor(PickyNvml(nvml), DRIVER, DEVICES, wait_timeout_ms=10)
    m.start()
    assert keys(m.taints()["gpu-1"]) == [(f"{DRIVER}/unmonitored", None, "None")]
    assert m.taints()["gpu-0-mig-1g10gb-19-0"] == []


class DbeNvml:
    """FakeNvml that delivers one double-bit ECC event on GPU0's GI 7."""

    def __init__(self, inner: FakeNvml):
        self._inner = inner
        self.sent = False

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def nvmlEventSetWait(self, event_set, timeout_ms):
        if self.sent:
            return self._inner.nvmlEventSetWait(event_set, timeout_ms)
        self.sent = True
        data = pynvml.c_nvmlEventData_t()
        data.device = self._inner.nvmlDeviceGetHandleByUUID(GPU0)
        data.eventType = pynvml.nvmlEventTypeDoubleBitEccError
        data.eventData = 0
        data.gpuInstanceId = 7
        data.computeInstanceId = 0xFFFFFFFF
        return data


def test_double_bit_ecc_taints_no_schedule(nvml):
    m = HealthMonitor(DbeNvml(nvml), DRIVER, DEVICES, wait_timeout_ms=10, probe_interval_s=0)
    m.start()
    m.poll_once()
    assert keys(m.taints()["gpu-0-mig-1g10gb-19-0"]) == [(f"{DRIVER}/ecc", "double-bit", "NoSchedule")]
    assert m.taints()["gpu-0-mig-1g10gb-19-1"] == []


def test_dynamic_mig_binding(nvml):
    devices = [HealthDevice("gpu-1", GPU1), HealthDevice("gpu-0", GPU0),
               HealthDevice("gpu-0-mig-3g40gb-9-4", GPU0)]
    m = HealthMonitor(nvml, DRIVER, devices, wait_timeout_ms=50, probe_interval_s=0)
    m.start()
    live = create_mig_device(nvml, GPU0, 9, 4)
    m.bind_mig("gpu-0-mig-3g40gb-9-4", GPU0, live.gi_id, live.ci_id)
    nvml.inject_xid(GPU0, 45, gi=live.gi_id, ci=live.ci_id)
    m.poll_once()
    assert keys(m.taints()["gpu-0-mig-3g40gb-9-4"]) == [(f"{DRIVER}/xid", "45", "None")]
    assert m.taints()["gpu-0"] == []
    m.unbind_mig("gpu-0-mig-3g40gb-9-4")
    assert m.taints()["gpu-0-mig-3g40gb-9-4"] == []
    nvml.inject_xid(GPU0, 79)  # whole-GPU XID still reaches the abstract placement device
    m.poll_once()
    assert m.taints()["gpu-0-mig-3g40gb-9-4"][0]["value"] == "79"


def test_run_loop_notifies_and_stops(nvml):
    got = threading.Event()
    seen: list = []

    def on_change(taints):
        seen.append(taints)
        if taints["gpu-1"]:
            got.set()

    m = HealthMonitor(nvml, DRIVER, DEVICES, on_change, wait_timeout_ms=50)
    stop = threading.Event()
    thread = threading.Thread(target=m.run, args=(stop,))
    thread.start()
    time.sleep(0.1)
    nvml.inject_xid(GPU1, 79)
    assert got.wait(5)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    m.close()
    assert seen[-1]["gpu-1"][0]["key"] == f"{DRIVER}/xid"


def test_failing_callback_does_not_stop_monitoring(nvml):
    def broken(_):
        raise RuntimeError("consumer bug")

    m = HealthMonitor(nvml, DRIVER, DEVICES, broken, wait_timeout_ms=50, probe_interval_s=0)
    m.start()
    nvml.inject_xid(GPU1, 79)
    assert m.poll_once() is True
    assert m.taints()["gpu-1"] != []


def test_recoveries_source_clears_a_gpus_taints(nvml):
    m = monitor(nvml, [], quiet_period_s=None, recoveries=nvml.take_recoveries)
    nvml.inject_xid(GPU1, 79)
    nvml.inject_xid(GPU0, 48)
    m.poll_once()
    m.poll_once()
    assert m.taints()["gpu-1"] != [] and m.taints()["gpu-0-mig-1g10gb-19-0"] != []
    nvml.recover_gpu(GPU1)             # the operator's word (gpu-dra simulate recover on a simulated node)
    assert m.poll_once(10) is True
    assert m.taints()["gpu-1"] == [] and m.taints()["gpu-1-slot-0"] == []
    assert m.taints()["gpu-0-mig-1g10gb-19-0"] != []    # other GPUs keep theirs
    assert nvml.take_recoveries() == []
    nvml.inject_xid(GPU1, 79)          # still monitored after the recovery
    m.poll_once()
    assert keys(m.taints()["gpu-1"]) == [(f"{DRIVER}/xid", "79", "NoSchedule")]


def test_recovered_lost_gpu_is_monitored_again(nvml):
    m = monitor(nvml, [], recoveries=nvml.take_recoveries)
    nvml.lose_gpu(GPU1)
    m.poll_once()
    assert (f"{DRIVER}/gpu-lost", None, "NoSchedule") in keys(m.taints()["gpu-1"])
    nvml.recover_gpu(GPU1)
    m.poll_once(10)
    assert m.taints()["gpu-1"] == []
    nvml.inject_xid(GPU1, 62)
    m.poll_once()
    assert keys(m.taints()["gpu-1"]) == [(f"{DRIVER}/xid", "62", "NoSchedule")]


def test_taints_say_since_when(nvml):
    wall = Clock()
    wall.now = 1_767_225_600.0          # 2026-01-01T00:00:00Z
    m = monitor(nvml, [], wall_clock=wall)
    nvml.inject_xid(GPU1, 79)
    m.poll_once()
    wall.now += 3600
    nvml.inject_xid(GPU1, 79)           # a repeat keeps the first time: the slice must not change
    m.poll_once()
    assert m.taints()["gpu-1"][0]["timeAdded"] == "2026-01-01T00:00:00Z"


def test_an_idle_round_builds_no_taint_map_and_later_changes_still_notify(nvml, monkeypatch):
    """An idle monitor costs no CPU to speak of: a round with no event, recovery, lost GPU or expiry neither
    rebuilds, compares nor saves the taint map. Rounds that do change something still notify."""
    clock = Clock()
    changes: list = []
    m = monitor(nvml, changes, probe_interval_s=10.0, quiet_period_s=60.0, clock=clock)
    built = []
    real_taints = m.taints
    monkeypatch.setattr(m, "taints", lambda: built.append(1) or real_taints())
    for _ in range(3):
        assert m.poll_once(1) is False
    assert built == []
    nvml.inject_xid(GPU1, 79)                 # an event
    assert m.poll_once(1) is True and built
    clock.now += 61                           # past the quiet period: the taint expires
    assert m.poll_once(1) is True
    assert changes[-1]["gpu-1"] == []
    nvml.lose_gpu(GPU0)                       # found by the event wait or the next probe
    clock.now += 11
    m.poll_once(1)
    assert keys(changes[-1]["gpu-0-mig-1g10gb-19-0"]) == [(f"{DRIVER}/gpu-lost", None, "NoSchedule")]


def test_an_idle_monitor_waits_until_its_next_probe_or_expiry(nvml):
    """The NVML wait of a round lasts until the next due probe or taint expiry (capped by wait_timeout_ms), so an
    idle monitor wakes once per probe interval, not on a short beat."""
    clock = Clock()
    m = HealthMonitor(nvml, DRIVER, DEVICES, probe_interval_s=10.0, quiet_period_s=60.0, wait_timeout_ms=30_000,
                      clock=clock)
    m.start()
    m.poll_once(1)                            # the first round probes
    assert m._wait_ms() == 10_000             # next probe in 10 s
    clock.now += 4
    assert m._wait_ms() == 6_000
    clock.now += 6
    m.poll_once(1)                            # probes again (10 s since the first)
    assert m._wait_ms() == 10_000
    rare = HealthMonitor(nvml, DRIVER, DEVICES, probe_interval_s=1000.0, quiet_period_s=60.0, wait_timeout_ms=30_000,
                         clock=clock)
    rare.start()
    rare.poll_once(1)
    nvml.inject_xid(GPU1, 79)
    rare.poll_once(1)
    clock.now += 57                           # the XID taint expires 60 s after it was seen: in 3 s
    assert rare._wait_ms() == 3_000
    capped = HealthMonitor(nvml, DRIVER, DEVICES, probe_interval_s=10.0, wait_timeout_ms=500, clock=clock)
    capped.start()
    capped.poll_once(1)
    assert capped._wait_ms() == 500
