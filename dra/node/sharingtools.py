"""The seam for GPU sharing settings NVML does not cover: time-slice interval, compute mode, MPS daemons.

``SharingControl`` is the one small interface. ``NvidiaSmiSharingControl`` runs the driver's own programs
(``nvidia-smi`` and ``nvidia-cuda-mps-control``, never through a shell; MPS daemons through the
``dra.node.mpslaunch`` helper, in their own session); ``dra.sim.sharingtools`` enforces the same rules in memory,
and ``dra.sim.mpscontrol`` is a simulated ``nvidia-cuda-mps-control`` program for simulated nodes.

Rules both implementations share:

* Time-slice intervals (Default=0, Short=1, Medium=2, Long=3) apply to whole GPUs; a GPU (or a MIG device)
  that does not support it fails with ``SharingNotSupported``, a clean per-claim error.
* An MPS control daemon serves one pipe directory, and is known by the identity of its process (PID and start
  time) from the moment it starts: a process elsewhere that looks like it is never taken for it. A daemon whose
  identity is not known is reached only through its control socket (``quit``), never signalled.
* A GPU in EXCLUSIVE_PROCESS compute mode admits one process, so at most one MPS daemon serves it (the
  driver runs one daemon per GPU or MIG device, and switches a whole GPU to EXCLUSIVE_PROCESS under it). The
  compute mode of a GPU an MPS daemon serves is not changed while the daemon runs.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

from dra.node.processidentity import ProcessIdentity, identify, is_alive, send_signal, wait_gone
from dra.node.safefiles import read_regular_file

log = logging.getLogger(__name__)

TimeSliceInterval = Literal["Default", "Short", "Medium", "Long"]
TIME_SLICE_VALUES: dict[str, int] = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
ComputeMode = Literal["DEFAULT", "EXCLUSIVE_PROCESS"]
COMPUTE_MODES: tuple[str, ...] = ("DEFAULT", "EXCLUSIVE_PROCESS")

MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_PID_FILE = "nvidia-cuda-mps-control.pid"      # written by the daemon into its pipe directory


class SharingError(RuntimeError):
    """A sharing action failed; the message names the GPU or daemon and the reason."""


class SharingNotSupported(SharingError):
    """The GPU does not support the requested sharing setting (e.g. time-slicing on a MIG device)."""


@dataclass(frozen=True)
class MpsDaemonSpec:
    """What an MPS control daemon serves and where its directories are."""

    pipe_dir: str
    log_dir: str
    visible_devices: tuple[str, ...]      # CUDA_VISIBLE_DEVICES: GPU or MIG UUIDs
    shm_dir: str | None = None            # becomes the daemon's /dev/shm (clients mount the same directory)


def is_mig_uuid(uuid: str) -> bool:
    return uuid.startswith("MIG-")


def check_interval(interval: str) -> int:
    if interval not in TIME_SLICE_VALUES:
        raise SharingError(f"time-slice interval {interval!r}: must be one of {', '.join(TIME_SLICE_VALUES)}")
    return TIME_SLICE_VALUES[interval]


def check_compute_mode(mode: str) -> None:
    if mode not in COMPUTE_MODES:
        raise SharingError(f"compute mode {mode!r}: must be one of {', '.join(COMPUTE_MODES)}")


class SharingControl(ABC):
    """GPU sharing actions that need the driver's tools rather than NVML."""

    @abstractmethod
    def set_time_slice(self, gpu_uuid: str, interval: str) -> None:
        """Set the GPU-wide time-slice interval (whole GPUs only)."""

    @abstractmethod
    def get_time_slice(self, gpu_uuid: str) -> str | None:
        """The current interval, or None where it cannot be read."""

    @abstractmethod
    def set_compute_mode(self, gpu_uuid: str, mode: str) -> None:
        """DEFAULT or EXCLUSIVE_PROCESS (whole GPUs only)."""

    @abstractmethod
    def start_mps_daemon(self, spec: MpsDaemonSpec) -> ProcessIdentity:
        """Start an MPS control daemon; returns once it runs, with the identity of the daemon process."""

    @abstractmethod
    def mps_daemon(self, pipe_dir: str) -> ProcessIdentity | None:
        """The running daemon of this pipe directory as its own PID file names it (checked against the process):
        how a daemon just started is identified. Never how a daemon is found again: a PID file outlives its
        daemon, and its PID can be reused by a process that only looks like one."""

    @abstractmethod
    def mps_daemon_running(self, pipe_dir: str, daemon: ProcessIdentity) -> bool:
        """Whether the daemon process ``daemon`` (started for this pipe directory) is alive."""

    @abstractmethod
    def mps_command(self, pipe_dir: str, command: str) -> str:
        """Send one control command (e.g. ``set_default_active_thread_percentage 50``); returns its reply."""

    @abstractmethod
    def stop_mps_daemon(self, pipe_dir: str, daemon: ProcessIdentity | None) -> None:
        """Stop the daemon (``quit``, then signals to ``daemon`` alone); a daemon that is not running is fine.
        ``daemon`` None: whatever daemon answers on the pipe directory's control socket is sent ``quit`` and
        waited for until the socket answers no more; no process is signalled (SharingError if it stays)."""

    def lookalikes(self, pipe_dir: str, daemon: ProcessIdentity | None) -> list[int]:
        """Processes other than ``daemon`` that present themselves as this pipe directory's daemon: never
        acted on, only reported (any pod with the host's PID namespace can start one)."""
        return []


