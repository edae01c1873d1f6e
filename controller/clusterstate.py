"""What the controller knows of the cluster, kept by list+watch caches (kube.watchcache) and read by both of its
loops (controller.cluster, controller.pendingclaims) without a request of their own.

- ResourceSlices of this driver (``spec.driver`` field selector), folded as they arrive (dra.scheduling.compact);
- ResourceClaims that ask for one of this driver's classes or hold one of its devices, folded; the others are
  dropped as they arrive;
- DeviceClasses (whole: the cluster controller rewrites its own), DeviceTaintRules (where served) and the names
  of the Nodes (metadata only).

Every change goes straight into a ``ClusterView`` (dra.scheduling.clusterview), which the verdicts read.
RBAC: ``list`` and ``watch`` on each of these (claims and DeviceTaintRules only with the pending-claims pass).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from controller.metrics import WATCH_LISTS
from dra.scheduling.claimrequests import ClaimSpecError, read_claim_spec
from dra.scheduling.clusterview import ClusterView
from dra.scheduling.compact import fold_claim, fold_slice
from kube.client import DEVICE_CLASSES, NODES, RESOURCE_V1, SLICES, KubeApi
from kube.watchcache import WatchCache

log = logging.getLogger(__name__)

CLAIMS = f"{RESOURCE_V1}/resourceclaims"
TAINT_RULES = f"{RESOURCE_V1}/devicetaintrules"
_CLASS_METADATA = ("name", "uid", "resourceVersion", "labels", "annotations", "creationTimestamp")


def asks_for(claim: dict[str, Any], class_names: Iterable[str]) -> bool:
    """Whether a request (or subrequest) of the claim names one of the classes."""
    try:
        spec = read_claim_spec(claim.get("spec") or {})
    except ClaimSpecError:
        return False           # the API server validated it; nothing the scheduler could allocate either
    wanted = set(class_names)
    return any(alt.device_class in wanted for req in spec.requests for alt in req.alternatives)


def holds_devices_of(claim: dict[str, Any], driver: str) -> bool:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return any(r.get("driver") == driver for r in results)


class ClusterState:
    def __init__(self, kube: KubeApi, driver: str, class_names: Iterable[str], claims: bool = True) -> None:
        """`claims`: also keep the ResourceClaims and DeviceTaintRules, which only the pending-claims pass reads
        (without them the controller needs no right on either)."""
        self.kube, self.driver = kube, driver
        self.class_names = frozenset(class_names)
        self.view = ClusterView()
        self.slices: WatchCache[dict[str, Any]] = WatchCache(
            kube, SLICES, lambda o: fold_slice(o, self.view.interner), name="resourceslices",
            field_selector=f"spec.driver={driver}", on_change=self._slice)
        self.claims: WatchCache[dict[str, Any]] = WatchCache(
            kube, CLAIMS, self._fold_claim, name="resourceclaims", on_change=self._claim)
        self.classes: WatchCache[dict[str, Any]] = WatchCache(
            kube, DEVICE_CLASSES, _fold_class, name="deviceclasses",
            on_change=lambda *_: self.view.set_classes(self.classes.items()))
        self.taint_rules: WatchCache[dict[str, Any]] = WatchCache(
            kube, TAINT_RULES, _fold_rule, name="devicetaintrules", optional=True,
            on_change=lambda *_: self.view.set_taint_rules(self.taint_rules.items()))
        self.nodes: WatchCache[str] = WatchCache(
            kube, NODES, lambda o: str((o.get("metadata") or {}).get("name", "")), name="nodes",
            metadata_only=True, on_change=self._node)
        self.view.set_nodes(())
        self.running = False
        self._caches: tuple[WatchCache[Any], ...] = (self.classes, self.taint_rules, self.nodes, self.slices,
                                                      self.claims) if claims else (self.classes, self.nodes, self.slices)

    def start(self) -> "ClusterState":
        for cache in self._caches:
            cache.on_list = lambda c: WATCH_LISTS.labels(c.name).inc()
            cache.start()
        self.running = True
        return self

    def stop(self) -> None:
        for cache in self._caches:
            cache.stop()
        self.running = False

    def load(self) -> None:
        """One LIST of each resource, in this order (slices before Nodes: a Node created in between is seen), for
        a caller that makes one pass (``--once``) instead of watching."""
        for cache in (self.classes, self.taint_rules, self.slices, self.nodes, self.claims):
            if cache in self._caches:
                cache.relist()

    def wait_synced(self, timeout: float | None = None) -> bool:
        return all(cache.wait_synced(timeout) for cache in self._caches)

    @property
    def synced(self) -> bool:
        return all(cache.synced.is_set() for cache in self._caches)

    def problems(self) -> list[str]:
        """Caches whose last LIST or WATCH failed (they retry with back-off)."""
        return [f"{c.name}: {c.last_error}" for c in self._caches if c.last_error]

    @property
    def lists(self) -> int:
        return sum(c.lists for c in self._caches)

    # ---- folding and applying -----------------------------------------------------------------------

    def _fold_claim(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        if holds_devices_of(obj, self.driver) or asks_for(obj, self.class_names):
            return fold_claim(obj)
        return None

    def _slice(self, key: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if new is None:
            self.view.remove_slice(key)
        else:
            self.view.put_slice(new, folded=True)

    def _claim(self, key: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if new is None:
            self.view.remove_claim(key)
        else:
            self.view.put_claim(new, folded=True)

    def _node(self, key: str, old: str | None, new: str | None) -> None:
        if new is None:
            self.view.remove_node(key)
        elif old is None:
            self.view.add_node(new)


def _fold_class(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
            "metadata": {k: meta[k] for k in _CLASS_METADATA if k in meta}, "spec": obj.get("spec") or {}}


def _fold_rule(obj: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": (obj.get("metadata") or {}).get("name", "")}, "spec": obj.get("spec") or {}}
