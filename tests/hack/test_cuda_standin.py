"""The CUDA stand-in of simulated nodes (hack/cuda-standin) and the GPU listing it reads (dra.sim.standin).

The C pieces are built here with make and run on this machine: cuda-probe loads the stand-in libraries by
soname (found through LD_LIBRARY_PATH here; in a container through the CDI spec's mounts and hooks) and the
listing names device nodes this process can open (/dev/null) or not (a missing path, a node of other numbers).
The listing itself comes from the simulated NVML, MIG devices created at run time included.
"""
from __future__ import annotations

import os
import re
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from dra.node import migdevices
from dra.node.cdi import common_edits
from dra.node.driverroot import DeviceNodeInfo, DriverRoot, DriverRootError
from dra.sim.driverlayout import LAYOUTS, DriverLayoutError, install_standin, triplet
from dra.sim.driverroot import SimulatedDriverRoot
from dra.sim.fleet import nvml_for_node, parse_fleet
from dra.sim.standin import LISTING_CONTAINER_DIR, GpuListing, listing_text
from testbed.podprobe import ContainerView, SeenDevice, parse_probe, probe_script

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "hack" / "cuda-standin"
VERSION = "580.95.05"
NULL = DeviceNodeInfo(path="/dev/null", major=1, minor=3)          # opens here
UUID_RE = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("standin")
    subprocess.run(["make", "-s", "-C", str(SRC), f"OUT={out}", f"VERSION={VERSION}"], check=True,
                   capture_output=True)
    lib = out / "lib"
    for base in ("libcuda.so", "libnvidia-ml.so"):
        (lib / f"{base}.1").symlink_to(f"{base}.{VERSION}")
    return out


def run_probe(standin: Path, listing: Path, *args: str, env: dict[str, str] | None = None,
              lib_path: bool = True) -> str:
    environ = {"PATH": os.environ["PATH"], "GPU_DRA_SIM_GPUS": str(listing), **(env or {})}
    if lib_path:
        environ["LD_LIBRARY_PATH"] = str(standin / "lib")
    proc = subprocess.run([str(standin / "bin" / args[0]), *args[1:]], env=environ, capture_output=True, text=True,
                          timeout=30)
    return proc.stdout + proc.stderr


