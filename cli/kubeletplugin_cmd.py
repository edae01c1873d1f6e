"""`gpu-dra kubelet-plugin`: the node plugin (registration with the kubelet, ResourceSlices of this node,
prepare/unprepare, device health, metrics).

Every flag can also come from the environment variable named in its help, so a DaemonSet can set them with
the downward API (NODE_NAME from spec.nodeName, POD_UID from metadata.uid).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME
from cli.options import add_log_level

if TYPE_CHECKING:                       # loaded when the plugin starts, not when the parsers are built
    from kubeletplugin.options import PluginOptions

PROG = "gpu-dra kubelet-plugin"
# In --help (cli.main), with the statuses of cluster failures (cli.failures).
EXIT_STATUS = {0: "stopped (SIGTERM)", 2: "a flag, the node policy or the node's driver cannot be used"}
USES_CLUSTER = True

# flag -> (environment variable, default, help)
_STRING_FLAGS: dict[str, tuple[str, str | None, str]] = {
    "--node-name": ("NODE_NAME", None, "this node's name: the pool name and the slices' nodeName (required)"),
    "--driver-name": ("DRIVER_NAME", DEFAULT_DRIVER_NAME, f"DRA driver name (default {DEFAULT_DRIVER_NAME}; "
                                                          f"{NVIDIA_DRIVER_NAME} with --compat-nvidia)"),
    "--kubeconfig": ("KUBECONFIG", None, "kubeconfig file (default: in-cluster service account)"),
    "--registry-dir": ("KUBELET_REGISTRAR_DIRECTORY_PATH", "/var/lib/kubelet/plugins_registry",
                       "the kubelet's plugin registry directory"),
    "--plugin-dir": ("PLUGIN_DIR", None,
                     "directory for the DRA socket (default /var/lib/kubelet/plugins/<driver>)"),
    "--cdi-root": ("CDI_ROOT", "/var/run/cdi", "directory the container runtime reads CDI specs from"),
    "--driver-root": ("NVIDIA_DRIVER_ROOT", "/", "where this process sees the NVIDIA driver's files"),
    "--host-driver-root": ("NVIDIA_HOST_DRIVER_ROOT", None,
                           "the driver root as the host sees it, for CDI host paths (default: --driver-root)"),
    "--cdi-hook-path": ("CDI_HOOK_PATH", None,
                        "host path of nvidia-cdi-hook, which this process sees at the same path: every CDI spec "
                        "runs it (create-symlinks, update-ldcache, disable-device-node-modification); default: a "
                        "hook program in the driver root (a host NVIDIA Container Toolkit's); a real node without "
                        "either does not start"),
    "--dev-root": ("DEV_ROOT", "/", "where this process sees /dev"),
    "--proc-root": ("PROC_ROOT", "/proc", "where this process sees /proc"),
    "--pod-resources-socket": ("POD_RESOURCES_SOCKET", None,
                               "the kubelet's PodResources socket (<kubelet root dir>/pod-resources/kubelet.sock): "
                               "turns on the per-claim GPU metrics, which need it to know which container holds "
                               "which claim device (default: off)"),
    "--state-dir": ("STATE_DIR", None, "checkpoint and MPS directories (default: the plugin directory)"),
    "--pod-uid": ("POD_UID", None, "rolling-update mode: name the sockets after this pod UID"),
    "--node-policy": ("NODE_POLICY", None, "node policy YAML file: what to publish per GPU"),
    "--fleet": ("FLEET", None, "simulated node: take this node's GPUs from the fleet file"),
    "--sim-state": ("SIM_STATE", None, "simulated node: file where the GPUs' MIG instances, MIG and compute modes "
                                       "outlive plugin restarts as on hardware (default "
                                       "<state-dir>/simulated-gpus.json; 'none': in memory only)"),
    "--mps-cgroup": ("MPS_CGROUP", "", "a cgroup, as a path below the host's cgroup root (e.g. gpu-dra-mps), that MPS "
                                       "daemons join in every hierarchy under --mps-cgroup-root, created where "
                                       "missing, so a container restart does not end them; needs the host's PID "
                                       "namespace where the container has a private cgroup namespace (empty: off)"),
    "--mps-cgroup-root": ("MPS_CGROUP_ROOT", "/sys/fs/cgroup",
                          "where this process sees the host's cgroup hierarchies (its /sys/fs/cgroup mounted here)"),
    "--boot-id-path": ("BOOT_ID_PATH", "/proc/sys/kernel/random/boot_id", "kernel boot ID file (reboot detection)"),
}


def _env_bool(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_number(name: str, default: float, kind: Callable[[str], float]) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(f"gpu-dra kubelet-plugin: environment {name}={raw!r} is not a number") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, (env, default, help_text) in _STRING_FLAGS.items():
        parser.add_argument(flag, default=os.environ.get(env) or default, help=f"{help_text} [env {env}]")
    parser.add_argument("--compat-nvidia", action="store_true", default=_env_bool("COMPAT_NVIDIA"),
                        help="accept NVIDIA's opaque configs and use NVIDIA's driver name [env COMPAT_NVIDIA]")
    parser.add_argument("--metrics-port", type=int, default=int(_env_number("METRICS_PORT", 0, int)),
                        help="serve Prometheus /metrics, and /healthz, /readyz, /livez for probes, on this port "
                             "(0: off) [env METRICS_PORT]")
    parser.add_argument("--health-interval", type=float, default=_env_number("HEALTH_INTERVAL", 10.0, float),
                        help="seconds between full device-health messages to the kubelet [env HEALTH_INTERVAL]")
    parser.add_argument("--health-quiet-period", type=float,
                        default=_env_number("HEALTH_QUIET_PERIOD", 300.0, float), metavar="SECONDS",
                        help="remove a device's XID/ECC taint after this many seconds without a new event on it "
                             "(0: never; a lost GPU's taint goes when it answers again) [env HEALTH_QUIET_PERIOD]")
    parser.add_argument("--mps-cgroup-procs", default=os.environ.get("MPS_CGROUP_PROCS", ""), metavar="FILES",
                        help="comma-separated cgroup.procs files MPS daemons move into, outside this container's "
                             "cgroup, so a container restart does not end them [env MPS_CGROUP_PROCS]")
    parser.add_argument("--mps-shm-tmpfs", default=os.environ.get("MPS_SHM_TMPFS", "auto"),
                        choices=["auto", "true", "false"],
                        help="each MPS daemon's /dev/shm is a tmpfs of the node policy's mps.shmSize (auto: on real "
                             "nodes, off for simulated fleets) [env MPS_SHM_TMPFS]")
    add_log_level(parser, "info", env="LOG_LEVEL")
    parser.add_argument("--log-format", default=os.environ.get("LOG_FORMAT", "json"), choices=["json", "text"],
                        help="log format [env LOG_FORMAT]")


def options_from_args(args: argparse.Namespace) -> PluginOptions:
    from kubeletplugin.options import PluginOptions

    driver = args.driver_name
    if args.compat_nvidia and driver == DEFAULT_DRIVER_NAME:
        driver = NVIDIA_DRIVER_NAME
    if args.health_interval <= 0:
        raise ValueError(f"--health-interval {args.health_interval}: must be positive")
    if not args.health_quiet_period >= 0:   # also refuses NaN
        raise ValueError(f"--health-quiet-period {args.health_quiet_period}: must be 0 (never) or positive")
    return PluginOptions(
        node_name=args.node_name or "", driver_name=driver, kubeconfig=args.kubeconfig,
        registry_dir=args.registry_dir, plugin_dir=args.plugin_dir, cdi_root=args.cdi_root,
        driver_root=args.driver_root, host_driver_root=args.host_driver_root, cdi_hook_path=args.cdi_hook_path,
        dev_root=args.dev_root, pod_resources_socket=args.pod_resources_socket or "",
        proc_root=args.proc_root, state_dir=args.state_dir, pod_uid=args.pod_uid, node_policy=args.node_policy,
        fleet=args.fleet, sim_state=args.sim_state, compat_nvidia=args.compat_nvidia, metrics_port=args.metrics_port,
        health_interval=args.health_interval, boot_id_path=args.boot_id_path,
        health_quiet_period=args.health_quiet_period,
        mps_cgroup_procs=tuple(p for p in args.mps_cgroup_procs.split(",") if p),
        mps_cgroup=_cgroup_path(args.mps_cgroup or ""), mps_cgroup_root=args.mps_cgroup_root,
        mps_shm_tmpfs={"auto": None, "true": True, "false": False}[args.mps_shm_tmpfs],
    )


def _cgroup_path(path: str) -> str:
    """A cgroup below the root: '/a/b' and 'a/b' alike, never '.' or '..' ("": off)."""
    parts = [p for p in path.strip().split("/") if p]
    if any(p in (".", "..") for p in parts) or (path.strip() and not parts):
        raise ValueError(f"--mps-cgroup {path!r}: must name a cgroup below the cgroup root, without '.' or '..'")
    return "/".join(parts)


def run(args: argparse.Namespace) -> int:
    from kubeletplugin.transport.sockets import SocketPathError

    # The sockets first, with nothing slow imported yet: the kubelet registers the plugin at once and its calls
    # wait for the driver, instead of finding no plugin for as long as imports, discovery and recovery take.
    endpoints = None
    try:
        options = options_from_args(args)
        if not options.node_name:
            print("gpu-dra kubelet-plugin: --node-name (or NODE_NAME) is required", file=sys.stderr)
            return 2
        from kubeletplugin.transport.endpoints import start_endpoints

        endpoints = start_endpoints(options.driver_name, options.registry_dir, options.plugin_directory,
                                    options.pod_uid, options.health_interval)
    except (SocketPathError, ValueError, OSError) as exc:
        print(f"gpu-dra kubelet-plugin: {exc}", file=sys.stderr)
        return 2

    from cli.failures import report
    from kube.connect import ConnectError
    from kubeletplugin.logs import configure_logging
    from kubeletplugin.plugin import KubeletPlugin, PluginConfigError

    configure_logging(args.log_level, json_output=args.log_format == "json")
    try:
        plugin = KubeletPlugin(options, endpoints=endpoints)
        return plugin.run()          # stops the sockets too, also after a failed start
    except (PluginConfigError, SocketPathError, ConnectError, ValueError) as exc:
        return report(PROG, exc)
    finally:
        endpoints.stop()             # idempotent: gone already after a normal stop
