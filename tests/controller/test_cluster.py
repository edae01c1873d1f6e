"""The cluster controller while the API server does not answer: passes are retried with a growing back-off
(0.5 s doubling up to the pass interval), a success resets it, and /healthz answers 503 until a pass succeeds
and again once the last success is older than three intervals plus 10 s."""
from __future__ import annotations

import time
import types
import urllib.error
import urllib.request
from typing import Any

from api.deviceclasses import device_classes
from controller.cluster import ClusterController
from controller.clusterstate import ClusterState
from kube.client import DEVICE_CLASSES, ApiError, ApiUnavailable
from kube.httpserver import serve_health_and_metrics

DRIVER = "gpu.example.com"


class ScriptedApi:
    """The verbs of KubeApi a pass uses, over a cluster that already holds the wanted DeviceClasses and no
    slices. Pass n (1-based) finds the API server unreachable when n is in ``down``."""

    def __init__(self, down: set[int]) -> None:
        self.classes: dict[str, dict[str, Any]] = {}
        self.down = down
        self.passes = 1

    def begin_pass(self) -> None:
        self.passes += 1

    def _check(self, path: str) -> None:
        if self.passes in self.down:
            raise ApiUnavailable(f"GET https://10.0.0.1:6443{path}: ConnectionRefusedError: [Errno 111] refused")

    def get(self, path: str, **query: Any) -> dict[str, Any]:
        self._check(path)
        name = path.rsplit("/", 1)[-1]
        if path.startswith(DEVICE_CLASSES) and name in self.classes:
            return self.classes[name]
        raise ApiError("GET", path, 404, '{"reason": "NotFound", "message": "not found"}')

    def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        """The LISTs the controller's caches load at each pass (controller.clusterstate)."""
        self._check(path)
        items = list(self.classes.values()) if path == DEVICE_CLASSES else []
        return {"items": items, "metadata": {"resourceVersion": "1"}}

    def create(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError(f"unexpected create in {collection}")

    replace = delete = create


class CountedStop:
    """Stands in for the loop's stop event: records each wait instead of sleeping, and ends the loop after
    ``passes`` passes. Each wait ends one pass, so the API's pass counter moves on there."""

    def __init__(self, api: ScriptedApi, passes: int) -> None:
        self.api = api
        self.left = passes
        self.delays: list[float] = []

    def is_set(self) -> bool:
        return self.left <= 0

    def wait(self, delay: float) -> bool:
        self.delays.append(delay)
        self.left -= 1
        self.api.begin_pass()
        return self.is_set()

    def set(self) -> None:
        self.left = 0

    def clear(self) -> None:
        pass


def controller(api: ScriptedApi, interval: float) -> ClusterController:
    ctl = ClusterController(object(), DRIVER, device_classes(DRIVER), interval=interval, server_minor=37)
    api.classes = {c["metadata"]["name"]: c for c in ctl._classes_for_server()}   # the cluster is in line
    ctl.kube = api  # type: ignore[assignment]
    ctl.state = ClusterState(api, DRIVER, [c["metadata"]["name"] for c in device_classes(DRIVER)])  # type: ignore[arg-type]
    return ctl


def test_passes_back_off_while_the_api_server_is_unreachable_and_a_success_resets_it():
    api = ScriptedApi(down={1, 2, 3, 4, 5, 7, 8})
    ctl = controller(api, interval=4.0)
    stop = CountedStop(api, passes=8)
    ctl._runner._stop = stop  # type: ignore[assignment]
    ctl._runner._loop()
    #                      failures 1..5, capped at the interval | success | failures again, from the start
    assert stop.delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 0.5, 1.0]
    assert ctl.last_error is not None and "ConnectionRefusedError" in ctl.last_error
    assert ctl.writes == 0


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_healthz_is_503_until_a_pass_succeeds_and_again_when_passes_keep_failing(monkeypatch):
    api = ScriptedApi(down={1, 2, 4})
    ctl = controller(api, interval=30.0)
    server = serve_health_and_metrics(0, ctl.healthy, "127.0.0.1")
    url = f"http://127.0.0.1:{server.server_address[1]}/healthz"
    try:
        for _ in range(2):
            assert not ctl._pass()
            api.begin_pass()
        status, body = get(url)
        assert status == 503
        assert body.startswith("no successful pass yet (GET https://10.0.0.1:6443") and "refused" in body

        assert ctl._pass()                                        # the API server is back
        api.begin_pass()
        assert get(url) == (200, "ok\n")

        # The API server goes away again: healthy while the last success is recent, 503 after 3 x 30 s + 10 s.
        assert not ctl._pass()
        assert get(url) == (200, "ok\n")
        real = time.monotonic
        monkeypatch.setattr("controller.cluster.time", types.SimpleNamespace(monotonic=lambda: real() + 101.0,
                                                                             sleep=time.sleep))
        status, body = get(url)
        assert status == 503
        assert body.startswith("last successful pass 101s ago: GET https://10.0.0.1:6443")
        monkeypatch.setattr("controller.cluster.time", types.SimpleNamespace(monotonic=lambda: real() + 95.0,
                                                                             sleep=time.sleep))
        assert get(url) == (200, "ok\n")                          # 95 s is still within 3 x 30 s + 10 s
    finally:
        server.shutdown()
