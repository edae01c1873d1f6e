"""The simulated NVML: pynvml's interface, return structures, error codes and MIG hardware rules."""
from __future__ import annotations

import ctypes
import inspect
import threading
import time

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dra.sim.fakenvml import FakeNvml, SimulatedGpu

ERR = pynvml


def make(*models: str, mig: bool = False, numa: int | None = 0) -> FakeNvml:
    gpus = [SimulatedGpu(model=m, uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000", minor=10 + i,
                         pci_bus_id="00000000:%02X:00.0" % (0x18 + i), numa_node=numa,
                         mig_enabled=mig and m not in ("T4", "L4", "L40S", "A10"))
            for i, m in enumerate(models)]
    nvml = FakeNvml(gpus, driver_version="580.95.05", cuda_driver_version=13000)
    nvml.nvmlInit()
    return nvml


def code(exc_info) -> int:
    return exc_info.value.value


def placement(start: int, size: int):
    return pynvml.c_nvmlGpuInstancePlacement_t(start, size)


def create_ids(nvml, h, ids):
    """Create GIs with NVML auto-placement; the starts chosen, or the error code at the first failure."""
    starts = []
    for pid in ids:
        try:
            gi = nvml.nvmlDeviceCreateGpuInstance(h, pid)
        except pynvml.NVMLError as exc:
            return exc.value
        starts.append(nvml.nvmlGpuInstanceGetInfo(gi).placement.start)
    return starts


def full_ci(nvml, gi):
    info = nvml.nvmlGpuInstanceGetInfo(gi)
    for idx in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            ci_info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, idx, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        except pynvml.NVMLError:
            continue
        gi_prof = nvml.nvmlDeviceGetGpuInstanceProfileInfoById(info.device, info.profileId)
        if ci_info.sliceCount == gi_prof.sliceCount:
            return nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
    raise AssertionError("no full-size compute-instance profile")


# -- interface -----------------------------------------------------------------------------------------------


def test_every_simulated_function_exists_in_pynvml_with_the_same_parameters():
    names = [n for n in dir(FakeNvml) if n.startswith("nvml")]
    assert len(names) > 50
    for name in names:
        assert hasattr(pynvml, name), name
        real = [p for p in inspect.signature(getattr(pynvml, name)).parameters]
        fake = [p for p in inspect.signature(getattr(FakeNvml, name)).parameters][1:]
        assert fake == real, name


def test_constants_come_from_pynvml_and_unsimulated_functions_are_refused():
    nvml = make("H100-80GB")
    assert nvml.NVML_DEVICE_MIG_ENABLE == pynvml.NVML_DEVICE_MIG_ENABLE
    assert nvml.NVMLError is pynvml.NVMLError
    assert nvml.c_nvmlGpuInstancePlacement_t is pynvml.c_nvmlGpuInstancePlacement_t
    with pytest.raises(AttributeError, match="does not simulate"):
        nvml.nvmlDeviceGetPowerUsage  # noqa: B018 - the lookup is what raises
    with pytest.raises(AttributeError):
        nvml.no_such_thing  # noqa: B018 - the lookup is what raises


def test_calls_need_init():
    nvml = FakeNvml([SimulatedGpu("T4", "GPU-a", 0, "00000000:18:00.0")])
    with pytest.raises(pynvml.NVMLError) as e:
        nvml.nvmlDeviceGetCount()
    assert code(e) == ERR.NVML_ERROR_UNINITIALIZED
    nvml.nvmlInit()
    nvml.nvmlInit()
    nvml.nvmlShutdown()
    assert nvml.nvmlDeviceGetCount() == 1   # reference counted, like NVML
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()


