"""The showcase (examples/showcase-stable-diffusion): its manifests pass the real API server's validation
(server-side dry run), and its Deployment's two replicas run on the real node with the CUDA stand-in in place of
the model, each on its own MPS slot of one GPU, with the claim's thread percentage and pinned-memory limit.

Made runnable here (testbed.podprobe.for_local_node): the cuda-probe image and probe script instead of the app's
image, the app's SD_STANDIN=cuda-probe switch set, and without the readiness probe (no web server in the probe
image), the container port (the probe pods use the host's network, where two replicas cannot both have it) and
the CPU and memory requests (sized for the model, more than this machine may have).
"""
from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from realnode_helpers import EXAMPLES, RealNode
from test_convert_migration import runnable
from test_realnode_examples import MPS_PIPE, check_cuda_view, expected_view, parents_of

from api.names import DEFAULT_DRIVER_NAME
from testbed.nodeplugin import LocalNodePlugin
from testbed.podprobe import probe_marker

pytestmark = pytest.mark.e2e

SHOWCASE = EXAMPLES / "showcase-stable-diffusion" / "manifests"


def manifests() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for p in sorted(SHOWCASE.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d}


@pytest.fixture(scope="module")
def real() -> Iterator[RealNode]:
    with RealNode().running() as node:
        yield node


@pytest.fixture(scope="module")
def ours(real: RealNode) -> LocalNodePlugin:
    return real.start_plugin(real.plugin(DEFAULT_DRIVER_NAME))


def test_manifests_pass_server_side_validation(real: RealNode, tmp_path: Path) -> None:
    assert real.cluster is not None
    real.namespace("showcase-dry-run")
    proc = real.cluster.kubectl("apply", "--dry-run=server", "-n", "showcase-dry-run", "-f", str(SHOWCASE))
    assert sorted(proc.stdout.split("\n"))[1:] == sorted([
        "resourceclaimtemplate.resource.k8s.io/sd-mps-slot created (server dry run)",
        "deployment.apps/stable-diffusion created (server dry run)",
        "service/stable-diffusion created (server dry run)"]), proc.stdout
    # The same check refuses a Deployment whose container names a claim the pod does not have.
    broken = copy.deepcopy(manifests()["Deployment"])
    broken["spec"]["template"]["spec"]["containers"][0]["resources"]["claims"] = [{"name": "other"}]
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
    proc = real.cluster.kubectl("apply", "--dry-run=server", "-n", "showcase-dry-run", "-f",
                                str(tmp_path / "broken.yaml"), check=False)
    assert proc.returncode != 0 and "other" in proc.stderr, proc.stderr


def _standin(deployment: dict[str, Any]) -> dict[str, Any]:
    out = runnable(deployment)
    for c in out["spec"]["template"]["spec"]["containers"]:
        c.pop("readinessProbe", None)
        c.pop("ports", None)   # with the host's network, two replicas would want the same host port
        c["resources"] = {"claims": c["resources"]["claims"]}
        c["env"] = [e for e in c.get("env") or [] if e["name"] != "SD_STANDIN"] + [
            {"name": "SD_STANDIN", "value": "cuda-probe"}]
    return out


def test_two_replicas_run_on_mps_slots_of_one_gpu(real: RealNode, ours: LocalNodePlugin) -> None:
    assert real.kube is not None
    ns = real.namespace("showcase")
    objs = manifests()
    real.kube.create(f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates",
                     objs["ResourceClaimTemplate"])
    real.kube.create(f"/api/v1/namespaces/{ns}/services", objs["Service"])
    real.kube.create(f"/apis/apps/v1/namespaces/{ns}/deployments", _standin(objs["Deployment"]))
    deadline = time.monotonic() + 60
    pods: list[dict[str, Any]] = []
    while time.monotonic() < deadline and len(pods) < 2:
        pods = real.kube.list(f"/api/v1/namespaces/{ns}/pods", label_selector="app=stable-diffusion")["items"]
        time.sleep(0.5)
    assert len(pods) == 2, [p["metadata"]["name"] for p in pods]
    published = real.devices(ours)
    slots = []
    for p in pods:
        name = p["metadata"]["name"]
        pod = real.wait_running(ns, name, timeout=90)
        results = real.claim_of(ns, pod, "gpu")["status"]["allocation"]["devices"]["results"]
        assert len(results) == 1, results
        slots.append(published[results[0]["device"]])
        # Exactly its GPU's device nodes and, through libcuda and NVML, that GPU; an MPS client of a daemon.
        view = real.view(ns, name, "web")
        nodes, visible, _ = expected_view(real, ours, results)
        assert view.devices == nodes and view.env.get("NVIDIA_VISIBLE_DEVICES") == visible, (view.devices, nodes)
        check_cuda_view(view, real.hardware(ours), visible.split(","), parents_of(published, results), name)
        env = view.env
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == MPS_PIPE and {"control"} <= set(view.pipe_entries), view
        # The probe's marker is named after the Deployment (the template has no pod name), in its own /dev/shm.
        assert view.wrote == [f"/dev/shm/{probe_marker('stable-diffusion', 'web')}"], view.wrote
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25", env
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=16384M", env
    assert [(s["type"], s["sharing"]) for s in slots] == [("slot", "mps")] * 2, slots
    assert slots[0]["parentUUID"] == slots[1]["parentUUID"], slots
    # One control daemon for the GPU, both replicas its clients, each with its own claim's limits (docs/mps.md).
    assert len(ours.mps_daemons()) == 1, ours.mps_daemons()
