"""Fuzzing what the API server hands the plugin: claims whose allocation, config entries and opaque parameters
are replaced, at random paths, by random JSON, prepared through ``Driver.prepare`` as the kubelet's call
would. Every outcome must be a success or a clean per-claim error (never "internal error"), and nothing may
be left behind after the unprepare. Seeded; thousands of cases per run; prints tried / survived / leaked."""
from __future__ import annotations

import copy
from collections import Counter
from typing import Any

from driver_node import Node, gpu_config, opaque
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
    | st.text(max_size=12) | st.sampled_from(["GpuConfig", "MigDeviceConfig", "MPS", "TimeSlicing", "Long", "50",
                                             "1Gi", "gpu.dra-driver.io/v1alpha1", "gpu-1-slot-0", "r"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8) | st.sampled_from(
        ["kind", "apiVersion", "sharing", "strategy", "mps", "timeSlicing", "interval", "requests", "opaque",
         "driver", "parameters", "activeThreadPercentage", "pinnedMemoryLimit"]), inner, max_size=3),
    max_leaves=6)

# Where a value is replaced: paths into the claim below ("*" ends at a key picked by the fuzzer).
PATHS = [
    ("status",), ("status", "allocation"), ("status", "allocation", "devices"),
    ("status", "allocation", "devices", "results"), ("status", "allocation", "devices", "results", 0),
    ("status", "allocation", "devices", "results", 0, "*"),
    ("status", "allocation", "devices", "config"), ("status", "allocation", "devices", "config", 0),
    ("status", "allocation", "devices", "config", 0, "*"), ("status", "allocation", "devices", "config", 0, "opaque"),
    ("status", "allocation", "devices", "config", 0, "opaque", "parameters"),
    ("status", "allocation", "devices", "config", 0, "opaque", "parameters", "*"),
    ("status", "allocation", "devices", "config", 0, "opaque", "parameters", "sharing", "*"),
    ("status", "allocation", "devices", "config", 0, "opaque", "parameters", "sharing", "mps", "*"),
    ("spec", "devices", "config"), ("spec",),
]
KEYS = ["request", "device", "driver", "pool", "shareID", "adminAccess", "consumedCapacity", "requests", "source",
        "kind", "apiVersion", "strategy", "timeSlicing", "mps", "activeThreadPercentage", "pinnedMemoryLimit",
        "perDevicePinnedMemoryLimit", "sharing", "unknownField"]

stats: Counter[str] = Counter()


def _set(doc: Any, path: tuple[Any, ...], key: str, value: Any) -> None:
    for step in path[:-1]:
        doc = doc[step] if isinstance(doc, (dict, list)) and (isinstance(doc, dict) and step in doc or
                                                               isinstance(doc, list) and step < len(doc)) else None
        if doc is None:
            return
    last = key if path[-1] == "*" else path[-1]
    if isinstance(doc, dict):
        doc[last] = value
    elif isinstance(doc, list) and isinstance(last, int) and last < len(doc):
        doc[last] = value


_NODE: dict[str, Node] = {}


def _node(tmp_path_factory: Any) -> Node:
    if "n" not in _NODE:
        _NODE["n"] = Node(tmp_path_factory.mktemp("fuzz"), {
            "default": {"mig": "dynamic"},
            "rules": [{"match": {"index": 1}, "slots": {"count": 2, "strategy": "mps"}}]})
    return _NODE["n"]


@seed(20261203)
@settings(max_examples=2500, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(path=st.sampled_from(PATHS), key=st.sampled_from(KEYS), value=JSON, device=st.sampled_from(
    ["gpu-1-slot-0", "gpu-0-mig-1g10gb-19-0", "gpu-0"]))
def test_fuzzed_claims_fail_cleanly_and_leave_nothing(tmp_path_factory: Any, path: tuple[Any, ...], key: str,
                                                      value: Any, device: str) -> None:
    node = _node(tmp_path_factory)
    ref = node.add_claim("fuzz", [{"request": "r", "device": device}],
                         [opaque(gpu_config(strategy="MPS", mps={"activeThreadPercentage": 40}))]
                         if "slot" in device else None)
    claim = copy.deepcopy(node.claims.get_claim(ref.namespace, ref.name, ref.uid))
    claim.setdefault("spec", {"devices": {"config": []}})
    _set(claim, path, key, value)
    node.claims.put(claim)
    result = node.driver.prepare([ref])[ref.uid]
    stats["tried"] += 1
    assert "internal error" not in result.error, result.error
    stats["survived" if not result.error else "refused"] += 1
    assert node.driver.unprepare([ref])[ref.uid].error == ""
    leaked = [m.uuid for g in range(2) for m in node.mig_devices(g)] + list(node.driver.checkpoint.claims()) \
        + list(node.driver.cdi.list_claim_specs()) + [p for p, d in node.control.daemons.items() if d.alive]
    stats["leaked"] += len(leaked)
    assert leaked == []


def test_fuzz_report() -> None:
    print(f"\nfuzz: tried {stats['tried']}, prepared {stats['survived']}, refused cleanly {stats['refused']}, "
          f"leaked {stats['leaked']}")
    assert stats["tried"] >= 2000 and stats["survived"] > 0 and stats["refused"] > 0
