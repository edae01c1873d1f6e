"""A grpcio server on one unix socket: stale socket cleared first, permissions tightened after bind, socket
removed on stop, and the limits a privileged daemon sets for its peers.

grpcio's synchronous server: its C core reads the connections (no thread per connection), calls run on a
bounded pool. That pool's threads are all started before the socket listens, so a call never needs a new thread:
grpcio's serving loop dies when its pool cannot start one (the process at its thread limit), and the socket would
then queue the kubelet's calls for ever. Calls past ``max_concurrent_rpcs`` are answered RESOURCE_EXHAUSTED at once
(the kubelet retries), so the pool's queue is bounded too.
"""
from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import grpc

from kubeletplugin.transport.sockets import prepare_socket_path, remove_socket, restrict_socket

MIB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """What one server accepts from its peers. The defaults suit the kubelet: small calls, one client."""

    max_message: int = 4 * MIB                # each way; grpcio's (and the kubelet's) default receive limit
    max_concurrent_streams: int = 32          # per connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS)
    max_metadata: int = 16 * 1024             # a call's header list
    # A connection without calls for this long is closed (GOAWAY): idle clients cannot pile up. The kubelet's
    # connection carries its health stream, so it is never idle; its DRA calls reconnect on their own.
    max_connection_idle_ms: int = 5 * 60 * 1000
    # The server pings each connection after this much silence and closes it when no answer comes within the
    # timeout: a peer that stopped reading releases the calls it holds.
    keepalive_time_ms: int = 60 * 1000
    keepalive_timeout_ms: int = 20 * 1000
    # Keepalive enforcement: a client pinging more often than this (or without calls) is sent GOAWAY after two
    # strikes (grpcio's rule), so pings cannot keep the server busy.
    min_client_ping_interval_ms: int = 5 * 60 * 1000

    def options(self) -> list[tuple[str, Any]]:
        # No grpc.max_connection_age_ms: it would end the kubelet's health stream on a timer.
        return [
            ("grpc.max_receive_message_length", self.max_message),
            ("grpc.max_send_message_length", self.max_message),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.max_metadata_size", self.max_metadata),
            ("grpc.max_connection_idle_ms", self.max_connection_idle_ms),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_client_ping_interval_ms),
            ("grpc.http2.max_ping_strikes", 2),
        ]


class StartedPool(futures.ThreadPoolExecutor):
    """A thread pool whose ``max_workers`` threads are started at once, so that a later ``submit`` never starts
    one (and so cannot fail with "can't start new thread")."""

    def __init__(self, max_workers: int, thread_name_prefix: str):
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        started = threading.Barrier(max_workers + 1)
        for _ in range(max_workers):
            self.submit(started.wait)       # each waits for the others: the pool starts a thread per task
        started.wait()

    @property
    def threads(self) -> int:
        return len(self._threads)


class UnixGrpcServer:
    """One grpcio server on one or more unix sockets (``add`` each before ``start``; ``register(server)`` adds
    the services, with the generated ``add_*Servicer_to_server``). The plugin serves both of its sockets from one
    server: each server's serving thread wakes five times a second, so two would double what an idle plugin
    costs."""

    def __init__(self, path: Path | None = None, register: Callable[[grpc.Server], None] | None = None,
                 max_workers: int = 8, name: str = "grpc", max_concurrent_rpcs: int | None = None,
                 limits: Limits = Limits()):
        self._sockets: list[Path] = []
        self._registers: list[Callable[[grpc.Server], None]] = []
        self._closed: set[Path] = set()
        self._max_workers = max_workers
        # Room for every pod of a busy node to start at once (the kubelet calls once per pod), not for floods.
        self._max_concurrent_rpcs = max_concurrent_rpcs or 16 * max_workers
        self._name = name
        self._limits = limits
        self._server: grpc.Server | None = None
        self._pool: StartedPool | None = None
        if path is not None:
            self.add(path, register or (lambda _server: None))

    def add(self, path: Path, register: Callable[[grpc.Server], None]) -> None:
        """One more socket, and the services to serve (on every socket of this server)."""
        if self._server is not None:
            raise RuntimeError(f"{self._name}: sockets are added before the server starts")
        self._sockets.append(Path(path))
        self._registers.append(register)

    @property
    def path(self) -> Path:
        return self._sockets[0]

    def start(self) -> None:
        """Listens on every socket, in the order they were added."""
        for path in self._sockets:
            prepare_socket_path(path)
        pool = StartedPool(self._max_workers, self._name)
        server = grpc.server(pool, options=self._limits.options(), maximum_concurrent_rpcs=self._max_concurrent_rpcs)
        try:
            for register in self._registers:
                register(server)
            for path in self._sockets:
                # "unix:<path>", not "unix://<path>": gRPC refuses the URI form two bytes before the AF_UNIX limit.
                if server.add_insecure_port(f"unix:{path}") == 0:
                    raise OSError(f"cannot listen on unix socket {path}")
            server.start()
        except BaseException:
            server.stop(None)
            pool.shutdown(wait=False)
            for path in self._sockets:
                remove_socket(path)
            raise
        for path in self._sockets:
            restrict_socket(path)
        self._server, self._pool = server, pool
        self._closed.clear()

    def close_socket(self, path: Path) -> None:
        """Removes one socket while the others are served: the kubelet sees it go (its registry watch), and no
        one can dial it again."""
        self._closed.add(Path(path))
        remove_socket(Path(path))

    def serves(self, path: Path) -> bool:
        return self._server is not None and Path(path) in self._sockets and Path(path) not in self._closed

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving and remove the sockets (so the kubelet sees the plugin go away). Calls in progress get
        up to ``grace`` seconds to finish; then they are cancelled."""
        server, self._server = self._server, None
        pool, self._pool = self._pool, None
        if server is not None:
            server.stop(grace).wait(None if grace is None else grace + 5)
        if pool is not None:
            pool.shutdown(wait=False)
        for path in self._sockets:
            remove_socket(path)

    @property
    def running(self) -> bool:
        return self._server is not None
