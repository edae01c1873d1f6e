"""A real node for a `LocalCluster`: containerd (with runc) and a kubelet as local processes, running pods.

The binaries and the test images come from hack/build-node.sh (kubelet, containerd, ctr,
containerd-shim-runc-v2, runc; OCI archives of a pause image, a busybox image and the glibc cuda-probe image,
imported into containerd since no registry is reachable), as does the CUDA stand-in that
`install_driver_root` lays out in a simulated node's driver root. Pods must use ``hostNetwork: true`` (the
node has no pod network, only a loopback CNI configuration so that the runtime reports its network ready)
and ``imagePullPolicy: Never``.

Needs root and cgroups (v1 with every hierarchy mounted, or v2 with controllers delegated to the root).
Everything lives under the node's work dir except what the kubelet insists on writing elsewhere: its
cgroups (under a cgroup root of the node's own), host sysctls (``vm.overcommit_memory``, ``kernel.panic``,
...) and a few host directories (``/var/log/containers``, ``/var/lib/kubelet/device-plugins``). Before
starting anything, the node writes a record of what it will change to a records directory outside the work
dir; `LocalNode.stop` and, after a crash, `cleanup_leftovers` use it to put the machine back as found:
processes killed, mounts under the work dir unmounted, cgroups removed, sysctls restored, host paths that
did not exist removed. That host plumbing, the record included, is `testbed.hostplumbing`.

Several nodes run side by side on one machine (each its own work dir, sockets, ports, cgroup root, CDI
directory and plugin registry); what they share is the host's: the sysctls and host paths above (the record
of the last node to stop puts them back) and the kubelet's device-manager socket directory
``/var/lib/kubelet/device-plugins``, which the kubelet does not let one configure (no device plugin runs
here: DRA drivers use the plugin registry).

    with LocalCluster() as cluster, LocalNode(cluster, cdi_dirs=[cdi]) as node:
        cluster.request("POST", "/api/v1/namespaces/default/pods", node.pod_manifest("hi", ["echo", "hi"]))
        node.wait_pod("default", "hi", {"Succeeded"})
        print(node.container_log("default", "hi"))
"""
from __future__ import annotations

import calendar
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from api.k8snames import is_dns_subdomain
from testbed.hostplumbing import (
    NodeError,
    cgroup_hierarchies,
    cgroup_v2_only,
    cleanup_record,
    first_missing_ancestor,
    local_hostname,
    mounts_under,
    node_ip,
    proc_start,
    read_record,
    read_sysctl,
    record_paths,
    records_lock,
    write_record,
)
from testbed.localcluster import ClusterError, LocalCluster, bin_dir_from_script, free_port, pinned_version

log = logging.getLogger(__name__)

NODE_BIN_ENV = "GPU_DRA_NODE_BIN"
NODE_BINARIES = ("kubelet", "containerd", "ctr", "containerd-shim-runc-v2", "runc")
_REPO_ROOT = Path(__file__).resolve().parents[1]
_BUILD_SCRIPT = _REPO_ROOT / "hack" / "build-node.sh"
CRI_NAMESPACE = "k8s.io"
# The kubelet sets these at start-up (container manager's kernel tunables) and never puts them back.
SYSCTLS = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
           "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes")
# Host paths the kubelet or containerd may create outside the work dir whatever their configuration says.
# /run/mount is util-linux mount's lock directory (the kubelet runs mount).
HOST_PATHS = ("/var/lib/kubelet/device-plugins", "/var/log/containers", "/var/log/pods", "/run/containerd",
              "/var/lib/kubelet/pod-resources", "/etc/cni", "/opt/cni", "/opt/containerd", "/run/nri", "/etc/nri",
              "/run/mount")
_UNIX_PATH_MAX = 107
_LOG_TAIL_LINES = 30


# ---- binaries and images --------------------------------------------------------------------------


def pause_image() -> str:
    """The sandbox image reference, pinned in hack/versions.env (imported from a local OCI archive)."""
    return pinned_version("PAUSE_IMAGE")


def busybox_image() -> str:
    """The test image reference (Debian's busybox-static, one applet link per command in /bin)."""
    return pinned_version("BUSYBOX_IMAGE")


def cuda_probe_image() -> str:
    """The glibc test image with cuda-probe (hack/cuda-standin), which the example pods run."""
    return pinned_version("CUDA_PROBE_IMAGE")


# Archive in the node's images directory -> the image it holds.
IMAGE_ARCHIVES: dict[str, Callable[[], str]] = {"pause.oci.tar": pause_image, "busybox.oci.tar": busybox_image,
                                                "cuda-probe.oci.tar": cuda_probe_image}


