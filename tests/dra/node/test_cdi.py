"""CDI spec building, validation and atomic writing, against a fake driver root. Every spec a test here builds
is also loaded by the CDI reference library (tests/support/cdivalidate.py) when the test ends."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import cdivalidate
import pytest
import yaml
from fixtures.fake_driver_root import CAPS_MAJOR, UVM_MAJOR, build_fake_driver_root

import dra.node.cdi as cdi_module
from dra.node.cdi import (
    CDI_VERSIONS,
    CdiSpecError,
    CdiSpecWriter,
    ClaimDevice,
    MpsMounts,
    ToolkitSpecs,
    build_claim_spec,
    load_spec,
    required_version,
    validate_spec,
)
from dra.node.driverroot import CdiHookError, DriverRoot, DriverRootError, check_real_node

UID = "0b5c3f2a-9d1e-4f7a-8c6b-2e4d1a7f9c30"
UID_LETTER = "c1a2b3c4-0000-4000-8000-000000000001"
GPU0 = ClaimDevice(name="gpu-0", uuid="GPU-aaaa", gpu_minor=0, gpu_index=0, requests=("gpu",))


@pytest.fixture(autouse=True)
def reference_validation(monkeypatch):
    """Every spec built during the test (through CdiSpecWriter or build_claim_spec) must load in the CDI
    reference library; checked once at the end of the test."""
    built: list[dict] = []
    original = cdi_module.build_claim_spec

    def recording(*args, **kwargs):
        spec, ids = original(*args, **kwargs)
        built.append(json.loads(json.dumps(spec)))
        return spec, ids

    monkeypatch.setattr(cdi_module, "build_claim_spec", recording)
    monkeypatch.setitem(globals(), "build_claim_spec", recording)
    yield built
    if built:
        cdivalidate.check_specs(built)


@pytest.fixture
def tree(tmp_path: Path):
    return build_fake_driver_root(tmp_path / "host")


def writer(tmp_path: Path, tree, **kwargs) -> CdiSpecWriter:
    return CdiSpecWriter(tmp_path / "cdi", tree.driver_root(), **kwargs)


def mounts_by_container(edits: dict) -> dict[str, dict]:
    return {m["containerPath"]: m for m in edits.get("mounts", [])}


# ----- driver root discovery -----------------------------------------------------------------------------------
def test_driver_files_pick_compute_libraries_once_through_merged_usr(tree):
    files = tree.driver_root().files()
    names = sorted(Path(lib.container_path).name for lib in files.libraries)
    assert names == sorted(f"{n}.{tree.version}" for n in
                           ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so", "libnvidia-nvvm.so"))
    # /lib -> usr/lib must not produce a second copy of each library.
    assert all(lib.container_path.startswith("/usr/lib/x86_64-linux-gnu/") for lib in files.libraries)
    assert {Path(link.container_path).name for link in files.soname_links} == {
        "libcuda.so", "libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1", "libnvidia-nvvm.so.4"}
    assert files.version == tree.version
    assert files.lib_folders == ("/usr/lib/x86_64-linux-gnu",)
    assert [Path(b.container_path).name for b in files.binaries] == [
        "nvidia-smi", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"]
    assert [f.container_path for f in files.firmware] == [f"/lib/firmware/nvidia/{tree.version}"]
    assert files.firmware[0].host_path == str(tree.root / "usr/lib/firmware/nvidia" / tree.version)
    assert files.hook is None


def test_absolute_links_resolve_inside_the_root(tmp_path):
    tree = build_fake_driver_root(tmp_path / "host", absolute_links=True)
    files = tree.driver_root().files()
    link = next(lk for lk in files.soname_links if lk.container_path.endswith("libcuda.so.1"))
    assert link.target == f"/usr/lib/x86_64-linux-gnu/libcuda.so.{tree.version}"
    assert link.resolved.host_path == str(tree.root / "usr/lib/x86_64-linux-gnu" / f"libcuda.so.{tree.version}")


def test_host_root_translates_host_paths(tree):
    root = DriverRoot(tree.root, host_root="/run/nvidia/driver", dev_root=tree.dev_root, host_dev_root="/",
                      proc_root=tree.proc_root)
    files = root.files()
    lib = files.libraries[0]
    assert lib.host_path == "/run/nvidia/driver" + lib.container_path
    assert root.gpu_node(0).host_path == "/dev/nvidia0"


def test_missing_libcuda_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DriverRootError, match="no libcuda.so"):
        DriverRoot(tmp_path / "empty", dev_root=tmp_path, proc_root=tmp_path).files()


def test_missing_gpu_node_names_the_path(tree):
    with pytest.raises(DriverRootError, match="nvidia7"):
        tree.driver_root().gpu_node(7)


def test_missing_uvm_nodes_use_proc_devices_major(tmp_path):
    tree = build_fake_driver_root(tmp_path / "host", with_uvm=False)
    nodes = {n.path: n for n in tree.driver_root().files().control_nodes}
    assert nodes["/dev/nvidia-uvm"].to_cdi() == {"path": "/dev/nvidia-uvm", "type": "c", "major": UVM_MAJOR, "minor": 0}
    assert nodes["/dev/nvidia-uvm-tools"].minor == 1


# ----- spec content ----------------------------------------------------------------------------------------------
def test_whole_gpu_spec_makes_cuda_usable_without_nvidia_runtime(tmp_path, tree):
    w = writer(tmp_path, tree)
    ids = w.write_claim_spec(UID, [GPU0])
    assert ids == [[f"k8s.gpu.dra-driver.io/claim={UID}-gpu-0"]]
    path = tmp_path / "cdi" / f"k8s.gpu.dra-driver.io-claim_{UID}.json"
    spec = load_spec(path)
    validate_spec(spec)
    assert spec["kind"] == "k8s.gpu.dra-driver.io/claim"
    assert spec["cdiVersion"] == "0.5.0"  # hostPath on device nodes and a name starting with a digit
    common = spec["containerEdits"]
    assert [n["path"] for n in common["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert common["deviceNodes"][0]["hostPath"] == str(tree.dev_root / "dev/nvidiactl")
    mounts = mounts_by_container(common)
    libdir = "/usr/lib/x86_64-linux-gnu"
    for expected in (f"{libdir}/libcuda.so.{tree.version}", f"{libdir}/libcuda.so.1", f"{libdir}/libcuda.so",
                     f"{libdir}/libnvidia-ml.so.1", f"{libdir}/libnvidia-ptxjitcompiler.so.1",
                     "/usr/bin/nvidia-smi", f"/lib/firmware/nvidia/{tree.version}"):
        assert expected in mounts, expected
        assert "ro" in mounts[expected]["options"]
    assert "/usr/bin/nvidia-cuda-mps-control" not in mounts     # only where the node policy asks for it
    # Without a hook, the soname link shows the real file.
    real_file = tree.root / libdir.lstrip("/") / f"libcuda.so.{tree.version}"
    assert mounts[f"{libdir}/libcuda.so.1"]["hostPath"] == str(real_file)
    assert not any("GLX" in p or "libc.so" in p or "unrelated" in p for p in mounts)
    assert "hooks" not in common
    assert not any(e.startswith("LD_LIBRARY_PATH") for e in common.get("env", []))
    (device,) = spec["devices"]
    assert device["name"] == f"{UID}-gpu-0"
    assert device["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": str(tree.dev_root / "dev/nvidia0")}]
    assert device["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=GPU-aaaa"]


def test_hooks_replace_link_mounts_when_nvidia_cdi_hook_exists(tmp_path, tree):
    hook = tree.add_hook()
    spec, _ = writer(tmp_path, tree).build(UID, [GPU0])
    common = spec["containerEdits"]
    mounts = mounts_by_container(common)
    assert "/usr/lib/x86_64-linux-gnu/libcuda.so.1" not in mounts
    assert f"/usr/lib/x86_64-linux-gnu/libcuda.so.{tree.version}" in mounts
    symlinks, ldcache, nodes = common["hooks"]
    assert symlinks["hookName"] == ldcache["hookName"] == nodes["hookName"] == "createContainer"
    assert symlinks["path"] == ldcache["path"] == nodes["path"] == str(hook)
    assert symlinks["args"][:2] == ["nvidia-cdi-hook", "create-symlinks"]
    assert f"libcuda.so.{tree.version}::/usr/lib/x86_64-linux-gnu/libcuda.so.1" in symlinks["args"]
    assert ldcache["args"] == ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"]
    assert nodes["args"] == ["nvidia-cdi-hook", "disable-device-node-modification"]
    validate_spec(spec)


def test_nvidia_ctk_hook_needs_hook_subcommand(tmp_path, tree):
    tree.add_hook("nvidia-ctk")
    spec, _ = writer(tmp_path, tree).build(UID, [GPU0])
    assert [h["args"][:3] for h in spec["containerEdits"]["hooks"]] == [
        ["nvidia-ctk", "hook", "create-symlinks"], ["nvidia-ctk", "hook", "update-ldcache"],
        ["nvidia-ctk", "hook", "disable-device-node-modification"]]


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_given_hook_path_is_used_over_the_driver_roots_own(tmp_path, tree):
    """The driver's own hook (--cdi-hook-path) runs every hook, whatever the driver root has (here a host
    toolkit's nvidia-ctk, whose sub-commands need another argv)."""
    tree.add_hook("nvidia-ctk")
    own = executable(tmp_path / "plugin/bin/nvidia-cdi-hook")
    w = CdiSpecWriter(tmp_path / "cdi", tree.driver_root(hook_path=str(own)))
    spec, _ = w.build(UID, [GPU0])
    hooks = spec["containerEdits"]["hooks"]
    assert {h["path"] for h in hooks} == {str(own)}
    assert [h["args"][1] for h in hooks] == ["create-symlinks", "update-ldcache", "disable-device-node-modification"]
    assert all(h["args"][0] == "nvidia-cdi-hook" for h in hooks)


