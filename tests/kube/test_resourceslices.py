"""Pure parts of the ResourceSlice controller: names, pool validation, spec comparison, back-off, version rule."""
from __future__ import annotations

import copy
import logging
import re
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from slice_servers import OldSliceApi

import kube.serverversion as serverversion
from api.quantity import quantity_value
from bench.memapi import InMemorySliceApi, _status
from kube.backoff import Backoff
from kube.client import SLICES
from kube.resourceslices import (
    MAX_POOL_SLICES,
    DesiredPool,
    InvalidPoolError,
    Owner,
    PoolSyncError,
    ResourceSliceController,
    check_desired_pool,
    slice_name,
)
from kube.slicecompare import normalize_spec

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def devices(*names: str, **extra: object) -> dict:
    return {"devices": [{"name": n, **extra} for n in names]}


# ---- names ------------------------------------------------------------------------------------------

def test_slice_names_are_readable_and_stable() -> None:
    assert slice_name("gpu.dra-driver.io", "node-a", 0) == "node-a-gpu.dra-driver.io-0000"
    assert slice_name("gpu.dra-driver.io", "node-a", 11) == "node-a-gpu.dra-driver.io-0011"


@settings(max_examples=60, deadline=None)
@given(pool=st.text(alphabet="abcXYZ019.-/_", min_size=1, max_size=300),
       indexes=st.lists(st.integers(0, MAX_POOL_SLICES - 1), min_size=2, max_size=20, unique=True))
def test_slice_names_sort_in_pool_order(pool: str, indexes: list[int]) -> None:
    """kube-scheduler visits a pool's slices in name order: that must be the order of their indexes."""
    names = {slice_name("gpu.dra-driver.io", pool, i): i for i in indexes}
    assert [names[n] for n in sorted(names)] == sorted(indexes)


def test_a_pool_has_at_most_as_many_slices_as_the_names_can_order() -> None:
    assert slice_name(DRIVER, "node-a", MAX_POOL_SLICES - 1).endswith("-9999")
    with pytest.raises(ValueError, match="at most 10000 slices"):
        slice_name(DRIVER, "node-a", MAX_POOL_SLICES)
    with pytest.raises(InvalidPoolError, match="10001 slices, at most 10000"):
        check_desired_pool(DRIVER, "node-a", pool(*[{"devices": []}] * (MAX_POOL_SLICES + 1)), NODE)


def test_pool_names_that_need_changes_get_a_hash_and_stay_distinct() -> None:
    a = slice_name("gpu.example.com", "rack/a", 0)
    b = slice_name("gpu.example.com", "rack-a", 0)
    assert a != b and DNS_SUBDOMAIN.match(a)
    assert b == "rack-a-gpu.example.com-0000"


@settings(max_examples=60, deadline=None)
@given(pool=st.text(alphabet="abcXYZ019.-/_", min_size=1, max_size=300), index=st.integers(0, 500))
def test_slice_names_are_always_dns_subdomains(pool: str, index: int) -> None:
    name = slice_name("gpu.dra-driver.io", pool, index)
    assert len(name) <= 253 and DNS_SUBDOMAIN.match(name), name
    assert name.endswith(f"-{index:04d}")


# ---- pool validation ----------------------------------------------------------------------------------

NODE = Owner.node("node-a")
DRIVER = "gpu.dra-driver.io"


