"""Discovery through the pynvml interface (simulated GPUs), and the `gpu-dra inventory` command."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pynvml
import pytest

import dra.node.inventory as inventory_module
from cli import inventory_cmd
from dra.model.catalog import get_model
from dra.node.inventory import describe_nvml_error, discover, format_cuda_version, normalise_pci_bus_id
from dra.sim.fakenvml import FakeNvml, SimulatedGpu
from dra.sim.fleet import gpu_uuid, load_fleet, nvml_for_node, parse_fleet

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "fleets"

MIXED = {"nodes": [{
    "name": "mixed",
    "driverVersion": "570.172.08",
    "cudaDriverVersion": "12.8",
    "gpus": [
        {"model": "A100-40GB", "mig": {"enabled": True, "instances": [
            {"profile": "3g.20gb", "start": 4}, {"profile": "2g.10gb", "start": 0}, {"profile": "1g.5gb", "start": 2}]}},
        {"model": "A30", "mig": {"enabled": True}},
        {"model": "T4"},
        {"model": "L40S"},
        {"model": "B200"},
        {"model": "L4", "broken": "fell off the bus"},
    ],
}]}


def discover_fleet(data) -> tuple[object, FakeNvml]:
    nvml = nvml_for_node(parse_fleet(data).nodes[0])
    nvml.nvmlInit()
    return discover(nvml), nvml


@pytest.fixture(scope="module")
def mixed():
    inv, _ = discover_fleet(MIXED)
    return inv


def test_node_versions(mixed):
    assert mixed.driver_version == "570.172.08"
    assert mixed.cuda_driver_version == "12.8"
    assert len(mixed.gpus) == 6


def test_identity_and_properties(mixed):
    a100, a30, t4, l40s, b200, _ = mixed.gpus
    assert [g.index for g in mixed.gpus] == list(range(6)) == [g.minor for g in mixed.gpus]
    assert a100.uuid == gpu_uuid("mixed", 0)
    assert (a100.product_name, a100.brand, a100.architecture, a100.cuda_compute_capability) == \
        ("NVIDIA A100-SXM4-40GB", "Nvidia", "Ampere", (8, 0))
    assert (t4.product_name, t4.brand, t4.architecture, t4.cuda_compute_capability) == \
        ("Tesla T4", "Tesla", "Turing", (7, 5))
    assert (l40s.architecture, l40s.cuda_compute_capability) == ("Ada Lovelace", (8, 9))
    assert (b200.architecture, b200.cuda_compute_capability) == ("Blackwell", (10, 0))
    assert a100.memory_mib == 40960 and b200.memory_mib == get_model("B200").memory_mib
    assert a100.pci_bus_id == "0000:18:00.0" and b200.pci_bus_id == "0000:9a:00.0"
    assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", t4.pci_bus_id)
    assert a100.pci_device_id == 0x20B010DE
    assert a100.numa_node == 0
    assert all(g.compute_mode == "Default" for g in mixed.gpus[:5])


def test_sm_and_engine_counts_of_whole_gpus(mixed):
    a100, _, t4, _, b200, _ = mixed.gpus
    assert (a100.multiprocessors, t4.multiprocessors, b200.multiprocessors) == (108, 40, 148)
    assert (a100.decoders, a100.jpeg_engines, a100.ofa_engines) == (5, 1, 1)


def test_mig_capability_and_modes(mixed):
    a100, a30, t4, l40s, b200, _ = mixed.gpus
    assert (a100.mig_capable, a100.mig_enabled, a100.mig_pending) == (True, True, True)
    assert (b200.mig_capable, b200.mig_enabled) == (True, False)
    assert not t4.mig_capable and not l40s.mig_capable
    assert (a100.memory_slices, a30.memory_slices, b200.memory_slices, t4.memory_slices) == (8, 4, 8, 0)
    assert t4.mig_profiles == () and t4.mig_instances == ()


def test_mig_profiles_come_from_nvml(mixed):
    a100, a30, _, _, b200, _ = mixed.gpus
    by_name = {p.name: p for p in a100.mig_profiles}
    assert set(by_name) == {"1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"}
    p = by_name["1g.10gb"]
    assert (p.profile_id, p.nvml_index, p.compute_slices, p.memory_slices, p.starts, p.max_instances,
            p.memory_mib) == (15, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 1, 2, (0, 2, 4, 6), 4, 9984)
    assert by_name["3g.20gb"].starts == (0, 4) and by_name["3g.20gb"].memory_slices == 4
    assert by_name["1g.5gb+me"].ofa_engines == 1
    assert [p.name for p in a30.mig_profiles] == ["1g.6gb", "2g.12gb", "4g.24gb", "1g.6gb+me", "2g.12gb+me"]
    # MIG off on B200: profiles and placements are still known (Hopper and later can switch on demand)
    assert {p.name for p in b200.mig_profiles} >= {"1g.23gb", "3g.90gb", "7g.180gb"}


def test_existing_mig_instances(mixed):
    a100 = mixed.gpus[0]
    names = {p.profile_id: p.name for p in a100.mig_profiles}
    got = [(names[m.profile_id], m.start, m.size, m.gi_id, m.ci_id, m.memory_mib) for m in a100.mig_instances]
    assert got == [("2g.10gb", 0, 2, 3, 0, 9984), ("1g.5gb", 2, 1, 9, 0, 4864), ("3g.20gb", 4, 4, 2, 0, 20096)]
    uuids = [m.uuid for m in a100.mig_instances]
    assert all(u.startswith("MIG-") for u in uuids) and len(set(uuids)) == 3
    assert mixed.gpus[1].mig_instances == ()


def test_broken_gpu_is_reported_not_raised(mixed):
    broken = mixed.gpus[5]
    assert not broken.healthy
    assert "GPU is lost" in broken.health_reason and "nvmlDeviceGetName" in broken.health_reason
    assert broken.uuid == gpu_uuid("mixed", 5) and broken.minor == 5   # identity is still known
    assert all(g.healthy for g in mixed.gpus[:5])


def test_gpu_whose_handle_cannot_be_read():
    class Flaky(FakeNvml):
        def nvmlDeviceGetHandleByIndex(self, index):
            if index == 0:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
            return super().nvmlDeviceGetHandleByIndex(index)

    gpus = [SimulatedGpu("L4", f"GPU-{i}", i, "00000000:%02X:00.0" % (0x18 + i)) for i in range(2)]
    nvml = Flaky(gpus)
    nvml.nvmlInit()
    inv = discover(nvml)
    first, second = inv.gpus
    assert (first.healthy, first.uuid, first.minor) == (False, "", -1)
    assert "nvmlDeviceGetHandleByIndex" in first.health_reason and "Unknown Error" in first.health_reason
    assert second.healthy and second.uuid == "GPU-1"


def test_pending_mig_mode_and_instances_without_compute_instance():
    nvml = FakeNvml([SimulatedGpu("A100-40GB", "GPU-a", 0, "00000000:18:00.0", mig_enabled=True),
                     SimulatedGpu("A30", "GPU-b", 1, "00000000:19:00.0")])
    nvml.nvmlInit()
    a100 = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(a100, 9, pynvml.c_nvmlGpuInstancePlacement_t(0, 4))
    nvml.nvmlDeviceSetMigMode(nvml.nvmlDeviceGetHandleByIndex(1), pynvml.NVML_DEVICE_MIG_ENABLE)
    gpu_a, gpu_b = discover(nvml).gpus
    assert [(m.gi_id, m.ci_id, m.uuid, m.start) for m in gpu_a.mig_instances] == [(1, -1, "", 0)]
    assert (gpu_b.mig_enabled, gpu_b.mig_pending, gpu_b.mig_instances) == (False, True, ())


def test_numa_unknown():
    nvml = FakeNvml([SimulatedGpu("L4", "GPU-a", 0, "00000000:18:00.0", numa_node=None)])
    nvml.nvmlInit()
    assert discover(nvml).gpus[0].numa_node is None


def test_discover_only_calls_functions_pynvml_has():
    source = Path(inventory_module.__file__).read_text()
    called = set(re.findall(r"\b(nvml[A-Z]\w+)", source))
    assert "nvmlDeviceGetGpuInstancePossiblePlacements" in called
    missing = sorted(name for name in called if not callable(getattr(pynvml, name, None)))
    assert missing == []


def test_helpers():
    assert format_cuda_version(13000) == "13.0" and format_cuda_version(12080) == "12.8"
    assert normalise_pci_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalise_pci_bus_id("0001:AF:1F.3") == "0001:af:1f.3"
    assert "GPU is lost" in describe_nvml_error(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST))
    assert "Insufficient resources" in describe_nvml_error(pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES))


def test_placement_buffers_are_ctypes():
    """The placement query is made the C way: a count first, then a buffer of NVML structures."""
    nvml = FakeNvml([SimulatedGpu("H100-80GB", "GPU-a", 0, "00000000:18:00.0")])
    nvml.nvmlInit()
    got = inventory_module._possible_placements(nvml, nvml.nvmlDeviceGetHandleByIndex(0), 9,
                                                lambda name, *a: getattr(nvml, name)(*a))
    assert got == [(0, 4), (4, 4)]


# -- CLI -------------------------------------------------------------------------------------------------------


def run_cli(capsys, *argv):
    parser = argparse.ArgumentParser()
    inventory_cmd.add_arguments(parser)
    rc = inventory_cmd.run(parser.parse_args(list(argv)))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_fleet_all_nodes(capsys):
    rc, out, _ = run_cli(capsys, "--fleet", str(EXAMPLES / "mixed.yaml"))
    assert rc == 0
    fleet = load_fleet(EXAMPLES / "mixed.yaml")
    for n in fleet.nodes:
        assert f"node {n.name}: {n.gpu_count} GPU(s)" in out
    assert "2g.10gb@0, 1g.5gb@2, 1g.5gb@3, 3g.20gb@4" in out
    assert "8.0 ampere" in out and "10.0 blackwell" in out and "7.5 turing" in out
    assert "UNHEALTHY" in out and "GPU is lost" in out


def test_cli_one_node(capsys):
    rc, out, _ = run_cli(capsys, "--fleet", str(EXAMPLES / "demo.yaml"), "--node", "node-b")
    assert rc == 0 and "node node-b: 4 GPU(s)" in out and "node-a" not in out
    assert out.count("NVIDIA L4") == 4


def test_cli_errors(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "--fleet", str(EXAMPLES / "demo.yaml"), "--node", "nope")
    assert rc == 2 and "no node 'nope'" in err
    rc, _, err = run_cli(capsys, "--node", "x")
    assert rc == 2 and "--node needs --fleet" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [{name: a, gpus: [{model: X1}]}]\n")
    rc, _, err = run_cli(capsys, "--fleet", str(bad))
    assert rc == 2 and "nodes[0].gpus[0].model" in err


def test_cli_without_nvml(capsys, monkeypatch):
    def no_library():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    rc, _, err = run_cli(capsys)
    assert rc == 1 and "NVML is not available" in err and "--fleet" in err


def test_cli_with_real_pynvml_path(capsys, monkeypatch):
    """Without --fleet the command drives the pynvml module itself; here it is swapped for a simulator."""
    fake = nvml_for_node(parse_fleet({"nodes": [{"name": "local", "gpus": [{"model": "L4", "count": 2}]}]}).nodes[0])
    for name in ("nvmlInit", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlSystemGetCudaDriverVersion",
                 "nvmlDeviceGetCount"):
        monkeypatch.setattr(pynvml, name, getattr(fake, name))
    monkeypatch.setattr(inventory_module, "discover", lambda nvml: discover(fake))
    rc, out, _ = run_cli(capsys)
    assert rc == 0 and "node local: 2 GPU(s)" in out


def test_pcie_root_comes_from_sysfs(tmp_path: Path) -> None:
    """The root complex is read from the device's canonical sysfs path; unknown devices get none."""
    from dra.node.inventory import discover
    from dra.sim.fleet import nvml_for_node, parse_fleet

    nvml = nvml_for_node(parse_fleet({"nodes": [{"name": "n", "gpus": [{"model": "L4", "count": 2}]}]}).node("n"))
    nvml.nvmlInit()
    first = discover(nvml, sysfs_root=tmp_path).gpus
    assert [g.pcie_root for g in first] == [None, None]
    bdf = first[0].pci_bus_id
    device_dir = tmp_path / "devices" / "pci0000:17" / "0000:17:00.0" / bdf
    device_dir.mkdir(parents=True)
    (tmp_path / "bus" / "pci" / "devices").mkdir(parents=True)
    (tmp_path / "bus" / "pci" / "devices" / bdf).symlink_to(device_dir)
    gpus = discover(nvml, sysfs_root=tmp_path).gpus
    assert [g.pcie_root for g in gpus] == ["pci0000:17", None]


def test_h200_with_mig_off_is_discovered_without_whole_gpu_attributes():
    """As on a real H200: nvmlDeviceGetAttributes answers Not Supported for the whole GPU while MIG is off, the
    profile queries answer all the same; SMs and engines come from the catalog, profiles from NVML."""
    inv, nvml = discover_fleet({"nodes": [{"name": "h200", "gpus": [{"model": "H200-141GB"}]}]})
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetAttributes(nvml.nvmlDeviceGetHandleByIndex(0))
    (gpu,) = inv.gpus
    assert (gpu.mig_capable, gpu.mig_enabled, gpu.healthy) == (True, False, True)
    assert (gpu.memory_mib, gpu.multiprocessors, gpu.copy_engines, gpu.decoders, gpu.jpeg_engines,
            gpu.ofa_engines) == (143771, 132, 8, 7, 7, 1)
    memory = {p.name: p.memory_mib for p in gpu.mig_profiles}
    assert memory == {"1g.18gb": 16384, "1g.18gb+me": 16384, "1g.35gb": 33280, "2g.35gb": 33280,
                      "3g.71gb": 71424, "4g.71gb": 71424, "7g.141gb": 143360}
