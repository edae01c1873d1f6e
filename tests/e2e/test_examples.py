"""Every example folder on the real control plane: the pod's ResourceClaimTemplate becomes a claim (the
controller-manager), the scheduler allocates one of our devices from the demo fleet's slices, and the device
is what the example asks for. Also the demo itself: its steps on the shared cluster, and `gpu-dra demo`."""
from __future__ import annotations

import itertools
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from allocation_helpers import EXAMPLES, FLEETS, PublishedFleet, attr, renamed_fleet, temporary_namespace

from api.quantity import quantity_value
from cli.demo_cmd import DemoContext, prepare_one_claim, report, run_demo
from dra.sim.fleet import load_fleet
from kube.client import KubeApi
from testbed.demo_cdi import node_plugin_available
from testbed.demo_examples import (
    PodClaim,
    apply_objects,
    delete_namespace,
    load_example,
    load_examples,
    wait_for_allocation,
)

pytestmark = pytest.mark.e2e

DRIVER = "examples.e2e.dra-driver.io"
GI = 1 << 30
_namespaces = itertools.count(1)


@pytest.fixture(scope="module")
def demo_fleet(cluster: Any, api_client: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PublishedFleet]:
    doc = renamed_fleet(yaml.safe_load((FLEETS / "demo.yaml").read_text()), "ex")
    fleet = PublishedFleet(cluster, api_client, DRIVER, doc, tmp_path_factory.mktemp("examples")).publish()
    yield fleet
    fleet.remove()


Allocated = list[tuple[PodClaim, dict[str, Any], dict[str, Any]]]


def allocate(api_client: Any, fleet: PublishedFleet, example: str) -> Allocated:
    """Applies one example in a fresh namespace; returns (pod claim, allocation result, device) per result."""
    kube = KubeApi(api_client)
    ex = load_example(EXAMPLES / example, DRIVER)
    with temporary_namespace(api_client, f"ex-{next(_namespaces)}-{example}") as ns:
        apply_objects(kube, ex.objects, ns)
        state = wait_for_allocation(kube, [ex], ns, timeout=30)
        assert state.complete, [(c.pod, c.claim, c.node, c.allocation) for c in state.pending]
        devices = fleet.devices()
        out = []
        for c in state.claims:
            assert c.node in fleet.node_names
            for r in c.results:
                assert r["driver"] == DRIVER and r["pool"] == c.node
                out.append((c, r, devices[(DRIVER, r["pool"], r["device"])]))
    assert out, f"example {example}: no allocation results"
    return out


def only(results: Allocated) -> tuple[dict[str, Any], dict[str, Any]]:
    assert len(results) == 1, results
    _, result, device = results[0]
    return result, device


def check_gpu_by_family(results: Allocated) -> None:
    result, device = only(results)
    assert attr(device, "type") == "gpu" and attr(device, "family") == "hopper"
    assert result["device"] == device["name"] and device["name"].startswith("gpu-")


def check_mig_partition(results: Allocated) -> None:
    _, device = only(results)
    assert attr(device, "type") == "mig" and attr(device, "profile") == "1g.10gb"
    assert "-mig-1g10gb-" in device["name"]


def check_time_slicing_slot(results: Allocated) -> None:
    _, device = only(results)
    assert attr(device, "type") == "slot" and attr(device, "sharing") == "time-slicing"


def check_mps_slot(results: Allocated) -> None:
    _, device = only(results)
    assert attr(device, "type") == "slot" and attr(device, "sharing") == "mps"


def check_first_available(results: Allocated) -> None:
    result, device = only(results)
    assert result["request"] == "gpu/h100"      # the first alternative was satisfiable
    assert attr(device, "productName").startswith("NVIDIA H100")


def check_memory_share(results: Allocated) -> None:
    result, device = only(results)
    assert attr(device, "type") == "shared" and device.get("allowMultipleAllocations") is True
    assert quantity_value(result["consumedCapacity"]["memory"]) == 10 * GI
    assert result.get("shareID")


def check_cel_memory(results: Allocated) -> None:
    _, device = only(results)
    assert attr(device, "type") == "gpu"
    assert quantity_value(device["capacity"]["memory"]["value"]) >= 40 * GI


def check_shared_claim(results: Allocated) -> None:
    pods = {c.pod for c, _, _ in results}
    assert pods == {"shared-slot-a", "shared-slot-b"}
    claims = {c.claim for c, _, _ in results}
    nodes = {c.node for c, _, _ in results}
    devices = {r["device"] for _, r, _ in results}
    assert claims == {"shared-slot"} and len(nodes) == 1 and len(devices) == 1, (claims, nodes, devices)
    assert attr(results[0][2], "type") == "slot"


