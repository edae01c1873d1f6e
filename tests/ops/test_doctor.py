"""`gpu-dra doctor` on simulated nodes with fake driver trees: each check passes on a complete node and fails,
with its fix, on the node that lacks what it checks (hook, libcuda, a device node of the spec); the driver
layouts are told apart; as root, the container check loads the libraries by soname in a private mount namespace
(a single-folder driver, as GKE's, loads only with the hook that refreshes the container's loader cache)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.fake_driver_root import DRIVER_VERSION, FakeDriverTree, build_fake_driver_root

from cli.main import main as gpu_dra
from dra.node.nodeobjects import NodeObjects, NodePaths
from ops.doctor.checks import DoctorOptions, _node_problem, driver_layout, exit_code, run_checks

REPO = Path(__file__).resolve().parents[2]
FLEET = REPO / "examples" / "fleets" / "demo.yaml"      # node-a: 8 x H100, minors 0-7
NODE = "node-a"
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the container check needs root (a private mount namespace)")


def tree_of(base: Path, **kwargs) -> FakeDriverTree:
    return build_fake_driver_root(base, gpu_minors=tuple(range(8)), **kwargs)


def single_folder_tree(base: Path) -> FakeDriverTree:
    """The driver in one folder, lib64/ and bin/ (GKE's /usr/local/nvidia, the measured H200 node)."""
    tree = tree_of(base, lib_dir="lib64", merged_usr=False, with_firmware=False)
    (tree.root / "lib64" / "libc.so.6").unlink()
    os.rename(tree.root / "usr/bin", tree.root / "bin")
    os.rmdir(tree.root / "usr")
    return tree


def path_args(tree: FakeDriverTree) -> list[str]:
    return ["--driver-root", str(tree.root), "--dev-root", str(tree.dev_root), "--proc-root", str(tree.proc_root)]


def doctor(capsys, *argv: str) -> tuple[int, str]:
    rc = gpu_dra(["doctor", "--fleet", str(FLEET), "--node", NODE, *argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


def line(out: str, check: str) -> str:
    return next(ln for ln in out.splitlines() if ln[6:].startswith(check + " "))


# ----- simulated node, every check but the container ------------------------------------------------------------
def test_complete_node_passes(capsys, tmp_path: Path) -> None:
    tree = tree_of(tmp_path)
    tree.add_hook()
    rc, out = doctor(capsys, *path_args(tree), "--no-container")
    assert rc == 0, out
    assert line(out, "nvml").startswith("PASS") and "sees 8 GPU(s): GPUs 0-7: NVIDIA H100 80GB HBM3" in out
    assert line(out, "driver-root").startswith("PASS") and "Debian-style" in line(out, "driver-root")
    assert line(out, "cdi-hook").startswith("PASS")
    spec = line(out, "cdi-spec")
    assert spec.startswith("PASS") and "all present on this node" in spec and "3 hook(s)" in spec
    assert line(out, "container").startswith("SKIP")
    assert line(out, "sharing-tools").startswith("PASS")
    assert out.rstrip().endswith("6 checks: 5 passed, 0 warned, 0 failed, 1 skipped")


def test_missing_hook_fails_with_the_fix(capsys, tmp_path: Path) -> None:
    tree = tree_of(tmp_path)
    rc, out = doctor(capsys, *path_args(tree), "--no-container")
    assert rc == 1
    hook = line(out, "cdi-hook")
    assert hook.startswith("FAIL") and "no nvidia-cdi-hook or nvidia-ctk" in hook
    assert "fix: pass --cdi-hook-path" in out


def test_hook_that_does_not_run_fails(capsys, tmp_path: Path) -> None:
    tree = tree_of(tmp_path)
    broken = tmp_path / "nvidia-cdi-hook"
    broken.write_text("#!/bin/sh\necho 'cannot execute: wrong architecture' >&2\nexit 126\n")
    broken.chmod(0o755)
    rc, out = doctor(capsys, *path_args(tree), "--cdi-hook-path", str(broken), "--no-container")
    assert rc == 1
    assert line(out, "cdi-hook").startswith(f"FAIL  cdi-hook       {broken} --version exited with 126: cannot execute")


def test_missing_libcuda_fails(capsys, tmp_path: Path) -> None:
    tree = tree_of(tmp_path)
    tree.add_hook()
    for lib in (tree.root / tree.lib_dir).glob("libcuda.so*"):
        lib.unlink()
    rc, out = doctor(capsys, *path_args(tree), "--no-container")
    assert rc == 1
    root = line(out, "driver-root")
    assert root.startswith("FAIL") and "no libcuda.so.*" in root and "in any library folder" in root
    assert "fix: set --driver-root" in out


def test_spec_device_node_that_does_not_exist_fails(capsys, tmp_path: Path) -> None:
    tree = tree_of(tmp_path)
    tree.add_hook()
    (tree.dev_root / "dev" / "nvidia0").unlink()
    rc, out = doctor(capsys, *path_args(tree), "--no-container")
    assert rc == 1
    spec = line(out, "cdi-spec")
    assert spec.startswith("FAIL") and "device node /dev/nvidia0: not on this node (the spec only has 195:0)" in spec
    assert "/dev/nvidiactl" not in spec          # the nodes that exist are not named


def test_no_driver_at_all(capsys) -> None:
    """A simulated node on a machine without the driver: NVML (simulated) passes, the rest says what is missing."""
    rc, out = doctor(capsys, "--driver-root", "/nonexistent", "--dev-root", "/nonexistent", "--no-container")
    assert rc == 1
    assert line(out, "nvml").startswith("PASS")
    assert line(out, "driver-root").startswith("FAIL") and line(out, "cdi-spec").startswith("FAIL")


def test_usage_errors(capsys) -> None:
    assert gpu_dra(["doctor", "--node", NODE]) == 2
    assert "--fleet and --node go together" in capsys.readouterr().err
    assert gpu_dra(["doctor", "--fleet", str(FLEET), "--node", "nope"]) == 2
    assert "gpu-dra doctor: --fleet: " in capsys.readouterr().err


def fake_sysfs(base: Path, vendors: dict[str, str]) -> Path:
    """A /sys with PCI devices: address -> vendor ID (as sysfs writes it, e.g. 0x10de)."""
    for address, vendor in vendors.items():
        dev = base / "sys/bus/pci/devices" / address
        dev.mkdir(parents=True)
        (dev / "vendor").write_text(vendor + "\n")
    (base / "sys/bus/pci/devices").mkdir(parents=True, exist_ok=True)
    return base / "sys"


def loaded_module(tree: FakeDriverTree) -> None:
    (tree.proc_root / "driver/nvidia").mkdir(parents=True, exist_ok=True)
    (tree.proc_root / "driver/nvidia/version").write_text(
        f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {DRIVER_VERSION}  Release Build\n")


def test_real_node_whose_nvml_cannot_load(tmp_path: Path) -> None:
    """A real node (not simulated) whose driver root has a libnvidia-ml that is no library: the NVML check fails
    naming the file; the checks that need a GPU are skipped, the driver root is still inspected."""
    tree = tree_of(tmp_path)
    tree.add_hook()
    loaded_module(tree)
    sys_root = fake_sysfs(tmp_path, {"0000:3b:00.0": "0x10de", "0000:00:1f.0": "0x8086"})
    paths = NodePaths(driver_root=str(tree.root), dev_root=str(tree.dev_root), proc_root=str(tree.proc_root))
    checks = {c.name: c for c in run_checks(NodeObjects(paths), DoctorOptions(container=False,
                                                                               sys_root=str(sys_root)))}
    assert checks["gpu"].status == "PASS" and "1 NVIDIA PCI device(s) (0000:3b:00.0)" in checks["gpu"].summary
    assert checks["gpu"].summary.endswith(f"; NVIDIA kernel module {DRIVER_VERSION} loaded")
    assert checks["nvml"].status == "FAIL" and "--driver-root: cannot open" in checks["nvml"].summary
    assert f"libnvidia-ml.so.{DRIVER_VERSION}" in checks["nvml"].summary
    assert checks["driver-root"].status == "PASS" and checks["cdi-spec"].status == "SKIP"
    assert exit_code(list(checks.values())) == 1


def test_device_node_with_other_numbers_is_named() -> None:
    """A real node's device node must be the character device the spec names (/dev/null is 1:3)."""
    node = {"path": "/dev/nvidia0", "local": "/dev/null", "major": 195, "minor": 0}
    assert _node_problem(node, simulated=False) == "device node /dev/nvidia0: /dev/null is 1:3, the spec says 195:0"
    assert _node_problem({**node, "major": 1, "minor": 3}, simulated=False) is None
    plain = Path(__file__)
    assert _node_problem({**node, "local": str(plain)}, simulated=False).endswith("is not a character device")
    assert _node_problem({**node, "local": str(plain)}, simulated=True) is None     # fake trees have plain files


def test_driver_layouts(tmp_path: Path) -> None:
    def layout(tree: FakeDriverTree, host_root: str | None = None) -> str:
        root = NodeObjects(NodePaths(driver_root=str(tree.root), host_driver_root=host_root,
                                     dev_root=str(tree.dev_root), proc_root=str(tree.proc_root))).driver_root()
        return driver_layout(root, root.files())

    assert layout(tree_of(tmp_path / "deb")) == "Debian-style (lib/<arch>-linux-gnu)"
    assert layout(tree_of(tmp_path / "rhel", lib_dir="usr/lib64", merged_usr=False)) == "RHEL-style (usr/lib64)"
    assert layout(single_folder_tree(tmp_path / "gke")) == "single folder (lib64/ + bin/, as GKE's /usr/local/nvidia)"
    assert layout(tree_of(tmp_path / "op"), host_root="/run/nvidia/driver") == \
        "GPU operator driver container (/run/nvidia/driver), Debian-style (lib/<arch>-linux-gnu) inside"


def test_command_line_exit_status(tmp_path: Path) -> None:
    """The installed entry point, as an operator runs it: exit 0 on a complete node, 1 when a check fails."""
    tree = tree_of(tmp_path)
    tree.add_hook()
    argv = [sys.executable, "-m", "cli.main", "doctor", "--fleet", str(FLEET), "--node", NODE, *path_args(tree),
            "--no-container"]
    ok = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (tree.root / "usr/bin/nvidia-cdi-hook").unlink()
    bad = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 1 and "FAIL  cdi-hook" in bad.stdout


# ----- as root: a container made from the spec ----------------------------------------------------------------
STUB = """int cuInit(unsigned flags) { (void)flags; return 0; }
int cuDeviceGetCount(int *n) { *n = 1; return 0; }
int nvmlInit_v2(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned *n) { *n = 1; return 0; }
"""


def stub_driver_libraries(tree: FakeDriverTree, tmp_path: Path) -> None:
    """libcuda and libnvidia-ml that load, with their real sonames, and report one GPU."""
    source = tmp_path / "stub.c"
    source.write_text(STUB)
    for name, soname in (("libcuda.so", "libcuda.so.1"), ("libnvidia-ml.so", "libnvidia-ml.so.1")):
        subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o",
                        str(tree.root / tree.lib_dir / f"{name}.{DRIVER_VERSION}"), str(source)], check=True)


def nvidia_cdi_hook() -> str:
    proc = subprocess.run(["bash", str(REPO / "hack" / "build-cdi-tools.sh"), "hook"], capture_output=True, text=True,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin", "GPU_DRA_CDI_NO_BUILD": "1",
                               **{k: os.environ[k] for k in ("HOME", "GPU_DRA_CACHE") if k in os.environ}},
                          timeout=60)
    if proc.returncode != 0:
        raise AssertionError("nvidia-cdi-hook is not built: run `make cdi-hook`")
    return proc.stdout.strip().splitlines()[-1]


def mounts_under(path: Path) -> list[str]:
    return [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if str(path) in ln]


@ROOT_ONLY
def test_container_check_single_folder_driver_loads_only_with_the_hook(capsys, tmp_path: Path) -> None:
    tree = single_folder_tree(tmp_path)
    stub_driver_libraries(tree, tmp_path)
    started = time.monotonic()
    rc, out = doctor(capsys, *path_args(tree))
    assert rc == 1
    container = line(out, "container")
    assert container.startswith("FAIL") and "no hooks" in container
    assert "libcuda.so.1 not found by the container's loader" in container      # /lib64 is not searched

    rc, out = doctor(capsys, *path_args(tree), "--cdi-hook-path", nvidia_cdi_hook())
    assert rc == 0, out
    container = line(out, "container")
    assert container.startswith("PASS") and "update-ldcache" in container
    assert "libcuda.so.1: 1 GPU(s); libnvidia-ml.so.1: 1 GPU(s)" in container
    assert time.monotonic() - started < 60
    assert mounts_under(tmp_path) == [] and not list(Path("/tmp").glob("gpu-dra-doctor-ctr-*/mnt/root/usr"))
    assert not (tree.root / "lib64" / "libcuda.so.1").is_symlink() or \
        os.readlink(tree.root / "lib64" / "libcuda.so.1") == f"libcuda.so.{DRIVER_VERSION}"   # the host tree as built


@ROOT_ONLY
def test_container_check_with_a_probe_program(capsys, tmp_path: Path) -> None:
    """--probe: the given program runs inside the container (here one that reports what cuda-probe would)."""
    tree = tree_of(tmp_path)
    tree.add_hook()
    probe = tmp_path / "cuda-probe"
    probe.write_text("#!/bin/sh\n[ -e /dev/nvidia0 ] && [ -e /dev/nvidiactl ] && echo 'cuda: 1 devices' "
                     "&& echo 'nvml: 1 devices'\n")
    probe.chmod(0o755)
    rc, out = doctor(capsys, *path_args(tree), "--probe", str(probe))
    assert rc == 0, out
    assert line(out, "container").endswith("cuda: 1 devices; nvml: 1 devices")


def test_container_check_is_skipped_without_root(tmp_path: Path) -> None:
    tree = tree_of(tmp_path)
    tree.add_hook()
    from dra.sim.nodeobjects import SimulatedNodeObjects

    objects = SimulatedNodeObjects.from_fleet(str(FLEET), NODE, NodePaths(
        driver_root=str(tree.root), dev_root=str(tree.dev_root), proc_root=str(tree.proc_root)))
    checks = {c.name: c for c in run_checks(objects, DoctorOptions(is_root=False))}
    assert checks["container"].status == "SKIP" and "needs root" in checks["container"].summary
    assert shutil.which("unshare") is None or exit_code(list(checks.values())) == 0


def test_a_machine_without_an_nvidia_gpu_is_told_so_before_nvml(tmp_path: Path) -> None:
    """No PCI device of vendor 0x10de: "no NVIDIA GPU on this machine", and NVML is not asked (its "does not
    initialise, check the kernel module" would send the operator the wrong way)."""
    tree = tree_of(tmp_path)
    sys_root = fake_sysfs(tmp_path, {"0000:00:1f.0": "0x8086", "0000:00:03.0": "0x1af4"})
    proc = subprocess.run([sys.executable, "-m", "cli.main", "doctor", *path_args(tree), "--sys-root", str(sys_root),
                           "--no-container"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert line(proc.stdout, "gpu").startswith(
        f"FAIL  gpu            no NVIDIA GPU on this machine: no PCI device of vendor 0x10de under {sys_root}/bus/pci/devices")
    assert line(proc.stdout, "nvml").startswith("SKIP") and "NVML does not initialise" not in proc.stdout


def test_an_nvidia_gpu_without_its_kernel_module_is_named(tmp_path: Path) -> None:
    tree = tree_of(tmp_path)
    sys_root = fake_sysfs(tmp_path, {"0000:3b:00.0": "0x10de", "0000:86:00.0": "0x10de"})
    paths = NodePaths(driver_root=str(tree.root), dev_root=str(tree.dev_root), proc_root=str(tree.proc_root))
    checks = {c.name: c for c in run_checks(NodeObjects(paths), DoctorOptions(container=False,
                                                                               sys_root=str(sys_root)))}
    assert checks["gpu"].status == "FAIL"
    assert checks["gpu"].summary == ("2 NVIDIA PCI device(s) (0000:3b:00.0, 0000:86:00.0) but the NVIDIA kernel "
                                     f"module is not loaded: no {tree.proc_root}/driver/nvidia")
    assert "modprobe nvidia" in checks["gpu"].fix and checks["nvml"].status == "SKIP"


@pytest.mark.parametrize("library, status", [("libcuda.so.1", "FAIL"), ("libnvidia-ml.so.1", "FAIL"),
                                             ("libnvidia-ptxjitcompiler.so.1", "WARN")])
def test_a_dangling_soname_link_is_reported(capsys, tmp_path: Path, library: str, status: str) -> None:
    """`libcuda.so.1 -> libcuda.so.<missing>`: the spec would leave the soname out and containers' CUDA would not
    load; a FAIL naming the link (a WARN for a library every container does not need)."""
    tree = tree_of(tmp_path)
    tree.add_hook()
    link = tree.root / tree.lib_dir / library
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(library.replace(".so.1", ".so.999.1.1"), link)
    rc, out = doctor(capsys, *path_args(tree), "--no-container")
    root = line(out, "driver-root")
    assert root.startswith(status), out
    assert "dangling link(s) " in root and "(target missing)" in root, root
    assert f"/{tree.lib_dir}/{library} -> {library.replace('.so.1', '.so.999.1.1')}" in root, root
    assert rc == (1 if status == "FAIL" else 0), out
