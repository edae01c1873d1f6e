"""Device model: names, attributes, order, counters (checked against the MIG model), policies, taints."""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import replace
from itertools import combinations, permutations

import pytest
from gpu_fixtures import a30, from_catalog, h100, inventory, l4, with_instances
from hypothesis import given, settings
from hypothesis import strategies as st
from mig_layouts import check_layout, maximal_layouts

from dra.model.catalog import CATALOG
from dra.model.devices import (
    DeviceModelError,
    build_devices,
    instances_together,
    mig_device_name,
    mig_instances_device_name,
    overlapping_placements,
    parse_device_name,
    profile_slug,
    semver,
)
from dra.model.mig import can_place
from dra.model.policy import parse_node_policy
from dra.node.inventory import discover
from dra.sim.fleet import nvml_for_node, parse_fleet


def policy(data):
    return parse_node_policy(data, "test")


DYNAMIC = policy({"default": {"mig": "dynamic"}})


def dynamic_with_slots(n, strategy="time-slicing"):
    return policy({"default": {"mig": "dynamic", "slots": {"count": n, "strategy": strategy}}})


# --------------------------------------------------------------------------------------------- counter helpers

def admitted(model, names) -> bool:
    """Would the scheduler's counter accounting allow all these devices at once?"""
    budget = {(cs.name, k): v for cs in model.counter_sets for k, v in cs.counters.items()}
    used: dict[tuple[str, str], int] = defaultdict(int)
    by_name = model.by_name()
    for n in names:
        for entry in by_name[n].consumes_counters:
            for k, v in entry["counters"].items():
                used[(entry["counterSet"], k)] += int(v["value"])
    return all(v <= budget[key] for key, v in used.items())


def realisable(model, gpu, names, slot_count) -> bool:
    """Could one GPU really run these devices at once? Stated without counters, using the MIG model."""
    devs = [model.by_name()[n] for n in names]
    kinds = [d.kind for d in devs]
    if "gpu" in kinds:
        return len(devs) == 1
    if "slot" in kinds:
        return all(k == "slot" for k in kinds) and len(devs) <= slot_count
    return check_layout(gpu.mig_profiles, [(d.mig_profile_id, d.mig_start) for d in devs]) is None


GPU_CASES = [
    ("h100-dynamic", h100(0), DYNAMIC, 0),
    ("h100-dynamic-2slots", h100(0), dynamic_with_slots(2), 2),
    ("h100-dynamic-4slots-mps", h100(0), dynamic_with_slots(4, "mps"), 4),
    ("a30-dynamic-mig-on", a30(0), DYNAMIC, 0),
    ("l4-3slots", l4(0), policy({"default": {"slots": {"count": 3}}}), 3),
    ("h100-1g-3g-me-2slots", h100(0), policy({"default": {
        "mig": "dynamic", "dynamicMig": {"profiles": ["1g.10gb", "3g.40gb", "1g.10gb+me"]},
        "slots": {"count": 2}}}), 2),
    ("a30-2g", a30(0), policy({"default": {"mig": "dynamic", "dynamicMig": {"profiles": ["2g.12gb"]}}}), 0),
]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(GPU_CASES), st.randoms(use_true_random=False))
def test_every_greedy_set_the_counters_admit_is_realisable(case, rnd):
    _, gpu, pol, slots = case
    model = build_devices(inventory(gpu), pol)
    names = [d.name for d in model.devices]
    rnd.shuffle(names)
    chosen: list[str] = []
    for n in names:
        if admitted(model, chosen + [n]):
            chosen.append(n)
    assert chosen
    assert realisable(model, gpu, chosen, slots), chosen


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(GPU_CASES), st.data())
def test_counters_admit_exactly_the_realisable_sets(case, data):
    _, gpu, pol, slots = case
    model = build_devices(inventory(gpu), pol)
    names = data.draw(st.lists(st.sampled_from([d.name for d in model.devices]), unique=True, max_size=5))
    assert admitted(model, names) == realisable(model, gpu, names, slots)


@pytest.mark.parametrize("gpu", [h100(0), a30(0)], ids=["slots8", "slots4"])
def test_every_maximal_layout_is_admitted(gpu):
    model = build_devices(inventory(gpu), DYNAMIC)
    layouts = maximal_layouts(gpu.mig_profiles)
    for layout in layouts:
        names = [mig_device_name(gpu.minor, next(p.name for p in gpu.mig_profiles if p.profile_id == pid), pid, s)
                 for pid, s in layout]
        assert admitted(model, names), layout


def test_slots_coexist_up_to_n_and_exclude_everything_else():
    model = build_devices(inventory(h100(0)), dynamic_with_slots(4))
    slots = [d.name for d in model.devices if d.kind == "slot"]
    assert len(slots) == 4
    assert admitted(model, slots)
    others = [d.name for d in model.devices if d.kind != "slot"]
    for other in others:
        assert not admitted(model, [slots[0], other]), other
    assert admitted(model, slots[:2])


