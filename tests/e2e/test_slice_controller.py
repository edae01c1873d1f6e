"""The ResourceSlice controller against a real API server: exact state, minimal writes, generations as
upstream counts them, recovery from external deletes and from an unreachable API server."""
from __future__ import annotations

import json
import logging
import re
import socket
import time
from typing import Any

import pytest
from e2e_helpers import TcpForwarder, consuming_device, counter_sets, gpu_devices, pool_summary, slices_of
from kubernetes import client as kclient
from prometheus_client import REGISTRY
from standin.workloads import wait_until

from kube.backoff import Backoff
from kube.client import SLICES, KubeApi
from kube.resourceslices import SPEC_ANNOTATION, DesiredPool, Owner, ResourceSliceController, slice_name
from kube.serverversion import fetch_server_minor
from testbed.localcluster import free_port

pytestmark = pytest.mark.e2e

SYNC_DELAY = 0.3


@pytest.fixture
def node(cluster: Any, driver_name: str) -> str:
    name = driver_name.split(".")[0] + "-node"
    cluster.add_node(name)
    return name


def controller(api_client: Any, driver: str, owner: Owner, **kw: Any) -> ResourceSliceController:
    kw.setdefault("sync_delay", SYNC_DELAY)
    kw.setdefault("backoff", Backoff(initial=0.1, maximum=2.0))
    return ResourceSliceController(api_client, driver, owner, **kw)


def three_slices(node: str, spare_memory: str = "80Gi", mig_memory: str = "10Gi") -> DesiredPool:
    """Counters, devices consuming them, plain devices: the shapes a GPU node publishes. The counter is
    spelled in a non-canonical form that the API server rewrites ("81920Mi" is stored as "80Gi")."""
    return DesiredPool(node_name=node, slices=[
        counter_sets("gpu-0-counters", memory="81920Mi"),
        {"devices": [consuming_device("gpu-0", "gpu-0-counters", "80Gi"),
                     consuming_device("gpu-0-mig-1g10gb-19-0", "gpu-0-counters", mig_memory)]},
        gpu_devices("gpu-spare", 2, memory=spare_memory),
    ])


def assert_pool(api_client: Any, driver: str, generation: int, count: int) -> None:
    """Exactly `count` slices, all at `generation` and saying there are `count`: a complete pool."""
    assert list(pool_summary(slices_of(api_client, driver)).values()) == [(generation, count)] * count


def delta(ctl: ResourceSliceController, before: dict[str, int]) -> dict[str, int]:
    now = ctl.writes_by_operation
    return {op: now.get(op, 0) - before.get(op, 0) for op in set(now) | set(before) if now.get(op, 0) != before.get(op, 0)}


