"""The few ``nvidia-smi`` commands ``gpu-dra convert`` writes, run against a simulated node's NVML (FakeNvml).

The simulator has no nvidia-smi of its own; this maps each command, split as a shell splits it (shlex), onto the
NVML calls nvidia-smi makes for it, so the commands are checked as written: GPU by index (``-i``), MIG mode
(``-mig 0|1``, pending on Ampere until ``-r``), GPU instances by profile name with NVML's own placement (``mig
-cgi NAMES -C``: each gets one full compute instance), and ``mig -dci`` / ``mig -dgi``. Anything else is an
error, as nvidia-smi would refuse it.
"""
from __future__ import annotations

import shlex
from typing import Any

import pynvml

from dra.sim.fakenvml import FakeNvml

# compute slices of a full compute instance -> NVML compute-instance profile
_CI_PROFILE = {1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
               3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
               7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE}


class CommandError(Exception):
    pass


def run(nvml: FakeNvml, command: str, models: list[Any]) -> None:
    """Run one command line; ``models``: the catalog model of each GPU index."""
    argv = shlex.split(command, comments=False)
    if not argv or argv[0] != "nvidia-smi":
        raise CommandError(f"not an nvidia-smi command: {command!r}")
    args = argv[1:]
    mig = bool(args) and args[0] == "mig"
    if mig:
        args = args[1:]
    if len(args) < 2 or args[0] != "-i" or not args[1].isdigit():
        raise CommandError(f"no single GPU (-i N) in {command!r}")
    index = int(args[1])
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    rest = args[2:]
    if not mig and len(rest) == 2 and rest[0] == "-mig" and rest[1] in ("0", "1"):
        nvml.nvmlDeviceSetMigMode(handle, int(rest[1]))
    elif not mig and rest == ["-r"]:
        nvml.reset_gpu(nvml.nvmlDeviceGetUUID(handle))
    elif mig and len(rest) == 3 and rest[0] == "-cgi" and rest[2] == "-C":
        for name in rest[1].split(","):
            profile = models[index].profile(name)
            gi = nvml.nvmlDeviceCreateGpuInstance(handle, profile.profile_id)
            nvml.nvmlGpuInstanceCreateComputeInstance(gi, _CI_PROFILE[profile.compute_slices])
    elif mig and rest in (["-dci"], ["-dgi"]):
        pass   # nothing exists on the fresh simulated GPUs these tests start from
    else:
        raise CommandError(f"not a command this check knows: {command!r}")


def partitions(nvml: FakeNvml, index: int) -> list[str]:
    """Profile names of the GPU instances on GPU ``index``, sorted."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    if nvml.nvmlDeviceGetMigMode(handle)[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
        return []
    out = []
    for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            dev = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except pynvml.NVMLError:
            continue
        out.append(nvml.nvmlDeviceGetName(dev).split(" MIG ")[-1])
    return sorted(out)
