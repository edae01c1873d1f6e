"""The ResourceSlice controller at fleet scale, against the in-memory API: one metadata-only LIST per pass, digests
instead of full comparisons, pools streamed in while others are written, a bounded number of writes in flight,
the desired state held compressed; and that none of it weakens what the controller guarantees."""
from __future__ import annotations

import json
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from slice_servers import OldSliceApi

from bench.memapi import InMemorySliceApi
from kube.client import NODES, SLICES
from kube.resourceslices import (
    SPEC_ANNOTATION,
    DesiredPool,
    InvalidPoolError,
    Owner,
    ResourceSliceController,
    slice_name,
)

DRIVER = "gpu.example.com"


def node_pool(node: str, gpus: int = 4, slices: int = 2, memory: str = "80Gi") -> DesiredPool:
    """`slices` slices of `gpus` devices each, with the attributes and capacities a GPU node publishes."""
    return DesiredPool(node_name=node, slices=[{"devices": [
        {"name": f"gpu-{s}-{i}", "attributes": {"type": {"string": "gpu"}, "index": {"int": i},
                                                "productName": {"string": "NVIDIA H100 80GB HBM3"}},
         "capacity": {"memory": {"value": memory}}} for i in range(gpus)]} for s in range(slices)])


def fleet(nodes: int, **kw: Any) -> dict[str, DesiredPool]:
    return {f"node-{i:03d}": node_pool(f"node-{i:03d}", **kw) for i in range(nodes)}