def test_system_and_identity():
    nvml = make("H100-80GB", "T4")
    assert nvml.nvmlSystemGetDriverVersion() == "580.95.05"
    assert nvml.nvmlSystemGetCudaDriverVersion() == 13000 == nvml.nvmlSystemGetCudaDriverVersion_v2()
    assert nvml.nvmlDeviceGetCount() == 2
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(h, pynvml.c_nvmlDevice_t)
    assert nvml.nvmlDeviceGetName(h) == "NVIDIA H100 80GB HBM3"
    assert nvml.nvmlDeviceGetUUID(h) == "GPU-00000000-0000-0000-0000-000000000000"
    assert nvml.nvmlDeviceGetMinorNumber(h) == 10
    assert nvml.nvmlDeviceGetIndex(h) == 0
    assert nvml.nvmlDeviceGetBrand(h) == pynvml.NVML_BRAND_NVIDIA
    assert nvml.nvmlDeviceGetArchitecture(h) == pynvml.NVML_DEVICE_ARCH_HOPPER
    assert nvml.nvmlDeviceGetCudaComputeCapability(h) == (9, 0)
    mem = nvml.nvmlDeviceGetMemoryInfo(h)
    assert isinstance(mem, pynvml.c_nvmlMemory_t) and mem.total == 81559 << 20
    assert nvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).total == 81559 << 20
    pci = nvml.nvmlDeviceGetPciInfo(h)
    assert isinstance(pci, pynvml.nvmlPciInfo_t)
    assert (pci.busId, pci.busIdLegacy, pci.bus, pci.pciDeviceId) == ("00000000:18:00.0", "0000:18:00.0", 0x18,
                                                                       0x233010DE)
    t4 = nvml.nvmlDeviceGetHandleByUUID("GPU-00000001-0000-0000-0000-000000000000")
    assert nvml.nvmlDeviceGetName(t4) == "Tesla T4"
    assert nvml.nvmlDeviceGetBrand(t4) == pynvml.NVML_BRAND_TESLA
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByPciBusId("0000:19:00.0")).startswith("GPU-00000001")
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID("GPU-nope")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetName(None)


def test_attributes_only_for_mig_devices_and_numa():
    nvml = make("H100-80GB", numa=1)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetAttributes(h)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetNumaNodeId(h)
    mask = nvml.nvmlDeviceGetMemoryAffinity(h, 2, pynvml.NVML_AFFINITY_SCOPE_NODE)
    assert list(mask) == [0b10, 0]


def test_compute_mode():
    nvml = make("L4")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetComputeMode(h) == pynvml.NVML_COMPUTEMODE_DEFAULT
    nvml.nvmlDeviceSetComputeMode(h, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert nvml.nvmlDeviceGetComputeMode(h) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceSetComputeMode(h, 9)


# -- MIG mode ------------------------------------------------------------------------------------------------


def test_mig_mode_not_supported_on_non_mig_gpu():
    nvml = make("L40S")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    for call in (lambda: nvml.nvmlDeviceGetMigMode(h),
                 lambda: nvml.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE),
                 lambda: nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()


def test_ampere_mig_mode_is_pending_until_reset():
    nvml = make("A100-40GB")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(h) == [0, 0]
    assert nvml.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_ERROR_RESET_REQUIRED
    assert nvml.nvmlDeviceGetMigMode(h) == [0, 1]
    with pytest.raises(pynvml.NVMLError_NotSupported):   # not on yet
        nvml.nvmlDeviceCreateGpuInstance(h, 19)
    nvml.reset_gpu(nvml.nvmlDeviceGetUUID(h))
    assert nvml.nvmlDeviceGetMigMode(h) == [1, 1]
    nvml.nvmlDeviceCreateGpuInstance(h, 19)


def test_hopper_mig_mode_switches_at_once_and_cannot_be_disabled_in_use():
    nvml = make("H100-80GB")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert nvml.nvmlDeviceGetMigMode(h) == [1, 1]
    gi = nvml.nvmlDeviceCreateGpuInstance(h, 9)
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_DISABLE)
    nvml.nvmlGpuInstanceDestroy(gi)
    nvml.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_DISABLE)
    assert nvml.nvmlDeviceGetMigMode(h) == [0, 0]


# -- GPU-instance profiles and placements ----------------------------------------------------------------------


