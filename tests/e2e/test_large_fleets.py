"""Slices of large fleets on the real API server: every slice is accepted (validation of device, counter and
attribute limits happens there) and stored exactly as sent, and `kubectl describe` shows our attributes."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from allocation_helpers import FLEETS, PublishedFleet, renamed_fleet

from dra.model.catalog import CATALOG, family_of, get_model
from kube.resourceslices import slice_name
from kube.slicecompare import normalize_spec, spec_differences

pytestmark = pytest.mark.e2e


def catalog_fleet() -> dict[str, Any]:
    """One node per catalog model, two GPUs each, with the densest policy the model allows: dynamic MIG
    beside four MPS slots and the whole GPU where MIG can be switched at runtime (Hopper and later), dynamic
    MIG on MIG-enabled GPUs for Ampere (switching there needs a reset), four time-slicing slots otherwise."""
    nodes = []
    for name in CATALOG:
        model = get_model(name)
        group: dict[str, Any] = {"model": name, "count": 2}
        if not model.mig_capable:
            policy = {"default": {"slots": {"count": 4, "strategy": "time-slicing"}}}
        elif model.compute_capability >= (9, 0):
            policy = {"default": {"mig": "dynamic", "slots": {"count": 4, "strategy": "mps"}}}
        else:
            group["mig"] = {"enabled": True}
            policy = {"default": {"wholeGpu": False, "mig": "dynamic"}}
        node_name = "cat-" + name.lower().replace(".", "-")
        nodes.append({"name": node_name, "gpus": [group], "policy": policy})
    return {"nodes": nodes}


def assert_stored_as_sent(fleet: PublishedFleet) -> int:
    """Every desired slice exists with the spec that was sent; returns the number of devices."""
    stored = {s["metadata"]["name"]: s for s in fleet.slices()}
    expected_names = {slice_name(fleet.driver, pool, i)
                      for pool, p in fleet.pools.items() for i in range(len(p.slices))}
    assert set(stored) == expected_names
    devices = 0
    for pool_name, pool in fleet.pools.items():
        for i, part in enumerate(pool.slices):
            got = stored[slice_name(fleet.driver, pool_name, i)]["spec"]
            sent = {"driver": fleet.driver, "nodeName": pool.node_name, **part}
            want, have = normalize_spec(sent), normalize_spec(got)
            assert have == want, spec_differences(want, have)
            assert got["pool"]["resourceSliceCount"] == len(pool.slices)
            devices += len(part.get("devices") or [])
    return devices


def describe(cluster: Any, fleet: PublishedFleet) -> str:
    """`kubectl describe` of the first slice with devices of every node."""
    names = []
    for node in fleet.node_names:
        first = next(s for s in fleet.slices() if s["spec"]["nodeName"] == node and s["spec"].get("devices"))
        names.append(first["metadata"]["name"])
    return cluster.kubectl("describe", "resourceslices", *names).stdout


def test_the_large_example_fleet_is_accepted(cluster: Any, api_client: Any, driver_name: str, tmp_path: Path) -> None:
    doc = renamed_fleet(yaml.safe_load((FLEETS / "large.yaml").read_text()), driver_name.split(".")[0])
    fleet = PublishedFleet(cluster, api_client, driver_name, doc, tmp_path).publish(with_classes=False)
    try:
        assert fleet.controller is not None and not fleet.controller.errors
        devices = assert_stored_as_sent(fleet)
        assert devices > 500        # 32 H200s, each whole, as every MIG placement and as four slots
        assert fleet.controller.writes_by_operation == {"create": len(fleet.slices())}
        text = describe(cluster, fleet)
        for needle in ("Family:", "String:  hopper", "Product Name:", "String:  NVIDIA H200", "Type:",
                       "String:  mig", "Profile:", "Cuda Compute Capability:", "Version:  9.0.0",
                       "Consumes Counters:", "memory-slice-0:"):
            assert needle in text, needle
    finally:
        fleet.remove()


def test_a_fleet_with_every_catalog_model_is_accepted(cluster: Any, api_client: Any, driver_name: str,
                                                      tmp_path: Path) -> None:
    doc = renamed_fleet(catalog_fleet(), driver_name.split(".")[0])
    fleet = PublishedFleet(cluster, api_client, driver_name, doc, tmp_path).publish(with_classes=False)
    try:
        assert fleet.controller is not None and not fleet.controller.errors
        assert_stored_as_sent(fleet)
        text = describe(cluster, fleet)
        for name in CATALOG:
            assert f"String:  {get_model(name).product_name}" in text, name
        for family in {family_of(*get_model(name).compute_capability) for name in CATALOG}:
            assert f"String:  {family}" in text, family
        for needle in ("Type:", "String:  gpu", "String:  slot", "String:  mig", "Sharing:", "String:  mps",
                       "String:  time-slicing", "Profile:", "Parent UUID:", "resource.kubernetes.io/pciBusID:"):
            assert needle in text, needle
    finally:
        fleet.remove()
