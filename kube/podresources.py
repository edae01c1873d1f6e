"""Client of the kubelet's PodResources API (v1): which containers hold which devices of which ResourceClaims.

The kubelet serves it on ``<kubelet root dir>/pod-resources/kubelet.sock`` (``/var/lib/kubelet/...`` on most
nodes). ``List`` answers, per pod and container, each ResourceClaim the container uses and the claim's devices
(driver, pool, device name). Only running pods are listed, so a prepared claim whose pod has not started yet is
not in the answer. Pods and containers are named by namespace and name only (no pod UID, no container ID): a
host process's cgroup (``dra.node.containers``) names its pod by UID, which the claims' ``status.reservedFor``
ties to the name (``kubeletplugin.claimmetrics``).

The client calls through ``call``, a unary gRPC call of the caller's (the kubelet plugin passes its transport's,
so that its process never loads grpcio).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from api.generated.podresources.v1 import api_pb2 as pb

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
TIMEOUT_S = 5.0
LIST = f"/{pb.DESCRIPTOR.services_by_name['PodResourcesLister'].full_name}/List"

# (socket path, method path, request, response message class, timeout in seconds) -> response; raises on failure.
UnaryCall = Callable[[Path, str, Any, Any, float], Any]


class PodResourcesError(RuntimeError):
    """The kubelet's PodResources socket could not be read; the message names it and why."""


@dataclass(frozen=True)
class ContainerDevice:
    """One device of one ResourceClaim used by one container."""

    namespace: str              # the pod's
    pod: str
    container: str
    claim_namespace: str
    claim_name: str
    driver: str
    pool: str
    device: str


def container_devices(response: pb.ListPodResourcesResponse, driver: str) -> list[ContainerDevice]:
    """The answer flattened to one row per container and device of `driver`."""
    out = []
    for pod in response.pod_resources:
        for container in pod.containers:
            for claim in container.dynamic_resources:
                for res in claim.claim_resources:
                    if res.driver_name == driver:
                        out.append(ContainerDevice(pod.namespace, pod.name, container.name,
                                                   claim.claim_namespace or pod.namespace, claim.claim_name,
                                                   res.driver_name, res.pool_name, res.device_name))
    return out


class PodResourcesClient:
    """A ``List`` call per ``list``: nothing is kept between calls, so a restarted kubelet is simply dialled again."""

    def __init__(self, socket_path: Path | str = DEFAULT_SOCKET, timeout: float = TIMEOUT_S, *,
                 call: UnaryCall) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self._call = call

    def list(self, driver: str) -> list[ContainerDevice]:
        try:
            response = self._call(self.socket_path, LIST, pb.ListPodResourcesRequest(),
                                  pb.ListPodResourcesResponse, self.timeout)
        except Exception as err:   # noqa: BLE001 - the caller's call raises its own error type
            raise PodResourcesError(f"PodResources List on {self.socket_path} failed: {err}") from None
        return container_devices(response, driver)