def test_profile_info_structures():
    nvml = make("A100-40GB", mig=True)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
    assert (info.id, info.sliceCount, info.instanceCount, info.memorySizeMB, info.multiprocessorCount,
            info.name) == (19, 1, 7, 4864, 14, "MIG 1g.5gb")
    v1 = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 1)
    assert isinstance(v1, pynvml.c_nvmlGpuInstanceProfileInfo_t) and v1.id == 15
    assert nvml.nvmlDeviceGetGpuInstanceProfileInfoV(h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1).name == \
        "MIG 1g.5gb+me"
    with pytest.raises(pynvml.NVMLError_NotSupported):      # a profile this GPU lacks
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)


def test_possible_placements_two_step_and_with_mig_off():
    nvml = make("H100-80GB")          # MIG off: placements are still answered
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    count = ctypes.c_uint(0)
    assert nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 15, None, ctypes.byref(count)) == pynvml.NVML_SUCCESS
    assert count.value == 4
    buf = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 15, buf, ctypes.byref(count))
    assert [(p.start, p.size) for p in buf] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    small = (pynvml.c_nvmlGpuInstancePlacement_t * 2)()
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 19, small, ctypes.byref(count))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 77, None, ctypes.byref(count))


# -- creating GPU instances ----------------------------------------------------------------------------------


def test_overlap_is_insufficient_resources_and_bad_start_invalid_argument():
    nvml = make("H100-80GB", mig=True)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, placement(4, 4))
    assert isinstance(gi, pynvml.c_nvmlGpuInstance_t)
    with pytest.raises(pynvml.NVMLError) as e:
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 14, placement(4, 2))
    assert code(e) == ERR.NVML_ERROR_INSUFFICIENT_RESOURCES
    with pytest.raises(pynvml.NVMLError) as e:
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, placement(7, 1))
    assert code(e) == ERR.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(pynvml.NVMLError) as e:      # placement size must match the profile
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 14, placement(0, 1))
    assert code(e) == ERR.NVML_ERROR_INVALID_ARGUMENT
    # byref() is accepted too, as the C function takes a pointer
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, ctypes.byref(placement(0, 4)))
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstance(h, 19)


def test_create_with_mig_disabled_is_not_supported():
    nvml = make("H100-80GB", mig=False)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, placement(0, 1))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19)


def test_only_one_media_extension_instance():
    nvml = make("A100-40GB", mig=True)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 20, placement(0, 1))
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 20) == 0
    with pytest.raises(pynvml.NVMLError) as e:
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 20, placement(3, 1))
    assert code(e) == ERR.NVML_ERROR_INSUFFICIENT_RESOURCES


def test_a30_me_profiles_share_the_single_ofa():
    nvml = make("A30", mig=True)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 21, placement(0, 1))
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 6, placement(2, 2))
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 5, placement(2, 2))


def test_auto_placement_order_matters_like_the_mig_guide():
    nvml = make("A100-40GB", "A100-40GB", mig=True)
    a, b = nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlDeviceGetHandleByIndex(1)
    assert create_ids(nvml, a, [19, 19, 14, 9]) == ERR.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert create_ids(nvml, b, [9, 19, 14, 19]) == [4, 0, 2, 1]


def test_auto_placement_fills_the_gpu():
    nvml = make("H100-80GB", mig=True)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 7
    assert sorted(create_ids(nvml, h, [19] * 7)) == list(range(7))
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 0
    assert create_ids(nvml, h, [19]) == ERR.NVML_ERROR_INSUFFICIENT_RESOURCES


