"""This node's pods by container ID, read from the API server.

A host process's cgroup names its pod's UID and its container's ID (``dra.node.containers``); the pod's
``status.containerStatuses[].containerID`` (``containerd://<id>``) names the container. One list of the
node's pods (field selector ``spec.nodeName``) answers for all of them; it is read again only when a
container turns up that the last list did not have, and then at most every ``min_interval`` seconds, so a
process that belongs to no pod (a host program, a container the kubelet did not start) costs one list per
interval at most.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from kube.client import KubeApi


@dataclass(frozen=True)
class PodContainer:
    namespace: str
    pod: str
    pod_uid: str
    container: str


def containers_by_id(pods: list[dict[str, Any]]) -> dict[str, PodContainer]:
    """Container ID (without the runtime prefix) → the pod and container name, for every started container."""
    out = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
            for cs in status.get(key) or []:
                cid = str(cs.get("containerID") or "").partition("://")[2]
                if cid:
                    out[cid] = PodContainer(str(meta.get("namespace", "")), str(meta.get("name", "")),
                                            str(meta.get("uid", "")), str(cs.get("name", "")))
    return out


class NodePods:
    def __init__(self, api_client: Any, node_name: str, *, min_interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._kube = KubeApi(api_client, timeout=10.0)
        self.node_name = node_name
        self.min_interval = min_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: dict[str, PodContainer] = {}
        self._listed_at: float | None = None

    def container(self, container_id: str) -> PodContainer | None:
        """The pod container with this ID; ApiError/ApiUnavailable when the list that was due failed."""
        with self._lock:
            found = self._by_id.get(container_id)
            due = self._listed_at is None or self._clock() - self._listed_at >= self.min_interval
            if found is None and due:
                self._listed_at = self._clock()
                pods = self._kube.list("/api/v1/pods", field_selector=f"spec.nodeName={self.node_name}")["items"]
                self._by_id = containers_by_id(pods)
                found = self._by_id.get(container_id)
            return found