def cuda_standin_dir(bin_dir: Path) -> Path:
    """The built CUDA stand-in of a node build (``lib/``, ``bin/``), beside its bin directory."""
    return bin_dir.parent / "cuda-standin"


def install_driver_root(root: Path, bin_dir: Path, layout: str, *, fleet: Path, node_name: str) -> list[str]:
    """The node build's CUDA stand-in installed in the driver root of the simulated node `node_name` of `fleet`,
    as a real driver install of ``layout`` (dra.sim.driverlayout.LAYOUTS) is, its libraries named after the
    node's driver version; returns the paths created under ``root``."""
    from dra.sim.driverlayout import DriverLayoutError, install_standin
    from dra.sim.fleet import FleetError, load_fleet

    try:
        version = load_fleet(fleet).node(node_name).driver_version
        return install_standin(root, cuda_standin_dir(bin_dir), layout, version)
    except (DriverLayoutError, FleetError) as err:
        raise NodeError(f"cannot install the CUDA stand-in into {root}: {err}") from None


def _missing(bin_dir: Path) -> list[str]:
    missing = [b for b in NODE_BINARIES if not os.access(bin_dir / b, os.X_OK)]
    images = bin_dir.parent / "images"
    missing += [f"../images/{i}" for i in IMAGE_ARCHIVES if not (images / i).is_file()]
    if not (cuda_standin_dir(bin_dir) / "lib").is_dir():
        missing.append("../cuda-standin/lib")
    return missing


# Nodes started at once (threads) build the binaries once: the others wait, then find the cache complete.
_FIND_LOCK = threading.Lock()


def find_node_binaries(build: bool = True) -> Path:
    """The bin directory with kubelet, containerd, ctr, containerd-shim-runc-v2 and runc; the image archives
    are in its sibling ``images``. $GPU_DRA_NODE_BIN if set, else hack/build-node.sh (which reuses its cache
    or builds; it prints the bin directory on its last line). Without `build`, only a complete cache counts."""
    with _FIND_LOCK:
        return _find_node_binaries(build)


def _find_node_binaries(build: bool) -> Path:
    env = os.environ.get(NODE_BIN_ENV)
    if env:
        bin_dir = Path(env).expanduser()
        missing = _missing(bin_dir)
        if missing:
            raise NodeError(f"${NODE_BIN_ENV}={env} lacks: {', '.join(missing)}")
        return bin_dir
    if not _BUILD_SCRIPT.is_file():
        raise NodeError(f"no ${NODE_BIN_ENV} set and no build script at {_BUILD_SCRIPT}")
    env_vars = dict(os.environ)
    if not build:
        # The script's own cache check, without building: it exits at once when everything is there.
        env_vars["GPU_DRA_NODE_NO_BUILD"] = "1"
    return bin_dir_from_script(_BUILD_SCRIPT, env_vars, _missing, NodeError, tail_lines=_LOG_TAIL_LINES)


# ---- the node -------------------------------------------------------------------------------------


