"""ResourceSlice packing under the API limits, per-server features, and the validator itself."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
from gpu_fixtures import a30, from_catalog, h100, inventory, l4, with_instances

from dra.model.devices import build_devices
from dra.model.policy import parse_node_policy
from dra.model.slices import (
    ApiFeatures,
    apply_features,
    build_pool_slices,
    desired_pool_slices,
    plan_pool,
    validate_pool,
    validate_slice_spec,
)

DRIVER = "gpu.dra-driver.io"
ALL = ApiFeatures.all()
OLD = ApiFeatures.for_server(35)


def policy(data):
    return parse_node_policy(data, "test")


def device_slices(specs):
    return [s for s in specs if "devices" in s]


def counter_slices(specs):
    return [s for s in specs if "sharedCounters" in s]


@pytest.mark.parametrize("minor, expected", [(34, False), (35, False), (36, True), (37, True), (38, True)])
def test_features_for_server(minor, expected):
    f = ApiFeatures.for_server(minor)
    assert (f.partitionable, f.consumable_capacity, f.device_taints) == (expected,) * 3


BIG_NODES = {
    "8xH200-dynamic-4mps": ([from_catalog("H200-141GB", i) for i in range(8)],
                            {"default": {"mig": "dynamic", "slots": {"count": 4, "strategy": "mps"}}}),
    "16xH100-dynamic-8slots": ([h100(i) for i in range(16)],
                               {"default": {"mig": "dynamic", "slots": {"count": 8}}}),
    "8xA100-40GB-mig-on-dynamic": ([from_catalog("A100-40GB", i, mig_enabled=True) for i in range(8)],
                                   {"default": {"mig": "dynamic"}}),
    "8xB200-64slots": ([from_catalog("B200", i) for i in range(8)],
                       {"default": {"mig": "dynamic", "slots": {"count": 64}}}),
    "mixed": ([h100(0), with_instances(h100(1), [(9, 0), (9, 4)]), a30(2), l4(3), l4(4),
               replace(h100(5), healthy=False, health_reason="XID 79")],
              {"rules": [{"match": {"index": 0}, "mig": "dynamic", "slots": {"count": 2}},
                         {"match": {"index": 1}, "mig": "static"},
                         {"match": {"index": 2}, "mig": "dynamic"},
                         {"match": {"index": 3}, "memoryShares": {}},
                         {"match": {"index": 4}, "slots": {"count": 16, "strategy": "mps"}}],
               "default": {"mig": "dynamic"}}),
    "200xL4-whole": ([l4(i) for i in range(200)], None),
}


@pytest.mark.parametrize("name", list(BIG_NODES))
@pytest.mark.parametrize("features", [ALL, OLD], ids=["1.37", "1.35"])
def test_big_nodes_validate(name, features):
    gpus, pol = BIG_NODES[name]
    plan = plan_pool(inventory(*gpus), policy(pol), DRIVER, "node-a", features)
    specs = plan.slices
    assert specs or (features == OLD and "A100" in name)  # Ampere in MIG mode: dynamic MIG or nothing
    assert validate_pool(specs) == []
    for s in specs:
        assert s["pool"] == {"name": "node-a", "resourceSliceCount": len(specs)}
        assert s["nodeName"] == "node-a" and s["driver"] == DRIVER
        assert ("devices" in s) != ("sharedCounters" in s)
        assert len(s.get("sharedCounters", [])) <= 8
        limit = 64 if any(d.get("consumesCounters") or d.get("taints") for d in s.get("devices", [])) else 128
        assert len(s.get("devices", [])) <= limit
    # every device of the model that the server can take is published exactly once
    published = [d["name"] for s in device_slices(specs) for d in s["devices"]]
    assert len(published) == len(set(published))
    model = build_devices(inventory(*gpus), policy(pol), driver=DRIVER)
    kept, _, _ = apply_features(model.devices, model.counter_sets, features)
    assert published == [d.name for d in kept]
    if features == OLD:
        assert not counter_slices(specs)
        assert all("consumesCounters" not in d and "taints" not in d and not d.get("allowMultipleAllocations")
                   for s in specs for d in s["devices"])


def test_counter_slices_come_first_and_hold_at_most_8_sets():
    specs = desired_pool_slices(inventory(*[h100(i) for i in range(16)]), policy({"default": {"mig": "dynamic"}}),
                                DRIVER, "node-a", ALL)
    assert [len(s["sharedCounters"]) for s in specs[:2]] == [8, 8]
    assert all("devices" in s for s in specs[2:])
    assert [cs["name"] for s in specs[:2] for cs in s["sharedCounters"]] == [f"gpu-{i}-counters" for i in range(16)]


def test_one_gpus_devices_stay_in_one_slice():
    specs = desired_pool_slices(inventory(*[h100(i) for i in range(8)]),
                                policy({"default": {"mig": "dynamic", "slots": {"count": 4}}}), DRIVER, "n", ALL)
    where: dict[str, set[int]] = {}
    for i, s in enumerate(device_slices(specs)):
        for d in s["devices"]:
            where.setdefault(d["name"].split("-")[1], set()).add(i)
    assert all(len(v) == 1 for v in where.values())
    assert [len(s["devices"]) for s in device_slices(specs)] == [60] * 4   # 2 GPUs x 30 devices per slice


def test_plain_devices_pack_128_per_slice():
    specs = desired_pool_slices(inventory(*[l4(i) for i in range(200)]), policy(None), DRIVER, "n", ALL)
    assert [len(s["devices"]) for s in specs] == [128, 72]


def test_a_gpu_larger_than_a_slice_is_split():
    # 64 slots + whole + 25 partitions = 90 devices with counters: more than 64 per slice
    specs = desired_pool_slices(inventory(from_catalog("B200")),
                                policy({"default": {"mig": "dynamic", "slots": {"count": 64}}}), DRIVER, "n", ALL)
    assert [len(s["devices"]) for s in device_slices(specs)] == [64, 26]
    assert validate_pool(specs) == []


def test_old_server_publishes_only_whole_gpus_and_static_mig_with_notes():
    gpus = [h100(0), with_instances(h100(1), [(14, 0)]), l4(2), replace(l4(3), healthy=False, health_reason="lost")]
    pol = policy({"rules": [{"match": {"index": 0}, "mig": "dynamic", "slots": {"count": 2}},
                            {"match": {"index": 1}, "mig": "static"},
                            {"match": {"index": 2}, "memoryShares": {}}]})
    plan = plan_pool(inventory(*gpus), pol, DRIVER, "n", OLD)
    names = [d["name"] for s in plan.slices for d in s["devices"]]
    assert names == ["gpu-0", "gpu-1-mig-2g20gb-14-0"]
    text = "\n".join(plan.notes)
    assert "partitionable devices" in text and "gpu-0: 25 mig, 2 slot" in text
    assert "consumable capacity" in text and "gpu-2: 1 shared" in text
    assert "device taints" in text and "gpu-3: 1 gpu" in text
    new = plan_pool(inventory(*gpus), pol, DRIVER, "n", ALL)
    assert new.notes == ()


def test_output_is_deterministic_and_fresh():
    args = (inventory(h100(0), a30(1)), policy({"default": {"mig": "dynamic", "slots": {"count": 2}}}), DRIVER, "n", ALL)
    first = desired_pool_slices(*args)
    first[0]["driver"] = "mutated"
    first_devices = device_slices(first)
    first_devices[0]["devices"][0]["attributes"]["type"]["string"] = "mutated"
    again = desired_pool_slices(*args)
    assert again[0]["driver"] == DRIVER
    assert device_slices(again)[0]["devices"][0]["attributes"]["type"] == {"string": "gpu"}


def test_build_pool_slices_takes_devices_and_counter_sets():
    model = build_devices(inventory(h100(0)), policy({"default": {"mig": "dynamic"}}))
    specs = build_pool_slices(DRIVER, "pool/a", "node-a", model.devices, model.counter_sets, ALL)
    assert specs[0]["sharedCounters"][0]["name"] == "gpu-0-counters"
    assert specs[0]["pool"]["name"] == "pool/a"
    assert validate_pool(specs) == []


def test_empty_node_has_no_slices():
    assert desired_pool_slices(inventory(), policy(None), DRIVER, "n", ALL) == []


# --------------------------------------------------------------------------------------------- validator

def _good():
    specs = desired_pool_slices(inventory(h100(0)), policy({"default": {"mig": "dynamic", "slots": {"count": 2}}}),
                                DRIVER, "node-a", ALL)
    assert validate_pool(specs) == []
    return specs


def _share_spec():
    specs = desired_pool_slices(inventory(l4(0)), policy({"default": {"memoryShares": {}}}), DRIVER, "node-a", ALL)
    assert validate_pool(specs) == []
    return specs


def _mutate(specs, fn):
    specs = copy.deepcopy(specs)
    fn(specs)
    return specs


def _dev(specs, i=0):
    return device_slices(specs)[0]["devices"][i]


MUTATIONS = {
    "driver upper case": (lambda s: s[1].update(driver="GPU.example.com"), "driver"),
    "long driver": (lambda s: s[1].update(driver="a" * 64), "driver"),
    "bad pool name": (lambda s: s[1]["pool"].update(name="Node_A"), "pool.name"),
    "no node selector": (lambda s: s[1].pop("nodeName"), "exactly one of nodeName"),
    "two node selectors": (lambda s: s[1].update(allNodes=True), "exactly one of nodeName"),
    "devices and counters": (lambda s: s[1].update(sharedCounters=s[0]["sharedCounters"]), "either devices or sharedCounters"),
    "bad device name": (lambda s: _dev(s).update(name="gpu_0"), "DNS label"),
    "duplicate device": (lambda s: s[1]["devices"].append(copy.deepcopy(_dev(s))), "duplicate"),
    "long string": (lambda s: _dev(s)["attributes"].update(productName={"string": "x" * 65}), "longer than 64"),
    "bad version": (lambda s: _dev(s)["attributes"].update(driverVersion={"version": "580.95.05"}), "semantic version"),
    "two value kinds": (lambda s: _dev(s)["attributes"].update(brand={"string": "a", "int": 1}), "exactly one"),
    "bad attribute name": (lambda s: _dev(s)["attributes"].update({"bad-name": {"int": 1}}), "qualified name"),
    "too many attributes": (lambda s: _dev(s)["attributes"].update({f"a{i}": {"int": i} for i in range(20)}), "at most 32"),
    "too many values": (lambda s: _dev(s)["attributes"].update({f"l{i}": {"ints": list(range(10))} for i in range(5)}),
                        "attribute values"),
    "bad quantity": (lambda s: _dev(s)["capacity"].update(memory={"value": "80 GiB"}), "not a quantity"),
    "policy without multi": (lambda s: _dev(s)["capacity"]["memory"].update(requestPolicy={"validRange": {"min": "1Gi"}}),
                             "allowMultipleAllocations"),
    "missing counter set": (lambda s: _dev(s)["consumesCounters"][0].update(counterSet="gpu-9-counters"), "does not define"),
    "missing counter": (lambda s: _dev(s)["consumesCounters"][0]["counters"].update({"memory-slice-9": {"value": "1"}}),
                        "are not in counter set"),
    "three consumes entries": (lambda s: _dev(s)["consumesCounters"].extend([{"counterSet": "a", "counters": {"x": {"value": "1"}}},
                                                                            {"counterSet": "b", "counters": {"x": {"value": "1"}}}]),
                               "at most 2"),
    "too many counters": (lambda s: s[0]["sharedCounters"][0]["counters"].update({f"c{i}": {"value": "1"} for i in range(30)}),
                          "at most 32"),
    "too many counter sets": (lambda s: s[0]["sharedCounters"].extend(
        {"name": f"x{i}", "counters": {"c": {"value": "1"}}} for i in range(8)), "at most 8"),
    "bad counter name": (lambda s: s[0]["sharedCounters"][0]["counters"].update({"Memory": {"value": "1"}}), "DNS label"),
    "overconsumption": (lambda s: _dev(s)["consumesCounters"][0]["counters"].update({"memory-slice-0": {"value": "9"}}),
                        "consumes more"),
    "too many devices": (lambda s: s[1]["devices"].extend(
        {**copy.deepcopy(_dev(s)), "name": f"extra-{i}"} for i in range(40)), "at most 64"),
    "bad taint effect": (lambda s: _dev(s).update(taints=[{"key": "a/b", "effect": "Evict"}]), "taint effect"),
    "too many taints": (lambda s: _dev(s).update(taints=[{"key": f"k{i}", "effect": "None"} for i in range(17)]), "taints"),
    "bad taint value": (lambda s: _dev(s).update(taints=[{"key": "k", "value": "GPU is lost", "effect": "None"}]),
                        "label value"),
    "slice count mismatch": (lambda s: s[1]["pool"].update(resourceSliceCount=3), "resourceSliceCount"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_validator_catches(name):
    fn, words = MUTATIONS[name]
    errors = validate_pool(_mutate(_good(), fn))
    assert errors and any(words in e for e in errors), errors


SHARE_MUTATIONS = {
    "default outside range": (lambda r: r.update(default="0"), "not in validRange"),
    "range min above max": (lambda r: r["validRange"].update(min="40Gi"), "min <= max"),
    "max above value": (lambda r: r["validRange"].update(max="64Gi"), "min <= max <= value"),
    "no min": (lambda r: r["validRange"].pop("min"), "validRange.min"),
    "values not ascending": (lambda r: (r.pop("validRange"), r.update(validValues=["2Gi", "1Gi"])), "ascending"),
    "too many values": (lambda r: (r.pop("validRange"), r.update(validValues=[f"{i}Gi" for i in range(1, 12)])), "1..10"),
    "default not a value": (lambda r: (r.pop("validRange"), r.update(validValues=["2Gi", "4Gi"])), "contain the default"),
}


@pytest.mark.parametrize("name", list(SHARE_MUTATIONS))
def test_validator_checks_request_policy(name):
    fn, words = SHARE_MUTATIONS[name]
    specs = _mutate(_share_spec(), lambda s: fn(s[0]["devices"][0]["capacity"]["memory"]["requestPolicy"]))
    errors = validate_pool(specs)
    assert errors and any(words in e for e in errors), errors


def test_validate_slice_spec_alone_does_not_need_the_pool():
    specs = _good()
    assert validate_slice_spec(specs[1]) == []
    assert validate_slice_spec(specs[0]) == []


def test_slot_capacity_layout_validates_and_is_left_out_before_1_36():
    pol = policy({"default": {"mig": "dynamic", "dynamicMig": {"profiles": ["1g.10gb"]},
                              "slots": {"count": 4, "strategy": "mps", "layout": "capacity"}}})
    new = plan_pool(inventory(h100(0), h100(1)), pol, DRIVER, "n", ALL)
    assert validate_pool(new.slices) == [] and new.notes == ()
    devices = [d for s in new.slices for d in s.get("devices", [])]
    assert len(devices) == 2 * 9
    [slots] = [d for d in devices if d["name"] == "gpu-0-slots"]
    assert slots["allowMultipleAllocations"] is True and slots["consumesCounters"]
    old = plan_pool(inventory(h100(0)), pol, DRIVER, "n", OLD)
    assert [d["name"] for s in old.slices for d in s["devices"]] == ["gpu-0"]
    assert "gpu-0: 7 mig, 1 slot" in "\n".join(old.notes)
    # A server with counters but without consumable capacity gets the N-device picture's absence explained.
    no_cc = plan_pool(inventory(h100(0)), pol, DRIVER, "n", ApiFeatures(True, False, True))
    assert "gpu-0-slots" not in [d["name"] for s in no_cc.slices for d in s.get("devices", [])]
    assert "slots.layout: capacity" in "\n".join(no_cc.notes)
