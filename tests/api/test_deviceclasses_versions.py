"""DeviceClasses fitted to the API server's version: what 1.34/1.35 would drop is not sent, so the cluster
controller writes each class once instead of on every pass."""
from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from api.deviceclasses import EXTENDED_RESOURCE_MIN_MINOR, classes_for_server, device_classes
from api.names import NVIDIA_DRIVER_NAME
from controller.cluster import ClusterController
from controller.clusterstate import ClusterState
from kube.client import DEVICE_CLASSES, NODES, SLICES, ApiError


def _extended(classes: list[dict[str, Any]]) -> dict[str, str]:
    return {c["metadata"]["name"]: c["spec"]["extendedResourceName"]
            for c in classes if "extendedResourceName" in c["spec"]}


@pytest.mark.parametrize("minor", [34, 35])
def test_old_servers_get_no_extended_resource_name(minor: int) -> None:
    classes = device_classes(compat_nvidia=True)
    before = copy.deepcopy(classes)
    fitted, notes = classes_for_server(classes, minor)
    assert classes == before                      # the inputs are left alone
    assert _extended(classes) == {"gpu.nvidia.com": "nvidia.com/gpu"} and _extended(fitted) == {}
    assert len(notes) == 1 and "gpu.nvidia.com" in notes[0] and "nvidia.com/gpu" in notes[0]
    # Everything else is as it was.
    stripped = [{**c, "spec": {k: v for k, v in c["spec"].items() if k != "extendedResourceName"}} for c in classes]
    assert fitted == stripped


@pytest.mark.parametrize("minor", [EXTENDED_RESOURCE_MIN_MINOR, 37, 38])
def test_current_servers_get_the_classes_unchanged(minor: int) -> None:
    classes = device_classes(compat_nvidia=True)
    assert classes_for_server(classes, minor) == (classes, [])


def test_classes_without_the_field_are_unchanged_on_old_servers() -> None:
    classes = device_classes("gpus.example.com")
    assert classes_for_server(classes, 34) == (classes, [])


class FakeServer:
    """The few KubeApi calls of the cluster controller, storing DeviceClasses the way an API server of
    Kubernetes 1.<minor> does: before 1.36 extendedResourceName is dropped on every write."""

    def __init__(self, minor: int) -> None:
        self.minor = minor
        self.classes: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, str]] = []
        self.version_calls = 0

    def server_version(self) -> tuple[int, int]:
        self.version_calls += 1
        return 1, self.minor

    def _store(self, obj: dict[str, Any]) -> dict[str, Any]:
        stored = copy.deepcopy(obj)
        if self.minor < 36:
            stored["spec"].pop("extendedResourceName", None)
        self.classes[stored["metadata"]["name"]] = stored
        return copy.deepcopy(stored)

    def get(self, path: str) -> dict[str, Any]:
        name = path.rsplit("/", 1)[1]
        if name not in self.classes:
            raise ApiError("GET", path, 404, '{"reason": "NotFound", "message": "not found"}')
        return copy.deepcopy(self.classes[name])

    def create(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        assert collection == DEVICE_CLASSES
        self.writes.append(("create", obj["metadata"]["name"]))
        return self._store(obj)

    def replace(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        assert collection == DEVICE_CLASSES
        self.writes.append(("update", obj["metadata"]["name"]))
        return self._store(obj)

    def list(self, collection: str, field_selector: str | None = None,
             label_selector: str | None = None) -> dict[str, Any]:
        if collection in (SLICES, NODES):
            return {"items": []}
        wanted = dict(term.split("=", 1) for term in (label_selector or "").split(",") if term)
        items = [c for c in self.classes.values()
                 if all(c["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())]
        return {"items": copy.deepcopy(items)}

    def delete(self, collection: str, name: str, uid: str | None = None,
               resource_version: str | None = None) -> dict[str, Any]:
        self.writes.append(("delete", name))
        return self.classes.pop(name)

    def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        """The LISTs the controller's caches load at each pass (controller.clusterstate)."""
        items = list(self.classes.values()) if path == DEVICE_CLASSES else []
        return {"items": copy.deepcopy(items), "metadata": {"resourceVersion": "1"}}


def _controller(server: FakeServer, server_minor: int | None = None) -> ClusterController:
    ctl = ClusterController(object(), NVIDIA_DRIVER_NAME, device_classes(compat_nvidia=True),
                            server_minor=server_minor)
    ctl.kube = server  # type: ignore[assignment]
    ctl.state = ClusterState(server, NVIDIA_DRIVER_NAME, [])  # type: ignore[arg-type]
    return ctl


def test_on_a_1_34_server_each_class_is_written_once_and_the_omission_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    server = FakeServer(34)
    ctl = _controller(server)
    with caplog.at_level(logging.WARNING, logger="controller.cluster"):
        for _ in range(3):
            ctl.reconcile_once()
    count = len(device_classes(compat_nvidia=True))
    assert server.writes == [("create", c["metadata"]["name"]) for c in device_classes(compat_nvidia=True)]
    assert ctl.writes_by_operation == {"deviceclass-create": count}
    assert server.version_calls == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "Kubernetes 1.34" in lines[0] and "extendedResourceName nvidia.com/gpu" in lines[0]


def test_without_fitting_a_1_34_server_would_see_a_change_on_every_pass() -> None:
    # The controller told the wrong version sends the field; the server drops it; every pass rewrites.
    server = FakeServer(34)
    ctl = _controller(server, server_minor=37)
    for _ in range(3):
        ctl.reconcile_once()
    assert server.writes.count(("update", "gpu.nvidia.com")) == 2
    assert server.version_calls == 0


def test_on_a_1_37_server_the_extended_resource_name_is_kept() -> None:
    server = FakeServer(37)
    ctl = _controller(server)
    ctl.reconcile_once()
    ctl.reconcile_once()
    assert server.classes["gpu.nvidia.com"]["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert ctl.writes == len(device_classes(compat_nvidia=True))


def test_an_unexpected_major_version_fails_the_pass() -> None:
    server = FakeServer(34)
    server.server_version = lambda: (2, 0)  # type: ignore[method-assign]
    with pytest.raises(ApiError, match="unexpected major version 2"):
        _controller(server).reconcile_once()
    assert server.writes == []
