"""Unit tests of the demo's parts that need no cluster: loading examples for any driver name, pairing pods
with claims, the scheduler's reason, the printed table (with pod phases) and describe cut, what the containers
saw (the probe script, its output read back, pods made runnable on a local node), whether the pods of a shared
claim saw the same GPU, which fleet nodes run for real, the one line when a real node cannot start, and
argument checks."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml
from claims import resource_claim

from api.names import CONFIG_API_VERSION, DEFAULT_DRIVER_NAME
from cli import demo_cmd
from cli.main import build_parser
from testbed.demo_cdi import pick_claim
from testbed.demo_examples import (
    ExampleError,
    PodClaim,
    allocation_state,
    describe_pending,
    load_example,
    load_examples,
    retarget_driver,
    scheduler_reason,
)
from testbed.demo_node import PodRun, RealNodeUnavailable, start_real_nodes
from testbed.demo_report import (
    allocation_rows,
    closing_line,
    container_lines,
    device_index,
    format_table,
    format_writes,
    shared_claims,
    trim_describe,
)
from testbed.podprobe import (
    BEGIN,
    END,
    ContainerView,
    SeenDevice,
    for_local_node,
    parse_probe,
    probe_marker,
    probe_script,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


# ------------------------------------------------------------------------------------------------ examples

def test_the_repository_examples_load_and_each_has_a_pod() -> None:
    examples = load_examples(EXAMPLES)
    folders = sorted(d.name for d in EXAMPLES.iterdir() if (d / "claim.yaml").is_file())
    assert [e.name for e in examples] == folders and len(folders) >= 8
    assert all(e.pods for e in examples)


def test_retargeting_renames_the_driver_but_not_our_config_api_version() -> None:
    text = (EXAMPLES / "mps-slot" / "claim.yaml").read_text()
    assert retarget_driver(text, DEFAULT_DRIVER_NAME) == text
    moved = retarget_driver(text, "t1.example.com")
    doc = next(yaml.safe_load_all(moved))
    request = doc["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert request["deviceClassName"] == "slot.t1.example.com"
    assert request["selectors"][0]["cel"]["expression"] == "device.attributes['t1.example.com'].sharing == 'mps'"
    opaque = doc["spec"]["spec"]["devices"]["config"][0]["opaque"]
    assert opaque["driver"] == "t1.example.com"
    assert opaque["parameters"]["apiVersion"] == CONFIG_API_VERSION
    assert DEFAULT_DRIVER_NAME not in moved.replace(CONFIG_API_VERSION, "")


def test_retargeted_capacity_selectors_use_the_new_domain() -> None:
    ex = load_example(EXAMPLES / "cel-memory", "t2.example.com")
    template = ex.objects[0]
    cel = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]["expression"]
    assert cel.startswith("device.capacity['t2.example.com'].memory")


@pytest.mark.parametrize("content, message", [
    ("a: [", "not valid YAML"),
    ("", "no objects"),
    ("- 1\n- 2\n", "document 1: must be a mapping"),
    ("kind: Deployment\nmetadata: {name: x}\n", "kind 'Deployment' is not supported"),
    ("kind: Pod\nmetadata: {}\n", "Pod without metadata.name"),
    ("kind: ResourceClaim\nmetadata: {name: c}\n", "no Pod"),
    ("kind: Pod\nmetadata: {name: p}\nspec: " + "[" * 5000 + "]" * 5000 + "\n", "line 3, column 70: nested deeper than 64 levels"),
    (b"kind: Pod\nmetadata: {name: \xff}\n", "not UTF-8: line 2"),
])
def test_bad_example_files_are_named_with_the_reason(tmp_path: Path, content: str | bytes, message: str) -> None:
    (tmp_path / "bad").mkdir()
    claim = tmp_path / "bad" / "claim.yaml"
    claim.write_bytes(content) if isinstance(content, bytes) else claim.write_text(content)
    with pytest.raises(ExampleError) as err:
        load_example(tmp_path / "bad")
    assert str(tmp_path / "bad" / "claim.yaml") in str(err.value) and message in str(err.value)


def test_a_folder_without_examples_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ExampleError, match="no sub-folder with a claim.yaml"):
        load_examples(tmp_path)
    with pytest.raises(ExampleError, match="not a directory"):
        load_examples(tmp_path / "missing")


# ------------------------------------------------------------------------------------------- pods and claims

class FakeKube:
    """Answers list/get like KubeApi from fixed objects."""

    def __init__(self, pods: list[dict[str, Any]], claims: list[dict[str, Any]],
                 events: list[dict[str, Any]] | None = None) -> None:
        self.pods, self.claims, self.events = pods, claims, events or []

    def list(self, path: str, field_selector: str | None = None, label_selector: str | None = None) -> dict[str, Any]:
        if path.endswith("/pods"):
            return {"items": self.pods}
        if path.endswith("/resourceclaims"):
            return {"items": self.claims}
        if path.endswith("/events"):
            name = (field_selector or "").rsplit("involvedObject.name=", 1)[-1]
            return {"items": [e for e in self.events if e["involvedObject"]["name"] == name]}
        raise AssertionError(path)

    def get(self, path: str) -> dict[str, Any]:
        name = path.rsplit("/", 1)[-1]
        return next(p for p in self.pods if p["metadata"]["name"] == name)


def _pod(name: str, node: str | None = None, statuses: dict[str, str] | None = None,
         condition: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"nodeName": node} if node else {},
            "status": {"resourceClaimStatuses": [{"name": k, "resourceClaimName": v}
                                                 for k, v in (statuses or {}).items()],
                       "conditions": [condition] if condition else []}}


def _claim(name: str, devices: list[str] | None = None, uid: str = "u") -> dict[str, Any]:
    results = None if devices is None else [{"request": "r", "driver": "d", "pool": "n1", "device": d} for d in devices]
    return resource_claim(name, None, uid=uid, results=results, typed=False)


def test_pods_are_paired_with_generated_and_named_claims() -> None:
    examples = load_examples(EXAMPLES)
    by_name = {e.name: e for e in examples}
    chosen = [by_name["mig-partition"], by_name["shared-claim"]]
    kube = FakeKube(
        pods=[_pod("mig-1g10gb", "n1", {"mig": "mig-1g10gb-mig-abcde"}), _pod("shared-slot-a", "n1"),
              _pod("shared-slot-b")],
        claims=[_claim("mig-1g10gb-mig-abcde", ["gpu-0-mig-1g10gb-19-6"]), _claim("shared-slot", ["gpu-0-slot-0"])])
    state = allocation_state(kube, chosen, "ns")   # type: ignore[arg-type]
    assert [(c.pod, c.claim, c.node) for c in state.claims] == [
        ("mig-1g10gb", "mig-1g10gb-mig-abcde", "n1"), ("shared-slot-a", "shared-slot", "n1"),
        ("shared-slot-b", "shared-slot", None)]
    assert not state.complete and [c.pod for c in state.pending] == ["shared-slot-b"]


def test_a_claim_not_created_yet_is_pending() -> None:
    ex = load_example(EXAMPLES / "gpu-by-family")
    state = allocation_state(FakeKube([_pod("hopper-gpu")], []), [ex], "ns")   # type: ignore[arg-type]
    (c,) = state.claims
    assert c.claim is None and not c.done and not state.complete


def test_the_scheduler_reason_combines_condition_and_new_event_text() -> None:
    cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/2 nodes are available: 2 cannot allocate all claims."}
    events = [
        {"involvedObject": {"name": "p"}, "type": "Warning", "reason": "FailedScheduling",
         "message": "0/2 nodes are available: 2 cannot allocate all claims.", "lastTimestamp": "2026-01-01T00:00:01Z"},
        {"involvedObject": {"name": "p"}, "type": "Normal", "reason": "Other", "message": "ignored",
         "lastTimestamp": "2026-01-01T00:00:02Z"},
    ]
    kube = FakeKube([_pod("p", condition=cond)], [], events)
    reason = scheduler_reason(kube, "ns", "p")  # type: ignore[arg-type]
    assert reason == "Unschedulable: 0/2 nodes are available: 2 cannot allocate all claims."
    events.append({"involvedObject": {"name": "p"}, "type": "Warning", "reason": "FailedScheduling",
                   "message": "resourceclaim not found", "lastTimestamp": "2026-01-01T00:00:03Z"})
    reason = scheduler_reason(kube, "ns", "p")  # type: ignore[arg-type]
    assert reason.endswith("; event FailedScheduling: resourceclaim not found")
    quiet = FakeKube([_pod("q")], [])
    assert "has not reported" in scheduler_reason(quiet, "ns", "q")  # type: ignore[arg-type]


def test_pending_lines_name_example_claim_pod_and_reason() -> None:
    ex = load_example(EXAMPLES / "cel-memory")
    cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "no GPU that big"}
    kube = FakeKube([_pod("gpu-40gi", None, {"gpu": "gpu-40gi-gpu-xyz"}, cond)], [_claim("gpu-40gi-gpu-xyz")])
    state = allocation_state(kube, [ex], "ns")   # type: ignore[arg-type]
    from ops.explain.verdict import ALLOCATABLE, Explanation

    def allocatable(_kube: Any, target: str, _ns: str) -> Explanation:   # explain sees no reason: the scheduler's
        return Explanation(ALLOCATABLE, "allocatable on node n1", [target])

    assert describe_pending(kube, state, "ns", allocatable) == [   # type: ignore[arg-type]
        "cel-memory: claim gpu-40gi-gpu-xyz (not allocated), pod gpu-40gi: Unschedulable: no GPU that big"]


def test_a_claim_not_allocated_is_explained_by_explains_verdict() -> None:
    """The demo's failure line carries `gpu-dra explain`'s verdict on the failed claim, not the scheduler's
    "cannot allocate all claims"; where explain cannot evaluate, the scheduler's reason and why."""
    from ops.explain.reads import ExplainTargetError
    from ops.explain.verdict import NOT_ALLOCATABLE, Explanation

    ex = load_example(EXAMPLES / "cel-memory")
    cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/2 nodes are available: 2 cannot allocate all claims."}
    kube = FakeKube([_pod("gpu-40gi", None, {"gpu": "gpu-40gi-gpu-xyz"}, cond)], [_claim("gpu-40gi-gpu-xyz")])
    state = allocation_state(kube, [ex], "ns")   # type: ignore[arg-type]
    asked: list[tuple[str, str]] = []

    def explain(_kube: Any, target: str, namespace: str) -> Explanation:
        asked.append((target, namespace))
        return Explanation(NOT_ALLOCATABLE, "not allocatable on any node: no device has 40Gi of memory", [target])

    assert describe_pending(kube, state, "ns", explain) == [   # type: ignore[arg-type]
        "cel-memory: claim gpu-40gi-gpu-xyz (not allocated), pod gpu-40gi: gpu-dra explain claim/gpu-40gi-gpu-xyz: "
        "not allocatable on any node: no device has 40Gi of memory"]
    assert asked == [("claim/gpu-40gi-gpu-xyz", "ns")]

    def cannot(_kube: Any, target: str, namespace: str) -> Explanation:
        raise ExplainTargetError(f"no claim named x in namespace {namespace}")

    (line,) = describe_pending(kube, state, "ns", cannot)   # type: ignore[arg-type]
    assert line.endswith("Unschedulable: 0/2 nodes are available: 2 cannot allocate all claims. (gpu-dra explain "
                         "claim/gpu-40gi-gpu-xyz: no claim named x in namespace ns)"), line


