"""Node policy parsing, errors that name the field, and rule selection."""
from __future__ import annotations

import pytest
import yaml
from gpu_fixtures import a30, h100, l4

from dra.model.policy import DEFAULT_NODE_POLICY, NodePolicy, PolicyError, parse_node_policy

EXAMPLE = """
default:
  wholeGpu: true
rules:
- match: {model: H100}
  mig: dynamic
  slots: {count: 4, strategy: mps}
- match: {index: 3}
  wholeGpu: false
  mig: static
- match: {uuid: gpu-14000000-0000-0000-0000-000000000002}
  memoryShares: {minimum: 2Gi, step: 1Gi}
"""


def parse(data):
    return parse_node_policy(data, "nodes/a.yaml")


def test_module_docstring_example_parses():
    import dra.model.policy as mod

    doc = mod.__doc__
    example = doc[doc.index("Example::") + len("Example::"):doc.index("Combinations that")]
    text = "\n".join(line[4:] for line in example.splitlines())
    policy = parse(yaml.safe_load(text))
    assert len(policy.rules) == 3


def test_mixed_policies_on_one_node():
    policy = parse(yaml.safe_load(EXAMPLE))
    h = policy.for_gpu(h100(0), "H100-80GB")
    assert h.mig == "dynamic" and h.slots.count == 4 and h.slots.strategy == "mps" and h.publish_whole
    assert policy.for_gpu(a30(3), "A30").mig == "static"
    assert policy.for_gpu(a30(3), "A30").publish_whole is False
    shared = policy.for_gpu(l4(2), "L4")
    assert shared.memory_shares is not None and shared.memory_shares.minimum_bytes == 2 << 30
    assert not shared.publish_whole
    plain = policy.for_gpu(l4(1), "L4")                      # no rule: the default
    assert plain == policy.default and plain.publish_whole and plain.mig == "none"


def test_first_matching_rule_wins_and_is_not_merged_with_default():
    policy = parse({"default": {"slots": {"count": 2}},
                    "rules": [{"match": {"index": 0}, "mig": "dynamic"},
                              {"match": {"index": 0}, "wholeGpu": False}]})
    chosen = policy.for_gpu(h100(0))
    assert chosen.mig == "dynamic" and chosen.slots is None and chosen.publish_whole


def test_model_matches_catalog_name_or_product_substring():
    policy = parse({"rules": [{"match": {"model": "h100-80gb"}, "mig": "dynamic"},
                              {"match": {"model": "nvidia l4"}, "wholeGpu": False}]})
    assert policy.for_gpu(h100(0), "H100-80GB").mig == "dynamic"
    assert policy.for_gpu(h100(0), None).mig == "none"         # name not in the product name, no catalog name
    assert policy.for_gpu(l4(0), None).publish_whole is False  # product-name substring, case-insensitive


def test_selector_keys_must_all_match():
    policy = parse({"rules": [{"match": {"model": "H100", "index": 1}, "mig": "dynamic"}]})
    assert policy.for_gpu(h100(0)).mig == "none"
    assert policy.for_gpu(h100(1)).mig == "dynamic"


def test_snake_case_spelling_is_accepted_too():
    a = parse({"default": {"whole_gpu": False, "memory_shares": {"minimum": "1Gi"}}})
    b = parse({"default": {"wholeGpu": False, "memoryShares": {"minimum": "1Gi"}}})
    assert a == b


def test_none_gives_default_policy():
    assert parse(None) is DEFAULT_NODE_POLICY
    assert NodePolicy().for_gpu(h100(0)).publish_whole


