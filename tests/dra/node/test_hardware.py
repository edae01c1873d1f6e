"""Hardware actions: MIG through (fake) NVML, sharing tools (simulated and real with stand-in programs),
time-slice bookkeeping and the MPS supervisor."""
from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import sys
import threading
from pathlib import Path

import pynvml
import pytest

from dra.node import migdevices as hardware
from dra.node.checkpoint import TimeSliceUndo
from dra.node.migdevices import (
    MigError,
    create_mig_device,
    destroy_mig_device,
    destroy_unknown_mig_devices,
    disable_mig_mode_if_unused,
    list_mig_devices,
)
from dra.node.processidentity import send_signal
from dra.node.sharing import MpsDaemons, TimeSlicing
from dra.node.sharingtools import (
    MpsDaemonSpec,
    NvidiaSmiSharingControl,
    SharingError,
    SharingNotSupported,
)
from dra.sim.fakenvml import FakeNvml, SimulatedGpu
from dra.sim.mpscontrol import write_simulated_mps_control
from dra.sim.sharingtools import SimulatedSharingControl

H100 = "GPU-11111111-0000-4000-8000-000000000000"
H100_B = "GPU-11111111-0000-4000-8000-000000000001"
A100 = "GPU-a1000000-0000-4000-8000-000000000000"
A100_MIG = "GPU-a1000000-0000-4000-8000-000000000001"

# GPU-instance profile ids on 8-slice GPUs (nvidia-smi numbering).
P_1G, P_1G_2SLICE, P_2G, P_3G, P_4G, P_7G = 19, 15, 14, 9, 5, 0


@pytest.fixture
def nvml() -> FakeNvml:
    fake = FakeNvml([
        SimulatedGpu(model="H100-80GB", uuid=H100, minor=0, pci_bus_id="00000000:18:00.0"),
        SimulatedGpu(model="H100-80GB", uuid=H100_B, minor=1, pci_bus_id="00000000:28:00.0"),
        SimulatedGpu(model="A100-40GB", uuid=A100, minor=2, pci_bus_id="00000000:38:00.0"),
        SimulatedGpu(model="A100-40GB", uuid=A100_MIG, minor=3, pci_bus_id="00000000:48:00.0", mig_enabled=True),
    ])
    fake.nvmlInit()
    return fake


def mig_mode(nvml, uuid: str) -> list[int]:
    return nvml.nvmlDeviceGetMigMode(nvml.nvmlDeviceGetHandleByUUID(uuid))


# ----- MIG ----------------------------------------------------------------------------------------------------
def test_create_on_hopper_enables_mig_and_places_exactly(nvml):
    assert mig_mode(nvml, H100) == [0, 0]
    live = create_mig_device(nvml, H100, P_2G, 4)
    assert mig_mode(nvml, H100)[0] == 1
    assert live.uuid.startswith("MIG-") and live.parent_uuid == H100
    assert (live.profile_id, live.start) == (P_2G, 4)
    (listed,) = list_mig_devices(nvml, H100)
    assert listed == live
    # The MIG device is visible through NVML under that UUID, at the GI/CI we returned.
    mig = nvml.nvmlDeviceGetHandleByUUID(live.uuid)
    assert nvml.nvmlDeviceGetGpuInstanceId(mig) == live.gi_id
    assert nvml.nvmlDeviceGetComputeInstanceId(mig) == live.ci_id


def test_compute_instance_spans_the_whole_gpu_instance(nvml):
    live = create_mig_device(nvml, H100, P_7G, 0)
    gi = nvml.nvmlDeviceGetGpuInstanceById(nvml.nvmlDeviceGetHandleByUUID(H100), live.gi_id)
    for index in (pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE):
        assert nvml.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, index) == 0


def test_ampere_with_mig_off_is_an_error_and_mode_untouched(nvml):
    with pytest.raises(MigError, match="reset"):
        create_mig_device(nvml, A100, P_1G, 0)
    assert mig_mode(nvml, A100) == [0, 0]


def test_ampere_with_mig_on_works_and_mode_is_never_turned_off(nvml):
    live = create_mig_device(nvml, A100_MIG, P_3G, 4)
    assert destroy_mig_device(nvml, A100_MIG, live.gi_id, live.ci_id) is True
    assert disable_mig_mode_if_unused(nvml, A100_MIG) is False
    assert mig_mode(nvml, A100_MIG) == [1, 1]


