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

At fleet scale (a cluster-wide publisher of a thousand nodes, five thousand slices of ~50 KB):

* pools are synced by `workers` threads, one pool per thread at a time, so at most `workers` writes are in
  flight and each pool keeps the guarantees above (a pool is never synced by two threads at once);
* `update_from()` and `run_once(pools=...)` take the desired pools as a stream: each pool is queued as soon as
  it is ready, while the rest is still being computed; pools missing from a stream are removed only once it
  ended (an aborted stream removes nothing);
* a desired pool is held as a digest and the zlib-compressed canonical JSON of each slice, never as dicts, and
  request bodies are assembled from that JSON: memory grows by kilobytes per pool, not by its megabyte of dicts;
* each slice we write carries the annotation SPEC_ANNOTATION: the digest of the spec as sent, its pool fields
  and the `metadata.generation` the write gives it (1 on create, +1 on an update, which always changes the
  spec). The API server raises `metadata.generation` on every spec change and on nothing else, so while the
  two agree the stored spec is exactly what we sent and comparing digests is enough. Otherwise (no
  annotation: written by someone else or by an older release; or edited since) the stored spec is read in
  full and compared normalised (`kube.slicecompare`);
* the annotation is part of the object, so whoever edits the spec can carry it along: `kubectl replace
  --force` (or delete and create) of an edited copy gives generation 1 again under a new uid, and one write
  may change the spec and the annotation's generation together. So the annotation vouches for a slice only
  while its uid and `metadata.generation` are the ones this controller saw it get from its own write (or,
  for a cluster-wide publisher and a slice it has not written yet, the ones it had in the first listing: a
  restart of the fleet reads metadata only; a node's plugin reads its few slices in full when it starts). Any
  other uid or generation of that name is compared in full;
* what exists is read with ONE metadata-only LIST of the driver's slices (names, versions, annotations: a
  thousandth of the bytes) at the start of a pass, and kept current from the watch and from the answers to
  our own writes; slices it cannot vouch for are read in full (GET, or one paged LIST when there are many).
  A pool is read on its own (a LIST selected by `spec.pool.name`) when that cache is not running, when a
  write of the pool failed (a conflict: someone changed it), after `resync()`, and in a `run_once` pass over
  at most FRESH_READ_POOLS pools (a node's plugin), where reading just before writing narrows the window
  for conflicts at no cost worth saving.

Differences from upstream, for simplicity: slice names are deterministic (`<pool>-<driver>-<index>`, the index
zero-padded so that name order, which kube-scheduler follows, is pool order) rather than generated; the cache
above plays the informer's and the mutation cache's part. API servers that cannot select by `spec.pool.name`
(Kubernetes 1.34) answer 400; from then on a pool's slices are picked out of the driver's (and node's) slices
here. Slices under names this publisher no longer gives (e.g. the unpadded `-2` of older releases) are
obsolete: they are deleted and the pool is written anew under the current names with the next generation.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import zlib
from collections import Counter as _Tally
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from api.k8snames import is_dns_subdomain
from dra.model.slices import validate_pool
from kube.backoff import Backoff
from kube.client import NODES, SLICES, ApiError, ApiUnavailable, EncodedObject, KubeApi, iter_json_lines
from kube.metrics import SLICE_POOLS, SLICE_SYNCS, SLICE_WRITES
from kube.slicecompare import normalize_spec, spec_differences

log = logging.getLogger(__name__)

DEFAULT_SYNC_DELAY = 30.0      # upstream DefaultSyncDelay
DEFAULT_RESYNC_PERIOD = 600.0
_POOL_FIELDS = ("driver", "pool", "nodeName", "nodeSelector", "allNodes")
_SELECTION_FIELDS = ("nodeName", "nodeSelector", "allNodes")

# Written on every slice we write (see the module docstring); a JSON object, e.g.
# {"count":5,"generation":2,"pool":"node-a","poolGeneration":1,"sha256":"…","v":1}
SPEC_ANNOTATION = "gpu.dra-driver.io/published-spec"
_DIGEST_VERSION = 1
# A run_once pass over at most this many pools reads each pool on its own right before syncing it.
FRESH_READ_POOLS = 4
# Slices that the metadata-only LIST cannot vouch for are read one GET each up to this many, else by a paged LIST.
_MAX_SINGLE_READS = 64


class InvalidPoolError(ValueError):
    """A desired pool that the API server would reject or that would mislead the scheduler."""


class PoolSyncError(RuntimeError):
    """A pool could not be brought in line this time (retried with back-off)."""


@dataclass(frozen=True)
class Owner:
    """Who publishes: one node's plugin (only slices with spec.nodeName == node), a cluster-wide publisher
    (every slice of the driver; pools it does not desire are deleted), or a labelled publisher: only slices that
    carry its label (``key=value``), which it puts on every slice it creates, are read, changed or deleted, so
    pools that others publish (node plugins) are invisible to it."""

    node_name: str | None = None
    label: tuple[str, str] | None = None

    @classmethod
    def node(cls, name: str) -> "Owner":
        return cls(name)

    @classmethod
    def cluster(cls) -> "Owner":
        return cls(None)

    @classmethod
    def labelled(cls, key: str, value: str) -> "Owner":
        return cls(None, (key, value))

    @property
    def label_selector(self) -> str | None:
        return f"{self.label[0]}={self.label[1]}" if self.label else None


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

    def selection(self) -> dict[str, Any]:
        """The spec fields that select the pool's nodes: the first of node_name, node_selector, all_nodes set."""
        if self.node_name:
            return {"nodeName": self.node_name}
        if self.node_selector is not None:
            return {"nodeSelector": self.node_selector}
        return {"allNodes": True} if self.all_nodes else {}

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
    selection = pool.selection()
    head = {"driver": driver, "pool": {"name": pool_name, "generation": 0, "resourceSliceCount": len(pool.slices)}}
    return [{**head, **selection, **part} for part in pool.slices]


def _canonical(obj: Any) -> str:
    """One JSON text per value: sorted keys, no spaces (digests must not depend on dict insertion order)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _newer(rv: str, than: str) -> bool:
    """resourceVersions are etcd revisions in practice; where one is not a number, take the new one."""
    try:
        return int(rv) > int(than)
    except ValueError:
        return True


@dataclass(frozen=True, eq=False)
class PreparedPool:
    """A desired pool as the controller holds it: per slice the compressed canonical JSON of its part and the
    digest of the spec it makes (generation aside). A few kilobytes where the dicts took a megabyte. Made by
    `prepare_pool`, also in another process (it pickles small): streams may give these instead of DesiredPools."""

    driver: str
    node_name: str | None
    selection: str                 # JSON members of the node selection ('"nodeName":"n"'), may be empty
    generation: int
    parts: tuple[bytes, ...]       # zlib(canonical JSON of each slice part)
    digests: tuple[str, ...]
    checked: bool                  # passed check_desired_pool

    @property
    def count(self) -> int:
        return len(self.parts)

    def part_json(self, index: int) -> str:
        return zlib.decompress(self.parts[index]).decode()

    def checked_copy(self) -> "PreparedPool":
        return replace(self, checked=True)

    def same_as(self, other: "PreparedPool | None") -> bool:
        return (other is not None and self.digests == other.digests and self.generation == other.generation
                and self.node_name == other.node_name)


@dataclass(frozen=True)
class _Slice:
    """What the controller remembers of one existing slice: enough to compare and to update or delete it."""

    name: str
    uid: str
    rv: str
    mgen: int                      # metadata.generation
    meta: dict[str, Any]           # metadata without managedFields: an update keeps others' labels and annotations
    pool: str
    pool_gen: int
    count: int
    digest: str | None             # the spec is exactly the one we sent with this digest
    norm: str | None               # otherwise: digest of the normalised stored spec


def prepare_pool(driver: str, pool_name: str, pool: DesiredPool, checked: bool = False) -> PreparedPool:
    """The compact form of a desired pool (not validated unless `checked` says it was)."""
    members = _canonical(pool.selection())[1:-1]
    texts = [_canonical(part) for part in pool.slices]
    head = f"{_DIGEST_VERSION}\n{driver}\n{pool_name}\n{len(texts)}\n{members}\n"
    return PreparedPool(driver=driver, node_name=pool.node_name or None, selection=members,
                        generation=pool.generation, parts=tuple(zlib.compress(t.encode(), 1) for t in texts),
                        digests=tuple(_digest(head + t) for t in texts), checked=checked)


def _note(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """Our annotation, if present and readable."""
    text = (meta.get("annotations") or {}).get(SPEC_ANNOTATION)
    if not isinstance(text, str):
        return None
    try:
        note = json.loads(text)
    except ValueError:
        return None
    if not isinstance(note, dict) or note.get("v") != _DIGEST_VERSION or not isinstance(note.get("sha256"), str) \
            or not isinstance(note.get("pool"), str):
        return None
    return note


def _norm_digest(spec: Mapping[str, Any]) -> str:
    return _digest(_canonical(normalize_spec(dict(spec))))


class ResourceSliceController:
    """Publishes the desired pools of one driver and keeps them exact. Thread-safe.

    Use as a context manager (threads: a watch and `workers` workers), or call `run_once()` for a single
    reconciliation that returns when it is done."""

    def __init__(self, api_client: Any, driver_name: str, owner: Owner = Owner.cluster(), *,
                 sync_delay: float = DEFAULT_SYNC_DELAY, resync_period: float = DEFAULT_RESYNC_PERIOD,
                 backoff: Backoff | None = None, watch_timeout: int = 300, workers: int = 1) -> None:
        if not is_dns_subdomain(driver_name, 63):
            raise ValueError(f"driver name {driver_name!r} must be a lower-case DNS subdomain of at most 63 characters")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.kube = KubeApi(api_client)
        self.driver = driver_name
        self.owner = owner
        self.sync_delay = sync_delay
        self.resync_period = resync_period
        self.watch_timeout = watch_timeout
        self.workers = workers
        self._backoff = backoff or Backoff()
        self._cond = threading.Condition()
        self._desired: dict[str, PreparedPool] | None = None
        self._queue: dict[str, tuple[float, bool]] = {}    # pool -> (due, urgent)
        self._deferred: dict[str, tuple[float, bool]] = {}  # queued, but an unfinished stream has not given it yet
        self._busy: set[str] = set()
        self._errors: dict[str, str] = {}
        self._failing_since: dict[str, float] = {}          # pool -> monotonic time of its first failure in a row
        self._writes: _Tally[str] = _Tally()
        self._own_writes: dict[str, str] = {}               # slice name -> resourceVersion we wrote
        # Slice name -> (uid, metadata.generation) whose stored spec our annotation describes (see _vouched).
        self._vouched_for: dict[str, tuple[str, int]] = {}
        self._seeded = False                                # the first listing is done: vouch for no new names
        self._own_deletes: set[str] = set()                 # uids we deleted
        self._accepted: dict[tuple[str, int], tuple[str, str | None]] = {}   # (pool, index) -> (desired, stored) norms
        self._reported_drops: set[tuple[str, ...]] = set()
        self._desired_norms: dict[str, str] = {}            # slice digest -> digest of its normalised spec
        # What exists: slice name -> record, pool -> names. Trusted while _cache_ready (see the module docstring).
        self._cache: dict[str, _Slice] = {}
        self._pool_names: dict[str, set[str]] = {}
        self._cache_ready = False
        self._fresh: set[str] = set()                       # pools to read on their own at their next sync
        self._node_uids: dict[str, str] | None = None       # during a bulk pass: Node name -> uid, from one LIST
        self._streamed: set[str] | None = None              # pools an unfinished stream has given so far
        self._active_workers = 0
        self._pass_over = False
        self._next_resync = 0.0
        self._prompt_until = 0.0                            # watch events sync at once until then (resync)
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

    @property
    def desired_slices(self) -> int:
        """How many slices the desired pools have."""
        with self._cond:
            return sum(p.count for p in (self._desired or {}).values())

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
        new = {name: self._prepare(name, pool, checked=True) for name, pool in pools.items()}
        with self._cond:
            old = self._desired or {}
            self._desired = new
            SLICE_POOLS.labels(self.driver).set(len(new))
            for name in set(old) | set(new):
                previous, wanted = old.get(name), new.get(name)
                changed = previous is not wanted and (wanted is None or not wanted.same_as(previous))
                if changed or name in self._errors:
                    self._enqueue_locked(name, 0.0, urgent=True)
            self._cond.notify_all()

    def update_from(self, pools: Iterable[tuple[str, DesiredPool | PreparedPool]]) -> None:
        """Replaces the whole desired state with the pools `pools` yields, in the calling thread, while the
        controller's threads (`start()`) already write each pool as soon as it is yielded. Pools not yielded
        are removed when the iterable is exhausted; if it raises (or a pool is invalid: InvalidPoolError),
        the error propagates and nothing is removed."""
        self._consume(pools, deadline=None)

    def resync(self, prompt_for: float = 0.0) -> None:
        """Queues every desired pool for an immediate sync from a fresh read: for when slices are known to be gone
        without a watch event to say so yet (a kubelet deletes its node's slices when it starts). For the next
        ``prompt_for`` seconds a watch event of a desired pool is synced at once instead of after ``sync_delay``:
        a starting kubelet deletes the slices while it registers its plugins, so its deletes can come after the
        sync queued here and would otherwise wait the whole delay."""
        with self._cond:
            self._prompt_until = max(self._prompt_until, time.monotonic() + prompt_for)
            for name in self._desired or {}:
                self._fresh.add(name)
                self._enqueue_locked(name, 0.0, urgent=True)
            self._cond.notify_all()

    def start(self) -> "ResourceSliceController":
        if self._threads:
            return self
        self._stop.clear()
        self._watch_synced.clear()   # the first listing after a start removes pools no longer wanted
        self._next_resync = time.monotonic() + self.resync_period
        targets = [(self._watch_loop, "watch")] + [(self._worker_loop, f"worker-{i}") for i in range(self.workers)]
        with self._cond:
            self._active_workers = self.workers
        for target, name in targets:
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
        with self._cond:
            self._active_workers = 0
            self._cache_ready = False     # nothing keeps it current any more

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

    def run_once(self, timeout: float = 120.0,
                 pools: Iterable[tuple[str, DesiredPool | PreparedPool]] | None = None) -> None:
        """One complete reconciliation without the watch: the existing slices are listed (once, metadata only)
        to find pools that are no longer desired, then every queued pool is synced by `workers` threads,
        retrying with back-off. With `pools`, the desired state is replaced by what that iterable yields (as
        `update_from`), each pool synced while the next is computed. Raises PoolSyncError when the deadline
        passes first."""
        if self._threads:
            raise RuntimeError("run_once() cannot be used while the controller threads run")
        with self._cond:
            if self._desired is None and pools is None:
                raise RuntimeError("call update() before run_once()")
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._prime()
                break
            except (ApiUnavailable, ApiError) as exc:
                delay = self._backoff.failure("list")
                if time.monotonic() + delay > deadline:
                    raise PoolSyncError(f"cannot list ResourceSlices: {exc}") from exc
                log.warning("listing ResourceSlices failed (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay)
        self._backoff.success("list")
        with self._cond:
            for name in self._pool_names:
                self._enqueue_locked(name, 0.0, urgent=True)
            queued = [p for p, (_, urgent) in self._queue.items() if urgent]
            if pools is None and len(queued) <= FRESH_READ_POOLS:
                self._fresh.update(queued)
            self._node_uids = {} if self.owner.node_name is None else None
            self._pass_over = False
            self._active_workers = self.workers
        if pools is not None:
            self._begin_stream()      # before the workers start: pools not given yet must wait for the stream
        threads = [threading.Thread(target=self._pass_worker, name=f"slices-pass-{i}-{self.driver}", daemon=True)
                   for i in range(self.workers)]
        for t in threads:
            t.start()
        try:
            if pools is not None:
                self._consume(pools, deadline)
            self._wait_for_pass(deadline)
        finally:
            with self._cond:
                self._pass_over = True
                self._cond.notify_all()
            for t in threads:
                t.join()
            with self._cond:
                self._active_workers = 0
                self._cache_ready = False     # nothing keeps it current between passes
                self._node_uids = None

    # ---- desired state ----------------------------------------------------------------------------

    def _prepare(self, pool_name: str, pool: DesiredPool, checked: bool) -> PreparedPool:
        return prepare_pool(self.driver, pool_name, pool, checked)

    def _consume(self, pools: Iterable[tuple[str, DesiredPool | PreparedPool]], deadline: float | None) -> None:
        """Streams `pools` into the desired state (see update_from). While workers run, at most a few pools per
        worker wait to be synced: computing the next pool waits for them, which keeps memory per pool and
        leaves the CPU to the writes rather than racing ahead of them."""
        self._begin_stream()
        completed = False
        try:
            for name, pool in pools:
                prepared = self._prepare_streamed(name, pool)
                with self._cond:
                    while self._active_workers and self._pending_locked() >= 4 * self.workers:
                        if deadline is not None and time.monotonic() > deadline:
                            raise PoolSyncError(f"not all pools synced before the deadline: {self._errors}")
                        self._cond.wait(0.5)
                    desired, streamed = self._streaming_locked()
                    previous = desired.get(name)
                    desired[name] = prepared
                    streamed.add(name)
                    waiting = self._deferred.pop(name, None)
                    if waiting is not None:
                        self._enqueue_locked(name, waiting[0] - time.monotonic(), waiting[1])
                    if not prepared.same_as(previous) or name in self._errors:
                        self._enqueue_locked(name, 0.0, urgent=True)
                    SLICE_POOLS.labels(self.driver).set(len(desired))
                    self._cond.notify_all()
            completed = True
        finally:
            with self._cond:
                streamed, self._streamed = self._streamed or set(), None
                assert self._desired is not None            # from _begin_stream on
                desired = self._desired
                deferred, self._deferred = self._deferred, {}
                if completed:
                    for name in set(desired) - streamed:
                        del desired[name]
                        self._enqueue_locked(name, 0.0, urgent=True)
                for name, (due, urgent) in deferred.items():
                    # After an abort, pools found in the cluster and never yielded would look unwanted: left be.
                    if completed or name in desired:
                        self._enqueue_locked(name, due - time.monotonic(), urgent)
                SLICE_POOLS.labels(self.driver).set(len(desired))
                if self._threads:
                    self._node_uids = None    # a running controller looks owners up when it needs them
                self._cond.notify_all()

    def _begin_stream(self) -> None:
        with self._cond:
            if self._streamed is None:
                self._streamed = set()
                # Until the stream gives a pool, a sync could only see it as unwanted: park what is queued.
                self._deferred.update(self._queue)
                self._queue.clear()
            if self._desired is None:
                self._desired = {}
            if self.owner.node_name is None and self._node_uids is None:
                self._node_uids = {}

    def _streaming_locked(self) -> tuple[dict[str, PreparedPool], set[str]]:
        """The desired pools and those the running stream has given so far; both exist from _begin_stream on,
        the second until the stream ends."""
        assert self._desired is not None and self._streamed is not None
        return self._desired, self._streamed

    def _prepare_streamed(self, name: str, pool: DesiredPool | PreparedPool) -> PreparedPool:
        """A pool the server already holds exactly is not validated again (it was before it was written);
        any other is, now."""
        if isinstance(pool, PreparedPool):
            if pool.driver != self.driver:
                raise ValueError(f"pool {name!r} was prepared for driver {pool.driver}, not {self.driver}")
            prepared = pool
        else:
            prepared = self._prepare(name, pool, checked=False)
        with self._cond:
            records = self._cached_locked(name) if self._cache_ready and name not in self._fresh else None
        if records is not None and not prepared.checked:
            _, to_write, obsolete, _ = self._plan(name, prepared, records)
            if not to_write and not obsolete:
                return prepared
        if not prepared.checked:
            if isinstance(pool, PreparedPool):
                self._check_prepared(name, pool)
            else:
                check_desired_pool(self.driver, name, pool, self.owner)     # the dicts are at hand
        return prepared.checked_copy()

    def _check_prepared(self, pool_name: str, desired: PreparedPool) -> None:
        pool = DesiredPool(slices=[json.loads(desired.part_json(i)) for i in range(desired.count)],
                           node_name=desired.node_name, generation=desired.generation,
                           **self._selection_kwargs(desired))
        check_desired_pool(self.driver, pool_name, pool, self.owner)

    @staticmethod
    def _selection_kwargs(desired: PreparedPool) -> dict[str, Any]:
        selection = json.loads("{" + desired.selection + "}")
        return {"node_selector": selection.get("nodeSelector"), "all_nodes": bool(selection.get("allNodes"))}

    def _spec_json(self, pool_name: str, desired: PreparedPool, index: int, generation: int,
                   part: str | None = None) -> str:
        """The spec of slice `index` as JSON text, assembled without decoding the part (`part`: its JSON text,
        when the caller has it already)."""
        head = json.dumps({"driver": self.driver, "pool": {"name": pool_name, "generation": generation,
                                                           "resourceSliceCount": desired.count}},
                          separators=(",", ":"), ensure_ascii=False)
        members = [head[1:-1]]
        if desired.selection:
            members.append(desired.selection)
        if part is None:
            part = desired.part_json(index)
        if part != "{}":
            members.append(part[1:-1])
        return "{" + ",".join(members) + "}"

    def _desired_norm(self, pool_name: str, desired: PreparedPool, index: int) -> str:
        """Digest of the normalised desired spec (for slices whose stored spec has to be compared in full)."""
        key = desired.digests[index]
        with self._cond:
            norm = self._desired_norms.get(key)
        if norm is None:
            norm = _norm_digest(json.loads(self._spec_json(pool_name, desired, index, 0)))
            with self._cond:
                if len(self._desired_norms) > 10000:
                    self._desired_norms.clear()
                self._desired_norms[key] = norm
        return norm

    # ---- queue ------------------------------------------------------------------------------------

    def _enqueue_locked(self, pool: str, delay: float, urgent: bool) -> None:
        queue = self._deferred if self._streamed is not None and pool not in self._streamed else self._queue
        due = time.monotonic() + delay
        if pool in queue:
            old_due, old_urgent = queue[pool]
            due, urgent = min(due, old_due), urgent or old_urgent
        queue[pool] = (due, urgent)

    def _enqueue(self, pools: Iterable[str], delay: float, urgent: bool = False) -> None:
        with self._cond:
            for pool in pools:
                self._enqueue_locked(pool, delay, urgent)
            self._cond.notify_all()

    def _idle_locked(self) -> bool:
        return (self._desired is not None and not self._busy and not self._errors and self._streamed is None
                and not any(urgent for _, urgent in self._queue.values()))

    def _pending_locked(self) -> int:
        """Pools that wait for a worker or are being synced (failing ones not counted: an unreachable server must
        not stall the stream)."""
        waiting = sum(1 for p, (_, urgent) in self._queue.items() if urgent and p not in self._errors)
        return waiting + len(self._busy)

    def _pick_locked(self, now: float, urgent_only: bool) -> tuple[str | None, float]:
        """The queued pool due first that no worker holds; or None and how long to wait."""
        best: tuple[float, str] | None = None
        for pool, (due, urgent) in self._queue.items():
            if (urgent_only and not urgent) or pool in self._busy:
                continue
            if best is None or due < best[0]:
                best = (due, pool)
        if best is None:
            return None, 1.0
        if best[0] > now:
            return None, best[0] - now
        del self._queue[best[1]]
        self._busy.add(best[1])
        return best[1], 0.0

    def _worker_loop(self) -> None:
        # Every change a worker must act on (update, resync, a watch event, a sync ending, stop) notifies the
        # condition, so an idle worker sleeps until the next pool is due or the periodic resync, not on a tick.
        while not self._stop.is_set():
            with self._cond:
                if self._stop.is_set():   # checked under the lock: stop() notifies under it
                    return
                now = time.monotonic()
                if now >= self._next_resync and self._desired is not None:
                    for name in self._desired:
                        self._enqueue_locked(name, 0.0, urgent=False)
                    self._next_resync = now + self.resync_period
                if self._desired is None:
                    self._cond.wait()
                    continue
                pool, wait = self._pick_locked(now, urgent_only=False)
                if pool is None:
                    if all(p in self._busy for p in self._queue):
                        wait = self._next_resync - now   # nothing queued for this worker: until the resync
                    self._cond.wait(max(0.01, min(wait, self._next_resync - now)))
                    continue
            self._process(pool)

    def _pass_worker(self) -> None:
        """A worker of one run_once pass: syncs urgent pools until the pass is over."""
        while True:
            with self._cond:
                if self._pass_over:
                    return
                pool, wait = self._pick_locked(time.monotonic(), urgent_only=True)
                if pool is None:
                    self._cond.wait(min(wait, 0.5))
                    continue
            self._process(pool)

    def _wait_for_pass(self, deadline: float) -> None:
        with self._cond:
            while True:
                urgent = [due for _, (due, u) in self._queue.items() if u]
                if not urgent and not self._busy:
                    return
                now = time.monotonic()
                if now > deadline or (urgent and not self._busy and min(urgent) > deadline):
                    raise PoolSyncError(f"not all pools synced before the deadline: {self._errors}")
                self._cond.wait(0.5)

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
                self._fresh.add(pool)          # whatever failed, read the pool again before the next try
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

    # ---- what exists ------------------------------------------------------------------------------

    def _selector(self, pool: str | None = None) -> str:
        parts = [f"spec.driver={self.driver}"]
        if self.owner.node_name is not None:
            parts.append(f"spec.nodeName={self.owner.node_name}")
        if pool is not None:
            parts.append(f"spec.pool.name={pool}")
        return ",".join(parts)

    def _record(self, obj: Mapping[str, Any], ours: bool = False) -> _Slice | None:
        """The record of a listed, watched or written slice; None for metadata without an annotation we can
        trust (that slice must be read in full). `ours`: the answer to our own write."""
        meta = obj.get("metadata") or {}
        spec = obj.get("spec")
        mgen = _int(meta.get("generation"))
        note = _note(meta)
        trusted = note is not None and _int(note.get("generation")) == mgen \
            and self._vouched(str(meta.get("name", "")), str(meta.get("uid", "")), mgen, ours)
        kept = {k: v for k, v in meta.items() if k != "managedFields"}
        base = dict(name=meta.get("name", ""), uid=meta.get("uid", ""), rv=meta.get("resourceVersion", ""),
                    mgen=mgen, meta=kept)
        if spec is None:
            if not trusted:
                return None
            assert note is not None
            return _Slice(**base, pool=note["pool"], pool_gen=_int(note.get("poolGeneration")),
                          count=_int(note.get("count")), digest=note["sha256"], norm=None)
        pool = spec.get("pool") or {}
        fields = (str(pool.get("name", "")), _int(pool.get("generation")), _int(pool.get("resourceSliceCount")))
        if trusted and note is not None and (note["pool"], _int(note.get("poolGeneration")),
                                             _int(note.get("count"))) == fields:
            return _Slice(**base, pool=fields[0], pool_gen=fields[1], count=fields[2], digest=note["sha256"], norm=None)
        return _Slice(**base, pool=fields[0], pool_gen=fields[1], count=fields[2], digest=None, norm=_norm_digest(spec))

    def _vouched(self, name: str, uid: str, mgen: int, ours: bool) -> bool:
        """Whether the annotation of this slice may stand for its spec (see the module docstring): it is the
        answer to our write, or the uid and generation are those we last vouched for under this name, or
        (a cluster-wide publisher, before its first listing is done) the name is new to us. A node's plugin
        reads its few slices in full once instead. Remembers what it vouches for."""
        with self._cond:
            known = self._vouched_for.get(name)
            if ours or known == (uid, mgen) or (known is None and not self._seeded and self.owner.node_name is None):
                self._vouched_for[name] = (uid, mgen)
                return True
            return False

    def _cache_put_locked(self, rec: _Slice, if_newer: bool = False) -> None:
        old = self._cache.get(rec.name)
        if old is not None:
            if if_newer and not _newer(rec.rv, old.rv):
                return
            if old.pool != rec.pool:
                self._pool_names.get(old.pool, set()).discard(rec.name)
        self._cache[rec.name] = rec
        self._pool_names.setdefault(rec.pool, set()).add(rec.name)

    def _cache_drop_locked(self, name: str, uid: str | None = None) -> str | None:
        old = self._cache.get(name)
        if old is None or (uid and old.uid != uid):
            return None
        del self._cache[name]
        names = self._pool_names.get(old.pool)
        if names is not None:
            names.discard(name)
            if not names:
                del self._pool_names[old.pool]
        return old.pool

    def _cached_locked(self, pool: str) -> list[_Slice]:
        return [self._cache[n] for n in self._pool_names.get(pool, ())]

    def _prime(self) -> str:
        """ONE metadata-only LIST of every slice of the driver (and owner) into the cache; slices it cannot vouch
        for are read in full. Returns the list's resourceVersion."""
        listed = self.kube.list_metadata(SLICES, field_selector=self._selector(),
                                        label_selector=self.owner.label_selector)
        records: list[_Slice] = []
        unknown: set[str] = set()
        for item in listed["items"]:
            rec = self._record(item)
            if rec is None:
                unknown.add(item["metadata"]["name"])
            else:
                records.append(rec)
        if unknown:
            records.extend(self._read_in_full(unknown))
        list_rv = listed.get("resourceVersion", "")
        with self._cond:
            self._seeded = True
            old = self._cache
            self._cache, self._pool_names = {}, {}
            for rec in records:
                self._cache_put_locked(rec)
            # Our own writes answered after the snapshot was taken are newer than what it shows.
            for name, rec in old.items():
                if list_rv and _newer(rec.rv, list_rv) and (name not in self._cache or _newer(rec.rv, self._cache[name].rv)):
                    self._cache_put_locked(rec)
            self._cache_ready = True
        return list_rv

    def _read_in_full(self, names: set[str]) -> list[_Slice]:
        records: list[_Slice] = []
        if len(names) <= _MAX_SINGLE_READS:
            for name in sorted(names):
                try:
                    obj = self.kube.get(f"{SLICES}/{name}")
                except ApiError as exc:
                    if exc.not_found:
                        continue
                    raise
                rec = self._record(obj)
                if rec is not None:
                    records.append(rec)
            return records
        for obj in self.kube.iter_list(SLICES, field_selector=self._selector(),   # a page at a time
                                       label_selector=self.owner.label_selector):
            if obj.get("metadata", {}).get("name") in names:
                rec = self._record(obj)
                if rec is not None:
                    records.append(rec)
        return records

    def _read_pool(self, pool: str) -> list[_Slice]:
        """The pool's slices (of this driver and owner), read now with a LIST of their own; the cache follows."""
        items: Iterable[dict[str, Any]] | None = None
        if self._pool_field_selector:
            try:
                items = self.kube.list(SLICES, field_selector=self._selector(pool),
                                       label_selector=self.owner.label_selector)["items"]
            except ApiError as exc:
                if not (exc.status == 400 and "spec.pool.name" in exc.message):
                    raise
                with self._cond:
                    first, self._pool_field_selector = self._pool_field_selector, False
                if first:
                    log.info("driver %s: the API server cannot select ResourceSlices by spec.pool.name (%s); "
                             "listing the driver's slices and picking each pool's here", self.driver, exc.message)
        if items is None:
            items = (o for o in self.kube.iter_list(SLICES, field_selector=self._selector(),
                                                    label_selector=self.owner.label_selector)
                     if (o.get("spec") or {}).get("pool", {}).get("name") == pool)
        records = [r for r in map(self._record, items) if r is not None]
        with self._cond:
            for name in list(self._pool_names.get(pool, ())):
                self._cache_drop_locked(name)
            for rec in records:
                self._cache_put_locked(rec)
            self._fresh.discard(pool)
        return records

    # ---- watch ------------------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        backoff = Backoff(initial=0.5, maximum=30.0)
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._prime()
                    with self._cond:
                        pools = set(self._pool_names) | set(self._desired or {})
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
                    if kind == "BOOKMARK":
                        continue
                    pool = self._apply_event(kind, obj)
                    if self._is_own_echo(kind, obj):
                        continue
                    if pool:
                        self._enqueue([pool], self._event_delay(pool))
                backoff.success("watch")
            except (ApiUnavailable, ApiError, ValueError) as exc:
                with self._cond:
                    self._cache_ready = False     # events are being missed: pools are read on their own meanwhile
                if self._stop.is_set():
                    return
                delay = backoff.failure("watch")
                log.warning("driver %s: watching ResourceSlices failed (%s); again in %.1fs", self.driver, exc, delay)
                rv = None
                self._stop.wait(delay)

    def _apply_event(self, kind: str | None, obj: dict[str, Any]) -> str | None:
        """Brings the cache in line with one watch event; returns the pool of the slice."""
        meta = obj.get("metadata", {})
        pool = (obj.get("spec") or {}).get("pool", {}).get("name")
        with self._cond:
            if kind == "DELETED":
                self._cache_drop_locked(meta.get("name", ""), meta.get("uid"))
                if self._vouched_for.get(meta.get("name", ""), ("",))[0] == meta.get("uid"):
                    del self._vouched_for[meta["name"]]
                return pool
        rec = self._record(obj)
        if rec is not None:
            with self._cond:
                self._cache_put_locked(rec, if_newer=True)
        return pool

    def _event_delay(self, pool: str) -> float:
        """How long a watch event of ``pool`` waits to be synced: ``sync_delay`` coalesces bursts, except for a
        desired pool within a resync's prompt window."""
        with self._cond:
            prompt = time.monotonic() < self._prompt_until and pool in (self._desired or {})
        return 0.0 if prompt else self.sync_delay

    def _watch_events(self, rv: str) -> Iterable[dict[str, Any]]:
        query: dict[str, Any] = {"watch": "true", "resourceVersion": rv, "fieldSelector": self._selector(),
                                 "allowWatchBookmarks": "true", "timeoutSeconds": self.watch_timeout}
        if self.owner.label_selector:
            query["labelSelector"] = self.owner.label_selector
        resp = self.kube.request("GET", SLICES, query=query, timeout=self.watch_timeout + 30, stream=True)
        self._watch_resp = resp
        try:
            yield from iter_json_lines(resp)
        except Exception as exc:  # noqa: BLE001 - a broken stream is an unavailable server
            if not self._stop.is_set():
                raise ApiUnavailable(f"watch of ResourceSlices broke: {exc}") from exc
        finally:
            self._watch_resp = None
            resp.close()

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

    def _same(self, pool_name: str, desired: PreparedPool, index: int, generation: int, actual: _Slice) -> bool:
        if (actual.pool, actual.pool_gen, actual.count) != (pool_name, generation, desired.count):
            return False
        if actual.digest is not None:
            return actual.digest == desired.digests[index]
        nd = self._desired_norm(pool_name, desired, index)
        # The server dropped fields it does not support; we reported it already and must not loop.
        return actual.norm == nd or self._accepted.get((pool_name, index)) == (nd, actual.norm)

    def _plan(self, pool_name: str, desired: PreparedPool, existing: list[_Slice]
              ) -> tuple[int, list[int], list[_Slice], dict[int, _Slice]]:
        """The upstream rule: (generation to write, indexes to write, obsolete slices, existing by index)."""
        count = desired.count
        index_of = {slice_name(self.driver, pool_name, i): i for i in range(count)}
        generation = max((s.pool_gen for s in existing), default=0)
        by_index: dict[int, _Slice] = {}
        current: set[int] = set()
        obsolete: list[_Slice] = []
        for rec in existing:
            i = index_of.get(rec.name)
            if i is None:
                obsolete.append(rec)
                continue
            by_index[i] = rec
            if rec.pool_gen == generation:
                current.add(i)
        missing = [i for i in range(count) if i not in current]
        changed = [i for i in sorted(current) if not self._same(pool_name, desired, i, generation, by_index[i])]
        removed = any(s.pool_gen == generation for s in obsolete)
        if desired.generation > generation or missing or removed or len(changed) > 1:
            return max(generation + 1, desired.generation), list(range(count)), obsolete, by_index
        return generation, changed, obsolete, by_index

    def _sync_pool(self, pool_name: str) -> None:
        with self._cond:
            desired = (self._desired or {}).get(pool_name)
            fresh = pool_name in self._fresh or not self._cache_ready
            existing = None if fresh else self._cached_locked(pool_name)
        if existing is None:
            existing = self._read_pool(pool_name)
        existing.sort(key=lambda s: s.name)
        if desired is None:
            for rec in existing:
                self._delete(rec)
            return

        generation = max((s.pool_gen for s in existing), default=0)
        new_generation, to_write, obsolete, by_index = self._plan(pool_name, desired, existing)
        if not obsolete and not to_write:
            return
        if not desired.checked:
            self._check_prepared(pool_name, desired)
        log.info("driver %s pool %s: generation %d -> %d, %d slice(s) to write, %d to delete",
                 self.driver, pool_name, generation, new_generation, len(to_write), len(obsolete))

        for rec in obsolete:
            self._delete(rec)
        owner_refs = self._owner_refs(desired) if any(i not in by_index for i in to_write) else []
        for i in sorted(to_write, key=lambda i: i not in by_index):   # updates first, then creates
            part = desired.part_json(i)
            spec = self._spec_json(pool_name, desired, i, new_generation, part)
            if i in by_index:
                old = by_index[i]
                meta = dict(old.meta)
                meta["annotations"] = {**(meta.get("annotations") or {}),
                                       SPEC_ANNOTATION: self._annotation(pool_name, desired, i, new_generation, old.mgen + 1)}
                body = _encode(meta, spec)
                stored = self._write("update", lambda b=body: self.kube.replace(SLICES, b))
            else:
                meta = {"name": slice_name(self.driver, pool_name, i),
                        "annotations": {SPEC_ANNOTATION: self._annotation(pool_name, desired, i, new_generation, 1)}}
                if self.owner.label:
                    meta["labels"] = {self.owner.label[0]: self.owner.label[1]}
                if owner_refs:
                    meta["ownerReferences"] = owner_refs
                body = _encode(meta, spec)
                stored = self._write("create", lambda b=body: self.kube.create(SLICES, b))
            self._check_stored(pool_name, desired, i, stored, part)
            written = self._record(stored, ours=True)
            if written is not None:
                with self._cond:
                    self._cache_put_locked(written)

    @staticmethod
    def _annotation(pool_name: str, desired: PreparedPool, index: int, pool_generation: int, generation: int) -> str:
        """What SPEC_ANNOTATION says: `generation` is the metadata.generation this write gives the slice."""
        return _canonical({"v": _DIGEST_VERSION, "sha256": desired.digests[index], "pool": pool_name,
                           "poolGeneration": pool_generation, "count": desired.count, "generation": generation})

    def _owner_refs(self, pool: PreparedPool) -> list[dict[str, Any]]:
        if not pool.node_name:
            return []
        return [{"apiVersion": "v1", "kind": "Node", "name": pool.node_name, "uid": self._node_uid(pool.node_name),
                 "controller": True}]

    def _node_uid(self, node: str) -> str:
        """During a pass over many pools, one LIST of the Nodes (metadata only) answers every pool; else one GET.
        Not kept beyond the pass: a Node deleted and created again gets a new uid."""
        with self._cond:
            uids = self._node_uids
            uid = uids.get(node) if uids is not None else None
            first = uids is not None and not uids
        if uid:
            return uid
        if first:
            try:
                listed = {o["metadata"]["name"]: o["metadata"]["uid"]
                          for o in self.kube.list_metadata(NODES)["items"]}
            except ApiError:
                listed = {}          # e.g. not allowed to list Nodes: one GET per node instead
            with self._cond:
                if self._node_uids is not None:
                    self._node_uids.update(listed or {"": ""})   # non-empty: listed once
            if node in listed:
                return listed[node]
        try:
            found = self.kube.get(f"{NODES}/{node}")
        except ApiError as exc:
            if exc.not_found:
                raise PoolSyncError(f"Node {node!r} does not exist; its slices need it as owner") from exc
            raise
        return str(found["metadata"]["uid"])

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

    def _delete(self, rec: _Slice) -> None:
        try:
            self.kube.delete(SLICES, rec.name, uid=rec.uid or None, resource_version=rec.rv or None)
        except ApiError as exc:
            if exc.not_found:
                with self._cond:
                    self._cache_drop_locked(rec.name)
                return
            if exc.conflict:
                raise PoolSyncError(f"delete of {rec.name} conflicted ({exc.message}); will re-read") from exc
            raise
        with self._cond:
            self._writes["delete"] += 1
            if len(self._own_deletes) > 10000:
                self._own_deletes.clear()
            self._own_deletes.add(rec.uid)
            self._cache_drop_locked(rec.name)
            self._vouched_for.pop(rec.name, None)
        SLICE_WRITES.labels(self.driver, "delete").inc()

    def _check_stored(self, pool_name: str, desired: PreparedPool, index: int, stored: dict[str, Any], part_json: str) -> None:
        """Whether the server stored what we sent: exactly (the usual case), or else as the same normalised spec;
        a real difference is a field the server dropped, logged once."""
        spec = stored.get("spec") or {}
        part = {k: v for k, v in spec.items() if k not in _POOL_FIELDS}
        selection = _canonical({k: spec[k] for k in _SELECTION_FIELDS if k in spec})[1:-1]
        # Dict equality ignores key order and runs in C: a third of the cost of a canonical dump of the answer.
        if spec.get("driver") == self.driver and selection == desired.selection \
                and part == json.loads(part_json):
            with self._cond:
                self._accepted.pop((pool_name, index), None)
            return
        nd = normalize_spec(json.loads(self._spec_json(pool_name, desired, index, 0, part_json)))
        ns = normalize_spec(spec)
        with self._cond:
            if nd == ns:
                self._accepted.pop((pool_name, index), None)
                return
            self._accepted[(pool_name, index)] = (_digest(_canonical(nd)), _digest(_canonical(ns)))
            diffs = spec_differences(nd, ns)
            key = (pool_name, *diffs)
            if key in self._reported_drops:
                return
            self._reported_drops.add(key)
        log.error("driver %s pool %s: the API server did not store ResourceSlice %s as sent (%s); "
                  "a feature it needs is probably disabled there. Not retrying this difference.",
                  self.driver, pool_name, stored.get("metadata", {}).get("name"), "; ".join(diffs))


def _encode(meta: dict[str, Any], spec_json: str) -> EncodedObject:
    """A ResourceSlice request body from its metadata and its spec already as JSON text."""
    text = ('{"apiVersion":"resource.k8s.io/v1","kind":"ResourceSlice","metadata":'
            + json.dumps(meta, separators=(",", ":"), ensure_ascii=False) + ',"spec":' + spec_json + "}")
    return EncodedObject(text.encode(), str(meta["name"]))
