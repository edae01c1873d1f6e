"""Mutual exclusion through shared counters, enforced by the real scheduler.

Each test has a node of its own with a single H100 (whole GPU + dynamic MIG + N time-slicing slots) and a
driver name of its own, so the scheduler has no other device to fall back to: a claim that would overlap
what is already allocated stays unallocated, and the scheduler says why on the pod."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from allocation_helpers import (
    PublishedFleet,
    allocated_devices,
    claim_with_pod,
    temporary_namespace,
    wait_allocated,
    wait_unschedulable,
)

from kube.client import KubeApi
from testbed.demo_examples import apply_objects

pytestmark = pytest.mark.e2e

SLOTS = 3
UNALLOCATABLE = "cannot allocate all claims"


@pytest.fixture
def one_gpu(cluster: Any, api_client: Any, driver_name: str, tmp_path: Path) -> Iterator[PublishedFleet]:
    prefix = driver_name.split(".")[0]
    doc = {"nodes": [{"name": f"{prefix}-solo", "gpus": [{"model": "H100-80GB", "count": 1}],
                      "policy": {"default": {"wholeGpu": True, "mig": "dynamic",
                                             "slots": {"count": SLOTS, "strategy": "time-slicing"}}}}]}
    fleet = PublishedFleet(cluster, api_client, driver_name, doc, tmp_path).publish()
    yield fleet
    fleet.remove()


@pytest.fixture
def ns(api_client: Any, driver_name: str) -> Iterator[str]:
    with temporary_namespace(api_client, "mx-" + driver_name.split(".")[0]) as name:
        yield name


class Claims:
    """Creates claim + pod pairs for one fleet's DeviceClasses in one namespace."""

    def __init__(self, api_client: Any, fleet: PublishedFleet, ns: str) -> None:
        self.kube, self.driver, self.ns = KubeApi(api_client), fleet.driver, ns

    def add(self, name: str, kind: str, profile: str | None = None) -> str:
        device_class = self.driver if kind == "gpu" else f"{kind}.{self.driver}"
        cel = f"device.attributes['{self.driver}'].profile == '{profile}'" if profile else None
        apply_objects(self.kube, claim_with_pod(name, device_class, cel), self.ns)
        return name

    def allocated(self, name: str) -> str:
        (device,) = allocated_devices(wait_allocated(self.kube, self.ns, name))
        return device

    def waiting(self, name: str) -> str:
        message = wait_unschedulable(self.kube, self.ns, name)
        assert UNALLOCATABLE in message, message
        return message


def test_a_whole_gpu_excludes_its_partitions_and_slots(api_client: Any, one_gpu: PublishedFleet, ns: str) -> None:
    claims = Claims(api_client, one_gpu, ns)
    assert claims.allocated(claims.add("whole", "gpu")) == "gpu-0"
    claims.waiting(claims.add("partition", "mig", "1g.10gb"))
    claims.waiting(claims.add("slot", "slot"))
    # The slices do offer both: only the counters the whole GPU consumed stand in the way.
    devices = one_gpu.devices()
    node = one_gpu.node_names[0]
    assert (one_gpu.driver, node, "gpu-0-slot-0") in devices
    assert any(name.startswith("gpu-0-mig-1g10gb-") for (_, _, name) in devices)


def test_slots_coexist_up_to_their_count_and_exclude_partitions_and_the_whole_gpu(
        api_client: Any, one_gpu: PublishedFleet, ns: str) -> None:
    claims = Claims(api_client, one_gpu, ns)
    got = {claims.allocated(claims.add(f"slot-{k}", "slot")) for k in range(SLOTS)}
    assert got == {f"gpu-0-slot-{k}" for k in range(SLOTS)}
    claims.waiting(claims.add("one-slot-too-many", "slot"))
    claims.waiting(claims.add("partition", "mig", "1g.10gb"))
    claims.waiting(claims.add("whole", "gpu"))


def test_a_slot_alone_already_excludes_partitions(api_client: Any, one_gpu: PublishedFleet, ns: str) -> None:
    claims = Claims(api_client, one_gpu, ns)
    assert claims.allocated(claims.add("slot", "slot")).startswith("gpu-0-slot-")
    claims.waiting(claims.add("smallest-partition", "mig", "1g.10gb"))


def test_overlapping_partitions_exclude_each_other_and_disjoint_ones_fit(
        api_client: Any, one_gpu: PublishedFleet, ns: str) -> None:
    claims = Claims(api_client, one_gpu, ns)
    four = claims.allocated(claims.add("four", "mig", "4g.40gb"))
    three = claims.allocated(claims.add("three", "mig", "3g.40gb"))
    # 4g.40gb can only start at memory slice 0; the 3g.40gb beside it must then start at 4.
    assert four.startswith("gpu-0-mig-4g40gb-") and four.endswith("-0"), four
    assert three.startswith("gpu-0-mig-3g40gb-") and three.endswith("-4"), three
    claims.waiting(claims.add("second-four", "mig", "4g.40gb"))
    claims.waiting(claims.add("any-slot", "slot"))
    claims.waiting(claims.add("whole", "gpu"))
