"""The DRA node service on the plugin's socket: ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` and
``…v1beta1.DRAPlugin`` (one handler; the versions differ only in v1's ``Device.share_id``), plus the
``DRAResourceHealth`` stream in ``v1`` and ``v1alpha1``.

Everything runs on the server's bounded pool (kubeletplugin.transport.grpcserver): prepare and unprepare as plain
functions, a health stream as a blocking generator that sleeps between changes. Health streams are capped
(``MAX_HEALTH_STREAMS``), so the pool always keeps workers for prepares, and a call whose client has gone is not
handed to the driver.

Per-claim failures travel in the response's ``error`` field; a gRPC error is reserved for a call that
could not be handled at all (the kubelet then retries the whole pod). The time a call arrived goes to the
driver with its claims: the driver's budget for the call counts from then, not from when the claims reach it.

The server can listen before the driver exists (``attach`` supplies it): the plugin registers with the
kubelet within a fraction of a second of starting, and a call that comes before the driver is ready waits for
it (or fails its claims with an error the kubelet retries). Only grpc, the generated stubs and the transport's
own modules are imported on that path.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterator

import grpc

from api.generated.dra.v1 import api_pb2 as v1_pb
from api.generated.dra.v1 import api_pb2_grpc as v1_grpc
from api.generated.dra.v1beta1 import api_pb2 as v1beta1_pb
from api.generated.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from api.generated.dra_health.v1 import api_pb2 as health_v1_pb
from api.generated.dra_health.v1 import api_pb2_grpc as health_v1_grpc
from api.generated.dra_health.v1alpha1 import api_pb2 as health_v1alpha1_pb
from api.generated.dra_health.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from kubeletplugin.transport.grpcserver import UnixGrpcServer
from kubeletplugin.transport.health import MAX_MESSAGE, HealthBoard

if TYPE_CHECKING:
    from kubeletplugin.transport.nodedriver import ClaimRef, NodeDriver, RequestMetrics

# How long a call that arrives while the plugin starts waits for its driver before its claims fail (the
# kubelet's own deadline is 45 s).
READY_WAIT_S = 30.0
# The kubelet holds one health stream; a few more cover a restarted kubelet whose old stream has not ended yet.
# Each holds a pool thread for its lifetime, so the cap keeps the rest of the pool for prepares.
MAX_HEALTH_STREAMS = 4


def _claim_types() -> ModuleType:
    """kubeletplugin.transport.nodedriver, loaded at the first call instead of at start: its dataclasses and
    name checks are not needed to answer GetInfo, and by the first call the plugin has loaded it anyway."""
    from kubeletplugin.transport import nodedriver

    return nodedriver


def _logger(name: str) -> Any:
    import structlog  # not at import time: it is not needed to answer the kubelet's first calls

    return structlog.get_logger(name)


class DRAService:
    """Converts between the DRA messages of one API version and the driver's version-free calls."""

    def __init__(self, driver: NodeDriver | None, metrics: RequestMetrics | None = None, log: Any = None):
        self.driver = driver
        self.metrics = metrics
        self._log = log
        self._ready = threading.Event()
        if driver is not None:
            self._ready.set()

    @property
    def log(self) -> Any:
        if self._log is None:
            self._log = _logger("dra-service")
        return self._log

    def attach(self, driver: NodeDriver, metrics: RequestMetrics | None = None, log: Any = None) -> None:
        """The driver is ready: calls waiting for it go on."""
        self.driver, self.metrics, self._log = driver, metrics, log or self._log
        self._ready.set()

    def _driver(self) -> NodeDriver | None:
        return self.driver if self._ready.wait(READY_WAIT_S) else None

    @staticmethod
    def _claims(request: Any) -> list[ClaimRef]:
        ref = _claim_types().ClaimRef
        return [ref(namespace=c.namespace, uid=c.uid, name=c.name) for c in request.claims]

    def _check(self, claims: list[ClaimRef], context: grpc.ServicerContext) -> tuple[list[ClaimRef], dict[str, str]]:
        """(claims to hand to the driver, errors of claims that are not). A claim without UID cannot even be
        answered (answers are keyed by UID): that fails the call. Any other bad name fails its claim only,
        before it reaches an API path or a file name."""
        valid: list[ClaimRef] = []
        seen: set[str] = set()           # a call may hold thousands of claims: no scan of ``valid`` per claim
        errors: dict[str, str] = {}
        claim_ref_problem = _claim_types().claim_ref_problem
        for c in claims:
            if not c.uid:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"claim {c.namespace!r}/{c.name!r}: uid is required")
            problem = claim_ref_problem(c)
            if problem:
                errors[c.uid] = problem
            elif c.uid not in errors and c.uid not in seen:
                seen.add(c.uid)
                valid.append(c)
        return valid, errors

    def prepare(self, pb: ModuleType, version: str, request: Any, context: grpc.ServicerContext) -> Any:
        arrived = time.monotonic()
        claims = self._claims(request)
        if self.metrics:
            self.metrics.requests.labels(method="NodePrepareResources", version=version).inc()
        valid, errors = self._check(claims, context)
        driver = self._driver() if valid else None
        if not context.is_active():
            return pb.NodePrepareResourcesResponse()     # the kubelet cancelled the call or went away: no work for nobody
        if valid and driver is None:
            results = {c.uid: _claim_types().PrepareResult(error="the plugin is still starting; the kubelet retries")
                       for c in valid}
        else:
            results = driver.prepare(valid, arrived=arrived) if driver is not None else {}
        response = pb.NodePrepareResourcesResponse()
        with_share_id = version == "v1"
        for claim in claims:
            result = results.get(claim.uid)
            entry = response.claims[claim.uid]
            if claim.uid in errors:
                entry.error = errors[claim.uid]
                continue
            if result is None:
                entry.error = "internal error: driver returned no result for this claim"
                continue
            if result.error:
                entry.error = result.error
                continue
            del entry.devices[:]
            for d in result.devices:
                dev = entry.devices.add(request_names=list(d.request_names), pool_name=d.pool_name,
                                        device_name=d.device_name, cdi_device_ids=list(d.cdi_device_ids))
                if with_share_id and d.share_id:
                    dev.share_id = d.share_id
        return response

    def unprepare(self, pb: ModuleType, version: str, request: Any, context: grpc.ServicerContext) -> Any:
        arrived = time.monotonic()
        claims = self._claims(request)
        if self.metrics:
            self.metrics.requests.labels(method="NodeUnprepareResources", version=version).inc()
        valid, errors = self._check(claims, context)
        driver = self._driver() if valid else None
        if not context.is_active():
            return pb.NodeUnprepareResourcesResponse()     # the kubelet cancelled the call or went away: no work for nobody
        if valid and driver is None:
            results = {c.uid: _claim_types().UnprepareResult(error="the plugin is still starting; the kubelet retries")
                       for c in valid}
        else:
            results = driver.unprepare(valid, arrived=arrived) if driver is not None else {}
        response = pb.NodeUnprepareResourcesResponse()
        for claim in claims:
            result = results.get(claim.uid)
            entry = response.claims[claim.uid]
            if claim.uid in errors:
                entry.error = errors[claim.uid]
            elif result is None:
                entry.error = "internal error: driver returned no result for this claim"
            elif result.error:
                entry.error = result.error
        return response