def pool(*parts: dict, **kw: object) -> DesiredPool:
    kw.setdefault("node_name", "node-a")
    return DesiredPool(slices=list(parts), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad, message", [
    (pool(devices("gpu-0"), devices("gpu-0")), "device 'gpu-0' appears twice"),
    (pool({"sharedCounters": [{"name": "cs", "counters": {}}]}, {"sharedCounters": [{"name": "cs", "counters": {}}]}),
     "counter set 'cs' is defined twice"),
    (pool(devices("gpu-0", consumesCounters=[{"counterSet": "nope", "counters": {}}])), "'nope', which the pool does not define"),
    (pool({"sharedCounters": [{"name": "cs", "counters": {"memory": {"value": "1Gi"}}}]},
          devices("mig", consumesCounters=[{"counterSet": "cs", "counters": {"sm": {"value": "1"}}}])),
     r"counters \['sm'\] are not in counter set 'cs'"),
    (pool({"devices": [{"name": "a"}], "sharedCounters": [{"name": "cs"}]}), "either devices or sharedCounters"),
    (pool(devices(*[f"d{i}" for i in range(129)])), "129 devices, at most 128"),
    (pool({"sharedCounters": [{"name": "cs", "counters": {}}]},
          devices(*[f"d{i}" for i in range(65)], consumesCounters=[{"counterSet": "cs", "counters": {}}])),
     "65 devices, at most 64 allowed when devices use taints"),
    (pool({"nodeName": "node-a", "devices": []}), "belong to the pool, not to a slice part"),
    (pool(devices("a"), node_name=None), "exactly one of node_name"),
    (pool(devices("a"), all_nodes=True), "exactly one of node_name"),
    (pool(devices("a"), node_name="node-b"), "publishes for node 'node-a' only"),
    (pool(), "needs at least one slice"),
    (pool("not a dict"), "slice 0: must be a dict"),  # type: ignore[arg-type]
])
def test_invalid_pools_are_rejected_with_the_reason(bad: DesiredPool, message: str) -> None:
    with pytest.raises(InvalidPoolError, match=message):
        check_desired_pool(DRIVER, "node-a", bad, NODE)


def test_valid_pools_pass() -> None:
    check_desired_pool(DRIVER, "node-a", pool({"sharedCounters": [{"name": "cs", "counters": {"memory": {"value": "1Gi"}}}]},
                                 devices("mig", consumesCounters=[{"counterSet": "cs", "counters": {"memory": {"value": "1Gi"}}}]),
                                 {"devices": []}), NODE)
    check_desired_pool(DRIVER, "shared-pool", DesiredPool(slices=[devices("a")], all_nodes=True), Owner.cluster())
    with pytest.raises(InvalidPoolError, match="name must be DNS subdomains"):
        check_desired_pool(DRIVER, "Bad_Pool", DesiredPool(slices=[devices("a")], all_nodes=True), Owner.cluster())


def test_update_is_all_or_nothing() -> None:
    ctl = ResourceSliceController(object(), "gpu.dra-driver.io", NODE)
    ctl.update({"node-a": pool(devices("a"))})
    with pytest.raises(InvalidPoolError):
        ctl.update({"node-a": pool(devices("a")), "node-b": pool(devices("b"), node_name="node-b")})
    assert set(ctl._desired or {}) == {"node-a"}


def test_driver_name_is_checked() -> None:
    with pytest.raises(ValueError, match="DNS subdomain"):
        ResourceSliceController(object(), "GPU_Driver", NODE)


def test_full_specs_from_the_slice_builder_become_a_pool() -> None:
    specs = [{"driver": "d.example.com", "pool": {"name": "node-a", "resourceSliceCount": 2}, "nodeName": "node-a",
              "sharedCounters": [{"name": "cs", "counters": {}}]},
             {"driver": "d.example.com", "pool": {"name": "node-a", "resourceSliceCount": 2}, "nodeName": "node-a",
              "devices": [{"name": "gpu-0"}]}]
    p = DesiredPool.from_slice_specs(specs)
    assert p.node_name == "node-a"
    assert p.slices == [{"sharedCounters": [{"name": "cs", "counters": {}}]}, {"devices": [{"name": "gpu-0"}]}]
    assert DesiredPool.from_slice_specs([], "node-b").slices == [{"devices": []}]
    with pytest.raises(InvalidPoolError, match="exactly one node"):
        DesiredPool.from_slice_specs([{**specs[0], "nodeName": "node-b"}, specs[1]])


