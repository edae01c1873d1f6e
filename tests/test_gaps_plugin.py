"""The plugin on a node whose driver root has no ``nvidia-smi``: it still starts, whole GPUs keep working, and
claims that need time-slicing or MPS fail with the reason instead of breaking the node."""
from __future__ import annotations

import shutil
import tempfile
import uuid as uuidlib
from pathlib import Path
from typing import Any, Iterator

import pytest

from dra.sim.fleet import nvml_for_node, parse_fleet
from dra.model.slices import ApiFeatures
from fixtures.fake_driver_root import build_fake_driver_root
from kubeletplugin.claims import DictClaimSource
from kubeletplugin.plugin import KubeletPlugin, PluginOptions, UnavailableSharingControl
from kubeletplugin.transport.nodedriver import ClaimRef

DRIVER = "gpu.dra-driver.io"
NODE = "node-a"


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kpg-", dir="/tmp"))  # short: unix socket paths are limited
    yield d
    shutil.rmtree(d, ignore_errors=True)


def claim(claims: DictClaimSource, name: str, device: str, config: dict[str, Any] | None = None) -> ClaimRef:
    uid = str(uuidlib.uuid4())
    opaque = [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": config}}] if config else []
    claims.put({"metadata": {"name": name, "namespace": "ns", "uid": uid},
                "status": {"allocation": {"devices": {
                    "results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}],
                    "config": opaque}}}})
    return ClaimRef("ns", uid, name)


def sharing(strategy: str, **settings: Any) -> dict[str, Any]:
    return {"apiVersion": "gpu.dra-driver.io/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": strategy, **settings}}


def test_without_nvidia_smi_whole_gpus_work_and_sharing_claims_fail_with_the_reason(base):
    tree = build_fake_driver_root(base / "host", gpu_minors=(0, 1, 2))
    (tree.root / "usr/bin/nvidia-smi").unlink()
    tree.add_hook()   # a real node does not start without a CDI hook
    nvml = nvml_for_node(parse_fleet({"nodes": [{"name": NODE, "gpus": [{"model": "L4", "count": 3}]}]}).node(NODE))
    nvml.nvmlInit()
    (base / "boot_id").write_text("b1\n")
    claims = DictClaimSource()
    opts = PluginOptions(node_name=NODE, registry_dir=str(base / "reg"), plugin_dir=str(base / "plug"),
                         cdi_root=str(base / "cdi"), driver_root=str(tree.root), dev_root=str(tree.dev_root),
                         proc_root=str(tree.proc_root), boot_id_path=str(base / "boot_id"), health_wait_ms=100)
    plugin = KubeletPlugin(opts, nvml=nvml, claim_source=claims, publish=False, features=ApiFeatures.all())
    plugin.start()
    try:
        assert isinstance(plugin.driver.mps.control, UnavailableSharingControl)
        reason = f"GPU sharing is unavailable on this node: driver root {tree.root}: nvidia-smi not found"

        sliced = claim(claims, "sliced", "gpu-0", sharing("TimeSlicing", timeSlicing={"interval": "Long"}))
        mps = claim(claims, "mps", "gpu-1", sharing("MPS", mps={"activeThreadPercentage": 50}))
        plain = claim(claims, "plain", "gpu-2")
        out = plugin.driver.prepare([sliced, mps, plain])
        assert out[sliced.uid].error == f"claim {sliced.describe()}: {reason}"
        assert out[mps.uid].error == f"claim {mps.describe()}: {reason}"
        assert out[plain.uid].error == ""
        assert [d.device_name for d in out[plain.uid].devices] == ["gpu-2"]

        # The failed claims hold nothing: their retries fail the same way, and their GPUs go whole to other claims.
        for ref in (sliced, mps):
            assert plugin.driver.checkpoint.get(ref.uid) is None
            assert not plugin.driver.cdi.spec_path(ref.uid).exists()
            assert plugin.driver.prepare([ref])[ref.uid].error == f"claim {ref.describe()}: {reason}"
        after = [claim(claims, "after-0", "gpu-0"), claim(claims, "after-1", "gpu-1")]
        assert [r.error for r in plugin.driver.prepare(after).values()] == ["", ""]
        assert [r.error for r in plugin.driver.unprepare([plain, *after]).values()] == ["", "", ""]
        assert plugin.driver.checkpoint.claims() == {}
    finally:
        plugin.stop()
