"""gpu-dra convert on NVIDIA's own published files: the GPU operator's default mig-parted ConfigMap and its
documentation's custom MIG config (copies in tests/ops/data, their origin named there), the device plugin README's
sharing configs and NVIDIA's sample workload (inline below). MIG configs convert per GPU model and per node,
checked against the catalog's geometry; the nvidia-smi commands run as written on simulated GPUs; workloads keep
the kubelet's and the device plugin's semantics; the report and exit status say what changed or was refused."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from api.names import DEFAULT_DRIVER_NAME as D
from cli.main import main
from dra.model.catalog import CATALOG
from dra.model.policy import parse_node_policy
from dra.sim.fakenvml import FakeNvml, SimulatedGpu
from ops.convert.conversion import EXIT_CHANGED, EXIT_REFUSED, Options, convert, output_files
from ops.convert.deviceplugin import ConvertError
from tests.support import nvidiasmi
from tests.support.gpu_fixtures import from_catalog

DATA = Path(__file__).parent / "data"
DEFAULT_CM = DATA / "gpu-operator-default-mig-parted-config.yaml"
CUSTOM_CM = DATA / "gpu-operator-custom-mig-config.yaml"
PRODUCT = {"H100-80GB": "NVIDIA-H100-80GB-HBM3", "A100-40GB": "NVIDIA-A100-SXM4-40GB",
           "A100-80GB": "NVIDIA-A100-SXM4-80GB", "H200-141GB": "NVIDIA-H200"}

# The device plugin README's time-slicing and MPS examples (renameByDefault as the README's variants set it).
TIME_SLICING = {"version": "v1", "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu",
                                                                            "replicas": 10}]}}}
MPS = {"version": "v1", "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 10}]}}}


def cm(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


def node(name: str, model: str, mig_config: str | None, count: int = 8, **labels: str) -> dict[str, Any]:
    lab = {"nvidia.com/gpu.product": PRODUCT[model], "nvidia.com/gpu.count": str(count), **labels}
    if mig_config:
        lab["nvidia.com/mig.config"] = mig_config
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": lab}}


def run(*docs: Any, **opts: Any) -> Any:
    return convert([(f"in{i}.yaml", d) for i, d in enumerate(docs)], Options(driver=D, **opts))


def vectoradd(name: str = "cuda-vectoradd", **resources: Any) -> dict[str, Any]:
    """NVIDIA's sample workload (the GPU operator's and device plugin's docs): CUDA vectorAdd on one GPU."""
    res = resources or {"limits": {"nvidia.com/gpu": 1}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "OnFailure", "containers": [
                {"name": "cuda-vectoradd", "image": "nvcr.io/nvidia/k8s/cuda-sample:vectoradd-cuda11.7.1-ubuntu20.04",
                 "resources": res}]}}


def refused(res: Any, source_prefix: str) -> list[str]:
    return [f.detail for f in res.findings.items if f.status == "not-convertible" and f.source.startswith(source_prefix)]


# ---- 1. every mig-parted form --------------------------------------------------------------------------------


def test_device_filter_lists_keep_their_known_models_and_name_each_unknown_id_once() -> None:
    res = run(cm(DEFAULT_CM), all_configs=True)
    by_name = {c.name: c for c in {g.mig.name: g.mig for g in res.groups if g.mig}.values()}
    ten = by_name["all-1g.10gb"]
    assert [(e.models, e.instances) for e in ten.entries] == [
        (("H100-80GB", "A100-80GB"), ("1g.10gb",) * 7), (("A100-40GB",), ("1g.10gb",) * 4)]
    balanced = by_name["all-balanced"]
    assert [e.models for e in balanced.entries] == [("B200",), ("H200-141GB",), ("H100-NVL",),
                                                   ("H100-80GB", "A100-80GB"), ("A100-40GB",), ("A30",)]
    text = res.findings.text()
    # Every id the catalog lacks is one line of its own, under the entry it came from; nothing is "unknown field".
    for flt in ("0x233110DE", "0x232210DE", "0x20B510DE", "0x20F310DE", "0x20F510DE", "0x232410DE"):
        assert sum(1 for f in res.findings.items if f.field.startswith("mig-configs.all-1g.10gb[0].device-filter")
                   and f.detail.startswith(flt)) == 1
    assert "unknown field" not in text
    # An entry none of whose ids is known (GB200, RTX PRO 6000, ...) is left out with one line of its own.
    assert any(f.field == "mig-configs.all-balanced[0]" and "left out" in f.detail for f in res.findings.items)