def test_invalid_start_names_valid_ones(nvml):
    with pytest.raises(MigError, match=r"valid: \[0, 4\]"):
        create_mig_device(nvml, H100, P_3G, 2)


def test_overlap_fails_cleanly_and_leaves_nothing_behind(nvml):
    create_mig_device(nvml, H100, P_4G, 0)
    with pytest.raises(MigError, match="overlap") as err:
        create_mig_device(nvml, H100, P_2G, 2)
    assert err.value.code == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert len(list_mig_devices(nvml, H100)) == 1


class FailingCi:
    """Wraps an NVML object; compute-instance creation fails."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def nvmlGpuInstanceCreateComputeInstance(self, gi, profile):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)


def test_failure_after_gi_creation_rolls_back(nvml):
    with pytest.raises(MigError, match="compute instance"):
        create_mig_device(FailingCi(nvml), H100, P_1G, 3)
    assert list_mig_devices(nvml, H100) == []


def test_destroy_is_idempotent_and_guards_reused_ids(nvml):
    live = create_mig_device(nvml, H100, P_1G, 0)
    assert destroy_mig_device(nvml, H100, live.gi_id, live.ci_id, live.uuid) is True
    assert destroy_mig_device(nvml, H100, live.gi_id, live.ci_id, live.uuid) is False
    # Same placement again → same GI id, different MIG device: an old record must not destroy it.
    again = create_mig_device(nvml, H100, P_1G, 0)
    assert again.gi_id == live.gi_id and again.uuid != live.uuid
    assert destroy_mig_device(nvml, H100, live.gi_id, live.ci_id, live.uuid) is False
    assert list_mig_devices(nvml, H100) == [again]


def test_destroy_on_gpu_with_mig_off_is_a_no_op(nvml):
    assert destroy_mig_device(nvml, H100, 7, 0) is False


def test_disable_mig_mode_when_last_device_is_gone_on_hopper(nvml):
    live = create_mig_device(nvml, H100, P_1G, 1)
    assert disable_mig_mode_if_unused(nvml, H100) is False  # still in use
    destroy_mig_device(nvml, H100, live.gi_id, live.ci_id)
    assert disable_mig_mode_if_unused(nvml, H100) is True
    assert mig_mode(nvml, H100) == [0, 0]


def test_destroy_unknown_keeps_claimed_devices_and_other_gpus(nvml):
    keep = create_mig_device(nvml, H100, P_1G, 0)
    stray1 = create_mig_device(nvml, H100, P_1G, 1)
    stray2 = create_mig_device(nvml, H100, P_3G, 4)
    # A GPU instance a crash left without a compute instance.
    handle = nvml.nvmlDeviceGetHandleByUUID(H100)
    placement = pynvml.c_nvmlGpuInstancePlacement_t(start=2, size=2)
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, P_2G, ctypes.byref(placement))
    other_gpu = create_mig_device(nvml, A100_MIG, P_1G, 0)  # static MIG on another GPU: not ours
    destroyed = destroy_unknown_mig_devices(nvml, {keep.key}, gpus=[H100])
    assert {d.uuid for d in destroyed if d.uuid} == {stray1.uuid, stray2.uuid}
    assert any(d.ci_id == -1 and d.start == 2 for d in destroyed)
    assert list_mig_devices(nvml, H100) == [keep]
    assert list_mig_devices(nvml, A100_MIG) == [other_gpu]


def test_parallel_creates_on_one_gpu(nvml):
    results: list = []
    errors: list = []

    def make(start: int) -> None:
        try:
            results.append(create_mig_device(nvml, H100, P_1G, start))
        except Exception as err:  # noqa: BLE001 - every failure is collected and asserted on
            errors.append(err)

    threads = [threading.Thread(target=make, args=(s,)) for s in range(7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len({r.uuid for r in results}) == 7
    assert sorted(r.start for r in results) == list(range(7))


def test_only_real_pynvml_names_are_used():
    """The modules must work with the real pynvml module, so every nvml.<name> must exist there."""
    root = Path(hardware.__file__).parent
    for module in ("migdevices.py", "health.py", "inventory.py"):
        names = set(re.findall(r"\bnvml\.([A-Za-z_][A-Za-z0-9_]*)", (root / module).read_text()))
        assert names, module
        missing = sorted(n for n in names if not hasattr(pynvml, n))
        assert missing == [], f"{module} uses names pynvml lacks: {missing}"


# ----- simulated sharing control -----------------------------------------------------------------------------
def test_simulated_time_slice_rules(nvml):
    tools = SimulatedSharingControl(nvml=nvml, time_slice_unsupported=[H100_B])
    tools.set_time_slice(H100, "Long")
    assert tools.get_time_slice(H100) == "Long"
    with pytest.raises(SharingNotSupported, match="not supported"):
        tools.set_time_slice(H100_B, "Short")
    with pytest.raises(SharingNotSupported, match="MIG"):
        tools.set_time_slice("MIG-1234", "Short")
    with pytest.raises(SharingError, match="interval"):
        tools.set_time_slice(H100, "Forever")
    with pytest.raises(SharingError, match="no GPU"):
        tools.set_time_slice("GPU-unknown", "Short")


def test_simulated_compute_mode_is_mirrored_into_nvml(nvml):
    tools = SimulatedSharingControl(nvml=nvml)
    tools.set_compute_mode(H100, "EXCLUSIVE_PROCESS")
    mode = nvml.nvmlDeviceGetComputeMode(nvml.nvmlDeviceGetHandleByUUID(H100))
    assert mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


def test_simulated_mps_rules(tmp_path, nvml):
    tools = SimulatedSharingControl(nvml=nvml)
    dirs = [tmp_path / n for n in ("p1", "l1", "p2", "l2")]
    for d in dirs:
        d.mkdir()
    spec1 = MpsDaemonSpec(str(dirs[0]), str(dirs[1]), (H100,))
    spec2 = MpsDaemonSpec(str(dirs[2]), str(dirs[3]), (H100,))
    tools.set_compute_mode(H100, "EXCLUSIVE_PROCESS")
    daemon1 = tools.start_mps_daemon(spec1)
    with pytest.raises(SharingError, match="already running"):
        tools.start_mps_daemon(spec1)
    with pytest.raises(SharingError, match="already served"):
        tools.start_mps_daemon(spec2)  # exclusive-process GPU: one MPS server
    with pytest.raises(SharingError, match="MPS daemon is running"):
        tools.set_compute_mode(H100, "DEFAULT")
    with pytest.raises(SharingError, match="not served"):
        tools.mps_command(spec1.pipe_dir, f"set_default_device_pinned_mem_limit {H100_B} 100M")
    tools.stop_mps_daemon(spec1.pipe_dir, daemon1)
    tools.stop_mps_daemon(spec1.pipe_dir, daemon1)
    assert not tools.mps_daemon_running(spec1.pipe_dir, daemon1)
    tools.set_compute_mode(H100, "DEFAULT")
    tools.start_mps_daemon(spec1)
    tools.start_mps_daemon(spec2)  # DEFAULT mode: daemons of different claims may share the GPU
    with pytest.raises(SharingError, match="no daemon"):
        tools.mps_command(str(tmp_path / "nowhere"), "get_server_list")


# ----- time-slicing bookkeeping -------------------------------------------------------------------------------
def test_time_slicing_shared_gpu_lifecycle(nvml):
    tools = SimulatedSharingControl(nvml=nvml)
    ts = TimeSlicing(tools)
    a = ts.apply("claim-a", [H100], "Medium")
    assert a == TimeSliceUndo(gpu_uuids=(H100,), interval="Medium", previous="Default")
    b = ts.apply("claim-b", [H100], "Medium")  # joins: no second hardware call
    assert [x for x in tools.actions if x[0] == "set_time_slice"] == [("set_time_slice", H100, "Medium")]
    with pytest.raises(SharingError, match="claim-a|claim-b"):
        ts.apply("claim-c", [H100], "Long")
    ts.release("claim-a", a)
    assert tools.get_time_slice(H100) == "Medium"  # claim-b still holds it
    ts.release("claim-b", b)
    assert tools.get_time_slice(H100) == "Default"


def test_time_slicing_partial_failure_is_rolled_back(nvml):
    tools = SimulatedSharingControl(nvml=nvml, time_slice_unsupported=[H100_B])
    ts = TimeSlicing(tools)
    with pytest.raises(SharingNotSupported):
        ts.apply("claim-a", [H100, H100_B], "Short")
    assert tools.get_time_slice(H100) == "Default"
    assert ts.holders(H100) == {} and ts.holders(H100_B) == {}
    with pytest.raises(SharingNotSupported, match="whole GPUs"):
        ts.apply("claim-a", ["MIG-abc"], "Short")


def test_time_slicing_adopt_after_restart(nvml):
    tools = SimulatedSharingControl(nvml=nvml)
    tools.set_time_slice(H100, "Long")
    ts = TimeSlicing(tools)
    applied = TimeSliceUndo(gpu_uuids=(H100,), interval="Long", previous="Default")
    ts.adopt("claim-a", applied)
    with pytest.raises(SharingError):
        ts.apply("claim-b", [H100], "Short")
    ts.release("claim-a", applied)
    assert tools.get_time_slice(H100) == "Default"


# ----- MPS daemons ------------------------------------------------------------------------------------------------
def test_one_daemon_per_device_started_once_restarted_and_released(tmp_path, nvml):
    tools = SimulatedSharingControl(nvml=nvml)
    mps = MpsDaemons(tools, tmp_path / "state")
    paths = mps.ensure(H100, H100)
    assert paths.base.parent == tmp_path / "state" / "mps" and len(paths.base.name) == 12
    assert len((Path(paths.pipe_dir) / "control").as_posix()) < len(str(tmp_path)) + 40   # fits a socket address
    assert Path(paths.pipe_dir).is_dir() and Path(paths.shm_dir).is_dir()
    assert oct(Path(paths.log_dir).stat().st_mode & 0o777) == oct(0o700)     # the daemon's log is private
    assert tools.compute_mode(H100) == "EXCLUSIVE_PROCESS"
    assert tools.daemons[paths.pipe_dir].spec.visible_devices == (H100,)
    assert mps.ensure(H100, H100) == paths                   # the second claim joins it
    assert [a for a in tools.actions if a[0] == "start_mps_daemon"] == [("start_mps_daemon", paths.pipe_dir, (H100,))]
    assert mps.records()[H100].compute_mode_set
    first = mps.records()[H100].daemon
    assert first is not None and tools.mps_daemon_running(paths.pipe_dir, first)
    assert mps.supervise({H100: H100}) == []
    tools.kill_mps_daemon(paths.pipe_dir)
    assert mps.supervise({H100: H100}) == [H100] and mps.running(H100)
    second = mps.records()[H100].daemon
    assert second is not None and second != first                            # the new daemon is recorded
    mps.release(H100)
    mps.release(H100)                                                         # idempotent
    assert not tools.mps_daemon_running(paths.pipe_dir, second)
    assert tools.compute_mode(H100) == "DEFAULT"
    assert not paths.base.exists() and mps.records() == {}


def test_mps_on_a_mig_device_leaves_the_compute_mode_alone(tmp_path, nvml):
    tools = SimulatedSharingControl(nvml=nvml)
    mps = MpsDaemons(tools, tmp_path)
    mig = create_mig_device(nvml, H100_B, P_3G, 0)
    paths = mps.ensure(mig.uuid, H100_B)
    assert tools.daemons[paths.pipe_dir].spec.visible_devices == (mig.uuid,)
    assert not mps.records()[mig.uuid].compute_mode_set and tools.compute_mode(H100_B) == "DEFAULT"


def test_a_failed_daemon_start_undoes_everything(tmp_path, nvml):
    tools = SimulatedSharingControl(nvml=nvml)
    mps = MpsDaemons(tools, tmp_path)

    def refuse(spec):
        raise SharingError("nvidia-cuda-mps-control -d exited with 1")

    tools.start_mps_daemon = refuse
    with pytest.raises(SharingError, match="exited with 1"):
        mps.ensure(H100, H100)
    assert tools.compute_mode(H100) == "DEFAULT"
    assert mps.records() == {} and not mps.paths(H100).base.exists()


def test_a_daemon_survives_a_new_plugin_process_and_is_found_on_disk(tmp_path, nvml):
    tools = SimulatedSharingControl(nvml=nvml)
    MpsDaemons(tools, tmp_path).ensure(H100_B, H100_B)
    after = MpsDaemons(tools, tmp_path)           # a new plugin process over the same state directory
    assert list(after.records()) == [H100_B] and after.running(H100_B)
    after.release(H100_B)
    assert tools.compute_mode(H100_B) == "DEFAULT"


def test_a_daemon_directory_is_logged_as_removed_only_when_it_is_gone(tmp_path, nvml, caplog):
    """A record's temporary file that a crash left is removed with the directory; a file of anyone else keeps the
    directory, and the line then says it stays and what is in it, never that it was removed."""
    tools = SimulatedSharingControl(nvml=nvml)
    mps = MpsDaemons(tools, tmp_path)
    crashed, planted = mps.paths(H100), mps.paths(H100_B)
    for paths in (crashed, planted):
        paths.base.mkdir(parents=True)
        (paths.base / ".daemon.json.x7y8z9.tmp").write_text("{")      # a record write cut short
    (planted.base / "notes.txt").write_text("not ours")
    with caplog.at_level(logging.WARNING):
        assert mps.remove_unknown({}) == [crashed.base.name]
    assert not crashed.base.exists() and sorted(p.name for p in planted.base.iterdir()) == ["notes.txt"]
    assert f"removed MPS daemon directory {crashed.base}" in caplog.text
    assert f"removed MPS daemon directory {planted.base}" not in caplog.text
    assert f"MPS daemon directory {planted.base} stays" in caplog.text and "(left in it: notes.txt)" in caplog.text
    (planted.base / ".daemon.json.a1b2c3.tmp").write_text("{")
    assert mps.remove_leftover_temp_files() == [planted.base / ".daemon.json.a1b2c3.tmp"]


def test_device_names_cannot_leave_the_mps_directory(tmp_path, nvml):
    mps = MpsDaemons(SimulatedSharingControl(nvml=nvml), tmp_path)
    for bad in ("../x", "..", "a/b", ""):
        with pytest.raises(SharingError, match="not a device UUID"):
            mps.paths(bad)


# ----- real sharing control with stand-in programs --------------------------------------------------------------
FAKE_SMI = """#!{python}
import os, sys
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
if os.environ.get("FAKE_UNSUPPORTED", "") in sys.argv:
    print("Setting compute policy is Not Supported for GPU", os.environ["FAKE_UNSUPPORTED"])
    sys.exit(3)
