"""gRPC servers bound to one unix socket each: stale socket cleared first, permissions tightened after bind,
socket removed on stop.

Every server of the process runs on one asyncio event loop in one thread (``grpc.aio``). The synchronous
server would poll its completion queue every 200 ms per server, so an idle plugin woke ten times a second; the
asyncio server waits on its completion queue without a timeout and an idle plugin's servers use no CPU.
Handlers written as plain functions run in the server's thread pool (so a slow prepare never blocks the loop);
streams that wait for events are coroutines (kubeletplugin.transport.server).
"""
from __future__ import annotations

import asyncio
import atexit
import threading
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Coroutine, TypeVar

import grpc

from kubeletplugin.transport.sockets import prepare_socket_path, remove_socket, restrict_socket

T = TypeVar("T")

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def server_loop() -> asyncio.AbstractEventLoop:
    """The event loop of this process's gRPC servers, started on first use in a daemon thread ("grpc-loop")."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="grpc-loop", daemon=True)
            thread.start()
            # gRPC's asyncio state (one completion queue, whose descriptor this loop reads) is counted by its
            # servers and shut down by whichever thread drops the last one: under the running loop, that closed
            # the descriptor the loop was reading ("Bad file descriptor" at exit). A reference of our own keeps it
            # for the loop's lifetime; it is given back on the loop's own thread when the process exits.
            asyncio.run_coroutine_threadsafe(_take_grpc(), loop).result()
            atexit.register(_stop_loop, loop, thread)
            _loop = loop
        return _loop


async def _take_grpc() -> None:
    grpc.aio.init_grpc_aio()      # on the loop's thread: the completion queue binds to the running loop


async def _give_back_grpc() -> None:
    grpc.aio.shutdown_grpc_aio()


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    asyncio.run_coroutine_threadsafe(_give_back_grpc(), loop).result(timeout=5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)


def on_loop(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the server loop and wait for its result (from any thread but the loop's own)."""
    return asyncio.run_coroutine_threadsafe(coro, server_loop()).result(timeout)


class UnixGrpcServer:
    def __init__(self, path: Path, register: Callable[[grpc.aio.Server], None], max_workers: int = 8,
                 name: str = "grpc"):
        self.path = Path(path)
        self._register = register
        self._max_workers = max_workers
        self._name = name
        self._server: grpc.aio.Server | None = None
        self._pool: futures.ThreadPoolExecutor | None = None

    async def _start(self, pool: futures.ThreadPoolExecutor) -> grpc.aio.Server:
        server = grpc.aio.server(migration_thread_pool=pool)
        self._register(server)
        # "unix:<path>", not "unix://<path>": gRPC refuses the URI form two bytes before the AF_UNIX limit.
        if server.add_insecure_port(f"unix:{self.path}") == 0:
            raise OSError(f"cannot listen on unix socket {self.path}")
        await server.start()
        return server

    def start(self) -> None:
        prepare_socket_path(self.path)
        pool = futures.ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix=self._name)
        try:
            server = on_loop(self._start(pool))
        except BaseException:
            pool.shutdown(wait=False)
            raise
        restrict_socket(self.path)
        self._server, self._pool = server, pool

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving and remove the socket (so the kubelet sees the plugin go away)."""
        server, self._server = self._server, None
        pool, self._pool = self._pool, None
        if server is not None:
            on_loop(server.stop(grace))
        if pool is not None:
            pool.shutdown(wait=False)
        remove_socket(self.path)

    @property
    def running(self) -> bool:
        return self._server is not None
