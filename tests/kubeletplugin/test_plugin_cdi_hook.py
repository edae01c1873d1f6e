"""The plugin's start-up on a real node (NVML answers, the driver root is a fake tree): it refuses to start
without a CDI hook or without the driver's libraries, each with one line naming the flag, and with
``--cdi-hook-path`` every spec it writes runs that hook and loads in the CDI reference library."""
from __future__ import annotations

import json
import shutil
import tempfile
import uuid as uuidlib
from pathlib import Path
from typing import Iterator

import cdivalidate
import pytest
from fixtures.fake_driver_root import FakeDriverTree, build_fake_driver_root

from dra.model.slices import ApiFeatures
from dra.sim.fleet import nvml_for_node, parse_fleet
from kubeletplugin.claims import DictClaimSource
from kubeletplugin.plugin import KubeletPlugin, PluginConfigError, PluginOptions
from kubeletplugin.transport.nodedriver import ClaimRef

DRIVER = "gpu.dra-driver.io"
NODE = "node-a"


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kph-", dir="/tmp"))  # short: unix socket paths are limited
    yield d
    shutil.rmtree(d, ignore_errors=True)


def plugin_for(base: Path, tree: FakeDriverTree, claims: DictClaimSource | None = None,
               **options: str) -> KubeletPlugin:
    nvml = nvml_for_node(parse_fleet({"nodes": [{"name": NODE, "gpus": [{"model": "L4", "count": 2}]}]}).node(NODE))
    nvml.nvmlInit()
    (base / "boot_id").write_text("b1\n")
    opts = PluginOptions(node_name=NODE, registry_dir=str(base / "reg"), plugin_dir=str(base / "plug"),
                         cdi_root=str(base / "cdi"), driver_root=str(tree.root), dev_root=str(tree.dev_root),
                         proc_root=str(tree.proc_root), boot_id_path=str(base / "boot_id"), health_wait_ms=100,
                         **options)
    return KubeletPlugin(opts, nvml=nvml, claim_source=claims or DictClaimSource(), publish=False,
                         features=ApiFeatures.all())


def start_fails(plugin: KubeletPlugin) -> str:
    with pytest.raises(PluginConfigError) as err:
        try:
            plugin.start()
        finally:
            plugin.stop()
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_real_node_without_a_hook_does_not_start(base: Path) -> None:
    tree = build_fake_driver_root(base / "host")
    assert "--cdi-hook-path" in start_fails(plugin_for(base, tree))


def test_a_hook_path_that_is_not_executable_stops_the_start(base: Path) -> None:
    tree = build_fake_driver_root(base / "host")
    hook = base / "nvidia-cdi-hook"
    hook.write_text("not a program")
    message = start_fails(plugin_for(base, tree, cdi_hook_path=str(hook)))
    assert message.startswith(f"--cdi-hook-path {hook}: not executable")


def test_a_driver_root_without_libcuda_names_the_flag(base: Path) -> None:
    tree = build_fake_driver_root(base / "host")
    for lib in (tree.root / tree.lib_dir).glob("libcuda.so*"):
        lib.unlink()
    hook = tree.add_hook()
    message = start_fails(plugin_for(base, tree, cdi_hook_path=str(hook)))
    assert "has no libcuda.so.*" in message and "--driver-root" in message and "driverRoot" in message


def test_every_spec_runs_the_given_hook(base: Path) -> None:
    tree = build_fake_driver_root(base / "host")
    tree.add_hook("nvidia-ctk")   # a host toolkit's: the given hook wins
    hook = base / "plugin-bin" / "nvidia-cdi-hook"
    hook.parent.mkdir()
    hook.write_text("#!/bin/sh\n")
    hook.chmod(0o755)
    claims = DictClaimSource()
    plugin = plugin_for(base, tree, claims, cdi_hook_path=str(hook))
    plugin.start()
    try:
        uid = str(uuidlib.uuid4())
        claims.put({"metadata": {"name": "c", "namespace": "ns", "uid": uid},
                    "status": {"allocation": {"devices": {"results": [
                        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}]}}}})
        out = plugin.driver.prepare([ClaimRef("ns", uid, "c")])
        assert out[uid].error == ""
        (spec_file,) = plugin.driver.cdi.list_claim_specs().values()
        cdivalidate.check_files([spec_file])
        hooks = json.loads(spec_file.read_text())["containerEdits"]["hooks"]
        assert [(h["path"], h["args"][1]) for h in hooks] == [
            (str(hook), "create-symlinks"), (str(hook), "update-ldcache"),
            (str(hook), "disable-device-node-modification")]
    finally:
        plugin.stop()