def test_first_start_writes_every_slice_and_a_restart_writes_nothing(api_client: Any, cluster: Any,
                                                                     driver_name: str, node: str) -> None:
    desired = {node: three_slices(node)}
    with controller(api_client, driver_name, Owner.node(node)) as first:
        first.update(desired)
        assert first.wait_for_sync(30), first.errors
        assert first.writes_by_operation == {"create": 3}
    created = slices_of(api_client, driver_name)
    assert [s["metadata"]["name"] for s in created] == [slice_name(driver_name, node, i) for i in range(3)]
    assert list(pool_summary(created).values()) == [(1, 3)] * 3
    assert created[0]["spec"]["sharedCounters"][0]["counters"]["memory"]["value"] == "80Gi"
    node_uid = cluster.request("GET", f"/api/v1/nodes/{node}")["metadata"]["uid"]
    for s in created:
        assert s["spec"]["nodeName"] == node and s["spec"]["driver"] == driver_name
        assert s["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}]
    assert REGISTRY.get_sample_value("gpu_dra_resourceslice_writes_total",
                                     {"driver": driver_name, "operation": "create"}) == 3

    # A restart with the same hardware: watch, list and compare, but not a single write.
    with controller(api_client, driver_name, Owner.node(node)) as second:
        second.update(desired)
        assert second.wait_for_sync(30), second.errors
        time.sleep(3 * SYNC_DELAY)   # let watch events of the start-up settle
        assert second.writes == 0
    one_shot = controller(api_client, driver_name, Owner.node(node))
    one_shot.update(desired)
    one_shot.run_once(timeout=30)
    assert one_shot.writes == 0
    after = slices_of(api_client, driver_name)
    assert [s["metadata"]["resourceVersion"] for s in after] == [s["metadata"]["resourceVersion"] for s in created]


def test_generation_follows_the_upstream_rule(api_client: Any, driver_name: str, node: str) -> None:
    with controller(api_client, driver_name, Owner.node(node)) as ctl:
        def publish(pool: DesiredPool) -> dict[str, int]:
            before = ctl.writes_by_operation
            ctl.update({node: pool})
            assert ctl.wait_for_sync(30), ctl.errors
            return delta(ctl, before)

        assert publish(three_slices(node)) == {"create": 3}
        # One slice changes: updated in place, the generation stays.
        assert publish(three_slices(node, spare_memory="40Gi")) == {"update": 1}
        slices = slices_of(api_client, driver_name)
        assert_pool(api_client, driver_name, 1, 3)
        assert slices[2]["spec"]["devices"][0]["capacity"]["memory"]["value"] == "40Gi"
        # Two slices change: generation + 1 and every slice is rewritten with it.
        assert publish(three_slices(node, spare_memory="20Gi", mig_memory="20Gi")) == {"update": 3}
        assert_pool(api_client, driver_name, 2, 3)
        # A slice is added: generation + 1, resourceSliceCount follows.
        four = three_slices(node, spare_memory="20Gi", mig_memory="20Gi")
        four.slices.append(gpu_devices("gpu-extra", 1))
        assert publish(four) == {"update": 3, "create": 1}
        assert_pool(api_client, driver_name, 3, 4)
        # Two slices are removed: deleted first, the rest rewritten with generation + 1.
        two = DesiredPool(node_name=node, slices=four.slices[:2])
        assert publish(two) == {"delete": 2, "update": 2}
        assert pool_summary(slices_of(api_client, driver_name)) == {
            slice_name(driver_name, node, 0): (4, 2), slice_name(driver_name, node, 1): (4, 2)}
        # The driver may force a higher generation.
        assert publish(DesiredPool(node_name=node, slices=two.slices, generation=10)) == {"update": 2}
        assert_pool(api_client, driver_name, 10, 2)
        # Nothing changed: nothing written.
        assert publish(DesiredPool(node_name=node, slices=two.slices, generation=10)) == {}


def test_pools_no_longer_desired_are_deleted_within_the_owners_scope(api_client: Any, cluster: Any,
                                                                      driver_name: str, node: str) -> None:
    other = node + "-b"
    cluster.add_node(other)
    with controller(api_client, driver_name, Owner.cluster()) as fleet:
        fleet.update({node: DesiredPool(node_name=node, slices=[gpu_devices("gpu", 2)]),
                      other: DesiredPool(node_name=other, slices=[gpu_devices("gpu", 1), gpu_devices("big", 1)])})
        assert fleet.wait_for_sync(30), fleet.errors
        assert len(slices_of(api_client, driver_name)) == 3
        fleet.update({node: DesiredPool(node_name=node, slices=[gpu_devices("gpu", 2)])})
        assert fleet.wait_for_sync(30), fleet.errors
        assert fleet.writes_by_operation == {"create": 3, "delete": 2}
    assert {s["spec"]["nodeName"] for s in slices_of(api_client, driver_name)} == {node}

    # A node-local controller only sees its own node: an empty desired state there leaves `node` alone.
    local = controller(api_client, driver_name, Owner.node(other))
    local.update({})
    local.run_once(timeout=30)
    assert local.writes == 0
    assert len(slices_of(api_client, driver_name)) == 1


def test_externally_deleted_or_edited_slices_are_restored(api_client: Any, driver_name: str, node: str) -> None:
    kube = KubeApi(api_client)
    with controller(api_client, driver_name, Owner.node(node)) as ctl:
        ctl.update({node: three_slices(node)})
        assert ctl.wait_for_sync(30), ctl.errors
        before = ctl.writes_by_operation

        # Someone edits one slice: the watch notices, the slice is put back, the generation stays.
        victim = slices_of(api_client, driver_name)[2]
        victim["spec"]["devices"] = victim["spec"]["devices"][:1]
        kube.replace(SLICES, victim)
        wait_until(lambda: len(slices_of(api_client, driver_name)[2]["spec"]["devices"]) == 2, 15,
                   "the edited slice to be restored")
        assert ctl.wait_for_sync(5)
        assert delta(ctl, before) == {"update": 1}
        assert_pool(api_client, driver_name, 1, 3)

        # Someone deletes one slice: recreated; the pool gets a new generation as upstream does.
        before = ctl.writes_by_operation
        gone = slices_of(api_client, driver_name)[1]["metadata"]["name"]
        kube.delete(SLICES, gone)
        wait_until(lambda: list(pool_summary(slices_of(api_client, driver_name)).values()) == [(2, 3)] * 3, 15,
                   "the pool to be complete again")
        assert ctl.wait_for_sync(5)
        assert delta(ctl, before) == {"create": 1, "update": 2}
        assert gone in pool_summary(slices_of(api_client, driver_name))


def test_within_a_resync_window_deleted_slices_come_back_at_once(api_client: Any, driver_name: str,
                                                                  node: str) -> None:
    """A restarted kubelet deletes its node's slices while it registers the plugin, possibly after the plugin's
    resync: within resync's prompt window a delete is undone at once; outside it, only after sync_delay."""
    kube = KubeApi(api_client)

    def present(name: str) -> bool:
        return name in pool_summary(slices_of(api_client, driver_name))

    with controller(api_client, driver_name, Owner.node(node), sync_delay=60.0) as ctl:
        ctl.update({node: three_slices(node)})
        assert ctl.wait_for_sync(30), ctl.errors
        first = slices_of(api_client, driver_name)[1]["metadata"]["name"]
        kube.delete(SLICES, first)
        time.sleep(3)
        assert not present(first)                  # no window: the watch event waits for sync_delay (60 s)
        ctl.resync(prompt_for=30)                  # the resync itself restores it ...
        wait_until(lambda: present(first), 10, "the resync to restore the deleted slice")
        assert ctl.wait_for_sync(10)
        second = slices_of(api_client, driver_name)[2]["metadata"]["name"]
        t0 = time.monotonic()
        kube.delete(SLICES, second)                # ... and a delete after it, within the window, is undone at once
        wait_until(lambda: present(second), 10, "a delete within the window to be undone")
        assert time.monotonic() - t0 < 10


def test_an_edited_slice_that_carries_our_annotation_along_is_restored(api_client: Any, driver_name: str,
                                                                       node: str) -> None:
    """Edits that keep our annotation valid-looking: an edited copy put in place of the slice (what `kubectl
    replace --force` does: generation 1 again, the value our annotation names for a created slice), and one
    patch that changes the spec and raises the annotation's generation with it. Neither is the slice our
    write made (another uid, another generation), so both are compared in full and put back."""
    kube = KubeApi(api_client)
    with controller(api_client, driver_name, Owner.node(node)) as ctl:
        ctl.update({node: three_slices(node)})
        assert ctl.wait_for_sync(30), ctl.errors

        def spare_devices() -> int:
            return len(slices_of(api_client, driver_name)[2]["spec"]["devices"])

        victim = slices_of(api_client, driver_name)[2]
        name = victim["metadata"]["name"]
        copy = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": {k: v for k, v in victim["metadata"].items()
                             if k in ("name", "labels", "annotations", "ownerReferences")},
                "spec": {**victim["spec"], "devices": victim["spec"]["devices"][:1]}}
        kube.delete(SLICES, name)
        stored = kube.create(SLICES, copy)
        note = json.loads(stored["metadata"]["annotations"][SPEC_ANNOTATION])
        assert note["generation"] == stored["metadata"]["generation"] == 1
        wait_until(lambda: spare_devices() == 2, 15, "the slice replaced by an edited copy to be restored")
        assert ctl.wait_for_sync(5), ctl.errors

        victim = kube.get(f"{SLICES}/{name}")
        note = json.loads(victim["metadata"]["annotations"][SPEC_ANNOTATION])
        note["generation"] = victim["metadata"]["generation"] + 1
        patched = kube.request("PATCH", f"{SLICES}/{name}", content_type="application/merge-patch+json", body={
            "metadata": {"annotations": {SPEC_ANNOTATION: json.dumps(note)}},
            "spec": {"devices": victim["spec"]["devices"][:1]}})
        assert patched["metadata"]["generation"] == note["generation"]
        wait_until(lambda: spare_devices() == 2, 15, "the slice patched with its annotation to be restored")
        assert ctl.wait_for_sync(5), ctl.errors
        summary = list(pool_summary(slices_of(api_client, driver_name)).values())
        assert len(summary) == 3 and len(set(summary)) == 1 and summary[0][1] == 3    # one complete pool


