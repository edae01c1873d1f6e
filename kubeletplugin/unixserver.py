"""A grpc server bound to one unix socket: stale socket cleared first, permissions tightened after bind,
socket removed on stop."""
from __future__ import annotations

from concurrent import futures
from pathlib import Path
from typing import Callable

import grpc

from kubeletplugin.sockets import prepare_socket_path, remove_socket, restrict_socket


class UnixGrpcServer:
    def __init__(self, path: Path, register: Callable[[grpc.Server], None], max_workers: int = 8,
                 name: str = "grpc"):
        self.path = Path(path)
        self._register = register
        self._max_workers = max_workers
        self._name = name
        self._server: grpc.Server | None = None

    def start(self) -> None:
        prepare_socket_path(self.path)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self._max_workers,
                                                        thread_name_prefix=self._name))
        self._register(server)
        # "unix:<path>", not "unix://<path>": gRPC refuses the URI form two bytes before the AF_UNIX limit.
        if server.add_insecure_port(f"unix:{self.path}") == 0:
            raise OSError(f"cannot listen on unix socket {self.path}")
        server.start()
        restrict_socket(self.path)
        self._server = server

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving and remove the socket (so the kubelet sees the plugin go away)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace).wait()
        remove_socket(self.path)

    @property
    def running(self) -> bool:
        return self._server is not None