# ------------------------------------------------------------------------------------------------ report

def _device(name: str, kind: str, memory: str, **attrs: str) -> dict[str, Any]:
    attributes = {"type": {"string": kind}, "productName": {"string": "NVIDIA H100 80GB HBM3"}}
    attributes.update({k: {"string": v} for k, v in attrs.items()})
    return {"name": name, "attributes": attributes, "capacity": {"memory": {"value": memory}}}


SLICES = [{"spec": {"driver": "d", "pool": {"name": "n1"}, "devices": [
    _device("gpu-0", "gpu", "80Gi", sharing="none"),
    _device("gpu-1-mig-1g10gb-19-6", "mig", "9984Mi", profile="1g.10gb", sharing="none"),
    _device("gpu-2-slot-0", "slot", "20Gi", sharing="mps"),
    _device("gpu-3-shared", "shared", "80Gi", sharing="mps"),
]}}]


def _pc(example: str, device: str, **extra: Any) -> PodClaim:
    result = {"request": "r", "driver": "d", "pool": "n1", "device": device, **extra}
    return PodClaim(example, f"{example}-pod", "x", f"{example}-claim", "n1",
                    {"devices": {"results": [result]}}, uid=f"uid-{example}")


def test_allocation_rows_show_type_profile_sharing_and_consumed_memory() -> None:
    claims = [_pc("whole", "gpu-0"), _pc("mig", "gpu-1-mig-1g10gb-19-6"), _pc("slot", "gpu-2-slot-0"),
              _pc("share", "gpu-3-shared", consumedCapacity={"memory": "10Gi"}, shareID="s"),
              _pc("gone", "gpu-9"), PodClaim("pending", "p", "x", None, None, None)]
    rows = allocation_rows(claims, SLICES)
    got = [(r.example, r.device_type, r.detail, r.memory) for r in rows]
    assert got == [("whole", "gpu", "-", "80Gi"), ("mig", "mig", "1g.10gb", "9984Mi"), ("slot", "slot", "mps", "20Gi"),
                   ("share", "shared", "mps", "10Gi of 80Gi"), ("gone", "?", "-", "-")]
    table = format_table(rows).splitlines()
    assert table[0].split() == ["EXAMPLE", "POD", "PHASE", "CLAIM", "REQUEST", "NODE", "DEVICE", "TYPE",
                                "PROFILE/SHARING", "MEMORY", "PRODUCT"]
    assert len(table) == 6
    column = table[0].index("DEVICE")
    assert [line[column:].split()[0] for line in table[1:]] == [r.device for r in rows]


