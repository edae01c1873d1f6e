"""A simulated node's GPUs outlive the plugin process: the --sim-state file, its default and its errors."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from cli.kubeletplugin_cmd import options_from_args
from cli.main import build_parser
from dra.model.slices import ApiFeatures
from dra.node import migdevices as mig
from dra.sim.fleet import load_fleet, nvml_for_node
from kubeletplugin.claims import DictClaimSource
from kubeletplugin.plugin import KubeletPlugin, PluginConfigError, PluginOptions
from kubeletplugin.transport.nodedriver import ClaimRef

DRIVER = "gpu.dra-driver.io"
NODE = "node-a"


@pytest.fixture
def base():
    d = Path(tempfile.mkdtemp(prefix="kps-", dir="/tmp"))  # short: unix socket paths are limited
    yield d
    shutil.rmtree(d, ignore_errors=True)


def options(base: Path, **kw) -> PluginOptions:
    fleet = base / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"nodes": [{"name": NODE, "gpus": [{"model": "H100-80GB", "count": 1}],
                                                "policy": {"default": {"mig": "dynamic"}}}]}))
    (base / "boot_id").write_text("b1\n")
    return PluginOptions(node_name=NODE, registry_dir=str(base / "reg"), plugin_dir=str(base / "plug"),
                         cdi_root=str(base / "cdi"), driver_root=str(base / "noroot"), proc_root=str(base / "noproc"),
                         dev_root=str(base / "nodev"), state_dir=str(base / "state"), fleet=str(fleet),
                         boot_id_path=str(base / "boot_id"), health_wait_ms=100, **kw)


def plugin(opts: PluginOptions, claims: DictClaimSource) -> KubeletPlugin:
    return KubeletPlugin(opts, claim_source=claims, publish=False, features=ApiFeatures.all())


def test_state_file_default_flag_and_environment(monkeypatch, base):
    assert options(base).simulated_state_file == base / "state" / "simulated-gpus.json"
    assert options(base, sim_state="none").simulated_state_file is None
    assert options(base, sim_state=str(base / "x.json")).simulated_state_file == base / "x.json"
    assert PluginOptions(node_name=NODE).simulated_state_file is None         # a real node has real GPUs
    monkeypatch.setenv("SIM_STATE", "/var/lib/sim/gpus.json")
    args = build_parser().parse_args(["kubelet-plugin", "--node-name", NODE, "--fleet", "f.yaml"])
    assert options_from_args(args).simulated_state_file == Path("/var/lib/sim/gpus.json")
    args = build_parser().parse_args(["kubelet-plugin", "--node-name", NODE, "--fleet", "f.yaml",
                                      "--sim-state", "s.json"])
    assert options_from_args(args).sim_state == "s.json"


def test_mig_device_made_by_one_plugin_process_is_there_for_the_next(base):
    claims = DictClaimSource()
    uid = "c0ffee00-0000-4000-8000-000000000001"
    claims.put({"metadata": {"name": "m", "namespace": "ns", "uid": uid}, "status": {"allocation": {"devices": {
        "results": [{"request": "m", "driver": DRIVER, "pool": NODE, "device": "gpu-0-mig-1g10gb-19-5"}]}}}})
    ref = ClaimRef("ns", uid, "m")
    first = plugin(options(base), claims)
    first.start()
    try:
        assert first.driver.prepare([ref])[uid].error == ""
        [live] = mig.list_mig_devices(first.nvml, first.inventory.gpus[0].uuid)
        assert first.metrics.dynamic_mig_devices._value.get() == 1
    finally:
        first.stop()
    # a third party (a test, an operator's tool) reads the same hardware
    hw = nvml_for_node(load_fleet(base / "fleet.yaml").node(NODE), state_file=base / "state" / "simulated-gpus.json")
    hw.nvmlInit()
    assert mig.list_mig_devices(hw, live.parent_uuid) == [live]

    second = plugin(options(base), claims)
    second.start()
    try:
        assert second.nvml.restored and second.startup.mig_destroyed == ()
        assert mig.list_mig_devices(second.nvml, live.parent_uuid) == [live]
        assert second.metrics.dynamic_mig_devices._value.get() == 1
        assert second.driver.unprepare([ref])[uid].error == ""
    finally:
        second.stop()
    assert mig.list_mig_devices(hw, live.parent_uuid) == []     # seen through the file by the other reader


def test_unusable_state_file_stops_the_plugin_with_its_name(base):
    opts = options(base)
    bad = base / "state" / "simulated-gpus.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("[]")
    p = plugin(opts, DictClaimSource())
    with pytest.raises(PluginConfigError, match=rf"--sim-state: simulated GPU state {bad}: .*delete it"):
        p.start()
    p.stop()


def test_state_kept_in_memory_only_when_asked(base):
    p = plugin(options(base, sim_state="none"), DictClaimSource())
    p.start()
    try:
        assert p.nvml.state_file is None
    finally:
        p.stop()
    assert not (base / "state" / "simulated-gpus.json").exists()
