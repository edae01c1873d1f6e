"""Client of the kubelet's PodResources API (v1): which containers hold which devices of which ResourceClaims.

The kubelet serves it on ``<kubelet root dir>/pod-resources/kubelet.sock`` (``/var/lib/kubelet/...`` on most
nodes). ``List`` answers, per pod and container, each ResourceClaim the container uses and the claim's devices
(driver, pool, device name). Only running pods are listed, so a prepared claim whose pod has not started yet is
not in the answer. Pods and containers are named by namespace and name only (no pod UID, no container ID): a
host process's cgroup (``dra.node.containers``) names its pod by UID, which the claims' ``status.reservedFor``
ties to the name (``kubeletplugin.claimmetrics``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from api.generated.podresources.v1 import api_pb2 as pb
from api.generated.podresources.v1 import api_pb2_grpc as pb_grpc

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
MAX_MESSAGE = 16 << 20          # every pod of a node; the kubelet's own limit is the same
TIMEOUT_S = 5.0


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
    """One channel to the socket, kept: gRPC dials the path again after the kubelet restarts."""

    def __init__(self, socket_path: Path | str = DEFAULT_SOCKET, timeout: float = TIMEOUT_S) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self._channel = grpc.insecure_channel(f"unix://{self.socket_path}", options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE)])
        self._stub = pb_grpc.PodResourcesListerStub(self._channel)

    def list(self, driver: str) -> list[ContainerDevice]:
        try:
            response = self._stub.List(pb.ListPodResourcesRequest(), timeout=self.timeout)
        except grpc.RpcError as err:
            detail = err.details() if hasattr(err, "details") else str(err)
            raise PodResourcesError(f"PodResources List on {self.socket_path} failed: {err.code().name}: "
                                    f"{detail}") from None
        return container_devices(response, driver)

    def close(self) -> None:
        self._channel.close()
