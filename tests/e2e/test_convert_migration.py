"""`gpu-dra convert` on a cluster as it is today, applied to the real control plane and a real node.

The inputs are examples/migration/: the device plugin's config (every whole GPU time-sliced four ways, MIG
devices per profile), a mig-parted config (GPU 0: 2 x 1g.10gb + 3g.40gb, GPUs 1-3 without MIG), the GPU node's
labels and three workloads placed by GFD labels (a Deployment on a time-sliced share of a Hopper GPU, a Job on a
1g.10gb MIG device of compute capability 9, a StatefulSet on a 3g.40gb MIG device by product name). The node's
simulated GPUs get the MIG state the converted config names (what `nvidia-smi mig -cgi ... -C` would create), the
plugin the node group's node policy from the chart values. Each workload's pod then runs and its container sees
exactly the device the old setup gave it: same count, same sharing, same MIG profile.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from realnode_helpers import EXAMPLES, RealNode
from test_realnode_examples import check_pod

from api.names import DEFAULT_DRIVER_NAME
from cli.main import main
from kube.client import namespaced_collection
from ops.convert.conversion import EXIT_REFUSED
from testbed.localnode import cuda_probe_image
from testbed.podprobe import for_local_node

pytestmark = pytest.mark.e2e

INPUTS = [EXAMPLES / "migration" / n for n in
          ("device-plugin-configs.yaml", "mig-parted-config.yaml", "nodes.yaml", "workloads.yaml")]
# What each workload had on the device plugin: (type, sharing, MIG profile) of each device, and how many.
OLD = {
    "notebook": ("slot", "time-slicing", None, 1),
    "batch-infer": ("mig", "none", "1g.10gb", 1),
    "model-server": ("mig", "none", "3g.40gb", 1),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("converted")
    args = ["convert", "--output-dir", str(out)] + [a for p in INPUTS for a in ("-f", str(p))]
    # Exit status 4: device plugin flags without an equivalent here are refused (and only those).
    assert main(args) == EXIT_REFUSED
    refused = [line for line in (out / "report.txt").read_text().splitlines() if line.startswith("not-convertible")]
    assert refused and all(": flags." in line for line in refused), refused
    return out


@pytest.fixture(scope="module")
def real(converted: Path) -> Iterator[RealNode]:
    # The node keeps the labels administrators and the GPU operator set (GFD's go with GFD).
    labels = yaml.safe_load(INPUTS[2].read_text())["items"][0]["metadata"]["labels"]
    node = RealNode(labels={k: v for k, v in labels.items() if not k.startswith("nvidia.com/gpu.")
                            or k == "nvidia.com/gpu.present"}).start()
    try:
        assert node.fleet is not None and node.node is not None
        node.fleet.write_text(yaml.safe_dump({"nodes": [fleet_from(converted, node.node.name)]}, sort_keys=False))
        node.add_classes()
        yield node
    finally:
        node.stop()


def fleet_from(converted: Path, name: str) -> dict[str, Any]:
    """The real node's simulated GPUs in the MIG state of the node's mig-parted config, with its group's policy."""
    values = yaml.safe_load((converted / "values-time-sliced-inference-mixed.yaml").read_text())
    state = yaml.safe_load((converted / "mig-inference-mixed.yaml").read_text())
    mig_gpu, plain = state["gpus"]
    assert mig_gpu["devices"] == [0] and plain["devices"] == [1, 2, 3] and not plain["migEnabled"], state
    return {"name": name,
            "gpus": [{"model": "H100-80GB", "count": 1,
                      "mig": {"enabled": True, "instances": [{"profile": p} for p in mig_gpu["instances"]]}},
                     {"model": "H100-80GB", "count": 3}],
            "policy": values["nodePolicy"]}


def test_report_names_every_input_field(converted: Path) -> None:
    report = (converted / "report.txt").read_text()
    for field in ("sharing.timeSlicing.resources[0].replicas", "flags.migStrategy", "flags.failOnInitError",
                  "mig-configs.inference-mixed[0].mig-devices.1g.10gb", "nodeSelector.nvidia.com/gpu.family",
                  "matchExpressions[0]", "nodeSelector.nvidia.com/gpu.product"):
        assert field in report, field


def runnable(obj: dict[str, Any]) -> dict[str, Any]:
    """The workload with its pod template made runnable on the local node (the cuda-probe image)."""
    tpl = obj["spec"]["template"]
    pod = for_local_node({"metadata": {"name": obj["metadata"]["name"]}, "spec": tpl["spec"]}, cuda_probe_image())
    return {**obj, "spec": {**obj["spec"], "template": {**tpl, "spec": pod["spec"]}}}


def _pods_of(real: RealNode, ns: str, workload: str) -> list[dict[str, Any]]:
    assert real.kube is not None
    pods = real.kube.list(f"/api/v1/namespaces/{ns}/pods")["items"]
    return [p for p in pods if p["metadata"]["name"].startswith(workload + "-")]


def test_converted_workloads_get_what_the_device_plugin_gave_them(real: RealNode, converted: Path) -> None:
    assert real.kube is not None
    plugin = real.start_plugin(real.plugin(DEFAULT_DRIVER_NAME))
    published = real.devices(plugin)
    # The node policy published what the old node offered: GPU 0's three partitions, four slots on each other GPU.
    kinds = sorted((d["type"], d.get("profile") or d.get("sharing")) for d in published.values())
    assert kinds == sorted([("mig", "1g.10gb")] * 2 + [("mig", "3g.40gb")] + [("slot", "time-slicing")] * 12), kinds
    ns = real.namespace("migrated")
    objects = [o for o in yaml.safe_load_all((converted / "workloads.yaml").read_text()) if o]
    for obj in sorted(objects, key=lambda o: o["kind"] != "ResourceClaimTemplate"):
        if obj["kind"] != "ResourceClaimTemplate":
            obj = runnable(obj)
        real.kube.create(namespaced_collection(obj["kind"], ns),
                         {**obj, "metadata": {**obj["metadata"], "namespace": ns}})
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not all(_pods_of(real, ns, w) for w in OLD):
        time.sleep(0.5)
    for workload, (kind, sharing, profile, count) in OLD.items():
        pods = _pods_of(real, ns, workload)
        assert len(pods) == 1, f"{workload}: pods {[p['metadata']['name'] for p in pods]}"
        name = pods[0]["metadata"]["name"]
        pod = real.wait_running(ns, name, timeout=90)
        claim = real.claim_of(ns, pod, "gpus")
        results = claim["status"]["allocation"]["devices"]["results"]
        got = [(published[r["device"]]["type"], published[r["device"]]["sharing"],
                published[r["device"]].get("profile")) for r in results]
        assert got == [(kind, sharing, profile)] * count, (workload, got)
        check_pod(real, plugin, ns, name)   # the container saw exactly that device, through CDI and libcuda