@pytest.mark.parametrize("make, problem", [
    (lambda p: p, "cannot be read"),
    (lambda p: (p.mkdir(), p)[1], "not a regular file"),
    (lambda p: (p.write_text("x"), p.chmod(0o644), p)[2], "not executable"),
])
def test_a_given_hook_that_cannot_run_is_an_error_naming_the_flag(tmp_path, tree, make, problem):
    hook = make(tmp_path / "nvidia-cdi-hook")
    with pytest.raises(CdiHookError, match=rf"^--cdi-hook-path {hook}: {problem}"):
        tree.driver_root(hook_path=str(hook)).files()


def test_relative_hook_path_is_refused(tree):
    with pytest.raises(CdiHookError, match="not an absolute path"):
        tree.driver_root(hook_path="bin/nvidia-cdi-hook").files()


def test_real_node_without_any_hook_does_not_start(tmp_path, tree):
    with pytest.raises(CdiHookError, match="--cdi-hook-path") as err:
        check_real_node(tree.driver_root())
    assert "\n" not in str(err.value)
    own = executable(tmp_path / "bin/nvidia-cdi-hook")
    assert check_real_node(tree.driver_root(hook_path=str(own))).hook.host_path == str(own)
    tree.add_hook()
    assert check_real_node(tree.driver_root()).hook is not None   # a host toolkit's hook will do