def test_slices_under_the_unpadded_names_of_older_releases_are_replaced_cleanly() -> None:
    """An upgrade: the server holds the pool under the old names (`-0` .. `-11`). One sync deletes every one of
    them and writes the pool under the new names with the next generation; the sync after that writes nothing."""
    api = InMemorySliceApi(["node-a"])
    old = pool(*[devices(f"gpu-{i}") for i in range(12)])
    for i, part in enumerate(old.slices):
        api.create(SLICES, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                            "metadata": {"name": f"node-a-{DRIVER}-{i}"},
                            "spec": {"driver": DRIVER, "nodeName": "node-a", **part,
                                     "pool": {"name": "node-a", "generation": 3, "resourceSliceCount": 12}}})
    api.writes.clear()
    ctl = ResourceSliceController(object(), DRIVER, NODE)
    ctl.kube = api  # type: ignore[assignment]
    ctl.update({"node-a": old})
    ctl.run_once(timeout=10)
    assert dict(api.writes) == {"delete": 12, "create": 12}
    stored = sorted(api.list(SLICES, f"spec.driver={DRIVER}")["items"], key=lambda o: o["metadata"]["name"])
    assert [o["metadata"]["name"] for o in stored] == [slice_name(DRIVER, "node-a", i) for i in range(12)]
    assert [o["spec"]["devices"][0]["name"] for o in stored] == [f"gpu-{i}" for i in range(12)]
    assert {o["spec"]["pool"]["generation"] for o in stored} == {4}
    ctl.run_once(timeout=10)
    assert dict(api.writes) == {"delete": 12, "create": 12}


def test_resync_brings_back_slices_deleted_without_an_event_seen() -> None:
    """A kubelet deletes its node's slices when it starts; the plugin calls resync() when that kubelet registers
    it again. Without it nothing queues the pool (no slice is left to list); with it the pool is written again."""
    api = InMemorySliceApi(["node-a"])
    ctl = ResourceSliceController(object(), DRIVER, NODE)
    ctl.kube = api  # type: ignore[assignment]
    ctl.update({"node-a": pool(devices("gpu-0"), devices("gpu-1"))})
    ctl.run_once(timeout=10)
    for obj in api.list(SLICES, f"spec.driver={DRIVER}")["items"]:
        api.delete(SLICES, obj["metadata"]["name"])
    api.writes.clear()
    ctl.run_once(timeout=10)
    assert api.slice_count == 0 and not api.writes
    ctl.resync()
    ctl.run_once(timeout=10)
    assert api.slice_count == 2 and dict(api.writes) == {"create": 2}


# ---- comparison ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("80Gi", 80 * 2**30), ("81920Mi", 80 * 2**30), ("1.5Gi", 3 * 2**29), ("500m", Fraction(1, 2)),
    ("1e3", 1000), ("2k", 2000), ("132", 132), (7, 7), ("0", 0), ("+1", 1)])
def test_quantities_are_read_exactly(text: object, value: object) -> None:
    assert quantity_value(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "1.2.3", "abc", "1KiB", True])
def test_bad_quantities_are_rejected(text: object) -> None:
    with pytest.raises(ValueError):
        quantity_value(text)


def spec(**device: object) -> dict:
    return {"driver": "d", "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1}, "nodeName": "n",
            "devices": [{"name": "gpu-0", **device}]}


def test_server_normalisation_is_not_a_change() -> None:
    sent = spec(capacity={"memory": {"value": "81920Mi"}}, attributes={"on": {"bool": False}}, taints=[
        {"key": "k", "effect": "NoSchedule"}], bindingConditions=[], allowMultipleAllocations=False)
    stored = spec(capacity={"memory": {"value": "80Gi"}}, attributes={"on": {"bool": False}}, taints=[
        {"key": "k", "effect": "NoSchedule", "timeAdded": "2026-01-01T00:00:00Z"}])
    assert normalize_spec(sent) == normalize_spec(stored)