def test_gpu_instance_ids_follow_placement_and_can_be_listed():
    nvml = make("H100-80GB", mig=True)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    for pid, start, size in [(9, 4, 4), (14, 0, 2), (19, 2, 1), (19, 3, 1)]:
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, pid, placement(start, size))
    count = ctypes.c_uint(0)
    buf = (pynvml.c_nvmlGpuInstance_t * 7)()
    nvml.nvmlDeviceGetGpuInstances(h, 19, buf, ctypes.byref(count))
    infos = [nvml.nvmlGpuInstanceGetInfo(buf[i]) for i in range(count.value)]
    assert [(i.id, i.profileId, i.placement.start, i.placement.size) for i in infos] == [(9, 19, 2, 1),
                                                                                         (10, 19, 3, 1)]
    assert nvml.nvmlDeviceGetUUID(infos[0].device) == nvml.nvmlDeviceGetUUID(h)
    assert nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(h, 2)).profileId == 9
    assert nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(h, 3)).profileId == 14
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetGpuInstanceById(h, 1)


# -- compute instances and MIG devices -----------------------------------------------------------------------


def test_compute_instance_is_a_mig_device():
    nvml = make("A100-40GB", mig=True)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, placement(4, 4))
    ci_prof = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    assert (ci_prof.sliceCount, ci_prof.instanceCount, ci_prof.multiprocessorCount) == (3, 1, 42)
    with pytest.raises(pynvml.NVMLError_NotSupported):   # 4 slices do not fit a 3g instance
        nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_prof.id)
    assert isinstance(ci, pynvml.c_nvmlComputeInstance_t)
    info = nvml.nvmlComputeInstanceGetInfo(ci)
    assert (info.id, info.profileId, info.placement.start, info.placement.size) == (0, ci_prof.id, 0, 3)
    assert nvml.nvmlGpuInstanceGetInfo(info.gpuInstance).id == 2
    ci_mig_uuid = nvml.nvmlDeviceGetUUID(info.device)     # the new MIG device, straight from the CI info

    assert nvml.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 1)
    assert nvml.nvmlDeviceIsMigDeviceHandle(mig).value == 1
    assert nvml.nvmlDeviceIsMigDeviceHandle(h).value == 0
    uuid = nvml.nvmlDeviceGetUUID(mig)
    assert uuid.startswith("MIG-") and len(uuid) == 40 and uuid == ci_mig_uuid
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByUUID(uuid)) == uuid
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)) == \
        nvml.nvmlDeviceGetUUID(h)
    assert (nvml.nvmlDeviceGetGpuInstanceId(mig), nvml.nvmlDeviceGetComputeInstanceId(mig)) == (2, 0)
    assert nvml.nvmlDeviceGetName(mig) == "NVIDIA A100-SXM4-40GB MIG 3g.20gb"
    assert nvml.nvmlDeviceGetMemoryInfo(mig).total == 20096 << 20
    attrs = nvml.nvmlDeviceGetAttributes(mig)
    assert isinstance(attrs, pynvml.c_nvmlDeviceAttributes)
    assert (attrs.multiprocessorCount, attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount,
            attrs.memorySizeMB, attrs.sharedDecoderCount) == (42, 3, 3, 20096, 2)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetCudaComputeCapability(mig)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstanceId(h)

    count = ctypes.c_uint(0)
    buf = (pynvml.c_nvmlComputeInstance_t * 1)()
    nvml.nvmlGpuInstanceGetComputeInstances(gi, ci_prof.id, buf, ctypes.byref(count))
    assert count.value == 1 and nvml.nvmlComputeInstanceGetInfo(buf[0]).id == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_prof.id)


def test_destroy_order_and_stale_handles():
    nvml = make("H100-80GB", mig=True)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 14, placement(2, 2))
    ci = full_ci(nvml, gi)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    with pytest.raises(pynvml.NVMLError) as e:
        nvml.nvmlGpuInstanceDestroy(gi)
    assert code(e) == ERR.NVML_ERROR_IN_USE
    assert nvml.nvmlComputeInstanceDestroy(ci) == pynvml.NVML_SUCCESS
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetUUID(mig)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlComputeInstanceDestroy(ci)
    assert nvml.nvmlGpuInstanceDestroy(gi) == pynvml.NVML_SUCCESS
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlGpuInstanceGetInfo(gi)
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, placement(0, 4))   # the slices are free again