@pytest.mark.parametrize("data, path, words", [
    ({"defaults": {}}, "defaults", "unknown field"),
    ({"rules": [{"match": {"index": 0}, "mig": "dynmic"}]}, "rules[0].mig", "'none', 'static' or 'dynamic'"),
    ({"rules": [{"match": {"index": 0}, "slots": {"count": 65}}]}, "rules[0].slots.count", "64"),
    ({"rules": [{"match": {"index": 0}, "slots": {"count": 0}}]}, "rules[0].slots.count", "1"),
    ({"rules": [{"match": {"index": 0}, "slots": {"count": "4"}}]}, "rules[0].slots.count", "integer"),
    ({"rules": [{"match": {"index": 0}, "slots": {"count": 2, "strategy": "mig"}}]}, "rules[0].slots.strategy", "mps"),
    ({"rules": [{"match": {}, "mig": "dynamic"}]}, "rules[0].match", "at least one of index, uuid, model"),
    ({"rules": [{"mig": "dynamic"}]}, "rules[0].match", "required"),
    ({"rules": [{"match": {"idx": 1}}]}, "rules[0].match.idx", "unknown field"),
    ({"default": {"wholeGpu": "yes"}}, "default.wholeGpu", "boolean"),
    ({"default": {"memoryShares": {}, "mig": "dynamic"}}, "default", "memoryShares cannot be combined with mig: dynamic"),
    ({"default": {"memoryShares": {}, "slots": {"count": 2}}}, "default", "memoryShares cannot be combined with slots"),
    ({"default": {"memoryShares": {}, "wholeGpu": True}}, "default", "wholeGpu: true"),
    ({"default": {"memoryShares": {"minimum": "1.5Gi"}}}, "default.memoryShares.minimum", "integer quantity"),
    ({"default": {"memoryShares": {"minimum": "2Gi", "default": "1Gi"}}}, "default.memoryShares", "default 1Gi"),
    ({"default": {"mig": "static", "slots": {"count": 2}}}, "default", "slots cannot be combined with mig: static"),
    ({"default": {"mig": "static", "wholeGpu": True}}, "default", "wholeGpu: true cannot be combined"),
    ({"default": {"dynamicMig": {"profiles": ["1g.10gb"]}}}, "default", "dynamicMig needs mig: dynamic"),
    ({"default": {"mig": "dynamic", "dynamicMig": {"profiles": []}}}, "default.dynamicMig.profiles", "at least 1"),
    ({"default": {"mig": "dynamic", "dynamicMig": {"profiles": ["1g10gb"]}}}, "default.dynamicMig.profiles",
     "'1g10gb': not a MIG profile name like 1g.10gb"),
    ({"default": {"mig": "dynamic", "dynamicMig": {"profiles": ["3g.40gb", "3g.40gb"]}}},
     "default.dynamicMig.profiles", "'3g.40gb' named more than once"),
    ({"default": {"mig": "dynamic", "dynamicMig": {"profile": ["3g.40gb"]}}}, "default.dynamicMig.profile",
     "unknown field"),
])
def test_errors_name_source_field_and_reason(data, path, words):
    with pytest.raises(PolicyError) as info:
        parse(data)
    err = info.value
    assert err.source == "nodes/a.yaml"
    assert any(p == path for p, _ in err.problems), err.problems
    assert words in str(err)
    assert str(err).startswith("node policy nodes/a.yaml: ")


def test_non_mapping_is_rejected():
    with pytest.raises(PolicyError, match="must be a mapping"):
        parse(["mig"])


def test_static_mig_default_does_not_publish_whole():
    assert parse({"default": {"mig": "static"}}).default.publish_whole is False
    assert parse({"default": {"mig": "dynamic"}}).default.publish_whole is True


def test_dynamic_mig_profiles_are_read_in_both_spellings():
    for key in ("dynamicMig", "dynamic_mig"):
        pol = parse({"rules": [{"match": {"model": "H100"}, "mig": "dynamic", key: {"profiles": ["1g.10gb+me"]}}]})
        assert pol.for_gpu(h100(0)).dynamic_mig.profiles == ["1g.10gb+me"]
    assert parse({"default": {"mig": "dynamic"}}).default.dynamic_mig is None


def test_slot_layout_is_devices_or_capacity():
    assert parse_node_policy({"default": {"slots": {"count": 2}}}, "t").default.slots.layout == "devices"
    pol = parse_node_policy({"default": {"slots": {"count": 2, "layout": "capacity"}}}, "t")
    assert pol.default.slots.layout == "capacity"
    with pytest.raises(PolicyError, match=r"default\.slots\.layout"):
        parse_node_policy({"default": {"slots": {"count": 2, "layout": "shares"}}}, "t")


def test_dynamic_mig_layout_capacity_needs_exactly_one_profile():
    dyn = parse_node_policy({"default": {"mig": "dynamic", "dynamicMig": {"profiles": ["1g.10gb"]}}}, "t")
    assert dyn.default.dynamic_mig is not None and dyn.default.dynamic_mig.layout == "placements"
    one = {"mig": "dynamic", "dynamicMig": {"profiles": ["1g.10gb"], "layout": "capacity"}}
    assert parse_node_policy({"default": one}, "t").default.dynamic_mig.layout == "capacity"
    two = {"mig": "dynamic", "dynamicMig": {"profiles": ["1g.10gb", "3g.40gb"], "layout": "capacity"}}
    with pytest.raises(PolicyError, match=r"rules\[0\]\.dynamicMig: layout: capacity needs exactly one profile .*got 2"):
        parse_node_policy({"rules": [{"match": {"index": 0}, **two}]}, "t")
    with pytest.raises(PolicyError, match=r"default\.dynamicMig\.layout"):
        parse_node_policy({"default": {**one, "dynamicMig": {"profiles": ["1g.10gb"], "layout": "any"}}}, "t")