CHECKS: dict[str, Callable[[Allocated], None]] = {
    "gpu-by-family": check_gpu_by_family,
    "mig-partition": check_mig_partition,
    "time-slicing-slot": check_time_slicing_slot,
    "mps-slot": check_mps_slot,
    "first-available": check_first_available,
    "memory-share": check_memory_share,
    "cel-memory": check_cel_memory,
    "shared-claim": check_shared_claim,
}


def test_every_example_folder_has_a_check() -> None:
    assert {e.name for e in load_examples(EXAMPLES, DRIVER)} == set(CHECKS)


@pytest.mark.parametrize("example", sorted(CHECKS))
def test_example_is_allocated_as_intended(api_client: Any, demo_fleet: PublishedFleet, example: str) -> None:
    CHECKS[example](allocate(api_client, demo_fleet, example))


def test_first_available_falls_back_when_no_h100_is_free(cluster: Any, api_client: Any, tmp_path: Path) -> None:
    """Only L4s in the fleet: the first alternative cannot be satisfied, the second (≥ 20Gi) can."""
    driver = "fallback.e2e.dra-driver.io"
    doc = {"nodes": [{"name": "fb-l4", "gpus": [{"model": "L4", "count": 1}]}]}
    fleet = PublishedFleet(cluster, api_client, driver, doc, tmp_path).publish()
    try:
        kube = KubeApi(api_client)
        ex = load_example(EXAMPLES / "first-available", driver)
        with temporary_namespace(api_client, "ex-fallback") as ns:
            apply_objects(kube, ex.objects, ns)
            state = wait_for_allocation(kube, [ex], ns, timeout=30)
            assert state.complete, state.pending
            (result,) = state.claims[0].results
            assert result["request"] == "gpu/big" and result["device"] == "gpu-0"
    finally:
        fleet.remove()


# ------------------------------------------------------------------------------------------------ the demo

def _write_fleet(path: Path, prefix: str) -> Path:
    path.write_text(yaml.safe_dump(renamed_fleet(yaml.safe_load((FLEETS / "demo.yaml").read_text()), prefix)))
    return path


def test_demo_steps_allocate_prepare_and_report_unallocatable_claims(cluster: Any, api_client: Any,
                                                                      tmp_path: Path) -> None:
    """run_demo on the shared cluster: a MIG example and one asking for more memory than any GPU has."""
    driver = "demo.e2e.dra-driver.io"
    examples_dir = tmp_path / "examples"
    (examples_dir / "mig").mkdir(parents=True)
    (examples_dir / "mig" / "claim.yaml").write_text((EXAMPLES / "mig-partition" / "claim.yaml").read_text())
    (examples_dir / "too-big").mkdir()
    (examples_dir / "too-big" / "claim.yaml").write_text(
        (EXAMPLES / "cel-memory" / "claim.yaml").read_text().replace("quantity('40Gi')", "quantity('4000Gi')"))
    fleet_path = _write_fleet(tmp_path / "fleet.yaml", "dm")
    fleet = load_fleet(fleet_path)
    lines: list[str] = []
    ctx = DemoContext(cluster, api_client, fleet_path, driver, "demo-e2e", lines.append)
    try:
        result = run_demo(ctx, fleet, load_examples(examples_dir, driver), timeout=4,
                          prepared_claim_hook=prepare_one_claim)
        assert sum(result.first_writes.values()) == len(ctx.slices) > 0
        assert result.first_writes == {"create": len(ctx.slices)}
        assert result.restart_writes == {}
        assert f"mig.{driver}" in result.device_classes
        (pending,) = result.pending
        assert pending.startswith("too-big: claim gpu-40gi-gpu-") and "(not allocated)" in pending
        # explain's verdict on the failed claim, not the scheduler's "cannot allocate all claims"
        assert "pod gpu-40gi: gpu-dra explain claim/gpu-40gi-gpu-" in pending, pending
        assert "not allocatable" in pending and "cannot allocate all claims" not in pending, pending
        assert [c.example for c in result.claims if c.done] == ["mig"]
        # The prepare hook is not run while a claim is pending; run it on its own for the allocated one.
        prepared = prepare_one_claim(ctx, [c for c in result.claims if c.done])
        if node_plugin_available():
            assert prepared is not None and prepared.claim.example == "mig"
            assert "-mig-1g10gb-" in prepared.spec_text and "NVIDIA_VISIBLE_DEVICES=MIG-" in prepared.spec_text
            ids = prepared.cdi_device_ids
            assert ids and all(i.startswith(f"k8s.{driver}/claim=") for i in ids)
        else:
            assert prepared is None
        report(ctx, result)
        text = "\n".join(lines)
        assert "### Allocations (namespace demo-e2e)" in text and "1g.10gb" in text
        assert "restart with the same fleet (second controller instance): 0 API write(s)" in text
        assert "kubectl describe resourceslice dm-node-b-" in text and "more devices (" in text
    finally:
        for name in fleet.node_names:
            try:
                cluster.delete_node(name)
            except Exception:  # noqa: BLE001 - best effort
                pass
        delete_namespace(KubeApi(api_client), "demo-e2e")