class DRAPluginV1(v1_grpc.DRAPluginServicer):
    def __init__(self, service: DRAService):
        self._s = service

    def NodePrepareResources(self, request: v1_pb.NodePrepareResourcesRequest,
                             context: grpc.ServicerContext) -> Any:
        return self._s.prepare(v1_pb, "v1", request, context)

    def NodeUnprepareResources(self, request: v1_pb.NodeUnprepareResourcesRequest,
                               context: grpc.ServicerContext) -> Any:
        return self._s.unprepare(v1_pb, "v1", request, context)


class DRAPluginV1beta1(v1beta1_grpc.DRAPluginServicer):
    def __init__(self, service: DRAService):
        self._s = service

    def NodePrepareResources(self, request: v1beta1_pb.NodePrepareResourcesRequest,
                             context: grpc.ServicerContext) -> Any:
        return self._s.prepare(v1beta1_pb, "v1beta1", request, context)

    def NodeUnprepareResources(self, request: v1beta1_pb.NodeUnprepareResourcesRequest,
                               context: grpc.ServicerContext) -> Any:
        return self._s.unprepare(v1beta1_pb, "v1beta1", request, context)


_HEALTH_ENUM = {"Healthy": "HEALTHY", "Unhealthy": "UNHEALTHY", "Unknown": "UNKNOWN"}