def test_every_form_of_entry_converts() -> None:
    """Single id, id list, all, per-index entries and mig-enabled: false entries of the published configs."""
    res = run(cm(DEFAULT_CM), cm(CUSTOM_CM), all_configs=True)
    policies = {g.mig.name: g.node_policy for g in res.groups if g.mig}
    assert policies["all-disabled"] == {"default": {"wholeGpu": True}}
    assert policies["all-7g.80gb"] == {"default": {"wholeGpu": False, "mig": "static"}}
    a30 = [r for r in policies["all-balanced"]["rules"] if r["match"] == {"model": "A30"}]   # the single id
    assert a30 == [{"match": {"model": "A30"}, "wholeGpu": False, "mig": "static"}]
    custom = policies["custom-config"]
    assert custom["default"] == {"wholeGpu": True}
    assert [r["match"]["index"] for r in custom["rules"]] == [4, 5, 6, 7]
    for p in policies.values():
        parse_node_policy(p, "converted")


# ---- 2. checks per node and per model ------------------------------------------------------------------------


def test_nodes_labelled_with_the_gpu_operators_configs_get_mig_policies() -> None:
    nodes = [node("h100", "H100-80GB", "all-1g.10gb"), node("a100", "A100-40GB", "all-balanced"),
             node("h200", "H200-141GB", "all-balanced"), node("a100-80", "A100-80GB", "all-2g.20gb"),
             node("h200-b", "H200-141GB", "all-1g.18gb")]
    res = run(cm(DEFAULT_CM), *nodes)
    assert not refused(res, "Node"), res.findings.text()
    groups = {n: g for g in res.groups for n in g.nodes}
    for n in nodes:
        name = n["metadata"]["name"]
        model = next(m for m, p in PRODUCT.items() if p == n["metadata"]["labels"]["nvidia.com/gpu.product"])
        policy = parse_node_policy(groups[name].node_policy, name)
        for i in range(8):
            got = policy.for_gpu(from_catalog(model, i), model)
            assert (got.mig, got.whole_gpu) == ("static", False), (name, i, got)
    # Only the configs the nodes use are written.
    files = output_files(res, Options(driver=D))
    assert sorted(f for f in files if f.startswith("mig-")) == [
        "mig-all-1g.10gb.yaml", "mig-all-1g.18gb.yaml", "mig-all-2g.20gb.yaml", "mig-all-balanced.yaml"]


@pytest.mark.parametrize("model, config, reason", [
    ("A100-40GB", "all-7g.80gb", "has no MIG profile '7g.80gb'"),          # product does not match its config
    ("H100-80GB", "all-1g.5gb", "has no MIG profile '1g.5gb'"),
    ("A100-40GB", "all-1g.20gb", "has no MIG profile '1g.20gb'"),
])
def test_a_node_whose_gpu_cannot_take_its_config_is_refused_by_name(model: str, config: str, reason: str) -> None:
    res = run(cm(DEFAULT_CM), node("bad", model, config), node("good", "H100-80GB", "all-7g.80gb"))
    (line,) = refused(res, "Node bad")
    assert config in line and model in line and reason in line
    assert all("bad" not in g.nodes for g in res.groups)
    assert res.exit_code() == EXIT_REFUSED


@pytest.mark.parametrize("devices, reason", [
    ({"1g.10gb": 7}, "7 x 1g.10gb: at most 4 on A100-40GB"),
    ({"1g.5gb": 8}, "8 x 1g.5gb: at most 7 on A100-40GB"),
    ({"3g.20gb": 2, "2g.10gb": 1}, "needs 8 compute slices"),
    ({"4g.20gb": 1, "1g.10gb": 3}, "needs 10 memory slices"),
])
def test_counts_are_checked_against_the_gpus_slices(devices: dict[str, int], reason: str) -> None:
    mig = {"version": "v1", "mig-configs": {"x": [{"devices": "all", "mig-enabled": True, "mig-devices": devices}]}}
    res = run(mig, node("n", "A100-40GB", "x"))
    (line,) = refused(res, "Node n")
    assert reason in line and "MIG config x on A100-40GB" in line
    assert res.groups == [] and res.mig_states == []   # no group written, no silent fallback to slots


