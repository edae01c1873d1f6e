"""Fleet files: validation errors that name the file and field, and the simulated NVML built for a node."""
from __future__ import annotations

from pathlib import Path

import pynvml
import pytest
import yaml

from dra.sim.fleet import FleetError, gpu_uuid, load_fleet, nvml_for_node, parse_fleet

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "fleets"


def write(tmp_path: Path, data) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def error_of(tmp_path: Path, data) -> str:
    path = write(tmp_path, data)
    with pytest.raises(FleetError) as exc:
        load_fleet(path)
    message = str(exc.value)
    assert message.startswith(str(path)), message
    return message


def node(name="node-a", **gpu):
    return {"name": name, "gpus": [{"model": "H100-80GB", **gpu}]}


# -- examples --------------------------------------------------------------------------------------------------


def test_demo_example():
    fleet = load_fleet(EXAMPLES / "demo.yaml")
    assert fleet.node_names == ["node-a", "node-b"]
    assert fleet.node("node-a").gpu_count == 8 and fleet.node("node-a").gpus[0].model == "H100-80GB"
    assert fleet.node("node-b").gpu_count == 4 and fleet.node("node-b").gpus[0].model == "L4"


@pytest.mark.parametrize("name", ["demo.yaml", "mixed.yaml", "large.yaml"])
def test_examples_build(name):
    fleet = load_fleet(EXAMPLES / name)
    for spec in fleet.nodes:
        nvml = nvml_for_node(spec)
        nvml.nvmlInit()
        assert nvml.nvmlDeviceGetCount() == spec.gpu_count
        nvml.nvmlShutdown()


def test_mixed_example_contents():
    fleet = load_fleet(EXAMPLES / "mixed.yaml")
    models = {g.model for n in fleet.nodes for g in n.gpus}
    assert {"A30", "A100-40GB", "T4", "L40S", "B200"} <= models
    assert any(g.broken for n in fleet.nodes for g in n.gpus)
    assert any(g.mig.instances for n in fleet.nodes for g in n.gpus if g.model == "A100-40GB")


def test_large_example_contents():
    fleet = load_fleet(EXAMPLES / "large.yaml")
    assert len(fleet.nodes) >= 3
    assert all(g.model == "H200-141GB" and g.count == 8 for n in fleet.nodes for g in n.gpus)


# -- errors ----------------------------------------------------------------------------------------------------


def test_unknown_model_names_field_and_known_models(tmp_path):
    msg = error_of(tmp_path, {"nodes": [node("a"), {"name": "b", "gpus": [{"model": "H100-81GB"}]}]})
    assert "nodes[1].gpus[0].model" in msg and "H100-81GB" in msg
    assert "H100-80GB" in msg and "T4" in msg and "B200" in msg


def test_unknown_field(tmp_path):
    msg = error_of(tmp_path, {"nodes": [node(cuont=2)]})
    assert "nodes[0].gpus[0].cuont: unknown field" in msg


def test_wrong_type(tmp_path):
    msg = error_of(tmp_path, {"nodes": [node(count="8")]})
    assert "nodes[0].gpus[0].count" in msg


def test_count_must_be_positive(tmp_path):
    assert "nodes[0].gpus[0].count" in error_of(tmp_path, {"nodes": [node(count=0)]})


def test_overlapping_layout_names_the_overlap(tmp_path):
    mig = {"enabled": True, "instances": [{"profile": "2g.20gb", "start": 4}, {"profile": "3g.40gb", "start": 4}]}
    msg = error_of(tmp_path, {"nodes": [node(mig=mig)]})
    assert "nodes[0].gpus[0].mig.instances[1]" in msg
    assert "3g.40gb@4 overlaps 2g.20gb@4" in msg


def test_invalid_start(tmp_path):
    mig = {"enabled": True, "instances": [{"profile": "1g.10gb", "start": 7}]}
    msg = error_of(tmp_path, {"nodes": [node(mig=mig)]})
    assert "nodes[0].gpus[0].mig.instances[0].start" in msg and "valid starts: 0, 1, 2, 3, 4, 5, 6" in msg