def test_whole_gpu_excludes_everything():
    model = build_devices(inventory(h100(0)), dynamic_with_slots(2))
    assert admitted(model, ["gpu-0"])
    for d in model.devices[1:]:
        assert not admitted(model, ["gpu-0", d.name]), d.name


def test_no_counters_when_nothing_excludes_anything():
    assert build_devices(inventory(l4(0)), policy(None)).counter_sets == ()
    assert build_devices(inventory(l4(0)), policy({"default": {"wholeGpu": False, "slots": {"count": 4}}})).counter_sets == ()
    model = build_devices(inventory(l4(0)), policy({"default": {"slots": {"count": 4}}}))
    assert [cs.counters for cs in model.counter_sets] == [{"memory-slice-0": 4}]


def test_counter_set_shape_and_api_limits():
    model = build_devices(inventory(h100(0), h100(1)), dynamic_with_slots(4))
    assert [cs.name for cs in model.counter_sets] == ["gpu-0-counters", "gpu-1-counters"]
    cs = model.counter_sets[0]
    assert {f"memory-slice-{i}": 4 for i in range(8)}.items() <= dict(cs.counters).items()
    assert cs.counters["ofa-engines"] == 1 and cs.counters["compute-slices"] == 7
    assert len(cs.counters) <= 32
    for d in model.devices:
        assert len(d.consumes_counters) <= 2
        for entry in d.consumes_counters:
            assert len(entry["counters"]) <= 32
            assert entry["counterSet"] == f"gpu-{d.gpu_minor}-counters"


# --------------------------------------------------------------------------------------------- order

def test_order_whole_then_partitions_then_slots_per_gpu_by_minor():
    inv = inventory(h100(index=0, minor=5), h100(index=1, minor=2))
    model = build_devices(inv, dynamic_with_slots(2))
    minors = [d.gpu_minor for d in model.devices]
    assert minors == sorted(minors)
    for minor in (2, 5):
        kinds = [d.kind for d in model.devices if d.gpu_minor == minor]
        assert kinds == ["gpu"] + ["mig"] * 25 + ["slot"] * 2
    migs = [d for d in model.devices if d.kind == "mig" and d.gpu_minor == 2]
    # smaller profiles first; +me after its plain twin; within a profile, highest start first
    assert [d.mig_profile_name for d in migs][:8] == ["1g.10gb"] * 7 + ["1g.10gb+me"]
    assert [d.mig_start for d in migs if d.mig_profile_name == "1g.10gb"] == [6, 5, 4, 3, 2, 1, 0]
    assert [d.mig_start for d in migs if d.mig_profile_name == "3g.40gb"] == [4, 0]
    assert migs[-1].mig_profile_name == "7g.80gb"


def _size(p):
    return (p.memory_slices, p.compute_slices)


def _largest_placeable(profiles, layout):
    return max((_size(p) for p in profiles for s in p.starts if can_place(profiles, layout, p.profile_id, s) is None),
               default=(0, 0))


def _first_fit(profiles, profile, order):
    """First-fit starts of ``profile`` in ``order`` and the largest profile still placeable after each."""
    layout: list = []
    out = []
    for _ in range(profile.max_instances):
        start = next(s for s in order if can_place(profiles, layout, profile.profile_id, s) is None)
        layout.append((profile.profile_id, start))
        out.append(_largest_placeable(profiles, layout))
    return [s for _, s in layout], out


@pytest.mark.parametrize("gpu", [h100(0), a30(0)], ids=["slots8", "slots4"])
def test_first_fit_order_protects_large_profiles(gpu):
    """The scheduler takes the first device that fits, and nobody knows how many partitions of a profile will
    be asked for. The published order must keep the largest possible profile placeable after the first
    allocation, then after the second, and so on: the sequence (largest after k=1, k=2, ...) is the
    lexicographic maximum over every possible order of the profile's starts (exhaustive).

    (No fixed order is best for every k at once: on 8 slices three 1g at 4, 5, 6 keep a 4g placeable, while
    four 1g keep a 3g only at 0..3.)"""
    model = build_devices(inventory(gpu), DYNAMIC)
    profiles = gpu.mig_profiles
    for prof in profiles:
        published = [d.mig_start for d in model.devices if d.kind == "mig" and d.mig_profile_id == prof.profile_id]
        # first-fit through the counters picks the same starts as first-fit through the model
        chosen: list = []
        for _ in range(prof.max_instances):
            pick = next(d for d in model.devices if d.kind == "mig" and d.mig_profile_id == prof.profile_id
                        and d.name not in chosen and admitted(model, chosen + [d.name]))
            chosen.append(pick.name)
        starts, ours = _first_fit(profiles, prof, published)
        assert [parse_device_name(n).start for n in chosen] == starts
        best = max(_first_fit(profiles, prof, order)[1] for order in permutations(prof.starts))
        assert ours == best, (prof.name, published, ours, best)


