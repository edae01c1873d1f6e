"""The chart values gpu-dra convert writes, rendered by the chart: one release per node group installs side by
side (no object of one release has the name of another's), only the first runs the controller, the webhook and
the DeviceClasses, and each plugin gets its group's node policy and node affinity."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from api.names import DEFAULT_DRIVER_NAME
from ops.convert.conversion import Options, convert, output_files
from testbed.helmchart import render
from test_convert import MIG_PARTED, TIME_SLICING


def _releases(tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "dp"},
          "data": {"ts": yaml.safe_dump(TIME_SLICING), "plain": "version: v1\nflags: {migStrategy: none}\n"}}
    mig = {"version": "v1", "mig-configs": {"all-1g.10gb": MIG_PARTED["mig-configs"]["all-1g.10gb"]}}
    nodes = [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": n, "labels": labels}} for n, labels in (
        ("a", {"nvidia.com/device-plugin.config": "ts"}),
        ("b", {"nvidia.com/device-plugin.config": "plain", "nvidia.com/mig.config": "all-1g.10gb"}))]
    res = convert([("cm", cm), ("mig", mig)] + [("nodes", n) for n in nodes],
                  Options(driver=DEFAULT_DRIVER_NAME, default_config="plain"))
    out = {}
    for name, text in output_files(res, Options(driver=DEFAULT_DRIVER_NAME)).items():
        if name.startswith("values-"):
            (tmp_path / name).write_text(text)
            release = yaml.safe_load(text)["fullnameOverride"]
            out[release] = render("-f", str(tmp_path / name), release=release)
    return out


def test_one_release_per_node_group_installs_side_by_side(tmp_path: Path) -> None:
    releases = _releases(tmp_path)
    assert sorted(releases) == ["gpu-dra-plain-all-1g-10gb", "gpu-dra-ts"]
    seen: dict[tuple[str, str | None, str], str] = {}
    for release, objs in releases.items():
        for o in objs:
            key = (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
            assert key not in seen, f"{key} in {release} and {seen[key]}"
            seen[key] = release
    kinds = {r: {o["kind"] for o in objs} for r, objs in releases.items()}
    first, second = list(releases)
    assert "DeviceClass" in kinds[first] and "Deployment" in kinds[first]
    assert "DeviceClass" not in kinds[second] and "Deployment" not in kinds[second]
    for objs in releases.values():
        (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
        terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms[0]["matchExpressions"][0]["key"] == "nvidia.com/device-plugin.config"


def test_each_plugin_gets_its_groups_node_policy(tmp_path: Path) -> None:
    for release, objs in _releases(tmp_path).items():
        text = "\n".join(v for o in objs if o["kind"] == "ConfigMap" for k, v in (o.get("data") or {}).items()
                         if k == "node-policy.yaml")
        policy = yaml.safe_load(text)
        expected = ({"default": {"wholeGpu": False, "slots": {"count": 10, "strategy": "time-slicing"}}}
                    if release == "gpu-dra-ts" else {"default": {"wholeGpu": False, "mig": "static"}})
        assert policy == expected, (release, policy)
