"""A plugin restart between prepare and unprepare: the new process must take the prepared claims over from its
checkpoint, answer a repeated prepare identically, and undo everything on unprepare. The simulated GPUs live in
the plugin's --sim-state file, so like hardware they keep their MIG devices across the restart."""
from __future__ import annotations

import pytest
from plugin_helpers import assert_nothing_left, run_example
from standin import resolve_cdi
from standin.workloads import delete_pod

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("crash", [False, True], ids=["sigterm", "sigkill"])
def test_dynamic_mig_survives_a_plugin_restart(kube, namespace, make_node, crash):
    node = make_node([{"model": "H100-80GB", "count": 1}], {"default": {"mig": "dynamic"}})
    pod, = run_example(kube, node, namespace, "mig-partition")
    before = node.kubelet.prepare_pod(pod)
    ids = before.container_cdi_ids["cuda"]
    visible = resolve_cdi([node.dirs.cdi], ids).env_map()["NVIDIA_VISIBLE_DEVICES"]
    claim = before.claims["mig"]
    [created] = node.mig_devices()
    assert created.uuid == visible

    node.restart_plugin(crash=crash)
    if not crash:
        assert ("deregistered", node.driver) in [(e, d) for e, d, _ in node.kubelet.watcher.history]
    # the MIG device outlived the process in the simulated hardware and the new process adopted it (start-up
    # cleanup destroys only MIG devices no prepared claim owns)
    assert node.mig_devices() == [created]
    assert node.metrics()["gpu_dra_dynamic_mig_devices"] == 1
    # the claim stays prepared across the restart: same CDI file, and a repeated prepare (a kubelet that
    # restarted too) gets the same devices from the new process
    assert resolve_cdi([node.dirs.cdi], ids).env_map()["NVIDIA_VISIBLE_DEVICES"] == visible
    again = node.kubelet.client(node.driver).prepare([claim])[claim.uid]
    assert again.devices == before.devices["mig"]
    assert node.metrics()["gpu_dra_prepared_claims"] == 1

    delete_pod(kube, namespace, pod["metadata"]["name"])
    assert [r.uid for r in node.kubelet.unprepare_pod(pod)] == [claim.uid]
    assert_nothing_left(node)


def test_mps_slot_after_a_crash(kube, namespace, make_node):
    node = make_node([{"model": "H100-80GB", "count": 1}],
                     {"default": {"wholeGpu": False, "slots": {"count": 2, "strategy": "mps"}}})
    pod, = run_example(kube, node, namespace, "mps-slot")
    before = node.kubelet.prepare_pod(pod)
    record, = node.checkpoint_claims().values()
    assert record["undo"]["mpsDevices"]

    node.restart_plugin(crash=True)
    assert node.kubelet.prepared_pod(pod).container_cdi_ids == before.container_cdi_ids
    assert set(node.checkpoint_claims()) == {before.claims["slot"].uid}

    delete_pod(kube, namespace, pod["metadata"]["name"])
    node.kubelet.unprepare_pod(pod)
    assert_nothing_left(node)