def test_allocation_rows_carry_each_pods_phase() -> None:
    rows = allocation_rows([_pc("whole", "gpu-0"), _pc("mig", "gpu-1-mig-1g10gb-19-6")], SLICES,
                           {"whole-pod": "Running"})
    assert [(r.pod, r.phase) for r in rows] == [("whole-pod", "Running"), ("mig-pod", "-")]
    header, first, second = format_table(rows).splitlines()
    column = header.index("PHASE")
    assert first[column:].split()[0] == "Running" and second[column:].split()[0] == "-"


def test_container_lines_say_what_each_container_saw_or_why_nothing() -> None:
    seen = ContainerView(devices={"/dev/nvidiactl": (195, 255), "/dev/nvidia3": (195, 3)},
                         env={"NVIDIA_VISIBLE_DEVICES": "GPU-1"}, complete=True)
    pods = {
        "a": PodRun("Running", "node-a", {"cuda": seen}),
        "b": PodRun("Running", "node-a", {"x": seen, "y": ContainerView()}),
        "c": PodRun("Pending", "node-b"),
        "d": PodRun("Pending", None),
        "e": PodRun("Pending", "node-a"),
    }
    assert container_lines(pods, ["node-a"]) == [
        "a/cuda on node-a: /dev/nvidia3 /dev/nvidiactl; NVIDIA_VISIBLE_DEVICES=GPU-1",
        "b/x on node-a: /dev/nvidia3 /dev/nvidiactl; NVIDIA_VISIBLE_DEVICES=GPU-1",
        "b/y on node-a: (its output is not complete yet)",
        "c: on node-b, which has no kubelet: not started",
        "d: not bound to a node",
        "e: Pending on node-a, its container has printed nothing yet",
    ]


