"""`gpu-dra explain` without a cluster: the CEL layer (Kubernetes' device-selector environment with quantity and
semver) and the explainer over hand-made ResourceSlices, DeviceClasses and claims as plain dicts."""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
from claims import request, resource_claim

import ops.explain.verdict as explain_mod
from api.deviceclasses import device_classes
from dra.model.tolerations import tolerates
from dra.scheduling.claimrequests import ClaimSpecError, read_claim_spec
from dra.scheduling.devicecel import CelRuntimeError, CelUnsupported, compile_selector, device_variable
from dra.scheduling.devicefit import capacity_needs, untolerated_taints
from ops.explain.verdict import ALLOCATABLE, ALLOCATED, CANNOT_EVALUATE, NOT_ALLOCATABLE, Target, explain, format_text

D = "gpu.example.com"
CLASSES = device_classes(D)
GI = 1 << 30


# ------------------------------------------------------------------------------------------------- CEL

GPU0 = {"name": "gpu-0",
        "attributes": {"type": {"string": "gpu"}, "productName": {"string": "NVIDIA H100 80GB HBM3"},
                       "driverVersion": {"version": "580.95.5"}, "index": {"int": 0}, "migCapable": {"bool": True},
                       "resource.kubernetes.io/pcieRoot": {"string": "pci0000:18"}},
        "capacity": {"memory": {"value": "81559Mi"}, "multiprocessors": {"value": "132"}}}


def matches(expression: str, device: dict[str, Any] = GPU0) -> bool:
    return compile_selector(expression).matches(device_variable(D, device))


@pytest.mark.parametrize("expression, expected", [
    (f"device.driver == '{D}'", True),
    (f"device.attributes['{D}'].type == 'gpu' && device.attributes['{D}'].index == 0", True),
    (f"device.attributes['{D}'].productName.startsWith('NVIDIA H100')", True),
    (f"device.attributes['{D}'].productName.matches('^NVIDIA H(100|200)')", True),
    (f"device.attributes['{D}'].productName.lowerAscii().contains('h100')", True),   # strings extension
    ("device.attributes['resource.kubernetes.io'].pcieRoot == 'pci0000:18'", True),
    ("has(device.attributes['other.example.com'].x)", False),                         # unknown domain: empty
    (f"has(device.attributes['{D}'].profile)", False),
    (f"device.attributes['{D}'].?profile.orValue('none') == 'none'", True),            # optionals
    (f"cel.bind(g, device.attributes['{D}'], g.type == 'gpu' && g.migCapable)", True),
    # quantities: exact, across suffixes; 81559Mi is less than 80Gi (81920Mi)
    (f"device.capacity['{D}'].memory.compareTo(quantity('40Gi')) >= 0", True),
    (f"device.capacity['{D}'].memory.isGreaterThan(quantity('80Gi'))", False),
    (f"device.capacity['{D}'].memory.isLessThan(quantity('80Gi'))", True),
    (f"device.capacity['{D}'].memory == quantity('81559Mi')", True),
    ("quantity('1') == quantity('1000m') && quantity('1k') == quantity('1000')", True),
    ("quantity('1Gi').add(quantity('1Gi')) == quantity('2Gi') && quantity('2Gi').sub(1) .isLessThan(quantity('2Gi'))", True),
    ("quantity('500m').isInteger() == false && quantity('3').asInteger() == 3 && quantity('0').sign() == 0", True),
    (f"device.capacity['{D}'].multiprocessors.asInteger() > 100", True),
    ("isQuantity('10Gi') && !isQuantity('ten')", True),
    # semver: numeric, not textual; a pre-release ranks below its release
    (f"device.attributes['{D}'].driverVersion.isGreaterThan(semver('550.0.0'))", True),
    (f"device.attributes['{D}'].driverVersion.compareTo(semver('580.95.10')) < 0", True),
    (f"device.attributes['{D}'].driverVersion.major() == 580 && device.attributes['{D}'].driverVersion.minor() == 95", True),
    ("semver('1.2.3-alpha').isLessThan(semver('1.2.3')) && semver('1.2.3-alpha.2').isLessThan(semver('1.2.3-alpha.10'))", True),
    ("semver('1.2.3').patch() == 3 && isSemver('1.0.0') && !isSemver('1.0')", True),
])
def test_selector_environment(expression: str, expected: bool) -> None:
    assert matches(expression) is expected


@pytest.mark.parametrize("expression, words", [
    ("device.attributes['x'].list.isSorted()", "undeclared reference to 'isSorted'"),
    ("url('https://example.com').getHost() == 'example.com'", "undeclared reference to 'url'"),
    ("device.attributes[", "Syntax error"),
])
def test_what_the_environment_lacks_cannot_be_evaluated(expression: str, words: str) -> None:
    with pytest.raises(CelUnsupported) as err:
        compile_selector(expression)
    assert words in str(err.value)


@pytest.mark.parametrize("expression, words", [
    (f"device.attributes['{D}'].profile == '1g.10gb'", "profile"),        # no such key, as in the scheduler
    (f"device.attributes['{D}'].productName", "not bool"),
    ("quantity('ten').sign() == 1", "not a Kubernetes quantity"),
    ("quantity('1').compareTo(semver('1.0.0')) == 0", "compareTo(quantity, semver)"),
    (f"device.attributes['{D}'].index.startsWith('0')", "No matching overloads"),
])
def test_runtime_errors_are_reported_not_guessed(expression: str, words: str) -> None:
    with pytest.raises(CelRuntimeError) as err:
        matches(expression)
    assert words in str(err.value)


def test_every_class_of_the_driver_compiles_and_selects_its_kind() -> None:
    mig = {**GPU0, "name": "gpu-0-mig-1g10gb-19-6", "attributes": {**GPU0["attributes"], "type": {"string": "mig"}}}
    by_name = {c["metadata"]["name"]: c["spec"]["selectors"][0]["cel"]["expression"] for c in CLASSES}
    assert matches(by_name[D]) and not matches(by_name[D], mig)
    assert matches(by_name[f"mig.{D}"], mig) and not matches(by_name[f"mig.{D}"])
    assert not matches(by_name[f"hopper.{D}"])            # has() guard: no family attribute, no error