def test_unreachable_api_server_is_retried_with_growing_back_off(api_client: Any, cluster: Any, driver_name: str,
                                                                 node: str, caplog: pytest.LogCaptureFixture) -> None:
    # A client whose API server address is a closed port until the forwarder starts listening there.
    port = free_port()
    conf = kclient.Configuration()
    conf.host = f"https://127.0.0.1:{port}"
    conf.ssl_ca_cert = str(cluster.ca_file)
    conf.api_key = {"authorization": f"Bearer {cluster.token}"}
    unreachable = kclient.ApiClient(conf)
    forwarder = TcpForwarder(port, cluster.ports["apiserver"])
    caplog.set_level(logging.WARNING, logger="kube.resourceslices")
    ctl = controller(unreachable, driver_name, Owner.node(node), backoff=Backoff(initial=0.1, maximum=0.8))
    try:
        with ctl:
            ctl.update({node: DesiredPool(node_name=node, slices=[gpu_devices("gpu", 2)])})
            assert not ctl.wait_for_sync(2.0)
            assert node in ctl.errors and "ApiUnavailable" in ctl.errors[node]
            assert slices_of(api_client, driver_name) == []
            forwarder.start()
            assert ctl.wait_for_sync(15), ctl.errors
            assert ctl.writes_by_operation == {"create": 1}
    finally:
        forwarder.stop()
        unreachable.close()
    assert forwarder.connections > 0
    assert len(slices_of(api_client, driver_name)) == 1
    delays = [float(m.group(1)) for r in caplog.records
              if f"pool {node}: sync failed" in r.getMessage()
              for m in [re.search(r"retrying in ([0-9.]+)s", r.getMessage())] if m]
    assert len(delays) >= 4, delays
    assert delays[:4] == [0.1, 0.2, 0.4, 0.8]
    assert all(d <= 0.8 for d in delays)


def test_server_minor_version(api_client: Any) -> None:
    assert fetch_server_minor(api_client) == 37


def test_closed_port_fails_fast_with_a_clear_error(cluster: Any) -> None:
    from kube.client import ApiUnavailable

    with socket.socket() as s:   # nothing listens on a port we bound but never listened on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        conf = kclient.Configuration()
        conf.host = f"https://127.0.0.1:{port}"
        with pytest.raises(ApiUnavailable, match=f"127.0.0.1:{port}"):
            KubeApi(kclient.ApiClient(conf)).get("/version")
