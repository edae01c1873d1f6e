"""Fault injection through the simulated GPUs' state file: XIDs, lost GPUs and recoveries recorded by one party
(``gpu-dra simulate``, dra/sim/faults.py) reach the event sets of another simulator over the same file."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pynvml
import pytest

from cli.main import main
from dra.sim import faults
from dra.sim.fakenvml import FILE_POLL_S, FakeNvml
from dra.sim.fleet import nvml_for_node, parse_fleet
from dra.sim.state import MAX_EVENTS, SimulatedHardwareState, SimulatedStateError

REPO = Path(__file__).resolve().parents[3]
NO_ID = 0xFFFFFFFF
FLEET = {"nodes": [{"name": "node-a", "gpus": [
    {"model": "H100-80GB", "count": 1},
    {"model": "H100-80GB", "count": 1, "mig": {"enabled": True, "instances": [{"profile": "3g.40gb", "start": 4}]}},
]}]}


def simulator(path: Path) -> FakeNvml:
    """What a plugin process holds: the node's simulated NVML over the state file, initialised."""
    nvml = nvml_for_node(parse_fleet(FLEET).node("node-a"), state_file=path)
    nvml.nvmlInit()
    return nvml


@pytest.fixture
def state_path(tmp_path) -> Path:
    return tmp_path / "state" / "simulated-gpus.json"


@pytest.fixture
def plugin(state_path) -> FakeNvml:
    return simulator(state_path)


def listen(nvml: FakeNvml, gpu: int = 1):
    es = nvml.nvmlEventSetCreate()
    handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlDeviceGetSupportedEventTypes(handle), es)
    return es


def test_xid_recorded_in_the_file_reaches_a_waiting_event_set(plugin, state_path):
    es = listen(plugin)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append((plugin.nvmlEventSetWait(es, 5000), time.monotonic())))
    waiter.start()
    time.sleep(0.2)
    injected = time.monotonic()
    event = faults.inject_xid(SimulatedHardwareState(state_path), "1", 79)
    waiter.join(timeout=5)
    (data, received), = got
    assert received - injected < FILE_POLL_S + 0.5, "the wait must notice the file within its poll interval"
    assert (plugin.nvmlDeviceGetUUID(data.device), data.eventData) == (plugin.gpu_uuids[1], 79)
    assert (data.gpuInstanceId, data.computeInstanceId) == (NO_ID, NO_ID)
    assert data.eventType == pynvml.nvmlEventTypeXidCriticalError
    assert (event.seq, event.gpu_uuid) == (1, plugin.gpu_uuids[1])
    with pytest.raises(pynvml.NVMLError) as err:   # delivered once
        plugin.nvmlEventSetWait(es, 200)
    assert err.value.value == pynvml.NVML_ERROR_TIMEOUT


def test_events_from_before_a_simulator_started_are_history(plugin, state_path):
    faults.inject_xid(SimulatedHardwareState(state_path), plugin.gpu_uuids[1], 48)
    later = simulator(state_path)
    es = listen(later)
    with pytest.raises(pynvml.NVMLError) as err:
        later.nvmlEventSetWait(es, 300)
    assert err.value.value == pynvml.NVML_ERROR_TIMEOUT
    faults.inject_xid(SimulatedHardwareState(state_path), "1", 94)   # but new ones arrive
    assert later.nvmlEventSetWait(es, 2000).eventData == 94


def test_xid_on_a_mig_device_names_its_instances(plugin, state_path):
    es = listen(plugin)
    state = SimulatedHardwareState(state_path)
    faults.inject_xid(state, "1", 43, gi=2, ci=0)       # 3g.40gb at start 4 is GPU instance 2
    data = plugin.nvmlEventSetWait(es, 2000)
    assert (data.eventData, data.gpuInstanceId, data.computeInstanceId) == (43, 2, 0)
    with pytest.raises(SimulatedStateError, match=r"no GPU instance 5 \(it has \[2\]\)"):
        faults.inject_xid(state, "1", 43, gi=5)
    with pytest.raises(SimulatedStateError, match=r"has no compute instance 3 \(it has \[0\]\)"):
        faults.inject_xid(state, "1", 43, gi=2, ci=3)
    with pytest.raises(SimulatedStateError, match="needs its GPU instance"):
        faults.inject_xid(state, "1", 43, ci=0)


def test_lost_gpu_and_recovery_through_the_file(plugin, state_path):
    es = listen(plugin)
    state = SimulatedHardwareState(state_path)
    faults.lose_gpu(state, "1", "fell off the bus")
    with pytest.raises(pynvml.NVMLError) as err:
        plugin.nvmlEventSetWait(es, 2000)
    assert err.value.value == pynvml.NVML_ERROR_GPU_IS_LOST
    handle = plugin.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError):
        plugin.nvmlDeviceGetMemoryInfo(handle)
    assert plugin.lost_reason(plugin.gpu_uuids[1]) == "fell off the bus"
    assert plugin.take_recoveries() == []

    faults.recover_gpu(state, plugin.gpu_uuids[1])
    assert plugin.nvmlDeviceGetMemoryInfo(handle).total > 0
    assert plugin.take_recoveries() == [plugin.gpu_uuids[1]]
    assert plugin.take_recoveries() == []            # each recovery once


