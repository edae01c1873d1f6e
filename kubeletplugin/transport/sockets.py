"""Where the plugin's two unix sockets live, and how they are created and removed.

The kubelet finds the registration socket by watching its registry directory and learns the DRA socket
path from GetInfo, so both paths must be the same inside and outside the plugin's container. With
rolling updates two plugin pods of one driver run side by side; each then names its sockets with its pod
UID so that neither removes the other's.
"""
from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_UNIX_PATH = 107

DEFAULT_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DEFAULT_PLUGINS_DIR = "/var/lib/kubelet/plugins"

# Only the kubelet (root) needs to connect.
SOCKET_MODE = 0o600


class SocketPathError(ValueError):
    """A socket path that cannot be used (too long for AF_UNIX, or blocked by a non-socket file)."""


@dataclass(frozen=True)
class SocketPaths:
    registration: Path    # in the kubelet's plugins_registry directory
    dra: Path             # the endpoint GetInfo reports


def _short_hash(text: str, n: int = 16) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def registration_socket_name(driver_name: str, pod_uid: str | None = None) -> str:
    """``<driver>-reg.sock``, or ``<driver>-<podUID>-reg.sock`` in rolling-update mode."""
    if pod_uid:
        return f"{driver_name}-{pod_uid}-reg.sock"
    return f"{driver_name}-reg.sock"


def dra_socket_name(pod_uid: str | None = None) -> str:
    """``dra.sock``, or ``dra-<podUID>.sock`` in rolling-update mode."""
    return f"dra-{pod_uid}.sock" if pod_uid else "dra.sock"


def _fit(directory: Path, preferred: str, fallbacks: list[str]) -> Path:
    for name in [preferred, *fallbacks]:
        path = directory / name
        if len(os.fsencode(str(path))) <= MAX_UNIX_PATH:
            return path
    raise SocketPathError(
        f"socket path {directory / preferred} is longer than {MAX_UNIX_PATH} bytes even with a hashed name; "
        f"use a shorter directory than {directory}")


def socket_paths(driver_name: str, registry_dir: str | os.PathLike[str], plugin_dir: str | os.PathLike[str],
                 pod_uid: str | None = None) -> SocketPaths:
    """The two socket paths. Rolling-update names that would not fit AF_UNIX fall back to hashed names
    (still unique per pod and stable across restarts of the same pod)."""
    reg_dir = Path(registry_dir).absolute()
    dra_dir = Path(plugin_dir).absolute()
    reg_fallbacks: list[str] = []
    dra_fallbacks: list[str] = []
    if pod_uid:
        uid_hash = _short_hash(pod_uid)
        reg_fallbacks = [f"{driver_name}-{uid_hash}-reg.sock", f"{_short_hash(driver_name + '/' + pod_uid)}-reg.sock"]
        dra_fallbacks = [f"dra-{uid_hash[:8]}.sock"]
    else:
        reg_fallbacks = [f"{_short_hash(driver_name)}-reg.sock"]
    return SocketPaths(
        registration=_fit(reg_dir, registration_socket_name(driver_name, pod_uid), reg_fallbacks),
        dra=_fit(dra_dir, dra_socket_name(pod_uid), dra_fallbacks),
    )


def remove_stale_socket(path: Path) -> None:
    """Remove a socket left behind by an earlier run. Refuses to delete anything that is not a socket."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(f"{path} exists and is not a unix socket; refusing to replace it")
    path.unlink()


def prepare_socket_path(path: Path) -> None:
    """Create the parent directory and clear a stale socket so that grpc can bind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_socket(path)


def restrict_socket(path: Path) -> None:
    """Make a freshly bound socket accessible to its owner (the kubelet runs as root) only."""
    os.chmod(path, SOCKET_MODE)


def remove_socket(path: Path) -> None:
    """Remove our socket on shutdown; a missing file is fine."""
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
    except FileNotFoundError:
        pass