@pytest.mark.parametrize("changed", [
    spec(capacity={"memory": {"value": "40Gi"}}, attributes={"on": {"bool": False}}),
    spec(capacity={"memory": {"value": "80Gi"}}),                          # a false attribute is data
    spec(capacity={"memory": {"value": "80Gi"}}, attributes={"on": {"bool": True}}),
    spec(capacity={"memory": {"value": "80Gi"}}, attributes={"on": {"bool": False}}, taints=[{"key": "k", "effect": "None"}]),
])
def test_real_changes_are_seen(changed: dict) -> None:
    base = spec(capacity={"memory": {"value": "80Gi"}}, attributes={"on": {"bool": False}})
    assert normalize_spec(base) != normalize_spec(changed)


def test_counter_quantities_are_compared_by_value() -> None:
    a = {"sharedCounters": [{"name": "cs", "counters": {"memory": {"value": "1024Mi"}}}]}
    b = {"sharedCounters": [{"name": "cs", "counters": {"memory": {"value": "1Gi"}}}]}
    c = {"sharedCounters": [{"name": "cs", "counters": {"memory": {"value": "2Gi"}}}]}
    assert normalize_spec(a) == normalize_spec(b) != normalize_spec(c)


# ---- back-off and server version ------------------------------------------------------------------------

