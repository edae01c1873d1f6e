"""A simulated ``nvidia-cuda-mps-control``: the same command line, environment and control protocol, for nodes
whose GPUs are simulated. It is a real program, so the plugin drives it through the same code as the real
one (``dra.node.sharingtools.NvidiaSmiSharingControl``), and its daemon is a real process that outlives the
process that started it.

    nvidia-cuda-mps-control -d          start the control daemon (forks into the background, exits 0 once it
                                        listens), serving CUDA_VISIBLE_DEVICES; pipe and log directories from
                                        CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY
    nvidia-cuda-mps-control             read commands from stdin, one per line, send each to the daemon,
                                        print its reply; exit 1 on a refused command or without a daemon

Its pipe directory holds what NVIDIA's holds, with the same permissions (measured on an H200): ``control``, the
socket every client connects to (0666: the daemon serves clients of any user ID), ``control_privileged`` (0755:
its owner only), ``control_lock`` (0666), ``log`` (a FIFO, 0777) and ``nvidia-cuda-mps-control.pid`` (0666), all
whatever the umask of whoever started it.

CUDA clients (the CUDA stand-in, hack/cuda-standin/libcuda.c) connect to ``control`` when CUDA initialises and
send ``new_client``; the daemon reads the client's user ID from the socket (SO_PEERCRED) and answers
``OK server <uid>`` once an MPS server of that user serves it: at once when no server runs or the server runs as
the same user, else after every client of the running server has gone (MPS runs one server, of one user, at a
time). A client holds its connection for its life; each client is logged in ``control.log``.

It refuses what the real one refuses, so a design the hardware would reject fails here too: a second daemon
for a pipe directory; a daemon for a GPU that another daemon serves while the GPU is in EXCLUSIVE_PROCESS
compute mode (one process may hold the GPU); a device this node does not have; a thread percentage outside
1..100; a pinned memory limit above the device's memory. And it does what the real one does with its pipe
directory: writes its PID file and log there, following links. GPU facts (compute mode, memory, MIG devices) come
from the simulated node's state file (``GPU_DRA_SIM_STATE``), and the daemons serving each device are
registered beside it, so separate processes see each other. Started by ``python -m dra.sim.mpscontrol``.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import Any, NoReturn

STATE_ENV = "GPU_DRA_SIM_STATE"
CONTROL_SOCKET = "control"
PRIVILEGED_SOCKET = "control_privileged"
LOCK_FILE = "control_lock"
PID_FILE = "nvidia-cuda-mps-control.pid"
NEW_CLIENT = "new_client"
# The permissions of what NVIDIA's daemon leaves in its pipe directory (measured on an H200).
PIPE_MODES = {CONTROL_SOCKET: 0o666, PRIVILEGED_SOCKET: 0o755, LOCK_FILE: 0o666, "log": 0o777, PID_FILE: 0o666}
COMPUTEMODE_EXCLUSIVE_PROCESS = 3            # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


def _devices() -> dict[str, dict[str, Any]]:
    """UUID -> {memory_mib, exclusive, gpu} for every GPU and MIG device of the simulated node."""
    path = os.environ.get(STATE_ENV)
    if not path:
        return {}
    from dra.model.catalog import get_model
    from dra.sim.state import SimulatedHardwareState

    state = SimulatedHardwareState(path)
    with state.locked():
        doc = state.read()
    out: dict[str, dict[str, Any]] = {}
    for gpu in doc.gpus if doc else ():
        model = get_model(gpu.model)
        exclusive = gpu.compute_mode == COMPUTEMODE_EXCLUSIVE_PROCESS
        out[gpu.uuid] = {"memory_mib": model.memory_mib, "exclusive": exclusive, "gpu": gpu.uuid}
        for gi in gpu.gpu_instances:
            profile = model.profile_by_id(gi.profile_id)
            for ci in gi.compute_instances:
                out[ci.uuid] = {"memory_mib": profile.memory_mib if profile else 0, "exclusive": False,
                                "gpu": gpu.uuid}
    return out


def _registry() -> Path | None:
    path = os.environ.get(STATE_ENV)
    return Path(path + ".mps") if path else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _serving(uuid: str) -> tuple[int, str] | None:
    """(pid, pipe directory) of the live daemon registered for a device, if any."""
    registry = _registry()
    if registry is None:
        return None
    try:
        doc = json.loads((registry / uuid).read_text())
        pid = int(doc["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (pid, str(doc.get("pipe"))) if pid > 0 and _alive(pid) else None


def serving_pids(uuid: str) -> list[int]:
    """Process ids of simulated daemons serving a device (for the simulated compute-mode rule)."""
    found = _serving(uuid)
    return [found[0]] if found else []


def _served_by_other(uuid: str, pipe_dir: str) -> int | None:
    found = _serving(uuid)
    return found[0] if found and found[1] != pipe_dir else None


def _parse_limit(text: str) -> int | None:
    """MiB of a limit like 1024M, 2G or a plain number of bytes."""
    units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    try:
        if text[-1:].upper() in units:
            return int(float(text[:-1]) * units[text[-1].upper()])
        return int(text) // (1 << 20)
    except ValueError:
        return None


class _Daemon:
    def __init__(self, pipe_dir: str, log_dir: str, visible: list[str]) -> None:
        self.pipe_dir, self.log_dir, self.visible = pipe_dir, log_dir, visible
        self.threads: int | None = None
        self.limits: dict[str, int] = {}

    def device(self, key: str, devices: dict[str, dict[str, Any]]) -> str | None:
        """A device named by ordinal (in CUDA_VISIBLE_DEVICES order) or by UUID."""
        if key.isdigit() and int(key) < len(self.visible):
            return self.visible[int(key)]
        return key if key in self.visible else None

    def command(self, line: str) -> tuple[bool, str]:
        words = line.split()
        if words == ["quit"]:
            return True, ""
        if words == ["get_server_list"]:
            return True, ""
        if len(words) == 2 and words[0] == "set_default_active_thread_percentage":
            if not words[1].isdigit() or not 1 <= int(words[1]) <= 100:
                return False, f"Error: invalid active thread percentage {words[1]!r}, must be 1..100"
            self.threads = int(words[1])
            return True, ""
        if words == ["get_default_active_thread_percentage"]:
            return True, f"{float(self.threads or 100):.1f}"
        if len(words) == 3 and words[0] == "set_default_device_pinned_mem_limit":
            devices = _devices()
            uuid = self.device(words[1], devices)
            mib = _parse_limit(words[2])
            if uuid is None:
                return False, f"Error: device {words[1]} is not served by this daemon"
            if mib is None or mib <= 0:
                return False, f"Error: invalid pinned memory limit {words[2]!r}"
            memory = devices.get(uuid, {}).get("memory_mib")
            if memory is not None and mib > memory:
                return False, f"Error: pinned memory limit {mib}M exceeds the {memory}M of device {uuid}"
            self.limits[uuid] = mib
            return True, ""
        if len(words) == 2 and words[0] == "get_default_device_pinned_mem_limit":
            uuid = self.device(words[1], {})
            return True, f"{self.limits[uuid]}M" if uuid in self.limits else "0M"
        return False, f"Error: unknown command {line.strip()!r}"


def _write_pipe_files(pipe_dir: str, line: str) -> None:
    """What NVIDIA's daemon leaves in its pipe directory besides the sockets, written the way it writes them
    (measured on an H200): its PID over the start of ``nvidia-cuda-mps-control.pid`` (no truncation), and its
    log lines into ``log``, a FIFO it creates where none exists. Both are opened following links, as root: a
    link planted there is written through."""
    fd = os.open(os.path.join(pipe_dir, PID_FILE), os.O_WRONLY | os.O_CREAT, PIPE_MODES[PID_FILE])
    try:
        os.write(fd, str(os.getpid()).encode())
    finally:
        os.close(fd)
    log = os.path.join(pipe_dir, "log")
    if not os.path.exists(log):
        os.mkfifo(log, PIPE_MODES["log"])
        return
    try:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
    except OSError:
        return                                          # a FIFO nobody reads: the line is dropped
    try:
        os.write(fd, (line + "\n").encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def _log(log_dir: str, text: str) -> None:
    try:
        with open(os.path.join(log_dir, "control.log"), "a") as out:
            out.write(text + "\n")
    except OSError:
        pass


def _daemon_main() -> int:
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    log_dir = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    control = os.path.join(pipe_dir, CONTROL_SOCKET)
    if _connect(control) is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    devices = _devices()
    for uuid in visible:
        if devices and uuid not in devices:
            print(f"Error: device {uuid} not found", file=sys.stderr)
            return 1
        other = _served_by_other(uuid, pipe_dir)
        if other is not None and (devices.get(uuid, {}).get("exclusive") or uuid.startswith("MIG-")):
            print(f"Error: device {uuid} is in use by MPS control daemon {other} and cannot be shared "
                  "(compute mode EXCLUSIVE_PROCESS)", file=sys.stderr)
            return 1
    read_end, write_end = os.pipe()
    if os.fork() > 0:                                   # the caller's process: wait until the daemon listens
        os.close(write_end)
        ready = os.read(read_end, 1)
        return 0 if ready == b"1" else 1
    os.close(read_end)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    registry = _registry()
    if registry is not None:
        registry.mkdir(parents=True, exist_ok=True)
        for uuid in visible:
            (registry / uuid).write_text(json.dumps({"pid": os.getpid(), "pipe": pipe_dir}))
    # The pipe directory's files get exactly the modes they are created with, whoever started the daemon (a
    # plugin's umask of 022 would leave the control socket to its owner alone); files already there keep theirs.
    umask = os.umask(0)
    # Bound by names relative to the pipe directory: a socket address holds 108 bytes, and a long pipe directory
    # (a test's temporary one) would leave no room for "control_privileged".
    os.chdir(pipe_dir)
    listeners = [_listen(name) for name in (CONTROL_SOCKET, PRIVILEGED_SOCKET)]
    os.chdir("/")
    os.close(os.open(os.path.join(pipe_dir, LOCK_FILE), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, PIPE_MODES[LOCK_FILE]))
    daemon = _Daemon(pipe_dir, log_dir, visible)
    _write_pipe_files(pipe_dir, f"[{os.getpid()}] Starting control daemon for {','.join(visible)}")
    os.umask(umask)
    _log(log_dir, f"[{os.getpid()}] Starting control daemon for {','.join(visible)}")
    signal.signal(signal.SIGTERM, lambda *_: _shutdown(listeners, registry, visible, pipe_dir))
    os.write(write_end, b"1")
    os.close(write_end)
    _serve(daemon, listeners, registry, visible)


def _listen(name: str) -> socket.socket:
    """A socket listening at ``name`` in the working directory."""
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(name)
    os.chmod(name, PIPE_MODES[name])                    # who may connect: write permission on the socket
    server.listen(64)
    return server


class _Servers:
    """MPS runs one server at a time, of one user ID: a client of that user is served at once, a client of
    another waits until every client of the running server has gone."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.uid: int | None = None
        self.clients: dict[socket.socket, int] = {}
        self.waiting: list[tuple[socket.socket, int, int]] = []

    def arrive(self, conn: socket.socket) -> None:
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
        self.waiting.append((conn, pid, uid))
        self._admit()

    def leave(self, conn: socket.socket) -> None:
        self.clients.pop(conn, None)
        self.waiting = [w for w in self.waiting if w[0] is not conn]
        if not self.clients:
            self.uid = None
        self._admit()

    def _admit(self) -> None:
        for conn, pid, uid in list(self.waiting):
            if self.uid is None:
                self.uid = uid
            if uid != self.uid:
                continue
            self.waiting.remove((conn, pid, uid))
            # Logged before the client hears it is served: whoever the client tells finds the line already there.
            _log(self.log_dir, f"[{os.getpid()}] New client {pid} of user ID {uid} served by the MPS server of "
                               f"user ID {uid}")
            try:
                conn.sendall(f"OK server {uid}\n".encode())
            except OSError:
                continue
            self.clients[conn] = uid


