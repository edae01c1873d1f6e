"""Our opaque device configuration, apiVersion gpu.dra-driver.io/v1alpha1.

    apiVersion: gpu.dra-driver.io/v1alpha1
    kind: GpuConfig                    # whole GPUs (and slots / shares carved from them)
    sharing:
      strategy: MPS                    # TimeSlicing | MPS
      timeSlicing: {interval: Long}    # only with TimeSlicing: Default | Short | Medium | Long
      mps:                             # only with MPS
        activeThreadPercentage: 50     # 1..100
        pinnedMemoryLimit: 8Gi         # per client process, >= 1Mi
        perDevicePinnedMemoryLimit: {"0": 4Gi, gpu-1: 10Gi}

    apiVersion: gpu.dra-driver.io/v1alpha1
    kind: MigDeviceConfig              # MIG partitions: MPS only (time-slicing is GPU-wide)
    sharing: {strategy: MPS, mps: {...}}

A strategy without its settings block gets the defaults, so the decoded config always carries the
block that matches its strategy.
"""
from __future__ import annotations

from typing import Literal

from pydantic import model_validator
from pydantic_core import PydanticCustomError

from api.config.base import DeviceKey, Percentage, StrictModel
from api.config.quantity import MemoryLimit
from api.names import CONFIG_API_VERSION

Strategy = Literal["TimeSlicing", "MPS"]
# nvidia-smi compute-policy --set-timeslice values 0..3.
Interval = Literal["Default", "Short", "Medium", "Long"]
TIMESLICE_VALUES: dict[str, int] = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}


class TimeSlicingConfig(StrictModel):
    interval: Interval = "Default"


class MpsConfig(StrictModel):
    active_thread_percentage: Percentage | None = None
    pinned_memory_limit: MemoryLimit | None = None
    per_device_pinned_memory_limit: dict[DeviceKey, MemoryLimit] | None = None


def _conflict(field: str, strategy: str) -> PydanticCustomError:
    return PydanticCustomError("strategy_conflict", "must not be set when strategy is {strategy}",
                               {"field": field, "strategy": strategy})


class GpuSharing(StrictModel):
    strategy: Strategy
    time_slicing: TimeSlicingConfig | None = None
    mps: MpsConfig | None = None

    @model_validator(mode="after")
    def _one_strategy(self) -> GpuSharing:
        if self.strategy == "TimeSlicing":
            if self.mps is not None:
                raise _conflict("mps", self.strategy)
            return self if self.time_slicing else self.model_copy(update={"time_slicing": TimeSlicingConfig()})
        if self.time_slicing is not None:
            raise _conflict("timeSlicing", self.strategy)
        return self if self.mps else self.model_copy(update={"mps": MpsConfig()})


class MigSharing(StrictModel):
    strategy: Strategy
    mps: MpsConfig | None = None

    @model_validator(mode="after")
    def _mps_only(self) -> MigSharing:
        if self.strategy != "MPS":
            raise PydanticCustomError(
                "mig_strategy", "MIG devices support only MPS (time-slicing applies to a whole GPU), got {got}",
                {"field": "strategy", "got": repr(self.strategy)})
        return self if self.mps else self.model_copy(update={"mps": MpsConfig()})


class GpuConfig(StrictModel):
    api_version: Literal["gpu.dra-driver.io/v1alpha1"] = CONFIG_API_VERSION
    kind: Literal["GpuConfig"] = "GpuConfig"
    sharing: GpuSharing | None = None


class MigDeviceConfig(StrictModel):
    api_version: Literal["gpu.dra-driver.io/v1alpha1"] = CONFIG_API_VERSION
    kind: Literal["MigDeviceConfig"] = "MigDeviceConfig"
    sharing: MigSharing | None = None


DeviceConfig = GpuConfig | MigDeviceConfig