# ----------------------------------------------------------------------------------------- device fit

def test_tolerations_follow_kubernetes_matching() -> None:
    taint = {"key": "maint", "value": "soon", "effect": "NoSchedule"}
    assert tolerates({"key": "maint", "operator": "Exists"}, taint)
    assert tolerates({"operator": "Exists"}, taint)
    assert tolerates({"key": "maint", "value": "soon"}, taint)                 # Equal is the default
    assert not tolerates({"key": "maint", "value": "later"}, taint)
    assert not tolerates({"key": "maint", "operator": "Exists", "effect": "NoExecute"}, taint)
    assert untolerated_taints([taint, {"key": "info", "effect": "None"}], ()) == ["maint=soon:NoSchedule"]


SHARE = {"name": "gpu-7-shared", "allowMultipleAllocations": True, "attributes": {"type": {"string": "shared"}},
         "capacity": {"memory": {"value": "80Gi", "requestPolicy": {
             "default": "1Gi", "validRange": {"min": "1Gi", "max": "79Gi", "step": "1Gi"}}}}}


def test_consumable_capacity_is_rounded_by_the_request_policy() -> None:
    assert capacity_needs(SHARE, D, (("memory", GI * 5 // 2),)) == ({"memory": 3 * GI}, "")     # step up
    assert capacity_needs(SHARE, D, ()) == ({"memory": GI}, "")                                   # default
    assert capacity_needs(SHARE, D, ((f"{D}/memory", 2 * GI),)) == ({"memory": 2 * GI}, "")       # qualified
    assert "no valid amount" in capacity_needs(SHARE, D, (("memory", 80 * GI),))[1]                # above max
    assert "without capacity cores" in capacity_needs(SHARE, D, (("cores", 1),))[1]
    assert capacity_needs(GPU0, D, (("memory", 40 * GI),)) == ({}, "")              # a floor on whole devices
    assert capacity_needs(GPU0, D, (("memory", 100 * GI),))[1].startswith("too small: memory")


def test_claim_specs_are_read_with_their_alternatives_and_bad_ones_named() -> None:
    spec = read_claim_spec({"devices": {"requests": [
        {"name": "gpu", "firstAvailable": [{"name": "big", "deviceClassName": D, "count": 2},
                                           {"name": "any", "deviceClassName": D}]}],
        "constraints": [{"requests": ["gpu"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}]}})
    (req,) = spec.requests
    assert [a.request for a in req.alternatives] == ["gpu/big", "gpu/any"] and req.alternatives[0].count == 2
    assert spec.constraints[0].applies_to("gpu/any") and not spec.constraints[0].applies_to("nic")
    with pytest.raises(ClaimSpecError, match="request x: no deviceClassName"):
        read_claim_spec({"devices": {"requests": [{"name": "x", "exactly": {}}]}})
    with pytest.raises(ClaimSpecError, match="allocationMode 'Some'"):
        read_claim_spec({"devices": {"requests": [{"name": "x", "exactly": {"deviceClassName": D,
                                                                            "allocationMode": "Some"}}]}})


# ------------------------------------------------------------------------------------------ the explainer

def _attrs(kind: str, gpu: int, **extra: Any) -> dict[str, Any]:
    out = {"type": {"string": kind}, "productName": {"string": "NVIDIA H100 80GB HBM3"},
           "resource.kubernetes.io/pcieRoot": {"string": f"pci0000:{gpu}0"}, "parentUUID": {"string": f"GPU-{gpu}"}}
    out.update({k: {"string": v} for k, v in extra.items()})
    return out


def _slices(node: str = "node-a", gpus: int = 2, taints: dict[str, list[dict[str, Any]]] | None = None,
            count: int = 2) -> list[dict[str, Any]]:
    """A pool of `gpus` H100s: per GPU the whole GPU and two MIG profiles (7g.80gb over all eight memory
    slices, 1g.10gb on slice 0), drawing on one counter set per GPU."""
    slices = [{"metadata": {"name": f"{node}-0"}, "spec": {
        "driver": D, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": count},
        "sharedCounters": [{"name": f"gpu-{g}-counters", "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)}}
                           for g in range(gpus)]}}]
    all_slices = {f"memory-slice-{i}": {"value": "1"} for i in range(8)}
    devices = []
    for g in range(gpus):
        devices += [
            {"name": f"gpu-{g}", "attributes": _attrs("gpu", g), "capacity": {"memory": {"value": "80Gi"}},
             "consumesCounters": [{"counterSet": f"gpu-{g}-counters", "counters": all_slices}]},
            {"name": f"gpu-{g}-mig-7g80gb-0-0", "attributes": _attrs("mig", g, profile="7g.80gb"),
             "capacity": {"memory": {"value": "80Gi"}},
             "consumesCounters": [{"counterSet": f"gpu-{g}-counters", "counters": all_slices}]},
            {"name": f"gpu-{g}-mig-1g10gb-19-0", "attributes": _attrs("mig", g, profile="1g.10gb"),
             "capacity": {"memory": {"value": "10Gi"}},
             "consumesCounters": [{"counterSet": f"gpu-{g}-counters", "counters": {"memory-slice-0": {"value": "1"}}}]},
        ]
    for dev in devices:
        if taints and dev["name"] in taints:
            dev["taints"] = taints[dev["name"]]
    slices.append({"metadata": {"name": f"{node}-1"}, "spec": {
        "driver": D, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": count},
        "devices": devices}})
    return slices


def _claim(name: str, *requests: dict[str, Any], constraints: list[dict[str, Any]] | None = None,
           ns: str = "ml") -> dict[str, Any]:
    return resource_claim(name, ns, requests=requests, constraints=constraints, typed=False)


def _req(name: str = "gpu", cls: str = D, cel: str | None = None, **kw: Any) -> dict[str, Any]:
    return request(name, cls, cel=cel, **kw)


def _allocated(claim: dict[str, Any], node: str, *devices: str, pod: str = "", **result: Any) -> dict[str, Any]:
    out = copy.deepcopy(claim)
    out["status"] = {"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": D, "pool": node, "device": d, **result} for d in devices]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                                                 "values": [node]}]}]}}}
    if pod:
        out["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": "u"}]
    return out