def test_backoff_doubles_up_to_the_cap_and_resets() -> None:
    b = Backoff(initial=0.5, maximum=3.0)
    assert [b.failure("p") for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert b.failure("q") == 0.5 and b.failures("p") == 5
    b.success("p")
    assert b.failure("p") == 0.5


@pytest.mark.parametrize("minor, warned, partitionable", [(35, True, False), (36, False, True), (37, False, True)])
def test_old_api_servers_get_one_clear_line(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                            minor: int, warned: bool, partitionable: bool) -> None:
    monkeypatch.setattr(serverversion, "fetch_server_minor", lambda api, timeout=0: minor)
    with caplog.at_level(logging.INFO, logger="kube.serverversion"):
        features = serverversion.api_features(object())
    lines = [r.getMessage() for r in caplog.records]
    assert features.partitionable is partitionable
    if warned:
        assert len(lines) == 1 and f"Kubernetes 1.{minor}" in lines[0] and "only whole GPUs and static MIG" in lines[0]
    else:
        assert lines == []


# --- servers older than the newest API ------------------------------------------------------------------------------
# The ResourceSlice controller on an API server without the `spec.pool.name` field selector (Kubernetes 1.34):
# each pool's slices are picked out of the driver's slices, so no pool mistakes another's slices for its own.

NODES = ("node-a", "node-b")


def _pools(gpus: int = 2) -> dict[str, DesiredPool]:
    return {n: DesiredPool(node_name=n, slices=[{"devices": [
        {"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}}} for i in range(gpus)]}]) for n in NODES}


def _controller(api: InMemorySliceApi, owner: Owner = Owner.cluster()) -> ResourceSliceController:
    ctl = ResourceSliceController(object(), DRIVER, owner)
    ctl.kube = api  # type: ignore[assignment]
    return ctl


def _devices(api: InMemorySliceApi) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for s in api.list(SLICES, f"spec.driver={DRIVER}")["items"]:
        out.setdefault(s["spec"]["pool"]["name"], []).extend(d["name"] for d in s["spec"]["devices"])
    return out


def test_pools_are_kept_apart_without_the_pool_selector(caplog: pytest.LogCaptureFixture) -> None:
    api = OldSliceApi(list(NODES))
    ctl = _controller(api)
    ctl.update(_pools())
    with caplog.at_level(logging.INFO, logger="kube.resourceslices"):
        ctl.run_once(timeout=10)
        ctl.update(_pools(gpus=3))                  # one more GPU on every node: one update per pool
        ctl.run_once(timeout=10)
    assert _devices(api) == {n: ["gpu-0", "gpu-1", "gpu-2"] for n in NODES}
    assert dict(api.writes) == {"create": 2, "update": 2}
    assert api.rejected == 1                        # asked once, then never again
    lines = [r.getMessage() for r in caplog.records if "spec.pool.name" in r.getMessage()]
    assert len(lines) == 1 and DRIVER in lines[0]

    restarted = _controller(api)
    restarted.update(_pools(gpus=3))
    restarted.run_once(timeout=10)
    assert restarted.writes == 0


def test_a_node_owner_also_works_without_the_pool_selector() -> None:
    api = OldSliceApi(list(NODES))
    for node in NODES:
        ctl = _controller(api, Owner.node(node))
        ctl.update({node: _pools()[node]})
        ctl.run_once(timeout=10)
    assert _devices(api) == {n: ["gpu-0", "gpu-1"] for n in NODES}
    assert dict(api.writes) == {"create": 2}


def test_servers_with_the_pool_selector_are_asked_by_pool() -> None:
    api = InMemorySliceApi(list(NODES))
    ctl = _controller(api)
    ctl.update(_pools())
    ctl.run_once(timeout=10)
    assert ctl._pool_field_selector is True
    assert _devices(api) == {n: ["gpu-0", "gpu-1"] for n in NODES}


def test_other_bad_requests_are_not_mistaken_for_an_old_server() -> None:
    class Broken(InMemorySliceApi):
        def list(self, collection: str, field_selector: str | None = None,
                 label_selector: str | None = None) -> dict[str, Any]:
            if "spec.pool.name" in (field_selector or ""):
                raise _status("GET", collection, 400, "BadRequest", "something else is wrong")
            return super().list(collection, field_selector, label_selector)

    api = Broken(list(NODES))
    ctl = _controller(api)
    ctl.update(_pools())
    with pytest.raises(PoolSyncError, match="something else is wrong"):
        ctl.run_once(timeout=1)
    assert ctl._pool_field_selector is True and api.total_writes == 0


# --- servers that do not store what they are sent -------------------------------------------------------------------
# The ResourceSlice controller against servers that do not simply store what they are sent: one that drops a
# field it does not support (the slice must not be rewritten forever, and the drop is logged once), and a
# concurrent writer that makes an update conflict (409: the pool is re-read and synced again).

NODE_NAME = "node-a"


def gpus(count: int, **extra: Any) -> DesiredPool:
    return DesiredPool(node_name=NODE_NAME, slices=[{"devices": [
        {"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}}, **extra} for i in range(count)]}])


def controller(api: InMemorySliceApi) -> ResourceSliceController:
    ctl = ResourceSliceController(object(), DRIVER, Owner.node(NODE_NAME), backoff=Backoff(initial=0.01, maximum=0.05))
    ctl.kube = api  # type: ignore[assignment]
    return ctl


def stored_devices(api: InMemorySliceApi) -> list[dict[str, Any]]:
    [s] = api.list(SLICES, f"spec.driver={DRIVER}")["items"]
    return s["spec"]["devices"]


class DropsTaints(InMemorySliceApi):
    """A server whose DRADeviceTaints feature is off: it stores slices without device taints."""

    def _store(self, name: str, obj: dict[str, Any], uid: str, generation: int, operation: str) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        for device in obj.get("spec", {}).get("devices") or []:
            device.pop("taints", None)
        return super()._store(name, obj, uid, generation, operation)


TAINT = {"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}


def test_a_field_the_server_drops_is_logged_once_and_not_rewritten(caplog: pytest.LogCaptureFixture) -> None:
    api = DropsTaints([NODE_NAME])
    ctl = controller(api)
    with caplog.at_level(logging.ERROR, logger="kube.resourceslices"):
        ctl.update({NODE_NAME: gpus(2, taints=[TAINT])})
        ctl.run_once(timeout=10)
        for _ in range(3):                        # later passes (resyncs) see the same difference
            ctl.run_once(timeout=10)
    assert dict(api.writes) == {"create": 1}
    assert all("taints" not in d for d in stored_devices(api))
    [line] = [r.getMessage() for r in caplog.records]
    name = slice_name(DRIVER, NODE_NAME, 0)
    assert line.startswith(f"driver {DRIVER} pool {NODE_NAME}: the API server did not store ResourceSlice {name} as sent (")
    assert "spec.devices[0].taints: dropped by the server" in line
    assert line.endswith("a feature it needs is probably disabled there. Not retrying this difference.")

    # A real change is still written; the same field dropped again is not reported again.
    changed = gpus(2, taints=[TAINT])
    for device in changed.slices[0]["devices"]:
        device["attributes"]["productName"] = {"string": "NVIDIA L4"}
    ctl.update({NODE_NAME: changed})
    with caplog.at_level(logging.ERROR, logger="kube.resourceslices"):
        ctl.run_once(timeout=10)
        ctl.run_once(timeout=10)
    assert dict(api.writes) == {"create": 1, "update": 1}
    assert all(d["attributes"]["productName"] == {"string": "NVIDIA L4"} for d in stored_devices(api))
    assert len(caplog.records) == 1


class ConcurrentWriter(InMemorySliceApi):
    """Someone else updates the slice just before our next update reaches the server (once)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = False
        self.conflicts = 0

    def replace(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        if self.armed:
            self.armed = False
            theirs = self.list(SLICES, f"spec.driver={DRIVER}")["items"][0]
            theirs["spec"]["devices"].append({"name": "intruder", "attributes": {"type": {"string": "gpu"}}})
            super().replace(collection, theirs)
            try:
                return super().replace(collection, obj)   # our resourceVersion is now stale: 409
            except Exception:
                self.conflicts += 1
                raise
        return super().replace(collection, obj)


def test_an_update_conflict_is_re_read_and_synced_again(caplog: pytest.LogCaptureFixture) -> None:
    api = ConcurrentWriter([NODE_NAME])
    ctl = controller(api)
    ctl.update({NODE_NAME: gpus(2)})
    ctl.run_once(timeout=10)
    api.armed = True
    ctl.update({NODE_NAME: gpus(3)})
    with caplog.at_level(logging.WARNING, logger="kube.resourceslices"):
        ctl.run_once(timeout=10)
    assert api.conflicts == 1
    assert [d["name"] for d in stored_devices(api)] == ["gpu-0", "gpu-1", "gpu-2"]   # theirs overwritten
    assert ctl.errors == {}
    # One failed attempt (the conflict), then the re-read and a successful update.
    assert ctl.writes_by_operation == {"create": 1, "update": 1}
    assert dict(api.writes) == {"create": 1, "update": 2}
    [warning] = [r.getMessage() for r in caplog.records]
    assert f"pool {NODE_NAME}: sync failed (attempt 1)" in warning
    assert "update conflicted with another change" in warning and "will re-read" in warning


def test_a_labelled_publisher_changes_only_the_pools_it_created() -> None:
    """`gpu-dra publish` (a labelled owner) next to a node plugin: the plugin's pool (no label) is neither listed,
    changed nor deleted; the publisher's own pool leaves when it is no longer desired."""
    api = InMemorySliceApi(["node-a", "node-b"])
    plugin = ResourceSliceController(object(), DRIVER, NODE)
    plugin.kube = api  # type: ignore[assignment]
    plugin.update({"node-a": pool(devices("gpu-0"), devices("gpu-1"))})
    plugin.run_once(timeout=10)
    publisher = ResourceSliceController(object(), DRIVER, Owner.labelled("example.com/by", "publish"))
    publisher.kube = api  # type: ignore[assignment]
    publisher.update({"node-b": pool(devices("gpu-0"), node_name="node-b")})
    publisher.run_once(timeout=10)
    stored = api.list(SLICES, f"spec.driver={DRIVER}")["items"]
    by_pool = {o["spec"]["pool"]["name"]: o for o in stored}
    assert set(by_pool) == {"node-a", "node-b"}
    assert by_pool["node-b"]["metadata"]["labels"] == {"example.com/by": "publish"}
    assert "labels" not in by_pool["node-a"]["metadata"]
    api.writes.clear()
    publisher.update({})
    publisher.run_once(timeout=10)
    assert dict(api.writes) == {"delete": 1}
    assert {o["spec"]["pool"]["name"] for o in api.list(SLICES, f"spec.driver={DRIVER}")["items"]} == {"node-a"}
