"""Opaque device configuration: our versioned types, NVIDIA-compatible decoding, and precedence rules.

Entry points: `decode_opaque_config` (user parameters -> GpuConfig | MigDeviceConfig, or ConfigError
naming the field) and `merge_configs` / `merge_allocation_configs` (which config applies to a request).
"""
from __future__ import annotations

from api.config.decode import (
    CONFIG_KIND_FOR_DEVICE_TYPE,
    check_config_for_device_type,
    decode_opaque_config,
    encode_opaque_config,
)
from api.config.errors import ConfigError
from api.config.merge import ConfigEntry, merge_allocation_configs, merge_configs, restore_claim_request_scopes
from api.config.quantity import MemoryLimit, Quantity, quantity_bytes
from api.config.v1alpha1 import (
    TIMESLICE_VALUES,
    DeviceConfig,
    GpuConfig,
    GpuSharing,
    MigDeviceConfig,
    MigSharing,
    MpsConfig,
    TimeSlicingConfig,
)

__all__ = [
    "CONFIG_KIND_FOR_DEVICE_TYPE", "TIMESLICE_VALUES", "ConfigEntry", "ConfigError", "DeviceConfig", "GpuConfig",
    "GpuSharing", "MemoryLimit", "MigDeviceConfig", "MigSharing", "MpsConfig", "Quantity",
    "TimeSlicingConfig", "check_config_for_device_type", "decode_opaque_config",
    "encode_opaque_config", "merge_allocation_configs", "merge_configs", "quantity_bytes",
    "restore_claim_request_scopes",
]