def test_mig_device_gets_parent_node_and_capability_nodes(tmp_path, tree):
    gi_minor, ci_minor = tree.add_mig(1, gi_id=3, ci_id=0)
    mig = ClaimDevice(name="gpu-1-mig-1g10gb-19-2", uuid="MIG-bbbb", gpu_minor=1, mig=(3, 0), requests=("mig",))
    spec, ids = writer(tmp_path, tree).build(UID, [mig])
    nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
    assert [n["path"] for n in nodes] == ["/dev/nvidia1", f"/dev/nvidia-caps/nvidia-cap{gi_minor}",
                                          f"/dev/nvidia-caps/nvidia-cap{ci_minor}"]
    assert nodes[1] == {"path": f"/dev/nvidia-caps/nvidia-cap{gi_minor}",
                        "hostPath": str(tree.dev_root / f"dev/nvidia-caps/nvidia-cap{gi_minor}"),
                        "type": "c", "major": CAPS_MAJOR, "minor": gi_minor}
    assert spec["devices"][0]["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=MIG-bbbb"]
    assert ids == [[f"k8s.gpu.dra-driver.io/claim={UID}-gpu-1-mig-1g10gb-19-2"]]


def test_mig_capability_nodes_missing_on_host_are_created_by_runtime(tmp_path, tree):
    gi_minor, _ = tree.add_mig(0, gi_id=1, ci_id=0, create_nodes=False)
    nodes = tree.driver_root().mig_cap_nodes(0, 1, 0)
    assert nodes[0].to_cdi() == {"path": f"/dev/nvidia-caps/nvidia-cap{gi_minor}", "type": "c",
                                 "major": CAPS_MAJOR, "minor": gi_minor}