def _serve(daemon: _Daemon, listeners: list[socket.socket], registry: Path | None, visible: list[str]) -> NoReturn:
    """Commands arrive one a connection (a line, answered, closed); a CUDA client's connection stays open while
    the client lives."""
    events = selectors.DefaultSelector()
    for listener in listeners:
        events.register(listener, selectors.EVENT_READ, "listen")
    servers = _Servers(daemon.log_dir)
    pending: dict[socket.socket, bytes] = {}
    while True:
        for key, _ in events.select():
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if key.data == "listen":
                conn, _ = sock.accept()
                pending[conn] = b""
                events.register(conn, selectors.EVENT_READ, "conn")
                continue
            try:
                chunk = sock.recv(4096)
            except OSError:
                chunk = b""
            if sock in servers.clients or any(w[0] is sock for w in servers.waiting):
                if not chunk:                           # the client has gone
                    events.unregister(sock)
                    servers.leave(sock)
                    sock.close()
                continue
            data = pending[sock] + chunk
            if chunk and not data.endswith(b"\n") and len(data) < 65536:
                pending[sock] = data
                continue
            del pending[sock]
            line = data.decode(errors="replace").strip()
            if line == NEW_CLIENT:
                servers.arrive(sock)
                continue
            events.unregister(sock)
            if not line:                                # a client that only connected (a liveness probe)
                sock.close()
                continue
            ok, reply = daemon.command(line)
            try:
                sock.sendall((("OK " if ok else "ERR ") + reply + "\n").encode())
            except OSError:
                pass                                    # a client gone mid-way does not end the daemon
            sock.close()
            _log(daemon.log_dir, f"[{os.getpid()}] {line} -> {reply}")
            if ok and line.split() == ["quit"]:
                _shutdown(listeners, registry, visible, daemon.pipe_dir)


