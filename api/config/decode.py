"""decode_opaque_config: user parameters (a claim's or class's config[].opaque.parameters) -> typed config."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from api.config.errors import ConfigError, describe, problems_from_validation_error
from api.config.nvidia import NvidiaGpuConfig, NvidiaMigDeviceConfig
from api.config.v1alpha1 import DeviceConfig, GpuConfig, MigDeviceConfig
from api.names import CONFIG_API_VERSION, NVIDIA_CONFIG_API_VERSION

# apiVersion -> kind -> type. NVIDIA's version is only consulted in compatibility mode.
OUR_KINDS: dict[str, type[BaseModel]] = {"GpuConfig": GpuConfig, "MigDeviceConfig": MigDeviceConfig}
NVIDIA_KINDS: dict[str, type[BaseModel]] = {"GpuConfig": NvidiaGpuConfig, "MigDeviceConfig": NvidiaMigDeviceConfig}

# Our configs are at most a handful of levels deep; anything far deeper is refused before the model sees it (pydantic
# and the message builders recurse, and a deep enough document would end in RecursionError instead of a message).
MAX_PARAMETERS_DEPTH = 32

# Which config kind configures which device `type` attribute value (slots and shares are carved from GPUs).
CONFIG_KIND_FOR_DEVICE_TYPE: dict[str, str] = {
    "gpu": "GpuConfig",
    "slot": "GpuConfig",
    "shared": "GpuConfig",
    "mig": "MigDeviceConfig",
}


def _registry(compat_nvidia: bool) -> dict[str, dict[str, type[BaseModel]]]:
    registry = {CONFIG_API_VERSION: OUR_KINDS}
    if compat_nvidia:
        registry[NVIDIA_CONFIG_API_VERSION] = NVIDIA_KINDS
    return registry


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether objects and lists nest more than `limit` levels in `value` (a JSON-like document; walked without
    recursion, so any depth is measured)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, Mapping) else node if isinstance(node, (list, tuple)) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def decode_opaque_config(parameters: Any, *, compat_nvidia: bool) -> DeviceConfig:
    """Validate and decode opaque parameters. NVIDIA's types are mapped to ours when `compat_nvidia` is set.

    Raises ConfigError naming the field path, the apiVersion and kind, and for an unknown apiVersion
    or kind the supported ones.
    """
    if not isinstance(parameters, Mapping):
        raise ConfigError([("", f"parameters must be an object with apiVersion and kind, got {describe(parameters)}")])
    if nested_deeper_than(parameters, MAX_PARAMETERS_DEPTH):
        raise ConfigError([("", f"parameters nested deeper than {MAX_PARAMETERS_DEPTH} levels")])
    api_version, kind = parameters.get("apiVersion"), parameters.get("kind")
    registry = _registry(compat_nvidia)
    if not isinstance(api_version, str) or not api_version:
        reason = "required" if api_version is None else f"must be a non-empty string, got {describe(api_version)}"
        raise ConfigError([("apiVersion", f"{reason}; supported: {', '.join(registry)}")],
                          kind=kind if isinstance(kind, str) else None)
    if api_version not in registry:
        if api_version == NVIDIA_CONFIG_API_VERSION:
            reason = (f"{api_version!r} is accepted only in NVIDIA compatibility mode (compatNvidia); "
                      f"supported: {', '.join(registry)}")
        else:
            reason = f"unsupported {api_version!r}; supported: {', '.join(registry)}"
        raise ConfigError([("apiVersion", reason)])
    kinds = registry[api_version]
    if not isinstance(kind, str) or kind not in kinds:
        got = "missing" if kind is None else f"unsupported {describe(kind)}"
        raise ConfigError([("kind", f"{got}; {api_version} supports: {', '.join(kinds)}")], api_version=api_version)
    model = kinds[kind]
    try:
        decoded = model.model_validate(dict(parameters))
    except ValidationError as exc:
        raise ConfigError(problems_from_validation_error(exc, model), api_version=api_version, kind=kind) from None
    if isinstance(decoded, (NvidiaGpuConfig, NvidiaMigDeviceConfig)):
        return decoded.to_ours()
    assert isinstance(decoded, (GpuConfig, MigDeviceConfig))
    return decoded


def encode_opaque_config(config: DeviceConfig) -> dict[str, Any]:
    """The wire form of a decoded config (our apiVersion), e.g. for a checkpoint; decodes back to an equal config."""
    return config.model_dump(mode="json", exclude_none=True)


def check_config_for_device_type(config: DeviceConfig, device_type: str) -> None:
    """Raise ConfigError when `config` cannot configure a device of this `type` (e.g. GpuConfig on a MIG device)."""
    wanted = CONFIG_KIND_FOR_DEVICE_TYPE.get(device_type)
    if wanted is None:
        raise ConfigError([("kind", f"devices of type {device_type!r} take no configuration")],
                          api_version=config.api_version, kind=config.kind)
    if config.kind != wanted:
        raise ConfigError([("kind", f"{config.kind} cannot configure a {device_type!r} device; use {wanted}")],
                          api_version=config.api_version, kind=config.kind)

