"""Mutual exclusion through shared counters, enforced by the real scheduler.

Each test has a node of its own with a single H100 (whole GPU + dynamic MIG + N time-slicing slots, as N slot
devices or, with slots.layout: capacity, as one slot device with capacity slots: N) and a driver name of its
own, so the scheduler has no other device to fall back to: a claim that would overlap what is already
allocated stays unallocated, and the scheduler says why on the pod."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from allocation_helpers import (
    PublishedFleet,
    allocated_devices,
    claim_with_pod,
    get_claim,
    temporary_namespace,
    wait_allocated,
    wait_unschedulable,
)

from kube.client import ApiError, KubeApi, namespaced_collection
from testbed.demo_examples import apply_objects

pytestmark = pytest.mark.e2e

SLOTS = 3
UNALLOCATABLE = "cannot allocate all claims"


def _one_h100(cluster: Any, api_client: Any, driver_name: str, tmp_path: Path, layout: str,
              mig: dict[str, Any] | None = None) -> PublishedFleet:
    prefix = driver_name.split(".")[0]
    slots = {"count": SLOTS, "strategy": "time-slicing", "layout": layout}
    policy = {"wholeGpu": True, "mig": "dynamic", "slots": slots, **({"dynamicMig": mig} if mig else {})}
    doc = {"nodes": [{"name": f"{prefix}-solo", "gpus": [{"model": "H100-80GB", "count": 1}],
                      "policy": {"default": policy}}]}
    return PublishedFleet(cluster, api_client, driver_name, doc, tmp_path).publish()


@pytest.fixture
def one_gpu(cluster: Any, api_client: Any, driver_name: str, tmp_path: Path) -> Iterator[PublishedFleet]:
    fleet = _one_h100(cluster, api_client, driver_name, tmp_path, "devices")
    yield fleet
    fleet.remove()


@pytest.fixture
def slots_as_capacity(cluster: Any, api_client: Any, driver_name: str, tmp_path: Path) -> Iterator[PublishedFleet]:
    fleet = _one_h100(cluster, api_client, driver_name, tmp_path, "capacity")
    yield fleet
    fleet.remove()


@pytest.fixture
def mig_as_capacity(cluster: Any, api_client: Any, driver_name: str, tmp_path: Path) -> Iterator[PublishedFleet]:
    """The 3-device GPU: whole, 1g.10gb as one device with instances: 7, slots as one device with slots: 3."""
    fleet = _one_h100(cluster, api_client, driver_name, tmp_path, "capacity",
                      {"profiles": ["1g.10gb"], "layout": "capacity"})
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

    def add(self, name: str, kind: str, profile: str | None = None, capacity: dict[str, str] | None = None) -> str:
        device_class = self.driver if kind == "gpu" else f"{kind}.{self.driver}"
        cel = f"device.attributes['{self.driver}'].profile == '{profile}'" if profile else None
        apply_objects(self.kube, claim_with_pod(name, device_class, cel, capacity), self.ns)
        return name

    def allocated(self, name: str) -> str:
        (device,) = allocated_devices(wait_allocated(self.kube, self.ns, name))
        return device

    def result(self, name: str) -> dict[str, Any]:
        (result,) = wait_allocated(self.kube, self.ns, name)["status"]["allocation"]["devices"]["results"]
        return dict(result)

    def remove(self, name: str, timeout: float = 60.0) -> None:
        """Deletes the pod and its claim, and returns once the claim is gone (its allocation released)."""
        self.kube.request("DELETE", f"{namespaced_collection('Pod', self.ns)}/{name}",
                          body={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        self.kube.request("DELETE", f"{namespaced_collection('ResourceClaim', self.ns)}/{name}")
        deadline = time.monotonic() + timeout
        while True:
            try:
                get_claim(self.kube, self.ns, name)
            except ApiError as exc:
                if exc.not_found:
                    return
                raise
            assert time.monotonic() < deadline, f"claim {self.ns}/{name} still exists after {timeout:.0f} s"
            time.sleep(0.25)

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


# --------------------------------------------------------------------------- slots as capacity (one slot device)

def test_slot_shares_coexist_up_to_the_capacity_and_exclude_partitions_and_the_whole_gpu_until_the_last_goes(
        api_client: Any, slots_as_capacity: PublishedFleet, ns: str) -> None:
    devices = {name for (_, _, name) in slots_as_capacity.devices()}
    assert "gpu-0-slots" in devices and not any(n.startswith("gpu-0-slot-") for n in devices)
    claims = Claims(api_client, slots_as_capacity, ns)
    shares = [claims.result(claims.add(f"share-{k}", "slot")) for k in range(SLOTS)]
    assert {r["device"] for r in shares} == {"gpu-0-slots"}
    assert [r["consumedCapacity"] for r in shares] == [{"slots": "1"}] * SLOTS     # the requestPolicy default
    assert len({r["shareID"] for r in shares}) == SLOTS
    claims.waiting(claims.add("one-share-too-many", "slot"))
    claims.waiting(claims.add("partition", "mig", "1g.10gb"))
    claims.waiting(claims.add("whole", "gpu"))
    for name in ("partition", "whole", "share-0", "share-1"):
        claims.remove(name)
    # The slots freed let the waiting share in; a share is still out, so a partition asked for now waits.
    assert claims.allocated("one-share-too-many") == "gpu-0-slots"
    claims.waiting(claims.add("partition-after", "mig", "1g.10gb"))
    # The last shares go: the GPU is free of the slot device's counters again.
    claims.remove("share-2")
    claims.remove("one-share-too-many")
    assert claims.allocated("partition-after").startswith("gpu-0-mig-1g10gb-")
    claims.waiting(claims.add("whole-after", "gpu"))
    claims.remove("partition-after")
    assert claims.allocated("whole-after") == "gpu-0"


def test_a_share_of_two_slots_takes_two(api_client: Any, slots_as_capacity: PublishedFleet, ns: str) -> None:
    claims = Claims(api_client, slots_as_capacity, ns)
    two = claims.result(claims.add("two", "slot", capacity={"slots": "2"}))
    assert (two["device"], two["consumedCapacity"]) == ("gpu-0-slots", {"slots": "2"})
    assert claims.result(claims.add("one", "slot"))["consumedCapacity"] == {"slots": "1"}
    claims.waiting(claims.add("another", "slot"))                                 # 2 + 1 of 3 slots are out
    claims.waiting(claims.add("too-many", "slot", capacity={"slots": str(SLOTS + 1)}))


def test_a_held_whole_gpu_keeps_the_slot_shares_out(api_client: Any, slots_as_capacity: PublishedFleet,
                                                   ns: str) -> None:
    claims = Claims(api_client, slots_as_capacity, ns)
    assert claims.allocated(claims.add("whole", "gpu")) == "gpu-0"
    claims.waiting(claims.add("share", "slot"))
    claims.remove("whole")
    assert claims.allocated("share") == "gpu-0-slots"


# ------------------------------------------------------------------------ one MIG profile as capacity (instances)

ONE_G = "gpu-0-mig-1g10gb-19"
INSTANCES = 7          # 1g.10gb instances that fit on an H100 together


def test_mig_shares_coexist_up_to_the_instances_and_exclude_slots_and_the_whole_gpu_until_the_last_goes(
        api_client: Any, mig_as_capacity: PublishedFleet, ns: str) -> None:
    assert {name for (_, _, name) in mig_as_capacity.devices()} == {"gpu-0", ONE_G, "gpu-0-slots"}
    claims = Claims(api_client, mig_as_capacity, ns)
    three = claims.result(claims.add("three", "mig", "1g.10gb", capacity={"instances": "3"}))
    assert (three["device"], three["consumedCapacity"]) == (ONE_G, {"instances": "3"})
    singles = [claims.result(claims.add(f"one-{k}", "mig", "1g.10gb")) for k in range(INSTANCES - 3)]
    assert {r["device"] for r in singles} == {ONE_G}
    assert [r["consumedCapacity"] for r in singles] == [{"instances": "1"}] * (INSTANCES - 3)   # the default
    assert len({r["shareID"] for r in [three, *singles]}) == INSTANCES - 2
    claims.waiting(claims.add("one-too-many", "mig", "1g.10gb"))
    claims.waiting(claims.add("slot", "slot"))
    claims.waiting(claims.add("whole", "gpu"))
    claims.remove("slot")
    claims.remove("whole")
    claims.remove("three")
    # Instances freed let the waiting share in; shares are still out, so a slot share asked for now waits.
    assert claims.allocated("one-too-many") == ONE_G
    claims.waiting(claims.add("slot-after", "slot"))
    for k in range(INSTANCES - 3):
        claims.remove(f"one-{k}")
    claims.remove("one-too-many")
    # The last share is gone: the GPU is free of the MIG device's counters again.
    assert claims.allocated("slot-after") == "gpu-0-slots"
    claims.waiting(claims.add("whole-after", "gpu"))
    claims.remove("slot-after")
    assert claims.allocated("whole-after") == "gpu-0"
    claims.waiting(claims.add("mig-after", "mig", "1g.10gb"))


def test_a_share_asking_for_more_instances_than_the_gpu_has_waits(
        api_client: Any, mig_as_capacity: PublishedFleet, ns: str) -> None:
    claims = Claims(api_client, mig_as_capacity, ns)
    claims.waiting(claims.add("eight", "mig", "1g.10gb", capacity={"instances": str(INSTANCES + 1)}))
    assert claims.result(claims.add("seven", "mig", "1g.10gb", capacity={"instances": str(INSTANCES)}))[
        "consumedCapacity"] == {"instances": str(INSTANCES)}
