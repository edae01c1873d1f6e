"""From an allocated ResourceClaim to a prepare plan: which devices, what each must get.

Pure: no hardware, no files. Every problem raises ``PlanError`` with a message naming the request, the
device and, for configuration problems, the config entry and field, because this text reaches the user
as the pod's FailedPrepareDynamicResources event.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from api.config import (
    ConfigError,
    DeviceConfig,
    GpuConfig,
    MigDeviceConfig,
    check_config_for_device_type,
    decode_opaque_config,
    merge_allocation_configs,
    restore_claim_request_scopes,
)
from api.config.errors import printable
from api.quantity import MIB, parse_quantity
from dra.model.devices import KIND_GPU, KIND_MIG, KIND_SHARED, KIND_SLOT, Device
from kubeletplugin.claims import AllocatedDevice, ClaimError, allocation_for

TIMESLICE_DEFAULT = "Default"


class PlanError(ClaimError):
    """The claim's allocation or configuration cannot be prepared on this node. The message quotes the claim
    (device and request names from its allocation), so it is made one printable line here, for every message."""

    def __init__(self, message: str | ConfigError) -> None:
        super().__init__(printable(str(message)), reason="plan")


@dataclass(frozen=True)
class MpsPlan:
    """One MPS control daemon's limits (``None``: no limit)."""

    thread_percentage: int | None
    pinned_memory_limit_bytes: int | None


@dataclass(frozen=True)
class DevicePlan:
    """What preparing one allocated device involves."""

    result: AllocatedDevice
    device: Device
    config_key: tuple[str, int] | None     # (source, position) of the effective config; devices with the same
    # key share one config object (one MPS daemon per GPU for them)
    timeslice: str | None                  # interval to apply to the GPU (time-slicing), None: leave it alone
    mps: MpsPlan | None                    # MPS daemon to run for this device, None: no MPS
    mig_instances: int = 1                 # MIG devices to create for a share of a one-profile MIG device

    @property
    def name(self) -> str:
        return self.device.name


def _config_where(key: tuple[str, int] | None) -> str:
    if key is None:
        return "config"
    return f"status.allocation.devices.config[{key[1]}] ({key[0]})"


def _per_device_limit(mps: Any, device: Device, index: int) -> int | None:
    """perDevicePinnedMemoryLimit keyed by the device's position in the claim, its UUID or its name."""
    per = getattr(mps, "per_device_pinned_memory_limit", None) or {}
    for key in (str(index), device.mig_uuid or "", device.gpu_uuid if device.kind != KIND_MIG else "", device.name):
        if key and key in per:
            return int(per[key])
    return None


def _interval(sharing: Any) -> str:
    ts = getattr(sharing, "time_slicing", None)
    return ts.interval if ts is not None else TIMESLICE_DEFAULT


@dataclass(frozen=True)
class SlotShare:
    """What one allocation of a slot device holds: ``slots`` of the GPU's ``count``, and the MPS limits that
    come with them (k/N of the GPU's threads and memory; None for time-slicing)."""

    slots: int
    count: int
    thread_percentage: int | None
    memory_limit_mib: int | None

    @property
    def words(self) -> str:
        return f"{self.slots} of {self.count} slots" if self.slots > 1 else f"one of {self.count} slots"


def consumed_units(result: AllocatedDevice, capacity: str, n: int, where: str) -> int:
    """The whole number of units (1..n) of ``capacity`` a share of a capacity-layout device consumed (the
    scheduler fills in the requestPolicy default when the request names none)."""
    raw = result.consumed_capacity.get(capacity)
    if raw is None:
        raise PlanError(f"{where}: the allocation has no consumedCapacity for {capacity} (a share of this device "
                        "always has one; was the claim allocated by a scheduler without consumable capacity?)")
    try:
        amount = parse_quantity(raw)
    except ValueError:
        raise PlanError(f"{where}: consumedCapacity {capacity} {raw!r} is not a quantity") from None
    if amount != int(amount) or not 1 <= amount <= n:
        raise PlanError(f"{where}: consumedCapacity {capacity} {raw} is not a whole number of {capacity} "
                        f"from 1 to {n}")
    return int(amount)


