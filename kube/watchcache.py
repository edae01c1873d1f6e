"""A resource kept by LIST then WATCH, as Kubernetes controllers keep theirs (client-go's reflector): one paged
LIST, then a WATCH from its resourceVersion with bookmarks, each event applied as it arrives. A watch that ends is
resumed from the last version seen; one the API server answers with 410 Gone (the version is too old) starts over
with a LIST; failures wait with exponential back-off. Nothing is polled.

Each object goes through ``fold`` as it arrives: what the caller keeps of it (a compact copy, or None to keep
nothing), so the cache holds only what its readers need. ``on_change(key, old, new)`` hears of every change,
from the watch's thread; a relist reports only what differs from before.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from kube.backoff import Backoff
from kube.client import METADATA_LIST, METADATA_OBJECT, ApiError, ApiUnavailable, KubeApi, Stream

log = logging.getLogger(__name__)

T = TypeVar("T")
# Objects per LIST page: a page is parsed whole before it is folded, so this bounds what a LIST of large objects
# (a node's ResourceSlices are tens of KB each) holds at once.
PAGE_SIZE = 50
# A watch is ended by the API server after a random time in [MIN, 2 × MIN], as client-go asks, so that the
# watches of many clients do not all restart at once.
WATCH_MIN_S = 300


class Gone(Exception):
    """The API server no longer has the version a watch asked for: LIST again."""


def object_key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name', '')}" if ns else str(meta.get("name", ""))


class WatchCache(Generic[T]):
    """``path``: the collection (e.g. /apis/resource.k8s.io/v1/resourceslices); ``metadata_only``: objects as
    PartialObjectMetadata (names, labels: a fraction of the bytes)."""

    def __init__(self, kube: KubeApi, path: str, fold: Callable[[dict[str, Any]], T | None], *, name: str,
                 field_selector: str | None = None, label_selector: str | None = None, metadata_only: bool = False,
                 on_change: Callable[[str, T | None, T | None], None] | None = None,
                 backoff: Backoff | None = None, page_size: int = PAGE_SIZE, watch_min_s: float = WATCH_MIN_S,
                 optional: bool = False) -> None:
        """``optional``: a resource the API server may not serve (404: an older release); then the cache is
        synced and empty."""
        self.kube, self.path, self.fold, self.name = kube, path, fold, name
        self.field_selector, self.label_selector = field_selector, label_selector
        self.metadata_only, self.on_change, self.optional = metadata_only, on_change, optional
        self.page_size, self.watch_min_s = page_size, watch_min_s
        self._backoff = backoff or Backoff(initial=0.5, maximum=30.0)
        self.lock = threading.RLock()
        self.store: dict[str, T] = {}
        self.resource_version = ""
        self.synced = threading.Event()
        self.lists = 0                      # LISTs made (the first and every relist)
        self.watches = 0
        self.last_error: str | None = None
        self.on_list: Callable[["WatchCache[T]"], None] | None = None    # hears of each LIST (metrics)
        self._stop = threading.Event()
        self._stream: Stream | None = None
        self._thread: threading.Thread | None = None

    # ---- running ------------------------------------------------------------------------------------

    def start(self) -> "WatchCache[T]":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"watch-{self.name}", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.shutdown()               # ends a read blocked in the watch thread
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def wait_synced(self, timeout: float | None = None) -> bool:
        return self.synced.wait(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.resource_version:
                    self.relist()
                    if not self.resource_version:   # an optional resource that is not served: look again later
                        self._stop.wait(self.watch_min_s)
                        continue
                self._watch()
                self._backoff.success("watch")
                self.last_error = None
            except Gone:
                log.info("%s: watch from version %s is too old; listing again", self.name, self.resource_version)
                self.resource_version = ""
            except (ApiError, ApiUnavailable) as exc:
                if self._stop.is_set():
                    return                  # stop() ended the watch
                if isinstance(exc, ApiError) and exc.status == 410:
                    self.resource_version = ""
                    continue
                self.last_error = str(exc)
                delay = self._backoff.failure("watch")
                log.warning("%s: %s; again in %.1fs", self.name, exc, delay)
                self._stop.wait(delay)
            except Exception as exc:  # noqa: BLE001 - a bad object or a fold bug must not end the cache for good
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.resource_version = ""
                delay = self._backoff.failure("watch")
                log.exception("%s: unexpected failure; listing again in %.1fs", self.name, delay)
                self._stop.wait(delay)

    # ---- LIST ---------------------------------------------------------------------------------------

    def relist(self) -> None:
        """One paged LIST: the store becomes exactly what it returned, each page folded before the next is read."""
        with _collector_paused():
            self._relist()

    def _relist(self) -> None:
        fresh: dict[str, T] = {}
        cont: str | None = None
        version = ""
        self.lists += 1
        if self.on_list is not None:
            self.on_list(self)
        try:
            while True:
                page = self.kube.request("GET", self.path, accept=METADATA_LIST if self.metadata_only else
                                         "application/json", query={
                                             "fieldSelector": self.field_selector, "labelSelector": self.label_selector,
                                             "limit": self.page_size, "continue": cont})
                for obj in page.get("items") or []:
                    kept = self.fold(obj)
                    if kept is not None:
                        fresh[object_key(obj)] = kept
                meta = page.get("metadata") or {}
                cont, version = meta.get("continue"), meta.get("resourceVersion", "")
                if not cont:
                    break
        except ApiError as exc:
            if exc.status == 404 and self.optional:
                fresh, version = {}, ""
            elif exc.status == 410:
                raise Gone() from exc       # the continue token expired: start over
            else:
                raise
        with self.lock:
            old, self.store = self.store, fresh
            self.resource_version = version
        self.last_error = None
        self.synced.set()
        if self.on_change is not None:
            for key in old.keys() | fresh.keys():
                before, after = old.get(key), fresh.get(key)
                if before is not after:
                    self.on_change(key, before, after)

    # ---- WATCH --------------------------------------------------------------------------------------

    def _watch(self) -> None:
        if not self.resource_version:
            return
        timeout = int(self.watch_min_s * (1 + random.random()))
        self.watches += 1
        stream = self.kube.request("GET", self.path, stream=True, timeout=timeout + 30,
                                   accept=METADATA_OBJECT if self.metadata_only else "application/json", query={
                                       "watch": "true", "resourceVersion": self.resource_version,
                                       "allowWatchBookmarks": "true", "timeoutSeconds": timeout,
                                       "fieldSelector": self.field_selector, "labelSelector": self.label_selector})
        self._stream = stream
        self.last_error = None              # watching again
        try:
            if self._stop.is_set():
                return
            for event in stream:
                self._apply(event)
                if self._stop.is_set():
                    return
        finally:
            self._stream = None
            stream.close()

    def _apply(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise Gone()
            raise ApiError("WATCH", self.path, int(code or 500), _json_text(obj))
        version = (obj.get("metadata") or {}).get("resourceVersion", "")
        if kind == "BOOKMARK":
            self.resource_version = version or self.resource_version
            return
        key = object_key(obj)
        kept = self.fold(obj) if kind in ("ADDED", "MODIFIED") else None
        with self.lock:
            before = self.store.get(key)
            if kept is None:
                self.store.pop(key, None)
            else:
                self.store[key] = kept
            self.resource_version = version or self.resource_version
        if self.on_change is not None and (before is not None or kept is not None):
            self.on_change(key, before, kept)

    # ---- reading ------------------------------------------------------------------------------------

    def items(self) -> list[T]:
        with self.lock:
            return list(self.store.values())

    def keys(self) -> list[str]:
        with self.lock:
            return list(self.store)


_pauses = 0
_pauses_lock = threading.Lock()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cycle collector off while LIST pages are parsed and folded: each page makes millions of objects (none in
    cycles), and the collector would scan the growing cache again and again (most of a large LIST's time). After
    the last such pass the cache's objects are moved out of the collector's way (gc.freeze): they live as long as
    the process, in no cycle, and are freed by their counts when replaced."""
    global _pauses
    with _pauses_lock:
        _pauses += 1
        gc.disable()
    try:
        yield
    finally:
        with _pauses_lock:
            _pauses -= 1
            if not _pauses:
                gc.freeze()
                gc.enable()


def _json_text(obj: dict[str, Any]) -> str:
    import json

    return json.dumps(obj)
