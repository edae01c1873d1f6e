"""The kubelet's plugin manager for DRA plugins: discovery in the registry directory and the handshake.

A reconcile pass (``sync``) compares the sockets in the registry directory with the registered plugins:
new sockets are registered (dial, GetInfo, validate, NotifyRegistrationStatus), removed or replaced sockets
are deregistered. Failed registrations are retried with exponential back-off. ``start`` runs passes in a
background thread, like the kubelet's fsnotify watch plus its one-second reconciler.
"""
from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from standin.dra_client import DraClient, unix_target
from standin.stubs import DRA_PLUGIN_TYPE, DRA_SERVICES, KUBELET_DRA_SERVICES, KUBELET_HEALTH_SERVICES, REGISTRATION

DIAL_TIMEOUT = 10.0            # blocking dial of the registration socket
GET_INFO_TIMEOUT = 1.0
NOTIFY_TIMEOUT = 5.0
BACKOFF_INITIAL = 0.5
BACKOFF_MAX = 5.0              # the kubelet goes up to two minutes; tests want quick retries


class RegistrationError(Exception):
    """The kubelet would refuse this plugin; the message is what it would log."""


@dataclass
class RegisteredPlugin:
    driver_name: str
    endpoint: str
    registration_socket: Path
    supported_versions: tuple[str, ...]
    dra_service: str                     # the DRA service chosen, e.g. "v1.DRAPlugin"
    health_service: str | None           # e.g. "v1alpha1.DRAResourceHealth", None if not offered
    client: DraClient
    registered_at: float
    socket_identity: tuple[int, int]     # (inode, ctime) of the registration socket


@dataclass
class RegistrationFailure:
    message: str
    attempts: int
    retry_at: float
    socket_identity: tuple[int, int]


def _identity(st: os.stat_result) -> tuple[int, int]:
    return (st.st_ino, st.st_ctime_ns)


def _is_socket(path: str | Path) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def scan_registry(registry_dir: Path) -> dict[Path, tuple[int, int]]:
    """Unix sockets under ``registry_dir`` (recursive), skipping names that start with '.'."""
    found: dict[Path, tuple[int, int]] = {}
    for root, dirs, files in os.walk(registry_dir):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.startswith("."):
                continue
            path = Path(root) / name
            try:
                st = os.stat(path)
            except OSError:
                continue  # removed while scanning
            if stat.S_ISSOCK(st.st_mode):
                found[path] = _identity(st)
    return found