def soname(path: Path) -> str:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    m = re.search(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", out)
    assert m, out
    return m.group(1)


def test_libraries_have_the_real_sonames_and_entry_points(standin: Path) -> None:
    cuda, nvml = standin / "lib" / f"libcuda.so.{VERSION}", standin / "lib" / f"libnvidia-ml.so.{VERSION}"
    assert (soname(cuda), soname(nvml)) == ("libcuda.so.1", "libnvidia-ml.so.1")
    exported = subprocess.run(["nm", "-D", "--defined-only", str(cuda), str(nvml)], capture_output=True, text=True,
                              check=True).stdout.split()
    for sym in ("cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetName",
                "cuDeviceGetUuid", "cuDeviceGetUuid_v2", "cuDeviceTotalMem", "cuDeviceTotalMem_v2", "nvmlInit_v2",
                "nvmlShutdown", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetUUID",
                "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo"):
        assert sym in exported, sym
    assert not [s for s in exported if s.startswith("sim_")], "the listing parser must stay internal"


# ---- the C side against hand-written listings ----------------------------------------------------

G0 = "GPU-11111111-2222-3333-4444-000000000000"
G1 = "GPU-11111111-2222-3333-4444-111111111111"
G2 = "GPU-11111111-2222-3333-4444-222222222222"
M0 = "MIG-aaaaaaaa-2222-3333-4444-000000000000"
M1 = "MIG-aaaaaaaa-2222-3333-4444-111111111111"


def listing(tmp_path: Path, *, ctl: str = "/dev/null 1 3", gpu1: str = "/dev/null 1 3",
            mig_caps: tuple[str, str] = ("/dev/null 1 3", "/dev/null 1 3")) -> Path:
    text = f"""# hand-written
driver {VERSION} 13000
ctl {ctl}
gpu 0 /dev/gpu-dra-missing-node 195 0 0 {G0} 85520809984 NVIDIA H100 80GB HBM3
gpu 1 {gpu1} 0 {G1} 85520809984 NVIDIA H100 80GB HBM3
gpu 2 /dev/null 1 3 1 {G2} 85520809984 NVIDIA H100 80GB HBM3
mig 2 2 0 {mig_caps[0]} {mig_caps[1]} {M0} 42144366592 NVIDIA H100 80GB HBM3 MIG 3g.40gb
mig 2 1 0 /dev/null 1 3 /dev/gpu-dra-missing-cap 234 9 {M1} 21072183296 NVIDIA H100 80GB HBM3 MIG 2g.20gb
"""
    path = tmp_path / "gpus"
    path.write_text(text)
    return path


def test_probe_lists_only_devices_whose_nodes_open(standin: Path, tmp_path: Path) -> None:
    out = run_probe(standin, listing(tmp_path), "cuda-probe", "--once", env={"CUDA_MPS_PIPE_DIRECTORY": "/tmp/x"})
    assert out.splitlines() == [
        "cuda: driver 13000",
        "cuda: 2 devices",
        f"cuda: device 0 {G1} 81559 MiB NVIDIA H100 80GB HBM3",
        f"cuda: device 1 {M0} 40192 MiB NVIDIA H100 80GB HBM3 MIG 3g.40gb",
        f"nvml: driver {VERSION}",
        "nvml: 2 devices",
        f"nvml: device 0 {G1} 81559 MiB NVIDIA H100 80GB HBM3",
        f"nvml: device 1 {G2} 81559 MiB NVIDIA H100 80GB HBM3",
        f"nvml: mig 1 0 {M0} 40192 MiB NVIDIA H100 80GB HBM3 MIG 3g.40gb",
        "mps: CUDA_MPS_PIPE_DIRECTORY=/tmp/x",
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a character device node needs root (CAP_MKNOD)")
def test_a_node_without_a_kernel_driver_behind_it_counts(standin: Path, tmp_path: Path) -> None:
    """What runc creates on a simulated node: a character device of the listed numbers with no driver behind it
    (open fails with ENXIO); the device is the container's."""
    node = tmp_path / "nvidia7"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(195, 7))
    path = tmp_path / "gpus"
    path.write_text(f"driver {VERSION} 13000\nctl /dev/null 1 3\ngpu 7 {node} 195 7 0 {G0} 85520809984 NVIDIA H100\n")
    out = run_probe(standin, path, "cuda-probe", "--once")
    assert f"cuda: device 0 {G0} 81559 MiB NVIDIA H100" in out, out


def test_a_node_of_other_numbers_hides_its_device(standin: Path, tmp_path: Path) -> None:
    """/dev/zero exists and opens, but it is 1:5: listed as 1:3 it is not the device's node."""
    out = run_probe(standin, listing(tmp_path, gpu1="/dev/zero 1 3", mig_caps=("/dev/null 1 3", "/dev/zero 1 3")),
                    "cuda-probe", "--once")
    assert "cuda: 0 devices (cuInit: error 100)" in out
    assert "nvml: 1 devices" in out and G1 not in out and M0 not in out


def test_no_control_node_no_devices(standin: Path, tmp_path: Path) -> None:
    out = run_probe(standin, listing(tmp_path, ctl="/dev/gpu-dra-missing-ctl 195 255"), "cuda-probe", "--once")
    assert "cuda: 0 devices (cuInit: error 100)" in out
    assert "nvml: 0 devices (nvmlInit_v2: error 9)" in out


def test_without_the_listing_or_the_libraries(standin: Path, tmp_path: Path) -> None:
    out = run_probe(standin, tmp_path / "absent", "cuda-probe", "--once")
    assert "cuda: 0 devices (cuInit: error 304)" in out and "nvml: 0 devices (nvmlInit_v2: error 9)" in out
    out = run_probe(standin, listing(tmp_path), "cuda-probe", "--once", lib_path=False)
    assert "cuda: 0 devices (dlopen libcuda.so.1: libcuda.so.1: cannot open shared object file" in out
    assert "nvml: 0 devices (dlopen libnvidia-ml.so.1: " in out


def test_malformed_listing_is_refused(standin: Path, tmp_path: Path) -> None:
    path = tmp_path / "gpus"
    path.write_text(f"driver {VERSION} 13000\nctl /dev/null 1 3\ngpu 0 /dev/null 1 3 0 {G0}\n")
    out = run_probe(standin, path, "cuda-probe", "--once")
    assert "cuda: 0 devices (cuInit: error 304)" in out


def test_nvidia_smi_lists_like_the_real_one(standin: Path, tmp_path: Path) -> None:
    out = run_probe(standin, listing(tmp_path), "nvidia-smi", "-L")
    assert out.splitlines() == [
        f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {G1})",
        f"GPU 1: NVIDIA H100 80GB HBM3 (UUID: {G2})",
        f"  MIG 3g.40gb     Device  0: (UUID: {M0})",
    ]
    assert "only -L" in run_probe(standin, listing(tmp_path), "nvidia-smi", "-q")