def slot_share(result: AllocatedDevice, device: Device, where: str) -> SlotShare:
    """The share of a slot device: 1 slot for a slot of the devices layout, the consumed ``slots`` capacity for
    the slots device of the capacity layout."""
    n = device.slot_count or 1
    k = consumed_units(result, "slots", n, where) if device.allow_multiple_allocations else 1
    threads = device.mps_thread_percentage * k if device.mps_thread_percentage is not None else None
    mib = device.mps_memory_limit_mib * k if device.mps_memory_limit_mib is not None else None
    return SlotShare(k, n, threads, mib)


def _check_slot_share(mps: MpsPlan, share: SlotShare, where: str) -> None:
    """An MPS slot's limits are its share of the GPU; a config may lower them, never raise them (other slots of
    the GPU are published on the assumption that it does not)."""
    share_threads, share_mib = share.thread_percentage, share.memory_limit_mib
    if share_threads is not None and mps.thread_percentage is not None and mps.thread_percentage > share_threads:
        raise PlanError(f"{where}: activeThreadPercentage {mps.thread_percentage} exceeds the slot's share of "
                        f"{share_threads} % ({share.words}; a config may only lower it)")
    limit = mps.pinned_memory_limit_bytes
    if share_mib is not None and limit is not None and limit > share_mib * MIB:
        raise PlanError(f"{where}: pinned memory limit {limit // MIB}Mi exceeds the slot's share of {share_mib}Mi "
                        f"({share.words}; a config may only lower it)")


def _device_plan(result: AllocatedDevice, device: Device, index: int, config: DeviceConfig | None,
                 key: tuple[str, int] | None, limits_above_share: bool = False) -> DevicePlan:
    where = f"request {result.base_request!r}, device {device.name}"
    sharing = getattr(config, "sharing", None) if config is not None else None
    strategy = sharing.strategy if sharing is not None else None
    mps_cfg = getattr(sharing, "mps", None) if sharing is not None else None
    timeslice: str | None = None
    mps: MpsPlan | None = None

    def mps_plan(default_threads: int | None, default_limit: int | None) -> MpsPlan:
        threads = getattr(mps_cfg, "active_thread_percentage", None) if mps_cfg is not None else None
        limit = _per_device_limit(mps_cfg, device, index) if mps_cfg is not None else None
        if limit is None and mps_cfg is not None:
            limit = getattr(mps_cfg, "pinned_memory_limit", None)
        return MpsPlan(thread_percentage=threads if threads is not None else default_threads,
                       pinned_memory_limit_bytes=int(limit) if limit is not None else default_limit)

    if device.kind == KIND_GPU:
        if strategy == "TimeSlicing":
            timeslice = _interval(sharing)
        elif strategy == "MPS":
            mps = mps_plan(None, None)
    elif device.kind == KIND_SLOT:
        # A slot's sharing mechanism is fixed by the node policy (attribute `sharing`); a config may tune
        # it but not switch it, since the other slots of the GPU rely on it.
        if device.sharing == "mps":
            if strategy == "TimeSlicing":
                raise PlanError(f"{where}: {_config_where(key)}: sharing.strategy: TimeSlicing does not apply to "
                                "an MPS slot (the slot's sharing attribute is mps)")
            share = slot_share(result, device, where)
            mps = mps_plan(share.thread_percentage,
                           share.memory_limit_mib * MIB if share.memory_limit_mib else None)
            if not limits_above_share:
                _check_slot_share(mps, share, f"{where}: {_config_where(key)}: sharing.mps")
        else:
            if strategy == "MPS":
                raise PlanError(f"{where}: {_config_where(key)}: sharing.strategy: MPS does not apply to a "
                                "time-slicing slot (the slot's sharing attribute is time-slicing)")
            slot_share(result, device, where)     # a malformed share is refused for time-slicing too
            # Without a TimeSlicing config the GPU keeps its interval (others' claims may have set it).
            timeslice = _interval(sharing) if strategy == "TimeSlicing" else None
    elif device.kind == KIND_SHARED:
        memory = result.consumed_capacity.get("memory")
        share_bytes = parse_quantity(memory) if memory else None
        if device.sharing == "mps":
            if strategy == "TimeSlicing":
                raise PlanError(f"{where}: {_config_where(key)}: sharing.strategy: TimeSlicing does not apply to "
                                "an MPS memory share")
            # The share's memory is its budget: MPS enforces it as the pinned memory limit.
            planned = mps_plan(None, share_bytes)
            limit = planned.pinned_memory_limit_bytes
            if share_bytes is not None and limit is not None and limit > share_bytes:
                raise PlanError(f"{where}: {_config_where(key)}: sharing.mps pinned memory limit {limit // MIB}Mi "
                                f"exceeds the {memory} of memory allocated to this share")
            mps = planned
        else:
            if strategy == "MPS":
                raise PlanError(f"{where}: {_config_where(key)}: sharing.strategy: MPS does not apply to a "
                                "time-slicing memory share")
            timeslice = _interval(sharing) if strategy == "TimeSlicing" else None
    elif device.kind == KIND_MIG:
        if strategy == "MPS":
            mps = mps_plan(None, None)
    instances = 1
    if device.kind == KIND_MIG and device.allow_multiple_allocations:
        instances = consumed_units(result, "instances", device.mig_instances or 1, where)
        if mps is not None and instances > 1:
            raise PlanError(f"{where}: {_config_where(key)}: sharing.strategy: MPS serves one MIG device per daemon; "
                            f"a share of {instances} instances would need {instances} (ask for one instance per "
                            "request, or leave MPS out)")
    return DevicePlan(result=result, device=device, config_key=key, timeslice=timeslice, mps=mps,
                      mig_instances=instances)


