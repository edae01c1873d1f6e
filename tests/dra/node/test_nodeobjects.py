"""One factory for a node's objects (dra.node.nodeobjects, dra.sim.nodeobjects): every path flag reaches the driver
root, the NVML preload and the sharing tools; `gpu-dra inventory` takes the same flags."""
from __future__ import annotations

import argparse
import ctypes.util
import shutil
from pathlib import Path

import pytest
from fixtures.fake_driver_root import DRIVER_VERSION, LIB_DIR, build_fake_driver_root

from cli import inventory_cmd
from dra.node.nodeobjects import NodeObjects, NodePaths, NodeSetupError
from dra.node.sharingtools import NvidiaSmiSharingControl, SharingError
from dra.sim.driverroot import SimulatedDriverRoot
from dra.sim.nodeobjects import SimulatedNodeObjects
from dra.sim.sharingtools import SimulatedSharingControl

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "fleets"


def loadable_nvml(tmp_path: Path) -> tuple[object, Path]:
    """A fake driver tree whose NVML file is a real shared object (libm), so dlopen by path succeeds."""
    tree = build_fake_driver_root(tmp_path)
    name = ctypes.util.find_library("m")
    assert name, "libm is needed as a loadable stand-in"
    found = next(Path(d) / name for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64",
                                          "/usr/lib64", "/lib/aarch64-linux-gnu") if (Path(d) / name).exists())
    real = tree.root / LIB_DIR / f"libnvidia-ml.so.{DRIVER_VERSION}"
    shutil.copyfile(found, real)
    return tree, real


def paths_of(tree, **extra) -> NodePaths:
    return NodePaths(driver_root=str(tree.root), dev_root=str(tree.dev_root), proc_root=str(tree.proc_root), **extra)


def test_driver_root_carries_every_path(tmp_path: Path) -> None:
    tree = build_fake_driver_root(tmp_path)
    hook = tmp_path / "plugin-dir" / "nvidia-cdi-hook"
    hook.parent.mkdir()
    hook.write_text("#!/bin/sh\n")
    hook.chmod(0o755)
    root = NodeObjects(paths_of(tree, host_driver_root="/run/nvidia/driver", cdi_hook_path=str(hook))).driver_root()
    assert (str(root.root), str(root.host_root)) == (str(tree.root), "/run/nvidia/driver")
    assert (str(root.dev_root), str(root.proc_root)) == (str(tree.dev_root), str(tree.proc_root))
    files = root.files()
    assert files.hook is not None and files.hook.host_path == str(hook)
    assert [n.path for n in files.control_nodes][0] == "/dev/nvidiactl"


def test_nvml_preload_reads_the_device_root_it_is_given(tmp_path: Path) -> None:
    """The driver's files are read with the node's --dev-root: /dev/nvidiactl of the fake tree, not this machine's
    (which has none), so the preload gets as far as opening NVML by its path."""
    tree, real = loadable_nvml(tmp_path)
    assert NodeObjects(paths_of(tree)).preload_nvml() == str(real)
    # Without the device root the same driver root is refused for the missing control node.
    if not Path("/dev/nvidiactl").exists():
        with pytest.raises(NodeSetupError, match=r"^--driver-root: device node /dev/nvidiactl does not exist"):
            NodeObjects(NodePaths(driver_root=str(tree.root))).preload_nvml()


def test_nvml_preload_errors_name_the_flag(tmp_path: Path) -> None:
    tree = build_fake_driver_root(tmp_path)
    with pytest.raises(NodeSetupError, match=r"^--driver-root: cannot open .*libnvidia-ml\.so\."):
        NodeObjects(paths_of(tree)).preload_nvml()
    (tree.root / LIB_DIR / f"libcuda.so.{DRIVER_VERSION}").unlink()
    with pytest.raises(NodeSetupError, match=r"^--driver-root: driver root .* no libcuda\.so"):
        NodeObjects(paths_of(tree)).preload_nvml()


def test_sharing_tools_come_from_the_driver_root_or_say_what_is_missing(tmp_path: Path) -> None:
    tree = build_fake_driver_root(tmp_path)
    objects = NodeObjects(paths_of(tree))
    control = objects.sharing_control(objects.driver_root())
    assert isinstance(control, NvidiaSmiSharingControl)
    assert control.nvidia_smi == str(tree.root / "usr/bin/nvidia-smi")
    assert control.proc_root == tree.proc_root          # --proc-root, unless the MPS options say otherwise
    (tree.root / "usr/bin/nvidia-smi").unlink()
    with pytest.raises(SharingError, match="nvidia-smi not found"):
        objects.sharing_control(objects.driver_root())


def test_simulated_node_objects(tmp_path: Path) -> None:
    objects = SimulatedNodeObjects.from_fleet(str(EXAMPLES / "demo.yaml"), "node-b")
    assert objects.simulated and objects.preload_nvml() is None
    nvml = objects.open_nvml()
    assert nvml.nvmlDeviceGetCount() == 4
    root = objects.driver_root()
    assert isinstance(root, SimulatedDriverRoot) and root.driver_version == objects.node.driver_version
    assert isinstance(objects.sharing_control(root, nvml=nvml), SimulatedSharingControl)
    assert objects.cdi_writer(tmp_path / "cdi", root, vendor="k8s.gpu.dra-driver.io").toolkit is None
    with pytest.raises(NodeSetupError, match=r"^--fleet: .*no node 'nope'"):
        SimulatedNodeObjects.from_fleet(str(EXAMPLES / "demo.yaml"), "nope")


def run_inventory(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    inventory_cmd.add_arguments(parser)
    rc = inventory_cmd.run(parser.parse_args(list(argv)))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_inventory_loads_nvml_from_the_driver_root_it_is_given(capsys, tmp_path: Path) -> None:
    tree = build_fake_driver_root(tmp_path)
    rc, _, err = run_inventory(capsys, "--driver-root", str(tree.root), "--dev-root", str(tree.dev_root),
                               "--proc-root", str(tree.proc_root))
    assert rc == 1
    assert err.startswith("gpu-dra inventory: --driver-root: cannot open ")
    assert f"{tree.root}/{LIB_DIR}/libnvidia-ml.so.{DRIVER_VERSION}" in err
