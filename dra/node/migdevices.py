"""MIG actions: create and destroy MIG devices through NVML.

Every function takes the NVML library as ``nvml``: the real ``pynvml`` module or ``dra.sim.fakenvml.FakeNvml``.
Only pynvml's own function names and constants are used, read from that object, so the code is identical
in production and in tests.

A "MIG device" here is one GPU instance (GI) at an exact placement with one compute instance (CI) that
spans the whole GI, which is what a DRA MIG device stands for.

Sharing actions that NVML does not cover (time-slice, compute mode, MPS daemons) live in
``dra.node.sharingtools`` (the command seam) and ``dra.node.sharing`` (time-slice bookkeeping and the MPS
supervisor).
"""
from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterable

from dra.model.gpu import mig_mode_switches_at_runtime

log = logging.getLogger(__name__)

# Room for every placement NVML can list for one profile (at most 8 memory slices per GPU today).
_MAX_PLACEMENTS = 32


class MigError(RuntimeError):
    """A MIG action failed; ``code`` is the NVML error code when NVML reported one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class MigLive:
    """A MIG device that exists on the GPU now."""

    gi_id: int
    ci_id: int
    uuid: str                    # "MIG-..." ("" if it could not be read)
    parent_uuid: str = ""
    profile_id: int = -1         # GPU-instance profile id (info.id, e.g. 19)
    start: int = -1              # placement start (memory slice)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.parent_uuid, self.gi_id, self.ci_id)


# One lock per parent GPU: MIG mode switches and instance creation/destruction on one GPU must not interleave
# (a mode switch while another thread creates an instance would fail it), while different GPUs run in parallel.
_gpu_locks: dict[str, threading.Lock] = {}
_gpu_locks_guard = threading.Lock()


def _gpu_lock(uuid: str) -> threading.Lock:
    with _gpu_locks_guard:
        return _gpu_locks.setdefault(uuid, threading.Lock())


def _code(nvml: Any, err: BaseException) -> int | None:
    return getattr(err, "value", None) if isinstance(err, nvml.NVMLError) else None


def _is(nvml: Any, err: BaseException, *names: str) -> bool:
    code = _code(nvml, err)
    return code is not None and any(code == getattr(nvml, name) for name in names)


def _gpu_handle(nvml: Any, uuid: str) -> Any:
    try:
        return nvml.nvmlDeviceGetHandleByUUID(uuid)
    except nvml.NVMLError as err:
        raise MigError(f"GPU {uuid}: cannot get an NVML handle: {err}", _code(nvml, err)) from err


def can_toggle_mig_mode(nvml: Any, handle: Any) -> bool:
    """Whether this GPU switches MIG mode without a reset (dra.model.gpu)."""
    return mig_mode_switches_at_runtime(nvml.nvmlDeviceGetCudaComputeCapability(handle))


def mig_enabled(nvml: Any, handle: Any) -> bool:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError as err:
        if _is(nvml, err, "NVML_ERROR_NOT_SUPPORTED"):
            return False
        raise
    return current == nvml.NVML_DEVICE_MIG_ENABLE


def _ensure_mig_enabled(nvml: Any, handle: Any, uuid: str) -> bool:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError as err:
        raise MigError(f"GPU {uuid}: cannot read MIG mode (is it MIG-capable?): {err}", _code(nvml, err)) from err
    if current == nvml.NVML_DEVICE_MIG_ENABLE:
        return False
    if not can_toggle_mig_mode(nvml, handle):
        raise MigError(f"GPU {uuid}: MIG mode is disabled and this GPU (before Hopper) needs a GPU reset to enable "
                       "it; enable MIG mode (nvidia-smi -i <gpu> -mig 1 and a reset) before starting the driver")
    try:
        nvml.nvmlDeviceSetMigMode(handle, nvml.NVML_DEVICE_MIG_ENABLE)
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError as err:
        raise MigError(f"GPU {uuid}: enabling MIG mode failed: {err}", _code(nvml, err)) from err
    if current != nvml.NVML_DEVICE_MIG_ENABLE:
        raise MigError(f"GPU {uuid}: MIG mode is only pending after enabling it; the GPU needs a reset")
    log.info("enabled MIG mode on GPU %s", uuid)
    return True


def disable_mig_mode_if_unused(nvml: Any, parent_uuid: str) -> bool:
    """Turn MIG mode off when no GPU instance is left (Hopper+ only), so the GPU can be used whole again.

    Returns whether the mode was changed. Never touches a GPU that needs a reset to switch back.
    """
    handle = _gpu_handle(nvml, parent_uuid)
    with _gpu_lock(parent_uuid):
        if not mig_enabled(nvml, handle) or not can_toggle_mig_mode(nvml, handle):
            return False
        if _gpu_instances(nvml, handle):
            return False
        try:
            nvml.nvmlDeviceSetMigMode(handle, nvml.NVML_DEVICE_MIG_DISABLE)
        except nvml.NVMLError as err:
            if _is(nvml, err, "NVML_ERROR_IN_USE"):
                return False  # an instance appeared meanwhile (out of our hands) or a process holds the GPU
            raise MigError(f"GPU {parent_uuid}: disabling MIG mode failed: {err}", _code(nvml, err)) from err
    log.info("disabled MIG mode on GPU %s (no MIG devices left)", parent_uuid)
    return True


# ----- create --------------------------------------------------------------------------------------------------
def create_mig_device(nvml: Any, parent_uuid: str, profile_id: int, start: int) -> MigLive:
    """Create the MIG device ``profile_id`` at memory slice ``start`` on GPU ``parent_uuid``.

    Enables MIG mode first where that is possible without a reset (Hopper and later); on Ampere with MIG off
    this is an error. Placement is exact (never NVML's auto-placement): the scheduler chose it. If anything
    after the GPU instance's creation fails, what was created is destroyed again before the error is raised.
    """
    handle = _gpu_handle(nvml, parent_uuid)
    what = f"GPU {parent_uuid}: MIG profile {profile_id} at start {start}"
    with _gpu_lock(parent_uuid):
        _ensure_mig_enabled(nvml, handle, parent_uuid)
        placement = _placement(nvml, handle, profile_id, start, what)
        try:
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile_id, ctypes.byref(placement))
        except nvml.NVMLError as err:
            hint = ""
            if _is(nvml, err, "NVML_ERROR_INSUFFICIENT_RESOURCES"):
                hint = " (the memory slices overlap an existing MIG device, or the profile's instance limit is reached)"
            raise MigError(f"{what}: creating the GPU instance failed: {err}{hint}", _code(nvml, err)) from err
        ci = None
        try:
            gi_id = nvml.nvmlGpuInstanceGetInfo(gi).id
            ci_profile = _full_ci_profile(nvml, gi, what)
            ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile)
            ci_id = nvml.nvmlComputeInstanceGetInfo(ci).id
            mig_uuid = _mig_uuid(nvml, handle, gi_id, ci_id)
            if not mig_uuid:
                raise MigError(f"{what}: created GI {gi_id} / CI {ci_id} but found no MIG device for it")
        except BaseException as err:
            _rollback(nvml, gi, ci, what)
            if isinstance(err, MigError):
                raise
            if isinstance(err, nvml.NVMLError):
                raise MigError(f"{what}: creating the compute instance failed: {err}", _code(nvml, err)) from err
            raise
    log.info("created MIG device %s (GI %d, CI %d) on GPU %s, profile %d at %d", mig_uuid, gi_id, ci_id,
             parent_uuid, profile_id, start)
    return MigLive(gi_id=gi_id, ci_id=ci_id, uuid=mig_uuid, parent_uuid=parent_uuid, profile_id=profile_id,
                   start=start)


def _placement(nvml: Any, handle: Any, profile_id: int, start: int, what: str) -> Any:
    placements = (nvml.c_nvmlGpuInstancePlacement_t * _MAX_PLACEMENTS)()
    count = ctypes.c_uint(0)
    try:
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, placements, ctypes.byref(count))
    except nvml.NVMLError as err:
        raise MigError(f"{what}: the GPU does not offer this profile: {err}", _code(nvml, err)) from err
    starts = [placements[i].start for i in range(min(count.value, _MAX_PLACEMENTS))]
    for i in range(min(count.value, _MAX_PLACEMENTS)):
        if placements[i].start == start:
            chosen = nvml.c_nvmlGpuInstancePlacement_t()
            chosen.start = placements[i].start
            chosen.size = placements[i].size
            return chosen
    raise MigError(f"{what}: {start} is not a valid start for this profile (valid: {starts})",
                   getattr(nvml, "NVML_ERROR_INVALID_ARGUMENT", None))


def _full_ci_profile(nvml: Any, gi: Any, what: str) -> int:
    """The compute-instance profile that spans the whole GPU instance (largest slice count offered)."""
    best: tuple[int, int] | None = None  # (slices, profile id)
    for index in range(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, index, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        except nvml.NVMLError as err:
            if _is(nvml, err, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT"):
                continue  # profile absent on this GI: asking is how NVML tells
            raise
        if best is None or info.sliceCount > best[0]:
            best = (info.sliceCount, info.id)
    if best is None:
        raise MigError(f"{what}: the GPU instance offers no compute-instance profile")
    return best[1]


def _mig_uuid(nvml: Any, handle: Any, gi_id: int, ci_id: int) -> str:
    for mig in _mig_handles(nvml, handle):
        if nvml.nvmlDeviceGetGpuInstanceId(mig) == gi_id and nvml.nvmlDeviceGetComputeInstanceId(mig) == ci_id:
            return nvml.nvmlDeviceGetUUID(mig)
    return ""


def _mig_handles(nvml: Any, handle: Any) -> list[Any]:
    out = []
    for index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            out.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index))
        except nvml.NVMLError as err:
            if _is(nvml, err, "NVML_ERROR_NOT_FOUND", "NVML_ERROR_INVALID_ARGUMENT"):
                continue
            raise
    return out


def _rollback(nvml: Any, gi: Any, ci: Any, what: str) -> None:
    for destroy, obj in ((nvml.nvmlComputeInstanceDestroy, ci), (nvml.nvmlGpuInstanceDestroy, gi)):
        if obj is None:
            continue
        try:
            destroy(obj)
        except nvml.NVMLError as err:
            log.error("%s: could not undo a partly created MIG device (%s); start-up cleanup will retry", what, err)
            return


# ----- destroy -------------------------------------------------------------------------------------------------
def destroy_mig_device(nvml: Any, parent_uuid: str, gi_id: int, ci_id: int, mig_uuid: str | None = None) -> bool:
    """Destroy the compute instance and then its GPU instance. Something already gone is fine.

    ``mig_uuid``, when known, guards against destroying a *different* MIG device that reuses the same GI/CI
    ids after ours went away. Returns whether anything was destroyed.
    """
    handle = _gpu_handle(nvml, parent_uuid)
    what = f"GPU {parent_uuid}: MIG device GI {gi_id} / CI {ci_id}"
    with _gpu_lock(parent_uuid):
        if not mig_enabled(nvml, handle):
            return False
        try:
            gi = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
        except nvml.NVMLError as err:
            if _is(nvml, err, "NVML_ERROR_NOT_FOUND", "NVML_ERROR_INVALID_ARGUMENT"):
                return False
            raise MigError(f"{what}: cannot look up the GPU instance: {err}", _code(nvml, err)) from err
        if mig_uuid:
            current = _mig_uuid(nvml, handle, gi_id, ci_id)
            if current and current != mig_uuid:
                log.warning("%s is now %s, not %s: leaving it alone", what, current, mig_uuid)
                return False
        destroyed = False
        try:
            ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
        except nvml.NVMLError as err:
            if not _is(nvml, err, "NVML_ERROR_NOT_FOUND", "NVML_ERROR_INVALID_ARGUMENT"):
                raise MigError(f"{what}: cannot look up the compute instance: {err}", _code(nvml, err)) from err
            ci = None
        if ci is not None:
            try:
                nvml.nvmlComputeInstanceDestroy(ci)
                destroyed = True
            except nvml.NVMLError as err:
                if _is(nvml, err, "NVML_ERROR_IN_USE"):
                    raise MigError(f"{what}: a process still uses the MIG device", _code(nvml, err)) from err
                raise MigError(f"{what}: destroying the compute instance failed: {err}", _code(nvml, err)) from err
        try:
            nvml.nvmlGpuInstanceDestroy(gi)
            destroyed = True
        except nvml.NVMLError as err:
            if _is(nvml, err, "NVML_ERROR_NOT_FOUND", "NVML_ERROR_INVALID_ARGUMENT"):
                return destroyed
            if _is(nvml, err, "NVML_ERROR_IN_USE"):
                raise MigError(f"{what}: the GPU instance still has other compute instances", _code(nvml, err)) from err
            raise MigError(f"{what}: destroying the GPU instance failed: {err}", _code(nvml, err)) from err
    log.info("destroyed MIG device GI %d / CI %d on GPU %s", gi_id, ci_id, parent_uuid)
    return destroyed


# ----- enumerate -----------------------------------------------------------------------------------------------
def _gpu_instances(nvml: Any, handle: Any) -> list[Any]:
    """Every GPU instance on the GPU, over all GI profiles."""
    out: list[Any] = []
    seen_ids: set[int] = set()
    for index in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except nvml.NVMLError as err:
            if _is(nvml, err, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT"):
                continue
            raise
        if info.id in seen_ids:
            continue
        seen_ids.add(info.id)
        size = max(int(info.instanceCount), 1)
        array = (nvml.c_nvmlGpuInstance_t * size)()
        count = ctypes.c_uint(0)
        nvml.nvmlDeviceGetGpuInstances(handle, info.id, array, ctypes.byref(count))
        out.extend(array[i] for i in range(min(count.value, size)))
    return out


def _compute_instances(nvml: Any, gi: Any) -> list[Any]:
    out: list[Any] = []
    for index in range(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, index, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        except nvml.NVMLError as err:
            if _is(nvml, err, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT"):
                continue
            raise
        size = max(int(info.instanceCount), 1)
        array = (nvml.c_nvmlComputeInstance_t * size)()
        count = ctypes.c_uint(0)
        nvml.nvmlGpuInstanceGetComputeInstances(gi, info.id, array, ctypes.byref(count))
        out.extend(array[i] for i in range(min(count.value, size)))
    return out


def list_mig_devices(nvml: Any, parent_uuid: str) -> list[MigLive]:
    """The MIG devices (GI + CI) that exist on a GPU now; GIs without a CI appear with ``ci_id`` -1."""
    handle = _gpu_handle(nvml, parent_uuid)
    if not mig_enabled(nvml, handle):
        return []
    uuids = {(nvml.nvmlDeviceGetGpuInstanceId(m), nvml.nvmlDeviceGetComputeInstanceId(m)): nvml.nvmlDeviceGetUUID(m)
             for m in _mig_handles(nvml, handle)}
    out: list[MigLive] = []
    for gi in _gpu_instances(nvml, handle):
        info = nvml.nvmlGpuInstanceGetInfo(gi)
        cis = _compute_instances(nvml, gi)
        if not cis:
            out.append(MigLive(info.id, -1, "", parent_uuid, info.profileId, info.placement.start))
        for ci in cis:
            ci_id = nvml.nvmlComputeInstanceGetInfo(ci).id
            out.append(MigLive(info.id, ci_id, uuids.get((info.id, ci_id), ""), parent_uuid, info.profileId,
                               info.placement.start))
    return sorted(out, key=lambda m: (m.gi_id, m.ci_id))


def destroy_unknown_mig_devices(
    nvml: Any, keep: Iterable[tuple[str, int, int]], *, gpus: Iterable[str]
) -> list[MigLive]:
    """Start-up cleanup for dynamic MIG: destroy every MIG device on ``gpus`` whose (parent UUID, GI id, CI id)
    is not in ``keep`` (the devices of prepared claims), including GPU instances left without a compute instance
    by a crash.

    ``gpus`` must list only GPUs whose MIG devices this driver owns (dynamic MIG): statically partitioned
    GPUs are managed by the administrator and are never touched. Returns what was destroyed.
    """
    keep_set = set(keep)
    destroyed: list[MigLive] = []
    for parent_uuid in gpus:
        handle = _gpu_handle(nvml, parent_uuid)
        with _gpu_lock(parent_uuid):
            if not mig_enabled(nvml, handle):
                continue
            uuids = {(nvml.nvmlDeviceGetGpuInstanceId(m), nvml.nvmlDeviceGetComputeInstanceId(m)):
                     nvml.nvmlDeviceGetUUID(m) for m in _mig_handles(nvml, handle)}
            for gi in _gpu_instances(nvml, handle):
                info = nvml.nvmlGpuInstanceGetInfo(gi)
                kept_any = False
                for ci in _compute_instances(nvml, gi):
                    ci_id = nvml.nvmlComputeInstanceGetInfo(ci).id
                    if (parent_uuid, info.id, ci_id) in keep_set:
                        kept_any = True
                        continue
                    live = MigLive(info.id, ci_id, uuids.get((info.id, ci_id), ""), parent_uuid, info.profileId,
                                   info.placement.start)
                    try:
                        nvml.nvmlComputeInstanceDestroy(ci)
                    except nvml.NVMLError as err:
                        log.error("cannot destroy unknown MIG device %s (GI %d / CI %d) on GPU %s: %s", live.uuid,
                                  info.id, ci_id, parent_uuid, err)
                        kept_any = True
                        continue
                    destroyed.append(live)
                if kept_any:
                    continue
                try:
                    nvml.nvmlGpuInstanceDestroy(gi)
                except nvml.NVMLError as err:
                    log.error("cannot destroy unknown GPU instance %d on GPU %s: %s", info.id, parent_uuid, err)
                    continue
                if not any(d.parent_uuid == parent_uuid and d.gi_id == info.id for d in destroyed):
                    destroyed.append(MigLive(info.id, -1, "", parent_uuid, info.profileId, info.placement.start))
    for d in destroyed:
        log.warning("destroyed MIG device not owned by any prepared claim: GPU %s GI %d CI %d %s", d.parent_uuid,
                    d.gi_id, d.ci_id, d.uuid)
    return destroyed