def _path(obj: Any, *keys: str) -> list[Any]:
    """The list at ``obj[k1][k2]...``, or [] where any step is missing or of another type."""
    for key in keys:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj if isinstance(obj, list) else []


def plan_claim(claim: dict[str, Any], *, driver_name: str, pool_name: str, devices: Mapping[str, Device],
               compat_nvidia: bool = False, mps_limits_above_share: bool = False) -> list[DevicePlan]:
    """The prepare plan of this driver's devices in ``claim`` (allocation order).

    ``devices`` are the devices this node publishes, by name; ``mps_limits_above_share``: the node policy lets
    a config raise an MPS slot's limits above its share."""
    alloc = allocation_for(claim, driver_name, pool_name)
    raw_configs = _path(claim, "status", "allocation", "devices", "config")   # shapes checked by allocation_for
    # The user's request scoping decides which config applies, and whether a kind mismatch is an error.
    spec_configs = [c for c in _path(claim, "spec", "devices", "config") if isinstance(c, Mapping)]
    raw_configs = restore_claim_request_scopes(raw_configs, spec_configs)
    # Every entry for this driver must decode, whether or not it ends up applying to a device: an entry for all
    # requests with a misspelt kind would otherwise be skipped in silence and the defaults used instead.
    for given in alloc.configs:
        try:
            decode_opaque_config(given.parameters, compat_nvidia=compat_nvidia)
        except ConfigError as exc:
            raise PlanError(exc.with_prefix(f"status.allocation.devices.config[{given.index}].opaque.parameters")
                            ) from None
    plans: list[DevicePlan] = []
    seen: set[tuple[str, str | None]] = set()
    for index, result in enumerate(alloc.devices):
        device = devices.get(result.device)
        if device is None:
            raise PlanError(f"request {result.base_request!r}: device {result.device} is not published by this node "
                            f"(pool {pool_name}); was the node's GPU configuration changed?")
        ident = (result.device, result.share_id)
        if ident in seen:
            raise PlanError(f"request {result.base_request!r}: device {result.device} is allocated twice in the claim")
        seen.add(ident)
        if result.admin_access:
            # Admin access grants monitoring access to a device in use by others: no configuration applies.
            plans.append(DevicePlan(result=result, device=device, config_key=None, timeslice=None, mps=None))
            continue
        entry = merge_allocation_configs(raw_configs, result.request, driver_name=driver_name,
                                         device_type=device.kind)
        config: DeviceConfig | None = None
        key: tuple[str, int] | None = None
        if entry is not None:
            key = (entry.source, entry.position)
            try:
                config = decode_opaque_config(entry.parameters, compat_nvidia=compat_nvidia)
                check_config_for_device_type(config, device.kind)
            except ConfigError as exc:
                raise PlanError(f"request {result.base_request!r}, device {result.device}: "
                                f"{exc.with_prefix(f'status.allocation.devices.config[{entry.position}].opaque.parameters')}"
                                ) from None
            assert isinstance(config, (GpuConfig, MigDeviceConfig))
        plans.append(_device_plan(result, device, index, config, key, mps_limits_above_share))
    return plans