# ---- the listing from the simulated NVML ----------------------------------------------------------

STATIC_MIG = {"enabled": True, "instances": [{"profile": "3g.40gb", "start": 4}]}
FLEET = {"nodes": [{"name": "n1", "gpus": [{"model": "H100-80GB", "count": 2},
                                          {"model": "H100-80GB", "count": 1, "mig": STATIC_MIG}]}]}


@dataclass
class OpenOnly:
    """A driver root whose GPU nodes and capability nodes are /dev/null for the minors given, missing otherwise."""

    gpus: set[int]
    caps: bool = True

    def gpu_node(self, minor: int) -> DeviceNodeInfo:
        missing = DeviceNodeInfo(path=f"/dev/gpu-dra-missing{minor}", major=195, minor=minor)
        return NULL if minor in self.gpus else missing

    def mig_cap_nodes(self, gpu_minor: int, gi_id: int, ci_id: int) -> tuple[DeviceNodeInfo, DeviceNodeInfo]:
        missing = DeviceNodeInfo(path="/dev/gpu-dra-missing-cap", major=234, minor=1)
        return (NULL, NULL if self.caps else missing)


def test_listing_from_fake_nvml_reaches_the_stand_in(standin: Path, tmp_path: Path) -> None:
    nvml = nvml_for_node(parse_fleet(FLEET).node("n1"))
    nvml.nvmlInit()
    uuids = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(3)]
    static, = migdevices.list_mig_devices(nvml, uuids[2])
    text = listing_text(nvml, OpenOnly({1, 2}), NULL)
    lines = text.splitlines()
    assert lines[1] == f"driver {VERSION} 13000" and lines[2] == "ctl /dev/null 1 3"
    assert [ln.split()[0] for ln in lines[3:]] == ["gpu", "gpu", "gpu", "mig"]
    assert re.fullmatch(rf"mig 2 {static.gi_id} {static.ci_id} /dev/null 1 3 /dev/null 1 3 MIG-{UUID_RE} \d+ "
                        r"NVIDIA H100 80GB HBM3 MIG 3g\.40gb", lines[6])
    path = tmp_path / "gpus"
    path.write_text(text)
    out = run_probe(standin, path, "cuda-probe", "--once")
    # GPU 1 whole; GPU 2 is in MIG mode: CUDA shows its MIG device, NVML the GPU and, under it, the MIG device.
    cuda = [ln.split()[3] for ln in out.splitlines() if ln.startswith("cuda: device")]
    nvml_seen = [ln.split()[3 if " device " in ln else 4] for ln in out.splitlines()
                 if ln.startswith(("nvml: device", "nvml: mig"))]
    assert cuda == [uuids[1], static.uuid], out
    assert nvml_seen == [uuids[1], uuids[2], static.uuid], out
    # Without the CI's capability node the MIG device is gone from both.
    path.write_text(listing_text(nvml, OpenOnly({1, 2}, caps=False), NULL))
    out = run_probe(standin, path, "cuda-probe", "--once")
    assert static.uuid not in out and f"cuda: device 0 {uuids[1]} " in out