if "--set-timeslice" in sys.argv and sys.argv[-1] not in "0123":
    print("Invalid value"); sys.exit(2)
"""



@pytest.fixture
def programs(tmp_path: Path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    path = bindir / "nvidia-smi"
    path.write_text(FAKE_SMI.format(python=sys.executable))
    path.chmod(0o755)
    write_simulated_mps_control(bindir)       # the simulated nvidia-cuda-mps-control program
    return bindir


def real_tools(programs: Path, tmp_path: Path, **env) -> NvidiaSmiSharingControl:
    env = {"FAKE_LOG": str(tmp_path / "smi.log"), **env}
    return NvidiaSmiSharingControl(str(programs / "nvidia-smi"), str(programs / "nvidia-cuda-mps-control"), env=env,
                                   timeout_s=10, isolate_shm=False)


def test_real_tools_run_nvidia_smi_with_exact_arguments(programs, tmp_path):
    tools = real_tools(programs, tmp_path, FAKE_UNSUPPORTED="GPU-old")
    tools.set_time_slice(H100, "Medium")
    tools.set_compute_mode(H100, "EXCLUSIVE_PROCESS")
    tools.set_compute_mode(H100, "DEFAULT")
    assert (tmp_path / "smi.log").read_text().splitlines() == [
        f"compute-policy -i {H100} --set-timeslice 2",
        f"-i {H100} -c EXCLUSIVE_PROCESS",
        f"-i {H100} -c DEFAULT",
    ]
    assert tools.get_time_slice(H100) == "Medium"
    with pytest.raises(SharingNotSupported, match="GPU-old"):
        tools.set_time_slice("GPU-old", "Short")
    with pytest.raises(SharingNotSupported):
        tools.set_compute_mode("MIG-x", "DEFAULT")
    with pytest.raises(SharingError, match="interval"):
        tools.set_time_slice(H100, "Sometimes")


def test_real_tools_report_a_missing_program(tmp_path):
    tools = NvidiaSmiSharingControl(str(tmp_path / "absent-smi"), timeout_s=5)
    with pytest.raises(SharingError, match="absent-smi"):
        tools.set_compute_mode(H100, "DEFAULT")


def test_real_tools_mps_daemon_lifecycle(programs, tmp_path):
    tools = real_tools(programs, tmp_path)
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    pipe.mkdir()
    logs.mkdir()
    spec = MpsDaemonSpec(str(pipe), str(logs), (H100, "MIG-abc"))
    daemon = None
    try:
        daemon = tools.start_mps_daemon(spec)
        assert tools.mps_daemon_running(str(pipe), daemon)
        assert tools.mps_daemon(str(pipe)) == daemon                          # its own PID file names it
        assert tools.mps_daemon(str(tmp_path / "other")) is None
        assert "Starting control daemon for " + f"{H100},MIG-abc" in (logs / "control.log").read_text()
        with pytest.raises(SharingError, match="already running"):
            tools.start_mps_daemon(spec)
        tools.mps_command(str(pipe), "set_default_active_thread_percentage 30")
        assert tools.mps_command(str(pipe), "get_default_active_thread_percentage") == "30.0"
        with pytest.raises(SharingError, match="1..100"):
            tools.mps_command(str(pipe), "set_default_active_thread_percentage 300")
        tools.stop_mps_daemon(str(pipe), daemon)
        assert not tools.mps_daemon_running(str(pipe), daemon)
        tools.stop_mps_daemon(str(pipe), daemon)  # not running: fine
    finally:
        if daemon is not None:
            send_signal(daemon, signal.SIGKILL)


def test_the_simulated_program_refuses_what_the_real_one_refuses(programs, tmp_path):
    """The simulated nvidia-cuda-mps-control reads the simulated node's state file: a second control daemon for a
    GPU in EXCLUSIVE_PROCESS compute mode is refused (one process may hold such a GPU), so is a pinned memory
    limit above the device's memory; at the device's memory it is accepted."""
    from dra.model.catalog import get_model
    from dra.sim.fleet import nvml_for_node, parse_fleet
    from dra.sim.mpscontrol import STATE_ENV

    state = tmp_path / "gpus.json"
    fleet = parse_fleet({"nodes": [{"name": "n", "gpus": [{"model": "H100-80GB", "count": 1}]}]})
    nvml = nvml_for_node(fleet.node("n"), state_file=state)
    nvml.nvmlInit()
    uuid, = nvml.gpu_uuids
    memory = get_model("H100-80GB").memory_mib
    SimulatedSharingControl(nvml=nvml).set_compute_mode(uuid, "EXCLUSIVE_PROCESS")
    tools = NvidiaSmiSharingControl(mps_control=str(programs / "nvidia-cuda-mps-control"),
                                    env={STATE_ENV: str(state)}, timeout_s=10, isolate_shm=False)
    specs = []
    for name in ("a", "b"):
        (tmp_path / f"pipe-{name}").mkdir()
        (tmp_path / f"log-{name}").mkdir()
        specs.append(MpsDaemonSpec(str(tmp_path / f"pipe-{name}"), str(tmp_path / f"log-{name}"), (uuid,)))
    daemons = []
    try:
        daemons.append(tools.start_mps_daemon(specs[0]))
        with pytest.raises(SharingError, match="EXCLUSIVE_PROCESS"):
            tools.start_mps_daemon(specs[1])
        with pytest.raises(SharingError, match="exceeds"):
            tools.mps_command(specs[0].pipe_dir, f"set_default_device_pinned_mem_limit {uuid} {memory + 1}M")
        tools.mps_command(specs[0].pipe_dir, f"set_default_device_pinned_mem_limit {uuid} {memory}M")
        assert tools.mps_command(specs[0].pipe_dir, f"get_default_device_pinned_mem_limit {uuid}") == f"{memory}M"
    finally:
        for daemon in daemons:
            send_signal(daemon, signal.SIGKILL)


_CLIENT = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
sock.sendall(b"new_client\\n")
print(sock.recv(100).decode().strip(), flush=True)
sys.stdin.read()          # a client holds its connection while it lives
"""


