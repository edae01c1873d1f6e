"""The urllib3 pool a `kubernetes.client.ApiClient` built (TLS, proxy and pool size from its configuration), with two
bounds urllib3 and http.client leave out, put where urllib3 takes a connection class of our choosing:

* no read of an answer without a size: http.client reads a chunk whose size line says ``-1`` (or a body that only
  the connection's end delimits, when asked for all of it) to the end of the connection, in memory, however much
  the server sends; such a read is refused instead (``AnswerRefused``);
* a deadline for the status line and headers: http.client skips ``100 Continue`` interim answers for as long as
  they come, so a server sending them without end would hold the request forever; the head must be complete
  within the request's read timeout (or ``HEAD_DEADLINE_S`` without one).

Everything else (framing, TLS, proxies, keep-alive) is urllib3's and http.client's.
"""
from __future__ import annotations

import http.client
import threading
import time
import weakref
from typing import Any

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

HEAD_DEADLINE_S = 60.0


class AnswerRefused(http.client.HTTPException):
    """An answer that would cost more than its bounds; urllib3 reports it as a broken connection and drops it."""


class _BoundedFile:
    """The socket file of one answer, as http.client reads it: reads need a size, and none starts after the
    head's deadline until the head is complete."""

    __slots__ = ("_raw", "deadline", "_limit_s")

    def __init__(self, raw: Any, limit_s: float) -> None:
        self._raw, self._limit_s = raw, limit_s
        self.deadline: float | None = time.monotonic() + limit_s

    def _check(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise AnswerRefused(f"timed out: no complete status line and headers within {self._limit_s:g} s "
                                f"(interim answers without end?)")

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            raise AnswerRefused("a read of the answer to the end of the connection, without a bound (a negative "
                                "chunk size?)")
        self._check()
        data: bytes = self._raw.read(size)
        return data

    def readline(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            raise AnswerRefused("a line of the answer read without a bound")
        self._check()
        line: bytes = self._raw.readline(size)
        return line

    def readinto(self, buffer: Any) -> int:
        self._check()
        count: int = self._raw.readinto(buffer)
        return count

    def read1(self, size: int = -1) -> bytes:
        self._check()
        data: bytes = self._raw.read1(size)       # at most one read from the socket, whatever the size
        return data

    def close(self) -> None:
        self._raw.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _BoundedResponse(http.client.HTTPResponse):
    def __init__(self, sock: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        timeout = sock.gettimeout()
        self.fp = _BoundedFile(self.fp, timeout if timeout else HEAD_DEADLINE_S)  # type: ignore[assignment]

    def begin(self) -> None:
        super().begin()
        self.fp.deadline = None  # type: ignore[attr-defined]  # the body is bounded by its reader


class _HTTPConnection(HTTPConnection):
    response_class = _BoundedResponse


class _HTTPSConnection(HTTPSConnection):
    response_class = _BoundedResponse


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


class Pool:
    """The requests of one ApiClient, through its pool manager. Without a proxy, straight to the connection pool of
    the server (the manager would parse the URL and look the pool up again on every request)."""

    def __init__(self, manager: urllib3.PoolManager) -> None:
        self.manager = manager
        self._server: tuple[str, HTTPConnectionPool, str] | None = None    # (server URL, its pool, path prefix)

    def urlopen(self, method: str, server: str, target: str, **kw: Any) -> urllib3.BaseHTTPResponse:
        """`target`: the path and query below the `server` URL (which may end in a path prefix)."""
        if isinstance(self.manager, urllib3.ProxyManager):
            return self.manager.urlopen(method, server + target, redirect=False, **kw)
        cached = self._server
        if cached is None or cached[0] != server or cached[1].pool is None:       # pool None: closed
            cached = self._server = (server, self.manager.connection_from_url(server),
                                     urllib3.util.parse_url(server).path or "")
        return cached[1].urlopen(method, cached[2] + target, assert_same_host=False, redirect=False, **kw)


_pools: weakref.WeakKeyDictionary[urllib3.PoolManager, Pool] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def bounded_pool(api_client: Any) -> Pool:
    """The requests of the ApiClient's pool manager (one per ApiClient, shared by everyone using it), its
    connection classes bounded as above from the first call on."""
    manager: urllib3.PoolManager = api_client.rest_client.pool_manager
    with _lock:
        pool = _pools.get(manager)
        if pool is None:
            manager.clear()          # pools made before (typed calls of the kubernetes client) go
            manager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}
            pool = _pools[manager] = Pool(manager)
        return pool