def test_simulated_driver_root_refreshes_and_mounts_the_listing(tmp_path: Path) -> None:
    """Every files() call rewrites the listing (a dynamic MIG device appears before its container starts) and
    the common edits mount its directory read-only at /run/nvidia-sim."""
    nvml = nvml_for_node(parse_fleet(FLEET).node("n1"))
    nvml.nvmlInit()
    listing_dir = tmp_path / "state" / "sim-gpus"
    root = SimulatedDriverRoot(tmp_path / "empty-root", driver_version=VERSION,
                               listing=GpuListing(nvml, listing_dir))
    edits = common_edits(root.files())
    mount, = [m for m in edits["mounts"] if m["containerPath"] == LISTING_CONTAINER_DIR]
    assert mount["hostPath"] == str(listing_dir) and "ro" in mount["options"]
    before = (listing_dir / "gpus").read_text()
    assert before.count("\nmig ") == 1 and "/dev/nvidia0 195 0 0 GPU-" in before
    uuid0 = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(0))
    created = migdevices.create_mig_device(nvml, uuid0, 9, 0)   # 3g.40gb at slice 0
    root.files()
    after = (listing_dir / "gpus").read_text()
    assert created.uuid in after and "/dev/nvidia0 195 0 1 GPU-" in after
    line, = [ln for ln in after.splitlines() if created.uuid in ln]
    gi_cap, ci_cap = root.mig_cap_nodes(0, created.gi_id, created.ci_id)
    assert line.startswith(f"mig 0 {created.gi_id} {created.ci_id} {gi_cap.path} {gi_cap.major} {gi_cap.minor} "
                           f"{ci_cap.path} {ci_cap.major} {ci_cap.minor} {created.uuid} ")
    # A lost GPU is not listed.
    nvml.lose_gpu(uuid0)
    root.files()
    assert uuid0 not in (listing_dir / "gpus").read_text()


def test_the_listing_is_built_again_only_when_the_hardware_changed(tmp_path: Path) -> None:
    """Asked before every CDI spec, the listing is built from NVML only after a change of the simulated hardware:
    made in this process, or by another one through the shared state file."""
    state = tmp_path / "hw.json"
    node = parse_fleet(FLEET).node("n1")
    nvml, other = nvml_for_node(node, state), nvml_for_node(node, state)
    nvml.nvmlInit()
    other.nvmlInit()
    counted = []
    count = nvml.nvmlDeviceGetCount

    def counting() -> int:   # the first call of every listing
        counted.append(1)
        return count()

    nvml.nvmlDeviceGetCount = counting  # type: ignore[method-assign]
    listing_dir = tmp_path / "sim-gpus"
    root = SimulatedDriverRoot(tmp_path / "empty-root", driver_version=VERSION, listing=GpuListing(nvml, listing_dir))
    root.files()
    root.files()
    assert len(counted) == 1
    (listing_dir / "gpus").unlink()                  # gone: written again
    root.files()
    assert (listing_dir / "gpus").is_file() and len(counted) == 2
    uuid1 = other.nvmlDeviceGetUUID(other.nvmlDeviceGetHandleByIndex(1))
    other.lose_gpu(uuid1)                            # another process changes the hardware
    root.files()
    assert len(counted) == 3 and uuid1 not in (listing_dir / "gpus").read_text()
    root.files()
    assert len(counted) == 3


def test_a_listing_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    nvml = nvml_for_node(parse_fleet(FLEET).node("n1"))
    nvml.nvmlInit()
    blocked = tmp_path / "sim-gpus"
    blocked.write_text("a file where the directory should be")
    root = SimulatedDriverRoot(tmp_path / "empty-root", driver_version=VERSION, listing=GpuListing(nvml, blocked))
    with pytest.raises(DriverRootError, match=f"cannot write the simulated GPU listing {blocked}/gpus: "):
        root.files()


