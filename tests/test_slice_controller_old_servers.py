"""The ResourceSlice controller on an API server without the `spec.pool.name` field selector (Kubernetes 1.34):
each pool's slices are picked out of the driver's slices, so no pool mistakes another's slices for its own."""
from __future__ import annotations

import logging
from typing import Any

import pytest

from bench.memapi import InMemorySliceApi, _status
from kube.client import SLICES
from kube.resourceslices import DesiredPool, Owner, PoolSyncError, ResourceSliceController

DRIVER = "gpu.example.com"
NODES = ("node-a", "node-b")


class OldSliceApi(InMemorySliceApi):
    """Answers a spec.pool.name selector as 1.34 does: 400 BadRequest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rejected = 0

    def list(self, collection: str, field_selector: str | None = None,
             label_selector: str | None = None) -> dict[str, Any]:
        if "spec.pool.name" in (field_selector or ""):
            self.rejected += 1
            raise _status("GET", collection, 400, "BadRequest",
                          "field label not supported for resource.k8s.io/v1, Kind=ResourceSlice: spec.pool.name")
        return super().list(collection, field_selector, label_selector)


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
