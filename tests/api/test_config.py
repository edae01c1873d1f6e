"""Opaque device configuration: decoding ours and NVIDIA's, errors that name fields, quantities, precedence."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.config import (
    ConfigEntry,
    ConfigError,
    GpuConfig,
    MigDeviceConfig,
    check_config_for_device_type,
    decode_opaque_config,
    encode_opaque_config,
    merge_allocation_configs,
    merge_configs,
)
from api.names import CONFIG_API_VERSION, DEFAULT_DRIVER_NAME, NVIDIA_CONFIG_API_VERSION

OURS = CONFIG_API_VERSION
NV = NVIDIA_CONFIG_API_VERSION
GI, MI = 1 << 30, 1 << 20


def ours(kind: str = "GpuConfig", **body: Any) -> dict[str, Any]:
    return {"apiVersion": OURS, "kind": kind, **body}


def nvidia(kind: str = "GpuConfig", **body: Any) -> dict[str, Any]:
    return {"apiVersion": NV, "kind": kind, **body}


def error_of(parameters: Any, *, compat_nvidia: bool = False) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        decode_opaque_config(parameters, compat_nvidia=compat_nvidia)
    return info.value


# --- our types --------------------------------------------------------------------------------------

def test_gpu_config_without_sharing_means_exclusive() -> None:
    config = decode_opaque_config(ours(), compat_nvidia=False)
    assert isinstance(config, GpuConfig) and config.sharing is None


def test_time_slicing_defaults_its_interval() -> None:
    config = decode_opaque_config(ours(sharing={"strategy": "TimeSlicing"}), compat_nvidia=False)
    assert config.sharing.time_slicing.interval == "Default"
    assert config.sharing.mps is None


@pytest.mark.parametrize("interval", ["Default", "Short", "Medium", "Long"])
def test_time_slicing_intervals(interval: str) -> None:
    config = decode_opaque_config(ours(sharing={"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}),
                                  compat_nvidia=False)
    assert config.sharing.time_slicing.interval == interval


def test_mps_settings_are_decoded_to_bytes() -> None:
    config = decode_opaque_config(ours(sharing={"strategy": "MPS", "mps": {
        "activeThreadPercentage": 25, "pinnedMemoryLimit": "8Gi",
        "perDevicePinnedMemoryLimit": {"0": "4Gi", "gpu-1": 2048 * MI,
                                       "GPU-12ab34cd-0000-1111-2222-333344445555": "1G"},
    }}), compat_nvidia=False)
    mps = config.sharing.mps
    assert mps.active_thread_percentage == 25
    assert mps.pinned_memory_limit == 8 * GI
    assert mps.per_device_pinned_memory_limit == {
        "0": 4 * GI, "gpu-1": 2 * GI, "GPU-12ab34cd-0000-1111-2222-333344445555": 10**9}


def test_mps_without_settings_gets_an_empty_block() -> None:
    config = decode_opaque_config(ours(sharing={"strategy": "MPS"}), compat_nvidia=False)
    assert config.sharing.mps is not None and config.sharing.mps.active_thread_percentage is None


def test_mig_device_config_with_mps() -> None:
    config = decode_opaque_config(
        ours("MigDeviceConfig", sharing={"strategy": "MPS", "mps": {"activeThreadPercentage": 100}}),
        compat_nvidia=False)
    assert isinstance(config, MigDeviceConfig) and config.sharing.mps.active_thread_percentage == 100


def test_encode_round_trips() -> None:
    original = decode_opaque_config(ours(sharing={"strategy": "MPS", "mps": {
        "pinnedMemoryLimit": 3 * GI, "perDevicePinnedMemoryLimit": {"1": "1536Mi"}}}), compat_nvidia=False)
    wire = encode_opaque_config(original)
    assert wire == {"apiVersion": OURS, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mps": {
        "pinnedMemoryLimit": "3Gi", "perDevicePinnedMemoryLimit": {"1": "1536Mi"}}}}
    assert decode_opaque_config(wire, compat_nvidia=False) == original


def test_python_defaults_carry_our_api_version() -> None:
    assert GpuConfig().api_version == OURS and MigDeviceConfig().kind == "MigDeviceConfig"


# --- errors name the field, the apiVersion and the kind ---------------------------------------------

def test_out_of_range_percentage_names_the_path() -> None:
    err = error_of(ours(sharing={"strategy": "MPS", "mps": {"activeThreadPercentage": 150}}))
    assert err.problems == (("sharing.mps.activeThreadPercentage", "must be between 1 and 100, got 150"),)
    assert str(err) == (f"{OURS} GpuConfig: sharing.mps.activeThreadPercentage: "
                        "must be between 1 and 100, got 150")


@pytest.mark.parametrize(("body", "path", "fragment"), [
    ({"strategy": "Spatial"}, "sharing.strategy", "must be one of 'TimeSlicing' or 'MPS', got 'Spatial'"),
    ({}, "sharing.strategy", "required"),
    ({"strategy": "TimeSlicing", "mps": {}}, "sharing.mps", "must not be set when strategy is TimeSlicing"),
    ({"strategy": "MPS", "timeSlicing": {}}, "sharing.timeSlicing", "must not be set when strategy is MPS"),
    ({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Forever"}}, "sharing.timeSlicing.interval",
     "must be one of"),
    ({"strategy": "MPS", "mps": {"activeThreadPercentage": 0}}, "sharing.mps.activeThreadPercentage",
     "must be between 1 and 100, got 0"),
    ({"strategy": "MPS", "mps": {"activeThreadPercentage": "50"}}, "sharing.mps.activeThreadPercentage",
     "must be an integer, got '50'"),
    ({"strategy": "MPS", "mps": {"activeThreadPercentage": True}}, "sharing.mps.activeThreadPercentage",
     "must be an integer, got true"),
    ({"strategy": "MPS", "mps": {"activeThreadPercent": 5}}, "sharing.mps.activeThreadPercent",
     "unknown field (known fields: activeThreadPercentage, pinnedMemoryLimit, perDevicePinnedMemoryLimit)"),
    ({"strategy": "MPS", "mps": {"active_thread_percentage": 5}}, "sharing.mps.active_thread_percentage",
     "unknown field"),
    ({"strategy": "MPS", "mps": {"pinnedMemoryLimit": "512Ki"}}, "sharing.mps.pinnedMemoryLimit",
     "must be at least 1Mi, got '512Ki'"),
    ({"strategy": "MPS", "mps": {"perDevicePinnedMemoryLimit": {"Not A Device": "1Gi"}}},
     "sharing.mps.perDevicePinnedMemoryLimit.Not A Device", "must be a device index"),
    ({"strategy": "MPS", "mps": {"perDevicePinnedMemoryLimit": {"gpu-0": "lots"}}},
     "sharing.mps.perDevicePinnedMemoryLimit.gpu-0", "not an integer quantity"),
])
def test_bad_gpu_config_fields(body: dict[str, Any], path: str, fragment: str) -> None:
    err = error_of(ours(sharing=body))
    assert [p for p, _ in err.problems] == [path]
    assert fragment in err.problems[0][1]
    assert str(err).startswith(f"{OURS} GpuConfig: {path}: ")


def test_every_problem_is_reported_at_once() -> None:
    err = error_of(ours(sharing={"strategy": "MPS", "mps": {"activeThreadPercentage": 101,
                                                            "pinnedMemoryLimit": "1.5Gi"}}, extra=1))
    assert {p for p, _ in err.problems} == {"sharing.mps.activeThreadPercentage", "sharing.mps.pinnedMemoryLimit",
                                            "extra"}


def test_mig_config_rejects_time_slicing() -> None:
    err = error_of(ours("MigDeviceConfig", sharing={"strategy": "TimeSlicing"}))
    assert err.problems[0][0] == "sharing.strategy" and "only MPS" in err.problems[0][1]
    err = error_of(ours("MigDeviceConfig", sharing={"strategy": "MPS", "timeSlicing": {}}))
    assert err.problems == (("sharing.timeSlicing", "unknown field (known fields: strategy, mps)"),)


@pytest.mark.parametrize(("parameters", "path", "fragment"), [
    ("GpuConfig", "", "must be an object with apiVersion and kind"),
    ({"kind": "GpuConfig"}, "apiVersion", f"required; supported: {OURS}"),
    ({"apiVersion": "example.com/v1", "kind": "GpuConfig"}, "apiVersion",
     f"unsupported 'example.com/v1'; supported: {OURS}"),
    ({"apiVersion": OURS, "kind": "VfioDeviceConfig"}, "kind",
     f"unsupported 'VfioDeviceConfig'; {OURS} supports: GpuConfig, MigDeviceConfig"),
    ({"apiVersion": OURS}, "kind", "missing"),
    (nvidia(), "apiVersion", "only in NVIDIA compatibility mode"),
])
def test_unknown_api_version_or_kind_lists_the_supported(parameters: Any, path: str, fragment: str) -> None:
    err = error_of(parameters)
    assert err.problems[0][0] == path and fragment in err.problems[0][1]


def test_error_paths_can_be_placed_inside_a_claim() -> None:
    err = error_of(ours(sharing={"strategy": "MPS", "mps": {"activeThreadPercentage": 150}}))
    placed = err.with_prefix("spec.devices.config[0].opaque.parameters")
    assert placed.problems[0][0] == "spec.devices.config[0].opaque.parameters.sharing.mps.activeThreadPercentage"
    assert isinstance(placed, ValueError) and OURS in str(placed)


# --- quantities --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("1Mi", MI), ("512Mi", 512 * MI), ("4Gi", 4 * GI), ("1Ti", 1 << 40), ("2048Ki", 2 * MI),
    ("2M", 2 * 10**6), ("2G", 2 * 10**9), ("1500k", 1_500_000), ("1048576", MI), (1048576, MI), (3 * GI, 3 * GI),
])
def test_quantities(text: Any, expected: int) -> None:
    config = decode_opaque_config(ours(sharing={"strategy": "MPS", "mps": {"pinnedMemoryLimit": text}}),
                                  compat_nvidia=False)
    assert config.sharing.mps.pinned_memory_limit == expected


@pytest.mark.parametrize(("value", "fragment"), [
    ("1.5Gi", "not an integer quantity"), ("4GB", "not an integer quantity"), ("", "not an integer quantity"),
    ("-1Gi", "not an integer quantity"), ("Gi", "not an integer quantity"), (-5, "must not be negative"),
    (1.5, "must be a quantity"), (True, "must be a quantity"), ([1], "must be a quantity"),
    ("1000k", "must be at least 1Mi"), (1023, "must be at least 1Mi"),
])
def test_bad_quantities(value: Any, fragment: str) -> None:
    err = error_of(ours(sharing={"strategy": "MPS", "mps": {"pinnedMemoryLimit": value}}))
    assert err.problems[0][0] == "sharing.mps.pinnedMemoryLimit"
    assert fragment in err.problems[0][1]


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=1, max_value=1 << 20), st.sampled_from(["Mi", "Gi", "Ti"]))
def test_binary_quantities_round_trip(number: int, suffix: str) -> None:
    config = decode_opaque_config(
        ours(sharing={"strategy": "MPS", "mps": {"pinnedMemoryLimit": f"{number}{suffix}"}}), compat_nvidia=False)
    scale = {"Mi": MI, "Gi": GI, "Ti": 1 << 40}[suffix]
    assert config.sharing.mps.pinned_memory_limit == number * scale
    again = decode_opaque_config(encode_opaque_config(config), compat_nvidia=False)
    assert again == config


# --- NVIDIA compatibility ----------------------------------------------------------------------------

def test_nvidia_time_slicing_maps_to_ours() -> None:
    config = decode_opaque_config(
        nvidia(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}), compat_nvidia=True)
    assert config == decode_opaque_config(
        ours(sharing={"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}), compat_nvidia=False)
    assert config.api_version == OURS


def test_nvidia_time_slicing_without_config_is_default() -> None:
    config = decode_opaque_config(nvidia(sharing={"strategy": "TimeSlicing"}), compat_nvidia=True)
    assert config.sharing.time_slicing.interval == "Default"


def test_nvidia_mps_maps_field_names() -> None:
    config = decode_opaque_config(nvidia(sharing={"strategy": "MPS", "mpsConfig": {
        "defaultActiveThreadPercentage": 40, "defaultPinnedDeviceMemoryLimit": "10Gi",
        "defaultPerDevicePinnedMemoryLimit": {"0": "5Gi"}, "multiUser": False}}), compat_nvidia=True)
    assert config == GpuConfig.model_validate({"sharing": {"strategy": "MPS", "mps": {
        "activeThreadPercentage": 40, "pinnedMemoryLimit": "10Gi", "perDevicePinnedMemoryLimit": {"0": "5Gi"}}}})


def test_nvidia_mig_device_config() -> None:
    config = decode_opaque_config(nvidia("MigDeviceConfig", sharing={"strategy": "MPS", "mpsConfig": {
        "defaultActiveThreadPercentage": 50}}), compat_nvidia=True)
    assert isinstance(config, MigDeviceConfig) and config.sharing.mps.active_thread_percentage == 50
    # NVIDIA's driver accepts TimeSlicing on MIG devices and does nothing with it.
    assert decode_opaque_config(nvidia("MigDeviceConfig", sharing={"strategy": "TimeSlicing"}),
                                compat_nvidia=True) == MigDeviceConfig()


def test_nvidia_gpu_config_without_sharing() -> None:
    assert decode_opaque_config(nvidia(), compat_nvidia=True) == GpuConfig()


@pytest.mark.parametrize(("parameters", "path", "fragment"), [
    (nvidia(sharing={"strategy": "MPS", "mpsConfig": {"multiUser": True}}), "sharing.mpsConfig.multiUser",
     "multi-user MPS is not supported"),
    (nvidia(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 150}}),
     "sharing.mpsConfig.defaultActiveThreadPercentage", "must be between 1 and 100, got 150"),
    (nvidia(sharing={"strategy": "MPS", "mps": {}}), "sharing.mps", "unknown field (known fields: strategy, "
     "timeSlicingConfig, mpsConfig)"),
    (nvidia(sharing={"strategy": "TimeSlicing", "mpsConfig": {}}), "sharing.mpsConfig",
     "must not be set when strategy is TimeSlicing"),
    (nvidia(sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1Ki"}}),
     "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit", "must be at least 1Mi"),
    (nvidia("MigDeviceConfig", sharing={"strategy": "MPS", "timeSlicingConfig": {}}),
     "sharing.timeSlicingConfig", "unknown field"),
    (nvidia("VfioDeviceConfig", iommu={}), "kind", f"unsupported 'VfioDeviceConfig'; {NV} supports: GpuConfig, "
     "MigDeviceConfig"),
])
def test_nvidia_errors_use_nvidias_field_names(parameters: dict[str, Any], path: str, fragment: str) -> None:
    err = error_of(parameters, compat_nvidia=True)
    assert err.problems[0][0] == path and fragment in err.problems[0][1]
    assert str(err).startswith(NV)


def test_compat_mode_still_accepts_ours() -> None:
    assert decode_opaque_config(ours(), compat_nvidia=True) == GpuConfig()


# --- which config fits which device ------------------------------------------------------------------

def test_config_kind_must_fit_the_device_type() -> None:
    gpu, mig = GpuConfig(), MigDeviceConfig()
    for device_type in ("gpu", "slot", "shared"):
        check_config_for_device_type(gpu, device_type)
    check_config_for_device_type(mig, "mig")
    with pytest.raises(ConfigError, match="GpuConfig cannot configure a 'mig' device; use MigDeviceConfig"):
        check_config_for_device_type(gpu, "mig")
    with pytest.raises(ConfigError, match="MigDeviceConfig cannot configure a 'gpu' device"):
        check_config_for_device_type(mig, "gpu")


# --- precedence --------------------------------------------------------------------------------------

def entry(kind: str = "GpuConfig", requests: list[str] | None = None, driver: str = DEFAULT_DRIVER_NAME,
          source: str | None = None, tag: str = "") -> dict[str, Any]:
    item: dict[str, Any] = {"opaque": {"driver": driver, "parameters": {"apiVersion": OURS, "kind": kind,
                                                                        "tag": tag}}}
    if requests is not None:
        item["requests"] = requests
    if source is not None:
        item["source"] = source
    return item


def tag_of(result: ConfigEntry | None) -> str | None:
    return None if result is None else result.parameters["tag"]


def test_claim_config_wins_over_class_config() -> None:
    result = merge_configs([entry(tag="class")], [entry(tag="claim")], "gpu")
    assert tag_of(result) == "claim" and result.source == "FromClaim"


def test_claim_config_for_all_requests_still_wins_over_class_config_for_the_request() -> None:
    assert tag_of(merge_configs([entry(requests=["gpu"], tag="class")], [entry(tag="claim")], "gpu")) == "claim"


def test_request_specific_wins_over_general_within_a_source() -> None:
    claim = [entry(requests=["gpu"], tag="specific"), entry(tag="general")]
    assert tag_of(merge_configs([], claim, "gpu")) == "specific"


def test_later_entry_wins_at_equal_rank() -> None:
    claim = [entry(tag="first"), entry(tag="second")]
    result = merge_configs([], claim, "gpu")
    assert tag_of(result) == "second" and result.position == 1


def test_subrequests_match_their_parent_request() -> None:
    claim = [entry(requests=["gpu/h200"], tag="exact"), entry(requests=["gpu"], tag="parent"), entry(tag="all")]
    assert tag_of(merge_configs([], claim, "gpu/h200")) == "exact"
    assert tag_of(merge_configs([], claim, "gpu/a100")) == "parent"
    assert tag_of(merge_configs([], claim, "nic")) == "all"


def test_configs_for_other_requests_and_drivers_are_ignored() -> None:
    claim = [entry(requests=["other"], tag="other-request"), entry(driver="nic.example.com", tag="other-driver"),
             {"requests": ["gpu"]}]
    assert merge_configs([], claim, "gpu") is None
    assert tag_of(merge_configs([], claim, "gpu", driver_name="nic.example.com")) == "other-driver"


def test_general_config_applies_only_to_matching_device_type() -> None:
    claim = [entry("MigDeviceConfig", tag="mig"), entry("GpuConfig", tag="gpu")]
    assert tag_of(merge_configs([], claim, "r", device_type="mig")) == "mig"
    assert tag_of(merge_configs([], claim, "r", device_type="gpu")) == "gpu"
    assert tag_of(merge_configs([], claim, "r")) == "gpu"  # without a type: the later entry
    # A config naming the request is returned whatever its kind; decoding then rejects the mismatch.
    named = [entry("GpuConfig", requests=["r"], tag="named")]
    assert tag_of(merge_configs([], named, "r", device_type="mig")) == "named"


def test_allocation_config_list_is_split_by_source() -> None:
    allocation = [
        entry(source="FromClaim", tag="claim"),
        entry(source="FromClass", requests=["gpu"], tag="class"),
        entry(source="FromClass", requests=["gpu"], driver="other.example.com", tag="other"),
    ]
    result = merge_allocation_configs(allocation, "gpu")
    assert tag_of(result) == "claim" and (result.source, result.position) == ("FromClaim", 0)
    result = merge_allocation_configs(allocation[1:], "gpu")
    assert tag_of(result) == "class" and result.source == "FromClass"
    assert merge_allocation_configs([entry(tag="no-source")], "gpu") is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["FromClass", "FromClaim"]),
                          st.sampled_from([None, ["gpu"], ["other"]])), max_size=6))
def test_precedence_order_is_total(specs: list[tuple[str, list[str] | None]]) -> None:
    """The winner is the applicable entry with the highest (source, specificity, position)."""
    allocation = [entry(source=src, requests=req, tag=str(i)) for i, (src, req) in enumerate(specs)]
    applicable = [(1 if src == "FromClaim" else 0, 0 if req is None else 2, i)
                  for i, (src, req) in enumerate(specs) if req != ["other"]]
    expected = str(max(applicable)[2]) if applicable else None
    assert tag_of(merge_allocation_configs(allocation, "gpu")) == expected
