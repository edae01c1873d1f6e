"""Example pods made runnable on a local real node, and what their containers report seeing.

The examples' pods name a CUDA image and run ``nvidia-smi``; a local node has neither a registry nor GPUs.
`for_local_node` keeps everything that matters for allocation and preparation (claims, resources, restart
policy) and swaps the rest: host network, the node's busybox image (never pulled) and a probe script that
prints the container's NVIDIA device nodes (with major:minor), its NVIDIA/CUDA environment and its
NVIDIA-related mounts, then sleeps so the pod stays Running until it is deleted. `parse_probe` reads that
output back. The demo and the real-node tests share this, so the tests check what the demo shows.
"""
from __future__ import annotations

import copy
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

BEGIN = "gpu-dra-probe begin"
END = "gpu-dra-probe end"
MARKER_PREFIX = "probe-"

# busybox sh. Device nodes: only character devices count (what runc created from the CDI spec). Mounts:
# mount point and root (the source path inside its file system) of every mount whose point mentions nvidia,
# and of /dev/shm. An MPS client's pipe directory and /dev/shm get a marker file each, so a test can find them
# on the host side of the bind mounts (the MPS daemon's directories).
_PROBE = r"""echo '{begin}'
for f in /dev/nvidia* /dev/nvidia-caps/*; do
  [ -c "$f" ] && echo "dev $f $(stat -c '%t %T' "$f")"
done
env | grep -E '^(NVIDIA|CUDA)_' | sort | sed 's/^/env /'
awk '$5 ~ /nvidia/ || $5 == "/dev/shm" {{print "mount", $5, $4}}' /proc/self/mountinfo
if [ -n "$CUDA_MPS_PIPE_DIRECTORY" ]; then
  for d in "$CUDA_MPS_PIPE_DIRECTORY" /dev/shm; do
    touch "$d/{marker}" 2>/dev/null && echo "wrote $d/{marker}"
  done
fi
echo '{end}'
exec sleep 86400
"""


def probe_marker(pod: str, container: str) -> str:
    """The file the probe of `container` in `pod` writes into a mounted MPS pipe directory."""
    return f"{MARKER_PREFIX}{pod}-{container}"


def probe_script(pod: str, container: str) -> str:
    return _PROBE.format(begin=BEGIN, end=END, marker=shlex.quote(probe_marker(pod, container)))


def for_local_node(pod: dict[str, Any], image: str, node_name: str | None = None) -> dict[str, Any]:
    """A copy of `pod` that runs on a local real node: hostNetwork, `image` with imagePullPolicy Never, the probe
    as every container's command, a short grace period; pinned to `node_name` when given."""
    out = copy.deepcopy(pod)
    spec = out.setdefault("spec", {})
    name = out["metadata"]["name"]
    spec["hostNetwork"] = True
    # The probe's sleep runs as PID 1, which ignores SIGTERM: keep deletion quick.
    spec["terminationGracePeriodSeconds"] = 1
    if node_name:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), "kubernetes.io/hostname": node_name}
    for c in spec.get("containers") or []:
        c["image"] = image
        c["imagePullPolicy"] = "Never"
        c["command"] = ["sh", "-c", probe_script(name, c["name"])]
        c.pop("args", None)
    return out


@dataclass
class ContainerView:
    """What one container printed about itself (see the module docstring)."""

    devices: dict[str, tuple[int, int]] = field(default_factory=dict)   # path -> (major, minor)
    env: dict[str, str] = field(default_factory=dict)                    # NVIDIA_* and CUDA_* only
    mounts: dict[str, str] = field(default_factory=dict)                 # mount point -> root in its source
    wrote: list[str] = field(default_factory=list)                       # marker files written
    complete: bool = False                                               # the end line was printed

    def summary(self) -> str:
        """One line for people: device nodes and the environment the claim gave."""
        devs = " ".join(sorted(self.devices)) or "no /dev/nvidia* nodes"
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        return f"{devs}; {env}" if env else devs


_DEV = re.compile(r"^dev (\S+) ([0-9a-fA-F]+) ([0-9a-fA-F]+)$")


def parse_probe(text: str) -> ContainerView:
    """The view in a container's log (its last probe run); `complete` is False until the probe finished."""
    view = ContainerView()
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.strip() == BEGIN]
    if not starts:
        return view
    for line in lines[starts[-1] + 1:]:
        line = line.rstrip()
        if line == END:
            view.complete = True
            break
        if m := _DEV.match(line):
            view.devices[m.group(1)] = (int(m.group(2), 16), int(m.group(3), 16))
        elif line.startswith("env ") and "=" in line:
            key, _, value = line[4:].partition("=")
            view.env[key] = value
        elif line.startswith("mount "):
            parts = line.split(" ", 2)
            if len(parts) == 3:
                view.mounts[parts[1]] = parts[2]
        elif line.startswith("wrote "):
            view.wrote.append(line[6:])
    return view