class HealthStreams:
    """The health streams served at once, at most ``MAX_HEALTH_STREAMS``; one more is answered
    RESOURCE_EXHAUSTED."""

    def __init__(self, board: HealthBoard, limit: int = MAX_HEALTH_STREAMS):
        self.board = board
        self._slots = threading.BoundedSemaphore(limit)
        self._limit = limit

    def serve(self, pb: ModuleType, context: grpc.ServicerContext) -> Iterator[Any]:
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"already serving {self._limit} health streams; retry once one has ended")
        try:
            yield from _health_stream(self.board, pb, context)
        finally:
            self._slots.release()


def _health_stream(board: HealthBoard, pb: ModuleType, context: grpc.ServicerContext) -> Iterator[Any]:
    stop = threading.Event()

    def cancelled() -> None:              # the kubelet went away (or the call ended): end this watch
        stop.set()
        board.wake()

    if not context.add_callback(cancelled):
        return                            # the call is over already
    for devices in board.watch(stop):     # ends when the board closes or the call is cancelled
        msg = pb.NodeWatchResourcesResponse()
        for d in devices:
            msg.devices.add(device=pb.DeviceIdentifier(pool_name=d.pool, device_name=d.device),
                            health=pb.HealthStatus.Value(_HEALTH_ENUM[d.status]),
                            last_updated_time=int(d.updated or time.time()),
                            health_check_timeout_seconds=board.timeout_seconds,
                            message=d.message[:MAX_MESSAGE])
        yield msg


class ResourceHealthV1(health_v1_grpc.DRAResourceHealthServicer):
    def __init__(self, streams: HealthStreams):
        self._streams = streams

    def NodeWatchResources(self, request: health_v1_pb.NodeWatchResourcesRequest,
                           context: grpc.ServicerContext) -> Iterator[Any]:
        return self._streams.serve(health_v1_pb, context)


class ResourceHealthV1alpha1(health_v1alpha1_grpc.DRAResourceHealthServicer):
    def __init__(self, streams: HealthStreams):
        self._streams = streams

    def NodeWatchResources(self, request: health_v1alpha1_pb.NodeWatchResourcesRequest,
                           context: grpc.ServicerContext) -> Iterator[Any]:
        return self._streams.serve(health_v1alpha1_pb, context)


class DRAServer:
    """Serves the DRA services (and health, when a board is given) on the plugin's socket. ``driver`` None:
    calls wait for ``attach``."""

    def __init__(self, socket_path: Path, driver: NodeDriver | None, health: HealthBoard | None = None,
                 metrics: RequestMetrics | None = None, log: Any = None, max_workers: int = 16,
                 serve_v1: bool = True, serve_v1beta1: bool = True):
        self.service = DRAService(driver, metrics, log)
        self.health = health

        def register(server: grpc.Server) -> None:
            if serve_v1:
                v1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1(self.service), server)
            if serve_v1beta1:
                v1beta1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1beta1(self.service), server)
            if health is not None:
                streams = HealthStreams(health)
                health_v1_grpc.add_DRAResourceHealthServicer_to_server(ResourceHealthV1(streams), server)
                health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(ResourceHealthV1alpha1(streams), server)

        # Prepares, unprepares and health streams share the server's pool; the streams' cap leaves
        # max_workers - MAX_HEALTH_STREAMS workers for the calls at the least. The registration socket may join
        # this server (RegistrationServer's ``server``).
        self.server = self._server = UnixGrpcServer(socket_path, register, max_workers=max_workers, name="dra")

    def attach(self, driver: NodeDriver, metrics: RequestMetrics | None = None, log: Any = None) -> None:
        self.service.attach(driver, metrics, log)

    @property
    def socket_path(self) -> Path:
        return self._server.path

    @property
    def running(self) -> bool:
        return self._server.running

    def start(self) -> None:
        self._server.start()

    def stop(self, grace: float | None = 1.0) -> None:
        if self.health is not None:
            self.health.close()
        self._server.stop(grace)