def run(claim: dict[str, Any], slices: list[dict[str, Any]] | None = None,
        others: Sequence[dict[str, Any]] = (), **kw: Any) -> Any:
    return explain([Target(f"ml/{claim['metadata']['name']}", claim)], CLASSES,
                   _slices() if slices is None else slices, [*others, claim], **kw)


PROFILE = f"device.attributes['{D}'].profile == '%s'"


def test_allocatable_names_the_node_and_the_devices_first() -> None:
    exp = run(_claim("c", _req("mig", f"mig.{D}", PROFILE % "1g.10gb")))
    assert exp.verdict == ALLOCATABLE
    assert exp.sentence == "allocatable on node-a: ml/c: mig -> gpu-0-mig-1g10gb-19-0"
    assert format_text(exp).splitlines()[0] == exp.sentence


def test_a_held_gpu_blocks_its_partitions_and_the_holder_is_named() -> None:
    holder = _allocated(_claim("job-7", _req(), ns="train"), "node-a", "gpu-0", pod="job-7-pod")
    one_gpu = _slices(gpus=1)
    exp = run(_claim("c", _req("mig", f"mig.{D}", PROFILE % "1g.10gb")), one_gpu, [holder])
    assert exp.verdict == NOT_ALLOCATABLE
    assert "gpu-0-mig-1g10gb-19-0 is unavailable: counter set gpu-0-counters is used up by gpu-0 held by " \
           "train/job-7 (pod train/job-7-pod)" in format_text(exp)
    (node,) = exp.nodes
    assert node.gpus == ["gpu-0-counters: gpu-0 held by train/job-7 (pod train/job-7-pod); "
                         "largest MIG profile still placeable: none"]
    # With two GPUs the partition goes to the other one.
    exp = run(_claim("c", _req("mig", f"mig.{D}", PROFILE % "7g.80gb")), None, [holder])
    assert exp.sentence == "allocatable on node-a: ml/c: mig -> gpu-1-mig-7g80gb-0-0"
    assert exp.nodes[0].gpus[1] == "gpu-1-counters: nothing allocated; largest MIG profile still placeable: 7g.80gb"


def test_a_small_partition_leaves_only_smaller_profiles_placeable() -> None:
    holder = _allocated(_claim("small", _req()), "node-a", "gpu-0-mig-1g10gb-19-0")
    exp = run(_claim("c", _req("mig", f"mig.{D}", PROFILE % "7g.80gb")), _slices(gpus=1), [holder])
    assert exp.verdict == NOT_ALLOCATABLE and "used up by gpu-0-mig-1g10gb-19-0 held by ml/small" in format_text(exp)
    assert "largest MIG profile still placeable: none" in exp.nodes[0].gpus[0]


def test_taken_devices_name_claim_and_pod() -> None:
    holders = [_allocated(_claim(f"h{i}", _req()), "node-a", f"gpu-{i}", pod=f"p{i}") for i in range(2)]
    exp = run(_claim("c", _req(cel=f"device.attributes['{D}'].type == 'gpu'")), None, holders)
    assert exp.verdict == NOT_ALLOCATABLE
    assert "gpu-0 is held by ml/h0 (pod ml/p0)" in format_text(exp) and "gpu-1 is held by ml/h1 (pod ml/p1)" in format_text(exp)


def test_admin_access_ignores_who_holds_a_device_but_not_the_shared_counters() -> None:
    # The scheduler checks a device's counters whatever the request's adminAccess: a device that consumes no
    # counters is allocatable while held; one whose counter set its holder used up is not.
    no_counters = _slices(gpus=2)
    for dev in no_counters[1]["spec"]["devices"]:
        if dev["name"] == "gpu-1":
            del dev["consumesCounters"]
    holders = [_allocated(_claim(f"h{i}", _req()), "node-a", f"gpu-{i}") for i in range(2)]
    exp = run(_claim("c", _req(adminAccess=True)), no_counters, holders)
    assert exp.verdict == ALLOCATABLE and exp.sentence.endswith("gpu -> gpu-1"), exp.sentence
    exp = run(_claim("c", _req("mig", f"mig.{D}", PROFILE % "1g.10gb", adminAccess=True)), None, holders)
    assert exp.verdict == NOT_ALLOCATABLE and "counter set gpu-0-counters is used up by gpu-0" in format_text(exp)
    # An admin-access holder takes no counters (the scheduler leaves admin allocations out of what is in use).
    admin_holder = _allocated(_claim("h", _req(adminAccess=True)), "node-a", "gpu-0", adminAccess=True)
    exp = run(_claim("c", _req("mig", f"mig.{D}", PROFILE % "1g.10gb", adminAccess=True)), None, [admin_holder])
    assert exp.verdict == ALLOCATABLE, exp.sentence


def test_taints_block_unless_tolerated() -> None:
    taint = {"key": "maint", "value": "planned", "effect": "NoSchedule"}
    slices = _slices(gpus=1, taints={"gpu-0": [taint]})
    exp = run(_claim("c", _req()), slices)
    assert exp.verdict == NOT_ALLOCATABLE and "gpu-0 is tainted maint=planned:NoSchedule, not tolerated" in format_text(exp)
    tolerant = _claim("c", _req(tolerations=[{"key": "maint", "operator": "Exists"}]))
    assert run(tolerant, slices).verdict == ALLOCATABLE
    # A DeviceTaintRule taints the same way.
    rule = {"spec": {"deviceSelector": {"driver": D, "device": "gpu-0"}, "taint": taint}}
    assert run(_claim("c", _req()), _slices(gpus=1), taint_rules=[rule]).verdict == NOT_ALLOCATABLE
    assert run(_claim("c", _req()), _slices(gpus=1), taint_rules=[{"spec": {"taint": taint}}]).verdict == ALLOCATABLE