def test_unknown_profile_lists_the_models_profiles(tmp_path):
    mig = {"enabled": True, "instances": [{"profile": "3g.20gb"}]}
    msg = error_of(tmp_path, {"nodes": [node(mig=mig)]})
    assert "nodes[0].gpus[0].mig.instances[0].profile" in msg and "3g.40gb" in msg


def test_two_media_extension_instances(tmp_path):
    mig = {"enabled": True, "instances": [{"profile": "1g.10gb+me"}, {"profile": "1g.10gb+me"}]}
    assert "at most 1" in error_of(tmp_path, {"nodes": [node(mig=mig)]})


def test_auto_placed_layout_that_cannot_fit(tmp_path):
    # NVML's own placement puts the 2g on slot 4, so the 3g no longer fits (MIG guide example)
    mig = {"enabled": True, "instances": [{"profile": p} for p in ("1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb")]}
    msg = error_of(tmp_path, {"nodes": [node(mig=mig)]})
    assert "instances[3]" in msg and "3g.40gb" in msg


def test_mig_on_a_gpu_without_mig(tmp_path):
    msg = error_of(tmp_path, {"nodes": [{"name": "n", "gpus": [{"model": "L4", "mig": {"enabled": True}}]}]})
    assert "nodes[0].gpus[0].mig.enabled" in msg and "does not support MIG" in msg


def test_instances_need_mig_enabled(tmp_path):
    mig = {"instances": [{"profile": "7g.80gb"}]}
    assert "nodes[0].gpus[0].mig.instances: MIG instances need enabled: true" in \
        error_of(tmp_path, {"nodes": [node(mig=mig)]})


def test_duplicate_and_bad_node_names(tmp_path):
    assert "nodes[1].name" in error_of(tmp_path, {"nodes": [node("a"), node("a")]})
    assert "nodes[0].name" in error_of(tmp_path, {"nodes": [node("Node_A")]})


def test_bad_versions(tmp_path):
    assert "nodes[0].driverVersion" in error_of(tmp_path, {"nodes": [{**node(), "driverVersion": "latest"}]})
    assert "nodes[0].cudaDriverVersion" in error_of(tmp_path, {"nodes": [{**node(), "cudaDriverVersion": "13"}]})


def test_bad_policy_names_the_field(tmp_path):
    msg = error_of(tmp_path, {"nodes": [{**node(), "policy": {"default": {"bogus": 1}}}]})
    assert "nodes[0].policy.default.bogus" in msg


def test_valid_policy_is_kept_as_given():
    fleet = parse_fleet({"nodes": [{**node(), "policy": {"default": {"mig": "dynamic"}}}]})
    assert fleet.nodes[0].policy == {"default": {"mig": "dynamic"}}


def test_not_yaml_and_missing_file(tmp_path):
    assert "not valid YAML" in error_of(tmp_path, "nodes: [\n")
    assert "must be a mapping" in error_of(tmp_path, "- just a list\n")
    with pytest.raises(FleetError, match="cannot read"):
        load_fleet(tmp_path / "missing.yaml")


def test_unknown_node():
    fleet = parse_fleet({"nodes": [node("a")]}, source="f.yaml")
    with pytest.raises(FleetError, match=r"f\.yaml: no node 'b' \(nodes: a\)"):
        fleet.node("b")


# -- the simulated NVML of a node --------------------------------------------------------------------------------


