"""`gpu-dra kubelet-plugin` for a real local node (`testbed.localnode.LocalNode`), with the node's GPUs simulated.

The plugin talks to the node's real kubelet: its registration socket goes into the kubelet's plugin registry
directory, its DRA socket under the kubelet's plugins directory, its CDI specs into the directory containerd
reads. Its own files (state, the simulated GPUs' state file, an empty driver root, logs) live in the node's
work dir, so `LocalNode.stop` removes them and `cleanup_leftovers` kills a plugin left by a killed process
(its command line names the work dir).

The driver root is empty on purpose: a simulated node has no driver files, so the CDI specs describe
``/dev/nvidia*`` by major/minor and runc creates those nodes in the container. The plugin gets the driver's own
``nvidia-cdi-hook`` (hack/build-cdi-tools.sh, cached under ~/.cache/gpu-dra/cdi-hook) as on a real node, so runc
runs the hooks every spec names.
"""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from testbed.hostplumbing import processes_mentioning
from testbed.localcluster import free_port
from testbed.localnode import LocalNode

_REPO = Path(__file__).resolve().parents[1]
_CDI_TOOLS_SCRIPT = _REPO / "hack" / "build-cdi-tools.sh"
_LOG_TAIL_LINES = 40
SIM_STATE_FILE = "simulated-gpus.json"


class NodePluginError(RuntimeError):
    """The plugin did not start, exited, or was not registered in time; the message has its log tail."""


def find_cdi_hook(build: bool = True) -> Path:
    """The nvidia-cdi-hook of hack/build-cdi-tools.sh (NVIDIA_CTK_VERSION): reused from its cache, or built
    (about a minute) unless `build` is False. On this machine its path is the host path runc runs."""
    env = {**os.environ, **({} if build else {"GPU_DRA_CDI_NO_BUILD": "1"})}
    proc = subprocess.run(["bash", str(_CDI_TOOLS_SCRIPT), "hook"], capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-_LOG_TAIL_LINES:])
        raise NodePluginError(f"{_CDI_TOOLS_SCRIPT.name} hook failed (exit {proc.returncode}):\n{tail}")
    return Path(lines[-1])


