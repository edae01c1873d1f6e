"""The cluster as the scheduler replica reads it, kept up to date one object at a time.

``ClusterView`` holds DeviceClasses, ResourceSlices (folded, dra.scheduling.compact), ResourceClaims (folded),
DeviceTaintRules and the names of the Nodes, and derives what a verdict needs from them: the pools of each node
(built when first asked for after one of their slices changed), who holds which device, and what each pool's
counters have left. A change costs work for what it touches only: a slice rebuilds its pool, a claim updates
the holders of its devices. Every node has a stamp that changes whenever anything its verdict reads changes
(its pools, the holders of their devices, or what is cluster-wide: classes, taint rules, the Nodes), so a caller
can keep per-node results until the stamp moves.

One writer (a watch loop, or a reader of pages) and readers under the view's lock; no API access.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from fractions import Fraction
from typing import Any

from api.quantity import quantity_value
from dra.scheduling.compact import Interner, fold_claim, fold_slice
from dra.scheduling.occupancy import current_pools
from dra.scheduling.poolview import (
    DeviceKey,
    Holder,
    Pool,
    Usage,
    claim_id,
    pool_of,
)

PoolKey = tuple[str, str]              # (driver, pool name)


class ClusterView:
    def __init__(self, interner: Interner | None = None) -> None:
        self.lock = threading.RLock()
        self.interner = interner or Interner()
        self.classes: dict[str, dict[str, Any]] = {}
        self.taint_rules: list[dict[str, Any]] = []
        self.nodes: set[str] | None = None            # None: Node objects not known (every pool's node counts)
        self._slices: dict[str, dict[str, Any]] = {}  # by name
        self._pool_slices: dict[PoolKey, set[str]] = defaultdict(set)
        self._pools: dict[PoolKey, Pool] = {}         # built pools; a changed pool is dropped and rebuilt
        self._pool_node: dict[PoolKey, str] = {}      # node-local pools' nodes
        self._node_pools: dict[str, set[PoolKey]] = defaultdict(set)
        self._all_nodes: set[PoolKey] = set()         # pools for every node
        self._claims: dict[str, dict[str, Any]] = {}  # by namespace/name
        self.usage = Usage()
        self._claim_devices: dict[str, list[DeviceKey]] = {}
        self._pool_stamp: dict[PoolKey, int] = defaultdict(int)
        self._shared_stamp = 0                        # classes, taint rules, Nodes
        self._counter = 0
        self._taken: dict[PoolKey, dict[str, dict[str, Fraction]]] = {}
        self._holders: dict[PoolKey, dict[str, list[tuple[str, Holder]]]] = {}

    # ---- building -------------------------------------------------------------------------------------

    @classmethod
    def of(cls, classes: Iterable[dict[str, Any]], slices: Iterable[dict[str, Any]], claims: Iterable[dict[str, Any]],
           taint_rules: Iterable[dict[str, Any]] = (), nodes: Iterable[str] | None = None) -> "ClusterView":
        """A view of wire-format lists (slices and claims are folded as they are added)."""
        view = cls()
        view.set_classes(classes)
        view.set_taint_rules(taint_rules)
        if nodes is not None:
            view.set_nodes(nodes)
        for s in slices:
            view.put_slice(s)
        for c in claims:
            view.put_claim(c)
        return view

    def _tick(self) -> int:
        self._counter += 1
        return self._counter

    def set_classes(self, classes: Iterable[dict[str, Any]]) -> None:
        with self.lock:
            new = {c["metadata"]["name"]: c for c in classes}
            if new != self.classes:
                self.classes, self._shared_stamp = new, self._tick()

    def set_taint_rules(self, rules: Iterable[dict[str, Any]]) -> None:
        with self.lock:
            new = list(rules)
            if new != self.taint_rules:
                self.taint_rules, self._shared_stamp = new, self._tick()
                self._pools.clear()                   # rule taints are part of every device

    def set_nodes(self, names: Iterable[str] | None) -> None:
        with self.lock:
            new = None if names is None else set(names)
            if new != self.nodes:
                self.nodes, self._shared_stamp = new, self._tick()

    def add_node(self, name: str) -> None:
        with self.lock:
            if self.nodes is None:
                self.nodes = set()
            if name not in self.nodes:
                self.nodes.add(name)
                self._shared_stamp = self._tick()

    def remove_node(self, name: str) -> None:
        with self.lock:
            if self.nodes is not None and name in self.nodes:
                self.nodes.discard(name)
                self._shared_stamp = self._tick()

    def put_slice(self, obj: dict[str, Any], folded: bool = False) -> None:
        """Adds or replaces a slice (by name); ``folded``: it already is (dra.scheduling.compact)."""
        with self.lock:
            s = obj if folded else fold_slice(obj, self.interner)
            name = s["metadata"].get("name", "")
            self.remove_slice(name)
            self._slices[name] = s
            key = _pool_key(s)
            self._pool_slices[key].add(name)
            self._place(key)
            self._changed_pool(key)

    def remove_slice(self, name: str) -> None:
        with self.lock:
            old = self._slices.pop(name, None)
            if old is None:
                return
            key = _pool_key(old)
            names = self._pool_slices.get(key)
            if names is not None:
                names.discard(name)
                if not names:
                    del self._pool_slices[key]
            self._place(key)
            self._changed_pool(key)

    def _place(self, key: PoolKey) -> None:
        """Index the pool by its node (that of its slices), or as a pool for all nodes."""
        node = self._pool_node.pop(key, None)
        if node is not None:
            self._node_pools[node].discard(key)
            if not self._node_pools[node]:
                del self._node_pools[node]
        self._all_nodes.discard(key)
        specs = [self._slices[n]["spec"] for n in self._pool_slices.get(key, ())]
        node = next((str(sp["nodeName"]) for sp in specs if sp.get("nodeName")), None)
        if node:
            self._pool_node[key] = node
            self._node_pools[node].add(key)
        elif any(sp.get("allNodes") for sp in specs):
            self._all_nodes.add(key)

    def put_claim(self, obj: dict[str, Any], folded: bool = False) -> None:
        with self.lock:
            c = obj if folded else fold_claim(obj)
            cid = claim_id(c)
            self.remove_claim(cid)
            self._claims[cid] = c
            keys = []
            ns = c["metadata"].get("namespace", "")
            status = c.get("status") or {}
            pods = tuple(f"{ns}/{r.get('name')}" for r in status.get("reservedFor") or [] if r.get("resource") == "pods")
            for r in ((status.get("allocation") or {}).get("devices") or {}).get("results") or []:
                consumed = {n: quantity_value(str(v)) for n, v in (r.get("consumedCapacity") or {}).items()}
                key = (r["driver"], r["pool"], r["device"])
                self.usage.holders[key].append(Holder(cid, pods, bool(r.get("adminAccess")), consumed))
                keys.append(key)
            if keys:
                self._claim_devices[cid] = keys
                for pool in {(k[0], k[1]) for k in keys}:
                    self._changed_usage(pool)

    def remove_claim(self, cid: str) -> None:
        with self.lock:
            if self._claims.pop(cid, None) is None:
                return
            keys = self._claim_devices.pop(cid, [])
            for key in keys:
                left = [h for h in self.usage.holders.get(key, []) if h.claim != cid]
                if left:
                    self.usage.holders[key] = left
                else:
                    self.usage.holders.pop(key, None)
            for pool in {(k[0], k[1]) for k in keys}:
                self._changed_usage(pool)

    def _changed_pool(self, key: PoolKey) -> None:
        self._pools.pop(key, None)
        self._changed_usage(key)

    def _changed_usage(self, key: PoolKey) -> None:
        self._pool_stamp[key] = self._tick()
        self._taken.pop(key, None)
        self._holders.pop(key, None)

    # ---- reading --------------------------------------------------------------------------------------

    @contextmanager
    def reading(self) -> Iterator["ClusterView"]:
        """Holds the view still while a verdict reads it."""
        with self.lock:
            yield self

    @property
    def claims(self) -> list[dict[str, Any]]:
        return list(self._claims.values())

    def claim(self, cid: str) -> dict[str, Any] | None:
        return self._claims.get(cid)

    def slices(self) -> list[dict[str, Any]]:
        return list(self._slices.values())

    def pools(self) -> list[Pool]:
        """Every pool, by driver and name."""
        return [self.pool(k) for k in sorted(self._pool_slices)]

    def pool(self, key: PoolKey) -> Pool:
        built = self._pools.get(key)
        if built is None:
            items = [self._slices[n] for n in self._pool_slices.get(key, ())]
            current = current_pools(items, key[0]).get(key[1], [])
            built = self._pools[key] = pool_of(key[0], key[1], current, self.taint_rules)
        return built

    def pool_keys(self) -> list[PoolKey]:
        return sorted(self._pool_slices)

    def node_names(self) -> list[str]:
        """The nodes that have a node-local pool."""
        return sorted(self._node_pools)

    def pool_keys_of_node(self, node: str) -> list[PoolKey]:
        """The node's own pools (not those for all nodes)."""
        return sorted(self._node_pools.get(node, ()))

    def pools_of_node(self, node: str) -> list[Pool]:
        return [self.pool(k) for k in self.pool_keys_of_node(node)]

    def drop_pool(self, key: PoolKey) -> None:
        """Removes every slice of a pool (a reader that is done with it)."""
        with self.lock:
            for name in sorted(self._pool_slices.get(key, ())):
                self.remove_slice(name)

    def has_all_node_pools(self) -> bool:
        return bool(self._all_nodes)

    def _keys_for(self, node: str) -> list[PoolKey]:
        return sorted(self._node_pools.get(node, set()) | self._all_nodes)

    def pools_for(self, node: str) -> list[Pool]:
        """The complete pools a pod on ``node`` can be allocated from (its own and those for all nodes)."""
        return [p for p in (self.pool(k) for k in self._keys_for(node)) if not p.incomplete]

    def node_stamp(self, node: str) -> tuple[int, ...]:
        """Changes whenever anything the node's verdict reads changes."""
        return (self._shared_stamp, *(self._pool_stamp[k] for k in self._keys_for(node)))

    def counters_taken(self, pool: Pool) -> dict[str, dict[str, Fraction]]:
        """counter set -> counter -> what the exclusive allocations of the pool's devices take."""
        key = (pool.driver, pool.name)
        taken = self._taken.get(key)
        if taken is None:
            acc: dict[str, dict[str, Fraction]] = defaultdict(lambda: defaultdict(Fraction))
            for dev in pool.devices:
                if self.usage.exclusive(dev.key):
                    for cs, counters in dev.consumes().items():
                        for n, v in counters.items():
                            acc[cs][n] += v
            taken = self._taken[key] = {cs: dict(c) for cs, c in acc.items()}
        return taken

    def counter_holders(self, pool: Pool) -> dict[str, list[tuple[str, Holder]]]:
        """counter set -> (device name, holder) of every allocated device of the pool that consumes from it."""
        key = (pool.driver, pool.name)
        held = self._holders.get(key)
        if held is None:
            out: dict[str, list[tuple[str, Holder]]] = defaultdict(list)
            for dev in pool.devices:
                for h in self.usage.exclusive(dev.key):
                    for cs in dev.consumes():
                        out[cs].append((dev.name, h))
            held = self._holders[key] = dict(out)
        return held

    def capacity_taken(self, key: DeviceKey) -> dict[str, Fraction]:
        out: dict[str, Fraction] = defaultdict(Fraction)
        for h in self.usage.holders.get(key, ()):
            if not h.admin_access:
                for n, v in h.consumed.items():
                    out[n] += v
        return out


def _pool_key(s: Mapping[str, Any]) -> PoolKey:
    spec = s.get("spec") or {}
    return str(spec.get("driver", "")), str((spec.get("pool") or {}).get("name", ""))