# --------------------------------------------------------------------------------------------- names

def test_names_and_parse_round_trip():
    model = build_devices(inventory(h100(0), l4(1)), policy({
        "rules": [{"match": {"index": 0}, "mig": "dynamic", "slots": {"count": 2}},
                  {"match": {"index": 1}, "memoryShares": {}}]}))
    for d in model.devices:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d.name) and len(d.name) <= 63
        parsed = parse_device_name(d.name)
        assert parsed.kind == d.kind and parsed.minor == d.gpu_minor
        if d.kind == "mig":
            assert (parsed.profile_id, parsed.start, parsed.profile_slug) == (
                d.mig_profile_id, d.mig_start, profile_slug(d.mig_profile_name))
        if d.kind == "slot":
            assert parsed.slot == d.slot_index
    assert "gpu-0-mig-1g10gbme-20-6" in model.by_name()
    assert "gpu-1-shared" in model.by_name()


@pytest.mark.parametrize("bad", ["gpu", "gpu-x", "gpu-0-mig-1g10gb", "gpu-0-mig-1g10gb-19-", "gpu-0-slot-", "vfio-0", "gpu-0-shared-1"])
def test_parse_rejects_foreign_names(bad):
    with pytest.raises(ValueError):
        parse_device_name(bad)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 4095), st.from_regex(r"[1-7]g\.[0-9]{1,3}gb(\+me|-me|\+me\.all|\+gfx)?", fullmatch=True),
       st.integers(0, 99), st.integers(0, 7))
def test_mig_names_parse_back(minor, profile, pid, start):
    name = mig_device_name(minor, profile, pid, start)
    parsed = parse_device_name(name)
    assert (parsed.kind, parsed.minor, parsed.profile_id, parsed.start) == ("mig", minor, pid, start)
    assert parsed.profile_slug == profile_slug(profile)


def test_names_are_stable_across_rebuilds_and_index_shifts():
    pol = dynamic_with_slots(2)
    first = [d.name for d in build_devices(inventory(h100(0), h100(1), h100(2)), pol).devices]
    again = [d.name for d in build_devices(inventory(h100(0), h100(1), h100(2)), pol).devices]
    assert first == again
    # GPU 0 falls off the bus: the others' indexes shift, minors (and so names) stay
    shifted = [d.name for d in build_devices(inventory(h100(index=0, minor=1), h100(index=1, minor=2)), pol).devices]
    assert shifted == [n for n in first if not n.startswith("gpu-0")]


def test_semver():
    assert semver("580.95.05") == "580.95.5"
    assert semver("13.0") == "13.0.0"
    assert semver("550") == "550.0.0"
    with pytest.raises(ValueError):
        semver("n/a")


# --------------------------------------------------------------------------------------------- attributes