class CountingApi(InMemorySliceApi):
    """Counts every read by kind, and can make creates slow (to see what happens while writes are in flight)."""

    def __init__(self, *args: Any, create_delay: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter[str] = Counter()
        self.create_delay = create_delay
        self.in_flight = 0
        self.max_in_flight = 0
        self.pools_in_flight: Counter[str] = Counter()
        self.max_per_pool = 0
        self._count_lock = threading.Lock()

    def list(self, collection: str, field_selector: str | None = None,
             label_selector: str | None = None) -> dict[str, Any]:
        kind = "list-pool" if "spec.pool.name" in (field_selector or "") else "list"
        self.calls[f"{kind} {'nodes' if collection == NODES else 'slices'}"] += 1
        return super().list(collection, field_selector, label_selector)

    def list_metadata(self, collection: str, field_selector: str | None = None,
                      label_selector: str | None = None) -> dict[str, Any]:
        self.calls[f"list-metadata {'nodes' if collection == NODES else 'slices'}"] += 1
        listed = InMemorySliceApi.list(self, collection, field_selector, label_selector)   # not counted as a list
        return {"items": [{"metadata": o["metadata"]} for o in listed["items"]], "resourceVersion": listed["resourceVersion"]}

    def iter_list(self, collection: str, field_selector: str | None = None, page_size: int = 100,
                  label_selector: str | None = None) -> Iterator[dict[str, Any]]:
        self.calls["paged-list slices"] += 1
        yield from InMemorySliceApi.list(self, collection, field_selector, label_selector)["items"]

    def get(self, path: str, **query: Any) -> dict[str, Any]:
        self.calls[f"get {'nodes' if path.startswith(NODES) else 'slices'}"] += 1
        return super().get(path, **query)

    def create(self, collection: str, obj: Any) -> dict[str, Any]:
        pool = (json.loads(obj) if isinstance(obj, bytes) else obj)["spec"]["pool"]["name"]
        with self._count_lock:
            self.in_flight += 1
            self.pools_in_flight[pool] += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.max_per_pool = max(self.max_per_pool, self.pools_in_flight[pool])
        try:
            time.sleep(self.create_delay)
            return super().create(collection, obj)
        finally:
            with self._count_lock:
                self.in_flight -= 1
                self.pools_in_flight[pool] -= 1

    def slices(self) -> list[dict[str, Any]]:
        return sorted(InMemorySliceApi.list(self, SLICES, f"spec.driver={DRIVER}")["items"],
                      key=lambda o: o["metadata"]["name"])


def controller(api: InMemorySliceApi, workers: int = 4, owner: Owner = Owner.cluster()) -> ResourceSliceController:
    ctl = ResourceSliceController(object(), DRIVER, owner, workers=workers)
    ctl.kube = api  # type: ignore[assignment]
    return ctl


def published(nodes: int = 12, **kw: Any) -> tuple[CountingApi, dict[str, DesiredPool]]:
    pools = fleet(nodes, **kw)
    api = CountingApi(list(pools))
    ctl = controller(api)
    ctl.update(pools)
    ctl.run_once(timeout=30)
    assert dict(api.writes) == {"create": sum(len(p.slices) for p in pools.values())}
    api.writes.clear()
    api.calls.clear()
    return api, pools


# ---- reading what exists ---------------------------------------------------------------------------------

def test_a_restart_lists_once_metadata_only_and_writes_nothing() -> None:
    api, pools = published(12)
    restarted = controller(api)
    restarted.update(pools)
    restarted.run_once(timeout=30)
    assert restarted.writes == 0 and not api.writes
    assert dict(api.calls) == {"list-metadata slices": 1}     # no LIST per pool, no full object read


def test_a_streamed_restart_lists_once_and_writes_nothing() -> None:
    api, pools = published(12)
    restarted = controller(api)
    restarted.run_once(timeout=30, pools=iter(pools.items()))
    assert restarted.writes == 0 and not api.writes
    assert dict(api.calls) == {"list-metadata slices": 1}


def test_every_slice_we_write_says_what_was_sent_and_which_generation_that_makes() -> None:
    api, pools = published(1)
    for obj in api.slices():
        note = json.loads(obj["metadata"]["annotations"][SPEC_ANNOTATION])
        assert note["generation"] == obj["metadata"]["generation"] == 1
        assert (note["pool"], note["poolGeneration"], note["count"]) == ("node-000", 1, 2)
    ctl = controller(api)
    changed = node_pool("node-000")
    changed.slices[1]["devices"][0]["capacity"]["memory"]["value"] = "40Gi"
    ctl.update({"node-000": changed})
    ctl.run_once(timeout=30)
    assert dict(api.writes) == {"update": 1}
    updated = api.slices()[1]
    assert json.loads(updated["metadata"]["annotations"][SPEC_ANNOTATION])["generation"] == 2
    assert updated["metadata"]["generation"] == 2


def test_one_change_is_one_update_and_two_changes_a_new_generation() -> None:
    api, pools = published(3)
    ctl = controller(api)
    one = dict(pools)
    one["node-001"] = node_pool("node-001")
    one["node-001"].slices[0]["devices"][2]["attributes"]["index"] = {"int": 99}
    ctl.update(one)
    ctl.run_once(timeout=30)
    assert dict(api.writes) == {"update": 1}
    two = dict(one)
    two["node-002"] = node_pool("node-002", memory="40Gi")          # both slices of one pool change
    ctl.update(two)
    ctl.run_once(timeout=30)
    assert dict(api.writes) == {"update": 3}
    assert {o["spec"]["pool"]["generation"] for o in api.slices() if o["spec"]["pool"]["name"] == "node-002"} == {2}


def test_a_spec_edited_behind_our_back_is_restored_though_our_annotation_stayed() -> None:
    """The edit leaves our annotation as it was, but the server raised metadata.generation: the slice can no
    longer be vouched for by its digest, is read in full, and put back."""
    api, pools = published(2)
    victim = api.slices()[1]
    victim["spec"]["devices"] = victim["spec"]["devices"][:1]
    InMemorySliceApi.replace(api, SLICES, victim)
    labelled = api.slices()[2]                                      # only metadata changes: still vouched for
    labelled["metadata"]["labels"] = {"team": "ml"}
    InMemorySliceApi.replace(api, SLICES, labelled)
    api.writes.clear()
    api.calls.clear()
    ctl = controller(api)
    ctl.update(pools)
    ctl.run_once(timeout=30)
    assert dict(api.writes) == {"update": 1}
    assert len(api.slices()[1]["spec"]["devices"]) == 4
    assert api.calls["get slices"] == 1                             # the edited one, and only that one
    assert api.slices()[2]["metadata"]["labels"] == {"team": "ml"}   # others' labels are kept


def _edited(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy of a published slice with one device fewer and our annotation left as it was."""
    copy = json.loads(json.dumps(obj))
    copy["spec"]["devices"] = copy["spec"]["devices"][:1]
    return copy


def test_a_slice_recreated_with_an_edited_spec_and_our_annotation_is_restored() -> None:
    """`kubectl replace --force` of an edited copy: the server gives the new object generation 1, the value our
    copied annotation names for a created slice; its uid is new, so the annotation no longer vouches for it."""
    pools = fleet(2)
    api = CountingApi(list(pools))
    ctl = controller(api)
    ctl.update(pools)
    ctl.run_once(timeout=30)
    victim = _edited(api.slices()[1])
    InMemorySliceApi.delete(api, SLICES, victim["metadata"]["name"])
    for key in ("uid", "resourceVersion", "generation"):
        del victim["metadata"][key]
    stored = InMemorySliceApi.create(api, SLICES, victim)
    assert stored["metadata"]["generation"] == json.loads(stored["metadata"]["annotations"][SPEC_ANNOTATION])["generation"]
    api.writes.clear()
    ctl.run_once(timeout=30)
    assert dict(api.writes) == {"update": 1}
    assert len(api.slices()[1]["spec"]["devices"]) == 4


def test_a_spec_edited_together_with_our_annotations_generation_is_restored() -> None:
    """One write changes the spec and raises the generation in our annotation to match: the server's generation
    is not the one our own write gave the slice, so the annotation no longer vouches for it."""
    pools = fleet(2)
    api = CountingApi(list(pools))
    ctl = controller(api)
    ctl.update(pools)
    ctl.run_once(timeout=30)
    victim = _edited(api.slices()[1])
    note = json.loads(victim["metadata"]["annotations"][SPEC_ANNOTATION])
    victim["metadata"]["annotations"][SPEC_ANNOTATION] = json.dumps({**note, "generation": note["generation"] + 1})
    stored = InMemorySliceApi.replace(api, SLICES, victim)
    assert stored["metadata"]["generation"] == note["generation"] + 1
    api.writes.clear()
    api.calls.clear()
    ctl.run_once(timeout=30)
    assert dict(api.writes) == {"update": 1}
    assert len(api.slices()[1]["spec"]["devices"]) == 4
    api.writes.clear()
    ctl.run_once(timeout=30)      # the repair is our write: vouched for again, nothing more to do
    assert not api.writes


def test_a_node_plugin_does_not_take_the_annotations_word_when_it_starts() -> None:
    """While no plugin ran, its slice was replaced by an edited copy carrying our annotation. A node's plugin
    reads its few slices in full when it starts, finds the edit and restores it; a second start, after that
    write of its own, still writes nothing."""
    pools = {"node-000": node_pool("node-000")}
    api = CountingApi(list(pools))
    node = Owner.node("node-000")
    first = controller(api, owner=node)
    first.update(pools)
    first.run_once(timeout=30)
    victim = _edited(api.slices()[1])
    InMemorySliceApi.delete(api, SLICES, victim["metadata"]["name"])
    for key in ("uid", "resourceVersion", "generation"):
        del victim["metadata"][key]
    InMemorySliceApi.create(api, SLICES, victim)
    api.writes.clear()
    for expected in ({"update": 1}, {}):
        restarted = controller(api, owner=node)
        restarted.update(pools)
        restarted.run_once(timeout=30)
        assert dict(api.writes) == expected
        api.writes.clear()
    assert len(api.slices()[1]["spec"]["devices"]) == 4


def old_release_slices(api: InMemorySliceApi, pools: dict[str, DesiredPool]) -> None:
    """The pools as an older release wrote them: same specs, no annotation."""
    for name, pool in pools.items():
        for i, part in enumerate(pool.slices):
            api.create(SLICES, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                                "metadata": {"name": slice_name(DRIVER, name, i)},
                                "spec": {"driver": DRIVER, "nodeName": pool.node_name, **part,
                                         "pool": {"name": name, "generation": 1, "resourceSliceCount": len(pool.slices)}}})
    api.writes.clear()


@pytest.mark.parametrize("nodes, reads", [(3, "get slices"), (40, "paged-list slices")])
def test_slices_without_our_annotation_are_compared_in_full_and_left_alone(nodes: int, reads: str) -> None:
    pools = fleet(nodes)
    api = CountingApi(list(pools))
    old_release_slices(api, pools)
    ctl = controller(api)
    ctl.run_once(timeout=30, pools=iter(pools.items()))
    assert not api.writes
    assert api.calls[reads] == (2 * nodes if reads == "get slices" else 1)   # a few GETs, or one paged LIST
    assert api.calls["list-metadata slices"] == 1 and api.calls["list-pool slices"] == 0


# ---- streaming -------------------------------------------------------------------------------------------

def slow(pools: dict[str, DesiredPool], api: CountingApi, seen: list[int], delay: float = 0.01
         ) -> Iterator[tuple[str, DesiredPool]]:
    """The pools one at a time, noting how many creates the server had taken before each."""
    for item in pools.items():
        time.sleep(delay)
        seen.append(api.writes["create"])
        yield item


def test_streamed_pools_are_written_while_the_rest_is_still_computed() -> None:
    pools = fleet(20)
    api = CountingApi(list(pools))
    seen: list[int] = []
    ctl = controller(api, workers=2)
    ctl.run_once(timeout=30, pools=slow(pools, api, seen, delay=0.02))
    assert dict(api.writes) == {"create": 40}
    assert seen[-1] > 0, seen          # slices were stored before the last pool was even computed


def test_a_stream_never_deletes_a_pool_it_has_not_given_yet() -> None:
    """The LIST finds every pool; a pool the stream has not reached must not look unwanted."""
    api, pools = published(12)
    seen: list[int] = []
    ctl = controller(api, workers=4)
    ctl.run_once(timeout=30, pools=slow(pools, api, seen))
    assert not api.writes


def test_pools_missing_from_a_finished_stream_are_deleted() -> None:
    api, pools = published(5)
    kept = dict(list(pools.items())[:3])
    ctl = controller(api)
    ctl.run_once(timeout=30, pools=iter(kept.items()))
    assert dict(api.writes) == {"delete": 4}
    assert {o["spec"]["pool"]["name"] for o in api.slices()} == set(kept)


def test_an_aborted_stream_deletes_nothing_and_says_why() -> None:
    api, pools = published(6)

    def broken() -> Iterator[tuple[str, DesiredPool]]:
        yield from list(pools.items())[:2]
        raise ValueError("node-002: policy cannot be used")

    ctl = controller(api)
    with pytest.raises(ValueError, match="node-002"):
        ctl.run_once(timeout=30, pools=broken())
    assert not api.writes and len(api.slices()) == 12


def test_an_invalid_pool_in_a_stream_stops_it_before_anything_of_it_is_written() -> None:
    pools = fleet(3)
    pools["node-001"].slices.append({"devices": [{"name": "gpu-0-0"}]})   # a device name twice in the pool
    api = CountingApi(list(pools))
    with pytest.raises(InvalidPoolError, match="node-001.*appears twice"):
        controller(api).run_once(timeout=30, pools=iter(pools.items()))
    assert {o["spec"]["pool"]["name"] for o in api.slices()} <= {"node-000"}


def test_a_running_controller_takes_a_stream_and_drops_what_it_no_longer_gives() -> None:
    pools = fleet(6)
    api = CountingApi(list(pools))
    ctl = controller(api, workers=3)
    ctl.kube = api  # type: ignore[assignment]
    ctl._watch_loop = lambda: None        # type: ignore[method-assign]  # the in-memory API serves no watch
    with ctl:
        ctl.update_from(iter(pools.items()))
        assert ctl.wait_for_sync(10), ctl.errors
        assert dict(api.writes) == {"create": 12}
        ctl.update_from(iter(list(pools.items())[1:]))
        assert ctl.wait_for_sync(10), ctl.errors
    assert dict(api.writes) == {"create": 12, "delete": 2}


# ---- parallel writes ---------------------------------------------------------------------------------------

def test_writes_in_flight_are_bounded_by_the_workers_and_a_pool_has_one_writer() -> None:
    pools = fleet(16)
    api = CountingApi(list(pools), create_delay=0.02)
    ctl = controller(api, workers=3)
    ctl.run_once(timeout=60, pools=iter(pools.items()))
    assert dict(api.writes) == {"create": 32}
    assert api.max_in_flight == 3        # in parallel, never more than the workers
    assert api.max_per_pool == 1         # a pool's writes stay in order, one at a time


def test_the_stream_stays_only_a_few_pools_ahead_of_the_writes() -> None:
    pools = fleet(40)
    api = CountingApi(list(pools), create_delay=0.01)
    seen: list[int] = []
    ctl = controller(api, workers=2)
    ctl.run_once(timeout=60, pools=slow(pools, api, seen, delay=0.0))
    # Before pool k is computed, pools 0..k-1 were given; at most 4 per worker wait and 2 are being written.
    assert max(k - created // 2 for k, created in enumerate(seen)) <= 4 * 2 + 2 + 1, seen


def test_one_list_of_nodes_gives_every_owner_reference() -> None:
    pools = fleet(10)
    api = CountingApi(list(pools))
    controller(api).run_once(timeout=30, pools=iter(pools.items()))
    assert api.calls["list-metadata nodes"] == 1 and api.calls["get nodes"] == 0
    node_uids = {o["metadata"]["name"]: o["metadata"]["uid"] for o in InMemorySliceApi.list(api, NODES)["items"]}
    for obj in api.slices():
        [ref] = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == node_uids[obj["spec"]["nodeName"]]


def test_a_node_plugin_reads_its_pool_fresh_and_asks_for_its_node_only() -> None:
    api = CountingApi(["node-000"])
    ctl = controller(api, owner=Owner.node("node-000"))
    ctl.update({"node-000": node_pool("node-000")})
    ctl.run_once(timeout=30)
    assert api.calls["list-metadata nodes"] == 0 and api.calls["get nodes"] == 1
    assert api.calls["list-pool slices"] == 1


# ---- memory ------------------------------------------------------------------------------------------------

def test_the_desired_state_is_held_compressed_not_as_dicts() -> None:
    def pools() -> Iterator[tuple[str, DesiredPool]]:
        for i in range(30):
            yield f"node-{i:03d}", node_pool(f"node-{i:03d}", gpus=60)

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        as_dicts = dict(pools())
        dicts = tracemalloc.get_traced_memory()[0] - before
        del as_dicts
        api = CountingApi([f"node-{i:03d}" for i in range(30)])
        ctl = controller(api)
        base = tracemalloc.get_traced_memory()[0]
        ctl.run_once(timeout=30, pools=pools())
        held = tracemalloc.get_traced_memory()[0] - base - api_size(api)
    finally:
        tracemalloc.stop()
    assert ctl.desired_slices == 60
    assert held < dicts / 10, (held, dicts)


def api_size(api: InMemorySliceApi) -> int:
    """What the in-memory server itself holds (its stored JSON), not the controller's."""
    return sum(len(s.text) + 100 for s in api._slices.values())


# ---- old servers at scale ------------------------------------------------------------------------------------

def test_a_bulk_pass_on_a_server_without_the_pool_selector_never_needs_it_until_a_conflict() -> None:

    class OldServerWithAnotherWriter(OldSliceApi):
        """Someone changes the slice just before our update of it arrives (once)."""

        armed = False

        def replace(self, collection: str, obj: Any) -> dict[str, Any]:
            if self.armed:
                self.armed = False
                theirs = InMemorySliceApi.get(self, f"{SLICES}/{json.loads(obj)['metadata']['name']}")
                theirs["metadata"]["labels"] = {"touched": "yes"}
                InMemorySliceApi.replace(self, collection, theirs)
            return super().replace(collection, obj)

    pools = fleet(8)
    api = OldServerWithAnotherWriter(list(pools))
    ctl = controller(api)
    ctl.run_once(timeout=30, pools=iter(pools.items()))
    assert dict(api.writes) == {"create": 16} and api.rejected == 0
    # The update conflicts; the pool is read again on its own, which on this server means picking it out of
    # the driver's slices after one refused LIST.
    changed = dict(pools)
    changed["node-003"] = node_pool("node-003")
    changed["node-003"].slices[0]["devices"][0]["attributes"]["index"] = {"int": 7}
    api.armed = True
    ctl.run_once(timeout=30, pools=iter(changed.items()))
    assert api.rejected == 1
    assert dict(api.writes) == {"create": 16, "update": 2}        # theirs, then ours again
    assert ctl.writes_by_operation == {"create": 16, "update": 1}
    stored = [o for o in InMemorySliceApi.list(api, SLICES, f"spec.driver={DRIVER}")["items"]
              if o["metadata"]["name"] == slice_name(DRIVER, "node-003", 0)]
    assert stored[0]["spec"]["devices"][0]["attributes"]["index"] == {"int": 7}
    assert stored[0]["metadata"]["labels"] == {"touched": "yes"}


# ---- the desired state's cost per node (dra.model) ---------------------------------------------------------

def h100_node_model() -> Any:
    from dra.model.devices import build_devices
    from dra.model.policy import parse_node_policy
    from dra.node.inventory import discover_once
    from dra.sim.fleet import nvml_for_node, parse_fleet

    policy = {"default": {"mig": "dynamic", "slots": {"count": 4, "strategy": "mps"}}}
    node = parse_fleet({"nodes": [{"name": "n", "gpus": [{"model": "H100-80GB", "count": 8}], "policy": policy}]},
                       "<test>").nodes[0]
    return build_devices(discover_once(nvml_for_node(node)), parse_node_policy(policy, "<test>"))


def containers(value: Any) -> Iterator[Any]:
    if isinstance(value, (dict, list)):
        yield value
    for child in (value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()):
        yield from containers(child)


def test_wire_devices_are_fresh_deep_copies() -> None:
    """to_wire copies without copy.deepcopy now; callers may still change what it returns."""
    for device in h100_node_model().devices:
        first, second = device.to_wire(), device.to_wire()
        assert first == second
        shared = {id(c) for c in containers(first)} & {id(c) for c in containers(second)}
        assert not shared, device.name
        for c in containers(first):
            if isinstance(c, dict):
                c["changed"] = True
            else:
                c.append("changed")
        assert device.to_wire() == second


def test_the_mig_placement_search_runs_once_per_gpu_model() -> None:
    import dra.model.mig as mig

    mig._max_instances_alone.cache_clear()
    h100_node_model()
    info = mig._max_instances_alone.cache_info()
    assert info.misses <= 12 and info.hits >= 7 * info.misses     # 8 identical GPUs: the first one pays
    profiles = h100_profiles()
    assert profiles
    for p in profiles:
        assert mig.max_instances_alone(profiles, p.profile_id) == mig._max_instances_alone.__wrapped__(
            tuple(profiles), p.profile_id)


def h100_profiles() -> Any:
    from dra.model.catalog import get_model

    return get_model("H100-80GB").mig_profiles


# ---- gpu-dra publish: nodes computed in several processes ------------------------------------------------------

def test_nodes_computed_in_job_processes_come_back_prepared_in_fleet_order(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    import cli.publish_cmd as publish_cmd
    from dra.model.slices import ApiFeatures
    from dra.sim.fleet import parse_fleet
    from kube.resourceslices import PreparedPool, prepare_pool

    fleet = parse_fleet({"nodes": [{"name": f"l4-{i}", "gpus": [{"model": "L4", "count": 2}],
                                    "policy": {"default": {"slots": {"count": 2, "strategy": "time-slicing"}}}}
                                   for i in range(6)]}, "<test>")
    monkeypatch.setattr(publish_cmd, "MIN_NODES_PER_JOB", 2)
    in_jobs = publish_cmd.iter_prepared_fleet_pools(fleet, "<test>", DRIVER, ApiFeatures.all(), jobs=2)
    name, first = next(in_jobs)
    assert multiprocessing.active_children()           # computed elsewhere
    got = [(name, first), *in_jobs]
    here = [(n, prepare_pool(DRIVER, n, p)) for n, p in
            publish_cmd.iter_fleet_pools(fleet, "<test>", DRIVER, ApiFeatures.all())]
    assert [n for n, _ in got] == [n for n, _ in here] == fleet.node_names
    for (_, a), (_, b) in zip(got, here):
        assert isinstance(a, PreparedPool) and a.same_as(b) and a.parts == b.parts and not a.checked


def test_prepared_pools_are_validated_before_they_are_written() -> None:
    from kube.resourceslices import prepare_pool

    pools = fleet(2)
    pools["node-001"].slices.append({"devices": [{"name": "gpu-0-0"}]})   # a device name twice in the pool
    api = CountingApi(list(pools))
    prepared = [(n, prepare_pool(DRIVER, n, p)) for n, p in pools.items()]
    with pytest.raises(InvalidPoolError, match="node-001.*appears twice"):
        controller(api).run_once(timeout=30, pools=iter(prepared))
    with pytest.raises(ValueError, match="prepared for driver other.example.com"):
        controller(api).run_once(timeout=30, pools=iter([("node-000", prepare_pool("other.example.com", "node-000",
                                                                                   pools["node-000"]))]))
