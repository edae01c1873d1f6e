"""Which Kubernetes container a host process runs in, from its cgroup.

The container runtime puts every container's processes into a cgroup the kubelet names: the pod's UID in a
``pod<uid>`` segment and the container ID in the one below it. A process cannot leave its container's cgroup
(nor forge the path), so this, unlike its name, environment or command line, identifies it. Both layouts the
kubelet uses are read:

    cgroupfs:  .../kubepods/burstable/pod0b9f...-...-.../3f2a...(64 hex)
    systemd:   .../kubepods-burstable-pod0b9f..._..._....slice/cri-containerd-3f2a...(64 hex).scope

``/proc/<pid>/cgroup`` has one line per hierarchy under cgroup v1 and one (``0::``) under v2; the first line
that names a pod and a container wins (they all agree for a container's process). Read from the host's
cgroup namespace: inside a container's own namespace the path is cut above the container.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?")
_CONTAINER = re.compile(r"(?:[a-z-]+-)?([0-9a-f]{64})(?:\.scope)?")
MAX_CGROUP_FILE = 64 << 10


@dataclass(frozen=True)
class ContainerCgroup:
    pod_uid: str                # with dashes, as in metadata.uid
    container_id: str           # 64 hex digits, without the runtime's "containerd://" prefix


def parse_cgroup(text: str) -> ContainerCgroup | None:
    """The pod UID and container ID in the text of /proc/<pid>/cgroup, or None for a process in no container."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        segments = path.split("/")
        for i, segment in enumerate(segments[:-1]):
            pod = _POD.fullmatch(segment.rpartition("-")[2] if segment.startswith("kubepods") else segment)
            if pod is None:
                continue
            container = _CONTAINER.fullmatch(segments[i + 1])
            if container is not None:
                return ContainerCgroup(pod[1].replace("_", "-"), container[1])
    return None


def container_of(pid: int, proc_root: Path | str = "/proc") -> ContainerCgroup | None:
    """The container of a host process; None when it is gone or in none."""
    try:
        with open(Path(proc_root) / str(pid) / "cgroup", "rb") as f:
            text = f.read(MAX_CGROUP_FILE).decode("utf-8", "replace")
    except OSError:
        return None
    return parse_cgroup(text)