def test_whole_gpu_attributes_and_capacity():
    d = build_devices(inventory(h100(0)), policy(None)).devices[0]
    a = d.attributes
    assert d.name == "gpu-0" and d.kind == "gpu" and d.consumes_counters == ()
    assert a["type"] == {"string": "gpu"}
    assert a["uuid"] == {"string": h100(0).uuid}
    assert "parentUUID" not in a and "index" not in a
    assert a["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert a["family"] == {"string": "hopper"} and a["architecture"] == {"string": "Hopper"}
    assert a["cudaComputeCapability"] == {"version": "9.0.0"}
    assert a["driverVersion"] == {"version": "580.95.5"} and a["cudaDriverVersion"] == {"version": "13.0.0"}
    assert a["migCapable"] == {"bool": True} and a["sharing"] == {"string": "none"}
    assert a["resource.kubernetes.io/pciBusID"] == {"string": "0000:18:00.0"}
    assert a["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:18"}
    assert a["resource.kubernetes.io/numaNode"] == {"int": 0}
    assert d.capacity["memory"] == {"value": "81559Mi"}
    assert d.capacity["multiprocessors"] == {"value": "132"}
    assert set(d.capacity) == {"memory", "multiprocessors", "copyEngines", "decoders", "encoders", "jpegEngines",
                               "ofaEngines"}
    assert len(d.attributes) + len(d.capacity) <= 32


def test_numa_node_omitted_when_unknown_and_family_from_cc():
    d = build_devices(inventory(a30(0, mig_enabled=False)), policy(None)).devices[0]
    assert "resource.kubernetes.io/numaNode" not in d.attributes
    assert d.attributes["family"] == {"string": "ampere"}
    d = build_devices(inventory(l4(0)), policy(None)).devices[0]
    assert d.attributes["family"] == {"string": "ada-lovelace"} and d.attributes["migCapable"] == {"bool": False}


def test_dynamic_mig_partition_record_and_attributes():
    model = build_devices(inventory(h100(0)), DYNAMIC)
    d = model.by_name()["gpu-0-mig-3g40gb-9-4"]
    assert d.kind == "mig" and d.mig_dynamic and d.mig_uuid is None
    assert (d.mig_profile_id, d.mig_profile_name, d.mig_start, d.mig_size) == (9, "3g.40gb", 4, 4)
    assert (d.gpu_uuid, d.gpu_index, d.gpu_minor) == (h100(0).uuid, 0, 0)
    assert "uuid" not in d.attributes
    assert d.attributes["parentUUID"] == {"string": h100(0).uuid}
    assert d.attributes["profile"] == {"string": "3g.40gb"}
    assert d.attributes["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert d.capacity["memory"] == {"value": "40448Mi"} and d.capacity["multiprocessors"] == {"value": "60"}
    counters = d.consumes_counters[0]["counters"]
    assert {k for k in counters if k.startswith("memory-slice")} == {f"memory-slice-{i}" for i in range(4, 8)}


def test_static_mig_publishes_existing_partitions_only():
    gpu = with_instances(h100(0), [(5, 0), (14, 4), (19, 6)])
    model = build_devices(inventory(gpu), policy({"default": {"mig": "static"}}))
    assert [d.name for d in model.devices] == ["gpu-0-mig-1g10gb-19-6", "gpu-0-mig-2g20gb-14-4", "gpu-0-mig-4g40gb-5-0"]
    assert model.counter_sets == ()
    for d, inst in zip(model.devices, sorted(gpu.mig_instances, key=lambda i: i.start, reverse=True)):
        assert not d.mig_dynamic and d.mig_uuid == inst.uuid and d.attributes["uuid"] == {"string": inst.uuid}
        assert (d.mig_gi_id, d.mig_ci_id) == (inst.gi_id, inst.ci_id)
        assert d.consumes_counters == ()


def test_static_mig_with_mig_disabled_publishes_nothing_and_warns():
    model = build_devices(inventory(h100(0)), policy({"default": {"mig": "static"}}))
    assert model.devices == ()
    assert "MIG mode is disabled" in model.warnings[0] and h100(0).uuid in model.warnings[0]


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_mig_policy_on_a_gpu_without_mig_is_an_error_naming_the_gpu(mode):
    with pytest.raises(DeviceModelError) as info:
        build_devices(inventory(h100(0), l4(1)), policy({"default": {"mig": mode}}))
    assert "GPU 1" in str(info.value) and "NVIDIA L4" in str(info.value)
    assert f"node policy default asks for mig: {mode}" in str(info.value)
    with pytest.raises(DeviceModelError, match=r"rules\[1\] asks for mig: dynamic"):
        build_devices(inventory(h100(0), l4(1)), policy({"rules": [{"match": {"index": 0}, "mig": "static"},
                                                                   {"match": {"model": "L4"}, "mig": "dynamic"}]}))


def test_mig_enabled_gpu_under_mig_none_publishes_nothing_and_warns():
    model = build_devices(inventory(a30(0)), policy(None))
    assert model.devices == () and "mig: none" in model.warnings[0]


def test_ampere_dynamic_mig_needs_mig_already_on():
    on = build_devices(inventory(a30(0)), policy({"default": {"mig": "dynamic", "slots": {"count": 2}}}))
    assert {d.kind for d in on.devices} == {"mig"}            # cannot leave MIG mode: no whole GPU, no slots
    assert any("cannot be switched off" in w for w in on.warnings)
    off = build_devices(inventory(a30(0, mig_enabled=False, mig_pending=False)), DYNAMIC)
    assert [d.kind for d in off.devices] == ["gpu"]
    assert any("needs MIG mode enabled" in w for w in off.warnings)


def test_hopper_dynamic_mig_keeps_whole_gpu_while_mig_is_on():
    model = build_devices(inventory(with_instances(h100(0), [(19, 0)])), DYNAMIC)
    assert model.devices[0].name == "gpu-0" and len(model.devices) == 1 + 25


@pytest.mark.parametrize("n", [1, 3, 4, 7])
def test_mps_slots_carry_defaults_for_prepare(n):
    model = build_devices(inventory(h100(0)), policy({"default": {"slots": {"count": n, "strategy": "mps"}}}))
    slots = [d for d in model.devices if d.kind == "slot"]
    assert [d.slot_index for d in slots] == list(range(n))
    for d in slots:
        assert d.sharing == "mps" and d.slot_count == n
        assert d.mps_thread_percentage == 100 // n
        assert d.mps_memory_limit_mib == 81559 // n
        assert d.capacity["memory"] == {"value": f"{81559 // n}Mi"}
        assert d.attributes["sharing"] == {"string": "mps"} and d.attributes["type"] == {"string": "slot"}
        assert d.attributes["parentUUID"] == {"string": h100(0).uuid} and "uuid" not in d.attributes


def test_time_slicing_slots_advertise_the_whole_gpu():
    model = build_devices(inventory(l4(0)), policy({"default": {"wholeGpu": False, "slots": {"count": 4}}}))
    assert [d.kind for d in model.devices] == ["slot"] * 4
    d = model.devices[0]
    assert d.sharing == "time-slicing" and d.mps_thread_percentage is None and d.mps_memory_limit_mib is None
    assert d.capacity["memory"] == {"value": "23034Mi"}


def test_memory_share_device():
    model = build_devices(inventory(l4(0)), policy({"default": {"memoryShares": {"minimum": "2Gi", "step": "512Mi"}}}))
    assert len(model.devices) == 1 and model.counter_sets == ()
    d = model.devices[0]
    assert d.name == "gpu-0-shared" and d.kind == "shared" and d.allow_multiple_allocations
    assert set(d.capacity) == {"memory"}
    mem = d.capacity["memory"]
    assert mem["value"] == "23034Mi"
    assert mem["requestPolicy"] == {"default": "2Gi", "validRange": {"min": "2Gi", "max": "22Gi", "step": "512Mi"}}
    wire = d.to_wire()
    assert wire["allowMultipleAllocations"] is True and "consumesCounters" not in wire


def test_memory_share_minimum_above_gpu_memory_is_an_error():
    with pytest.raises(DeviceModelError, match="memoryShares.minimum"):
        build_devices(inventory(l4(0)), policy({"default": {"memoryShares": {"minimum": "64Gi"}}}))


# --------------------------------------------------------------------------------------------- taints

def test_unhealthy_gpu_taints_all_its_devices():
    sick = replace(h100(1), healthy=False, health_reason="XID 79: GPU has fallen off the bus")
    model = build_devices(inventory(h100(0), sick), dynamic_with_slots(2), driver="gpu.example.com")
    assert [d.name for d in model.devices if d.gpu_minor == 1] == ["gpu-1"]   # its policy is not applied
    for d in model.devices:
        if d.gpu_minor == 1:
            assert d.taints == ({"key": "gpu.example.com/unhealthy", "value": "XID-79-GPU-has-fallen-off-the-bus",
                                 "effect": "NoSchedule"},)
        else:
            assert d.taints == ()


@pytest.mark.parametrize("rule", [
    {"slots": {"count": 4, "strategy": "time-slicing"}},
    {"wholeGpu": False, "slots": {"count": 8, "strategy": "mps"}},
    {"memoryShares": {"minimum": "1Gi"}},
    {"mig": "dynamic", "slots": {"count": 2}},
    {"wholeGpu": False, "mig": "static"},
])
def test_a_lost_gpu_is_one_tainted_whole_gpu_whatever_rule_matches(rule):
    """Discovered through the simulated NVML: a lost GPU answers only its identity (no memory, no MIG profiles)."""
    fleet = parse_fleet({"nodes": [{"name": "n", "gpus": [
        {"model": "H100-80GB"}, {"model": "H100-80GB", "broken": "fell off the bus"}]}]})
    nvml = nvml_for_node(fleet.nodes[0])
    nvml.nvmlInit()
    try:
        inv = discover(nvml)
    finally:
        nvml.nvmlShutdown()
    assert [g.healthy for g in inv.gpus] == [True, False]
    model = build_devices(inv, policy({"rules": [{"match": {"index": 1}, **rule}]}), driver="gpu.example.com")
    assert [d.name for d in model.devices] == ["gpu-0", "gpu-1"]
    lost = model.by_name()["gpu-1"]
    assert lost.kind == "gpu" and lost.attributes["type"] == {"string": "gpu"}
    [taint] = lost.taints
    assert taint["key"] == "gpu.example.com/unhealthy" and taint["effect"] == "NoSchedule"
    assert "GPU-is-lost" in taint["value"]
    assert model.by_name()["gpu-0"].taints == () and model.counter_sets == ()
    assert any("GPU 1" in w and "unhealthy" in w and "rules[0]" in w for w in model.warnings), model.warnings


def test_monitor_taints_whole_gpu_name_spreads_other_names_do_not():
    xid = {"key": "gpu.dra-driver.io/xid", "value": "48", "effect": "NoExecute"}
    slot_taint = {"key": "gpu.dra-driver.io/xid", "value": "13", "effect": "None"}
    model = build_devices(inventory(h100(0), h100(1)), dynamic_with_slots(2),
                          taints={"gpu-0": [xid], "gpu-1-slot-1": [slot_taint], "gpu-9": [xid]})
    by = model.by_name()
    assert all(by[n].taints == (xid,) for n in by if n.startswith("gpu-0"))
    assert by["gpu-1-slot-1"].taints == (slot_taint,)
    assert by["gpu-1"].taints == () and by["gpu-1-slot-0"].taints == ()
    assert any("gpu-9" in w for w in model.warnings)


def test_taints_reach_share_and_static_devices_through_gpu_name():
    xid = {"key": "gpu.dra-driver.io/xid", "value": "94", "effect": "NoSchedule"}
    gpu = with_instances(h100(0), [(9, 0)])
    model = build_devices(inventory(gpu, l4(1)), policy({"rules": [
        {"match": {"index": 0}, "mig": "static"}, {"match": {"index": 1}, "memoryShares": {}}]}),
        taints={"gpu-0": [xid], "gpu-1": [xid]})
    assert all(d.taints == (xid,) for d in model.devices) and len(model.devices) == 2
    assert model.warnings == ()


# --------------------------------------------------------------------------------------------- catalog models

@pytest.mark.parametrize("name", ["A100-40GB", "A100-80GB", "H100-80GB", "H100-NVL", "H200-141GB", "B200"])
def test_catalog_models_publish_consistent_partitions(name):
    gpu = from_catalog(name, mig_enabled=True)
    model = build_devices(inventory(gpu), DYNAMIC)
    migs = [d for d in model.devices if d.kind == "mig"]
    assert len(migs) == sum(len(p.starts) for p in gpu.mig_profiles)
    # the whole GPU only where MIG mode can be switched off at runtime (Hopper and later)
    assert (model.devices[0].kind == "gpu") == (gpu.cuda_compute_capability >= (9, 0))
    for layout in maximal_layouts(gpu.mig_profiles)[:40]:
        names = [mig_device_name(0, next(p.name for p in gpu.mig_profiles if p.profile_id == pid), pid, s)
                 for pid, s in layout]
        assert admitted(model, names)


def test_catalog_model_name_lets_rules_match_by_model():
    pol = policy({"rules": [{"match": {"model": "H200-141GB"}, "slots": {"count": 2}}]})
    model = build_devices(inventory(from_catalog("H200-141GB"), from_catalog("L4", 1)), pol)
    assert [d.name for d in model.devices] == ["gpu-0", "gpu-0-slot-0", "gpu-0-slot-1", "gpu-1"]


def test_lost_gpu_stays_visible_when_its_policy_cannot_apply():
    lost = replace(l4(1), product_name="", mig_capable=False, healthy=False, health_reason="GPU is lost")
    model = build_devices(inventory(h100(0), lost), DYNAMIC)
    gpu1 = [d for d in model.devices if d.gpu_minor == 1]
    assert [d.name for d in gpu1] == ["gpu-1"]
    assert gpu1[0].taints[0]["value"] == "GPU-is-lost"
    assert any("unhealthy" in w and "GPU 1" in w for w in model.warnings)
    with pytest.raises(DeviceModelError):  # a healthy GPU with the same policy problem is still an error
        build_devices(inventory(h100(0), replace(lost, healthy=True)), DYNAMIC)


def test_dynamic_mig_profiles_publish_only_those_at_every_placement():
    pol = policy({"default": {"mig": "dynamic", "dynamicMig": {"profiles": ["3g.40gb", "1g.10gb"]},
                              "slots": {"count": 4, "strategy": "mps"}}})
    model = build_devices(inventory(h100(0)), pol)
    mig = [d for d in model.devices if d.kind == "mig"]
    assert [(d.mig_profile_name, d.mig_start) for d in mig] == (
        [("1g.10gb", s) for s in range(6, -1, -1)] + [("3g.40gb", 4), ("3g.40gb", 0)])
    assert [d.kind for d in model.devices] == ["gpu"] + ["mig"] * 9 + ["slot"] * 4
    # No profile left uses an OFA engine, so the counter set has none to count.
    (cs,) = model.counter_sets
    assert "ofa-engines" not in cs.counters
    assert all("ofa-engines" not in e["counters"] for d in model.devices for e in d.consumes_counters)
    # Without the list: every profile, as before.
    everything = build_devices(inventory(h100(0)), dynamic_with_slots(4, "mps"))
    assert len([d for d in everything.devices if d.kind == "mig"]) == 25


def test_dynamic_mig_profile_the_gpu_lacks_is_an_error_naming_it_and_the_gpus_profiles():
    pol = policy({"rules": [{"match": {"model": "H100"}, "mig": "dynamic",
                             "dynamicMig": {"profiles": ["1g.10gb", "1g.5gb"]}}]})
    with pytest.raises(DeviceModelError) as info:
        build_devices(inventory(h100(0)), pol)
    text = str(info.value)
    assert "GPU 0" in text and "rules[0]" in text and "'1g.5gb'" in text and "H100-80GB" in text
    assert "its profiles: 1g.10gb, 1g.10gb+me, 1g.20gb" in text
    assert "'1g.10gb'" not in text


# --------------------------------------------------------------------------------------------- slots as capacity

def slot_capacity(n, strategy="mps", profiles=("1g.10gb",)):
    return policy({"default": {"mig": "dynamic", "dynamicMig": {"profiles": list(profiles)},
                               "slots": {"count": n, "strategy": strategy, "layout": "capacity"}}})


def admitted_once(model, names) -> bool:
    """The scheduler's counter accounting when each name is a device (a multi-allocatable one may be named many
    times, once per share): a device's counters are charged once, however many shares it has out."""
    return admitted(model, list(dict.fromkeys(names)))


def test_slot_capacity_layout_is_one_device_per_gpu_with_slots_capacity():
    model = build_devices(inventory(h100(0), h100(1)), slot_capacity(4))
    per_gpu = [d.name for d in model.devices if d.gpu_minor == 0]
    assert per_gpu[0] == "gpu-0" and per_gpu[-1] == "gpu-0-slots" and len(per_gpu) == 1 + 7 + 1
    d = model.by_name()["gpu-0-slots"]
    assert d.kind == "slot" and d.allow_multiple_allocations and d.slot_index is None and d.slot_count == 4
    assert d.attributes["type"] == {"string": "slot"} and d.attributes["sharing"] == {"string": "mps"}
    assert d.capacity == {"slots": {"value": "4", "requestPolicy": {
        "default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}}}}
    assert (d.mps_thread_percentage, d.mps_memory_limit_mib) == (25, 81559 // 4)   # per slot of a share
    wire = d.to_wire()
    assert wire["allowMultipleAllocations"] is True
    [consumes] = wire["consumesCounters"]
    assert consumes["counterSet"] == "gpu-0-counters"
    assert consumes["counters"] == {f"memory-slice-{i}": {"value": "1"} for i in range(8)}
    # One unit per memory slice: the slots device is charged once, whatever its shares.
    [cs, _] = model.counter_sets
    assert {k: v for k, v in cs.counters.items() if k.startswith("memory-slice-")} == {
        f"memory-slice-{i}": 1 for i in range(8)}
    assert parse_device_name("gpu-0-slots").kind == "slot" and parse_device_name("gpu-0-slots").slot is None


def test_slot_capacity_excludes_whole_gpu_and_every_partition_while_a_share_is_out():
    model = build_devices(inventory(h100(0)), slot_capacity(4))
    assert admitted_once(model, ["gpu-0-slots"] * 4)
    for other in (d.name for d in model.devices if d.name != "gpu-0-slots"):
        assert admitted_once(model, [other])
        assert not admitted_once(model, ["gpu-0-slots", other]), other
    partitions = [d.name for d in model.devices if d.kind == "mig"]
    assert admitted_once(model, partitions)                     # 7 × 1g.10gb at once, as before


def test_slot_capacity_layout_without_exclusive_kinds_has_no_counters():
    model = build_devices(inventory(l4(0)), policy({"default": {"wholeGpu": False, "slots": {
        "count": 3, "strategy": "time-slicing", "layout": "capacity"}}}))
    assert model.counter_sets == () and [d.name for d in model.devices] == ["gpu-0-slots"]
    d = model.devices[0]
    assert d.consumes_counters == () and d.mps_thread_percentage is None and d.mps_memory_limit_mib is None


def test_slot_device_layout_is_still_the_default():
    model = build_devices(inventory(h100(0)), dynamic_with_slots(4))
    assert [d.name for d in model.devices if d.kind == "slot"] == [f"gpu-0-slot-{k}" for k in range(4)]


# ------------------------------------------------------------------------------------- one MIG profile as capacity

def mig_capacity(profile="1g.10gb", *, whole=True, slots=None):
    pol = {"wholeGpu": whole, "mig": "dynamic", "dynamicMig": {"profiles": [profile], "layout": "capacity"}}
    if slots is not None:
        pol["slots"] = slots
    return policy({"default": pol})


def test_mig_capacity_layout_is_one_partition_device_per_gpu():
    model = build_devices(inventory(h100(0), h100(1)),
                          mig_capacity(slots={"count": 4, "strategy": "mps", "layout": "capacity"}))
    assert [d.name for d in model.devices if d.gpu_minor == 1] == ["gpu-1", "gpu-1-mig-1g10gb-19", "gpu-1-slots"]
    d = model.by_name()["gpu-0-mig-1g10gb-19"]
    assert d.kind == "mig" and d.mig_dynamic and d.allow_multiple_allocations
    assert (d.mig_profile_id, d.mig_profile_name, d.mig_start, d.mig_instances) == (19, "1g.10gb", None, 7)
    assert d.capacity == {"instances": {"value": "7", "requestPolicy": {
        "default": "1", "validRange": {"min": "1", "max": "7", "step": "1"}}}}
    prof = next(p for p in h100(0).mig_profiles if p.name == "1g.10gb")
    assert d.attributes["profile"] == {"string": "1g.10gb"} and d.attributes["type"] == {"string": "mig"}
    assert d.attributes["instanceMemoryMiB"] == {"int": prof.memory_mib}
    assert d.attributes["instanceMultiprocessors"] == {"int": prof.multiprocessors}
    assert len(d.attributes) + len(d.capacity) <= 32                     # the API's limit per device
    # The counter set shrinks to one memory slice: nothing on the GPU competes for single slices any more.
    [cs, _] = model.counter_sets
    assert cs.counters == {"memory-slice-0": 1}
    [consumes] = d.to_wire()["consumesCounters"]
    assert consumes["counters"] == {"memory-slice-0": {"value": "1"}}
    name = parse_device_name("gpu-0-mig-1g10gb-19")
    assert (name.kind, name.minor, name.profile_slug, name.profile_id, name.start) == ("mig", 0, "1g10gb", 19, None)
    assert parse_device_name("gpu-0-mig-1g10gb-19-6").start == 6


def test_mig_capacity_excludes_whole_gpu_and_slots_while_a_share_is_out():
    for slots in ({"count": 4, "strategy": "mps", "layout": "capacity"}, {"count": 3}):
        model = build_devices(inventory(h100(0)), mig_capacity(slots=slots))
        mig = "gpu-0-mig-1g10gb-19"
        assert admitted_once(model, [mig] * 7)
        for other in (d.name for d in model.devices if d.name != mig):
            assert admitted_once(model, [other])
            assert not admitted_once(model, [mig, other]), (slots, other)


def test_mig_capacity_alone_has_no_counters():
    model = build_devices(inventory(h100(0)), mig_capacity(whole=False))
    assert model.counter_sets == () and [d.name for d in model.devices] == ["gpu-0-mig-1g10gb-19"]
    assert model.devices[0].consumes_counters == ()


@pytest.mark.parametrize("model_name", sorted(m for m, g in CATALOG.items() if g.mig_profiles))
def test_every_catalog_profile_has_interchangeable_placements(model_name):
    """The capacity layout's premise, for every profile of every MIG GPU: no two placements overlap, so k
    instances fit at any free placements whenever k ≤ N (the most that fit together)."""
    gpu = from_catalog(model_name, 0, mig_enabled=True)     # Ampere publishes dynamic MIG only with MIG on
    for prof in gpu.mig_profiles:
        assert overlapping_placements(prof) is None, prof.name
        n = instances_together(gpu.mig_profiles, prof)
        assert n >= 1
        for taken in combinations(prof.starts, n - 1):                 # any n-1 placements out
            state = [(prof.profile_id, s) for s in taken]
            free = [s for s in prof.starts if s not in taken and can_place(gpu.mig_profiles, state, prof.profile_id, s) is None]
            assert free, (prof.name, taken)
        state = [(prof.profile_id, s) for s in prof.starts[:n]]
        assert all(can_place(gpu.mig_profiles, state, prof.profile_id, s) is not None for s in prof.starts), prof.name
        built = build_devices(inventory(gpu), mig_capacity(prof.name))
        assert built.by_name()[mig_instances_device_name(0, prof.name, prof.profile_id)].mig_instances == n


def test_mig_capacity_refuses_a_profile_whose_placements_overlap():
    gpu = h100(0)
    overlapping = tuple(replace(p, starts=(0, 1)) if p.name == "2g.20gb" else p for p in gpu.mig_profiles)
    with pytest.raises(DeviceModelError) as info:
        build_devices(inventory(replace(gpu, mig_profiles=overlapping)), mig_capacity("2g.20gb"))
    text = str(info.value)
    assert "dynamicMig.layout: capacity" in text and "2g.20gb" in text and "0 and 1 overlap" in text


def test_mig_capacity_of_the_media_profile_is_one_instance():
    d = build_devices(inventory(h100(0)), mig_capacity("1g.10gb+me")).by_name()["gpu-0-mig-1g10gbme-20"]
    assert d.mig_instances == 1 and d.capacity["instances"]["value"] == "1"


def test_mig_placement_layout_is_still_the_default():
    model = build_devices(inventory(h100(0)), policy({"default": {"mig": "dynamic",
                                                                  "dynamicMig": {"profiles": ["1g.10gb"]}}}))
    assert len([d for d in model.devices if d.kind == "mig"]) == 7
    assert not any(d.allow_multiple_allocations for d in model.devices)
