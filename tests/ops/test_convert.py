"""gpu-dra convert: every input field of the device plugin config, mig-parted config, Node labels and workloads
is converted (to the right thing) or reported with its reason; the CEL that GFD labels become selects the same
devices the labels described (evaluated as kube-scheduler does, on the devices a simulated node publishes)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from api.names import DEFAULT_DRIVER_NAME
from api.names import DEFAULT_DRIVER_NAME as D
from cli.main import main
from dra.model.devices import build_devices
from dra.model.policy import parse_node_policy
from dra.node.inventory import discover_once
from dra.scheduling.devicecel import compile_selector, device_variable
from dra.sim.fleet import nvml_for_node, parse_fleet
from ops.convert import gfdselectors as gfd
from ops.convert.conversion import EXIT_REFUSED, Options, convert, output_files
from ops.convert.deviceplugin import ConvertError
from testbed.helmchart import render

REPO = Path(__file__).resolve().parents[2]
A = f"device.attributes['{D}']"

# The shapes of upstream examples: the device plugin README's time-slicing and MPS configs, mig-parted's
# examples/config.yaml.
TIME_SLICING = {"version": "v1", "flags": {"migStrategy": "none"},
                "sharing": {"timeSlicing": {"renameByDefault": False, "failRequestsGreaterThanOne": False,
                                            "resources": [{"name": "nvidia.com/gpu", "replicas": 10}]}}}
MPS = {"version": "v1", "sharing": {"mps": {"renameByDefault": True,
                                            "resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}}
MIG_PARTED = {"version": "v1", "mig-configs": {
    "all-disabled": [{"devices": "all", "mig-enabled": False}],
    "all-1g.10gb": [{"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}],
    "custom": [{"devices": [0, 1], "mig-enabled": True, "mig-devices": {"3g.40gb": 2}},
               {"devices": [2, 3], "device-filter": "0x233010DE", "mig-enabled": True,
                "mig-devices": {"1g.10gb": 2, "2g.20gb": 1, "1c.2g.20gb": 1}},
               {"devices": [4, 5, 6, 7], "mig-enabled": False}]}}


def run(*docs: Any, **opts: Any) -> Any:
    return convert([(f"in{i}.yaml", d) for i, d in enumerate(docs)], Options(driver=D, **opts))


def status(res: Any, field: str) -> tuple[str, str]:
    hits = [f for f in res.findings.items if f.field == field or f.field.endswith("." + field)]
    assert hits, f"{field} not in the report:\n{res.findings.text()}"
    return hits[-1].status, hits[-1].detail


def pod(name: str = "p", resources: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "x",
                                     "resources": {"limits": resources or {"nvidia.com/gpu": 1}}}], **spec}}


def template_of(res: Any) -> dict[str, Any]:
    return next(o for o in res.objects if o["kind"] == "ResourceClaimTemplate")


def request(res: Any, i: int = 0) -> dict[str, Any]:
    return template_of(res)["spec"]["spec"]["devices"]["requests"][i]


# ---- device plugin config ------------------------------------------------------------------------------------


def test_time_slicing_replicas_become_slots_without_the_whole_gpu() -> None:
    res = run(TIME_SLICING)
    (g,) = res.groups
    assert g.node_policy == {"default": {"wholeGpu": False, "slots": {"count": 10, "strategy": "time-slicing"}}}
    parse_node_policy(g.values["nodePolicy"], "t")
    assert status(res, "sharing.timeSlicing.resources[0].replicas")[0] == "converted"
    assert status(res, "sharing.timeSlicing.renameByDefault")[0] == "converted"
    assert status(res, "sharing.timeSlicing.failRequestsGreaterThanOne")[0] == "converted"
    assert status(res, "flags.migStrategy")[0] == "converted"


def test_mps_renamed_shared_resource_is_an_mps_slot_and_plain_gpu_is_not_served() -> None:
    res = run(MPS, pod("a", {"nvidia.com/gpu.shared": 1}), pod("b", {"nvidia.com/gpu": 2}))
    assert res.groups[0].node_policy["default"]["slots"] == {"count": 4, "strategy": "mps"}
    (a,) = [o for o in res.objects if o["kind"] == "ResourceClaimTemplate"]
    req_a = a["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert req_a["deviceClassName"] == f"slot.{D}"
    assert req_a["selectors"] == [{"cel": {"expression": f"{A}.sharing == 'mps'"}}]
    # With renameByDefault the device plugin advertised no nvidia.com/gpu: b could not run before either.
    assert [o["metadata"]["name"] for o in res.objects if o["kind"] == "Pod"] == ["a"]
    assert status(res, "spec.containers[0].resources.limits.nvidia.com/gpu")[0] == "not-convertible"


def test_mps_wins_over_time_slicing_as_in_the_device_plugin() -> None:
    both = {"version": "v1", "sharing": {**TIME_SLICING["sharing"], **MPS["sharing"]}}
    res = run(both)
    assert res.groups[0].node_policy["default"]["slots"]["strategy"] == "mps"
    assert status(res, "sharing.timeSlicing") == ("not-convertible", "not in effect: the device plugin uses MPS "
                                                  "when both have shared resources")


def test_flags_and_fields_without_an_equivalent_are_reported_by_name() -> None:
    doc = {"version": "v1", "flags": {"migStrategy": "mixed", "failOnInitError": True, "nvidiaDriverRoot":
                                      "/run/nvidia/driver", "nvidiaDevRoot": "/", "mpsRoot": "/run/nvidia/mps",
                                      "gdsEnabled": False, "mofedEnabled": False, "gdrcopyEnabled": False,
                                      "useNodeFeatureAPI": False, "deviceDiscoveryStrategy": "auto",
                                      "gfd": {"oneshot": False, "sleepInterval": "60s"},
                                      "plugin": {"passDeviceSpecs": True, "deviceListStrategy": ["envvar"],
                                                 "deviceIDStrategy": "uuid", "cdiAnnotationPrefix": "x",
                                                 "nvidiaCTKPath": "/usr/bin/nvidia-ctk", "containerDriverRoot":
                                                 "/driver-root", "sharedDevicesAllocationPolicy": "packed",
                                                 "someNewFlag": 1}},
           "resources": {"gpus": [{"pattern": "*", "name": "nvidia.com/gpu"}]},
           "imex": {"channelIDs": [0]}, "futureField": True,
           "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": [0],
                                                      "rename": "x"},
                                                     {"name": "nvidia.com/mig-1g.10gb", "replicas": 2}]}}}
    res = run(doc)
    assert res.groups[0].values["driverRoot"] == "/run/nvidia/driver"
    assert status(res, "flags.nvidiaDriverRoot")[0] == "converted"
    for field in ("flags.failOnInitError", "flags.nvidiaDevRoot", "flags.mpsRoot", "flags.gdsEnabled",
                  "flags.mofedEnabled", "flags.gdrcopyEnabled", "flags.useNodeFeatureAPI",
                  "flags.deviceDiscoveryStrategy", "flags.gfd", "flags.plugin.passDeviceSpecs",
                  "flags.plugin.deviceListStrategy", "flags.plugin.deviceIDStrategy",
                  "flags.plugin.cdiAnnotationPrefix", "flags.plugin.nvidiaCTKPath",
                  "flags.plugin.containerDriverRoot", "flags.plugin.sharedDevicesAllocationPolicy", "resources",
                  "imex", "sharing.timeSlicing.resources[0].devices", "sharing.timeSlicing.resources[0].rename",
                  "sharing.timeSlicing.resources[1]"):
        assert status(res, field)[0] == "not-convertible", field
    assert status(res, "flags.plugin.someNewFlag") == ("not-convertible", "unknown field: not converted")
    assert status(res, "futureField") == ("not-convertible", "unknown field: not converted")


@pytest.mark.parametrize("doc, message", [
    ({"version": "v2", "flags": {}}, "version must be v1"),
    ({"version": "v1", "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 1}]}}},
     "replicas must be an integer of at least 2"),
    ({"version": "v1", "flags": {"migStrategy": "all"}}, "flags.migStrategy must be none, single or mixed"),
    ({"version": "v1", "mig-configs": {"x": [{"devices": "some"}]}}, "devices must be all or a list"),
    ({"version": "v1", "mig-configs": {"x": [{"devices": "all", "mig-devices": {"big": 1}}]}}, "not a MIG profile"),
    ({"kind": "Thing"}, "neither a device plugin config"),
])
def test_unreadable_input_is_one_error_naming_the_field(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConvertError, match=message):
        run(doc)


def test_a_config_map_of_configs_names_them_by_key_and_labels_pick_the_group() -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "dp"},
          "data": {"ts": yaml.safe_dump(TIME_SLICING), "plain": "version: v1\nflags: {migStrategy: none}\n"}}
    nodes = [{"kind": "Node", "apiVersion": "v1", "metadata": {"name": n, "labels": lab}} for n, lab in
             (("a", {"nvidia.com/device-plugin.config": "ts"}), ("b", {}),
              ("c", {"nvidia.com/device-plugin.config": "nope"}))]
    res = convert([("cm.yaml", cm)] + [("n.yaml", n) for n in nodes],
                  Options(driver=D, default_config="plain"))
    by_name = {g.name: g for g in res.groups}
    assert by_name["ts"].nodes == ["a"] and by_name["plain"].nodes == ["b"]
    terms = lambda g: g.values["kubeletPlugin"]["affinity"]["nodeAffinity"][  # noqa: E731 - read twice below
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms(by_name["ts"]) == [{"matchExpressions": [
        {"key": "nvidia.com/device-plugin.config", "operator": "In", "values": ["ts"]}]}]
    # The default config also serves nodes without the label.
    assert terms(by_name["plain"])[0]["matchExpressions"][0] == {
        "key": "nvidia.com/device-plugin.config", "operator": "NotIn", "values": ["ts"]}
    assert status(res, "metadata.labels.nvidia.com/device-plugin.config")[0] == "not-convertible"
    # One controller, webhook and class set: the second release leaves them to the first.
    assert [g.values.get("controller") for g in res.groups] == [None, {"enabled": False}]
    assert {g.values["fullnameOverride"] for g in res.groups} == {"gpu-dra-ts", "gpu-dra-plain"}


# ---- mig-parted ------------------------------------------------------------------------------------------------


def _node(name: str, mig_config: str, count: int = 8) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
        "nvidia.com/mig.config": mig_config, "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.count": str(count)}}}


def test_mig_parted_entries_become_static_rules_and_the_state_to_create() -> None:
    res = run(MIG_PARTED)
    by_name = {g.mig.name: g for g in res.groups if g.mig}
    assert by_name["all-1g.10gb"].node_policy == {"default": {"wholeGpu": False, "mig": "static"}}
    assert by_name["all-disabled"].node_policy == {"default": {"wholeGpu": True}}
    custom = by_name["custom"].node_policy
    assert custom["rules"] == [{"match": {"index": 0}, "wholeGpu": False, "mig": "static"},
                               {"match": {"index": 1}, "wholeGpu": False, "mig": "static"},
                               {"match": {"index": 2, "model": "H100-80GB"}, "wholeGpu": False, "mig": "static"},
                               {"match": {"index": 3, "model": "H100-80GB"}, "wholeGpu": False, "mig": "static"}]
    parse_node_policy(custom, "custom")
    state = next(s for s in res.mig_states if s["migConfig"] == "custom")
    assert state["gpus"][1]["instances"] == ["1g.10gb", "1g.10gb", "2g.20gb"]
    assert state["nodes"] == []   # no Node given: which GPUs a node has is not known, so no commands
    # The 1c.2g.20gb compute instance is refused, and so is a node that would need it.
    assert status(res, "mig-configs.custom[1].mig-devices.1c.2g.20gb")[0] == "not-convertible"
    assert status(res, "mig-configs.custom[1].device-filter")[0] == "converted"
    assert "1c.2g.20gb" in state["gpus"][1]["problem"]
    res = run(MIG_PARTED, _node("n", "all-1g.10gb"), _node("m", "custom"))
    assert [g.nodes for g in res.groups] == [["n"]]
    assert "1c.2g.20gb" in status(res, "metadata.labels.nvidia.com/mig.config")[1]
    (state,) = res.mig_states
    assert state["nodes"][0]["commands"][:2] == ["nvidia-smi -i 0 -mig 1",
                                                 "nvidia-smi mig -i 0 -cgi 1g.10gb,1g.10gb,1g.10gb,1g.10gb,"
                                                 "1g.10gb,1g.10gb,1g.10gb -C"]


def test_dynamic_mig_publishes_the_configs_profiles_and_leaves_no_partitions() -> None:
    res = run(MIG_PARTED, _node("n", "all-1g.10gb", count=1), dynamic_mig=True)
    g = next(g for g in res.groups if g.mig and g.mig.name == "all-1g.10gb")
    assert g.node_policy == {"default": {"wholeGpu": False, "mig": "dynamic",
                                         "dynamicMig": {"profiles": ["1g.10gb"]}}}
    state = next(s for s in res.mig_states if s["migConfig"] == "all-1g.10gb")
    assert state["gpus"][0]["instances"] == []
    assert state["nodes"][0]["commands"] == ["nvidia-smi -i 0 -mig 1", "nvidia-smi mig -i 0 -dci",
                                             "nvidia-smi mig -i 0 -dgi"]


def test_dynamic_mig_rules_name_each_entrys_profiles_and_publish_only_those() -> None:
    doc = {"version": "v1", "mig-configs": {"mixed": [
        {"devices": [0, 1], "mig-enabled": True, "mig-devices": {"3g.40gb": 1, "1g.10gb": 4}},
        {"devices": [2], "mig-enabled": True, "mig-devices": {"1g.10gb+me": 1, "1g.10gb": 2}},
        {"devices": [3], "mig-enabled": True},
        {"devices": [4, 5, 6, 7], "mig-enabled": False}]}}
    res = run(doc, _node("n", "mixed"), dynamic_mig=True)
    (g,) = res.groups
    rules = {r["match"]["index"]: r.get("dynamicMig") for r in g.node_policy["rules"]}
    assert rules[0] == rules[1] == {"profiles": ["3g.40gb", "1g.10gb"]}
    assert rules[2] == {"profiles": ["1g.10gb+me", "1g.10gb"]}
    assert rules[3] is None          # MIG on with no partitions named: every profile
    # What the converted policy publishes on the node: exactly those profiles, per GPU.
    pol = parse_node_policy(g.node_policy, "converted")
    fleet = parse_fleet({"nodes": [{"name": "n", "gpus": [{"model": "H100-80GB", "count": 8}],
                                    "policy": g.node_policy}]})
    model = build_devices(discover_once(nvml_for_node(fleet.node("n"))), pol)
    profiles: dict[int, set[str]] = {}
    for d in model.devices:
        if d.kind == "mig":
            profiles.setdefault(d.gpu_index, set()).add(d.mig_profile_name or "")
    assert profiles[0] == profiles[1] == {"3g.40gb", "1g.10gb"}
    assert profiles[2] == {"1g.10gb+me", "1g.10gb"}
    assert len(profiles[3]) == 7
    assert set(profiles) == {0, 1, 2, 3}


def test_mig_capacity_writes_the_capacity_layout_for_entries_of_one_profile() -> None:
    doc = {"version": "v1", "mig-configs": {"mixed": [
        {"devices": [0, 1], "mig-enabled": True, "mig-devices": {"1g.10gb": 7}},
        {"devices": [2], "mig-enabled": True, "mig-devices": {"3g.40gb": 1, "1g.10gb": 4}},
        {"devices": [3, 4, 5, 6, 7], "mig-enabled": False}]}}
    res = run(doc, _node("n", "mixed"), dynamic_mig=True, mig_capacity=True)
    (g,) = res.groups
    rules = {r["match"]["index"]: r.get("dynamicMig") for r in g.node_policy["rules"]}
    assert rules[0] == rules[1] == {"profiles": ["1g.10gb"], "layout": "capacity"}
    assert rules[2] == {"profiles": ["3g.40gb", "1g.10gb"]}          # two profiles: one device per placement
    fleet = parse_fleet({"nodes": [{"name": "n", "gpus": [{"model": "H100-80GB", "count": 8}],
                                    "policy": g.node_policy}]})
    model = build_devices(discover_once(nvml_for_node(fleet.node("n"))), parse_node_policy(g.node_policy, "c"))
    assert [d.name for d in model.devices if d.gpu_index == 0] == ["gpu-0-mig-1g10gb-19"]
    assert len([d for d in model.devices if d.gpu_index == 2]) == 2 + 7
    assert run(doc, _node("n", "mixed"), dynamic_mig=True).groups[0].node_policy["rules"][0]["dynamicMig"] == {
        "profiles": ["1g.10gb"]}


def test_mig_capacity_flag_needs_dynamic_mig(tmp_path: Any, capsys: Any) -> None:
    path = tmp_path / "mig.yaml"
    path.write_text(yaml.safe_dump(MIG_PARTED))
    assert main(["convert", "-f", str(path), "--mig-capacity"]) == 2
    assert "--mig-capacity applies to dynamic MIG only; give --dynamic-mig too" in capsys.readouterr().err


def test_unknown_device_filter_and_profiles_of_another_model_are_reported() -> None:
    doc = {"version": "v1", "mig-configs": {"x": [
        {"devices": "all", "device-filter": ["0x12345678"], "mig-enabled": True},
        {"devices": [1], "device-filter": "0x20B210DE", "mig-enabled": True, "mig-devices": {"1g.5gb": 1}}]}}
    res = run(doc)
    assert status(res, "mig-configs.x[0].device-filter[0]")[0] == "not-convertible"
    assert status(res, "mig-configs.x[0]") == ("not-convertible", "no PCI id of its device-filter is in the "
                                                                  "catalog: the entry is left out")
    # A100-80GB has no 1g.5gb
    assert "not possible on A100-80GB" in status(res, "mig-configs.x[1]")[1]


@pytest.mark.parametrize("devices, reason", [
    ({"1g.10gb": 8}, "8 x 1g.10gb: at most 7 on H100-80GB"),
    ({"1g.7gb": 2}, "no GPU of the catalog has MIG profile 1g.7gb"),
    ({"4g.40gb": 1, "3g.40gb": 1, "1g.10gb": 1}, "needs 8 compute slices; H100-80GB has 7"),
], ids=["more-1g-than-any-gpu", "profile-of-no-gpu", "over-7-compute-slices"])
def test_an_entry_no_gpu_can_hold_is_refused_without_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           devices: dict[str, int], reason: str) -> None:
    """No Node is given and the entry has no device-filter: it is checked against every MIG GPU of the catalog,
    and refused with the reason (exit status 4); its MIG state says no node can take it. An entry one GPU model
    can hold (1g.5gb only on A100-40GB) is not refused."""
    def convert_file(devs: dict[str, int], out: Path) -> int:
        path = tmp_path / "mig.yaml"
        path.write_text(yaml.safe_dump({"version": "v1", "mig-configs": {"cfg": [
            {"devices": "all", "mig-enabled": True, "mig-devices": devs}]}}))
        return main(["convert", "-f", str(path), "--output-dir", str(out)])

    assert convert_file(devices, tmp_path / "out") == EXIT_REFUSED
    report = (tmp_path / "out" / "report.txt").read_text()
    [line] = [x for x in report.splitlines() if x.startswith("not-convertible")]
    assert "mig-configs.cfg[0]: no GPU of the catalog can hold it: " in line and reason in line, line
    state = yaml.safe_load((tmp_path / "out" / "mig-cfg.yaml").read_text())
    assert state["gpus"][0]["problem"].endswith("no node can take this entry")
    assert convert_file({"1g.5gb": 7}, tmp_path / "ok") == 0
    capsys.readouterr()


def test_mig_single_strategy_gpu_means_the_groups_profile() -> None:
    single = {"version": "v1", "flags": {"migStrategy": "single"}}
    mig = {"version": "v1", "mig-configs": {"all-1g.10gb": MIG_PARTED["mig-configs"]["all-1g.10gb"]}}
    res = run(single, mig, pod())
    assert request(res)["exactly"] == {"deviceClassName": f"mig.{D}", "selectors": [
        {"cel": {"expression": f"{A}.profile == '1g.10gb'"}}]}


# ---- workloads -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, path", [("Deployment", ("spec", "template", "spec")),
                                        ("StatefulSet", ("spec", "template", "spec")),
                                        ("Job", ("spec", "template", "spec")),
                                        ("CronJob", ("spec", "jobTemplate", "spec", "template", "spec"))])
def test_workload_kinds_get_a_claim_and_lose_the_extended_resource(kind: str, path: tuple[str, ...]) -> None:
    spec = pod()["spec"]
    obj: dict[str, Any] = {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": "w", "namespace": "ns"}}
    node = obj
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = spec
    res = run(obj)
    tpl, out = res.objects
    assert tpl["metadata"] == {"name": "w-gpus", "namespace": "ns"}
    inner = out
    for key in path:
        inner = inner[key]
    assert inner["resourceClaims"] == [{"name": "gpus", "resourceClaimTemplateName": "w-gpus"}]
    assert inner["containers"][0]["resources"] == {"claims": [{"name": "gpus", "request": "c"}]}


def test_mig_resource_and_mig_labels() -> None:
    res = run(pod(resources={"nvidia.com/mig-1g.5gb.me": 2, "cpu": "1"}))
    assert request(res)["exactly"] == {"deviceClassName": f"mig.{D}", "count": 2,
                                       "selectors": [{"cel": {"expression": f"{A}.profile == '1g.5gb+me'"}}]}
    out = res.objects[1]
    assert out["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "1"}


def test_extended_resource_mode_keeps_whole_gpu_requests_without_selectors() -> None:
    plain, placed = pod("a"), pod("b", nodeSelector={"nvidia.com/gpu.family": "hopper"})
    res = convert([("w", plain), ("w", placed)], Options(driver="gpu.nvidia.com", extended_resource=True))
    assert res.objects[0] == plain   # unchanged
    assert res.objects[1]["kind"] == "ResourceClaimTemplate"
    assert status(res, "spec.containers[0].resources.limits.nvidia.com/gpu")[0] == "converted"
    assert any(f.status == "kept" and "extendedResourceName" in f.detail for f in res.findings.items)


def test_compatibility_mode_uses_nvidias_class_names() -> None:
    res = convert([("w", pod("a", {"nvidia.com/mig-1g.10gb": 1})), ("w", pod("b", {"nvidia.com/gpu.shared": 1}))],
                  Options(driver="gpu.nvidia.com", extended_resource=True))
    a, b = [o for o in res.objects if o["kind"] == "ResourceClaimTemplate"]
    assert a["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "mig.nvidia.com"
    assert b["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "slot.gpu.nvidia.com"


def test_ambiguous_gpu_meaning_is_reported_and_pinning_resolves_it() -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "dp"},
          "data": {"ts": yaml.safe_dump(TIME_SLICING), "plain": "version: v1\n" "flags: {migStrategy: none}\n"}}
    res = convert([("cm", cm), ("w", pod("a")),
                   ("w", pod("b", nodeSelector={"nvidia.com/device-plugin.config": "ts"}))],
                  Options(driver=D, default_config="plain"))
    a = [f for f in res.findings.items if f.source.startswith("Pod a") and f.status == "not-convertible"]
    assert a and "depending on the node group" in a[0].detail
    b_tpl = [o for o in res.objects if o["kind"] == "ResourceClaimTemplate"][1]
    assert b_tpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == f"slot.{D}"
    b = next(o for o in res.objects if o["metadata"]["name"] == "b" and o["kind"] == "Pod")
    assert b["spec"]["nodeSelector"] == {"nvidia.com/device-plugin.config": "ts"}   # an admin label: kept


def test_fail_requests_greater_than_one_is_refused() -> None:
    doc = {**TIME_SLICING, "sharing": {"timeSlicing": {**TIME_SLICING["sharing"]["timeSlicing"],
                                                       "failRequestsGreaterThanOne": True}}}
    res = run(doc, pod(resources={"nvidia.com/gpu": 2}))
    assert res.objects == []
    assert any("failRequestsGreaterThanOne" in f.detail and f.status == "not-convertible" for f in res.findings.items)


def test_affinity_terms_become_one_or_selector_and_leave_the_pod() -> None:
    aff = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.family", "operator": "In", "values": ["hopper"]}]},
        {"matchExpressions": [{"key": "nvidia.com/gpu.compute.major", "operator": "Gt", "values": ["9"]}]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {"matchExpressions": [
            {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["40000"]}]}}]}}
    res = run(pod(affinity=aff))
    sel = [s["cel"]["expression"] for s in request(res)["exactly"]["selectors"]]
    assert sel == [f"({A}.family == 'hopper') || ({A}.cudaComputeCapability.major() > 9)"]
    out = res.objects[1]["spec"]["affinity"]["nodeAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in out
    assert status(res, "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]")[0] == \
        "not-convertible"


def test_untranslatable_labels_stay_on_the_node_and_gpu_less_pods_are_kept() -> None:
    res = run(pod("a", nodeSelector={"nvidia.com/gpu.count": "8", "nvidia.com/gpu.family": "ampere"}),
              {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cpu"},
               "spec": {"nodeSelector": {"nvidia.com/gpu.family": "ampere"}, "containers": [{"name": "c"}]}},
              {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}})
    a = next(o for o in res.objects if o["kind"] == "Pod" and o["metadata"]["name"] == "a")
    assert a["spec"]["nodeSelector"] == {"nvidia.com/gpu.count": "8"}
    assert status(res, "nodeSelector.nvidia.com/gpu.count")[0] == "not-convertible"
    cpu = [f for f in res.findings.items if f.source.startswith("Pod cpu")]
    assert [f.status for f in cpu] == ["kept"]
    assert any(f.source.startswith("Service s") and f.status == "kept" for f in res.findings.items)


def test_memory_of_the_gpu_is_not_the_memory_of_a_mig_device() -> None:
    res = run(pod(resources={"nvidia.com/mig-1g.10gb": 1}, nodeSelector={"nvidia.com/gpu.memory": "81559"}))
    assert [s["cel"]["expression"] for s in request(res)["exactly"]["selectors"]] == [f"{A}.profile == '1g.10gb'"]
    assert status(res, "nodeSelector.nvidia.com/gpu.memory")[0] == "not-convertible"


# ---- GFD labels: the CEL selects what the label described ----------------------------------------------------


def _node_a_devices() -> list[dict[str, Any]]:
    from dra.model.slices import ApiFeatures, plan_pool
    from dra.node.inventory import discover_once
    from dra.sim.fleet import load_fleet, nvml_for_node

    node = load_fleet(REPO / "examples" / "fleets" / "demo.yaml").node("node-a")
    plan = plan_pool(discover_once(nvml_for_node(node)), parse_node_policy(node.policy, "demo"), D, node.name,
                     ApiFeatures.for_server(37))
    return [d for s in plan.slices for d in s.get("devices") or []]


# label, operator, values that fit node-a's whole H100 GPUs, values that do not
H100_LABELS = [
    ("nvidia.com/gpu.family", "In", ["hopper"], ["ampere"]),
    ("nvidia.com/gpu.family", "NotIn", ["ampere", "ada-lovelace"], ["hopper"]),
    ("nvidia.com/gpu.product", "In", ["NVIDIA-H100-80GB-HBM3"], ["NVIDIA-A100-SXM4-80GB"]),
    ("nvidia.com/gpu.product", "In", ["NVIDIA-H100-80GB-HBM3-SHARED"], ["NVIDIA-L4-SHARED"]),
    ("nvidia.com/gpu.memory", "In", ["81559"], ["40960"]),
    ("nvidia.com/gpu.memory", "Gt", ["40959"], ["81559"]),
    ("nvidia.com/gpu.memory", "Lt", ["90000"], ["81559"]),
    ("nvidia.com/gpu.compute.major", "In", ["9"], ["8"]),
    ("nvidia.com/gpu.compute.major", "Gt", ["8"], ["9"]),
    ("nvidia.com/gpu.compute.minor", "In", ["0"], ["9"]),
    ("nvidia.com/cuda.driver-version.major", "In", ["580"], ["550"]),
    ("nvidia.com/cuda.driver-version.minor", "In", ["95"], ["107"]),
    ("nvidia.com/cuda.driver-version.revision", "In", ["05"], ["02"]),
    ("nvidia.com/cuda.driver-version.full", "In", ["580.95.05"], ["550.107.02"]),
    ("nvidia.com/cuda.driver-version.full", "Gt", ["550.107.02"], ["580.95.05"]),
    ("nvidia.com/cuda.driver.major", "In", ["580"], ["550"]),
    ("nvidia.com/cuda.driver.minor", "In", ["95"], ["107"]),
    ("nvidia.com/cuda.driver.rev", "In", ["05"], ["02"]),
    ("nvidia.com/cuda.runtime-version.major", "In", ["13"], ["12"]),
    ("nvidia.com/cuda.runtime-version.minor", "In", ["0"], ["5"]),
    ("nvidia.com/cuda.runtime.major", "In", ["13"], ["12"]),
    ("nvidia.com/cuda.runtime.minor", "In", ["0"], ["5"]),
    ("nvidia.com/cuda.runtime-version.full", "In", ["13.0"], ["12.5"]),
    ("nvidia.com/mig.capable", "In", ["true"], ["false"]),
    ("nvidia.com/gpu.sharing-strategy", "In", ["none"], ["time-slicing"]),
    ("nvidia.com/gpu.multiprocessors", "In", ["132"], ["14"]),
    ("nvidia.com/gpu.engines.copy", "In", ["8"], ["1"]),
    ("nvidia.com/gpu.engines.decoder", "In", ["7"], ["1"]),
    ("nvidia.com/gpu.engines.encoder", "In", ["0"], ["1"]),
    ("nvidia.com/gpu.engines.jpeg", "In", ["7"], ["1"]),
    ("nvidia.com/gpu.engines.ofa", "In", ["1"], ["0"]),
]


@pytest.mark.parametrize("key, op, fits, misses", H100_LABELS, ids=lambda v: str(v))
def test_gfd_label_cel_selects_what_the_label_described(key: str, op: str, fits: list[str],
                                                        misses: list[str]) -> None:
    whole = [d for d in _node_a_devices() if d["attributes"]["type"]["string"] == "gpu"]
    for values, expected in ((fits, True), (misses, False)):
        t = gfd.translate(gfd.Requirement(key, op, tuple(values)))
        assert t.problem is None and t.cel, (key, t)
        sel = compile_selector(gfd.render(t.cel, D))
        assert all(sel.matches(device_variable(D, d)) == expected for d in whole), (key, op, values, t.cel)


def test_gfd_sharing_and_mig_labels_pick_slots_and_profiles() -> None:
    devices = _node_a_devices()
    t = gfd.translate(gfd.Requirement("nvidia.com/gpu.sharing-strategy", "In", ("mps",)))
    assert (t.kind, t.sharing) == ("slot", "mps")
    sel = compile_selector(gfd.render(str(t.cel), D))
    matched = {d["attributes"]["type"]["string"] for d in devices if sel.matches(device_variable(D, d))}
    assert matched == {"slot", "shared"}   # MPS slots and MPS memory shares; the request's class picks slots
    for key, op, values in (("nvidia.com/mig-3g.40gb.count", "Gt", ("0",)),
                            ("nvidia.com/mig-3g.40gb.product", "In", ("H100-80GB-HBM3-MIG-3g.40gb",)),
                            ("nvidia.com/mig-3g.40gb.memory", "Exists", ())):
        assert gfd.translate(gfd.Requirement(key, op, values)).profile == "3g.40gb"
    t = gfd.translate(gfd.Requirement("nvidia.com/gpu.product", "In", ("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb",)))
    assert (t.kind, t.profile) == ("mig", "1g.10gb")


@pytest.mark.parametrize("key", sorted(gfd.NO_EQUIVALENT) + ["nvidia.com/vgpu.present", "nvidia.com/something"])
def test_labels_without_an_attribute_say_why(key: str) -> None:
    t = gfd.translate(gfd.Requirement(key, "In", ("1",)))
    assert t.problem and t.cel is None


@pytest.mark.parametrize("key", list(gfd.NODE_LABELS) + ["nvidia.com/gpu.deploy.device-plugin"])
def test_operator_and_admin_labels_stay_node_labels(key: str) -> None:
    assert gfd.translate(gfd.Requirement(key, "In", ("x",))).node_label


def test_operators_that_have_no_device_meaning() -> None:
    assert gfd.translate(gfd.Requirement("nvidia.com/gpu.family", "DoesNotExist")).problem
    assert gfd.translate(gfd.Requirement("nvidia.com/gpu.family", "Gt", ("1",))).problem
    assert gfd.translate(gfd.Requirement("nvidia.com/gpu.compute.major", "In", ("nine",))).problem
    assert gfd.translate(gfd.Requirement("nvidia.com/gpu.family", "Exists")) == gfd.Translation()


# ---- the command -----------------------------------------------------------------------------------------------


def test_command_on_the_migration_example_writes_files_and_report(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    ex = REPO / "examples" / "migration"
    files = ["device-plugin-configs.yaml", "mig-parted-config.yaml", "nodes.yaml", "workloads.yaml"]
    # 4: the device plugin flags without an equivalent are refused; all-disabled is used by no node.
    assert main(["convert", "--output-dir", str(tmp_path)] + [a for n in files for a in ("-f", str(ex / n))]) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mig-inference-mixed.yaml", "report.txt", "values-time-sliced-inference-mixed.yaml", "workloads.yaml"]
    state = yaml.safe_load((tmp_path / "mig-inference-mixed.yaml").read_text())
    assert state["nodes"][0]["commands"] == ["nvidia-smi -i 0 -mig 1", "nvidia-smi mig -i 0 -cgi 3g.40gb,1g.10gb,"
                                             "1g.10gb -C", "nvidia-smi -i 1 -mig 0", "nvidia-smi -i 2 -mig 0",
                                             "nvidia-smi -i 3 -mig 0"]
    assert "not-convertible" in capsys.readouterr().err
    assert main(["convert", "-f", str(ex / "workloads.yaml")]) == 0
    out = capsys.readouterr().out
    kinds = [d["kind"] for d in yaml.safe_load_all(out) if d]
    assert kinds == ["ResourceClaimTemplate", "Deployment", "ResourceClaimTemplate", "Job",
                     "ResourceClaimTemplate", "StatefulSet"]


def test_command_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: v1\nsharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 1}]}}\n")
    assert main(["convert", "-f", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "replicas must be an integer of at least 2" in err
    bad.write_text("a: [\n")
    assert main(["convert", "-f", str(bad)]) == 2
    assert "not YAML" in capsys.readouterr().err
    assert main(["convert", "-f", str(tmp_path / "missing.yaml")]) == 2


def test_output_files_validate_as_node_policies() -> None:
    res = run(TIME_SLICING, MIG_PARTED)
    files = output_files(res, Options(driver=D))
    for name, text in files.items():
        if name.startswith("values-"):
            parse_node_policy(yaml.safe_load(text)["nodePolicy"], name)


# --- converted configs through the chart ----------------------------------------------------------------------------
# The chart values gpu-dra convert writes, rendered by the chart: one release per node group installs side by
# side (no object of one release has the name of another's), only the first runs the controller, the webhook and
# the DeviceClasses, and each plugin gets its group's node policy and node affinity.

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
