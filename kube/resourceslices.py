"""The ResourceSlice controller: keeps the API server's ResourceSlices of one driver exactly in line with
the desired pools, writing only what changed.

It follows the algorithm of the upstream Go helper (k8s.io/dynamic-resource-allocation/resourceslice):

* desired state: pools by name, each an ordered list of slice specs (`devices` or `sharedCounters`);
* a work queue keyed by pool name: `update()` queues the pools at once, watch events queue the pool after
  `sync_delay` (coalescing bursts; this is how externally deleted slices come back), failures are retried
  with exponential back-off, and every `resync_period` all pools are checked again;
* one sync of a pool: the highest `spec.pool.generation` is current, lower ones are obsolete; slices are
  matched to desired positions by name; if the driver forces a higher generation, slices are added or
  removed, or more than one slice changes, the generation goes up by one and every slice is rewritten
  with it, otherwise at most one slice is updated in place; obsolete slices are deleted first (with uid
  and resourceVersion preconditions), then updates, then creates;
* nothing is written when the server already holds the desired state, so a restart with unchanged
  hardware writes nothing.

Differences from upstream, for simplicity: slice names are deterministic (`<pool>-<driver>-<index>`, the index
zero-padded so that name order, which kube-scheduler follows, is pool order) rather than generated, and each
pool sync reads the pool's slices with a fresh LIST (field selectors on driver and pool) instead of an
informer cache, which makes a mutation cache unnecessary. API servers that cannot select by `spec.pool.name`
(Kubernetes 1.34) answer 400; from then on the pool's slices are picked out of the driver's (and node's)
slices here. Slices under names this publisher no longer gives (e.g. the unpadded `-2` of older releases) are
obsolete: they are deleted and the pool is written anew under the current names with the next generation.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import re
import threading
import time
from collections import Counter as _Tally
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from api.k8snames import is_dns_subdomain
from dra.model.slices import validate_pool
from kube.backoff import Backoff
from kube.client import NODES, SLICES, ApiError, ApiUnavailable, KubeApi, iter_json_lines
from kube.metrics import SLICE_POOLS, SLICE_SYNCS, SLICE_WRITES
from kube.slicecompare import normalize_spec, spec_differences

log = logging.getLogger(__name__)

DEFAULT_SYNC_DELAY = 30.0      # upstream DefaultSyncDelay
DEFAULT_RESYNC_PERIOD = 600.0
_POOL_FIELDS = ("driver", "pool", "nodeName", "nodeSelector", "allNodes")


class InvalidPoolError(ValueError):
    """A desired pool that the API server would reject or that would mislead the scheduler."""


class PoolSyncError(RuntimeError):
    """A pool could not be brought in line this time (retried with back-off)."""


@dataclass(frozen=True)
class Owner:
    """Who publishes: one node's plugin (only slices with spec.nodeName == node) or a cluster-wide
    publisher (every slice of the driver; pools it does not desire are deleted)."""

    node_name: str | None = None

    @classmethod
    def node(cls, name: str) -> "Owner":
        return cls(name)

    @classmethod
    def cluster(cls) -> "Owner":
        return cls(None)


@dataclass
class DesiredPool:
    """One pool as the driver wants it published.

    slices: ordered spec parts, each a wire-format dict with `devices` or `sharedCounters` (or neither,
    for an empty slice that says "this node has nothing"). Node selection comes from exactly one of
    node_name (node-local; the Node becomes the slices' owner), node_selector or all_nodes, unless every
    part sets `perDeviceNodeSelection`. generation: 0 lets the controller count; a higher value forces it.
    """

    slices: list[dict[str, Any]]
    node_name: str | None = None
    node_selector: dict[str, Any] | None = None
    all_nodes: bool = False
    generation: int = 0

    @classmethod
    def from_slice_specs(cls, specs: list[dict[str, Any]], node_name: str | None = None) -> "DesiredPool":
        """A node-local pool from full ResourceSlice specs as `dra.model.slices.desired_pool_slices` returns them:
        driver, pool and nodeName are dropped from each spec (the controller sets them); every spec must
        name the same node. No specs at all becomes one empty slice ("this node has no devices")."""
        parts: list[dict[str, Any]] = []
        nodes = {node_name} if node_name else set()
        for i, spec in enumerate(specs):
            if not isinstance(spec, dict):
                raise InvalidPoolError(f"slice spec {i}: must be a dict, got {type(spec).__name__}")
            if spec.get("nodeName"):
                nodes.add(spec["nodeName"])
            if spec.get("nodeSelector") is not None or spec.get("allNodes"):
                raise InvalidPoolError(f"slice spec {i}: only node-local specs (nodeName) can be converted")
            parts.append({k: v for k, v in spec.items() if k not in _POOL_FIELDS})  # update() copies
        if len(nodes) != 1:
            raise InvalidPoolError(f"slice specs must name exactly one node, found {sorted(nodes) or 'none'}")
        return cls(slices=parts or [{"devices": []}], node_name=nodes.pop())


# Slice names end in the index zero-padded to this many digits: kube-scheduler visits a pool's slices in name
# order, so names must sort like the indexes (unpadded, `-10` sorts before `-2`) for the device order to hold.
SLICE_INDEX_DIGITS = 4
MAX_POOL_SLICES = 10 ** SLICE_INDEX_DIGITS


def slice_name(driver: str, pool: str, index: int) -> str:
    """Stable ResourceSlice name `<pool>-<driver>-<index>` with the index zero-padded to SLICE_INDEX_DIGITS
    digits (so name order is pool order), made a valid DNS subdomain.

    When the pool name had to be changed (upper case, '/', too long) a short hash of the original is
    added so that two pools never share names."""
    if not 0 <= index < MAX_POOL_SLICES:
        raise ValueError(f"slice index {index} out of range: a pool has at most {MAX_POOL_SLICES} slices")
    base = f"{pool}-{driver}".lower()
    clean = re.sub(r"[^a-z0-9.-]+", "-", base)
    clean = re.sub(r"-*\.-*", ".", clean)          # no '-' next to '.'
    clean = re.sub(r"\.{2,}", ".", clean).strip(".-") or "pool"
    suffix = f"-{index:0{SLICE_INDEX_DIGITS}d}"
    if clean != base or len(clean) + len(suffix) > 253:
        digest = hashlib.sha256(pool.encode()).hexdigest()[:8]
        clean = clean[: 253 - len(suffix) - 9].rstrip(".-") + "-" + digest
    return clean + suffix


def check_desired_pool(driver: str, pool_name: str, pool: DesiredPool, owner: Owner) -> None:
    """What only the publisher can check (pool name, node selection, owner, generation), then every
    ResourceSlice limit and pool-wide rule of ``dra.model.slices.validate_pool`` on the slices as they will be
    written. Raises InvalidPoolError naming the pool and every problem."""
    where = f"pool {pool_name!r}"
    if not pool_name or len(pool_name) > 253 or not all(is_dns_subdomain(p) for p in pool_name.split("/")):
        raise InvalidPoolError(f"{where}: name must be DNS subdomains joined by '/', at most 253 characters")
    if not isinstance(pool.slices, list) or not pool.slices:
        raise InvalidPoolError(f"{where}: needs at least one slice (an empty one says the pool has no devices)")
    if len(pool.slices) > MAX_POOL_SLICES:
        raise InvalidPoolError(f"{where}: {len(pool.slices)} slices, at most {MAX_POOL_SLICES} (slice names carry "
                               f"a {SLICE_INDEX_DIGITS}-digit index)")
    for i, part in enumerate(pool.slices):
        if not isinstance(part, dict):
            raise InvalidPoolError(f"{where} slice {i}: must be a dict with 'devices' or 'sharedCounters', "
                                   f"got {type(part).__name__}")
        bad = [k for k in _POOL_FIELDS if k in part]
        if bad:
            raise InvalidPoolError(f"{where} slice {i}: {', '.join(bad)} belong to the pool, not to a slice part "
                                   "(DesiredPool.from_slice_specs converts full specs)")
    per_device = [bool(p.get("perDeviceNodeSelection")) for p in pool.slices]
    selections = [s for s, on in (("node_name", bool(pool.node_name)), ("node_selector", pool.node_selector is not None),
                                  ("all_nodes", pool.all_nodes), ("perDeviceNodeSelection", all(per_device)))
                  if on]
    if len(selections) != 1:
        raise InvalidPoolError(f"{where}: exactly one of node_name, node_selector, all_nodes or perDeviceNodeSelection "
                               f"in every slice must be set, got {selections or 'none'}")
    if owner.node_name is not None and pool.node_name != owner.node_name:
        raise InvalidPoolError(f"{where}: this controller publishes for node {owner.node_name!r} only, "
                               f"but the pool has node_name={pool.node_name!r}")
    if pool.generation < 0:
        raise InvalidPoolError(f"{where}: generation must not be negative")
    problems = validate_pool(_full_specs(driver, pool_name, pool))
    if problems:
        raise InvalidPoolError(f"{where}: " + "; ".join(problems))


def _full_specs(driver: str, pool_name: str, pool: DesiredPool) -> list[dict[str, Any]]:
    """The specs as they will be written (generation aside), for validation."""
    selection: dict[str, Any] = {}
    if pool.node_name:
        selection["nodeName"] = pool.node_name
    elif pool.node_selector is not None:
        selection["nodeSelector"] = pool.node_selector
    elif pool.all_nodes:
        selection["allNodes"] = True
    head = {"driver": driver, "pool": {"name": pool_name, "generation": 0, "resourceSliceCount": len(pool.slices)}}
    return [{**head, **selection, **part} for part in pool.slices]


def _generation(obj: dict[str, Any]) -> int:
    return int(obj.get("spec", {}).get("pool", {}).get("generation", 0))


class ResourceSliceController:
    """Publishes the desired pools of one driver and keeps them exact. Thread-safe.

    Use as a context manager (threads: a watch and a worker), or call `run_once()` for a single
    synchronous reconciliation without threads."""

    def __init__(self, api_client: Any, driver_name: str, owner: Owner = Owner.cluster(), *,
                 sync_delay: float = DEFAULT_SYNC_DELAY, resync_period: float = DEFAULT_RESYNC_PERIOD,
                 backoff: Backoff | None = None, watch_timeout: int = 300) -> None:
        if not is_dns_subdomain(driver_name, 63):
            raise ValueError(f"driver name {driver_name!r} must be a lower-case DNS subdomain of at most 63 characters")
        self.kube = KubeApi(api_client)
        self.driver = driver_name
        self.owner = owner
        self.sync_delay = sync_delay
        self.resync_period = resync_period
        self.watch_timeout = watch_timeout
        self._backoff = backoff or Backoff()
        self._cond = threading.Condition()
        self._desired: dict[str, DesiredPool] | None = None
        self._queue: dict[str, tuple[float, bool]] = {}    # pool -> (due, urgent)
        self._busy: set[str] = set()
        self._errors: dict[str, str] = {}
        self._failing_since: dict[str, float] = {}          # pool -> monotonic time of its first failure in a row
        self._writes: _Tally[str] = _Tally()
        self._own_writes: dict[str, str] = {}               # slice name -> resourceVersion we wrote
        self._own_deletes: set[str] = set()                 # uids we deleted
        self._accepted: dict[tuple[str, int], tuple[dict[str, Any], dict[str, Any]]] = {}
        self._reported_drops: set[tuple[str, ...]] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch_resp: Any = None
        self._watch_synced = threading.Event()
        self._pool_field_selector = True     # until the server says it has no spec.pool.name selector

    # ---- public API -------------------------------------------------------------------------------

    @property
    def writes(self) -> int:
        """API writes (create + update + delete) this instance has made."""
        with self._cond:
            return sum(self._writes.values())

    @property
    def writes_by_operation(self) -> dict[str, int]:
        with self._cond:
            return dict(self._writes)

    @property
    def errors(self) -> dict[str, str]:
        """Last error per pool that is currently failing."""
        with self._cond:
            return dict(self._errors)

    def failing(self) -> dict[str, tuple[float, str]]:
        """Pools whose syncs have failed without a success since: seconds since the first failure of that
        streak, and the last error (for health checks: a pool failing for minutes is not a blip)."""
        now = time.monotonic()
        with self._cond:
            return {pool: (now - since, self._errors.get(pool, "")) for pool, since in self._failing_since.items()}

    def update(self, pools: Mapping[str, DesiredPool]) -> None:
        """Replaces the whole desired state. Validates every pool first (InvalidPoolError, nothing
        changes); then queues removed and new pools for an immediate sync."""
        for name, pool in pools.items():
            check_desired_pool(self.driver, name, pool, self.owner)
        new = {name: copy.deepcopy(pool) for name, pool in pools.items()}
        with self._cond:
            old = self._desired or {}
            self._desired = new
            SLICE_POOLS.labels(self.driver).set(len(new))
            for name in set(old) | set(new):
                if old.get(name) != new.get(name) or name in self._errors:
                    self._enqueue_locked(name, 0.0, urgent=True)
            self._cond.notify_all()

    def resync(self) -> None:
        """Queues every desired pool for an immediate sync: for when slices are known to be gone without a
        watch event to say so yet (a kubelet deletes its node's slices when it starts)."""
        with self._cond:
            for name in self._desired or {}:
                self._enqueue_locked(name, 0.0, urgent=True)
            self._cond.notify_all()

    def start(self) -> "ResourceSliceController":
        if self._threads:
            return self
        self._stop.clear()
        self._watch_synced.clear()   # the first listing after a start removes pools no longer wanted
        for target, name in ((self._watch_loop, "watch"), (self._worker_loop, "worker")):
            t = threading.Thread(target=target, name=f"slices-{name}-{self.driver}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        resp = self._watch_resp
        if resp is not None:
            try:
                resp.shutdown()   # unblocks the watch thread's read
            except Exception:  # noqa: BLE001 - best effort during shutdown
                pass
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()

    def __enter__(self) -> "ResourceSliceController":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_for_sync(self, timeout: float) -> bool:
        """True once every pool queued by `update()` (and every failing pool) has synced successfully."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._idle_locked():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def run_once(self, timeout: float = 120.0) -> None:
        """One complete reconciliation in the calling thread (no watch, no worker): the existing slices
        are listed to find pools that are no longer desired, then every queued pool is synced, retrying
        with back-off. Raises PoolSyncError when the deadline passes first."""
        if self._threads:
            raise RuntimeError("run_once() cannot be used while the controller threads run")
        with self._cond:
            if self._desired is None:
                raise RuntimeError("call update() before run_once()")
        deadline = time.monotonic() + timeout
        while True:
            try:
                existing = self.kube.list(SLICES, field_selector=self._selector())["items"]
                break
            except (ApiUnavailable, ApiError) as exc:
                delay = self._backoff.failure("list")
                if time.monotonic() + delay > deadline:
                    raise PoolSyncError(f"cannot list ResourceSlices: {exc}") from exc
                log.warning("listing ResourceSlices failed (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay)
        self._backoff.success("list")
        with self._cond:
            for obj in existing:
                self._enqueue_locked(obj["spec"]["pool"]["name"], 0.0, urgent=True)
        while True:
            with self._cond:
                urgent = [(due, p) for p, (due, u) in self._queue.items() if u]
                if not urgent:
                    return
                due, pool = min(urgent)
                if due > deadline:
                    raise PoolSyncError(f"not all pools synced before the deadline: {self._errors}")
                del self._queue[pool]
            time.sleep(max(0.0, due - time.monotonic()))
            self._process(pool)

    # ---- queue ------------------------------------------------------------------------------------

    def _enqueue_locked(self, pool: str, delay: float, urgent: bool) -> None:
        due = time.monotonic() + delay
        if pool in self._queue:
            old_due, old_urgent = self._queue[pool]
            due, urgent = min(due, old_due), urgent or old_urgent
        self._queue[pool] = (due, urgent)

    def _enqueue(self, pools: Iterable[str], delay: float, urgent: bool = False) -> None:
        with self._cond:
            for pool in pools:
                self._enqueue_locked(pool, delay, urgent)
            self._cond.notify_all()

    def _idle_locked(self) -> bool:
        return (self._desired is not None and not self._busy and not self._errors
                and not any(urgent for _, urgent in self._queue.values()))

    def _worker_loop(self) -> None:
        next_resync = time.monotonic() + self.resync_period
        while not self._stop.is_set():
            with self._cond:
                now = time.monotonic()
                if now >= next_resync and self._desired is not None:
                    for name in self._desired:
                        self._enqueue_locked(name, 0.0, urgent=False)
                    next_resync = now + self.resync_period
                if self._desired is None or not self._queue:
                    self._cond.wait(max(0.01, min(1.0, next_resync - now)))
                    continue
                pool, (due, _) = min(self._queue.items(), key=lambda kv: kv[1][0])
                if due > now:
                    self._cond.wait(min(due - now, 1.0))
                    continue
                del self._queue[pool]
                self._busy.add(pool)
            self._process(pool)

    def _process(self, pool: str) -> None:
        with self._cond:
            self._busy.add(pool)
        try:
            self._sync_pool(pool)
        except Exception as exc:  # noqa: BLE001 - every failure is retried with back-off
            with self._cond:
                delay = self._backoff.failure(pool)
                attempt = self._backoff.failures(pool)
                self._errors[pool] = f"{type(exc).__name__}: {exc}"
                self._failing_since.setdefault(pool, time.monotonic())
                self._enqueue_locked(pool, delay, urgent=True)
            SLICE_SYNCS.labels(self.driver, "error").inc()
            log.warning("driver %s pool %s: sync failed (attempt %d), retrying in %.2fs: %s",
                        self.driver, pool, attempt, delay, exc)
        else:
            with self._cond:
                self._backoff.success(pool)
                self._errors.pop(pool, None)
                self._failing_since.pop(pool, None)
            SLICE_SYNCS.labels(self.driver, "ok").inc()
        finally:
            with self._cond:
                self._busy.discard(pool)
                self._cond.notify_all()

    # ---- watch ------------------------------------------------------------------------------------

    def _selector(self, pool: str | None = None) -> str:
        parts = [f"spec.driver={self.driver}"]
        if self.owner.node_name is not None:
            parts.append(f"spec.nodeName={self.owner.node_name}")
        if pool is not None:
            parts.append(f"spec.pool.name={pool}")
        return ",".join(parts)

    def _list_pool(self, pool: str) -> list[dict[str, Any]]:
        """The pool's slices (of this driver and owner)."""
        if self._pool_field_selector:
            try:
                return list(self.kube.list(SLICES, field_selector=self._selector(pool))["items"])
            except ApiError as exc:
                if not (exc.status == 400 and "spec.pool.name" in exc.message):
                    raise
                with self._cond:
                    first, self._pool_field_selector = self._pool_field_selector, False
                if first:
                    log.info("driver %s: the API server cannot select ResourceSlices by spec.pool.name (%s); "
                             "listing the driver's slices and picking each pool's here", self.driver, exc.message)
        items = self.kube.list(SLICES, field_selector=self._selector())["items"]
        return [o for o in items if (o.get("spec") or {}).get("pool", {}).get("name") == pool]

    def _watch_loop(self) -> None:
        backoff = Backoff(initial=0.5, maximum=30.0)
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    listed = self.kube.list(SLICES, field_selector=self._selector())
                    rv = listed["resourceVersion"]
                    pools = {o["spec"]["pool"]["name"] for o in listed["items"]}
                    with self._cond:
                        pools |= set(self._desired or {})
                    # The first listing finds pools this owner no longer wants; later ones catch up
                    # on whatever the watch missed while it was down.
                    first = not self._watch_synced.is_set()
                    self._enqueue(pools, 0.0 if first else self.sync_delay, urgent=first)
                    self._watch_synced.set()
                for event in self._watch_events(rv):
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        if obj.get("code") == 410:   # resourceVersion too old: list again
                            rv = None
                            break
                        raise ApiError("WATCH", SLICES, int(obj.get("code") or 500), str(obj))
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if kind == "BOOKMARK" or self._is_own_echo(kind, obj):
                        continue
                    pool = obj.get("spec", {}).get("pool", {}).get("name")
                    if pool:
                        self._enqueue([pool], self.sync_delay)
                backoff.success("watch")
            except (ApiUnavailable, ApiError, ValueError) as exc:
                if self._stop.is_set():
                    return
                delay = backoff.failure("watch")
                log.warning("driver %s: watching ResourceSlices failed (%s); again in %.1fs", self.driver, exc, delay)
                rv = None
                self._stop.wait(delay)

    def _watch_events(self, rv: str) -> Iterable[dict[str, Any]]:
        resp = self.kube.request("GET", SLICES, query={
            "watch": "true", "resourceVersion": rv, "fieldSelector": self._selector(),
            "allowWatchBookmarks": "true", "timeoutSeconds": self.watch_timeout},
            timeout=self.watch_timeout + 30, stream=True)
        self._watch_resp = resp
        try:
            yield from iter_json_lines(resp)
        except Exception as exc:  # noqa: BLE001 - a broken stream is an unavailable server
            if not self._stop.is_set():
                raise ApiUnavailable(f"watch of ResourceSlices broke: {exc}") from exc
        finally:
            self._watch_resp = None
            resp.release_conn()

    def _is_own_echo(self, kind: str | None, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        with self._cond:
            if kind == "DELETED" and meta.get("uid") in self._own_deletes:
                self._own_deletes.discard(meta["uid"])
                return True
            if kind in ("ADDED", "MODIFIED") and self._own_writes.get(meta.get("name", "")) == meta.get("resourceVersion"):
                del self._own_writes[meta["name"]]
                return True
        return False

    # ---- one pool ---------------------------------------------------------------------------------

    def _desired_spec(self, pool_name: str, pool: DesiredPool, index: int, generation: int) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "driver": self.driver,
            "pool": {"name": pool_name, "generation": generation, "resourceSliceCount": len(pool.slices)},
        }
        if pool.node_name:
            spec["nodeName"] = pool.node_name
        elif pool.node_selector is not None:
            spec["nodeSelector"] = copy.deepcopy(pool.node_selector)
        elif pool.all_nodes:
            spec["allNodes"] = True
        # Shared with the desired state, which update() copied: request bodies are only read, never changed.
        spec.update(pool.slices[index])
        return spec

    def _same(self, pool_name: str, index: int, desired: dict[str, Any], actual: dict[str, Any]) -> bool:
        dp, ap = desired["pool"], actual.get("pool", {})
        if (dp["name"], dp["generation"], dp["resourceSliceCount"]) != (
                ap.get("name"), int(ap.get("generation", 0)), int(ap.get("resourceSliceCount", 0))):
            return False
        nd, na = normalize_spec(desired), normalize_spec(actual)
        if nd == na:
            return True
        # The server dropped fields it does not support; we reported it already and must not loop.
        return self._accepted.get((pool_name, index)) == (nd, na)

    def _sync_pool(self, pool_name: str) -> None:
        with self._cond:
            desired = (self._desired or {}).get(pool_name)
        existing = self._list_pool(pool_name)
        existing.sort(key=lambda o: o["metadata"]["name"])
        if desired is None:
            for obj in existing:
                self._delete(obj)
            return

        count = len(desired.slices)
        index_of = {slice_name(self.driver, pool_name, i): i for i in range(count)}
        generation = max((_generation(o) for o in existing), default=0)
        by_index: dict[int, dict[str, Any]] = {}
        current: set[int] = set()
        obsolete: list[dict[str, Any]] = []
        for obj in existing:
            i = index_of.get(obj["metadata"]["name"])
            if i is None:
                obsolete.append(obj)
                continue
            by_index[i] = obj
            if _generation(obj) == generation:
                current.add(i)
        missing = [i for i in range(count) if i not in current]
        changed = [i for i in sorted(current)
                   if not self._same(pool_name, i, self._desired_spec(pool_name, desired, i, generation),
                                     by_index[i]["spec"])]
        removed = any(_generation(o) == generation for o in obsolete)
        if desired.generation > generation or missing or removed or len(changed) > 1:
            new_generation = max(generation + 1, desired.generation)
            to_write = list(range(count))
        else:
            new_generation, to_write = generation, changed
        if not obsolete and not to_write:
            return
        log.info("driver %s pool %s: generation %d -> %d, %d slice(s) to write, %d to delete",
                 self.driver, pool_name, generation, new_generation, len(to_write), len(obsolete))

        for obj in obsolete:
            self._delete(obj)
        owner_refs = self._owner_refs(desired) if any(i not in by_index for i in to_write) else []
        for i in sorted(to_write, key=lambda i: i not in by_index):   # updates first, then creates
            spec = self._desired_spec(pool_name, desired, i, new_generation)
            if i in by_index:
                meta = {k: v for k, v in by_index[i]["metadata"].items() if k != "managedFields"}
                body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": meta, "spec": spec}
                stored = self._write("update", lambda b=body: self.kube.replace(SLICES, b))
            else:
                meta = {"name": slice_name(self.driver, pool_name, i)}
                if owner_refs:
                    meta["ownerReferences"] = owner_refs
                body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": meta, "spec": spec}
                stored = self._write("create", lambda b=body: self.kube.create(SLICES, b))
            self._check_stored(pool_name, i, spec, stored)

    def _owner_refs(self, pool: DesiredPool) -> list[dict[str, Any]]:
        if not pool.node_name:
            return []
        try:
            node = self.kube.get(f"{NODES}/{pool.node_name}")
        except ApiError as exc:
            if exc.not_found:
                raise PoolSyncError(f"Node {pool.node_name!r} does not exist; its slices need it as owner") from exc
            raise
        return [{"apiVersion": "v1", "kind": "Node", "name": pool.node_name,
                 "uid": node["metadata"]["uid"], "controller": True}]

    def _write(self, operation: str, call: Any) -> dict[str, Any]:
        try:
            stored = call()
        except ApiError as exc:
            if exc.conflict:
                raise PoolSyncError(f"{operation} conflicted with another change ({exc.message}); will re-read") from exc
            raise
        with self._cond:
            self._writes[operation] += 1
            meta = stored.get("metadata", {})
            if len(self._own_writes) > 10000:
                self._own_writes.clear()
            self._own_writes[meta.get("name", "")] = meta.get("resourceVersion", "")
        SLICE_WRITES.labels(self.driver, operation).inc()
        return stored

    def _delete(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        try:
            self.kube.delete(SLICES, meta["name"], uid=meta.get("uid"), resource_version=meta.get("resourceVersion"))
        except ApiError as exc:
            if exc.not_found:
                return
            if exc.conflict:
                raise PoolSyncError(f"delete of {meta['name']} conflicted ({exc.message}); will re-read") from exc
            raise
        with self._cond:
            self._writes["delete"] += 1
            if len(self._own_deletes) > 10000:
                self._own_deletes.clear()
            self._own_deletes.add(meta.get("uid", ""))
        SLICE_WRITES.labels(self.driver, "delete").inc()

    def _check_stored(self, pool_name: str, index: int, desired: dict[str, Any], stored: dict[str, Any]) -> None:
        nd, ns = normalize_spec(desired), normalize_spec(stored.get("spec", {}))
        if nd == ns:
            self._accepted.pop((pool_name, index), None)
            return
        self._accepted[(pool_name, index)] = (nd, ns)
        diffs = spec_differences(nd, ns)
        key = (pool_name, *diffs)
        if key not in self._reported_drops:
            self._reported_drops.add(key)
            log.error("driver %s pool %s: the API server did not store ResourceSlice %s as sent (%s); "
                      "a feature it needs is probably disabled there. Not retrying this difference.",
                      self.driver, pool_name, stored.get("metadata", {}).get("name"), "; ".join(diffs))
