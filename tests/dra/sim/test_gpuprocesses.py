"""GPU processes of a simulated node: the CUDA stand-in's cuCtxCreate/cuMemAlloc register the calling process and
the simulated NVML reports it with its host PID (dra.sim.gpuprocesses), as the real driver does.

cuda-probe --alloc-mib runs here against a listing of the simulated GPUs, in this PID namespace and (as root)
in a PID namespace of its own, where its PID is not the host's."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pynvml
import pytest

from dra.node.cdi import common_edits
from dra.sim.driverroot import SimulatedDriverRoot
from dra.sim.fleet import nvml_for_node, parse_fleet
from dra.sim.gpuprocesses import PROCESS_CONTAINER_DIR, ProcessRegistry, parse_registration, read_registrations
from dra.sim.standin import GpuListing

REPO = Path(__file__).resolve().parents[3]
SRC = REPO / "hack" / "cuda-standin"
VERSION = "580.95.05"
FLEET = {"nodes": [{"name": "n1", "gpus": [{"model": "H100-80GB", "count": 2}]}]}
MiB = 1 << 20


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("standin")
    subprocess.run(["make", "-s", "-C", str(SRC), f"OUT={out}", f"VERSION={VERSION}"], check=True,
                   capture_output=True)
    for base in ("libcuda.so", "libnvidia-ml.so"):
        (out / "lib" / f"{base}.1").symlink_to(f"{base}.{VERSION}")
    return out


@pytest.fixture
def node(tmp_path: Path) -> tuple[object, Path, Path, list[str]]:
    """The simulated NVML with a process registry, the stand-in's listing of its GPUs (both openable here:
    /dev/null stands for their nodes) and the process directory."""
    nvml = nvml_for_node(parse_fleet(FLEET).node("n1"))
    nvml.nvmlInit()
    uuids = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
    listing = tmp_path / "gpus"
    listing.write_text(f"driver {VERSION} 13000\nctl /dev/null 1 3\n" + "".join(
        f"gpu {i} /dev/null 1 3 0 {u} 85520809984 NVIDIA H100 80GB HBM3\n" for i, u in enumerate(uuids)))
    procs = tmp_path / "procs"
    procs.mkdir()
    nvml.processes = ProcessRegistry(procs)
    return nvml, listing, procs, uuids


def start_probe(standin: Path, listing: Path, procs: Path, *args: str, env: dict[str, str] | None = None,
                prefix: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    environ = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": str(standin / "lib"), "GPU_DRA_SIM_GPUS": str(listing),
               "GPU_DRA_SIM_PROCS": str(procs), **(env or {})}
    return subprocess.Popen([*prefix, str(standin / "bin" / "cuda-probe"), *args], env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_alloc(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("alloc:"):
            return line.strip()
    raise AssertionError(f"cuda-probe ended without an alloc line (rc {proc.wait()})")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(timeout=10)


def processes(nvml: object, uuid: str, mps: bool = False) -> list[tuple[int, int]]:
    handle = nvml.nvmlDeviceGetHandleByUUID(uuid)  # type: ignore[attr-defined]
    name = "nvmlDeviceGetMPSComputeRunningProcesses" if mps else "nvmlDeviceGetComputeRunningProcesses"
    query = getattr(nvml, name)
    return [(p.pid, p.usedGpuMemory) for p in query(handle)]


def test_an_allocation_is_reported_with_its_pid_and_bytes_until_the_process_ends(
        standin: Path, node: tuple) -> None:
    nvml, listing, procs, uuids = node
    assert processes(nvml, uuids[0]) == []
    proc = start_probe(standin, listing, procs, "--alloc-mib", "300")
    try:
        assert wait_alloc(proc) == "alloc: 300 MiB on device 0"
        assert processes(nvml, uuids[0]) == [(proc.pid, 300 * MiB)]
        assert processes(nvml, uuids[1]) == []
        assert processes(nvml, uuids[0], mps=True) == []
        samples = nvml.nvmlDeviceGetProcessUtilization(nvml.nvmlDeviceGetHandleByUUID(uuids[0]), 0)
        assert [(s.pid, s.smUtil) for s in samples] == [(proc.pid, 0)]
    finally:
        stop(proc)
    # Killed without cuCtxDestroy: the driver forgets it, and its registration goes.
    assert processes(nvml, uuids[0]) == []
    assert os.listdir(procs) == []
    with pytest.raises(pynvml.NVMLError):
        nvml.nvmlDeviceGetProcessUtilization(nvml.nvmlDeviceGetHandleByUUID(uuids[0]), 0)


def test_mps_clients_are_reported_by_the_mps_query(standin: Path, node: tuple) -> None:
    nvml, listing, procs, uuids = node
    proc = start_probe(standin, listing, procs, "--alloc-mib", "64", env={"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps"})
    try:
        wait_alloc(proc)
        assert processes(nvml, uuids[0]) == []
        assert processes(nvml, uuids[0], mps=True) == [(proc.pid, 64 * MiB)]
    finally:
        stop(proc)


def test_more_than_the_device_holds_is_out_of_memory(standin: Path, node: tuple) -> None:
    nvml, listing, procs, uuids = node
    proc = start_probe(standin, listing, procs, "--alloc-mib", str(200 * 1024))
    try:
        assert wait_alloc(proc) == "alloc: 0 MiB on device 0 (error 2)"   # CUDA_ERROR_OUT_OF_MEMORY
        assert processes(nvml, uuids[0]) == [(proc.pid, 0)]                # the context exists
    finally:
        stop(proc)


@pytest.mark.parametrize("arg", ["0", "-1", "12x", str(1 << 31)])
def test_alloc_mib_refuses_bad_numbers(standin: Path, node: tuple, arg: str) -> None:
    _, listing, procs, _ = node
    proc = start_probe(standin, listing, procs, "--alloc-mib", arg)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "--alloc-mib wants a number of MiB" in out


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="a PID namespace needs root")
def test_a_process_in_its_own_pid_namespace_is_found_by_its_host_pid(standin: Path, node: tuple) -> None:
    nvml, listing, procs, uuids = node
    # --kill-child: the probe, PID 1 of the new namespace, dies with unshare instead of outliving the test.
    proc = start_probe(standin, listing, procs, "--alloc-mib", "128",
                       prefix=("unshare", "--pid", "--fork", "--kill-child"))
    pid = 0
    try:
        wait_alloc(proc)
        reg, = read_registrations(procs)
        assert reg.nspid == 1                               # PID 1 of its namespace ...
        (pid, used), = processes(nvml, uuids[0])
        assert pid not in (1, proc.pid) and used == 128 * MiB   # ... reported by its host PID (unshare's child)
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"cuda-probe")
    finally:
        stop(proc)
        deadline = time.monotonic() + 10
        while pid and Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid or not Path(f"/proc/{pid}").exists(), f"the probe (host PID {pid}) outlived its namespace"


def test_registrations_are_untrusted_input(tmp_path: Path) -> None:
    good = f"v1 4026531836 {os.getpid()} 1 0 1048576 GPU-11111111-2222-3333-4444-555555555555\n"
    (tmp_path / "ok").write_text(good)
    (tmp_path / "long").write_text(good + "x" * 600)
    (tmp_path / "bad").write_text("v1 1 2 3 0 -5 GPU-x\n")
    (tmp_path / "other").write_text("v1 1 2 3 0 5 /etc/passwd\n")
    (tmp_path / "half.tmp").write_text(good)
    (tmp_path / "link").symlink_to(tmp_path / "ok")
    os.mkfifo(tmp_path / "fifo")
    assert [r.file for r in read_registrations(tmp_path)] == ["ok"]
    assert parse_registration("v1 1 2 3 2 5 GPU-a\n", "x") is None   # the MPS flag is 0 or 1
    assert read_registrations(tmp_path / "missing") == []


def test_containers_of_a_simulated_node_get_the_process_directory_read_write(tmp_path: Path) -> None:
    nvml = nvml_for_node(parse_fleet(FLEET).node("n1"))
    nvml.nvmlInit()
    procs = tmp_path / "procs"
    root = SimulatedDriverRoot(tmp_path / "root", driver_version=VERSION, listing=GpuListing(nvml, tmp_path / "gpus"),
                               process_dir=procs)
    mounts = {m["containerPath"]: m for m in common_edits(root.files())["mounts"]}
    assert mounts[PROCESS_CONTAINER_DIR]["hostPath"] == str(procs)
    assert "rw" in mounts[PROCESS_CONTAINER_DIR]["options"]