# ---- the driver root layouts ----------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_are_discovered_like_a_driver_install(standin: Path, tmp_path: Path, layout: str) -> None:
    root = tmp_path / "root"
    install_standin(root, standin, layout, "570.1.2")
    with pytest.raises(DriverRootError, match="nvidiactl"):   # no /dev/nvidiactl here: a real node's root refuses
        DriverRoot(root, dev_root=tmp_path, proc_root=tmp_path / "proc").files()
    sim = SimulatedDriverRoot(root, driver_version="570.1.2", dev_root=tmp_path, proc_root=tmp_path / "proc")
    files = sim.files()    # ... the simulated one describes it by numbers
    lib_dir = {"host": f"/usr/lib/{triplet()}", "operator": f"/usr/lib/{triplet()}", "single-folder": "/lib64"}[layout]
    bin_dir = {"host": "/usr/bin", "operator": "/usr/bin", "single-folder": "/bin"}[layout]
    assert [lib.container_path for lib in files.libraries] == [f"{lib_dir}/libcuda.so.570.1.2",
                                                               f"{lib_dir}/libnvidia-ml.so.570.1.2"]
    assert {(ln.container_path, ln.resolved.container_path) for ln in files.soname_links} == {
        (f"{lib_dir}/libcuda.so.1", f"{lib_dir}/libcuda.so.570.1.2"),
        (f"{lib_dir}/libnvidia-ml.so.1", f"{lib_dir}/libnvidia-ml.so.570.1.2")}
    assert files.lib_folders == (lib_dir,)
    assert [b.container_path for b in files.binaries] == [f"{bin_dir}/nvidia-smi"]
    assert [(n.path, n.major, n.minor) for n in files.control_nodes] == [("/dev/nvidiactl", 195, 255)]
    for lib in files.libraries:   # regular files, as a driver install has
        assert Path(lib.host_path).is_file() and not Path(lib.host_path).is_symlink()


def test_operator_layout_links_resolve_inside_the_root(standin: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    install_standin(root, standin, "operator", VERSION)
    link = root / "usr/lib" / triplet() / "libcuda.so.1"
    assert os.readlink(link) == f"/usr/lib/{triplet()}/libcuda.so.{VERSION}"
    assert (root / "lib").is_symlink() and os.readlink(root / "lib") == "usr/lib"


def test_layout_errors_name_the_problem(standin: Path, tmp_path: Path) -> None:
    with pytest.raises(DriverLayoutError, match="'flat' is not one of host, operator, single-folder"):
        install_standin(tmp_path / "r", standin, "flat", VERSION)
    empty = tmp_path / "empty"
    (empty / "lib").mkdir(parents=True)
    with pytest.raises(DriverLayoutError, match=r"expected one built libcuda\.so\.<version>, found none"):
        install_standin(tmp_path / "r2", empty, "host", VERSION)


# ---- the pod probe script with cuda-probe -------------------------------------------------------

def test_pod_probe_reports_what_cuda_probe_saw(standin: Path, tmp_path: Path) -> None:
    """testbed.podprobe's script runs cuda-probe between its markers; parse_probe reads its devices back."""
    (tmp_path / "sleep").write_text("#!/bin/sh\n")
    (tmp_path / "sleep").chmod(0o755)
    env = {"PATH": f"{standin / 'bin'}:{tmp_path}:/usr/bin:/bin", "LD_LIBRARY_PATH": str(standin / "lib"),
           "GPU_DRA_SIM_GPUS": str(listing(tmp_path))}
    done = subprocess.run(["sh", "-c", probe_script("p", "cuda")], env=env, capture_output=True, text=True,
                          timeout=30)
    view = parse_probe(done.stdout)
    assert view.complete and view.probed, done.stdout
    assert view.cuda == [SeenDevice(G1, 81559, "NVIDIA H100 80GB HBM3"),
                         SeenDevice(M0, 40192, "NVIDIA H100 80GB HBM3 MIG 3g.40gb")]
    assert [d.uuid for d in view.nvml] == [G1, G2] and [d.uuid for d in view.nvml_mig] == [M0]
    assert view.cuda_summary() == f"cuda: 2 devices {G1}, 81559 MiB, {M0}, 40192 MiB"
    assert view.summary().endswith(view.cuda_summary())
    assert view.smi == [f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {G1})", f"GPU 1: NVIDIA H100 80GB HBM3 (UUID: {G2})",
                        f"  MIG 3g.40gb     Device  0: (UUID: {M0})"]
    # No libraries: the reason is kept and shown.
    env.pop("LD_LIBRARY_PATH")
    view = parse_probe(subprocess.run(["sh", "-c", probe_script("p", "cuda")], env=env, capture_output=True,
                                      text=True, timeout=30).stdout)
    assert view.cuda == [] and view.cuda_error is not None and view.cuda_error.startswith("dlopen libcuda.so.1: ")
    assert view.cuda_summary().startswith("cuda: 0 devices (dlopen libcuda.so.1: ")
    one = ContainerView(cuda=[SeenDevice(G1, 81559, "x")], probed=True)
    assert one.cuda_summary() == f"cuda: 1 device {G1}, 81559 MiB"


