"""A client of one plugin's DRA endpoint that talks like the kubelet and checks answers like the kubelet."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from standin.rules import (
    AllocatedDevice,
    ClaimOutcome,
    ClaimRef,
    PreparedDevice,
    ProtocolViolation,
    check_prepare_response,
    check_unprepare_response,
)
from standin.stubs import DRA_SERVICES, HEALTH_SERVICES

# The kubelet's per-call timeout for Prepare/Unprepare ("half of the kubelet retry period").
DEFAULT_CALL_TIMEOUT = 45.0


class DraCallError(RuntimeError):
    """The gRPC call itself failed (any status code, timeouts included): the kubelet ignores the answer."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str):
        self.method = method
        self.code = code
        self.details = details
        super().__init__(f"{method} failed: {code.name}: {details}")


def unix_target(path: str) -> str:
    return "unix:" + path


@dataclass(frozen=True)
class HealthUpdate:
    """One NodeWatchResourcesResponse: (pool, device) -> (health name, message), with receive time."""

    received: float
    devices: dict[tuple[str, str], tuple[str, str]]


class DraClient:
    """Calls NodePrepareResources / NodeUnprepareResources on one endpoint through one service version."""

    def __init__(self, endpoint: str, service: str = "v1.DRAPlugin", *, call_timeout: float = DEFAULT_CALL_TIMEOUT):
        if service not in DRA_SERVICES:
            raise ValueError(f"unknown DRA service {service!r}; known: {', '.join(DRA_SERVICES)}")
        self.endpoint = endpoint
        self.service = service
        self.call_timeout = call_timeout
        self._messages, grpc_module = DRA_SERVICES[service]
        self._channel = grpc.insecure_channel(unix_target(endpoint))
        self._stub = grpc_module.DRAPluginStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _claims(self, claims: Sequence[ClaimRef]) -> list:
        return [self._messages.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]

    def _call(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, timeout=self.call_timeout)
        except grpc.RpcError as exc:  # a grpc.Call: code() and details() are available
            raise DraCallError(method, exc.code(), exc.details() or "") from exc

    def prepare(
        self,
        claims: Sequence[ClaimRef],
        allocations: Mapping[str, Sequence[AllocatedDevice]] | None = None,
    ) -> dict[str, ClaimOutcome]:
        """Prepare ``claims``; returns the outcome per claim UID.

        Raises DraCallError when the call fails and ProtocolViolation when the answer breaks a kubelet rule.
        ``allocations`` (claim UID -> this driver's allocation results) enables the device checks.
        """
        request = self._messages.NodePrepareResourcesRequest(claims=self._claims(claims))
        response = self._call("NodePrepareResources", request)
        by_uid = {c.uid: c for c in claims}
        with_share_id = "share_id" in self._messages.Device.DESCRIPTOR.fields_by_name
        outcomes: dict[str, ClaimOutcome] = {}
        for uid, answer in response.claims.items():
            devices = tuple(
                PreparedDevice(
                    request_names=tuple(d.request_names),
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=tuple(d.cdi_device_ids),
                    share_id=d.share_id if with_share_id and d.HasField("share_id") else None,
                )
                for d in answer.devices
            )
            claim = by_uid.get(uid, ClaimRef("", "", uid))
            outcomes[uid] = ClaimOutcome(claim=claim, devices=devices, error=answer.error)
        violations = check_prepare_response(claims, outcomes, allocations, with_share_id=with_share_id)
        if violations:
            raise ProtocolViolation("NodePrepareResources", violations)
        return outcomes

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Unprepare ``claims``; returns the error string per claim UID ("" = done)."""
        request = self._messages.NodeUnprepareResourcesRequest(claims=self._claims(claims))
        response = self._call("NodeUnprepareResources", request)
        violations = check_unprepare_response(claims, response.claims.keys())
        if violations:
            raise ProtocolViolation("NodeUnprepareResources", violations)
        return {uid: answer.error for uid, answer in response.claims.items()}

    def watch_health(self, service: str = "v1alpha1.DRAResourceHealth") -> HealthWatch:
        return HealthWatch(self._channel, service)


class HealthWatch:
    """Consumes the NodeWatchResources stream in a background thread and keeps every update."""

    def __init__(self, channel: grpc.Channel, service: str):
        if service not in HEALTH_SERVICES:
            raise ValueError(f"unknown health service {service!r}; known: {', '.join(HEALTH_SERVICES)}")
        messages, grpc_module = HEALTH_SERVICES[service]
        self.service = service
        self.updates: list[HealthUpdate] = []
        self.error: grpc.RpcError | None = None
        self._health_names = {v: k for k, v in messages.HealthStatus.items()}
        self._cond = threading.Condition()
        stub = grpc_module.DRAResourceHealthStub(channel)
        self._stream = stub.NodeWatchResources(messages.NodeWatchResourcesRequest())
        self._thread = threading.Thread(target=self._consume, name=f"health-{service}", daemon=True)
        self._thread.start()

    def _consume(self) -> None:
        try:
            for response in self._stream:
                update = HealthUpdate(
                    received=time.monotonic(),
                    devices={
                        (d.device.pool_name, d.device.device_name): (self._health_names[d.health], d.message)
                        for d in response.devices
                    },
                )
                with self._cond:
                    self.updates.append(update)
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            with self._cond:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    self.error = exc
                self._cond.notify_all()

    def wait_for(self, predicate: Callable[[HealthUpdate], bool], timeout: float = 10.0) -> HealthUpdate:
        """The first update (already received or arriving within ``timeout``) that satisfies ``predicate``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for update in self.updates:
                    if predicate(update):
                        return update
                if self.error is not None:
                    raise DraCallError("NodeWatchResources", self.error.code(), self.error.details() or "")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no health update matching the condition within {timeout}s ({len(self.updates)} received)")
                self._cond.wait(left)

    def close(self) -> None:
        self._stream.cancel()
        self._thread.join(timeout=5)

    def __enter__(self) -> HealthWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
