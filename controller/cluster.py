"""The cluster controller: keeps this driver's DeviceClasses in place and removes ResourceSlices whose
Node is gone (node-local pools of deleted nodes would otherwise linger when no owner reference was set,
or until the garbage collector gets to them).

The classes are fitted to the API server's version once (`api.deviceclasses.classes_for_server`): fields an
older server drops are not sent, so that the stored classes match and are not rewritten on every pass.

Each pass compares what is wanted with the controller's watch caches (controller.clusterstate), writes only
what differs, and is repeated every `interval` seconds (retried with exponential back-off while writes fail). A
slice counts as stale once its node has been missing from the Node cache at two passes in a row (a Node and its
first slice may arrive on different watches in either order), or at once after a synchronous load, which lists
slices before Nodes.
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from collections import Counter as _Tally
from typing import Any

from api.deviceclasses import classes_for_server
from controller.clusterstate import ClusterState
from controller.metrics import CLUSTER_RECONCILES, DEVICECLASS_WRITES, STALE_SLICE_DELETES
from controller.passloop import PassLoop
from kube.backoff import Backoff
from kube.client import DEVICE_CLASSES, SLICES, ApiError, ApiUnavailable, KubeApi
from kube.slicecompare import prune_empty

log = logging.getLogger(__name__)

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpu-dra-controller"
DRIVER_LABEL = "resource.dra-driver.io/driver"


class ClusterController:
    """One reconcile pass = DeviceClasses exactly as desired + no slices of the driver on vanished nodes."""

    def __init__(self, api_client: Any, driver_name: str, device_classes: list[dict[str, Any]],
                 interval: float = 30.0, backoff: Backoff | None = None, server_minor: int | None = None,
                 state: ClusterState | None = None) -> None:
        """`server_minor`: the API server's Kubernetes minor version if known; asked on the first pass if not.
        `state`: the caches to read (started by the caller); without one, each pass loads its own."""
        self.kube = KubeApi(api_client)
        self.state = state or ClusterState(self.kube, driver_name, [c["metadata"]["name"] for c in device_classes])
        self._missing: set[str] = set()     # slices whose node was missing at the last pass
        self.driver = driver_name
        self.interval = interval
        self._backoff = backoff or Backoff(initial=0.5, maximum=interval)
        self._classes = [self._labelled(c) for c in device_classes]
        self._server_minor = server_minor
        self._server_classes: list[dict[str, Any]] | None = None
        self._lock = threading.Lock()
        self._writes: _Tally[str] = _Tally()
        self.last_success: float | None = None
        self.last_error: str | None = None
        self.last_exception: ApiUnavailable | ApiError | None = None     # what the last failed pass raised
        self._runner = PassLoop(f"cluster-{driver_name}", self._pass, interval, self._backoff)

    # ---- public API -------------------------------------------------------------------------------

    @property
    def writes(self) -> int:
        with self._lock:
            return sum(self._writes.values())

    @property
    def writes_by_operation(self) -> dict[str, int]:
        with self._lock:
            return dict(self._writes)

    def healthy(self) -> tuple[bool, str]:
        """Healthy while the last successful pass is recent (three intervals)."""
        if self.last_success is None:
            return False, f"no successful pass yet ({self.last_error or 'starting'})"
        age = time.monotonic() - self.last_success
        if age > 3 * self.interval + 10:
            return False, f"last successful pass {age:.0f}s ago: {self.last_error}"
        return True, "ok"

    def reconcile_once(self) -> None:
        """One pass; raises ApiUnavailable/ApiError when the API server does not cooperate."""
        loaded = not self.state.running
        if loaded:
            self.state.load()
        elif not self.state.synced:
            raise ApiUnavailable(f"waiting for the first lists: {'; '.join(self.state.problems()) or 'in progress'}")
        self.ensure_device_classes()
        self.remove_stale_slices(at_once=loaded)

    def start(self) -> "ClusterController":
        self._runner.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._runner.stop(timeout)

    def __enter__(self) -> "ClusterController":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run_until_success(self, timeout: float) -> None:
        """Passes with back-off until one succeeds (for --once); raises the last error at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            if self._pass():
                return
            delay = self._backoff.failure("pass")
            if time.monotonic() + delay > deadline:
                raise RuntimeError(f"cluster controller pass did not succeed in {timeout:.0f}s: {self.last_error}")
            time.sleep(delay)

    # ---- passes -----------------------------------------------------------------------------------

    def _pass(self) -> bool:
        try:
            self.reconcile_once()
        except (ApiUnavailable, ApiError) as exc:
            self.last_error, self.last_exception = str(exc), exc
            CLUSTER_RECONCILES.labels(self.driver, "error").inc()
            log.warning("cluster controller pass failed: %s", exc)
            return False
        self.last_success, self.last_error = time.monotonic(), None
        CLUSTER_RECONCILES.labels(self.driver, "ok").inc()
        return True

    def _labelled(self, device_class: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(device_class)
        labels = obj.setdefault("metadata", {}).setdefault("labels", {})
        labels[MANAGED_BY_LABEL] = MANAGED_BY
        labels[DRIVER_LABEL] = self.driver
        return obj

    def _classes_for_server(self) -> list[dict[str, Any]]:
        if self._server_classes is None:
            if self._server_minor is None:
                major, minor = self.kube.server_version()
                if major != 1:
                    raise ApiError("GET", "/version", 200, f'{{"message": "unexpected major version {major}"}}')
                self._server_minor = minor
            classes, notes = classes_for_server(self._classes, self._server_minor)
            for note in notes:
                log.warning("API server is Kubernetes 1.%d: %s", self._server_minor, note)
            self._server_classes = classes
        return self._server_classes

    def ensure_device_classes(self) -> None:
        """Creates missing classes, rewrites changed ones, deletes ones we made that are no longer wanted. A
        write against a cache that is behind is refused (409) and done again at the next pass."""
        wanted = {c["metadata"]["name"]: c for c in self._classes_for_server()}
        stored = {c["metadata"]["name"]: c for c in self.state.classes.items()}
        for name, desired in wanted.items():
            existing = stored.get(name)
            if existing is None:
                try:
                    self._count_class("create", self.kube.create(DEVICE_CLASSES, desired))
                except ApiError as exc:
                    if not exc.conflict:
                        raise
                    continue                # made meanwhile: the cache hears of it
                log.info("created DeviceClass %s", name)
                continue
            labels = existing.get("metadata", {}).get("labels") or {}
            want_labels = dict(desired["metadata"].get("labels") or {})
            if labels.get(MANAGED_BY_LABEL) not in (None, MANAGED_BY):
                # Installed by another manager (Helm, from the chart): its label stays. Taking it over made every
                # `helm upgrade` fail with a server-side apply conflict; such classes are never ours to delete.
                del want_labels[MANAGED_BY_LABEL]
            if (prune_empty(existing.get("spec", {})) == prune_empty(desired.get("spec", {}))
                    and all(labels.get(k) == v for k, v in want_labels.items())):
                continue
            meta = {k: v for k, v in existing["metadata"].items() if k != "managedFields"}
            meta["labels"] = {**labels, **want_labels}
            try:
                self._count_class("update", self.kube.replace(DEVICE_CLASSES, {**desired, "metadata": meta}))
            except ApiError as exc:
                if not (exc.conflict or exc.not_found):
                    raise
                continue
            log.info("updated DeviceClass %s to the desired spec", name)
        for obj in stored.values():
            meta = obj["metadata"]
            labels = meta.get("labels") or {}
            if (meta["name"] in wanted or labels.get(MANAGED_BY_LABEL) != MANAGED_BY
                    or labels.get(DRIVER_LABEL) != self.driver):
                continue
            try:
                self.kube.delete(DEVICE_CLASSES, meta["name"], uid=meta.get("uid"), resource_version=meta.get("resourceVersion"))
            except ApiError as exc:
                if not (exc.not_found or exc.conflict):
                    raise
                continue
            self._count_class("delete", obj)
            log.info("deleted DeviceClass %s (no longer part of this driver's classes)", meta["name"])

    def _count_class(self, operation: str, _obj: dict[str, Any]) -> None:
        with self._lock:
            self._writes[f"deviceclass-{operation}"] += 1
        DEVICECLASS_WRITES.labels(self.driver, operation).inc()

    def remove_stale_slices(self, at_once: bool = False) -> list[str]:
        """Deletes this driver's slices whose spec.nodeName is not a Node (at two passes in a row, or at once
        after a synchronous load); returns their names."""
        if self.state.nodes.last_error:
            return []                       # the Node cache may be behind: no verdict on missing nodes now
        nodes = set(self.state.nodes.items())
        missing = {s["metadata"]["name"]: s for s in self.state.slices.items()
                   if s.get("spec", {}).get("nodeName") and s["spec"]["nodeName"] not in nodes}
        stale = [s for name, s in missing.items() if at_once or name in self._missing]
        self._missing = set(missing)
        deleted = []
        for obj in stale:
            meta, node = obj["metadata"], obj["spec"]["nodeName"]
            try:
                self.kube.delete(SLICES, meta["name"], uid=meta.get("uid"), resource_version=meta.get("resourceVersion"))
            except ApiError as exc:
                if exc.not_found or exc.conflict:
                    continue   # gone already, or changed: the next pass looks again
                raise
            deleted.append(meta["name"])
            self._missing.discard(meta["name"])
            with self._lock:
                self._writes["slice-delete"] += 1
            STALE_SLICE_DELETES.labels(self.driver).inc()
            log.info("deleted ResourceSlice %s: its node %s no longer exists", meta["name"], node)
        return deleted