class LocalNode:
    """A node of `cluster` with a real kubelet and containerd. Not thread-safe.

    `name` defaults to the host name when it resolves to this host (then ``kubectl logs`` works), else
    ``local-node``. `labels` go to --node-labels (not kubernetes.io/k8s.io ones: the kubelet refuses those).
    `cdi_dirs` are containerd's CDI spec directories, where a DRA kubelet plugin writes its specs (default:
    ``cdi`` in the work dir); those that do not exist are created, and removed on stop.
    `workdir` holds everything of the node (default: a new directory under /tmp, removed on stop); sockets
    live in it, so it must be short. `kubelet_config` is merged over the generated KubeletConfiguration.
    On a cluster with `node_authorization` the kubelet authenticates as system:node:<name> (a client
    certificate), else as the cluster's admin. `registry_cas` maps registry hosts (host:port) to the CA file
    containerd trusts for them (a hosts.toml each under ``containerd/certs.d``), so that pods pull from them."""

    def __init__(self, cluster: LocalCluster, name: str | None = None, labels: dict[str, str] | None = None,
                 cdi_dirs: Sequence[Path | str] = (), workdir: Path | str | None = None,
                 bin_dir: Path | str | None = None, startup_timeout: float = 120.0,
                 kubelet_config: dict[str, Any] | None = None, kubelet_args: Sequence[str] = (),
                 kubelet_verbosity: int = 2, registry_cas: Mapping[str, Path] | None = None) -> None:
        self.cluster = cluster
        self.name = name or local_hostname() or "local-node"
        self.labels = dict(labels or {})
        self._given_cdi_dirs = [Path(d) for d in cdi_dirs]
        self.cdi_dirs = list(self._given_cdi_dirs)
        self._given_workdir = Path(workdir) if workdir else None
        self._bin_dir = Path(bin_dir) if bin_dir else None
        self.startup_timeout = startup_timeout
        self.kubelet_config_overrides = dict(kubelet_config or {})
        self.kubelet_args = list(kubelet_args)
        self.kubelet_verbosity = kubelet_verbosity
        self.registry_cas = dict(registry_cas or {})
        self.workdir: Path | None = None
        self.node_ip = ""
        self.cgroup_root = ""
        self.snapshotter = ""
        self.ports: dict[str, int] = {}
        self.times: dict[str, float] = {}
        self._record_path: Path | None = None
        self._containerd: subprocess.Popen[bytes] | None = None
        self._kubelet: subprocess.Popen[bytes] | None = None
        self._kubelet_log_start = 0       # where this kubelet's output starts in the (appended) log

    # ---- paths ------------------------------------------------------------------------------------

    @property
    def bin_dir(self) -> Path:
        if self._bin_dir is None:
            self._bin_dir = find_node_binaries()
        return self._bin_dir

    @property
    def images_dir(self) -> Path:
        return self.bin_dir.parent / "images"

    @property
    def _dir(self) -> Path:
        if self.workdir is None:
            raise NodeError("node is not started")
        return self.workdir

    @property
    def root_dir(self) -> Path:
        """The kubelet's --root-dir."""
        return self._dir / "kubelet"

    @property
    def plugins_registry_dir(self) -> Path:
        """Where a kubelet plugin puts its registration socket (the kubelet watches it)."""
        return self.root_dir / "plugins_registry"

    @property
    def plugins_dir(self) -> Path:
        """Where a kubelet plugin puts its service sockets (``<plugins_dir>/<driver>/dra.sock``)."""
        return self.root_dir / "plugins"

    @property
    def pod_logs_dir(self) -> Path:
        """The kubelet's podLogsDir: CRI log files of every container, ``<ns>_<pod>_<uid>/<container>/<n>.log``."""
        return self._dir / "pod-logs"

    @property
    def containerd_socket(self) -> Path:
        return self._dir / "run" / "containerd.sock"

    @property
    def record_path(self) -> Path | None:
        """The record of what this node changes outside its work dir (see `cleanup_record`)."""
        return self._record_path

    @property
    def kubelet_log(self) -> Path:
        return self._dir / "logs" / "kubelet.log"

    @property
    def containerd_log(self) -> Path:
        return self._dir / "logs" / "containerd.log"

    @property
    def kubelet_pid(self) -> int | None:
        return self._kubelet.pid if self._kubelet and self._kubelet.poll() is None else None

    @property
    def containerd_pid(self) -> int | None:
        return self._containerd.pid if self._containerd and self._containerd.poll() is None else None

    @property
    def serves_logs(self) -> bool:
        """Whether the API server can reach this kubelet (``kubectl logs``/``exec``): the node name resolves here."""
        return self.name == local_hostname()

    # ---- lifecycle --------------------------------------------------------------------------------

    def start(self) -> "LocalNode":
        t0 = time.monotonic()
        self.ports = {}
        self._preflight()
        bin_dir = self.bin_dir
        self.times["binaries"] = time.monotonic() - t0
        if self._given_workdir:
            self._given_workdir.mkdir(parents=True, exist_ok=True)
            self.workdir = self._given_workdir.resolve()
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix="gpu-dra-node-"))
        self.cdi_dirs = self._given_cdi_dirs or [self._dir / "cdi"]
        try:
            self._check_socket_paths()
            self._write_record()
            self._phase("cgroups", self._make_cgroup_root)
            self._phase("containerd", self._start_containerd, bin_dir)
            self._phase("images", self._import_images, bin_dir)
            self._phase("kubelet", self._start_kubelet_until_ready, bin_dir, time.time() - 1)
        except BaseException:
            try:
                self.stop(delete_node=False)
            except NodeError as exc:
                log.error("%s", exc)
            raise
        log.info("node %s ready in %.1fs (%s)", self.name, sum(self.times.values()),
                 ", ".join(f"{k} {v:.1f}s" for k, v in self.times.items()))
        return self

    def stop(self, delete_node: bool = True) -> None:
        """Stops the kubelet, every container (through containerd) and containerd, then puts the host back as
        found (see `cleanup_record`) and, unless `delete_node` is False, deletes the Node object.
        Raises NodeError naming what could not be cleaned."""
        if self.workdir is None:
            return
        _terminate(self._kubelet)
        if self._containerd is not None and self._containerd.poll() is None:
            try:
                self._stop_all_tasks()
            except (NodeError, subprocess.TimeoutExpired) as exc:
                log.warning("node %s: stopping tasks through containerd failed (%s); killing them", self.name, exc)
        _terminate(self._containerd, grace=10.0)
        if self._record_path:
            problems = cleanup_record(self._record_path)
        else:  # start-up failed before anything outside the work dir was touched
            problems = []
            if self._given_workdir is None and not mounts_under(self._dir):
                shutil.rmtree(self._dir, ignore_errors=True)
        self._kubelet = self._containerd = None
        self._record_path = None
        self.workdir = None
        if delete_node:
            try:
                self.cluster.request("DELETE", f"/api/v1/nodes/{self.name}")
            except (ClusterError, OSError) as exc:
                if "404" not in str(exc):
                    log.warning("node %s: cannot delete the Node object: %s", self.name, exc)
        if problems:
            # The record stays: cleanup_leftovers() retries once this process is gone.
            raise NodeError(f"node {self.name}: teardown incomplete:\n" + "\n".join(problems))

    def restart_kubelet(self, downtime: float = 0.0) -> None:
        """Stops the kubelet (SIGTERM) and starts it again with the same flags and state; containers keep
        running meanwhile. Returns once the node has reported Ready again."""
        self.stop_kubelet()
        time.sleep(downtime)
        self.start_kubelet()

    def stop_kubelet(self) -> None:
        """Stops the kubelet (SIGTERM); containerd and the containers keep running (see `start_kubelet`)."""
        _terminate(self._kubelet)

    def start_kubelet(self) -> None:
        """Starts the stopped kubelet again with the same flags and state; returns once the node has reported
        Ready again."""
        if self.kubelet_pid is not None:
            raise NodeError(f"node {self.name}: the kubelet already runs (pid {self.kubelet_pid})")
        self._start_kubelet_until_ready(self.bin_dir, time.time())

    def __enter__(self) -> "LocalNode":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check_running(self) -> None:
        """Raises NodeError naming containerd or the kubelet if it has exited."""
        dead = [(n, p) for n, p in (("containerd", self._containerd), ("kubelet", self._kubelet))
                if p is None or p.poll() is not None]
        if dead:
            names = ", ".join(f"{n} (exit {p.returncode if p else 'never started'})" for n, p in dead)
            raise NodeError(f"node {self.name}: {names} not running\n{self.logs_tail()}")

    def logs_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        parts = []
        for what, path in (("containerd", self.containerd_log), ("kubelet", self.kubelet_log)):
            try:
                text = "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            except OSError as exc:
                text = f"(no log: {exc})"
            parts.append(f"--- {what} ({path}) ---\n{text}")
        return "\n".join(parts)

    # ---- pods and containers ----------------------------------------------------------------------

    def pod_manifest(self, name: str, command: Sequence[str], namespace: str = "default",
                     image: str | None = None, env: dict[str, str] | None = None,
                     restart_policy: str = "Never", **spec: Any) -> dict[str, Any]:
        """A pod for this node as it must be here: host network, no image pull, the busybox image by default.
        The scheduler places it (nodeSelector on the node's hostname label); `spec` adds pod spec fields."""
        container: dict[str, Any] = {"name": "main", "image": image or busybox_image(), "imagePullPolicy": "Never",
                                     "command": list(command)}
        if env:
            container["env"] = [{"name": k, "value": v} for k, v in env.items()]
        return {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"hostNetwork": True, "restartPolicy": restart_policy, "terminationGracePeriodSeconds": 1,
                     "nodeSelector": {"kubernetes.io/hostname": self.name}, "containers": [container], **spec},
        }

    def wait_pod(self, namespace: str, name: str, phases: set[str], timeout: float = 90.0) -> dict[str, Any]:
        """Waits for the pod to reach one of `phases`; NodeError with its status and the node logs if not."""
        deadline = time.monotonic() + timeout
        pod: dict[str, Any] = {}
        while time.monotonic() < deadline:
            pod = self.cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
            if pod.get("status", {}).get("phase") in phases:
                return pod
            if pod.get("status", {}).get("phase") in ("Failed", "Succeeded"):
                break
            self.check_running()
            time.sleep(0.3)
        raise NodeError(f"pod {namespace}/{name} did not reach {sorted(phases)} (status: "
                        f"{json.dumps(pod.get('status', {}))[:2000]})\n{self.logs_tail()}")

    def wait_pod_gone(self, namespace: str, name: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
            except ClusterError as exc:
                if "HTTP 404" in str(exc):
                    return
                raise
            time.sleep(0.3)
        raise NodeError(f"pod {namespace}/{name} still exists after {timeout:.0f}s\n{self.logs_tail()}")

    def container_log(self, namespace: str, pod: str, container: str = "main", attempt: int | None = None) -> str:
        """What the container wrote to stdout and stderr, read from the kubelet's CRI log file (the latest
        attempt unless `attempt` is given); works whatever the node's name."""
        dirs = sorted(self.pod_logs_dir.glob(f"{namespace}_{pod}_*/{container}"))
        if not dirs:
            raise NodeError(f"no log directory for {namespace}/{pod}/{container} in {self.pod_logs_dir}")
        files = sorted(dirs[-1].glob("*.log"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1)
        if attempt is not None:
            files = [f for f in files if f.stem == str(attempt)]
        if not files:
            raise NodeError(f"no log file in {dirs[-1]}")
        return parse_cri_log(files[-1].read_text(errors="replace"))

    def container_ids(self, namespace: str, pod: str) -> dict[str, str]:
        """Container name -> runtime container id, from the pod's status."""
        obj = self.cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")
        out = {}
        for st in obj.get("status", {}).get("containerStatuses", []):
            cid = st.get("containerID", "")
            if cid:
                out[st["name"]] = cid.partition("://")[2]
        return out

    def ctr(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Runs ctr against this node's containerd in the CRI namespace."""
        cmd = [str(self.bin_dir / "ctr"), "--address", str(self.containerd_socket), "--namespace", CRI_NAMESPACE, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
        return proc

    def running_tasks(self) -> dict[str, int]:
        """Task (container or sandbox) id -> pid of the tasks containerd runs that are RUNNING."""
        out = {}
        for line in self.ctr("tasks", "ls").stdout.splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "RUNNING":
                out[parts[0]] = int(parts[1])
        return out

    # ---- start-up ---------------------------------------------------------------------------------

    def _phase(self, name: str, fn: Any, *args: Any) -> None:
        t = time.monotonic()
        fn(*args)
        self.times[name] = time.monotonic() - t

    def _preflight(self) -> None:
        if os.geteuid() != 0:
            raise NodeError("a real node needs root (containerd, runc and the kubelet mount and make cgroups)")
        if not cgroup_hierarchies():
            raise NodeError("no cgroup hierarchy is mounted under /sys/fs/cgroup: the kubelet needs cgroups")
        if not is_dns_subdomain(self.name):
            raise NodeError(f"node name {self.name!r} is not a valid DNS subdomain")
        bad = [k for k in self.labels if k.split("/")[0].endswith(("kubernetes.io", "k8s.io"))]
        if bad:
            raise NodeError(f"the kubelet refuses to set kubernetes.io/k8s.io labels on its node: {bad}")
        try:
            self.cluster.request("GET", f"/api/v1/nodes/{self.name}")
        except ClusterError as exc:
            if "HTTP 404" not in str(exc):
                raise NodeError(f"cannot reach the API server: {exc}") from exc
        else:
            raise NodeError(f"a Node named {self.name} already exists in the cluster")

    def _check_socket_paths(self) -> None:
        longest = self._dir / "run" / ("s/" + "0" * 64)
        if len(str(longest)) > _UNIX_PATH_MAX:
            raise NodeError(f"work dir {self._dir} is too long for the shims' unix sockets "
                            f"({len(str(longest))} > {_UNIX_PATH_MAX} bytes); use a shorter one")

    def _write_record(self) -> None:
        suffix = self._dir.name.rsplit("-", 1)[-1] if self._given_workdir is None else secrets.token_hex(4)
        self.cgroup_root = f"/gpu-dra-node-{suffix}"
        with records_lock() as d:
            others = [r for r in (read_record(p) for p in record_paths(d)) if r is not None]
            # A node started while another runs sees the host as that one changed it: inherit its originals.
            inherited: dict[str, str | None] = {}
            for other in sorted(others, key=lambda r: float(r.get("created", 0))):
                for key, value in other.get("sysctls", {}).items():
                    inherited.setdefault(key, value)
            sysctls = {k: inherited.get(k, read_sysctl(k)) for k in SYSCTLS}
            # The CDI directories too: the node creates them when missing.
            wanted = [*HOST_PATHS, *(str(p) for p in self.cdi_dirs)]
            created = sorted({m for m in (first_missing_ancestor(p) for p in wanted) if m})
            self._record_path = d / f"{self.name}-{self._dir.name}.json"
            write_record(self._record_path, {
                "name": self.name, "workdir": str(self._dir), "created_workdir": self._given_workdir is None,
                "cgroup_root": self.cgroup_root, "sysctls": sysctls, "created_paths": created,
                "owner_pid": os.getpid(), "owner_start": proc_start(os.getpid()), "created": time.time(),
                "pids": {},
            })

    def _update_record_pids(self) -> None:
        if not self._record_path:
            return
        with records_lock():
            record = read_record(self._record_path) or {}
            record["pids"] = {n: p.pid for n, p in (("containerd", self._containerd), ("kubelet", self._kubelet)) if p}
            write_record(self._record_path, record)

    def _make_cgroup_root(self) -> None:
        """The kubelet requires its cgroup root to exist in every hierarchy it uses."""
        for hier in cgroup_hierarchies():
            d = hier / self.cgroup_root.strip("/")
            d.mkdir(exist_ok=True)
            # v1 cpuset: a new cgroup starts with no CPUs and memory nodes, and nothing can join it.
            for f in ("cpuset.cpus", "cpuset.mems"):
                if (d / f).exists() and not (d / f).read_text().strip():
                    (d / f).write_text((hier / f).read_text())
            if hier == Path("/sys/fs/cgroup") and (hier / "cgroup.subtree_control").exists():
                # v2: the kubelet needs the controllers delegated below its root.
                wanted = set((hier / "cgroup.subtree_control").read_text().split())
                if wanted:
                    (d / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))

    def _containerd_config(self, bin_dir: Path) -> str:
        d = self._dir
        q = json.dumps  # TOML basic strings accept JSON string escapes
        cdi = ", ".join(q(str(p)) for p in self.cdi_dirs)
        return f"""\
version = 4
# Nothing from the host's /etc/containerd.
imports = []
root = {q(str(d / 'containerd' / 'root'))}
state = {q(str(d / 'containerd' / 'state'))}
temp = {q(str(d / 'containerd' / 'tmp'))}

[debug]
  level = "info"

[plugins]
  [plugins.'io.containerd.server.v1.grpc']
    address = {q(str(self.containerd_socket))}
  [plugins.'io.containerd.server.v1.ttrpc']
    address = {q(str(self.containerd_socket) + '.ttrpc')}
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = {q(self.snapshotter)}
    [plugins.'io.containerd.cri.v1.images'.registry]
      config_path = {q(str(self._certs_dir))}
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = {q(pause_image())}
  [plugins.'io.containerd.cri.v1.runtime']
    cdi_spec_dirs = [{cdi}]
    # The kubelet asks for -998 on the pause container; without CAP_SYS_RESOURCE that fails unless
    # containerd keeps scores at or above its own.
    restrict_oom_score_adj = true
    enable_selinux = false
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = "runc"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        snapshotter = {q(self.snapshotter)}
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = {q(str(bin_dir / 'runc'))}
          Root = {q(str(d / 'containerd' / 'runc'))}
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = [{q(str(d / 'cni' / 'bin'))}]
      conf_dir = {q(str(d / 'cni' / 'net.d'))}
      max_conf_num = 1
  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
  [plugins.'io.containerd.internal.v1.opt']
    path = {q(str(d / 'containerd' / 'opt'))}
  [plugins.'io.containerd.image-verifier.v1.bindir']
    bin_dir = {q(str(d / 'containerd' / 'image-verifier'))}
  [plugins.'io.containerd.nri.v1.nri']
    disable = true
  [plugins.'io.containerd.shim.v1.manager']
    socket_dir = {q(str(d / 'run' / 's'))}
"""

    @property
    def _certs_dir(self) -> Path:
        return self._dir / "containerd" / "certs.d"

    def _write_registry_hosts(self) -> None:
        """containerd's hosts.toml per registry of `registry_cas`: HTTPS with that CA."""
        for host, ca in self.registry_cas.items():
            d = self._certs_dir / host
            d.mkdir(parents=True, exist_ok=True)
            q = json.dumps
            (d / "hosts.toml").write_text(f'server = {q("https://" + host)}\n\n[host.{q("https://" + host)}]\n'
                                          f'  capabilities = ["pull", "resolve"]\n  ca = {q(str(ca))}\n')

    def _pick_snapshotter(self) -> str:
        """overlayfs when the kernel mounts it in the work dir's file system, else the copying native one."""
        base = self._dir / "overlay-probe"
        for sub in ("lower", "upper", "work", "merged"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        opts = f"lowerdir={base / 'lower'},upperdir={base / 'upper'},workdir={base / 'work'}"
        proc = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(base / "merged")],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            subprocess.run(["umount", str(base / "merged")], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
        if proc.returncode != 0:
            log.warning("overlayfs does not mount here (%s); containerd uses the native snapshotter",
                        proc.stderr.strip())
        return "overlayfs" if proc.returncode == 0 else "native"

    def _start_containerd(self, bin_dir: Path) -> None:
        d = self._dir
        for sub in ("logs", "run", "containerd", "cni/bin", "cni/net.d"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for cdi in self.cdi_dirs:
            cdi.mkdir(parents=True, exist_ok=True)
        # Only loopback: the runtime reports its network ready and hostNetwork pods need no CNI plugin.
        (d / "cni" / "net.d" / "10-loopback.conflist").write_text(json.dumps(
            {"cniVersion": "1.0.0", "name": "loopback", "plugins": [{"type": "loopback"}]}))
        self.snapshotter = self._pick_snapshotter()
        self._write_registry_hosts()
        config = d / "containerd.toml"
        config.write_text(self._containerd_config(bin_dir))
        # The shim finds runc and itself on PATH; keep the node's binaries first.
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}
        with open(self.containerd_log, "ab") as out:
            self._containerd = subprocess.Popen([str(bin_dir / "containerd"), "--config", str(config)],
                                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                start_new_session=True, cwd=d, env=env)
        self._update_record_pids()
        deadline = time.monotonic() + self.startup_timeout
        last = ""
        while time.monotonic() < deadline:
            if self._containerd.poll() is not None:
                raise NodeError(f"containerd exited with {self._containerd.returncode} at start-up\n{self.logs_tail()}")
            if self.containerd_socket.exists():
                proc = self.ctr("version", check=False, timeout=10)
                if proc.returncode == 0:
                    return
                last = proc.stderr.strip()
            time.sleep(0.1)
        raise NodeError(f"containerd did not answer on {self.containerd_socket} within "
                        f"{self.startup_timeout:.0f}s (last: {last})\n{self.logs_tail()}")

    def _import_images(self, bin_dir: Path) -> None:
        for archive, image in IMAGE_ARCHIVES.items():
            ref = image()
            self.ctr("images", "import", "--snapshotter", self.snapshotter, str(self.images_dir / archive), timeout=120)
            names = self.ctr("images", "ls", "-q").stdout.split()
            if ref not in names:
                raise NodeError(f"importing {archive} did not create image {ref} (images: {names})")

    def _kubelet_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            # The API server reaches the kubelet (logs, exec) through the node's Hostname address: serve on
            # loopback only, where anonymous access harms no one, rather than on the node IP.
            "address": "127.0.0.1", "port": self.ports["kubelet"], "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": self.ports["healthz"],
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root, "cgroupsPerQOS": True,
            "failSwapOn": False, "podLogsDir": str(self.pod_logs_dir),
            "registerNode": True, "serializeImagePulls": False,
            # Images cannot be pulled back here: never collect them, and never evict for a nearly full disk.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "nodefs.inodesFree": "1%",
                             "imagefs.available": "1%"},
            "nodeStatusUpdateFrequency": "2s", "nodeStatusReportFrequency": "10s",
            "syncFrequency": "10s", "fileCheckFrequency": "10s",
            "resolvConf": "/etc/resolv.conf" if Path("/etc/resolv.conf").exists() else "",
        }
        if not cgroup_v2_only():
            cfg["failCgroupV1"] = False
        cfg.update(self.kubelet_config_overrides)
        return cfg

    def _kubelet_argv(self, bin_dir: Path) -> list[str]:
        d = self._dir
        # With the Node authorizer the kubelet must be system:node:<name>, as in a real cluster; else the admin.
        kubeconfig = (self.cluster.node_kubeconfig(self.name) if self.cluster.node_authorization
                      else self.cluster.kubeconfig)
        argv = [str(bin_dir / "kubelet"), f"--config={d / 'kubelet-config.yaml'}",
                f"--kubeconfig={kubeconfig}", f"--root-dir={self.root_dir}",
                f"--cert-dir={d / 'kubelet-pki'}", f"--hostname-override={self.name}", f"--node-ip={self.node_ip}",
                f"--v={self.kubelet_verbosity}"]
        if self.labels:
            argv.append("--node-labels=" + ",".join(f"{k}={v}" for k, v in sorted(self.labels.items())))
        return argv + self.kubelet_args

    def _start_kubelet_until_ready(self, bin_dir: Path, since: float) -> None:
        """Starts the kubelet and waits until the node is Ready (see `_wait_ready`). `free_port` only finds a
        port that is free now: another process may bind it before the kubelet does. When the kubelet's log says
        one of its ports was taken, it is stopped and started again on new ports, up to KUBELET_PORT_ATTEMPTS
        times. (containerd binds no TCP port here: its stream server takes port 0.)"""
        for attempt in range(1, KUBELET_PORT_ATTEMPTS + 1):
            self._start_kubelet(bin_dir, new_ports=attempt > 1)
            try:
                self._wait_ready(since)
                return
            except PortTaken as exc:
                _terminate(self._kubelet)
                if attempt == KUBELET_PORT_ATTEMPTS:
                    raise NodeError(f"node {self.name}: the kubelet found its port taken {attempt} times in a "
                                    f"row (last: {exc.port})\n{self.logs_tail()}") from exc
                log.warning("node %s: kubelet port %d was taken before the kubelet bound it; starting it again "
                            "on new ports", self.name, exc.port)

    def _start_kubelet(self, bin_dir: Path, new_ports: bool = False) -> None:
        d = self._dir
        if not self.ports or new_ports:
            self.ports = {"kubelet": free_port(), "healthz": free_port()}
            self.node_ip = self.node_ip or node_ip()
            (d / "kubelet-config.yaml").write_text(yaml.safe_dump(self._kubelet_config(), sort_keys=False))
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}
        self._kubelet_log_start = self.kubelet_log.stat().st_size if self.kubelet_log.exists() else 0
        with open(self.kubelet_log, "ab") as out:
            self._kubelet = subprocess.Popen(self._kubelet_argv(bin_dir), stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True, cwd=d, env=env)
        self._update_record_pids()

    def _check_ports(self) -> None:
        """Raises PortTaken when this kubelet's log (since its start) says one of its ports was in use: the
        kubelet exits for its server port, but only logs and retries for its healthz port, where another
        process might even answer in its place."""
        try:
            with open(self.kubelet_log, "rb") as f:
                f.seek(self._kubelet_log_start)
                text = f.read().decode(errors="replace")
        except OSError:
            return
        port = port_taken(text, self.ports.values())
        if port is not None:
            raise PortTaken(port)

    def _kubelet_healthy(self) -> bool:
        url = f"http://127.0.0.1:{self.ports['healthz']}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return bool(resp.status == 200 and resp.read().strip() == b"ok")
        except (OSError, urllib.error.URLError):
            return False

    def _wait_ready(self, since: float) -> None:
        """Waits until this kubelet process answers /healthz (its sync loop runs) and the Node reports Ready
        with a heartbeat from `since` (a Unix time) on."""
        deadline = time.monotonic() + self.startup_timeout
        last = "not registered yet"
        while time.monotonic() < deadline:
            self._check_ports()
            self.check_running()
            if not self._kubelet_healthy():
                last = "kubelet /healthz not ok yet"
                time.sleep(0.2)
                continue
            try:
                node = self.cluster.request("GET", f"/api/v1/nodes/{self.name}")
            except ClusterError as exc:
                if "HTTP 404" not in str(exc):
                    raise
                node = {}
            for cond in node.get("status", {}).get("conditions", []):
                if cond.get("type") == "Ready":
                    last = f"Ready={cond.get('status')} ({cond.get('reason')}: {cond.get('message')})"
                    beat = calendar.timegm(time.strptime(cond["lastHeartbeatTime"], "%Y-%m-%dT%H:%M:%SZ"))
                    # Heartbeats have whole seconds.
                    if cond.get("status") == "True" and beat >= int(since):
                        return
            time.sleep(0.5)
        raise NodeError(f"node {self.name} not Ready within {self.startup_timeout:.0f}s (last: {last})\n"
                        f"{self.logs_tail()}")

    def _stop_all_tasks(self) -> None:
        """Kills and deletes every task (containers first, then sandboxes: containerd refuses to delete a
        sandbox task with containers), so that the shims unmount their root file systems and exit."""
        for _ in range(3):
            tasks = self.ctr("tasks", "ls", "-q", timeout=20).stdout.split()
            if not tasks:
                return
            for task in tasks:
                self.ctr("tasks", "kill", "--signal", "SIGKILL", "--all", task, check=False, timeout=20)
            for task in tasks:
                self.ctr("tasks", "delete", "--force", task, check=False, timeout=30)


KUBELET_PORT_ATTEMPTS = 3
# Go's net.Listen error, as the kubelet logs it: `listen tcp 127.0.0.1:10250: bind: address already in use`.
_BIND_FAILED = re.compile(r"listen tcp [^\s\"]*:(\d+): bind: address already in use")


class PortTaken(NodeError):
    """The kubelet could not bind one of its ports: something else took it after `free_port` found it free."""

    def __init__(self, port: int) -> None:
        super().__init__(f"port {port} is already in use")
        self.port = port


def port_taken(log_text: str, ports: Iterable[int]) -> int | None:
    """The first of `ports` that `log_text` (kubelet output) says could not be bound, if any."""
    wanted = set(ports)
    for m in _BIND_FAILED.finditer(log_text):
        if int(m.group(1)) in wanted:
            return int(m.group(1))
    return None


def parse_cri_log(text: str) -> str:
    """The payload of a CRI log file (``<time> <stream> <P|F> <text>`` per line; P lines continue)."""
    out: list[str] = []
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3:
            continue
        payload = parts[3] if len(parts) == 4 else ""
        out.append(payload if parts[2] == "P" else payload + "\n")
    return "".join(out)


def _terminate(proc: subprocess.Popen[bytes] | None, grace: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=grace)
