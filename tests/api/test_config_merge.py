"""A claim config's `requests` as the user wrote them decide which config applies, even though the scheduler
empties `requests` in the allocation when a config names every request of the claim."""
from __future__ import annotations

from typing import Any

import pytest
from claims import request, resource_claim

from api.config import merge_allocation_configs, restore_claim_request_scopes
from dra.model.devices import build_devices
from dra.model.policy import parse_node_policy
from dra.node.inventory import discover
from dra.sim.fleet import nvml_for_node, parse_fleet
from kubeletplugin.plan import PlanError, plan_claim

DRIVER = "gpu.nvidia.com"
NODE = "node-a"
NVIDIA = "resource.nvidia.com/v1beta1"


def opaque(parameters: dict[str, Any], requests: list[str] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"opaque": {"driver": DRIVER, "parameters": parameters}}
    if requests:
        entry["requests"] = requests
    return entry


def time_slicing(interval: str) -> dict[str, Any]:
    return {"apiVersion": NVIDIA, "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}}


def as_allocated(spec_configs: list[dict[str, Any]], cleared: bool = True) -> list[dict[str, Any]]:
    """The allocation's copy as the scheduler writes it for a one-request claim: `requests` emptied."""
    return [{"source": "FromClaim", **{k: v for k, v in c.items() if not (cleared and k == "requests")}}
            for c in spec_configs]


def test_requests_come_back_from_the_claim_spec():
    spec = [opaque(time_slicing("Long"), ["gpu"]), opaque(time_slicing("Short"))]
    restored = restore_claim_request_scopes(as_allocated(spec), spec)
    assert [e.get("requests") for e in restored] == [["gpu"], None]
    assert [e["source"] for e in restored] == ["FromClaim", "FromClaim"]


def test_class_configs_and_unmatched_entries_are_left_alone():
    class_entry = {"source": "FromClass", **opaque(time_slicing("Medium"))}
    spec = [opaque(time_slicing("Long"), ["gpu/h100"]), opaque(time_slicing("Short"), ["gpu"])]
    # The config for the sub-request the scheduler did not pick is not in the allocation at all.
    allocated = [class_entry, *as_allocated(spec[1:])]
    restored = restore_claim_request_scopes(allocated, spec)
    assert restored[0] == class_entry
    assert restored[1]["requests"] == ["gpu"]
    assert restore_claim_request_scopes(allocated, []) == allocated   # no spec (e.g. a trimmed copy)


def test_scoped_config_beats_a_later_general_one_again():
    """Naming the request wins over a general config; with the scheduler's emptied `requests`, the later
    general config would win instead."""
    spec = [opaque(time_slicing("Long"), ["gpu"]), opaque(time_slicing("Short"))]
    allocated = as_allocated(spec)
    assert merge_allocation_configs(allocated, "gpu", driver_name=DRIVER, device_type="gpu").position == 1
    restored = restore_claim_request_scopes(allocated, spec)
    assert merge_allocation_configs(restored, "gpu", driver_name=DRIVER, device_type="gpu").position == 0


def _gpu_devices():
    fleet = parse_fleet({"nodes": [{"name": NODE, "gpus": [{"model": "L4", "count": 1}]}]})
    nvml = nvml_for_node(fleet.node(NODE))
    nvml.nvmlInit()
    return build_devices(discover(nvml), parse_node_policy({}, "p"), driver=DRIVER).by_name()


def _claim(spec_configs: list[dict[str, Any]]) -> dict[str, Any]:
    return resource_claim("c", "ns", uid="u", requests=[request("gpu", DRIVER)], config=spec_configs,
                          results=[{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}],
                          allocation_config=as_allocated(spec_configs), typed=False)


@pytest.mark.parametrize("parameters, words", [
    ({"apiVersion": NVIDIA, "kind": "VfioDeviceConfig", "iommu": {"backendPolicy": "LegacyOnly"}},
     ["kind", "'VfioDeviceConfig'", "GpuConfig, MigDeviceConfig"]),
    ({"apiVersion": NVIDIA, "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}},
     ["MigDeviceConfig cannot configure a 'gpu' device"]),
])
def test_config_aimed_at_the_request_fails_instead_of_being_ignored(parameters, words):
    """A config the user named the request in is not dropped for having the wrong kind: the claim fails."""
    claim = _claim([opaque(parameters, ["gpu"])])
    with pytest.raises(PlanError) as err:
        plan_claim(claim, driver_name=DRIVER, pool_name=NODE, devices=_gpu_devices(), compat_nvidia=True)
    for word in words:
        assert word in str(err.value)
    assert "status.allocation.devices.config[0]" in str(err.value)


def test_general_config_of_another_kind_is_still_skipped():
    """Written without `requests`, a MigDeviceConfig simply does not apply to a whole GPU (NVIDIA's rule)."""
    claim = _claim([opaque({"apiVersion": NVIDIA, "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}})])
    [plan] = plan_claim(claim, driver_name=DRIVER, pool_name=NODE, devices=_gpu_devices(), compat_nvidia=True)
    assert plan.config_key is None and plan.mps is None
