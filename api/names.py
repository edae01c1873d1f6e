"""Names shared by the API types, the DeviceClasses and the deployment: driver names and config versions."""
from __future__ import annotations

from typing import Final

# The DRA driver name: ResourceSlice spec.driver, the CEL attribute domain, the kubelet registration name.
DEFAULT_DRIVER_NAME = "gpu.dra-driver.io"
# Driver name in NVIDIA compatibility mode, so claims and classes written for NVIDIA's driver keep working.
NVIDIA_DRIVER_NAME = "gpu.nvidia.com"

# apiVersion of our opaque device configuration (ResourceClaim / DeviceClass config[].opaque.parameters).
CONFIG_API_VERSION: Final = "gpu.dra-driver.io/v1alpha1"
# NVIDIA's opaque configuration, accepted in compatibility mode only.
NVIDIA_CONFIG_API_VERSION: Final = "resource.nvidia.com/v1beta1"
