"""Example pods made runnable on a local real node, and what their containers report seeing.

The examples' pods name a CUDA image and run ``nvidia-smi``; a local node has neither a registry nor GPUs.
`for_local_node` keeps everything that matters for allocation and preparation (claims, resources, restart
policy) and swaps the rest: host network, the node's cuda-probe image (never pulled; Debian's glibc, busybox
and hack/cuda-standin's cuda-probe) and a probe script that prints the container's NVIDIA device nodes (with
major:minor), its NVIDIA/CUDA environment and its NVIDIA-related mounts, runs ``cuda-probe --once`` (the
devices libcuda.so.1 and libnvidia-ml.so.1, loaded by soname, show this container) and ``nvidia-smi -L`` where
the spec mounted one, then sleeps so the pod
stays Running until it is deleted. `parse_probe` reads that output back. The demo and the real-node tests
share this, so the tests check what the demo shows.
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
# and of /dev/shm. An MPS client tries to write a marker file into its pipe directory and /dev/shm, so a test
# can find them on the host side of the bind mounts (the MPS daemon's directories): /dev/shm takes it, the pipe
# directory is read-only. It lists the pipe directory too (the daemon's sockets and PID file).
_PROBE = r"""echo '{begin}'
for f in /dev/nvidia* /dev/nvidia-caps/*; do
  [ -c "$f" ] && echo "dev $f $(stat -c '%t %T' "$f")"
done
env | grep -E '^(NVIDIA|CUDA)_' | sort | sed 's/^/env /'
cuda-probe --once 2>&1
command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 | sed 's/^/smi /'
awk '$5 ~ /nvidia/ || $5 == "/dev/shm" {{print "mount", $5, $4}}' /proc/self/mountinfo
if [ -n "$CUDA_MPS_PIPE_DIRECTORY" ]; then
  for d in "$CUDA_MPS_PIPE_DIRECTORY" /dev/shm; do
    touch "$d/{marker}" 2>/dev/null && echo "wrote $d/{marker}"
  done
  echo "pipe $(ls -A "$CUDA_MPS_PIPE_DIRECTORY" | tr '\n' ' ')"
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


@dataclass(frozen=True)
class SeenDevice:
    """One device cuda-probe printed: through libcuda, or through NVML (a GPU, or a MIG device under one)."""

    uuid: str
    memory_mib: int
    name: str


@dataclass
class ContainerView:
    """What one container printed about itself (see the module docstring)."""

    devices: dict[str, tuple[int, int]] = field(default_factory=dict)   # path -> (major, minor)
    env: dict[str, str] = field(default_factory=dict)                    # NVIDIA_* and CUDA_* only
    mounts: dict[str, str] = field(default_factory=dict)                 # mount point -> root in its source
    wrote: list[str] = field(default_factory=list)                       # marker files written
    pipe_entries: list[str] = field(default_factory=list)                # what the MPS pipe directory holds
    cuda: list[SeenDevice] = field(default_factory=list)                 # CUDA devices, in ordinal order
    nvml: list[SeenDevice] = field(default_factory=list)                 # NVML GPUs
    nvml_mig: list[SeenDevice] = field(default_factory=list)             # NVML MIG devices
    smi: list[str] = field(default_factory=list)                         # `nvidia-smi -L`, when mounted
    cuda_error: str | None = None      # why cuda-probe saw no CUDA device ("dlopen libcuda.so.1: ...")
    nvml_error: str | None = None
    probed: bool = False                                                 # cuda-probe printed its cuda count
    complete: bool = False                                               # the end line was printed

    def summary(self) -> str:
        """One line for people: device nodes and the environment the claim gave."""
        devs = " ".join(sorted(self.devices)) or "no /dev/nvidia* nodes"
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        line = f"{devs}; {env}" if env else devs
        return f"{line}; {self.cuda_summary()}" if self.probed else line

    def cuda_summary(self) -> str:
        """What libcuda showed, e.g. ``cuda: 1 device GPU-..., 81559 MiB``."""
        if not self.cuda:
            return f"cuda: 0 devices ({self.cuda_error})" if self.cuda_error else "cuda: 0 devices"
        noun = "device" if len(self.cuda) == 1 else "devices"
        return f"cuda: {len(self.cuda)} {noun} " + ", ".join(f"{d.uuid}, {d.memory_mib} MiB" for d in self.cuda)


_DEV = re.compile(r"^dev (\S+) ([0-9a-fA-F]+) ([0-9a-fA-F]+)$")
# cuda-probe's lines (hack/cuda-standin/cuda-probe.c)
_SEEN = re.compile(r"^(cuda|nvml): (device \d+|mig \d+ \d+) (\S+) (\d+) MiB (.*)$")
_NONE = re.compile(r"^(cuda|nvml): 0 devices \((.*)\)$")
_COUNT = re.compile(r"^cuda: (\d+ devices|0 devices \(.*\))$")


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
        elif line.startswith("pipe "):
            view.pipe_entries = line[5:].split()
        elif line.startswith("smi "):
            view.smi.append(line[4:])
        if m := _SEEN.match(line):
            seen = SeenDevice(m.group(3), int(m.group(4)), m.group(5))
            if m.group(1) == "cuda":
                view.cuda.append(seen)
            else:
                (view.nvml_mig if m.group(2).startswith("mig") else view.nvml).append(seen)
        elif m := _NONE.match(line):
            if m.group(1) == "cuda":
                view.cuda_error = m.group(2)
            else:
                view.nvml_error = m.group(2)
        view.probed = view.probed or bool(_COUNT.match(line))
    return view
