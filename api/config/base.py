"""The pydantic base every user-facing config type shares: strict, closed, immutable, camelCase."""
from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError


class StrictModel(BaseModel):
    """Strict types (no "1" for 1), unknown fields rejected, fields spelled in camelCase only."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        frozen=True,
        alias_generator=to_camel,
        validate_by_alias=True,
        validate_by_name=False,
        serialize_by_alias=True,
    )


def _percentage(value: int) -> int:
    if not 1 <= value <= 100:
        raise PydanticCustomError("range", "must be between 1 and 100, got {got}", {"got": value})
    return value


# MPS active thread percentage: nvidia-cuda-mps-control accepts 1..100.
Percentage = Annotated[int, AfterValidator(_percentage)]

# How a claim names one of its devices in per-device settings: the device's position in the claim
# ("0"), a GPU or MIG UUID, or the device name from the ResourceSlice ("gpu-0").
_DEVICE_KEY_RE = re.compile(r"^(?:[0-9]+|(?:GPU|MIG)-[0-9A-Fa-f-]+|[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?)$")


def _device_key(value: str) -> str:
    if not _DEVICE_KEY_RE.fullmatch(value):
        raise PydanticCustomError(
            "device_key",
            "key {got} must be a device index within the claim ('0'), a GPU or MIG UUID, or a device name ('gpu-0')",
            {"got": repr(value)})
    return value


DeviceKey = Annotated[str, AfterValidator(_device_key)]
