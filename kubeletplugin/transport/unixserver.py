"""gRPC servers bound to one unix socket each: stale socket cleared first, permissions tightened after bind,
socket removed on stop.

Blocking sockets and threads: one thread accepts, one thread per connection reads its frames
(kubeletplugin.transport.http2), unary calls run in the server's thread pool and each server stream in a thread
of its own (kubeletplugin.transport.rpc). Every thread sleeps in a system call until something arrives, so an
idle plugin's servers use no CPU and wake no one; ``stop`` shuts the sockets down, which ends those calls.
"""
from __future__ import annotations

import socket
import threading
from concurrent import futures
from pathlib import Path
from typing import Mapping

from kubeletplugin.transport.http2 import Limits, ServerConnection
from kubeletplugin.transport.rpc import Dispatcher, Method
from kubeletplugin.transport.sockets import prepare_socket_path, remove_socket, restrict_socket

LISTEN_BACKLOG = 16


class UnixGrpcServer:
    def __init__(self, path: Path, methods: Mapping[str, Method], max_workers: int = 8, name: str = "grpc",
                 limits: Limits = Limits()):
        self.path = Path(path)
        self._methods = dict(methods)
        self._max_workers = max_workers
        self._name = name
        self._limits = limits
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._pool: futures.ThreadPoolExecutor | None = None
        self._connections: dict[ServerConnection, threading.Thread] = {}

    def start(self) -> None:
        prepare_socket_path(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            listener.listen(LISTEN_BACKLOG)
        except OSError as err:
            listener.close()
            raise OSError(f"cannot listen on unix socket {self.path}: {err}") from err
        restrict_socket(self.path)
        pool = futures.ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix=self._name)
        dispatcher = Dispatcher(self._methods, pool, self._name)
        accepter = threading.Thread(target=self._accept, args=(listener, dispatcher), name=f"{self._name}-accept",
                                    daemon=True)
        self._listener, self._pool, self._accepter = listener, pool, accepter
        accepter.start()

    def _accept(self, listener: socket.socket, dispatcher: Dispatcher) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return                                      # stop() shut the listener down
            conn = ServerConnection(sock, dispatcher, self._limits)
            thread = threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-conn", daemon=True)
            with self._lock:
                if self._listener is None:                  # stopping: this one came too late
                    sock.close()
                    return
                self._connections[conn] = thread
            thread.start()

    def _serve(self, conn: ServerConnection) -> None:
        try:
            conn.serve()
        finally:
            with self._lock:
                self._connections.pop(conn, None)

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving and remove the socket (so the kubelet sees the plugin go away). Calls in progress get
        up to ``grace`` seconds to finish; then every connection is closed."""
        with self._lock:
            listener, self._listener = self._listener, None
            connections = dict(self._connections)
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)         # wakes accept()
            except OSError:
                pass
            listener.close()
            if self._accepter is not None:
                self._accepter.join(timeout=5)
        for conn in connections:
            conn.shutdown()
        for conn, thread in connections.items():
            thread.join(timeout=grace or 0)
            conn.close()
            thread.join(timeout=5)
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
        remove_socket(self.path)

    @property
    def running(self) -> bool:
        return self._listener is not None