def test_cuda_init_is_an_mps_client_of_any_user(standin: Path, tmp_path: Path) -> None:
    """cuInit connects to the MPS control daemon of CUDA_MPS_PIPE_DIRECTORY, as CUDA does: a process running as
    UID 65534 is served by a server of its own user (the simulated daemon logs each client); with no daemon to
    reach, CUDA runs without MPS."""
    import shutil
    import tempfile

    from dra.node.processidentity import send_signal
    from dra.node.sharingtools import MpsDaemonSpec, NvidiaSmiSharingControl
    from dra.sim.mpscontrol import write_simulated_mps_control

    base = Path(tempfile.mkdtemp(prefix="standin-mps-"))   # every user reaches it; pytest's directories do not
    daemon = None
    try:
        base.chmod(0o755)
        tree = base / "standin"
        shutil.copytree(standin, tree, symlinks=True)
        for directory in (tree, *(d for d in tree.rglob("*") if d.is_dir() and not d.is_symlink())):
            directory.chmod(0o755)
        gpus = listing(base)
        gpus.chmod(0o644)
        pipe, logs = base / "pipe", tmp_path / "log"
        pipe.mkdir(mode=0o755)
        logs.mkdir()
        tools = NvidiaSmiSharingControl(mps_control=str(write_simulated_mps_control(tmp_path / "tools")),
                                        timeout_s=10, isolate_shm=False)
        env = {"PATH": os.environ["PATH"], "GPU_DRA_SIM_GPUS": str(gpus), "LD_LIBRARY_PATH": str(tree / "lib"),
               "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}

        def probe() -> subprocess.CompletedProcess[str]:
            return subprocess.run([str(tree / "bin" / "cuda-probe"), "--once"], env=env, user=65534, group=65534,
                                  capture_output=True, text=True, timeout=30)

        alone = probe()                                    # no daemon yet: CUDA without MPS
        assert alone.returncode == 0 and "cuda: 2 devices" in alone.stdout, alone
        daemon = tools.start_mps_daemon(MpsDaemonSpec(str(pipe), str(logs), (G1,)))
        served = probe()
        assert served.returncode == 0 and "cuda: 2 devices" in served.stdout, served
        log = (logs / "control.log").read_text()
        assert re.search(r"New client \d+ of user ID 65534 served by the MPS server of user ID 65534", log), log
        tools.stop_mps_daemon(str(pipe), daemon)
    finally:
        if daemon is not None:
            send_signal(daemon, 9)
        shutil.rmtree(base, ignore_errors=True)