def _saw(*uuids: str) -> ContainerView:
    return ContainerView(cuda=[SeenDevice(u, 23034, "NVIDIA L4") for u in uuids], probed=True, complete=True)


def _shared_pc(pod: str, claim: str, node: str = "node-b") -> PodClaim:
    return PodClaim("shared-claim", pod, "slot", claim, node, {"devices": {"results": []}})


def test_the_pods_of_a_shared_claim_are_said_to_see_the_same_gpu_or_not() -> None:
    claims = [_shared_pc("a", "shared"), _shared_pc("b", "shared"), _shared_pc("c", "own")]
    same = {"a": PodRun("Running", "node-b", {"cuda": _saw("GPU-1")}),
            "b": PodRun("Running", "node-b", {"cuda": _saw("GPU-1")}),
            "c": PodRun("Running", "node-b", {"cuda": _saw("GPU-2")})}
    (shared,) = shared_claims(claims, same)
    assert shared.same_gpu
    assert shared.line() == "claim shared is shared by pods a and b on node-b: they see the same GPU GPU-1"
    other = {**same, "b": PodRun("Running", "node-b", {"cuda": _saw("GPU-2")})}
    (shared,) = shared_claims(claims, other)
    assert not shared.same_gpu
    assert shared.line() == ("claim shared is shared by pods a and b on node-b, but they do NOT see the same GPU: "
                             "a sees GPU-1; b sees GPU-2")
    # Neither pod saw any GPU: not "the same".
    blind = {**same, "a": PodRun("Running", "node-b", {"cuda": _saw()}),
             "b": PodRun("Running", "node-b", {"cuda": _saw()})}
    assert not shared_claims(claims, blind)[0].same_gpu
    # A pod that did not run (no kubelet on its node) has nothing to compare.
    assert shared_claims(claims, {**same, "b": PodRun("Pending", "node-b")}) == []