def _shutdown(listeners: list[socket.socket], registry: Path | None, visible: list[str], pipe_dir: str) -> NoReturn:
    for listener in listeners:
        listener.close()
    for name in (CONTROL_SOCKET, PRIVILEGED_SOCKET):
        try:
            os.unlink(os.path.join(pipe_dir, name))
        except OSError:
            pass
    for entry in [registry / uuid for uuid in visible] if registry is not None else []:
        try:
            if json.loads(entry.read_text()).get("pipe") == pipe_dir:
                entry.unlink()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def _client_main() -> int:
    control = os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), CONTROL_SOCKET)
    status = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        sock = _connect(control)
        if sock is None:
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        with sock:
            sock.sendall(line.strip().encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        verdict, _, text = reply.decode(errors="replace").strip().partition(" ")
        if text:
            print(text)
        if verdict != "OK":
            status = 1
    return status


def write_simulated_mps_control(directory: Path) -> Path:
    """An executable named ``nvidia-cuda-mps-control`` in ``directory`` that runs this program under that
    name (so the daemon looks like the real one in /proc), for ``NvidiaSmiSharingControl(mps_control=...)``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "nvidia-cuda-mps-control"
    # Under another argv[0] Python does not find its environment by itself: hand it this process's path.
    package_root = str(Path(__file__).resolve().parents[2])
    search = ":".join(dict.fromkeys([package_root, *(p for p in sys.path if p and os.path.isdir(p))]))
    # Python, not a shell script: the driver image has no shell.
    script = (f"#!{sys.executable}\nimport os, sys\nos.environ['PYTHONPATH'] = {search!r}\n"
              f"os.execv({sys.executable!r}, ['nvidia-cuda-mps-control', '-m', 'dra.sim.mpscontrol', *sys.argv[1:]])\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(script)
    tmp.chmod(0o755)
    tmp.replace(path)
    return path


def main(argv: list[str]) -> int:
    return _daemon_main() if "-d" in argv else _client_main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