def test_reset_clears_instances():
    nvml = make("H100-80GB", mig=True)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    full_ci(nvml, nvml.nvmlDeviceCreateGpuInstance(h, 0))
    nvml.reset_gpu(nvml.nvmlDeviceGetUUID(h))
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 0) == 1
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)


def test_new_mig_uuid_for_each_creation():
    nvml = make("H100-80GB", mig=True)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    uuids = []
    for _ in range(2):
        gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, placement(0, 1))
        ci = full_ci(nvml, gi)
        uuids.append(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)))
        nvml.nvmlComputeInstanceDestroy(ci)
        nvml.nvmlGpuInstanceDestroy(gi)
    assert uuids[0] != uuids[1]


def test_parallel_creation_is_serialised():
    nvml = make("H100-80GB", mig=True)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    results: list[object] = []

    def worker(start: int) -> None:
        try:
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 14, placement(start, 2))
            full_ci(nvml, gi)
            results.append(start)
        except pynvml.NVMLError as exc:
            results.append(exc.value)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (0, 2, 4, 0, 2, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r for r in results if r in (0, 2, 4)) == [0, 2, 4]
    assert results.count(ERR.NVML_ERROR_INSUFFICIENT_RESOURCES) == 3


# -- events and lost GPUs ------------------------------------------------------------------------------------


def test_xid_events():
    nvml = make("H100-80GB", "H100-80GB")
    h0 = nvml.nvmlDeviceGetHandleByIndex(0)
    uuid0 = nvml.nvmlDeviceGetUUID(h0)
    es = nvml.nvmlEventSetCreate()
    assert nvml.nvmlDeviceGetSupportedEventTypes(h0) & pynvml.nvmlEventTypeXidCriticalError
    nvml.nvmlDeviceRegisterEvents(h0, pynvml.nvmlEventTypeXidCriticalError, es)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait(es, 10)
    nvml.inject_xid(uuid0, 48, gi=3, ci=0)
    nvml.inject_xid(uuid0, 79)
    first = nvml.nvmlEventSetWait_v2(es, 100)
    assert isinstance(first, pynvml.c_nvmlEventData_t)
    assert nvml.nvmlDeviceGetUUID(first.device) == uuid0
    assert (first.eventType, first.eventData, first.gpuInstanceId, first.computeInstanceId) == \
        (pynvml.nvmlEventTypeXidCriticalError, 48, 3, 0)
    second = nvml.nvmlEventSetWait(es, 100)
    assert (second.eventData, second.gpuInstanceId, second.computeInstanceId) == (79, 0xFFFFFFFF, 0xFFFFFFFF)
    nvml.nvmlEventSetFree(es)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlEventSetWait(es, 10)


def test_wait_wakes_up_when_an_event_arrives():
    nvml = make("L4")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    es = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    timer = threading.Timer(0.05, nvml.inject_xid, args=(nvml.nvmlDeviceGetUUID(h), 31))
    began = time.monotonic()
    timer.start()
    data = nvml.nvmlEventSetWait(es, 5000)
    assert data.eventData == 31 and time.monotonic() - began < 4


def test_events_before_registration_are_delivered_later():
    nvml = make("L4")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.inject_xid(nvml.nvmlDeviceGetUUID(h), 94)
    es = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    assert nvml.nvmlEventSetWait(es, 0).eventData == 94


def test_unsupported_event_types_are_refused():
    nvml = make("L4")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    es = nvml.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypePowerSourceChange, es)


def test_lost_gpu():
    nvml = make("H100-80GB", "H100-80GB", mig=True)
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    uuid = nvml.nvmlDeviceGetUUID(h)
    es = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    nvml.lose_gpu(uuid, "fell off the bus")
    assert nvml.lost_reason(uuid) == "fell off the bus"
    for call in (nvml.nvmlDeviceGetName, nvml.nvmlDeviceGetMemoryInfo, nvml.nvmlDeviceGetMigMode,
                 nvml.nvmlDeviceGetCudaComputeCapability, lambda x: nvml.nvmlDeviceCreateGpuInstance(x, 19)):
        with pytest.raises(pynvml.NVMLError) as e:
            call(h)
        assert code(e) == ERR.NVML_ERROR_GPU_IS_LOST
    # identity NVML learnt at enumeration stays readable
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(1)) == uuid
    assert nvml.nvmlDeviceGetMinorNumber(h) == 11
    # the other GPU is unaffected
    assert nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0)) == "NVIDIA H100 80GB HBM3"
    # the event set reports the loss once
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlEventSetWait(es, 100)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait(es, 10)
    nvml.recover_gpu(uuid)
    assert nvml.nvmlDeviceGetName(h) == "NVIDIA H100 80GB HBM3"