class LocalNodePlugin:
    """One ``gpu-dra kubelet-plugin`` process for `node` (a started LocalNode) and `driver`.

    `fleet` is a fleet file with a node named like `node`. `extra_args` are added to the command line (e.g.
    ``--compat-nvidia``, ``--health-quiet-period 0``); `python` runs ``-m cli.main`` from the checkout. Every
    start gets a log file of its own."""

    def __init__(self, node: LocalNode, fleet: Path | str, driver: str, *, extra_args: Sequence[str] = (),
                 log_level: str = "info", env: dict[str, str] | None = None,
                 python: Sequence[str] = (sys.executable,)) -> None:
        if node.workdir is None:
            raise NodePluginError("the node is not started")
        self.node = node
        self.fleet = Path(fleet)
        self.driver = driver
        self.extra_args = list(extra_args)
        self.log_level = log_level
        self.env = dict(env or {})
        self.python = list(python)      # the interpreter and its options (e.g. -S with the image's wheels)
        # Short: the MPS control sockets live under the state dir, and unix socket paths end at 107 bytes.
        self.base = Path(node.workdir) / f"p-{hashlib.sha256(driver.encode()).hexdigest()[:6]}"
        self.state_dir = self.base / "state"
        self.driver_root = self.base / "driver-root"
        for d in (self.state_dir, self.driver_root):
            d.mkdir(parents=True, exist_ok=True)
        self.cdi_hook = find_cdi_hook()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    # ---- paths ------------------------------------------------------------------------------------

    @property
    def cdi_dir(self) -> Path:
        return Path(self.node.cdi_dirs[0])

    @property
    def plugin_dir(self) -> Path:
        return Path(self.node.plugins_dir) / self.driver

    @property
    def registration_socket(self) -> Path:
        return Path(self.node.plugins_registry_dir) / f"{self.driver}-reg.sock"

    @property
    def sim_state(self) -> Path:
        """The simulated GPUs' state file (``gpu-dra simulate --sim-state``)."""
        return self.state_dir / SIM_STATE_FILE

    @property
    def log_path(self) -> Path:
        return self.base / f"plugin-{self.starts}.log"

    def argv(self) -> list[str]:
        return [*self.python, "-m", "cli.main", "kubelet-plugin", "--node-name", self.node.name,
                "--driver-name", self.driver, "--kubeconfig", str(self.node.cluster.kubeconfig),
                "--registry-dir", str(self.node.plugins_registry_dir), "--plugin-dir", str(self.plugin_dir),
                "--cdi-root", str(self.cdi_dir), "--state-dir", str(self.state_dir), "--fleet", str(self.fleet),
                "--sim-state", str(self.sim_state), "--driver-root", str(self.driver_root),
                "--dev-root", str(self.driver_root), "--cdi-hook-path", str(self.cdi_hook),
                # MPS shared memory as on a real node: a tmpfs per daemon (unmounted with the node's work dir).
                "--mps-shm-tmpfs", "true",
                "--metrics-port", str(self.metrics_port),
                "--log-format", "text", "--log-level", self.log_level, *self.extra_args]

    # ---- lifecycle --------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "LocalNodePlugin":
        """Starts the process and returns at once (see `wait_registered`)."""
        if self.proc is not None and self.proc.poll() is None:
            raise NodePluginError(f"the plugin of {self.driver} already runs (pid {self.proc.pid})")
        self.starts += 1
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv(), cwd=_REPO, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})
        return self

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (the plugin removes its sockets; prepared claims stay prepared), then SIGKILL."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout)
        return self.proc.returncode

    def kill(self) -> None:
        """A crash: SIGKILL, the sockets stay behind."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)

    def check_alive(self) -> None:
        if not self.alive:
            code = self.proc.returncode if self.proc else None
            raise NodePluginError(f"the kubelet plugin of {self.driver} on {self.node.name} is not running "
                                  f"(exit {code}):\n{self.log_tail()}")

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    # ---- what it says -----------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """The plugin's Prometheus samples, ``name{labels}`` -> value."""
        return scrape_metrics(self.metrics_port)

    def mps_daemons(self) -> dict[int, Path]:
        """The (simulated) MPS control daemons this plugin started that run now: pid -> pipe directory. They
        run in their own sessions and outlive the plugin process, as on a real node."""
        return mps_daemons_under(self.base)

    def registered(self) -> bool:
        """Whether the kubelet has accepted this process's registration (its NotifyRegistrationStatus)."""
        try:
            return self.metrics().get("gpu_dra_kubelet_registered") == 1.0
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def wait_registered(self, timeout: float = 60.0) -> None:
        """Waits until the real kubelet has registered this plugin process."""
        deadline = time.monotonic() + timeout
        while not self.registered():
            self.check_alive()
            if time.monotonic() > deadline:
                raise NodePluginError(f"the kubelet did not register the plugin of {self.driver} within "
                                      f"{timeout:.0f}s\n--- plugin log ---\n{self.log_tail()}\n"
                                      f"{self.node.logs_tail()}")
            time.sleep(0.2)


def scrape_metrics(port: int) -> dict[str, float]:
    """A plugin's Prometheus samples on 127.0.0.1:``port``, ``name{labels}`` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def mps_daemons_under(root: Path) -> dict[int, Path]:
    """Running MPS control daemons (``nvidia-cuda-mps-control -d``) whose environment names a directory under
    ``root``: pid -> pipe directory."""
    found = {}
    for pid in processes_mentioning(f"{root}/", environ=True):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if Path(argv[0].decode(errors="replace")).name == "nvidia-cuda-mps-control" and b"-d" in argv[1:]:
            pipe = next((e.partition(b"=")[2].decode() for e in environ
                         if e.startswith(b"CUDA_MPS_PIPE_DIRECTORY=")), "")
            found[pid] = Path(pipe)
    return found
