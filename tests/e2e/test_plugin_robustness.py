"""The kubelet plugin's robustness end to end, on the real control plane with a kubelet stand-in: a checkpoint
lost while a claim is in use, a crash right after a time-slice change, a fatal XID across a plugin restart, and
the plugin's /healthz, /livez and /metrics. The simulated GPUs live in the plugin's --sim-state file, so like
hardware they keep their MIG devices across restarts; ``gpu-dra simulate`` injects faults as its own process."""
from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from plugin_helpers import assert_nothing_left, run_example
from standin import resolve_cdi
from standin.dra_client import DraCallError
from standin.node import REPO, SimulatedNode
from standin.workloads import delete_pod, slice_devices

pytestmark = pytest.mark.e2e

DYNAMIC_MIG = ([{"model": "H100-80GB", "count": 1}], {"default": {"mig": "dynamic"}})
TIME_SLICED = ([{"model": "H100-80GB", "count": 1}],
               {"default": {"wholeGpu": False, "slots": {"count": 4, "strategy": "time-slicing"}}})
TORN = b'{"schemaVersion": 1, "claims": {"x": '


def http_get(node: SimulatedNode, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def log_lines(node: SimulatedNode, text: str) -> list[str]:
    return [line for line in node.plugin.log_path.read_text().splitlines() if text in line]


def test_lost_checkpoint_keeps_the_claim_in_use_and_its_unprepare_still_cleans_up(kube, namespace, make_node):
    node = make_node(*DYNAMIC_MIG)
    pod, = run_example(kube, node, namespace, "mig-partition")
    before = node.kubelet.prepare_pod(pod)
    claim = before.claims["mig"]
    ids = before.container_cdi_ids["cuda"]
    [created] = node.mig_devices()
    specs = node.cdi_spec_files()

    node.plugin.stop()
    (node.dirs.state / "checkpoint.json").write_bytes(TORN)      # lost while the pod runs
    node.restart_plugin()

    # Nothing of the running pod was destroyed: its MIG device and CDI spec are there, its IDs still resolve.
    assert node.mig_devices() == [created] and node.cdi_spec_files() == specs
    assert resolve_cdi([node.dirs.cdi], ids).env_map()["NVIDIA_VISIBLE_DEVICES"] == created.uuid
    [line] = log_lines(node, "prepared-claim state was lost")
    assert "destroys no MIG device and deletes no CDI spec" in line and claim.uid in line
    assert node.checkpoint_claims()[claim.uid]["recovered"] is True
    assert node.metrics()["gpu_dra_dynamic_mig_devices"] == 1

    # The kubelet's repeated prepare gets the answer of before; the unprepare leaves nothing behind.
    again = node.kubelet.client(node.driver).prepare([claim])[claim.uid]
    assert again.devices == before.devices["mig"]
    delete_pod(kube, namespace, pod["metadata"]["name"])
    assert [r.uid for r in node.kubelet.unprepare_pod(pod)] == [claim.uid]
    assert_nothing_left(node)


def test_crash_right_after_a_time_slice_change_is_rolled_back(kube, namespace, make_node):
    node = make_node(*TIME_SLICED)
    pod, = run_example(kube, node, namespace, "time-slicing-slot")
    node.restart_plugin(env={"GPU_DRA_FAULT": "crash-after:timeslice-applied"})
    with pytest.raises(DraCallError):
        node.kubelet.prepare_pod(pod)
    assert node.plugin.wait_exit() == 137
    [record] = node.checkpoint_claims().values()
    assert record["state"] == "PrepareStarted"
    [intent] = record["undo"]["timeSlices"]                      # written before the GPU was changed
    assert (intent["interval"], intent["previous"]) == ("Long", "Default")

    node.restart_plugin()
    assert node.checkpoint_claims() == {}
    [line] = log_lines(node, "driver state recovered")
    assert f"rolled_back=['{record['uid']}']" in line            # rolled back at start-up
    prepared = node.kubelet.prepare_pod(pod)
    [slot] = prepared.devices["slot"]
    delete_pod(kube, namespace, pod["metadata"]["name"])
    assert [r.uid for r in node.kubelet.unprepare_pod(pod)] == [prepared.claims["slot"].uid]
    assert_nothing_left(node)
    assert slot.device_name.startswith("gpu-0-slot-")


def simulate(node: SimulatedNode, *args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "cli.main", "simulate", *args, "--sim-state", str(node.dirs.sim_state)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def taints(node: SimulatedNode) -> dict[str, list[dict[str, Any]]]:
    return {d["name"]: d.get("taints") or [] for d in slice_devices(node.wait_for_slices())}


def wait_for(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_fatal_xid_stays_tainted_across_a_plugin_restart(make_node):
    node = make_node([{"model": "H100-80GB", "count": 2}], extra_args=("--health-quiet-period", "0"))
    simulate(node, "xid", "--gpu", "1", "--xid", "79")
    tainted = wait_for(lambda: taints(node)["gpu-1"], 20, "the XID to taint gpu-1")
    assert [(t["key"], t["value"], t["effect"]) for t in tainted] == [(f"{node.driver}/xid", "79", "NoSchedule")]

    node.restart_plugin()
    plugin = node.kubelet.watcher.plugin(node.driver)
    watch = plugin.client.watch_health(plugin.health_service)
    try:
        # The new process reports the GPU unhealthy from its first message: the XID itself is history now.
        first = watch.wait_for(lambda u: True, timeout=20)
        health = {name: h for (_, name), (h, _) in first.devices.items()}
        assert health["gpu-1"] == "UNHEALTHY" and health["gpu-0"] == "HEALTHY"
    finally:
        watch.close()
    time.sleep(3)                      # time for a (wrong) untainted republish to reach the API server
    assert taints(node)["gpu-1"] == tainted and taints(node)["gpu-0"] == []   # timeAdded kept too

    simulate(node, "recover", "--gpu", "1")
    wait_for(lambda: taints(node)["gpu-1"] == [], 20, "recover to clear gpu-1")
    node.restart_plugin()
    time.sleep(3)
    assert taints(node)["gpu-1"] == []


def test_health_and_metrics_endpoint(make_node):
    node = make_node([{"model": "L4", "count": 1}])
    assert http_get(node, "/healthz") == (200, "ok\n")
    assert http_get(node, "/livez") == (200, "ok\n")
    status, text = http_get(node, "/metrics")
    assert status == 200
    created = [line for line in text.splitlines()
               if line.startswith("gpu_dra_resourceslice_writes_total") and f'driver="{node.driver}"' in line
               and 'operation="create"' in line]
    assert created and float(created[0].rsplit(" ", 1)[1]) >= 1, text
    assert f'gpu_dra_resourceslice_pool_syncs_total{{driver="{node.driver}",result="ok"}}' in text
    assert "gpu_dra_kubelet_registered 1.0" in text

    # The registration socket gone (a wiped registry directory): not alive any more, a restart cures it.
    next(node.dirs.registry.glob("*.sock")).unlink()
    status, body = http_get(node, "/livez")
    assert status == 503 and "does not answer GetInfo" in body, body
    node.restart_plugin()
    assert http_get(node, "/healthz") == (200, "ok\n")