def test_missing_capability_file_is_a_clear_error(tree):
    with pytest.raises(DriverRootError, match=r"gpu0/mig/gi9/access"):
        tree.driver_root().mig_cap_nodes(0, 9, 0)


def test_mps_edits_mount_pipe_and_shm_never_the_log(tmp_path, tree):
    mps = MpsMounts(pipe_dir="/var/lib/plugin/mps/x/pipe", shm_dir="/var/lib/plugin/mps/x/shm")
    dev = ClaimDevice(name="gpu-0-slot-1", uuid="GPU-aaaa", gpu_minor=0, requests=("s",), mps=mps)
    spec, _ = writer(tmp_path, tree).build(UID, [dev])
    edits = spec["devices"][0]["containerEdits"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in edits["env"]
    assert not any(e.startswith("CUDA_MPS_LOG_DIRECTORY=") for e in edits["env"])
    mounts = mounts_by_container(edits)
    assert set(mounts) >= {"/tmp/nvidia-mps", "/dev/shm"} and not any("log" in m for m in mounts)
    assert mounts["/tmp/nvidia-mps"]["hostPath"] == mps.pipe_dir
    assert mounts["/dev/shm"]["hostPath"] == mps.shm_dir
    # Read-only: clients only connect; the root daemon writes its PID file and log there following links.
    assert "ro" in mounts["/tmp/nvidia-mps"]["options"] and "rw" not in mounts["/tmp/nvidia-mps"]["options"]
    assert "rw" in mounts["/dev/shm"]["options"]


def test_mps_shm_is_mounted_noexec_nosuid_nodev(tmp_path, tree):
    """The daemon's shared-memory directory is written by every client of the daemon: as a container's /dev/shm
    nothing in it runs, and no set-uid bit or device node there counts."""
    mps = MpsMounts(pipe_dir="/var/lib/plugin/mps/x/pipe", shm_dir="/var/lib/plugin/mps/x/shm")
    dev = ClaimDevice(name="gpu-0-slot-1", uuid="GPU-aaaa", gpu_minor=0, requests=("s",), mps=mps)
    spec, _ = writer(tmp_path, tree).build(UID, [dev])
    options = mounts_by_container(spec["devices"][0]["containerEdits"])["/dev/shm"]["options"]
    assert {"rw", "noexec", "nosuid", "nodev"} <= set(options) and "exec" not in options, options


def test_visible_devices_follow_requests(tmp_path, tree):
    devices = [
        ClaimDevice(name="gpu-0", uuid="GPU-a", gpu_minor=0, requests=("pair",)),
        ClaimDevice(name="gpu-1", uuid="GPU-b", gpu_minor=1, requests=("pair",)),
        ClaimDevice(name="gpu-1-shared", uuid="GPU-b", gpu_minor=1, requests=("solo",), share_id="6f0e"),
    ]
    spec, ids = writer(tmp_path, tree).build(UID, devices)
    envs = [d["containerEdits"]["env"][0] for d in spec["devices"]]
    assert envs == ["NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b", "NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b",
                    "NVIDIA_VISIBLE_DEVICES=GPU-b"]
    assert ids[2] == [f"k8s.gpu.dra-driver.io/claim={UID}-gpu-1-shared-6f0e"]


def test_vendor_is_configurable_and_checked(tmp_path, tree):
    w = writer(tmp_path, tree, vendor="k8s.gpu.nvidia.com")
    ids = w.write_claim_spec(UID, [GPU0])
    assert ids == [[f"k8s.gpu.nvidia.com/claim={UID}-gpu-0"]]
    assert w.spec_path(UID).name == f"k8s.gpu.nvidia.com-claim_{UID}.json"
    with pytest.raises(ValueError, match="vendor"):
        CdiSpecWriter(tmp_path, tree.driver_root(), vendor="-bad")


def test_json_format(tmp_path, tree):
    w = writer(tmp_path, tree, fmt="json")
    w.write_claim_spec(UID, [GPU0])
    doc = json.loads(w.spec_path(UID).read_text())
    assert w.spec_path(UID).suffix == ".json"
    validate_spec(doc)


# ----- atomic writing, delete, listing --------------------------------------------------------------------------
def test_rewrite_replaces_content_and_leaves_no_temp_files(tmp_path, tree):
    w = writer(tmp_path, tree)
    w.write_claim_spec(UID, [GPU0])
    w.write_claim_spec(UID, [ClaimDevice(name="gpu-1", uuid="GPU-bbbb", gpu_minor=1)])
    spec = load_spec(w.spec_path(UID))
    assert [d["name"] for d in spec["devices"]] == [f"{UID}-gpu-1"]
    assert sorted(p.name for p in (tmp_path / "cdi").iterdir()) == [w.spec_path(UID).name]
    assert oct(w.spec_path(UID).stat().st_mode & 0o777) == oct(0o644)


def test_failed_write_keeps_old_spec_and_cleans_temp(tmp_path, tree, monkeypatch):
    w = writer(tmp_path, tree)
    w.write_claim_spec(UID, [GPU0])
    before = w.spec_path(UID).read_bytes()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        w.write_claim_spec(UID, [ClaimDevice(name="gpu-1", uuid="GPU-bbbb", gpu_minor=1)])
    monkeypatch.undo()
    assert w.spec_path(UID).read_bytes() == before
    assert [p.name for p in (tmp_path / "cdi").iterdir()] == [w.spec_path(UID).name]


def test_concurrent_writers_never_expose_partial_files(tmp_path, tree):
    w = writer(tmp_path, tree)
    w.write_claim_spec(UID, [GPU0])
    stop = threading.Event()
    errors: list[Exception] = []

    def reader():
        while not stop.is_set():
            try:
                validate_spec(yaml.safe_load(w.spec_path(UID).read_text()))
            except Exception as err:  # noqa: BLE001 - any failure is the finding
                errors.append(err)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(30):
        w.write_claim_spec(UID, [ClaimDevice(name=f"gpu-{i % 2}", uuid=f"GPU-{i}", gpu_minor=i % 2)])
    stop.set()
    t.join()
    assert errors == []


def test_delete_is_idempotent_and_listing_finds_claims(tmp_path, tree):
    w = writer(tmp_path, tree)
    other = "11111111-2222-4333-8444-555555555555"
    w.write_claim_spec(UID, [GPU0])
    w.write_claim_spec(other, [GPU0])
    (tmp_path / "cdi" / "nvidia.yaml").write_text("kind: nvidia.com/gpu\n")
    assert sorted(w.list_claim_specs()) == sorted([UID, other])
    assert w.delete_claim_spec(UID) is True
    assert w.delete_claim_spec(UID) is False
    assert list(w.list_claim_specs()) == [other]
    assert (tmp_path / "cdi" / "nvidia.yaml").exists()


def test_leftover_temp_files_are_removed(tmp_path, tree):
    w = writer(tmp_path, tree)
    w.write_claim_spec(UID, [GPU0])
    leftover = tmp_path / "cdi" / f".{w.spec_path(UID).name}.abc123.tmp"
    leftover.write_text("half")
    assert w.list_claim_specs() == {UID: w.spec_path(UID)}
    assert w.remove_leftover_temp_files() == [leftover]
    assert not leftover.exists()


# ----- NVIDIA Container Toolkit specs --------------------------------------------------------------------------
def write_toolkit_spec(directory: Path, kind: str, names: list[str], file: str = "nvidia.yaml") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    spec = {"cdiVersion": "0.5.0", "kind": kind,
            "devices": [{"name": n, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}} for n in names],
            "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}}
    (directory / file).write_text(yaml.safe_dump(spec))


def test_toolkit_spec_ids_are_returned_and_own_spec_is_env_only(tmp_path, tree):
    etc = tmp_path / "etc-cdi"
    write_toolkit_spec(etc, "nvidia.com/gpu", ["0", "GPU-aaaa", "all"])
    toolkit = ToolkitSpecs([etc, tmp_path / "run-cdi"], ignore_vendor="k8s.gpu.dra-driver.io")
    w = writer(tmp_path, tree, toolkit=toolkit)
    ids = w.write_claim_spec(UID, [GPU0])
    assert ids == [[f"k8s.gpu.dra-driver.io/claim={UID}-gpu-0", "nvidia.com/gpu=GPU-aaaa"]]
    spec = load_spec(w.spec_path(UID))
    validate_spec(spec)
    assert "containerEdits" not in spec
    assert spec["devices"][0]["containerEdits"] == {"env": ["NVIDIA_VISIBLE_DEVICES=GPU-aaaa"]}


def test_toolkit_spec_by_index_and_mixed_claim(tmp_path, tree):
    run = tmp_path / "run-cdi"
    write_toolkit_spec(run, "nvidia.com/gpu", ["0", "1"])
    tree.add_mig(1, 2, 0)
    toolkit = ToolkitSpecs([tmp_path / "etc-cdi", run])
    devices = [GPU0, ClaimDevice(name="gpu-1-mig-3g40gb-9-4", uuid="MIG-new", gpu_minor=1, gpu_index=1, mig=(2, 0))]
    spec, ids = writer(tmp_path, tree, toolkit=toolkit).build(UID, devices)
    assert ids[0][1] == "nvidia.com/gpu=0"
    assert len(ids[1]) == 1  # a MIG device the toolkit does not know gets our own edits
    assert "deviceNodes" in spec["devices"][1]["containerEdits"]
    assert "deviceNodes" not in spec["devices"][0]["containerEdits"]
    assert "containerEdits" in spec  # common edits needed for the MIG device
    validate_spec(spec)


def test_toolkit_spec_refreshes_and_later_dirs_win(tmp_path, tree):
    etc, run = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    write_toolkit_spec(etc, "nvidia.com/mig", ["MIG-x"])
    toolkit = ToolkitSpecs([etc, run])
    mig = ClaimDevice(name="m", uuid="MIG-x", gpu_minor=0, mig=(1, 0))
    assert toolkit.lookup(mig) == "nvidia.com/mig=MIG-x"
    write_toolkit_spec(run, "nvidia.com/gpu", ["MIG-x"], file="nvidia-other.json")
    assert toolkit.lookup(mig) == "nvidia.com/gpu=MIG-x"
    (etc / "broken.yaml").write_text("{not: yaml: [")
    assert toolkit.lookup(mig) == "nvidia.com/gpu=MIG-x"


def test_letter_uid_env_only_spec_needs_oldest_version(tmp_path, tree):
    etc = tmp_path / "etc-cdi"
    write_toolkit_spec(etc, "nvidia.com/gpu", ["GPU-aaaa"])
    spec, _ = writer(tmp_path, tree, toolkit=ToolkitSpecs([etc])).build(UID_LETTER, [GPU0])
    assert spec["cdiVersion"] == "0.3.0"


# ----- validation rules ---------------------------------------------------------------------------------------
def minimal(**overrides) -> dict:
    spec = {"cdiVersion": "0.3.0", "kind": "example.com/claim",
            "devices": [{"name": "dev", "containerEdits": {"env": ["A=1"]}}]}
    spec.update(overrides)
    return spec


@pytest.mark.parametrize("spec, fragment", [
    (minimal(kind="nokind"), "kind"),
    (minimal(kind="1bad.com/claim"), "vendor"),
    (minimal(kind="example.com/cl.ass"), "0.6.0"),
    (minimal(devices=[]), "non-empty"),
    (minimal(devices=[{"name": "-x", "containerEdits": {}}]), "devices[0].name"),
    (minimal(devices=[{"name": "9dev", "containerEdits": {}}]), "0.5.0"),
    (minimal(devices=[{"name": "a", "containerEdits": {}}, {"name": "a", "containerEdits": {}}]), "twice"),
    (minimal(devices=[{"name": "a"}]), "containerEdits: required"),
    (minimal(devices=[{"name": "a", "containerEdits": {"deviceNodes": [{"path": "/dev/x", "hostPath": "/dev/x"}]}}]),
     "0.5.0"),
    (minimal(devices=[{"name": "a", "containerEdits": {"mounts": [{"hostPath": "/a", "containerPath": "/a",
                                                                    "type": "bind"}]}}]), "0.4.0"),
    (minimal(devices=[{"name": "a", "containerEdits": {"env": ["no-equals"]}}]), "env[0]"),
    (minimal(devices=[{"name": "a", "containerEdits": {"hooks": [{"hookName": "bogus", "path": "/h"}]}}]), "hookName"),
    (minimal(devices=[{"name": "a", "containerEdits": {"deviceNodes": [{"path": "rel"}]}}]), "absolute"),
    (minimal(extra=1), "extra: unknown field"),
    (minimal(devices=[{"name": "a", "containerEdits": {"mounts": [{"hostPath": "/a", "containerPath": "/a",
                                                                    "opts": []}]}}]), "opts: unknown field"),
    (minimal(cdiVersion="0.9.0"), "not a known"),
])
def test_validation_rejects(spec, fragment):
    with pytest.raises(CdiSpecError) as err:
        validate_spec(spec)
    assert fragment in str(err.value)


def test_validation_accepts_minimal_and_version_is_minimal():
    validate_spec(minimal())
    assert required_version(minimal()) == "0.3.0"
    spec = minimal(devices=[{"name": "a", "containerEdits": {"netDevices": [{"hostInterfaceName": "e", "name": "e"}]}}])
    assert required_version(spec) == "1.1.0"
    assert CDI_VERSIONS[0] == "0.3.0"


def test_build_refuses_empty_claims_and_unknown_devices_without_root():
    with pytest.raises(ValueError, match="no devices"):
        build_claim_spec(UID, [], None)
    with pytest.raises(ValueError, match="no toolkit CDI spec"):
        build_claim_spec(UID, [GPU0], None)


# ----- resolution as a container runtime does it ------------------------------------------------------------
def test_written_specs_resolve_like_a_runtime(tmp_path, tree):
    from standin.cdi import resolve

    tree.add_mig(1, 2, 0)
    etc = tmp_path / "etc-cdi"
    write_toolkit_spec(etc, "nvidia.com/gpu", ["GPU-tk"])
    w = writer(tmp_path, tree, toolkit=ToolkitSpecs([etc]))
    mps = MpsMounts(pipe_dir="/m/pipe", shm_dir="/m/shm")
    ids = w.write_claim_spec(UID, [
        ClaimDevice(name="gpu-0", uuid="GPU-aaaa", gpu_minor=0, requests=("a",), mps=mps),
        ClaimDevice(name="gpu-1-mig-3g40gb-9-4", uuid="MIG-cccc", gpu_minor=1, mig=(2, 0), requests=("b",)),
        ClaimDevice(name="gpu-3", uuid="GPU-tk", gpu_minor=3, requests=("c",)),
    ])
    edits = resolve([etc, tmp_path / "cdi"], [i for per_device in ids for i in per_device])
    paths = edits.device_paths()
    for expected in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidia1"):
        assert expected in paths
    assert sum(p.startswith("/dev/nvidia-caps/") for p in paths) == 2
    assert "/tmp/nvidia-mps" in edits.mount_targets()
    assert f"/usr/lib/x86_64-linux-gnu/libcuda.so.{tree.version}" in edits.mount_targets()
    assert ids[2] == [f"k8s.gpu.dra-driver.io/claim={UID}-gpu-3", "nvidia.com/gpu=GPU-tk"]