def test_the_simulated_daemon_has_nvidias_pipe_files_and_serves_clients_of_any_user(programs, tmp_path):
    """The pipe directory's files carry the permissions NVIDIA's daemon gives them (measured on an H200), whatever
    the umask of the plugin that started it: ``control`` is 0666, so a client of any user ID connects. One MPS
    server, of one user, at a time: a client of another user waits until the server's clients have gone."""
    import shutil
    import subprocess
    import tempfile

    tools = real_tools(programs, tmp_path)
    # The system's Python: the project's may lie where other users cannot reach it.
    python = shutil.which("python3", path="/usr/bin:/bin")
    assert python, "no python3 in /usr/bin or /bin for the clients of other users"
    # Reachable by every user: pytest's own temporary directory is its owner's alone.
    base = Path(tempfile.mkdtemp(prefix="mps-any-user-"))
    base.chmod(0o755)
    pipe, logs = base / "pipe", tmp_path / "log"
    pipe.mkdir(mode=0o755)
    logs.mkdir()
    daemon = None
    clients: list[subprocess.Popen] = []
    old_umask = os.umask(0o022)                 # the plugin's
    try:
        daemon = tools.start_mps_daemon(MpsDaemonSpec(str(pipe), str(logs), (H100,)))
        modes = {e.name: (e.lstat().st_mode & 0o7777, e.lstat().st_mode & 0o170000) for e in pipe.iterdir()}
        assert modes == {"control": (0o666, 0o140000), "control_privileged": (0o755, 0o140000),
                         "control_lock": (0o666, 0o100000), "log": (0o777, 0o010000),
                         "nvidia-cuda-mps-control.pid": (0o666, 0o100000)}, modes

        def client(uid: int) -> subprocess.Popen:
            proc = subprocess.Popen([python, "-c", _CLIENT, str(pipe / "control")], user=uid, group=uid,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            clients.append(proc)
            return proc

        nobody = client(65534)
        assert nobody.stdout.readline().strip() == "OK server 65534"
        same = client(65534)
        assert same.stdout.readline().strip() == "OK server 65534"         # served beside it, at once
        other = client(65533)
        for proc in (nobody, same):                # the server's clients go: the other user's server comes
            proc.stdin.close()
            proc.wait(timeout=10)
        assert other.stdout.readline().strip() == "OK server 65533"
        served = (logs / "control.log").read_text()
        assert served.count("of user ID 65534 served by the MPS server of user ID 65534") == 2, served
        assert "of user ID 65533 served by the MPS server of user ID 65533" in served
        tools.stop_mps_daemon(str(pipe), daemon)
    finally:
        os.umask(old_umask)
        for proc in clients:
            proc.kill()
            proc.wait()
        if daemon is not None:
            send_signal(daemon, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


def test_the_control_program_is_never_pointed_at_a_planted_socket(programs, tmp_path):
    tools = real_tools(programs, tmp_path)
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    pipe.mkdir()
    logs.mkdir()
    daemon = tools.start_mps_daemon(MpsDaemonSpec(str(pipe), str(logs), (H100,)))
    try:
        control = pipe / "control"
        elsewhere = tmp_path / "elsewhere"
        control.rename(elsewhere)
        control.symlink_to(elsewhere)              # a workload replaced the socket in its mounted pipe dir
        with pytest.raises(SharingError, match="replaced"):
            tools.mps_command(str(pipe), "get_server_list")
    finally:
        send_signal(daemon, signal.SIGKILL)


def test_real_tools_from_driver_root(tmp_path):
    from fixtures.fake_driver_root import build_fake_driver_root

    tree = build_fake_driver_root(tmp_path / "host")
    tools = NvidiaSmiSharingControl.from_driver_root(tree.driver_root())
    assert tools.nvidia_smi == str(tree.root / "usr/bin/nvidia-smi")
    assert tools.mps_control == str(tree.root / "usr/bin/nvidia-cuda-mps-control")
    assert tools.extra_env["LD_LIBRARY_PATH"] == str(tree.root / "usr/lib/x86_64-linux-gnu")