def test_counts_of_a_filtered_entry_are_checked_without_nodes() -> None:
    mig = {"version": "v1", "mig-configs": {"x": [{"devices": "all", "device-filter": "0x20B010DE",
                                                   "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}]}}
    res = run(mig)
    assert any("not possible on A100-40GB: 7 x 1g.10gb: at most 4" in d for d in refused(res, "mig-parted"))


def test_a_mig_config_label_that_names_no_given_config_is_reported() -> None:
    res = run(TIME_SLICING, node("n", "H100-80GB", "all-1g.10gb"))
    (line,) = refused(res, "Node n")
    assert "all-1g.10gb: no mig-parted config of that name was given" in line
    assert res.groups == []


# ---- 5. nvidia-smi commands --------------------------------------------------------------------------------


def _simulate(model: str, count: int, commands: list[str], mig_on: tuple[int, ...] = ()) -> FakeNvml:
    gpus = [SimulatedGpu(model=model, uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000", minor=i,
                         pci_bus_id=f"00000000:{0x10 + i:02X}:00.0", mig_enabled=i in mig_on) for i in range(count)]
    nvml = FakeNvml(gpus)
    nvml.nvmlInit()
    for c in commands:
        nvidiasmi.run(nvml, c, [CATALOG[model]] * count)
    return nvml


@pytest.mark.parametrize("model, config", [
    ("H100-80GB", "all-1g.10gb"), ("A100-40GB", "all-1g.10gb"), ("A100-40GB", "all-balanced"),
    ("H100-80GB", "all-balanced"), ("H200-141GB", "all-balanced"), ("A100-80GB", "all-balanced"),
    ("H100-80GB", "all-1g.10gb.me"), ("H100-80GB", "all-1g.20gb"), ("H100-80GB", "all-2g.20gb"),
    ("H100-80GB", "all-3g.40gb"), ("H100-80GB", "all-4g.40gb"), ("H100-80GB", "all-7g.80gb"),
    ("A100-40GB", "all-1g.5gb"), ("H200-141GB", "all-1g.18gb"), ("H100-80GB", "all-disabled"),
])
def test_commands_run_as_written_on_simulated_gpus_and_make_the_config(model: str, config: str) -> None:
    res = run(cm(DEFAULT_CM), node("n", model, config, count=2))
    (st,) = res.mig_states
    (layout,) = st["nodes"]
    assert layout["model"] == model and layout["nodes"] == ["n"]
    for c in layout["commands"]:
        assert "#" not in c and "&" not in c and " -i " in c
    nvml = _simulate(model, 2, layout["commands"])
    cfg = next(g.mig for g in res.groups if g.mig)
    (entry,) = cfg.entries_for(model)
    for i in range(2):
        assert nvidiasmi.partitions(nvml, i) == sorted(entry.instances)


def test_mig_mode_changes_only_on_the_gpus_the_config_names() -> None:
    # The documented custom config on a node of 8 A100-40GB GPUs: 0-3 without MIG, 4-7 partitioned.
    res = run(cm(CUSTOM_CM), node("n", "A100-40GB", "custom-config"))
    cmds = res.mig_states[0]["nodes"][0]["commands"]
    assert "nvidia-smi -i 0 -mig 0" in cmds and "nvidia-smi -i 4 -mig 1" in cmds
    assert not any(c.startswith("nvidia-smi -mig") for c in cmds)
    nvml = _simulate("A100-40GB", 8, cmds, mig_on=(0,))
    assert [nvidiasmi.partitions(nvml, i) for i in range(4)] == [[]] * 4
    assert [nvml.nvmlDeviceGetMigMode(nvml.nvmlDeviceGetHandleByIndex(i))[0] for i in range(8)] == [0] * 4 + [1] * 4
    assert nvidiasmi.partitions(nvml, 4) == ["1g.5gb"] * 7
    assert nvidiasmi.partitions(nvml, 7) == ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]
    # A config naming GPU 0 only leaves GPU 1 as it is (MIG stays on there).
    one = {"version": "v1", "mig-configs": {"first": [{"devices": [0], "mig-enabled": True,
                                                       "mig-devices": {"7g.80gb": 1}}]}}
    res = run(one, node("m", "H100-80GB", "first", count=2))
    cmds = res.mig_states[0]["nodes"][0]["commands"]
    assert all(" -i 0 " in c for c in cmds)
    nvml = _simulate("H100-80GB", 2, cmds, mig_on=(1,))
    assert nvml.nvmlDeviceGetMigMode(nvml.nvmlDeviceGetHandleByIndex(1))[0] == 1


# ---- 3. workloads --------------------------------------------------------------------------------------------


def test_init_containers_reuse_the_app_containers_gpus() -> None:
    pod = vectoradd()
    pod["spec"]["containers"].append({**pod["spec"]["containers"][0], "name": "second"})
    pod["spec"]["initContainers"] = [{"name": "warmup", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 2}}}]
    res = run(pod)
    tpl, out = res.objects
    reqs = tpl["spec"]["spec"]["devices"]["requests"]
    assert sum(r["exactly"].get("count", 1) for r in reqs) == 2   # as the kubelet: max(2, 1 + 1), not 4
    assert out["spec"]["initContainers"][0]["resources"]["claims"] == [
        {"name": "gpus", "request": "cuda-vectoradd"}, {"name": "gpus", "request": "second"}]
    # An init container asking for more than the app containers: one extra request for the difference only.
    pod["spec"]["initContainers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 3
    reqs = run(pod).objects[0]["spec"]["spec"]["devices"]["requests"]
    assert sum(r["exactly"].get("count", 1) for r in reqs) == 3


@pytest.mark.parametrize("resources, reason", [
    ({"limits": {"nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 2}}, "requests 2 != limits 1"),
    ({"requests": {"nvidia.com/gpu": 1}}, "in requests without limits"),
    ({"limits": {"nvidia.com/gpu": "0.5"}}, "not a whole number"),
    ({"limits": {"nvidia.com/gpu": "one"}}, "not a whole number"),
    ({"limits": {"nvidia.com/gpu": -1}}, "not a whole number"),
])
def test_pods_the_api_server_refuses_are_not_written(resources: dict[str, Any], reason: str) -> None:
    res = run(vectoradd(**resources))
    assert res.objects == []
    (line,) = refused(res, "Pod cuda-vectoradd")
    assert reason in line and line.endswith("the workload is not written")
    assert res.exit_code() == EXIT_REFUSED


def test_renamed_sharing_leaves_plain_gpu_requests_unserved() -> None:
    renamed = {"version": "v1", "sharing": {"timeSlicing": {"renameByDefault": True, "resources": [
        {"name": "nvidia.com/gpu", "replicas": 10}]}}}
    res = run(renamed, vectoradd("plain"), vectoradd("shared", limits={"nvidia.com/gpu.shared": 1}))
    assert [o["metadata"]["name"] for o in res.objects] == ["shared-gpus", "shared"]
    (line,) = refused(res, "Pod plain")
    assert "advertise only nvidia.com/gpu.shared" in line


def test_fail_requests_greater_than_one_refuses_as_the_device_plugin_did() -> None:
    strict = {"version": "v1", "sharing": {"timeSlicing": {"failRequestsGreaterThanOne": True, "resources": [
        {"name": "nvidia.com/gpu", "replicas": 10}]}}}
    res = run(strict, vectoradd("two", limits={"nvidia.com/gpu": 2}), vectoradd("one"))
    assert [o["metadata"]["name"] for o in res.objects] == ["one-gpus", "one"]
    assert "failRequestsGreaterThanOne" in refused(res, "Pod two")[0]


def test_every_mps_config_says_that_its_daemon_serves_one_namespace() -> None:
    res = run(MPS)
    (line,) = [f for f in res.findings.items if f.status == "changed"]
    assert "one namespace" in line.detail and "shareAcrossNamespaces: true" in line.detail
    assert res.exit_code() == EXIT_CHANGED
    assert run(TIME_SLICING).exit_code() == 0


def test_a_misspelt_field_is_named() -> None:
    typo = {"version": "v1", "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replica": 4}]}}}
    with pytest.raises(ConvertError, match=r"resources\[0\] has no replicas \(its fields: name, replica"):
        run(typo)


# ---- 4. the report and the command ---------------------------------------------------------------------------


def test_report_starts_with_a_summary_and_groups_lines_by_severity(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump_all([node("h100", "H100-80GB", "all-1g.10gb"),
                                         node("a100", "A100-40GB", "all-7g.80gb")]))
    out = tmp_path / "out"
    rc = main(["convert", "-f", str(DEFAULT_CM), "-f", str(nodes), "--output-dir", str(out)])
    assert rc == EXIT_REFUSED
    report = (out / "report.txt").read_text().splitlines()
    assert report[0] == "nodes: 2 (1 in 1 node groups, 1 in none)"
    assert report[2].startswith("result: some fields were refused or left out") and f"(exit status {rc})" in report[2]
    heads = [line for line in report if line.startswith("== ")]
    assert [h.split()[1] for h in heads] == ["not-convertible", "kept", "converted"]
    assert len(report) < 80, "\n".join(report)
    assert not any(": metadata: " in line for line in report)   # the ConfigMap itself is no finding
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("mig-")) == ["mig-all-1g.10gb.yaml"]
    capsys.readouterr()
    rc = main(["convert", "-f", str(DEFAULT_CM), "-f", str(nodes), "--output-dir", str(tmp_path / "all"),
               "--all-configs"])
    assert len([p for p in (tmp_path / "all").iterdir() if p.name.startswith("mig-")]) == len(
        yaml.safe_load(cm(DEFAULT_CM)["data"]["config.yaml"])["mig-configs"])


def test_exit_codes_are_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0" in text and f"{EXIT_CHANGED} written" in text and f"{EXIT_REFUSED} written" in text


def test_a_missing_file_is_one_plain_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "-f", str(tmp_path / "nonexistent.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"gpu-dra convert: {tmp_path / 'nonexistent.yaml'}: No such file or directory"
