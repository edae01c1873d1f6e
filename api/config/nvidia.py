"""NVIDIA's opaque configuration (resource.nvidia.com/v1beta1), accepted in compatibility mode.

Decoded with NVIDIA's field names, so errors point at what the user wrote, then mapped to ours:

    sharing.timeSlicingConfig.interval                 -> sharing.timeSlicing.interval
    sharing.mpsConfig.defaultActiveThreadPercentage    -> sharing.mps.activeThreadPercentage
    sharing.mpsConfig.defaultPinnedDeviceMemoryLimit   -> sharing.mps.pinnedMemoryLimit
    sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit-> sharing.mps.perDevicePinnedMemoryLimit

Differences, each reported as a clear error or documented here:
- `multiUser: true` is not supported (false is accepted; it is the default).
- `defaultActiveThreadPercentage` must be 1..100 (0 does not give an MPS client any SMs).
- A MigDeviceConfig with strategy TimeSlicing is accepted and means "no sharing", as in NVIDIA's
  driver, where it has no effect.
- Setting the block of the other strategy (e.g. mpsConfig with TimeSlicing) is an error.
- Other kinds (VfioDeviceConfig, ComputeDomain*) are not supported.
"""
from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator
from pydantic_core import PydanticCustomError

from api.config.base import DeviceKey, Percentage, StrictModel
from api.config.quantity import MemoryLimit
from api.config.v1alpha1 import GpuConfig, Interval, MigDeviceConfig, Strategy
from api.names import NVIDIA_CONFIG_API_VERSION


class NvidiaTimeSlicingConfig(StrictModel):
    interval: Interval | None = None


class NvidiaMpsConfig(StrictModel):
    default_active_thread_percentage: Percentage | None = None
    default_pinned_device_memory_limit: MemoryLimit | None = None
    default_per_device_pinned_memory_limit: dict[DeviceKey, MemoryLimit] | None = None
    multi_user: bool | None = None

    @field_validator("multi_user")
    @classmethod
    def _no_multi_user(cls, value: bool | None) -> bool | None:
        if value:
            raise PydanticCustomError("unsupported", "multi-user MPS is not supported by this driver; remove the "
                                      "field or set it to false", {})
        return value

    def to_ours(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.default_active_thread_percentage is not None:
            out["activeThreadPercentage"] = self.default_active_thread_percentage
        if self.default_pinned_device_memory_limit is not None:
            out["pinnedMemoryLimit"] = self.default_pinned_device_memory_limit
        if self.default_per_device_pinned_memory_limit is not None:
            out["perDevicePinnedMemoryLimit"] = dict(self.default_per_device_pinned_memory_limit)
        return out


def _conflict(field: str, strategy: str) -> PydanticCustomError:
    return PydanticCustomError("strategy_conflict", "must not be set when strategy is {strategy}",
                               {"field": field, "strategy": strategy})


class NvidiaGpuSharing(StrictModel):
    strategy: Strategy
    time_slicing_config: NvidiaTimeSlicingConfig | None = None
    mps_config: NvidiaMpsConfig | None = None

    @model_validator(mode="after")
    def _one_strategy(self) -> NvidiaGpuSharing:
        if self.strategy == "TimeSlicing" and self.mps_config is not None:
            raise _conflict("mpsConfig", self.strategy)
        if self.strategy == "MPS" and self.time_slicing_config is not None:
            raise _conflict("timeSlicingConfig", self.strategy)
        return self

    def to_ours(self) -> dict[str, object]:
        if self.strategy == "TimeSlicing":
            interval = (self.time_slicing_config and self.time_slicing_config.interval) or "Default"
            return {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}
        return {"strategy": "MPS", "mps": self.mps_config.to_ours() if self.mps_config else {}}


class NvidiaMigSharing(StrictModel):
    strategy: Strategy
    mps_config: NvidiaMpsConfig | None = None

    @model_validator(mode="after")
    def _mps_block_needs_mps(self) -> NvidiaMigSharing:
        if self.strategy == "TimeSlicing" and self.mps_config is not None:
            raise _conflict("mpsConfig", self.strategy)
        return self

    def to_ours(self) -> dict[str, object] | None:
        if self.strategy == "TimeSlicing":
            return None  # no effect on MIG devices in NVIDIA's driver either
        return {"strategy": "MPS", "mps": self.mps_config.to_ours() if self.mps_config else {}}


class NvidiaGpuConfig(StrictModel):
    api_version: Literal["resource.nvidia.com/v1beta1"] = NVIDIA_CONFIG_API_VERSION
    kind: Literal["GpuConfig"] = "GpuConfig"
    sharing: NvidiaGpuSharing | None = None

    def to_ours(self) -> GpuConfig:
        return GpuConfig.model_validate({"sharing": self.sharing.to_ours()} if self.sharing else {})


class NvidiaMigDeviceConfig(StrictModel):
    api_version: Literal["resource.nvidia.com/v1beta1"] = NVIDIA_CONFIG_API_VERSION
    kind: Literal["MigDeviceConfig"] = "MigDeviceConfig"
    sharing: NvidiaMigSharing | None = None

    def to_ours(self) -> MigDeviceConfig:
        sharing = self.sharing.to_ours() if self.sharing else None
        return MigDeviceConfig.model_validate({"sharing": sharing} if sharing else {})
