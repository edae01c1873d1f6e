"""What ``gpu-dra kubelet-plugin`` is told, in a module light enough to read before anything slow is
imported (the plugin's sockets are up before the rest of it loads)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from api.names import DEFAULT_DRIVER_NAME
from dra.node.bootid import DEFAULT_BOOT_ID_PATH
from kubeletplugin.transport.sockets import DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR

SIMULATED_STATE_FILE = "simulated-gpus.json"
# Claims of one call prepared side by side. They are I/O-bound and wait only for the GPUs they share, so the
# bound is high: a kubelet call with hundreds of claims still answers well inside its 45 s deadline.
MAX_PARALLEL_CLAIMS = 64


@dataclass
class PluginOptions:
    """Everything ``gpu-dra kubelet-plugin`` is told (flags / environment)."""

    node_name: str
    driver_name: str = DEFAULT_DRIVER_NAME
    kubeconfig: str | None = None
    registry_dir: str = DEFAULT_REGISTRY_DIR
    plugin_dir: str | None = None          # default <plugins dir>/<driver>
    cdi_root: str = "/var/run/cdi"
    driver_root: str = "/"
    host_driver_root: str | None = None    # the driver root as the host sees it (CDI hostPaths)
    cdi_hook_path: str | None = None       # host path of nvidia-cdi-hook, seen at the same path here
    dev_root: str = "/"
    proc_root: str = "/proc"
    pod_resources_socket: str = ""         # the kubelet's PodResources socket ("": no per-claim GPU metrics)
    state_dir: str | None = None           # default: the plugin directory
    pod_uid: str | None = None             # rolling-update mode
    node_policy: str | None = None         # YAML file
    fleet: str | None = None               # simulated node: fleet file
    sim_state: str | None = None           # simulated node: GPU state file (default <state dir>/simulated-gpus.json;
                                           # "none": in memory only, gone with the process)
    compat_nvidia: bool = False
    metrics_port: int = 0                  # 0: no metrics endpoint
    health_interval: float = 10.0          # re-send period of the health stream
    boot_id_path: str = DEFAULT_BOOT_ID_PATH
    mps_supervise_interval: float = 5.0
    health_wait_ms: int = 10_000           # longest NVML event wait; the monitor wakes earlier for due probes
    mps_cgroup_procs: tuple[str, ...] = ()  # cgroup.procs files MPS daemons move into (outside this container)
    mps_cgroup: str = ""                   # cgroup (below mps_cgroup_root) MPS daemons join, made where missing
    mps_cgroup_root: str = "/sys/fs/cgroup"  # where this process sees the host's cgroup hierarchies
    mps_shm_tmpfs: bool | None = None      # each MPS daemon's /dev/shm a tmpfs (None: on real nodes, not simulated)
    health_quiet_period: float = 300.0     # XID/ECC taints go after this many seconds without a new event (0: never)
    publish_failure_grace: float = 300.0   # /healthz turns unhealthy when a pool's slices fail this long
    max_parallel: int = MAX_PARALLEL_CLAIMS

    @property
    def plugin_directory(self) -> Path:
        return Path(self.plugin_dir or f"{DEFAULT_PLUGINS_DIR}/{self.driver_name}")

    @property
    def state_directory(self) -> Path:
        return Path(self.state_dir) if self.state_dir else self.plugin_directory

    @property
    def mount_mps_shm(self) -> bool:
        return self.mps_shm_tmpfs if self.mps_shm_tmpfs is not None else not self.fleet

    @property
    def simulated_state_file(self) -> Path | None:
        """Where a simulated node's GPUs keep their state across plugin restarts (None: not kept)."""
        if not self.fleet or self.sim_state == "none":
            return None
        return Path(self.sim_state) if self.sim_state else self.state_directory / SIMULATED_STATE_FILE