class PluginWatcher:
    """Registers DRA plugins found in a registry directory and keeps the set current."""

    def __init__(
        self,
        registry_dir: str | Path,
        *,
        kubelet_services: Sequence[str] = KUBELET_DRA_SERVICES,
        call_timeout: float = 45.0,
        poll_interval: float = 0.2,
    ):
        unknown = [s for s in kubelet_services if s not in DRA_SERVICES]
        if unknown:
            raise ValueError(f"the stand-in cannot speak {unknown}; it knows {list(DRA_SERVICES)}")
        self.registry_dir = Path(registry_dir)
        self.kubelet_services = tuple(kubelet_services)
        self.call_timeout = call_timeout
        self.poll_interval = poll_interval
        self.registered: dict[Path, RegisteredPlugin] = {}   # by registration socket
        self.failures: dict[Path, RegistrationFailure] = {}
        self.history: list[tuple[str, str, Path]] = []       # ("registered"|"deregistered"|"rejected", driver or reason, socket)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the reconcile loop ---------------------------------------------------------------------------

    def sync(self) -> None:
        """One reconcile pass."""
        desired = scan_registry(self.registry_dir) if self.registry_dir.is_dir() else {}
        with self._lock:
            for path, plugin in list(self.registered.items()):
                if desired.get(path) != plugin.socket_identity:
                    self._deregister(path)
            for path in list(self.failures):
                if path not in desired:
                    del self.failures[path]
            now = time.monotonic()
            for path, identity in desired.items():
                if path in self.registered:
                    continue
                failure = self.failures.get(path)
                if failure and failure.socket_identity == identity and now < failure.retry_at:
                    continue
                try:
                    self.registered[path] = self._register(path, identity)
                    self.failures.pop(path, None)
                    self.history.append(("registered", self.registered[path].driver_name, path))
                except RegistrationError as exc:
                    attempts = failure.attempts + 1 if failure and failure.socket_identity == identity else 1
                    delay = min(BACKOFF_INITIAL * 2 ** (attempts - 1), BACKOFF_MAX)
                    self.failures[path] = RegistrationFailure(str(exc), attempts, now + delay, identity)
                    self.history.append(("rejected", str(exc), path))
            self._changed.notify_all()

    def _deregister(self, path: Path) -> None:
        plugin = self.registered.pop(path)
        plugin.client.close()
        self.history.append(("deregistered", plugin.driver_name, path))

    def _register(self, path: Path, identity: tuple[int, int]) -> RegisteredPlugin:
        channel = grpc.insecure_channel(unix_target(str(path)))
        try:
            try:
                grpc.channel_ready_future(channel).result(timeout=DIAL_TIMEOUT)
            except grpc.FutureTimeoutError as exc:
                raise RegistrationError(f"dial {path}: not answering within {DIAL_TIMEOUT}s") from exc
            stub = REGISTRATION.grpc.RegistrationStub(channel)
            try:
                info = stub.GetInfo(REGISTRATION.messages.InfoRequest(), timeout=GET_INFO_TIMEOUT)
            except grpc.RpcError as exc:
                raise RegistrationError(f"GetInfo on {path}: {exc.code().name}: {exc.details()}") from exc
            try:
                plugin = self._validate(path, identity, info)
            except RegistrationError as exc:
                self._notify(stub, False, str(exc))
                raise
            try:
                self._notify(stub, True, "")
            except grpc.RpcError as exc:
                plugin.client.close()
                raise RegistrationError(f"NotifyRegistrationStatus on {path}: {exc.code().name}: {exc.details()}") from exc
            return plugin
        finally:
            channel.close()

    @staticmethod
    def _notify(stub, registered: bool, error: str) -> None:
        status = REGISTRATION.messages.RegistrationStatus(plugin_registered=registered, error=error)
        try:
            stub.NotifyRegistrationStatus(status, timeout=NOTIFY_TIMEOUT)
        except grpc.RpcError:
            if registered:
                raise
            # a failed "not registered" notification changes nothing: the plugin is refused anyway

    def _validate(self, path: Path, identity: tuple[int, int], info) -> RegisteredPlugin:
        """The DRA handler's checks; raises RegistrationError with the kubelet's reason."""
        if info.type != DRA_PLUGIN_TYPE:
            raise RegistrationError(f"no handler registered for plugin type: {info.type!r}")
        if not info.name:
            raise RegistrationError("plugin name is empty")
        endpoint = info.endpoint or str(path)  # an empty endpoint means "the registration socket itself"
        if not os.path.isabs(endpoint):
            raise RegistrationError(f"endpoint {endpoint!r} is not an absolute path")
        if not _is_socket(endpoint):
            raise RegistrationError(f"endpoint {endpoint} is not a unix socket")
        versions = tuple(info.supported_versions)
        if not versions:
            raise RegistrationError(f"plugin {info.name}: empty list of supported versions")
        # The kubelet walks the plugin's list in the plugin's order and takes the first service it knows.
        dra_service = next((v for v in versions if v in self.kubelet_services), None)
        if dra_service is None:
            raise RegistrationError(
                f"none of services supported by the plugin {list(versions)} are supported by the kubelet {list(self.kubelet_services)}"
            )
        for other in self.registered.values():
            if other.driver_name == info.name and other.endpoint == endpoint:
                raise RegistrationError(f"plugin {info.name} with endpoint {endpoint} is already registered")
        health = next((h for h in KUBELET_HEALTH_SERVICES if h in versions), None)
        client = DraClient(endpoint, dra_service, call_timeout=self.call_timeout)
        return RegisteredPlugin(
            driver_name=info.name,
            endpoint=endpoint,
            registration_socket=path,
            supported_versions=versions,
            dra_service=dra_service,
            health_service=health,
            client=client,
            registered_at=time.monotonic(),
            socket_identity=identity,
        )

    # --- queries ----------------------------------------------------------------------------------------

    def plugin(self, driver_name: str) -> RegisteredPlugin | None:
        """The most recently registered instance of a driver (what the kubelet calls), or None."""
        with self._lock:
            instances = [p for p in self.registered.values() if p.driver_name == driver_name]
            return max(instances, key=lambda p: p.registered_at) if instances else None

    def wait_for_plugin(self, driver_name: str, timeout: float = 30.0, *, newer_than: float | None = None) -> RegisteredPlugin:
        """Block until ``driver_name`` is registered (registered after ``newer_than``, if given)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                if self._thread is None:
                    self.sync()
                plugin = self.plugin(driver_name)
                if plugin and (newer_than is None or plugin.registered_at > newer_than):
                    return plugin
                left = deadline - time.monotonic()
                if left <= 0:
                    failures = "; ".join(f"{p.name}: {f.message}" for p, f in self.failures.items()) or "none"
                    raise TimeoutError(
                        f"DRA driver {driver_name} not registered within {timeout}s "
                        f"(sockets in {self.registry_dir}: {sorted(p.name for p in scan_registry(self.registry_dir))}; "
                        f"failed registrations: {failures})"
                    )
                self._changed.wait(min(left, self.poll_interval))

    def wait_for_deregistration(self, driver_name: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.plugin(driver_name) is not None:
                if self._thread is None:
                    self.sync()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"DRA driver {driver_name} still registered after {timeout}s")
                self._changed.wait(min(left, self.poll_interval))

    # --- background thread ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="plugin-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as exc:  # noqa: BLE001 - keep watching; the error shows up in history
                with self._lock:
                    self.history.append(("rejected", f"reconcile error: {exc!r}", self.registry_dir))
            self._stop.wait(self.poll_interval)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            self._thread = None
        with self._lock:
            for path in list(self.registered):
                self._deregister(path)
