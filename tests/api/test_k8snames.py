"""Every name rule matches the whole value: a name followed by a newline ('$' in a pattern matches before a final
"\n") is refused, by api.k8snames and by every other validator of outside input."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from api.k8snames import is_dns_label, is_dns_subdomain, is_label_key, is_label_value, is_qualified_name, is_uid
from dra.model.devices import parse_device_name
from dra.model.slices import validate_slice_spec

NAME_RULES: list[tuple[Callable[[Any], bool], str]] = [
    (is_dns_label, "gpu-0"),
    (is_dns_subdomain, "gpu.example.com"),
    (is_qualified_name, "gpu.example.com/productName"),
    (is_qualified_name, "productName"),
    (is_label_key, "example.com/team"),
    (is_label_value, "ml-team"),
    (is_uid, "0b6d9c3e-2c5e-4f7e-9a53-5d8a1c1f2e3d"),
]


@pytest.mark.parametrize("rule, good", NAME_RULES, ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("tail", ["\n", "\r\n", "\n\n", " "])
def test_a_name_with_a_trailing_newline_is_refused(rule: Callable[[Any], bool], good: str, tail: str) -> None:
    assert rule(good)
    assert not rule(good + tail)


def test_an_empty_label_value_is_still_valid_and_a_newline_is_not() -> None:
    assert is_label_value("") and not is_label_value("\n")


@pytest.mark.parametrize("name", ["gpu-0\n", "gpu-0-slot-1\n", "gpu-0-shared\n", "gpu-0-mig-1g-10gb-19-0\n"])
def test_a_device_name_with_a_trailing_newline_is_not_ours(name: str) -> None:
    parse_device_name(name.rstrip("\n"))
    with pytest.raises(ValueError):
        parse_device_name(name)


def test_a_slice_attribute_version_with_a_trailing_newline_is_refused() -> None:
    spec = {"driver": "gpu.example.com", "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", "attributes": {"driverVersion": {"version": "550.54.15"}}}]}
    assert validate_slice_spec(spec) == []
    spec["devices"][0]["attributes"]["driverVersion"]["version"] = "550.54.15\n"
    assert any("driverVersion" in p for p in validate_slice_spec(spec))