def test_simulated_gpu_validation():
    with pytest.raises(ValueError, match="does not support MIG"):
        FakeNvml([SimulatedGpu("T4", "GPU-a", 0, "00000000:18:00.0", mig_enabled=True)])
    with pytest.raises(ValueError, match="distinct UUIDs"):
        FakeNvml([SimulatedGpu("T4", "GPU-a", 0, "00000000:18:00.0"),
                  SimulatedGpu("T4", "GPU-a", 1, "00000000:19:00.0")])


# -- property: whatever the order of operations, the GPU never holds an impossible layout ------------------------

_OPS = st.lists(st.one_of(
    st.tuples(st.just("auto"), st.sampled_from([19, 20, 15, 14, 9, 5, 0])),
    st.tuples(st.just("place"), st.sampled_from([19, 20, 15, 14, 9, 5, 0]), st.integers(0, 7)),
    st.tuples(st.just("destroy"), st.integers(0, 6)),
), max_size=25)


@settings(max_examples=60, deadline=None)
@given(_OPS)
def test_random_operations_keep_the_layout_valid(ops):
    nvml = make("H100-80GB", mig=True)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    sizes = {19: 1, 20: 1, 15: 2, 14: 2, 9: 4, 5: 4, 0: 8}
    live = []
    for op in ops:
        try:
            if op[0] == "auto":
                live.append(nvml.nvmlDeviceCreateGpuInstance(h, op[1]))
            elif op[0] == "place":
                live.append(nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, op[1], placement(op[2], sizes[op[1]])))
            elif live:
                nvml.nvmlGpuInstanceDestroy(live.pop(op[1] % len(live)))
        except pynvml.NVMLError as exc:
            assert exc.value in (ERR.NVML_ERROR_INSUFFICIENT_RESOURCES, ERR.NVML_ERROR_INVALID_ARGUMENT)
        infos = [nvml.nvmlGpuInstanceGetInfo(gi) for gi in live]
        used = [s for i in infos for s in range(i.placement.start, i.placement.start + i.placement.size)]
        assert len(used) == len(set(used)) and all(0 <= s < 8 for s in used)
        assert sum(1 for i in infos if i.profileId == 20) <= 1
        assert len({i.id for i in infos}) == len(infos)


# -- persistent state: simulated GPUs that outlive the process, like hardware -----------------------------------

def _persistent(path, *models: str) -> FakeNvml:
    gpus = [SimulatedGpu(model=m, uuid=f"GPU-{i:08d}-1111-0000-0000-000000000000", minor=i,
                         pci_bus_id="00000000:%02X:00.0" % (0x18 + i)) for i, m in enumerate(models)]
    nvml = FakeNvml(gpus, state_file=path)
    nvml.nvmlInit()
    return nvml


def _layout(nvml: FakeNvml, index: int) -> list[tuple]:
    """(GI id, profile id, start, CI id, MIG UUID) of every MIG device, read through NVML calls only."""
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    out = []
    for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
        except pynvml.NVMLError:
            break
        gi_id = nvml.nvmlDeviceGetGpuInstanceId(mig)
        info = nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(h, gi_id))
        out.append((gi_id, info.profileId, info.placement.start, nvml.nvmlDeviceGetComputeInstanceId(mig),
                    nvml.nvmlDeviceGetUUID(mig)))
    return out


