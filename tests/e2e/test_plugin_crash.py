"""The plugin dies in the middle of a prepare (the GPU_DRA_FAULT test hook exits with 137 at a chosen step) or
finds its checkpoint unreadable: the next process must bring the node back to a state where the kubelet's
retry succeeds and unprepare leaves nothing behind. The simulated GPUs live in the plugin's --sim-state file,
so what the dead process created on them is still there, as on hardware."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from plugin_helpers import assert_nothing_left, run_example
from standin import resolve_cdi
from standin.dra_client import DraCallError
from standin.node import SimulatedNode
from standin.workloads import delete_pod

from kube.client import KubeApi

pytestmark = pytest.mark.e2e

DYNAMIC_MIG = ([{"model": "H100-80GB", "count": 1}], {"default": {"mig": "dynamic"}})
MPS_SLOTS = ([{"model": "H100-80GB", "count": 1}],
             {"default": {"wholeGpu": False, "slots": {"count": 2, "strategy": "mps"}}})


def crash_during_prepare(node: SimulatedNode, pod: dict[str, Any], step: str) -> dict[str, Any]:
    """Restart the plugin with the crash hook armed, let the kubelet's prepare kill it; the checkpoint record
    the dead process left behind."""
    node.restart_plugin(env={"GPU_DRA_FAULT": f"crash-after:{step}"})
    with pytest.raises(DraCallError):
        node.kubelet.prepare_pod(pod)
    assert node.plugin.wait_exit() == 137, node.plugin.log_tail()
    [record] = node.checkpoint_claims().values()
    assert record["state"] == "PrepareStarted"
    return record


def prepare_again_and_clean_up(kube: KubeApi, node: SimulatedNode, namespace: str, pod: dict[str, Any],
                               claim: str) -> None:
    """The kubelet retries the prepare: a valid answer; then the pod goes and unprepare leaves nothing."""
    prepared = node.kubelet.prepare_pod(pod)
    [device] = prepared.devices[claim]
    cdi_ids = prepared.container_cdi_ids[next(iter(prepared.container_cdi_ids))]
    assert cdi_ids and set(device.cdi_device_ids) <= set(cdi_ids)
    env = resolve_cdi([node.dirs.cdi], cdi_ids).env_map()      # every ID resolves in a spec on disk
    [record] = node.checkpoint_claims().values()
    assert record["state"] == "PrepareCompleted"
    if node.mig_devices():
        [live] = node.mig_devices()                            # exactly one MIG device, the one handed out
        assert env["NVIDIA_VISIBLE_DEVICES"] == live.uuid
        assert node.metrics()["gpu_dra_dynamic_mig_devices"] == 1

    delete_pod(kube, namespace, pod["metadata"]["name"])
    assert [r.uid for r in node.kubelet.unprepare_pod(pod)] == [prepared.claims[claim].uid]
    assert_nothing_left(node)


def test_crash_after_mig_created_leaves_an_orphan_that_the_next_start_destroys(kube, namespace, make_node):
    node = make_node(*DYNAMIC_MIG)
    pod, = run_example(kube, node, namespace, "mig-partition")
    record = crash_during_prepare(node, pod, "mig-created")
    # The hardware kept the MIG device; the checkpoint never learnt about it.
    [orphan] = node.mig_devices()
    assert record["undo"].get("migDevices", []) == []

    node.restart_plugin()
    assert node.mig_devices() == []                # destroyed at start-up as owned by no prepared claim
    assert node.checkpoint_claims() == {}          # the half-done claim was rolled back
    log = node.plugin.log_path.read_text()
    assert orphan.uuid in log and "destroyed MIG device not owned by any prepared claim" in log

    prepare_again_and_clean_up(kube, node, namespace, pod, "mig")


def test_crash_after_cdi_written_is_rolled_back_and_prepared_again(kube, namespace, make_node):
    node = make_node(*DYNAMIC_MIG)
    pod, = run_example(kube, node, namespace, "mig-partition")
    record = crash_during_prepare(node, pod, "cdi-written")
    [created] = node.mig_devices()
    assert [m["migUuid"] for m in record["undo"]["migDevices"]] == [created.uuid]
    assert len(node.cdi_spec_files()) == 1

    node.restart_plugin()
    # everything the dead process did is undone at start-up: MIG device, CDI spec, checkpoint record
    assert node.mig_devices() == [] and node.cdi_spec_files() == [] and node.checkpoint_claims() == {}

    prepare_again_and_clean_up(kube, node, namespace, pod, "mig")
    assert created.uuid not in {m.uuid for m in node.mig_devices()}


@pytest.mark.parametrize("setup, example, claim, step", [
    (DYNAMIC_MIG, "mig-partition", "mig", "checkpoint-started"),
    (MPS_SLOTS, "mps-slot", "slot", "mps-use-recorded"),
    (MPS_SLOTS, "mps-slot", "slot", "mps-compute-mode-set"),
    (MPS_SLOTS, "mps-slot", "slot", "mps-started"),
], ids=["checkpoint-started", "mps-use-recorded", "mps-compute-mode-set", "mps-started"])
def test_crash_at_other_steps_recovers(kube, namespace, make_node, setup, example, claim, step):
    node = make_node(*setup)
    pod, = run_example(kube, node, namespace, example)
    record = crash_during_prepare(node, pod, step)
    if step.startswith("mps-"):
        assert record["undo"]["mpsDevices"]        # recorded before the daemon started
    node.restart_plugin()
    assert node.checkpoint_claims() == {} and node.mig_devices() == [] and node.cdi_spec_files() == []
    prepare_again_and_clean_up(kube, node, namespace, pod, claim)


def test_a_crash_before_a_daemon_records_rename_leaves_no_file_or_directory_behind(kube, namespace, make_node):
    """SIGKILL after an MPS daemon record's temporary file is written and before it is renamed: the next start
    deletes that file (one line names it) and with it the daemon's directory goes; no line says a directory was
    removed that is still there, at that start or a later one."""
    node = make_node(*MPS_SLOTS)
    pod, = run_example(kube, node, namespace, "mps-slot")
    record = crash_during_prepare(node, pod, "mps-record-temp-written")
    assert record["undo"]["mpsDevices"]
    [temp] = (node.dirs.state / "mps").glob("*/.daemon.json.*.tmp")
    daemon_dir = temp.parent
    assert not (daemon_dir / "daemon.json").exists()

    logs = []
    for _ in range(2):                              # the start after the crash, and a later one
        node.restart_plugin()
        assert not daemon_dir.exists(), sorted(p.name for p in daemon_dir.iterdir())
        assert node.checkpoint_claims() == {}
        logs.append(node.plugin.log_path.read_text())
        for line in logs[-1].splitlines():
            if "removed MPS daemon directory" in line:
                assert not Path(line.split("removed MPS daemon directory ")[1].split(":")[0]).exists(), line
    [removed] = [line for line in logs[0].splitlines() if "removed temporary files of writes a crash cut short" in line]
    assert str(temp) in removed
    assert str(temp) not in logs[1]                 # nothing was left for the later start

    prepare_again_and_clean_up(kube, node, namespace, pod, "slot")


def test_corrupt_checkpoint_is_moved_aside_with_one_log_line(make_node):
    node = make_node(*DYNAMIC_MIG)
    node.plugin.stop()
    checkpoint = node.dirs.state / "checkpoint.json"
    assert checkpoint.exists()
    checkpoint.write_bytes(b'{"schemaVersion": 1, "claims": {"x": ')   # torn by a disk fault

    node.restart_plugin()
    node.wait_for_slices()
    [moved] = node.dirs.state.glob("checkpoint.json.corrupt-*")
    assert moved.read_bytes() == b'{"schemaVersion": 1, "claims": {"x": '
    assert node.checkpoint()["claims"] == {}      # a fresh, readable checkpoint
    lines = [line for line in node.plugin.log_path.read_text().splitlines() if "unreadable" in line]
    assert len(lines) == 1, lines
    assert str(checkpoint) in lines[0] and str(moved) in lines[0]