def test_gpu_dra_demo_command_end_to_end(tmp_path: Path) -> None:
    """What `make demo` runs, with its own control plane and a real node for node-a and node-b: exit 0, every
    section of the output, every pod Running on the node the scheduler picked with what its container saw, the
    two pods of the shared claim on the same GPU, the machine left as found."""
    from testbed.hostplumbing import records_dir

    proc = subprocess.run([sys.executable, "-m", "cli.main", "demo"], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "==> no real node" not in out, out[:2000]
    for example in CHECKS:
        assert f"\n{example} " in out, example
    assert "### kubectl describe resourceslice node-b-gpu.dra-driver.io-0001" in out
    assert "String:  time-slicing" in out           # real kubectl describe output
    listing = out.split("### kubectl get resourceslices\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert {line.split()[1] for line in listing} == {"node-a", "node-b"}, listing
    # Each node's plugin publishes its own node's slices: the slice controller has nothing to write.
    assert "first start: 0 API write(s)" in out
    assert "restart with the same fleet (second controller instance): 0 API write(s)" in out

    # Each pod's phase in the table: Running, on both nodes.
    table = out.split("### Allocations (namespace gpu-demo)\n", 1)[1].split("\n\n", 1)[0].splitlines()
    header, rows = table[0], table[1:]
    phase, node = header.index("PHASE"), header.index("NODE")
    phases = {(r[node:].split()[0], r[phase:].split()[0]) for r in rows}
    assert phases == {("node-a", "Running"), ("node-b", "Running")}, rows
    saw = out.split("What each pod's container saw", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert len(saw) == len(rows), saw
    on_a = [line for line in saw if " on node-a: " in line]
    on_b = [line for line in saw if " on node-b: " in line]
    assert len(on_a) == sum(1 for r in rows if r[node:].startswith("node-a")), saw
    assert len(on_b) == sum(1 for r in rows if r[node:].startswith("node-b")) == 3, saw
    assert all(re.search(r" on node-[ab]: (/dev/nvidia\S+ )*/dev/nvidiactl; .*NVIDIA_VISIBLE_DEVICES=(GPU|MIG)-", line)
               for line in saw), saw
    assert any("/dev/nvidia-caps/nvidia-cap" in line and "=MIG-" in line for line in on_a), on_a
    assert any("CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in line for line in on_a), on_a
    # What cuda-probe saw through libcuda: each pod's own GPU or MIG device, with its memory (an L4 on node-b).
    assert all(re.search(r"; cuda: 1 device (GPU|MIG)-[0-9a-f-]{36}, \d+ MiB$", line) for line in saw), saw
    assert all(line.endswith(", 23034 MiB") for line in on_b), on_b
    # The two pods of the shared claim: the same GPU, and the demo says so.
    uuids = {line.strip().split("/", 1)[0]: line.rsplit("cuda: 1 device ", 1)[1].split(",")[0] for line in on_b}
    assert uuids["shared-slot-a"] == uuids["shared-slot-b"], on_b
    assert (f"claim shared-slot is shared by pods shared-slot-a and shared-slot-b on node-b: they see the same GPU "
            f"{uuids['shared-slot-a']}") in out
    assert "(mig-partition; prepared by the kubelet)" in out and '"NVIDIA_VISIBLE_DEVICES=MIG-' in out
    assert "### gpu-dra status node-a" in out and "### gpu-dra status node-b" in out
    assert "==> stopping the real nodes node-a, node-b" in out and "==> stopping the control plane" in out
    assert out.rstrip().endswith(f"==> every example pod is Running ({len(on_a)} on node-a, 3 on node-b)"), out[-500:]
    assert not list(records_dir().glob("*.json")), "a real node left its record: something was not cleaned"


def test_gpu_dra_demo_with_one_real_node(tmp_path: Path) -> None:
    """`--real-nodes 1` (a small machine): node-a runs, node-b's pods stay Pending and the demo says why; that
    is what was asked for, so it exits 0."""
    proc = subprocess.run([sys.executable, "-m", "cli.main", "demo", "--real-nodes", "1", "--no-prepare"],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "==> registering 1 simulated node(s) without a kubelet: node-b" in out
    assert "(pods on node-b stay Pending: no kubelet there)" in out
    saw = out.split("What each pod's container saw", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert sorted(line.split(":")[0].strip() for line in saw if "which has no kubelet: not started" in line) == [
        "shared-slot-a", "shared-slot-b", "ts-slot"], saw
    assert out.rstrip().endswith("==> 3 of 9 example pod(s) not Running: shared-slot-a, shared-slot-b, ts-slot; "
                                 "node-b has no kubelet"), out[-500:]