def test_identities_are_stable_and_distinct():
    fleet = parse_fleet({"nodes": [node("a", count=8), node("b", count=8)]})
    first, second = nvml_for_node(fleet.node("a")), nvml_for_node(fleet.node("a"))
    other = nvml_for_node(fleet.node("b"))
    for n in (first, second, other):
        n.nvmlInit()

    def ids(n):
        hs = [n.nvmlDeviceGetHandleByIndex(i) for i in range(8)]
        return [(n.nvmlDeviceGetUUID(h), n.nvmlDeviceGetMinorNumber(h), n.nvmlDeviceGetPciInfo(h).busId) for h in hs]

    assert ids(first) == ids(second)
    assert not {u for u, _, _ in ids(first)} & {u for u, _, _ in ids(other)}
    assert [m for _, m, _ in ids(first)] == list(range(8))
    assert len({b for _, _, b in ids(first)}) == 8
    assert ids(first)[3][0] == gpu_uuid("a", 3)


def test_numa_split_on_eight_gpu_nodes():
    fleet = parse_fleet({"nodes": [node("a", count=8), {"name": "b", "gpus": [{"model": "L4", "count": 4}]}]})

    def nodes(spec, n):
        nvml = nvml_for_node(spec)
        nvml.nvmlInit()
        masks = [nvml.nvmlDeviceGetMemoryAffinity(nvml.nvmlDeviceGetHandleByIndex(i), 1,
                                                  pynvml.NVML_AFFINITY_SCOPE_NODE)[0] for i in range(n)]
        return [m.bit_length() - 1 for m in masks]

    assert nodes(fleet.node("a"), 8) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert nodes(fleet.node("b"), 4) == [0, 0, 0, 0]


def test_pre_existing_layout_is_created_through_nvml():
    mig = {"enabled": True, "instances": [{"profile": "3g.40gb", "start": 4}, {"profile": "2g.20gb"}]}
    nvml = nvml_for_node(parse_fleet({"nodes": [node(mig=mig, count=2)]}).nodes[0])
    nvml.nvmlInit()
    for i in range(2):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        assert nvml.nvmlDeviceGetMigMode(h) == [1, 1]
        migs = [nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k) for k in range(2)]
        uuids = {nvml.nvmlDeviceGetUUID(m) for m in migs}
        assert len(uuids) == 2 and all(u.startswith("MIG-") for u in uuids)
        starts = sorted(nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(h, nvml.nvmlDeviceGetGpuInstanceId(m)))
                        .placement.start for m in migs)
        assert starts == [2, 4]   # the auto-placed 2g lands on the highest free start


def test_broken_gpu_and_queued_xids():
    data = {"nodes": [{"name": "n", "gpus": [{"model": "L4", "count": 1},
                                             {"model": "L4", "count": 1, "broken": "fell off the bus",
                                              "xids": [79]}]}]}
    nvml = nvml_for_node(parse_fleet(data).nodes[0])
    nvml.nvmlInit()
    good, bad = nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlDeviceGetHandleByIndex(1)
    assert nvml.nvmlDeviceGetName(good) == "NVIDIA L4"
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetName(bad)
    assert nvml.lost_reason(nvml.nvmlDeviceGetUUID(bad)) == "fell off the bus"

    data["nodes"][0]["gpus"][1].pop("broken")
    nvml = nvml_for_node(parse_fleet(data).nodes[0])
    nvml.nvmlInit()
    es = nvml.nvmlEventSetCreate()
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    nvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    event = nvml.nvmlEventSetWait(es, 0)
    assert event.eventData == 79 and nvml.nvmlDeviceGetUUID(event.device) == nvml.nvmlDeviceGetUUID(h)


def test_versions_reach_nvml():
    data = {"nodes": [{**node(), "driverVersion": "570.172.08", "cudaDriverVersion": "12.8"}]}
    nvml = nvml_for_node(parse_fleet(data).nodes[0])
    nvml.nvmlInit()
    assert nvml.nvmlSystemGetDriverVersion() == "570.172.08"
    assert nvml.nvmlSystemGetCudaDriverVersion() == 12080


def test_nvml_for_node_needs_init_like_the_real_library():
    nvml = nvml_for_node(parse_fleet({"nodes": [node()]}).nodes[0])
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