def test_match_attribute_within_and_across_requests() -> None:
    same_root = _claim("c", _req(count=2), constraints=[{"matchAttribute": "resource.kubernetes.io/pcieRoot"}])
    exp = run(same_root)
    assert exp.verdict == NOT_ALLOCATABLE and "constraint on resource.kubernetes.io/pcieRoot" in format_text(exp)
    pair = _claim("c", _req("a", f"mig.{D}", PROFILE % "1g.10gb"), _req("b", f"mig.{D}", PROFILE % "1g.10gb"),
                  constraints=[{"requests": ["a", "b"], "matchAttribute": f"{D}/parentUUID"}])
    assert run(pair).verdict == NOT_ALLOCATABLE               # both would need memory slice 0 of one GPU
    apart = copy.deepcopy(pair)
    apart["spec"]["devices"]["constraints"] = [{"requests": ["a", "b"], "distinctAttribute": f"{D}/parentUUID"}]
    exp = run(apart)
    assert exp.verdict == ALLOCATABLE and exp.nodes[0].chosen == {"ml/c: a": ["gpu-0-mig-1g10gb-19-0"],
                                                                  "ml/c: b": ["gpu-1-mig-1g10gb-19-0"]}


def test_count_and_all_mode() -> None:
    exp = run(_claim("c", _req(count=3)))
    assert exp.verdict == NOT_ALLOCATABLE and "needs 3 devices, only 2 match" in format_text(exp)
    assert run(_claim("c", _req(count=2))).verdict == ALLOCATABLE
    exp = run(_claim("c", _req(allocationMode="All")))
    assert exp.verdict == ALLOCATABLE and exp.nodes[0].chosen == {"ml/c: gpu": ["gpu-0", "gpu-1"]}
    holder = _allocated(_claim("h", _req()), "node-a", "gpu-1-mig-1g10gb-19-0")
    exp = run(_claim("c", _req(allocationMode="All")), None, [holder])
    assert exp.verdict == NOT_ALLOCATABLE and "all 2 matching devices are needed, 1 cannot be allocated" in format_text(exp)


def test_first_available_takes_the_first_subrequest_that_fits() -> None:
    claim = _claim("c", {"name": "gpu", "firstAvailable": [
        {"name": "h200", "deviceClassName": D, "selectors": [
            {"cel": {"expression": f"device.attributes['{D}'].productName == 'NVIDIA H200'"}}]},
        {"name": "any", "deviceClassName": D}]})
    exp = run(claim)
    assert exp.verdict == ALLOCATABLE and exp.sentence.endswith("ml/c: gpu/any -> gpu-0")
    holders = [_allocated(_claim(f"h{i}", _req()), "node-a", f"gpu-{i}") for i in range(2)]
    exp = run(claim, None, holders)
    assert "request gpu: no alternative fits (gpu/h200: none of the 2 devices" in format_text(exp)