def test_state_survives_a_new_simulator_on_the_same_file(tmp_path):
    path = tmp_path / "gpus.json"
    first = _persistent(path, "H100-80GB", "A100-40GB", "L4")
    assert not first.restored and not path.exists()      # nothing happened yet: nothing written
    h0, h1, h2 = (first.nvmlDeviceGetHandleByIndex(i) for i in range(3))
    first.nvmlDeviceSetMigMode(h0, pynvml.NVML_DEVICE_MIG_ENABLE)                 # Hopper: at once
    gi = first.nvmlDeviceCreateGpuInstanceWithPlacement(h0, 14, placement(2, 2))
    full_ci(first, gi)
    gone = full_ci(first, first.nvmlDeviceCreateGpuInstanceWithPlacement(h0, 19, placement(6, 1)))
    gone_uuid = _layout(first, 0)[-1][4]
    first.nvmlComputeInstanceDestroy(gone)
    assert first.nvmlDeviceSetMigMode(h1, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_ERROR_RESET_REQUIRED
    first.nvmlDeviceSetComputeMode(h2, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    first.lose_gpu(first.gpu_uuids[2], "fell off the bus")
    before = _layout(first, 0)

    second = _persistent(path, "H100-80GB", "A100-40GB", "L4")
    assert second.restored
    g0, g1 = second.nvmlDeviceGetHandleByIndex(0), second.nvmlDeviceGetHandleByIndex(1)
    assert _layout(second, 0) == before and len(before) == 1
    assert before[0][:4] == (4, 14, 2, 0)       # GI ids follow the placement
    # the GPU instance left without a compute instance by the destroy above is still there
    assert second.nvmlGpuInstanceGetInfo(second.nvmlDeviceGetGpuInstanceById(g0, 13)).placement.start == 6
    assert second.nvmlDeviceGetMigMode(g0) == [1, 1]
    assert second.nvmlDeviceGetMigMode(g1) == [0, 1]                                # still pending a reset
    assert second.lost_reason(second.gpu_uuids[2]) == "fell off the bus"
    second.recover_gpu(second.gpu_uuids[2])
    assert second.nvmlDeviceGetComputeMode(second.nvmlDeviceGetHandleByIndex(2)) == \
        pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    # MIG UUIDs stay unique across restarts: a new device at the same place is not the destroyed one
    again = full_ci(second, second.nvmlDeviceGetGpuInstanceById(g0, 13))
    new_uuid = second.nvmlDeviceGetUUID(second.nvmlComputeInstanceGetInfo(again).device)
    assert new_uuid not in (gone_uuid, before[0][4])


def test_simulators_on_one_file_see_each_others_changes(tmp_path):
    path = tmp_path / "gpus.json"
    a = _persistent(path, "H100-80GB")
    b = _persistent(path, "H100-80GB")
    ha, hb = a.nvmlDeviceGetHandleByIndex(0), b.nvmlDeviceGetHandleByIndex(0)
    a.nvmlDeviceSetMigMode(ha, pynvml.NVML_DEVICE_MIG_ENABLE)
    gi_a = a.nvmlDeviceCreateGpuInstanceWithPlacement(ha, 19, placement(0, 1))
    ci_a = full_ci(a, gi_a)
    assert b.nvmlDeviceGetMigMode(hb) == [1, 1]
    full_ci(b, b.nvmlDeviceCreateGpuInstanceWithPlacement(hb, 19, placement(1, 1)))
    # b's change reached a, and a's own handles of unchanged instances are still good
    assert [m[2] for m in _layout(a, 0)] == [0, 1]
    assert a.nvmlComputeInstanceGetInfo(ci_a).id == 0
    b.nvmlComputeInstanceDestroy(b.nvmlGpuInstanceGetComputeInstanceById(b.nvmlDeviceGetGpuInstanceById(hb, 7), 0))
    with pytest.raises(pynvml.NVMLError) as e:                 # destroyed by the other one: a stale handle
        a.nvmlComputeInstanceGetInfo(ci_a)
    assert code(e) == ERR.NVML_ERROR_INVALID_ARGUMENT


def test_the_state_lock_keeps_other_processes_out(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "gpus.json"
    held = _persistent(path, "H100-80GB")
    script = (
        "import sys; from dra.sim.fakenvml import FakeNvml, SimulatedGpu\n"
        "n = FakeNvml([SimulatedGpu('H100-80GB', 'GPU-00000000-1111-0000-0000-000000000000', 0, "
        "'00000000:18:00.0')], state_file=sys.argv[1]); n.nvmlInit()\n"
        "n.nvmlDeviceSetMigMode(n.nvmlDeviceGetHandleByIndex(0), 1)\n")
    repo = Path(__file__).resolve().parents[3]
    with held.hardware_locked():
        child = subprocess.Popen([sys.executable, "-c", script, str(path)], cwd=repo)
        time.sleep(1.0)
        assert child.poll() is None                    # waiting for the lock
        assert held.nvmlDeviceGetMigMode(held.nvmlDeviceGetHandleByIndex(0)) == [0, 0]
    assert child.wait(timeout=30) == 0
    assert held.nvmlDeviceGetMigMode(held.nvmlDeviceGetHandleByIndex(0)) == [1, 1]


def test_unusable_state_file_is_a_clear_error_naming_it(tmp_path):
    from dra.sim.state import SimulatedStateError

    path = tmp_path / "gpus.json"
    path.write_text("{not json")
    with pytest.raises(SimulatedStateError, match=rf"{path}: not valid JSON.*delete it"):
        _persistent(path, "H100-80GB")
    original = _persistent(tmp_path / "good.json", "H100-80GB")
    original.save_state()
    good = (tmp_path / "good.json").read_text()
    path.write_text(good.replace('"migCurrent": 0', '"migCurrent": "on"'))
    with pytest.raises(SimulatedStateError, match=rf"{path}: gpus\[0\]\.migCurrent"):
        _persistent(path, "H100-80GB")
    path.write_text(good)
    with pytest.raises(SimulatedStateError, match=rf"{path}: describes GPUs .*the fleet changed"):
        _persistent(path, "H100-80GB", "L4")
    with pytest.raises(SimulatedStateError, match=r"gpus\[0\]\.model: 'H100-80GB', but GPU .* is a L4"):
        _persistent(path, "L4")
    path.write_text(good.replace('"gpuInstances": []', '"gpuInstances": [{"id": 3, "profileId": 14, "start": 3}]'))
    with pytest.raises(SimulatedStateError, match=r"gpus\[0\]\.gpuInstances: GPU instances exist while MIG mode"):
        _persistent(path, "H100-80GB")


def test_nvml_for_node_boots_the_fleet_layout_once(tmp_path):
    from dra.sim.fleet import nvml_for_node, parse_fleet

    node = parse_fleet({"nodes": [{"name": "n", "gpus": [
        {"model": "H100-80GB", "mig": {"enabled": True, "instances": [{"profile": "3g.40gb", "start": 4}]}},
        {"model": "L4", "broken": "fell off the bus"}]}]}).node("n")
    path = tmp_path / "state" / "gpus.json"
    first = nvml_for_node(node, state_file=path)
    assert path.exists() and not first.restored
    first.nvmlInit()
    [(gi_id, _, start, ci_id, _uuid)] = _layout(first, 0)
    assert start == 4
    h = first.nvmlDeviceGetHandleByIndex(0)
    gi = first.nvmlDeviceGetGpuInstanceById(h, gi_id)
    first.nvmlComputeInstanceDestroy(first.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id))
    first.nvmlGpuInstanceDestroy(gi)
    first.recover_gpu(first.gpu_uuids[1])

    second = nvml_for_node(node, state_file=path)   # a restart: the file, not the fleet, says what exists
    second.nvmlInit()
    assert second.restored
    assert _layout(second, 0) == []
    assert second.lost_reason(second.gpu_uuids[1]) is None
    assert nvml_for_node(node).lost_reason(second.gpu_uuids[1]) == "fell off the bus"   # without a file: fleet
