"""A simulated GPU node for end-to-end tests: the Node object, ``gpu-dra kubelet-plugin`` as a subprocess with
its own directories, and a kubelet stand-in watching that plugin's registry directory."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from kube.client import KubeApi
from standin.kubelet import KubeletStandin
from standin.workloads import complete_pool, node_slices, wait_until
from testbed.nodeplugin import mps_daemons_under, scrape_metrics

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PluginDirs:
    """The plugin's directories under one short base (unix socket paths are limited to 107 bytes)."""

    def __init__(self, base: Path):
        self.base = base
        self.registry = base / "registry"
        self.plugins = base / "plugins"
        self.cdi = base / "cdi"
        self.state = base / "state"
        self.sim_state = self.state / "simulated-gpus.json"   # the simulated GPUs, outliving plugin restarts
        self.host = base / "host"         # fake driver installation (driver root, /dev, /proc)
        for d in (self.registry, self.plugins, self.cdi, self.state):
            d.mkdir(parents=True, exist_ok=True)


class PluginProcess:
    """``gpu-dra kubelet-plugin`` for one simulated node."""

    def __init__(self, *, node: str, driver: str, kubeconfig: Path, fleet: Path, dirs: PluginDirs,
                 host: Any = None, metrics_port: int = 0, extra_args: tuple[str, ...] = ()):
        self.node, self.driver, self.kubeconfig, self.fleet, self.dirs = node, driver, kubeconfig, fleet, dirs
        self.host = host                  # fixtures.fake_driver_root.FakeDriverTree, or None
        self.metrics_port = metrics_port
        self.extra_args = extra_args
        self.env: dict[str, str] = {}     # extra environment of the next start (e.g. the GPU_DRA_FAULT test hook)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.dirs.base / f"plugin-{self.starts}.log"

    def argv(self) -> list[str]:
        argv = [
            sys.executable, "-m", "cli.main", "kubelet-plugin",
            "--node-name", self.node, "--driver-name", self.driver, "--kubeconfig", str(self.kubeconfig),
            "--registry-dir", str(self.dirs.registry), "--plugin-dir", str(self.dirs.plugins),
            "--cdi-root", str(self.dirs.cdi), "--state-dir", str(self.dirs.state), "--fleet", str(self.fleet),
            "--sim-state", str(self.dirs.sim_state),
        ]
        if self.host is not None:
            argv += ["--driver-root", str(self.host.root), "--dev-root", str(self.host.dev_root),
                     "--proc-root", str(self.host.proc_root)]
        if self.metrics_port:
            argv += ["--metrics-port", str(self.metrics_port)]
        return argv + ["--log-format", "text", *self.extra_args]

    def start(self) -> None:
        if self.alive:
            raise RuntimeError(f"plugin for {self.node} is already running (pid {self.proc.pid})")
        self.starts += 1
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (the plugin removes its sockets and exits), then SIGKILL; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout)
        return self.proc.returncode

    def kill(self) -> None:
        """A crash: SIGKILL, sockets stay behind."""
        if self.alive:
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Wait for the process to end by itself; its exit code."""
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def check_alive(self) -> None:
        if not self.alive:
            code = self.proc.returncode if self.proc else None
            raise AssertionError(f"kubelet plugin of {self.node} is not running (exit {code}):\n{self.log_tail()}")


class SimulatedNode:
    """One node of a fleet file, with its plugin process and its kubelet stand-in.

    ``fleet`` is a fleet document (dict) or file; the node named ``name`` must be in it.
    """

    def __init__(self, cluster: Any, api_client: Any, *, name: str, driver: str, fleet: dict[str, Any] | Path,
                 fake_driver_root: bool = True, dra_services: tuple[str, ...] | None = None,
                 extra_args: tuple[str, ...] = ()):
        self.cluster = cluster
        self.api = KubeApi(api_client)
        self.name = name
        self.driver = driver
        self.dirs = PluginDirs(Path(tempfile.mkdtemp(prefix="e2e-", dir="/tmp")))
        if isinstance(fleet, dict):
            fleet_path = self.dirs.base / "fleet.yaml"
            fleet_path.write_text(yaml.safe_dump(fleet, sort_keys=False))
        else:
            fleet_path = fleet
        self.fleet_path = fleet_path
        self.host = self._fake_host(fleet) if fake_driver_root else None
        self.metrics_port = free_port()
        self.plugin = PluginProcess(node=name, driver=driver, kubeconfig=cluster.kubeconfig, fleet=fleet_path,
                                    dirs=self.dirs, host=self.host, metrics_port=self.metrics_port,
                                    extra_args=extra_args)
        kwargs = {"dra_services": dra_services} if dra_services else {}
        self.kubelet = KubeletStandin(name, self.dirs.registry, api_client, **kwargs)

    def _fake_host(self, fleet: dict[str, Any] | Path) -> Any:
        """A fake driver installation with a /dev/nvidia<minor> per GPU of the node (minor = index)."""
        from fixtures.fake_driver_root import build_fake_driver_root

        doc = fleet if isinstance(fleet, dict) else yaml.safe_load(Path(fleet).read_text())
        node = next(n for n in doc["nodes"] if n["name"] == self.name)
        count = sum(g.get("count", 1) for g in node.get("gpus") or [])
        return build_fake_driver_root(self.dirs.host, gpu_minors=tuple(range(count)))

    def metrics(self) -> dict[str, float]:
        """The plugin's Prometheus samples, ``name{labels}`` -> value."""
        return scrape_metrics(self.metrics_port)

    # --- lifecycle --------------------------------------------------------------------------------------

    def start(self, slices_timeout: float = 60.0) -> SimulatedNode:
        try:
            self.cluster.add_node(self.name)
        except Exception as exc:  # noqa: BLE001 - an existing node is fine (e.g. a second run against one cluster)
            if "AlreadyExists" not in str(exc) and "409" not in str(exc):
                raise
        self.plugin.start()
        self.kubelet.start()
        self.wait_registered()
        self.wait_for_slices(slices_timeout)
        return self

    def wait_registered(self, timeout: float = 60.0, newer_than: float | None = None):
        """Wait until the stand-in has registered the plugin and the plugin has finished starting (its sockets
        come first, before start-up recovery); fails at once if the plugin process exits."""
        deadline = time.monotonic() + timeout
        while True:
            self.plugin.check_alive()
            try:
                registered = self.kubelet.wait_for_plugin(self.driver, min(1.0, timeout), newer_than=newer_than)
                break
            except TimeoutError as exc:
                if time.monotonic() >= deadline:
                    raise AssertionError(f"{exc}\nplugin log:\n{self.plugin.log_tail()}") from None
        while "kubelet plugin serving" not in self.plugin.log_path.read_text(errors="replace"):
            self.plugin.check_alive()
            if time.monotonic() >= deadline:
                raise AssertionError(f"plugin registered but not serving after {timeout} s\n{self.plugin.log_tail()}")
            time.sleep(0.05)
        return registered

    def wait_for_slices(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        def ready():
            self.plugin.check_alive()
            slices = node_slices(self.api, self.driver, self.name)
            return slices if complete_pool(slices) else None

        return wait_until(ready, timeout, f"ResourceSlices of {self.driver} on {self.name}")

    def restart_plugin(self, *, crash: bool = False, env: dict[str, str] | None = None) -> None:
        """Stop (or kill) the plugin, unless it already exited, and start it again with ``env`` added to its
        environment; returns once the new instance is registered."""
        before = self.kubelet.watcher.plugin(self.driver)
        if crash:
            self.plugin.kill()
        else:
            self.plugin.stop()
        self.plugin.env = dict(env or {})
        self.plugin.start()
        self.wait_registered(newer_than=before.registered_at if before else None)

    def stop(self) -> None:
        self.kubelet.stop()
        self.plugin.stop()
        # MPS daemons outlive the plugin by design; a test that ends with claims prepared leaves them.
        kill_mps_daemons_under(self.dirs.base)
        try:
            self.cluster.delete_node(self.name)
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
        shutil.rmtree(self.dirs.base, ignore_errors=True)

    def __enter__(self) -> SimulatedNode:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- what the plugin left on the node ---------------------------------------------------------------

    def cdi_spec_files(self) -> list[Path]:
        return sorted(p for p in self.dirs.cdi.iterdir() if p.is_file())

    def checkpoint(self) -> dict[str, Any]:
        """The plugin's checkpoint document ({} when it has not written one)."""
        files = sorted(self.dirs.state.glob("checkpoint*.json"))
        return json.loads(files[0].read_text()) if files else {}

    def checkpoint_claims(self) -> dict[str, Any]:
        """The plugin's prepared claims by UID, as raw records (snapshot with its journal replayed)."""
        from dra.node.checkpoint import read_checkpoint

        return read_checkpoint(self.dirs.state / "checkpoint.json")

    def mps_daemons(self) -> dict[int, Path]:
        """The node's running MPS control daemons (real processes of the simulated tool): pid -> pipe dir."""
        return mps_daemons_under(self.dirs.base)

    def hardware(self) -> Any:
        """The node's simulated GPUs as the plugin left them: a FakeNvml (initialised) over the plugin's
        --sim-state file, so it sees (and may make) the same MIG devices, modes and lost GPUs."""
        from dra.sim.fleet import load_fleet, nvml_for_node

        nvml = nvml_for_node(load_fleet(self.fleet_path).node(self.name), state_file=self.dirs.sim_state)
        nvml.nvmlInit()
        return nvml

    def mig_devices(self) -> list[Any]:
        """Every MIG device on the node's simulated GPUs now (dra.node.migdevices.MigLive)."""
        from dra.node import migdevices as hardware

        nvml = self.hardware()
        return [m for uuid in nvml.gpu_uuids for m in hardware.list_mig_devices(nvml, uuid)]


def kill_mps_daemons_under(root: Path) -> list[int]:
    """SIGKILL every MPS control daemon whose pipe directory lies under ``root`` and wait until each is dead
    (gone, or a zombie: a signal is only queued when kill returns); returns their pids."""
    killed = []
    for pid in mps_daemons_under(root):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in killed):
        assert time.monotonic() < deadline, f"MPS daemons {killed} still run 10 s after SIGKILL"
        time.sleep(0.01)
    return killed


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