def test_consumable_capacity_left_on_a_memory_share() -> None:
    slices = [{"metadata": {"name": "s"}, "spec": {"driver": D, "nodeName": "node-a",
                                                   "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                                                   "devices": [SHARE]}}]
    share = f"shared.{D}"
    holder = _allocated(_claim("big", _req("share", share)), "node-a", "gpu-7-shared", consumedCapacity={"memory": "70Gi"})
    wants = _claim("c", _req("share", share, capacity={"requests": {"memory": "20Gi"}}))
    exp = run(wants, slices, [holder])
    assert exp.verdict == NOT_ALLOCATABLE and "gpu-7-shared is short of memory: 10Gi left, 20Gi needed" in format_text(exp)
    fits = _claim("c", _req("share", share, capacity={"requests": {"memory": "10Gi"}}))
    assert run(fits, slices, [holder]).verdict == ALLOCATABLE
    two = _claim("c", _req("a", share, capacity={"requests": {"memory": "6Gi"}}),
                 _req("b", share, capacity={"requests": {"memory": "6Gi"}}))
    exp = run(two, slices, [holder])                       # each fits alone, not both together
    assert exp.verdict == NOT_ALLOCATABLE and "together need more" in format_text(exp)


def _with_slots_device(slots: int = 2) -> list[dict[str, Any]]:
    """One H100 of _slices plus the capacity layout's slot device: every memory slice once, `slots` shares."""
    out = _slices(gpus=1)
    out[1]["spec"]["devices"].append({
        "name": "gpu-0-slots", "attributes": _attrs("slot", 0, sharing="mps"), "allowMultipleAllocations": True,
        "capacity": {"slots": {"value": str(slots), "requestPolicy": {
            "default": "1", "validRange": {"min": "1", "max": str(slots), "step": "1"}}}},
        "consumesCounters": [{"counterSet": "gpu-0-counters",
                              "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)}}]})
    return out


def test_a_slot_device_charges_its_counters_once_however_many_shares() -> None:
    slices, slot = _with_slots_device(), f"slot.{D}"
    share = _allocated(_claim("s1", _req("slot", slot)), "node-a", "gpu-0-slots", pod="p1",
                       shareID="a", consumedCapacity={"slots": "1"})
    exp = run(_claim("c", _req("slot", slot)), slices, [share])
    assert exp.verdict == ALLOCATABLE and exp.sentence.endswith("slot -> gpu-0-slots"), format_text(exp)
    whole = run(_claim("w", _req()), slices, [share])
    assert whole.verdict == NOT_ALLOCATABLE
    assert "counter set gpu-0-counters is used up by gpu-0-slots held by ml/s1 (pod ml/p1)" in format_text(whole)
    # Two shares of one claim on a free GPU: the counters are taken by the first only.
    assert run(_claim("two", _req("a", slot), _req("b", slot)), slices).verdict == ALLOCATABLE
    # Its slots are what bounds the shares.
    full = run(_claim("c", _req("slot", slot)), slices,
               [share, _allocated(_claim("s2", _req("slot", slot)), "node-a", "gpu-0-slots", shareID="b",
                                  consumedCapacity={"slots": "1"})])
    assert full.verdict == NOT_ALLOCATABLE and "gpu-0-slots is short of slots: 0 left, 1 needed" in format_text(full)
    held = run(_claim("c", _req("slot", slot)), slices, [_allocated(_claim("w", _req()), "node-a", "gpu-0")])
    assert held.verdict == NOT_ALLOCATABLE and "used up by gpu-0 held by ml/w" in format_text(held)


def _with_mig_instances_device(instances: int = 7) -> list[dict[str, Any]]:
    """One H100 of _slices, its 1g.10gb as one device with capacity (dynamicMig.layout: capacity): every memory
    slice once, `instances` shares, per-instance figures as attributes."""
    out = _slices(gpus=1)
    devices = out[1]["spec"]["devices"]
    devices[:] = [d for d in devices if "-mig-" not in d["name"]]
    devices.append({
        "name": "gpu-0-mig-1g10gb-19", "allowMultipleAllocations": True,
        "attributes": {**_attrs("mig", 0, profile="1g.10gb"), "instanceMemoryMiB": {"int": 9984}},
        "capacity": {"instances": {"value": str(instances), "requestPolicy": {
            "default": "1", "validRange": {"min": "1", "max": str(instances), "step": "1"}}}},
        "consumesCounters": [{"counterSet": "gpu-0-counters",
                              "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)}}]})
    return out


def test_a_mig_device_with_instances_charges_its_counters_once_and_its_instances_bound_the_shares() -> None:
    slices, mig = _with_mig_instances_device(instances=3), f"mig.{D}"
    one_g = PROFILE % "1g.10gb"
    share = _allocated(_claim("m1", _req("mig", mig, one_g)), "node-a", "gpu-0-mig-1g10gb-19", pod="p1",
                       shareID="a", consumedCapacity={"instances": "2"})
    exp = run(_claim("c", _req("mig", mig, one_g)), slices, [share])
    assert exp.verdict == ALLOCATABLE and exp.sentence.endswith("mig -> gpu-0-mig-1g10gb-19"), format_text(exp)
    whole = run(_claim("w", _req()), slices, [share])
    assert whole.verdict == NOT_ALLOCATABLE
    assert "counter set gpu-0-counters is used up by gpu-0-mig-1g10gb-19 held by ml/m1 (pod ml/p1)" in format_text(whole)
    two = run(_claim("c", _req("mig", mig, one_g, capacity={"requests": {"instances": "2"}})), slices, [share])
    assert two.verdict == NOT_ALLOCATABLE
    assert "gpu-0-mig-1g10gb-19 is short of instances: 1 left, 2 needed" in format_text(two), format_text(two)
    held = run(_claim("c", _req("mig", mig, one_g)), slices, [_allocated(_claim("w", _req()), "node-a", "gpu-0")])
    assert held.verdict == NOT_ALLOCATABLE and "used up by gpu-0 held by ml/w" in format_text(held)


def test_claims_of_one_pod_are_allocated_together() -> None:
    a, b = _claim("a", _req()), _claim("b", _req())
    exp = explain([Target("ml/a", a), Target("ml/b", b)], CLASSES, _slices(gpus=1), [a, b])
    assert exp.verdict == NOT_ALLOCATABLE and "together" in format_text(exp)
    exp = explain([Target("ml/a", a), Target("ml/b", b)], CLASSES, _slices(gpus=2), [a, b])
    assert exp.verdict == ALLOCATABLE and exp.nodes[0].chosen == {"ml/a: gpu": ["gpu-0"], "ml/b: gpu": ["gpu-1"]}
    # A claim of the pod that is already allocated ties the others to its node.
    done = _allocated(a, "node-b", "gpu-0")
    exp = explain([Target("ml/a", done), Target("ml/b", b)], CLASSES, _slices() + _slices("node-b"), [done, b])
    assert [n.node for n in exp.nodes] == ["node-b"] and exp.allocatable_nodes() == ["node-b"]
    assert exp.nodes[0].chosen == {"ml/b: gpu": ["gpu-1"]}             # gpu-0 is the pod's other claim's


def test_an_allocated_claim_says_where() -> None:
    done = _allocated(_claim("c", _req()), "node-a", "gpu-1")
    exp = run(done)
    assert exp.verdict == ALLOCATED and exp.sentence == "already allocated: ml/c on node-a: gpu-1"


def test_incomplete_pools_missing_classes_and_unknown_functions() -> None:
    exp = run(_claim("c", _req()), _slices(count=3))
    assert exp.verdict == NOT_ALLOCATABLE and exp.notes == ["pool node-a is incomplete (2 of 3 slices at generation 1)"]
    exp = run(_claim("c", _req(cls="nosuch.example.com")))
    assert exp.verdict == NOT_ALLOCATABLE and "DeviceClass nosuch.example.com does not exist" in format_text(exp)
    exp = run(_claim("c", _req(cel="device.attributes['x'].list.isSorted()")))
    assert exp.verdict == CANNOT_EVALUATE and exp.sentence.startswith("cannot evaluate: ")
    assert "isSorted" in format_text(exp)
    exp = run(_claim("c", _req(cel=f"device.attributes['{D}'].nosuch == 'x'")))
    assert exp.verdict == NOT_ALLOCATABLE
    assert f"claim ml/c: selector #0 on device {D}/node-a/gpu-0: CEL runtime error: no such key: nosuch" in format_text(exp)


def test_a_cel_error_counts_only_where_the_scheduler_reaches_the_device() -> None:
    """The allocator goes through the devices in order and stops at the first fit: an error on a later device
    is never seen; one on the first device it tries stops it; held devices are skipped before the selectors."""
    failing_on_gpu1 = f"device.attributes['{D}'].index == 0"      # gpu-0 has index 0, gpu-1 none
    slices = _slices(gpus=2)
    slices[1]["spec"]["devices"][0]["attributes"]["index"] = {"int": 0}
    exp = run(_claim("c", _req(cel=failing_on_gpu1)), slices)
    assert exp.verdict == ALLOCATABLE and exp.sentence.endswith("gpu -> gpu-0"), exp.sentence
    exp = run(_claim("c", _req(cel=failing_on_gpu1, count=2)), slices)
    assert exp.verdict == NOT_ALLOCATABLE and "on device gpu.example.com/node-a/gpu-1: CEL runtime error: no such key: index" \
        in format_text(exp), exp.sentence
    failing_on_gpu0 = f"device.attributes['{D}'].index == 1"
    slices[1]["spec"]["devices"][0]["attributes"]["index"] = {"int": 0}
    slices[1]["spec"]["devices"][3]["attributes"]["index"] = {"int": 1}
    del slices[1]["spec"]["devices"][0]["attributes"]["index"]
    exp = run(_claim("c", _req(cel=failing_on_gpu0)), slices)
    assert exp.verdict == NOT_ALLOCATABLE and "gpu-0: CEL runtime error: no such key" in format_text(exp)
    holder = _allocated(_claim("h", _req()), "node-a", "gpu-0")
    exp = run(_claim("c", _req(cel=failing_on_gpu0)), slices, [holder])
    assert exp.verdict == ALLOCATABLE and exp.sentence.endswith("gpu -> gpu-1"), exp.sentence
    # allocationMode All checks every device's selectors first, held ones too; a taint is checked after them.
    exp = run(_claim("c", _req(cel=failing_on_gpu1, allocationMode="All")), _slices(gpus=2))
    assert exp.verdict == NOT_ALLOCATABLE and "CEL runtime error: no such key" in format_text(exp)
    exp = run(_claim("c", _req(cel=failing_on_gpu0, allocationMode="All")), slices, [holder])
    assert exp.verdict == NOT_ALLOCATABLE and "gpu-0: CEL runtime error: no such key" in format_text(exp)
    tainted = copy.deepcopy(slices)
    tainted[1]["spec"]["devices"][0]["taints"] = [{"key": "maint", "effect": "NoSchedule"}]
    exp = run(_claim("c", _req(cel=failing_on_gpu0)), tainted)
    assert exp.verdict == NOT_ALLOCATABLE and "gpu-0: CEL runtime error: no such key" in format_text(exp)


def test_the_claim_limit_of_32_devices() -> None:
    """AllocationResultsMaxSize: allocationMode All over more than 32 devices, or requests adding up to more,
    are refused as the scheduler refuses them."""
    mig = f"mig.{D}"
    exp = run(_claim("c", _req("all", mig, allocationMode="All")), _slices(gpus=17))       # 34 MIG devices
    assert exp.verdict == NOT_ALLOCATABLE
    assert "ml/c: request all: adding 34 devices exceeds the claim limit of 32, with 0 already accounted for" \
        in format_text(exp), exp.sentence
    exp = run(_claim("c", _req("a", mig, PROFILE % "1g.10gb", count=17), _req("b", mig, PROFILE % "7g.80gb", count=17)),
              _slices(gpus=40))
    assert exp.verdict == NOT_ALLOCATABLE
    assert "request b: adding 17 devices exceeds the claim limit of 32, with 17 already accounted for" in format_text(exp)
    exp = run(_claim("c", _req("a", mig, PROFILE % "1g.10gb", count=16), _req("b", mig, PROFILE % "7g.80gb", count=16)),
              _slices(gpus=40))
    assert exp.verdict == ALLOCATABLE, exp.sentence
    assert len(exp.sentence) < 200 and len(format_text(exp).splitlines()[0]) < 200


def test_distinct_attribute_beyond_the_distinct_values_is_answered_quickly() -> None:
    import time
    mig = f"mig.{D}"
    slices = _slices(gpus=8)
    for g in range(8):       # six more 1g.10gb placements per GPU, each on its own memory slice
        for k in range(1, 7):
            slices[1]["spec"]["devices"].append(
                {"name": f"gpu-{g}-mig-1g10gb-19-{k}", "attributes": _attrs("mig", g, profile="1g.10gb"),
                 "capacity": {"memory": {"value": "10Gi"}},
                 "consumesCounters": [{"counterSet": f"gpu-{g}-counters", "counters": {f"memory-slice-{k}": {"value": "1"}}}]})
    began = time.monotonic()
    exp = run(_claim("c", _req("mig", mig, PROFILE % "1g.10gb", count=9),
                     constraints=[{"distinctAttribute": f"{D}/parentUUID"}]), slices)
    assert time.monotonic() - began < 1.0
    assert exp.verdict == NOT_ALLOCATABLE, exp.sentence
    assert f"needs 9 devices with distinct {D}/parentUUID; the free matching devices have 8 distinct values" \
        in format_text(exp), exp.sentence
    exp = run(_claim("c", _req("mig", mig, PROFILE % "1g.10gb", count=8),
                     constraints=[{"distinctAttribute": f"{D}/parentUUID"}]), slices)
    assert exp.verdict == ALLOCATABLE, exp.sentence


def test_a_search_past_its_limit_is_undecided_not_guessed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(explain_mod, "SEARCH_LIMIT", 1)
    exp = run(_claim("c", _req(count=2), constraints=[{"matchAttribute": "resource.kubernetes.io/pcieRoot"}]))
    assert exp.verdict == CANNOT_EVALUATE and "search stopped after 1 steps at ml/c: request gpu" in format_text(exp)


def test_json_form_carries_the_verdict() -> None:
    doc = run(_claim("c", _req(count=3))).to_dict()
    assert doc["allocatable"] is False and doc["verdict"] == NOT_ALLOCATABLE
    assert doc["nodes"][0]["requests"][0]["matching"] == 2


def test_shared_devices_show_the_capacity_left_and_missing_nodes_are_noted() -> None:
    slices = [{"metadata": {"name": "s"}, "spec": {"driver": D, "nodeName": "node-a",
                                                   "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                                                   "devices": [SHARE]}}]
    holder = _allocated(_claim("big", _req("share", f"shared.{D}")), "node-a", "gpu-7-shared",
                        consumedCapacity={"memory": "70Gi"})
    exp = run(_claim("c", _req("share", f"shared.{D}")), slices, [holder])
    assert exp.nodes[0].requests[0].capacity_left == ["gpu-7-shared: memory 10Gi of 80Gi left"]
    assert "    capacity: gpu-7-shared: memory 10Gi of 80Gi left" in format_text(exp)
    exp = run(_claim("c", _req()), _slices() + _slices("node-b"), nodes=["node-b"])
    assert [n.node for n in exp.nodes] == ["node-b"]
    assert exp.notes == ["no Node object for node-a: the scheduler cannot place pods there"]


def test_the_readme_example_is_what_the_command_prints(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """README's explain output, rebuilt from a simulated node's slices (two H100s, whole GPU and dynamic MIG)."""
    from pathlib import Path

    import yaml

    from cli.main import main

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("nodes:\n- name: node-a\n  gpus: [{model: H100-80GB, count: 2}]\n"
                     "  policy: {default: {wholeGpu: true, mig: dynamic}}\n")
    assert main(["slices", "--fleet", str(fleet), "--node", "node-a"]) == 0
    slices = list(yaml.safe_load_all(capsys.readouterr().out))
    driver = "gpu.dra-driver.io"

    def held(ns: str, name: str, device: str, pod: str) -> dict[str, Any]:
        return {"metadata": {"namespace": ns, "name": name}, "spec": {}, "status": {
            "allocation": {"devices": {"results": [{"request": "gpu", "driver": driver, "pool": "node-a",
                                                    "device": device}]}},
            "reservedFor": [{"resource": "pods", "name": pod, "uid": "u"}]}}

    claim = {"metadata": {"namespace": "ml", "name": "notebook-mig"}, "spec": {"devices": {"requests": [
        {"name": "mig", "exactly": {"deviceClassName": f"mig.{driver}", "selectors": [
            {"cel": {"expression": f"device.attributes['{driver}'].profile == '7g.80gb'"}}]}}]}}}
    exp = explain([Target("ml/notebook-mig", claim)], device_classes(), slices,
                  [held("train", "job-7", "gpu-0", "job-7-0"), held("train", "job-8", "gpu-1-mig-4g40gb-5-0", "job-8-0"),
                   claim], nodes=["node-a"])
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "$ gpu-dra explain -n ml claim/notebook-mig\n" + format_text(exp) + "```" in readme


@pytest.mark.parametrize("target, namespace, words", [
    ("node/x", "ml", "the kind before '/' must be one of claim, template, pod"),
    ("claim/", "ml", "no name given"),
    ("claim/../../api/v1/secrets", "ml", "the kind before '/' must be one of"),
    ("claim/Big_Name", "ml", "'Big_Name' is not a Kubernetes object name"),
    ("claim/x", "../kube-system", "namespace '../kube-system' is not a Kubernetes namespace name"),
])
def test_explain_refuses_targets_that_are_not_names_before_any_request(target: str, namespace: str,
                                                                       words: str) -> None:
    from ops.explain.reads import ExplainTargetError, find_targets

    class NoApi:
        def get(self, path: str, **query: Any) -> Any:
            raise AssertionError(f"no request expected, got GET {path}")

    with pytest.raises(ExplainTargetError) as err:
        find_targets(NoApi(), target, namespace)  # type: ignore[arg-type]
    assert words in str(err.value)


def test_cli_names_bad_arguments_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    # 5: no usable kubeconfig (cli.failures)
    assert main(["explain", "claim/x", "-n", "Not_A_Namespace", "--kubeconfig", "/nonexistent/kubeconfig"]) == 5
    err = capsys.readouterr().err.strip()
    assert err == "gpu-dra explain: --kubeconfig /nonexistent/kubeconfig: no such file"


def test_a_pods_extended_resources_are_explained_as_the_scheduler_claims_them() -> None:
    """`nvidia.com/gpu: 1` through a DeviceClass's extendedResourceName: before scheduling, the claim the scheduler
    would create; after, the claim named in status.extendedResourceClaimStatus."""
    from ops.explain.reads import ExplainTargetError, find_targets

    classes = [{**c, "spec": {**c["spec"], "extendedResourceName": "nvidia.com/gpu"}} if c["metadata"]["name"] == D
               else c for c in CLASSES]
    pod = {"metadata": {"name": "p", "namespace": "ml"}, "spec": {"containers": [
        {"name": "a", "resources": {"requests": {"cpu": "1", "nvidia.com/gpu": "2"}}},
        {"name": "b", "resources": {"requests": {f"deviceclass.resource.kubernetes.io/mig.{D}": "1"}}}]}}
    made = _allocated(_claim("p-gpu-x7k", _req()), "node-a", "gpu-0")

    class Api:
        def __init__(self, pod: dict[str, Any]) -> None:
            self.pod = pod

        def get(self, path: str, **query: Any) -> Any:
            from kube.client import ApiError
            if path.endswith("/pods/p"):
                return self.pod
            if path.endswith("/resourceclaims/p-gpu-x7k"):
                return made
            raise ApiError("GET", path, 404, "{}")

        def list(self, path: str, **kw: Any) -> Any:
            return {"items": classes}

        def server_version(self) -> tuple[int, int]:
            return 1, 37

    found = find_targets(Api(pod), "pod/p", "ml")  # type: ignore[arg-type]
    ((name, claim),) = found.claims
    assert name == "ml/p (extended resources, as the scheduler would create it)"
    assert claim["spec"]["devices"]["requests"] == [          # in name order, as the scheduler sorts them
        {"name": "container-0-request-1", "exactly": {"deviceClassName": D, "allocationMode": "ExactCount",
                                                      "count": 2}},
        {"name": "container-1-request-0", "exactly": {"deviceClassName": f"mig.{D}", "allocationMode": "ExactCount",
                                                      "count": 1}}]
    exp = explain([Target(name, claim)], classes, _slices(gpus=3), [])
    assert exp.verdict == ALLOCATABLE, exp.sentence
    scheduled = {**pod, "status": {"extendedResourceClaimStatus": {"resourceClaimName": "p-gpu-x7k", "requestMappings": []}}}
    assert find_targets(Api(scheduled), "pod/p", "ml").claims == [("ml/p-gpu-x7k (extended resources)", made)]  # type: ignore[arg-type]
    with pytest.raises(ExplainTargetError, match="no resource claims and asks for no extended resource"):
        find_targets(Api({**pod, "spec": {"containers": [{"name": "a"}]}}), "pod/p", "ml")  # type: ignore[arg-type]


def test_no_matching_mig_profile_names_those_there_are() -> None:
    exp = run(_claim("c", _req("mig", f"mig.{D}", PROFILE % "1g.12gb")))
    assert exp.verdict == NOT_ALLOCATABLE
    assert "matches the selectors (MIG profiles there: 7g.80gb, 1g.10gb)" in format_text(exp), format_text(exp)


def test_a_memory_share_outside_the_request_policy_names_the_valid_range() -> None:
    assert capacity_needs(SHARE, D, (("memory", 80 * GI),))[1] == \
        "outside the memory request policy: no valid amount for 80Gi (valid: 1Gi to 79Gi in steps of 1Gi)"


def test_an_opaque_config_the_plugin_refuses_is_named_in_the_webhooks_words() -> None:
    """The scheduler allocates a claim whatever its opaque config says; the node plugin then refuses to prepare
    it. explain keeps the scheduler's verdict and says so, with the decoder's message."""
    claim = _claim("c", _req())
    claim["spec"]["devices"]["config"] = [{"opaque": {"driver": D, "parameters": {
        "apiVersion": "gpu.dra-driver.io/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentge": 25}}}}},
        {"opaque": {"driver": "nic.example.com", "parameters": {"anything": 1}}}]     # another driver's: not ours
    exp = run(claim)
    assert exp.verdict == ALLOCATABLE
    assert exp.sentence.startswith("allocatable on node-a, but the node plugin will not prepare it: ml/c: "), exp.sentence
    assert exp.config_problems == [
        "ml/c: gpu.dra-driver.io/v1alpha1 GpuConfig: spec.devices.config[0].opaque.parameters.sharing.mps."
        "activeThreadPercentge: unknown field (known fields: activeThreadPercentage, pinnedMemoryLimit, "
        "perDevicePinnedMemoryLimit)"]
    assert f"config refused: {exp.config_problems[0]}" in format_text(exp)


def _counts(claim: dict[str, Any] | None) -> list[tuple[str, int]]:
    return [(r["name"], r["exactly"]["count"]) for r in (claim or {}).get("spec", {}).get("devices", {}).get("requests", [])]


def test_init_containers_count_as_the_kubelet_runs_them() -> None:
    """An init container runs before the app containers and hands its devices on: it reuses the requests of the
    long-lived containers after it (app containers, sidecars) and asks only for the rest, and only the largest
    such need is requested. `nvidia.com/gpu: 9` in an init container and 1 in the app container is 9 GPUs (not
    allocatable on an 8-GPU node); servers before 1.37 gave each container a request of its own."""
    from ops.explain.reads import pod_extended_resource_claim

    classes = [{**c, "spec": {**c["spec"], "extendedResourceName": "nvidia.com/gpu"}} if c["metadata"]["name"] == D
               else c for c in CLASSES]

    def pod(inits: list[dict[str, Any]], apps: list[dict[str, Any]]) -> dict[str, Any]:
        return {"metadata": {"name": "p", "namespace": "ml"}, "spec": {"initContainers": inits, "containers": apps}}

    def gpu(n: int, name: str = "c", always: bool = False) -> dict[str, Any]:
        return {"name": name, "resources": {"requests": {"nvidia.com/gpu": str(n)}},
                **({"restartPolicy": "Always"} if always else {})}

    big_init = pod([gpu(9, "init")], [gpu(1, "app")])
    assert _counts(pod_extended_resource_claim(big_init, classes)) == [("container-0-request-0", 8),
                                                                       ("container-1-request-0", 1)]
    exp = explain([Target("ml/p (extended resources)", pod_extended_resource_claim(big_init, classes))], classes,
                  _slices(gpus=8), [])
    assert exp.verdict == NOT_ALLOCATABLE, exp.sentence
    # The init container's need is covered by what the app containers get: nothing more.
    assert _counts(pod_extended_resource_claim(pod([gpu(1, "init")], [gpu(2, "a"), gpu(1, "b")]), classes)) == [
        ("container-1-request-0", 2), ("container-2-request-0", 1)]
    # Several init containers: the largest remainder only; a sidecar is long-lived and reusable by those before it.
    three = pod([gpu(3, "i0"), gpu(1, "side", always=True), gpu(5, "i2")], [gpu(1, "app")])
    assert _counts(pod_extended_resource_claim(three, classes)) == [("container-1-request-0", 1),
                                                                    ("container-2-request-0", 4),
                                                                    ("container-3-request-0", 1)]
    assert _counts(pod_extended_resource_claim(big_init, classes, server_minor=34)) == [("container-0-request-0", 9),
                                                                                        ("container-1-request-0", 1)]
    # A resource asked for by an init container only is still the pod's.
    assert _counts(pod_extended_resource_claim(pod([gpu(2, "init")], [{"name": "app"}]), classes)) == [
        ("container-0-request-0", 2)]