def test_in_process_recovery_is_offered_too(plugin):
    plugin.lose_gpu(plugin.gpu_uuids[0])
    plugin.recover_gpu(plugin.gpu_uuids[0])
    plugin.recover_gpu(plugin.gpu_uuids[0])
    assert plugin.take_recoveries() == [plugin.gpu_uuids[0]]


def test_event_log_keeps_the_newest_and_survives_the_plugins_own_writes(plugin, state_path):
    state = SimulatedHardwareState(state_path)
    for i in range(MAX_EVENTS + 5):
        faults.inject_xid(state, "0", 1 + i % 100)
    # The plugin changes the hardware (and writes the file): the log must stay as the injector left it.
    plugin.nvmlDeviceSetComputeMode(plugin.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_COMPUTEMODE_PROHIBITED)
    doc = json.loads(state_path.read_text())
    assert doc["eventSerial"] == MAX_EVENTS + 5
    assert [e["seq"] for e in doc["events"]] == list(range(6, MAX_EVENTS + 6))
    assert doc["gpus"][0]["computeMode"] == pynvml.NVML_COMPUTEMODE_PROHIBITED


def test_gpu_references_and_a_missing_file_are_named(plugin, state_path, tmp_path):
    state = SimulatedHardwareState(state_path)
    with pytest.raises(SimulatedStateError) as err:
        faults.inject_xid(state, "GPU-nope", 79)
    assert str(state_path) in str(err.value) and f"0={plugin.gpu_uuids[0]}" in str(err.value)
    with pytest.raises(SimulatedStateError, match="out of range"):
        faults.inject_xid(state, "0", 0)
    with pytest.raises(SimulatedStateError, match="no such file"):
        faults.lose_gpu(SimulatedHardwareState(tmp_path / "nothing.json"), "0")


def test_a_state_file_with_an_event_for_another_gpu_is_refused(plugin, state_path):
    doc = json.loads(state_path.read_text())
    doc["eventSerial"] = 1
    doc["events"] = [{"seq": 1, "gpuUuid": "GPU-elsewhere", "kind": "xid", "xid": 79}]
    state_path.write_text(json.dumps(doc))
    with pytest.raises(SimulatedStateError, match=r"events\[0\]\.gpuUuid: no GPU GPU-elsewhere"):
        plugin.nvmlDeviceGetCount()


# --- the command -------------------------------------------------------------------------------------------

def test_simulate_command(plugin, state_path, capsys):
    es = listen(plugin)
    assert main(["simulate", "xid", "--sim-state", str(state_path), "--gpu", "1", "--xid", "79"]) == 0
    assert f"XID 79 on GPU {plugin.gpu_uuids[1]}: event 1 recorded" in capsys.readouterr().out
    assert plugin.nvmlEventSetWait(es, 2000).eventData == 79
    assert main(["simulate", "lose", "--sim-state", str(state_path), "--gpu", plugin.gpu_uuids[1]]) == 0
    assert "is lost" in capsys.readouterr().out
    assert plugin.lost_reason(plugin.gpu_uuids[1]) == faults.DEFAULT_LOST_REASON
    assert main(["simulate", "recover", "--sim-state", str(state_path), "--gpu", "1"]) == 0
    assert plugin.lost_reason(plugin.gpu_uuids[1]) is None and plugin.take_recoveries() == [plugin.gpu_uuids[1]]

    assert main(["simulate", "xid", "--sim-state", str(state_path), "--gpu", "9", "--xid", "79"]) == 2
    err = capsys.readouterr().err
    assert "gpu-dra simulate xid:" in err and "no GPU '9'" in err and str(state_path) in err


def test_simulate_needs_the_state_file(monkeypatch, capsys):
    monkeypatch.delenv("SIM_STATE", raising=False)
    assert main(["simulate", "recover", "--gpu", "0"]) == 2
    assert "--sim-state" in capsys.readouterr().err


def test_simulate_from_another_process(plugin, state_path):
    es = listen(plugin, gpu=0)
    proc = subprocess.run([sys.executable, "-m", "cli.main", "simulate", "xid", "--gpu", "0", "--xid", "31"],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"SIM_STATE": str(state_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert plugin.nvmlEventSetWait(es, 2000).eventData == 31


def test_a_recovery_ends_a_wait_early(plugin, state_path):
    es = listen(plugin)
    ended: list[float] = []

    def wait() -> None:
        with pytest.raises(pynvml.NVMLError) as err:
            plugin.nvmlEventSetWait(es, 10_000)
        assert err.value.value == pynvml.NVML_ERROR_TIMEOUT
        ended.append(time.monotonic())

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    recovered = time.monotonic()
    faults.recover_gpu(SimulatedHardwareState(state_path), "1")
    waiter.join(timeout=5)
    assert ended and ended[0] - recovered < FILE_POLL_S + 0.5
    assert plugin.take_recoveries() == [plugin.gpu_uuids[1]]
