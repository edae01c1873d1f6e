"""The ResourceSlice controller against servers that do not simply store what they are sent: one that drops a
field it does not support (the slice must not be rewritten forever, and the drop is logged once), and a
concurrent writer that makes an update conflict (409: the pool is re-read and synced again)."""
from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from bench.memapi import InMemorySliceApi
from kube.backoff import Backoff
from kube.client import SLICES
from kube.resourceslices import DesiredPool, Owner, ResourceSliceController, slice_name

DRIVER = "gpu.example.com"
NODE = "node-a"


def gpus(count: int, **extra: Any) -> DesiredPool:
    return DesiredPool(node_name=NODE, slices=[{"devices": [
        {"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}}, **extra} for i in range(count)]}])


def controller(api: InMemorySliceApi) -> ResourceSliceController:
    ctl = ResourceSliceController(object(), DRIVER, Owner.node(NODE), backoff=Backoff(initial=0.01, maximum=0.05))
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
    api = DropsTaints([NODE])
    ctl = controller(api)
    with caplog.at_level(logging.ERROR, logger="kube.resourceslices"):
        ctl.update({NODE: gpus(2, taints=[TAINT])})
        ctl.run_once(timeout=10)
        for _ in range(3):                        # later passes (resyncs) see the same difference
            ctl.run_once(timeout=10)
    assert dict(api.writes) == {"create": 1}
    assert all("taints" not in d for d in stored_devices(api))
    [line] = [r.getMessage() for r in caplog.records]
    name = slice_name(DRIVER, NODE, 0)
    assert line.startswith(f"driver {DRIVER} pool {NODE}: the API server did not store ResourceSlice {name} as sent (")
    assert "spec.devices[0].taints: dropped by the server" in line
    assert line.endswith("a feature it needs is probably disabled there. Not retrying this difference.")

    # A real change is still written; the same field dropped again is not reported again.
    changed = gpus(2, taints=[TAINT])
    for device in changed.slices[0]["devices"]:
        device["attributes"]["productName"] = {"string": "NVIDIA L4"}
    ctl.update({NODE: changed})
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
    api = ConcurrentWriter([NODE])
    ctl = controller(api)
    ctl.update({NODE: gpus(2)})
    ctl.run_once(timeout=10)
    api.armed = True
    ctl.update({NODE: gpus(3)})
    with caplog.at_level(logging.WARNING, logger="kube.resourceslices"):
        ctl.run_once(timeout=10)
    assert api.conflicts == 1
    assert [d["name"] for d in stored_devices(api)] == ["gpu-0", "gpu-1", "gpu-2"]   # theirs overwritten
    assert ctl.errors == {}
    # One failed attempt (the conflict), then the re-read and a successful update.
    assert ctl.writes_by_operation == {"create": 1, "update": 1}
    assert dict(api.writes) == {"create": 1, "update": 2}
    [warning] = [r.getMessage() for r in caplog.records]
    assert f"pool {NODE}: sync failed (attempt 1)" in warning
    assert "update conflicted with another change" in warning and "will re-read" in warning