def test_the_closing_line_says_where_the_pods_run_or_which_do_not() -> None:
    running = {"a": PodRun("Running", "node-a"), "b": PodRun("Running", "node-b"), "c": PodRun("Running", "node-a")}
    assert closing_line(running, ["node-a", "node-b"]) == "every example pod is Running (2 on node-a, 1 on node-b)"
    idle = {**running, "b": PodRun("Pending", "node-b")}
    assert closing_line(idle, ["node-a"]) == "1 of 3 example pod(s) not Running: b; node-b has no kubelet"
    assert closing_line(idle, ["node-a", "node-b"]) == "1 of 3 example pod(s) not Running: b"


# ------------------------------------------------------------------------------------------ the pod probe

PROBE_OUTPUT = f"""\
{BEGIN}
dev /dev/nvidia0 c3 0
dev /dev/nvidia-caps/nvidia-cap1208 ea 4b8
dev /dev/nvidiactl c3 ff
env CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps
env NVIDIA_VISIBLE_DEVICES=MIG-1=2
mount /tmp/nvidia-mps /var/lib/x/pipe
mount /dev/shm /var/lib/x/shm
wrote /tmp/nvidia-mps/probe-p-cuda
{END}
"""


def test_the_probe_output_is_read_back() -> None:
    view = parse_probe("noise before\n" + PROBE_OUTPUT)
    assert view.complete
    assert view.devices == {"/dev/nvidia0": (195, 0), "/dev/nvidia-caps/nvidia-cap1208": (234, 1208),
                            "/dev/nvidiactl": (195, 255)}
    assert view.env == {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps", "NVIDIA_VISIBLE_DEVICES": "MIG-1=2"}
    assert view.mounts == {"/tmp/nvidia-mps": "/var/lib/x/pipe", "/dev/shm": "/var/lib/x/shm"}
    assert view.wrote == ["/tmp/nvidia-mps/probe-p-cuda"]
    assert view.summary() == ("/dev/nvidia-caps/nvidia-cap1208 /dev/nvidia0 /dev/nvidiactl; "
                              "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps NVIDIA_VISIBLE_DEVICES=MIG-1=2")
    # A restarted container prints again: the last run counts; an unfinished run is not complete.
    assert parse_probe(PROBE_OUTPUT + f"{BEGIN}\ndev /dev/nvidia1 c3 1\n").devices == {"/dev/nvidia1": (195, 1)}
    assert not parse_probe(PROBE_OUTPUT.replace(END, "")).complete
    assert parse_probe("no probe here") == ContainerView()


def test_the_probe_script_runs_in_a_posix_shell(tmp_path: Path) -> None:
    """The script itself (here without NVIDIA devices or MPS): it reports its environment and finishes; its
    final sleep is a stand-in that returns at once."""
    import os
    import shutil
    import subprocess

    (tmp_path / "sleep").write_text("#!/bin/sh\necho slept $1\n")
    (tmp_path / "sleep").chmod(0o755)
    path = f"{tmp_path}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    sh = shutil.which("sh")
    assert sh is not None
    done = subprocess.run([sh, "-c", probe_script("p", "cuda")], capture_output=True, text=True, timeout=30,
                          env={"PATH": path, "NVIDIA_VISIBLE_DEVICES": "GPU-7", "CUDA_VISIBLE_DEVICES": "0",
                               "OTHER": "x"})
    assert done.returncode == 0, done.stderr
    view = parse_probe(done.stdout)
    assert view.complete and view.env == {"NVIDIA_VISIBLE_DEVICES": "GPU-7", "CUDA_VISIBLE_DEVICES": "0"}
    assert done.stdout.rstrip().endswith("slept 86400")
    assert probe_marker("p", "cuda") in probe_script("p", "cuda")


def test_example_pods_are_made_runnable_on_a_local_node() -> None:
    pod = load_example(EXAMPLES / "shared-claim").pods[0]
    local = for_local_node(pod, "registry.local/busybox:1", "node-a")
    spec, container = local["spec"], local["spec"]["containers"][0]
    assert spec["hostNetwork"] is True and spec["terminationGracePeriodSeconds"] == 1
    assert spec["nodeSelector"] == {"kubernetes.io/hostname": "node-a"}
    assert (container["image"], container["imagePullPolicy"]) == ("registry.local/busybox:1", "Never")
    assert container["command"] == ["sh", "-c", probe_script("shared-slot-a", "cuda")]
    # What allocation and preparation depend on is unchanged, and the example itself is untouched.
    assert spec["resourceClaims"] == pod["spec"]["resourceClaims"]
    assert container["resources"] == pod["spec"]["containers"][0]["resources"]
    assert spec["restartPolicy"] == pod["spec"]["restartPolicy"]
    assert pod["spec"]["containers"][0]["image"].startswith("nvcr.io/") and "hostNetwork" not in pod["spec"]
    assert "nodeSelector" not in for_local_node(pod, "img")["spec"]


def test_pick_claim_prefers_a_mig_partition() -> None:
    index = device_index(SLICES)
    whole, mig = _pc("whole", "gpu-0"), _pc("mig", "gpu-1-mig-1g10gb-19-6")
    assert pick_claim([whole, mig], index, "d") is mig
    assert pick_claim([whole], index, "d") is whole
    assert pick_claim([PodClaim("p", "p", "x", None, None, None)], index, "d") is None


DESCRIBE = """\
Name:         node-b-gpu.dra-driver.io-0001
Kind:         ResourceSlice
Spec:
  Devices:
    Attributes:
      Type:
        String:  gpu
    Capacity:
      Memory:
        Value:  23034Mi
    Name:         gpu-0
    Attributes:
      Type:
        String:  slot
    Name:         gpu-0-slot-0
    Attributes:
      Type:
        String:  slot
    Name:         gpu-0-slot-1
    Attributes:
      Type:
        String:  gpu
    Name:         gpu-1
  Driver:         gpu.dra-driver.io
  Node Name:      node-b
Events:                    <none>"""


def test_trim_describe_keeps_the_first_devices_and_everything_around_them() -> None:
    trimmed = trim_describe(DESCRIBE, keep_devices=2).splitlines()
    assert trimmed[:15] == DESCRIBE.splitlines()[:15]
    assert trimmed[15] == "    ... 2 more devices (gpu-0-slot-1, gpu-1) left out here ..."
    assert trimmed[16:] == DESCRIBE.splitlines()[-3:]
    assert trim_describe(DESCRIBE, keep_devices=4) == DESCRIBE
    no_devices = "Name: x\nSpec:\n  Shared Counters:\n    Name: c"
    assert trim_describe(no_devices) == no_devices


def test_format_writes() -> None:
    assert format_writes("first start", {"create": 7}) == "first start: 7 API write(s) (create 7)"
    assert format_writes("restart", {}) == "restart: 0 API write(s)"


# ------------------------------------------------------------------------------------------------ command

def _args(tmp_path: Path, **over: Any) -> argparse.Namespace:
    args = build_parser().parse_args(["demo"])
    for k, v in over.items():
        setattr(args, k, v)
    return args


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    from testbed import localcluster

    def refuse(self: Any) -> None:
        raise AssertionError("bad input must be reported before the control plane starts")

    monkeypatch.setattr(localcluster.LocalCluster, "start", refuse)


def test_the_demo_defaults_are_the_repository_fleet_and_examples() -> None:
    args = build_parser().parse_args(["demo"])
    assert Path(args.fleet) == EXAMPLES / "fleets" / "demo.yaml" and Path(args.examples) == EXAMPLES
    assert args.driver_name == DEFAULT_DRIVER_NAME and not args.keep and args.namespace == "gpu-demo"
    assert args.real_node is None and not args.no_real_node   # a real node for every node of the fleet
    assert args.real_nodes is None


@pytest.mark.parametrize("named, count, want", [
    ([], None, ["node-a", "node-b", "node-c"]),     # as many as the fleet has
    ([], 1, ["node-a"]),
    ([], 0, []),                                      # --real-nodes 0 / --no-real-node: scheduling only
    (["node-b"], None, ["node-b"]),                   # --real-node alone: that node
    (["node-c"], 2, ["node-c", "node-a"]),
    (["node-b", "node-a"], None, ["node-b", "node-a"]),
])
def test_which_fleet_nodes_run_for_real(named: list[str], count: int | None, want: list[str]) -> None:
    assert demo_cmd.real_node_names(["node-a", "node-b", "node-c"], named, count, "f.yaml") == want


def test_a_small_machine_runs_one_real_node_unless_asked_for_more() -> None:
    args = build_parser().parse_args(["demo"])
    lines: list[str] = []
    assert demo_cmd.small_machine_cap(["node-a", "node-b"], args, 8192, lines.append) == ["node-a", "node-b"]
    assert lines == []
    assert demo_cmd.small_machine_cap(["node-a", "node-b"], args, 2000, lines.append) == ["node-a"]
    assert lines == [f"==> one real node (node-a): this machine has 2000 MiB of memory available, under "
                     f"{demo_cmd.SMALL_MACHINE_MIB} MiB; --real-nodes 2 runs all of them"]
    asked = build_parser().parse_args(["demo", "--real-nodes", "2"])
    assert demo_cmd.small_machine_cap(["node-a", "node-b"], asked, 2000, lines.append) == ["node-a", "node-b"]


def test_without_a_real_node_the_demo_says_why_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Here: not root. LocalNode refuses before it touches the cluster or the host."""
    import os

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    lines: list[str] = []
    assert demo_cmd.start_real_nodes(object(), ["node-a", "node-b"], lines.append) == ([], [])
    assert lines[0].startswith("==> starting a real node for node-a, node-b")
    assert lines[1:] == ["==> no real node (a real node needs root (containerd, runc and the kubelet mount and make "
                         "cgroups)): scheduling only, the pods will stay Pending"]


class _Started:
    def __init__(self, name: str) -> None:
        self.name = name
        self.node = type("N", (), {"times": {"kubelet": 1.25}})()


def test_when_a_second_node_cannot_start_the_demo_says_why_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def start(cluster: Any, name: str, labels: dict[str, str]) -> Any:
        if name == "node-b":
            raise RealNodeUnavailable("node node-b not Ready within 120s (last: kubelet /healthz not ok yet)")
        return _Started(name)

    from testbed import demo_node

    monkeypatch.setattr(demo_node.RealNode, "start", start)
    lines: list[str] = []
    reals, failed = demo_cmd.start_real_nodes(object(), ["node-a", "node-b"], lines.append)
    assert [r.name for r in reals] == ["node-a"]
    assert failed == ["node-b"]    # run() exits non-zero for it: node-b's pods stayed Pending
    assert lines[1:] == ["==> no real node for node-b (node node-b not Ready within 120s (last: kubelet /healthz "
                         "not ok yet)): its pods will stay Pending", "    node-a ready in 1.2s"]
    assert set(start_real_nodes(object(), ["node-a", "node-b"], {}, start)) == {"node-a", "node-b"}


@pytest.mark.parametrize("over, message", [
    ({"fleet": "/nonexistent/fleet.yaml"}, "fleet.yaml"),
    ({"examples": "/nonexistent"}, "/nonexistent: not a directory"),
    ({"driver_name": "Not_A_Name"}, "driver name 'Not_A_Name'"),
    ({"timeout": 0.0}, "--timeout 0.0: must be positive"),
    ({"describe_node": "node-z"}, "--describe-node node-z: not a node of"),
    ({"real_node": ["node-z"]}, "--real-node node-z: not a node of"),
    ({"real_nodes": 3}, "--real-nodes 3: must be between 0 and the fleet's 2 node(s)"),
    ({"real_nodes": -1}, "--real-nodes -1: must be between 0"),
])
def test_bad_arguments_exit_2_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      no_cluster: None, over: dict[str, Any], message: str) -> None:
    assert demo_cmd.run(_args(tmp_path, **over)) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu-dra demo: ") and message in err


class _KeptCluster:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.kubeconfig = workdir / "admin.kubeconfig"
        self.bin_dir = workdir / "bin"

    def component_pids(self) -> dict[str, int]:
        return {"etcd": 101, "kube-apiserver": 102}


def test_keep_prints_the_kubeconfig_and_writes_a_stop_script(tmp_path: Path) -> None:
    lines: list[str] = []
    demo_cmd._print_keep(_KeptCluster(tmp_path), "gpu-demo", lines.append)
    text = "\n".join(lines)
    script = (tmp_path / "stop.sh").read_text()
    assert f"kubeconfig:  {tmp_path / 'admin.kubeconfig'}" in text and f"sh {tmp_path / 'stop.sh'}" in text
    assert "for g in 102 101; do" in script and f"rm -rf '{tmp_path}'" in script


def test_the_stop_script_stops_process_groups_and_removes_the_work_dir(tmp_path: Path) -> None:
    import subprocess
    import threading
    import time

    workdir = tmp_path / "cluster"
    workdir.mkdir()
    procs = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2)]
    # Reap them as soon as they exit (after the demo, init does that), or they linger as zombies.
    reapers = [threading.Thread(target=p.wait, daemon=True) for p in procs]
    for t in reapers:
        t.start()
    try:
        script = tmp_path / "stop.sh"
        script.write_text(demo_cmd.stop_script({"a": procs[0].pid, "b": procs[1].pid}, workdir))
        started = time.monotonic()
        done = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert time.monotonic() - started < 5        # no wait for the SIGKILL round: SIGTERM was enough
        for t in reapers:
            t.join(timeout=5)
        assert [p.returncode for p in procs] == [-15, -15]
        assert not workdir.exists()
        again = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=30)
        assert again.returncode == 0 and again.stdout.strip() == "already stopped"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_a_fleet_policy_the_hardware_cannot_follow_exits_2_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_cluster: None) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"nodes": [{"name": "n", "gpus": [{"model": "L4"}],
                                                "policy": {"default": {"mig": "dynamic"}}}]}))
    assert demo_cmd.run(_args(tmp_path, fleet=str(fleet))) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu-dra demo: ") and "does not support MIG" in err
