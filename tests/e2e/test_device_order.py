"""The documented device order (docs/devices.md, "Device order") on a dense node, in the real scheduler.

kube-scheduler visits a pool's slices in name order. A node of 8 H100s with the whole GPU, dynamic MIG and 40
time-slicing slots each needs 17 slices, so slice names must sort like the pool's indexes (`-10` sorting
before `-2` sent the second whole-GPU claim to gpu-5)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from allocation_helpers import PublishedFleet, allocated_devices, claim_with_pod, temporary_namespace, wait_allocated

from kube.client import KubeApi
from kube.resourceslices import slice_name
from testbed.demo_examples import apply_objects

pytestmark = pytest.mark.e2e

GPUS = 8


@pytest.fixture
def dense_node(cluster: Any, api_client: Any, driver_name: str, tmp_path: Path) -> Iterator[PublishedFleet]:
    prefix = driver_name.split(".")[0]
    doc = {"nodes": [{"name": f"{prefix}-dense", "gpus": [{"model": "H100-80GB", "count": GPUS}],
                      "policy": {"default": {"wholeGpu": True, "mig": "dynamic",
                                             "slots": {"count": 40, "strategy": "time-slicing"}}}}]}
    fleet = PublishedFleet(cluster, api_client, driver_name, doc, tmp_path).publish()
    yield fleet
    fleet.remove()


def test_whole_gpu_claims_follow_the_documented_order_on_a_pool_of_many_slices(
        api_client: Any, dense_node: PublishedFleet) -> None:
    slices = dense_node.slices()
    assert len(slices) > 10, f"the pool needs more than ten slices to test the order, got {len(slices)}"
    kube = KubeApi(api_client)
    with temporary_namespace(api_client, f"order-{dense_node.driver.split('.')[0]}") as ns:
        got = []
        for k in range(GPUS):       # one at a time: each claim sees the previous ones allocated
            apply_objects(kube, claim_with_pod(f"whole-{k}", dense_node.driver), ns)
            got.extend(allocated_devices(wait_allocated(kube, ns, f"whole-{k}")))
    assert got == [f"gpu-{k}" for k in range(GPUS)]
    # Because the names the server holds sort in the pool's order.
    node = dense_node.node_names[0]
    assert sorted(s["metadata"]["name"] for s in slices) == [slice_name(dense_node.driver, node, i)
                                                             for i in range(len(slices))]
