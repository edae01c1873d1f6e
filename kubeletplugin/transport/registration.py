"""The kubelet plugin-registration service (``pluginregistration.Registration`` v1).

The kubelet's plugin watcher finds our socket in its registry directory, calls GetInfo (with a 1 s
deadline, so the answer is precomputed), validates and registers the DRA endpoint, then reports the
outcome with NotifyRegistrationStatus. A rejection is logged and kept; we keep serving because the kubelet
retries registration with back-off, starting again from GetInfo.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc

from api.generated.pluginregistration.v1 import api_pb2 as reg_pb
from api.generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from kubeletplugin.transport.grpcserver import UnixGrpcServer

PLUGIN_TYPE = "DRAPlugin"

# What the kubelet matches in PluginInfo.supported_versions: short "<proto package>.<Service>" names.
# The DRA node service is listed newest first because 1.34+ kubelets pick the first entry they know.
DRA_V1_SERVICE = "v1.DRAPlugin"
DRA_V1BETA1_SERVICE = "v1beta1.DRAPlugin"
HEALTH_V1_SERVICE = "v1.DRAResourceHealth"
HEALTH_V1ALPHA1_SERVICE = "v1alpha1.DRAResourceHealth"


def supported_services(dra_v1: bool = True, dra_v1beta1: bool = True, health: bool = True) -> list[str]:
    services = []
    if dra_v1:
        services.append(DRA_V1_SERVICE)
    if dra_v1beta1:
        services.append(DRA_V1BETA1_SERVICE)
    if health:
        services += [HEALTH_V1_SERVICE, HEALTH_V1ALPHA1_SERVICE]
    return services


class RegistrationState:
    """What the kubelet last told us about our registration."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registered = threading.Event()
        self.last_error = ""
        self.notifications = 0

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    def wait_registered(self, timeout: float | None = None) -> bool:
        return self._registered.wait(timeout)

    def record(self, registered: bool, error: str) -> None:
        with self._lock:
            self.notifications += 1
            self.last_error = error
            if registered:
                self._registered.set()
            else:
                self._registered.clear()


class RegistrationServicer(reg_grpc.RegistrationServicer):
    def __init__(self, driver_name: str, endpoint: Path, services: Sequence[str], state: RegistrationState,
                 on_status: Callable[[bool, str], None] | None = None, log: Any = None):
        self._info = reg_pb.PluginInfo(type=PLUGIN_TYPE, name=driver_name, endpoint=str(endpoint),
                                       supported_versions=list(services))
        self._state = state
        self.on_status = on_status
        self._log_given = log

    @property
    def _log(self) -> Any:
        if self._log_given is None:
            import structlog  # not at import time: answering GetInfo must not wait for it

            self._log_given = structlog.get_logger("registration")
        return self._log_given

    def GetInfo(self, request: reg_pb.InfoRequest, context: grpc.ServicerContext) -> reg_pb.PluginInfo:
        return self._info

    def NotifyRegistrationStatus(self, request: reg_pb.RegistrationStatus,
                                 context: grpc.ServicerContext) -> reg_pb.RegistrationStatusResponse:
        self._state.record(request.plugin_registered, request.error)
        if request.plugin_registered:
            self._log.info("registered with the kubelet", endpoint=self._info.endpoint,
                           services=list(self._info.supported_versions))
        else:
            # The kubelet retries with back-off; stay up so the next attempt can succeed.
            self._log.error("kubelet rejected the registration", error=request.error,
                            endpoint=self._info.endpoint)
        if self.on_status is not None:
            try:
                self.on_status(request.plugin_registered, request.error)
            except Exception:  # noqa: BLE001 - a callback bug must not turn into a kubelet-visible failure
                self._log.exception("registration status callback failed")
        return reg_pb.RegistrationStatusResponse()


class RegistrationServer:
    """Serves the registration service on ``<registry dir>/<driver>-reg.sock`` (see kubeletplugin.transport.sockets).

    Start it only after the DRA socket listens: the kubelet dials the endpoint as soon as it registers. With
    ``server`` (the DRA server's), the socket is one more of that server: it listens when that server starts, in
    the order the sockets were added, and ``stop`` removes only this socket."""

    def __init__(self, driver_name: str, socket_path: Path, endpoint: Path, services: Sequence[str],
                 on_status: Callable[[bool, str], None] | None = None, log: Any = None,
                 server: UnixGrpcServer | None = None):
        self.state = RegistrationState()
        self.servicer = RegistrationServicer(driver_name, endpoint, services, self.state, on_status, log)
        self.path = Path(socket_path)

        def register(grpc_server: grpc.Server) -> None:
            reg_grpc.add_RegistrationServicer_to_server(self.servicer, grpc_server)

        self._shared = server is not None
        if server is None:
            self._server = UnixGrpcServer(self.path, register, max_workers=2, name="registration")
        else:
            self._server = server
            server.add(self.path, register)

    @property
    def socket_path(self) -> Path:
        return self.path

    @property
    def running(self) -> bool:
        return self._server.serves(self.path)

    def start(self) -> None:
        if not self._shared:
            self._server.start()
        elif not self._server.running:
            raise RuntimeError(f"registration socket {self.path} is served by a server that has not started")

    def stop(self, grace: float | None = 1.0) -> None:
        if self._shared:
            self._server.close_socket(self.path)
        else:
            self._server.stop(grace)


def get_info(path: Path, timeout: float) -> reg_pb.PluginInfo:
    """Asks the registration socket at ``path`` for GetInfo as the kubelet does (the plugin's /livez probe of its
    own socket); grpc.RpcError when there is no answer within ``timeout`` seconds. A channel per probe, so that
    the probe dials the path itself: a socket file that is gone fails the probe, as it fails the kubelet."""
    with grpc.insecure_channel(f"unix:{path}") as channel:
        info: reg_pb.PluginInfo = reg_grpc.RegistrationStub(channel).GetInfo(reg_pb.InfoRequest(), timeout=timeout)
    return info
