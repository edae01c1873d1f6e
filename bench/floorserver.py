"""A bare gRPC server, the floor of the plugin's start-up and idle memory (``plugin.startup.floor_s``,
``plugin.idle.rss_floor_mib``): ``python -m bench.floorserver <socket path>`` serves Registration.GetInfo on
that unix socket until SIGTERM.

It imports grpc and the generated registration stubs and nothing else of the project (``bench/__init__``
imports no benchmark), so it holds what any Python plugin answering the kubelet's GetInfo must.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from concurrent import futures

import grpc

from api.generated.pluginregistration.v1 import api_pb2 as reg_pb
from api.generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, info: reg_pb.PluginInfo) -> None:
        self._info = info

    def GetInfo(self, request: reg_pb.InfoRequest, context: grpc.ServicerContext) -> reg_pb.PluginInfo:  # noqa: N802 - gRPC name
        return self._info


def serve(path: str) -> None:
    """grpcio's synchronous server with a small pool (the plugin's kind of server,
    kubeletplugin.transport.grpcserver), with nothing else around it: what a Python plugin on grpcio holds and
    spends."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)   # left by a killed run
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    info = reg_pb.PluginInfo(type="DRAPlugin", name="floor.bench", endpoint=path,
                             supported_versions=["v1.DRAPlugin"])
    reg_grpc.add_RegistrationServicer_to_server(_Registration(info), server)
    if server.add_insecure_port(f"unix:{path}") == 0:
        raise SystemExit(f"cannot listen on unix socket {path}")
    server.start()
    signal.sigwait({signal.SIGTERM})           # blocked in every thread below: no polling, no handler
    server.stop(None)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m bench.floorserver <socket path>")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})   # before grpc starts its threads, which inherit it
    serve(sys.argv[1])