# ----- real: the driver's programs --------------------------------------------------------------------------------
Runner = Callable[..., subprocess.CompletedProcess[str]]

class NvidiaSmiSharingControl(SharingControl):
    """Runs ``nvidia-smi`` and ``nvidia-cuda-mps-control`` from the driver (no shell involved).

    nvidia_smi / mps_control:  program paths as this process sees them (e.g. found in the driver root)
    env:                       extra environment for both (e.g. LD_LIBRARY_PATH of the driver root's libraries)
    isolate_shm:               start daemons in a private mount namespace with the daemon's shm dir as /dev/shm
    cgroup:                    a cgroup (path below the cgroup root) that daemons join in every hierarchy mounted
                               at ``cgroup_root``, created where missing (outside the plugin container's cgroup)
    cgroup_root:               where the host's cgroup hierarchies are mounted in this container
    cgroup_procs:              cgroup.procs files to move daemons into (outside the plugin container's cgroup)

    With ``cgroup`` or ``cgroup_procs``, the launcher first enters the cgroup namespace of ``<proc_root>/1`` (the
    host's, with the host's PID namespace): from a private one, cgroups outside the container cannot be joined.
    """

    def __init__(
        self,
        nvidia_smi: str = "nvidia-smi",
        mps_control: str = MPS_CONTROL,
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
        isolate_shm: bool = True,
        cgroup: str = "",
        cgroup_root: str = "/sys/fs/cgroup",
        cgroup_procs: Sequence[str] = (),
        proc_root: str = "/proc",
        runner: Runner = subprocess.run,
    ) -> None:
        self.nvidia_smi = nvidia_smi
        self.mps_control = mps_control
        self.extra_env = dict(env or {})
        self.timeout_s = timeout_s
        self.isolate_shm = isolate_shm
        self.cgroup = cgroup
        self.cgroup_root = cgroup_root
        self.cgroup_procs = tuple(cgroup_procs)
        self.proc_root = Path(proc_root)
        self.run = runner
        self._intervals: dict[str, str] = {}  # what we set: nvidia-smi cannot read the interval back

    @classmethod
    def from_driver_root(cls, driver_root: Any, **kwargs: Any) -> NvidiaSmiSharingControl:
        """Use the tools and libraries of a ``dra.node.driverroot.DriverRoot``."""
        smi = driver_root.find_binary("nvidia-smi")
        mps = driver_root.find_binary(MPS_CONTROL)
        if smi is None:
            raise SharingError(f"driver root {driver_root.root}: nvidia-smi not found")
        lib_dirs = [os.path.join(str(driver_root.root), d.lstrip("/")) for d in driver_root.files().lib_folders]
        env = {"LD_LIBRARY_PATH": ":".join(lib_dirs)} if lib_dirs else {}
        env.update(kwargs.pop("env", None) or {})
        return cls(smi, mps or MPS_CONTROL, env=env, **kwargs)

    def _env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(extra or {})
        return env

    def _smi(self, args: Sequence[str], what: str) -> None:
        argv = [self.nvidia_smi, *args]
        try:
            done = self.run(argv, env=self._env(), capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.SubprocessError) as err:
            raise SharingError(f"{what}: running {' '.join(argv)} failed: {err}") from err
        if done.returncode != 0:
            output = " ".join(f"{done.stdout or ''} {done.stderr or ''}".split())
            if "not supported" in output.lower():
                raise SharingNotSupported(f"{what}: not supported on this GPU ({output})")
            raise SharingError(f"{what}: {' '.join(argv)} exited with {done.returncode}: {output}")

    def set_time_slice(self, gpu_uuid: str, interval: str) -> None:
        value = check_interval(interval)
        if is_mig_uuid(gpu_uuid):
            raise SharingNotSupported(f"time-slice on {gpu_uuid}: MIG devices have no time-slice setting")
        self._smi(["compute-policy", "-i", gpu_uuid, "--set-timeslice", str(value)],
                  f"setting time-slice {interval} on GPU {gpu_uuid}")
        self._intervals[gpu_uuid] = interval

    def get_time_slice(self, gpu_uuid: str) -> str | None:
        return self._intervals.get(gpu_uuid)

    def set_compute_mode(self, gpu_uuid: str, mode: str) -> None:
        check_compute_mode(mode)
        if is_mig_uuid(gpu_uuid):
            raise SharingNotSupported(f"compute mode on {gpu_uuid}: MIG devices have no compute mode")
        self._smi(["-i", gpu_uuid, "-c", mode], f"setting compute mode {mode} on GPU {gpu_uuid}")

    # -- MPS --
    def _mps_env(
        self, pipe_dir: str, log_dir: str | None = None, visible: Sequence[str] | None = None
    ) -> dict[str, str]:
        extra = {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir}
        if log_dir is not None:
            extra["CUDA_MPS_LOG_DIRECTORY"] = log_dir
        if visible is not None:
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
        return self._env(extra)

    def start_mps_daemon(self, spec: MpsDaemonSpec) -> ProcessIdentity:
        argv = [self.mps_control, "-d"]
        launcher: list[str] = []
        if self.isolate_shm and spec.shm_dir:
            launcher += ["--shm", spec.shm_dir]
        if self.cgroup or self.cgroup_procs:
            launcher += ["--cgroupns", str(self.proc_root / "1" / "ns" / "cgroup")]
        if self.cgroup:
            launcher += ["--cgroup-root", self.cgroup_root, "--cgroup", self.cgroup]
        for procs in self.cgroup_procs:
            launcher += ["--cgroup-procs", procs]
        env = self._mps_env(spec.pipe_dir, spec.log_dir, spec.visible_devices)
        if launcher:
            # The launcher is this image's Python: the driver's environment (LD_LIBRARY_PATH of the driver's library
            # folders, where a host's own libc and libm can be) is for the driver's program alone, set at its exec.
            for name, value in self.extra_env.items():
                launcher += ["--exec-env", f"{name}={value}"]
                if name in os.environ:
                    env[name] = os.environ[name]
                else:
                    del env[name]
            # -I: neither the working directory nor PYTHON* variables decide what the root launcher imports.
            argv = [sys.executable, "-I", "-m", "dra.node.mpslaunch", *launcher, "--", *argv]
        out_path = Path(spec.log_dir) / "control-start.out"
        try:
            # The daemon forks away and may keep inherited descriptors open: give it a file, not a pipe, or
            # waiting for the starter would wait for the daemon. The log directory is the plugin's own, but a
            # link there is still never followed.
            fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as out:
                done = self.run(argv, env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                timeout=self.timeout_s, check=False, start_new_session=True)
        except (OSError, subprocess.SubprocessError) as err:
            raise SharingError(f"MPS daemon for {spec.pipe_dir}: starting {' '.join(argv)} failed: {err}") from err
        if done.returncode != 0:
            raise SharingError(f"MPS daemon for {spec.pipe_dir}: {' '.join(argv)} exited with {done.returncode}: "
                               f"{_read_private(out_path)}")
        deadline = time.monotonic() + self.timeout_s
        while True:
            daemon = self.mps_daemon(spec.pipe_dir)
            if daemon is not None:
                return daemon
            if time.monotonic() > deadline:
                raise SharingError(f"MPS daemon for {spec.pipe_dir}: did not come up (see {spec.log_dir})")
            time.sleep(0.05)

    def mps_daemon(self, pipe_dir: str) -> ProcessIdentity | None:
        """The daemon named by the PID file NVIDIA's daemon writes into its pipe directory. Only root writes
        there (containers get the directory read-only), and the process must still look like this pipe
        directory's daemon: a PID file left behind by a dead daemon names nothing, or a process since reused."""
        try:
            text = read_regular_file(os.path.join(pipe_dir, MPS_PID_FILE), 64).decode("ascii", "replace").strip()
        except OSError:
            return None
        if not text.isdigit():
            return None
        pid = int(text)
        daemon = identify(pid, self.proc_root)
        if daemon is None or not self._looks_like_daemon(pid, pipe_dir):
            return None
        return daemon

    def _looks_like_daemon(self, pid: int, pipe_dir: str) -> bool:
        """``... nvidia-cuda-mps-control -d`` with this pipe directory in its environment: only a check of a
        PID that a trusted source named, since any process can look like this."""
        entry = self.proc_root / str(pid)
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            return False
        return (b"-d" in argv and any(os.path.basename(a) == MPS_CONTROL.encode() for a in argv)
                and f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode() in environ)

    def lookalikes(self, pipe_dir: str, daemon: ProcessIdentity | None) -> list[int]:
        pids = []
        for entry in self.proc_root.iterdir():
            if entry.name.isdigit() and (daemon is None or int(entry.name) != daemon.pid) \
                    and self._looks_like_daemon(int(entry.name), pipe_dir):
                pids.append(int(entry.name))
        return pids

    def mps_daemon_running(self, pipe_dir: str, daemon: ProcessIdentity) -> bool:
        return is_alive(daemon, self.proc_root)

    def mps_command(self, pipe_dir: str, command: str) -> str:
        _check_control_socket(pipe_dir)
        argv = [self.mps_control]
        try:
            done = self.run(argv, input=command + "\n", env=self._mps_env(pipe_dir), capture_output=True, text=True,
                            timeout=self.timeout_s, check=False)
        except (OSError, subprocess.SubprocessError) as err:
            raise SharingError(f"MPS daemon for {pipe_dir}: command {command!r} failed: {err}") from err
        if done.returncode != 0:
            output = " ".join(f"{done.stdout or ''} {done.stderr or ''}".split())
            raise SharingError(
                f"MPS daemon for {pipe_dir}: command {command!r} exited with {done.returncode}: {output}")
        return (done.stdout or "").strip()

    def stop_mps_daemon(self, pipe_dir: str, daemon: ProcessIdentity | None) -> None:
        if daemon is None:
            self._quit_unidentified(pipe_dir)
            return
        if not self.mps_daemon_running(pipe_dir, daemon):
            return
        try:
            self.mps_command(pipe_dir, "quit")
        except SharingError as err:
            log.warning("%s; sending signals instead", err)
        for sig, wait_s in ((None, self.timeout_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            # Signals reach the recorded process only (through a pidfd): never a process that took its PID.
            if sig is not None:
                send_signal(daemon, sig)
            if wait_gone(daemon, wait_s):
                return
        raise SharingError(f"MPS daemon for {pipe_dir}: still running after quit, SIGTERM and SIGKILL")


    def _quit_unidentified(self, pipe_dir: str) -> None:
        """``quit`` to the daemon listening on the control socket, if one does; wait until none does."""
        if not _control_answers(pipe_dir):
            return
        try:
            self.mps_command(pipe_dir, "quit")
        except SharingError as err:
            log.warning("%s", err)
        deadline = time.monotonic() + self.timeout_s
        while _control_answers(pipe_dir):
            if time.monotonic() > deadline:
                raise SharingError(f"MPS daemon for {pipe_dir}: its process is not known and it still answers on "
                                   "its control socket after quit; it is not signalled")
            time.sleep(0.05)


def _control_answers(pipe_dir: str) -> bool:
    """Whether a daemon listens on the pipe directory's control socket (a socket of this process's user)."""
    try:
        _check_control_socket(pipe_dir)
    except SharingError:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        try:
            sock.connect(os.path.join(pipe_dir, "control"))
        except OSError:
            return False
    return True


def _check_control_socket(pipe_dir: str) -> None:
    """Workload containers can write the pipe directory: before the (root) control program connects through
    it, its control socket must be a socket this process's user owns, not a link or a planted file."""
    path = os.path.join(pipe_dir, "control")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SharingError(f"MPS daemon for {pipe_dir}: no control socket") from None
    except OSError as err:
        raise SharingError(f"MPS daemon for {pipe_dir}: cannot inspect the control socket: {err}") from err
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise SharingError(f"MPS daemon for {pipe_dir}: the control socket was replaced (not a socket owned by "
                           "this plugin); not connecting through it")


def _read_private(path: Path) -> str:
    """The start output, read without following a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        return f.read(4096).decode(errors="replace").strip()
