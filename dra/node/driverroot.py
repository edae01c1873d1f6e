"""Find the NVIDIA driver's files that a container needs, under a driver root.

The driver may be installed on the host (driver root ``/``) or by the GPU operator's driver container
(``/run/nvidia/driver``), and the plugin usually sees it through a bind mount at another path
(``/driver-root``). So every file has two names here: where the plugin reads it (``root``) and where the host
has it (``host_root``), because CDI ``hostPath`` values are resolved by the container runtime on the host.
Device nodes and ``/proc`` get their own roots for the same reason and so tests can build a fake tree.

Symlinks inside the root are resolved *within* the root: an absolute link target such as ``/usr/lib`` in a
driver container's tree means ``<root>/usr/lib``, not the plugin's own ``/usr/lib``.
"""
from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

log = logging.getLogger(__name__)

# Directories searched for driver libraries, most specific first (relative to the driver root).
LIBRARY_DIRS: tuple[str, ...] = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "usr/lib64",
    "lib64",
    "usr/lib",
    "lib",
)

# User-space libraries a compute (CUDA / NVML) workload can load. Graphics and video libraries are left out
# on purpose: a GPU compute claim should not pull the whole display stack into the container.
COMPUTE_LIBRARIES: tuple[str, ...] = (
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-gpucomp.so",
    "libnvidia-allocator.so",
    "libnvidia-cfg.so",
    "libnvidia-opencl.so",
    "libnvidia-pkcs11.so",
    "libnvidia-pkcs11-openssl3.so",
)

BINARY_DIRS: tuple[str, ...] = ("usr/bin", "usr/sbin", "bin", "sbin", "usr/local/bin", "usr/local/nvidia/toolkit")

# Tools a container may use: nvidia-smi for inspection, the MPS control programs for MPS clients.
BINARIES: tuple[str, ...] = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)

# The CDI hook program, in order of preference. nvidia-cdi-hook takes the hook name as first argument;
# nvidia-ctk needs "hook" before it.
HOOK_PROGRAMS: tuple[str, ...] = ("nvidia-cdi-hook", "nvidia-ctk")

# Where nodes keep the driver, as host paths: a host install, the GPU operator's driver container, the single-folder
# installs (lib64/, bin/) of GKE (/home/kubernetes/bin/nvidia, shown to containers as /usr/local/nvidia). Listed in
# the start-up error when the configured root has no libcuda.
KNOWN_DRIVER_ROOTS: tuple[str, ...] = ("/", "/run/nvidia/driver", "/usr/local/nvidia", "/home/kubernetes/bin/nvidia")

_VERSIONED = re.compile(r"^(?P<base>.+\.so)(?P<suffix>(\.[0-9A-Za-z]+)*)$")
_DRIVER_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?$")
_MAX_LINK_HOPS = 40


class DriverRootError(RuntimeError):
    """The driver root lacks something a GPU container needs; the message names the path."""


class CdiHookError(DriverRootError):
    """The CDI hook program is missing or cannot run; the message names the path and the flag."""


@dataclass(frozen=True)
class RootedPath:
    """One file as the container sees it and where the runtime finds it on the host."""

    container_path: str      # absolute path inside the container (same as inside the driver root)
    host_path: str           # absolute path on the host


@dataclass(frozen=True)
class LibraryLink:
    """A symlink among the driver libraries, e.g. libcuda.so.1 -> libcuda.so.580.95.05."""

    container_path: str      # where the link lives, e.g. /usr/lib/x86_64-linux-gnu/libcuda.so.1
    target: str              # the link text as written, e.g. libcuda.so.580.95.05
    resolved: RootedPath     # the regular file the link ends at


@dataclass(frozen=True)
class DeviceNodeInfo:
    """A character device for CDI ``deviceNodes``; major/minor are set when known (real node or /proc)."""

    path: str                       # container path, e.g. /dev/nvidia0
    host_path: str | None = None    # host path; None when the runtime must create the node from major/minor
    major: int | None = None
    minor: int | None = None

    def to_cdi(self) -> dict[str, Any]:
        node: dict[str, Any] = {"path": self.path}
        if self.host_path is not None:
            node["hostPath"] = self.host_path
        if self.major is not None and self.minor is not None:
            node["type"] = "c"
            node["major"] = self.major
            node["minor"] = self.minor
        return node


@dataclass(frozen=True)
class DriverFiles:
    """Everything found under the driver root that every GPU container gets."""

    version: str
    libraries: tuple[RootedPath, ...]
    soname_links: tuple[LibraryLink, ...]
    lib_folders: tuple[str, ...]             # container dirs holding libraries (for the ldcache hook)
    binaries: tuple[RootedPath, ...]
    firmware: tuple[RootedPath, ...]          # directories
    hook: RootedPath | None                   # nvidia-cdi-hook / nvidia-ctk, if present
    control_nodes: tuple[DeviceNodeInfo, ...] = field(default_factory=tuple)  # nvidiactl, nvidia-uvm*
    data_dirs: tuple[RootedPath, ...] = ()    # read-only node data (a simulated node's GPU listing)
    writable_dirs: tuple[RootedPath, ...] = ()  # read-write node data (a simulated node's GPU processes)
    # Library links whose target is missing ("libcuda.so.1 -> libcuda.so.580.95.05"): left out of every spec.
    dangling_links: tuple[str, ...] = ()

    @property
    def hook_args_prefix(self) -> list[str]:
        """argv[0..] before the hook name: nvidia-ctk needs ``hook`` in front of it."""
        if self.hook is None:
            return []
        name = PurePosixPath(self.hook.container_path).name
        return [name, "hook"] if name == "nvidia-ctk" else [name]


class DriverRoot:
    """Reads the driver tree, device nodes and /proc, each under its own root.

    root:            where this process reads the driver's files (e.g. ``/driver-root``)
    host_root:       the same tree as the host sees it (e.g. ``/run/nvidia/driver``); defaults to ``root``
    dev_root:        where this process reads ``dev/nvidia*`` (default ``/``)
    host_dev_root:   the device root as the host sees it (default ``dev_root``)
    proc_root:       where this process reads ``driver/nvidia/capabilities`` and ``devices`` (default ``/proc``)
    hook_path:       host path of nvidia-cdi-hook (the driver's own, installed into the plugin directory), which
                     this process sees at the same path; it wins over a hook program in the driver root's binary
                     directories (a host toolkit's), which is used only when none is given
    driver_version:  skip detection from library file names
    """

    def __init__(
        self,
        root: Path | str = "/",
        *,
        host_root: Path | str | None = None,
        dev_root: Path | str = "/",
        host_dev_root: Path | str | None = None,
        proc_root: Path | str = "/proc",
        hook_path: Path | str | None = None,
        driver_version: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.host_root = PurePosixPath(host_root if host_root is not None else root)
        self.dev_root = Path(dev_root)
        self.host_dev_root = PurePosixPath(host_dev_root if host_dev_root is not None else dev_root)
        self.proc_root = Path(proc_root)
        self.hook_path = str(hook_path) if hook_path is not None else None
        self.driver_version = driver_version
        self._files: DriverFiles | None = None

    # ----- paths ---------------------------------------------------------------------------------------------
    def host_path(self, container_path: str) -> str:
        return _join(self.host_root, container_path)

    def resolve(self, relative: str) -> str | None:
        """Resolve ``relative`` (a path inside the root) following symlinks within the root.

        Returns the container path of the final file or directory, or None when it does not exist.
        """
        return _resolve_in_root(self.root, relative)

    # ----- discovery -----------------------------------------------------------------------------------------
    def files(self, refresh: bool = False) -> DriverFiles:
        """Driver files, cached: the driver does not change under a running plugin (an upgrade restarts it)."""
        if self._files is None or refresh:
            self._files = self._discover()
        return self._files

    def existing_lib_dirs(self) -> list[tuple[str, Path]]:
        """(container path, the path this process reads it at) of each existing library directory, once each, in
        LIBRARY_DIRS order."""
        out: list[tuple[str, Path]] = []
        seen_dirs: set[str] = set()
        for rel_dir in LIBRARY_DIRS:
            container_dir = self.resolve(rel_dir)
            if container_dir is None or container_dir in seen_dirs:
                continue  # missing, or the same directory reached through a merged-/usr symlink
            seen_dirs.add(container_dir)
            local_dir = Path(_join(self.root, container_dir))
            if local_dir.is_dir():
                out.append((container_dir, local_dir))
        return out

    def has_libcuda(self) -> bool:
        """Whether a ``libcuda.so*`` file or link is in one of the library directories."""
        for _, local_dir in self.existing_lib_dirs():
            try:
                if any(name.startswith("libcuda.so") and _is_compute_library(name) for name in os.listdir(local_dir)):
                    return True
            except OSError:
                continue
        return False

    def _discover(self) -> DriverFiles:
        libraries: dict[str, RootedPath] = {}
        links: dict[str, LibraryLink] = {}
        dangling: list[str] = []
        lib_folders: list[str] = []
        for container_dir, local_dir in self.existing_lib_dirs():
            found_here = False
            for entry in sorted(local_dir.iterdir(), key=lambda p: p.name):
                if not _is_compute_library(entry.name):
                    continue
                container_path = _join("/", container_dir, entry.name)
                if entry.is_symlink():
                    resolved = self.resolve(container_path)
                    if resolved is None or not Path(_join(self.root, resolved)).is_file():
                        log.warning("ignoring dangling driver library link %s", container_path)
                        dangling.append(f"{container_path} -> {os.readlink(entry)}")
                        continue
                    links[container_path] = LibraryLink(
                        container_path=container_path,
                        target=os.readlink(entry),
                        resolved=RootedPath(resolved, self.host_path(resolved)),
                    )
                    found_here = True
                elif entry.is_file():
                    libraries[container_path] = RootedPath(container_path, self.host_path(container_path))
                    found_here = True
            if found_here:
                lib_folders.append(_join("/", container_dir))
        if not any(PurePosixPath(p).name.startswith("libcuda.so") for p in libraries):
            raise DriverRootError(self._no_libcuda_message())
        version = self.driver_version or _version_from_libraries(libraries.values())
        return DriverFiles(
            version=version,
            libraries=tuple(libraries[k] for k in sorted(libraries)),
            soname_links=tuple(links[k] for k in sorted(links)),
            lib_folders=tuple(lib_folders),
            binaries=self._find_binaries(),
            firmware=self._find_firmware(version),
            hook=self._find_hook(),
            control_nodes=self._control_nodes(),
            dangling_links=tuple(dangling),
        )

    def _find_binaries(self) -> tuple[RootedPath, ...]:
        found: dict[str, RootedPath] = {}
        for name in BINARIES:
            for rel_dir in BINARY_DIRS:
                candidate = _join("/", rel_dir, name)
                resolved = self.resolve(candidate)
                if resolved is not None and Path(_join(self.root, resolved)).is_file():
                    # Mount at the conventional path, content from the resolved file.
                    found[name] = RootedPath(candidate, self.host_path(resolved))
                    break
        return tuple(found[name] for name in BINARIES if name in found)

    def find_binary(self, name: str) -> str | None:
        """Path (as this process sees it) of a driver program such as nvidia-smi, or None."""
        for rel_dir in BINARY_DIRS:
            resolved = self.resolve(_join("/", rel_dir, name))
            if resolved is not None and Path(_join(self.root, resolved)).is_file():
                return _join(self.root, resolved)
        return None

    def _find_firmware(self, version: str) -> tuple[RootedPath, ...]:
        candidate = f"/lib/firmware/nvidia/{version}"
        resolved = self.resolve(candidate)
        if resolved is None or not Path(_join(self.root, resolved)).is_dir():
            return ()
        return (RootedPath(candidate, self.host_path(resolved)),)

    def _no_libcuda_message(self) -> str:
        host = f" (host {self.host_root})" if str(self.host_root) != str(self.root) else ""
        host_fs = self.proc_root / "1" / "root"
        try:
            found = find_driver_roots(host_fs)
        except OSError as err:
            where = f"the node's other driver roots cannot be looked at through {host_fs} ({err.strerror or err})"
        else:
            where = (f"driver roots with libcuda.so.* on this node: {', '.join(found)}" if found else
                     f"none of {', '.join(KNOWN_DRIVER_ROOTS)} on this node has libcuda.so.* either; "
                     "is the NVIDIA driver installed?")
        return (f"driver root {self.root}{host} has no libcuda.so.* in any of {', '.join(LIBRARY_DIRS)}; "
                f"set --driver-root / --host-driver-root (chart value driverRoot) to the driver's folder; {where}")

    def _find_hook(self) -> RootedPath | None:
        if self.hook_path is not None:
            problem = hook_program_problem(self.hook_path)
            if problem is not None:
                raise CdiHookError(f"--cdi-hook-path {self.hook_path}: {problem} (chart value cdiHookPath; "
                                   "empty installs the image's nvidia-cdi-hook into the plugin directory)")
            return RootedPath(self.hook_path, self.hook_path)
        for name in HOOK_PROGRAMS:
            for rel_dir in BINARY_DIRS:
                candidate = _join("/", rel_dir, name)
                resolved = self.resolve(candidate)
                if resolved is not None and Path(_join(self.root, resolved)).is_file():
                    return RootedPath(resolved, self.host_path(resolved))
        return None

    # ----- device nodes --------------------------------------------------------------------------------------
    def _control_nodes(self) -> tuple[DeviceNodeInfo, ...]:
        nvidiactl = self.device_node("/dev/nvidiactl", required=True)
        assert nvidiactl is not None
        nodes = [nvidiactl]
        uvm_major = self.char_major("nvidia-uvm")
        for path, minor in (("/dev/nvidia-uvm", 0), ("/dev/nvidia-uvm-tools", 1)):
            node = self.device_node(path, required=False, fallback=(uvm_major, minor))
            if node is None:
                log.warning("%s is missing and /proc/devices has no nvidia-uvm entry; CUDA needs it "
                            "(load nvidia-uvm, e.g. with nvidia-modprobe -u -c=0)", path)
            else:
                nodes.append(node)
        return tuple(nodes)

    def gpu_node(self, minor: int) -> DeviceNodeInfo:
        """``/dev/nvidia<minor>`` for a GPU (the parent GPU for a MIG device)."""
        node = self.device_node(f"/dev/nvidia{minor}", required=True)
        assert node is not None
        return node

    def device_node(
        self, path: str, *, required: bool, fallback: tuple[int | None, int] | None = None
    ) -> DeviceNodeInfo | None:
        """Describe the device node at container ``path``.

        Present on the host: hostPath plus major/minor when it is a real character device (a fake tree uses
        plain files). Missing: built from ``fallback`` (major, minor) so the runtime creates it, else None, or
        an error when ``required``.
        """
        local = Path(_join(self.dev_root, path))
        host = _join(self.host_dev_root, path)
        try:
            st = local.stat()
        except FileNotFoundError:
            if fallback is not None and fallback[0] is not None:
                return DeviceNodeInfo(path=path, major=fallback[0], minor=fallback[1])
            if required:
                raise DriverRootError(f"device node {local} does not exist (needed for {path})") from None
            return None
        if stat.S_ISCHR(st.st_mode):
            return DeviceNodeInfo(path=path, host_path=host, major=os.major(st.st_rdev), minor=os.minor(st.st_rdev))
        return DeviceNodeInfo(path=path, host_path=host)

    def char_major(self, name: str) -> int | None:
        """Major number of a character driver from ``<proc>/devices`` (e.g. nvidia-caps), or None."""
        try:
            text = (self.proc_root / "devices").read_text()
        except OSError:
            return None
        in_char = False
        for line in text.splitlines():
            stripped = line.strip()
            if stripped.endswith(":"):
                in_char = stripped.lower().startswith("character")
                continue
            parts = stripped.split()
            if in_char and len(parts) == 2 and parts[1] == name and parts[0].isdigit():
                return int(parts[0])
        return None

    def mig_cap_nodes(self, gpu_minor: int, gi_id: int, ci_id: int) -> tuple[DeviceNodeInfo, DeviceNodeInfo]:
        """The ``/dev/nvidia-caps/nvidia-cap<N>`` nodes that grant access to one GI and one CI.

        The minors come from the driver's capability files; a container without them cannot open the MIG
        device even with the parent's ``/dev/nvidia<minor>``.
        """
        gi_access = self.proc_root / f"driver/nvidia/capabilities/gpu{gpu_minor}/mig/gi{gi_id}/access"
        ci_access = gi_access.parent / f"ci{ci_id}" / "access"
        major = self.char_major("nvidia-caps")
        nodes = []
        for access in (gi_access, ci_access):
            minor = _read_cap_minor(access)
            path = f"/dev/nvidia-caps/nvidia-cap{minor}"
            local = Path(_join(self.dev_root, path))
            host = _join(self.host_dev_root, path) if local.exists() else None
            if host is None and major is None:
                raise DriverRootError(
                    f"{local} does not exist and {self.proc_root / 'devices'} has no nvidia-caps entry; "
                    f"cannot describe the MIG capability node for {access}"
                )
            nodes.append(DeviceNodeInfo(path=path, host_path=host, major=major, minor=minor))
        return nodes[0], nodes[1]


# ----- start-up checks -------------------------------------------------------------------------------------------
def hook_program_problem(path: str) -> str | None:
    """Why ``path`` cannot be run as a CDI hook (None when it can): runc execs it by this absolute path."""
    if not path.startswith("/"):
        return "not an absolute path"
    try:
        st = os.stat(path)
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if not os.access(path, os.X_OK):
        return "not executable"
    return None


def find_driver_roots(host_fs: Path | str) -> list[str]:
    """The KNOWN_DRIVER_ROOTS that hold libcuda, read through ``host_fs``, the host's ``/`` as this process sees
    it (``/proc/1/root``: the host's own with the host PID namespace, else this container's). OSError when
    ``host_fs`` cannot be read."""
    os.listdir(host_fs)   # unreadable (no ptrace access to PID 1, no such root): say so, not "no driver"
    found = []
    for known in KNOWN_DRIVER_ROOTS:
        try:
            resolved = _resolve_in_root(Path(host_fs), known)   # e.g. a /usr/local/nvidia link into /home/kubernetes
            if resolved is not None and DriverRoot(_join(host_fs, resolved)).has_libcuda():
                found.append(known)
        except OSError:
            continue            # not ours to read (no permission to inspect PID 1): only a hint is lost
    return found


def check_real_node(driver_root: DriverRoot) -> DriverFiles:
    """What a real node needs before any claim is prepared, each failure one line naming its flag: the driver's
    libraries under the driver root, and a CDI hook (Debian and Ubuntu images search neither ``/lib64`` nor a
    driver's own folder, so the libraries are found only through the loader cache that the hook refreshes)."""
    files = driver_root.files()
    if files.hook is None:
        raise CdiHookError(
            f"no CDI hook: the driver root {driver_root.root} has none of {', '.join(HOOK_PROGRAMS)}; pass "
            "--cdi-hook-path with the host path of nvidia-cdi-hook (the chart installs the image's own)")
    return files


# ----- internals -------------------------------------------------------------------------------------------------
def _join(root: Path | PurePosixPath | str, *parts: str) -> str:
    """Join absolute-looking container paths under ``root`` (``Path('/x') / '/usr'`` would drop the root)."""
    out = PurePosixPath(str(root))
    for part in parts:
        out = out.joinpath(str(part).lstrip("/"))
    return str(out)


def _resolve_in_root(root: Path, relative: str) -> str | None:
    parts = [p for p in PurePosixPath("/" + relative.lstrip("/")).parts[1:]]
    resolved: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        local = Path(_join(root, *resolved, part))
        if local.is_symlink():
            hops += 1
            if hops > _MAX_LINK_HOPS:
                return None
            target = os.readlink(local)
            target_parts = list(PurePosixPath(target).parts)
            if target.startswith("/"):
                resolved = []
                target_parts = target_parts[1:]
            parts = target_parts + parts
            continue
        if not local.exists():
            return None
        resolved.append(part)
    return "/" + "/".join(resolved)


def _is_compute_library(name: str) -> bool:
    match = _VERSIONED.fullmatch(name)
    return match is not None and match.group("base") in COMPUTE_LIBRARIES


def _version_from_libraries(libraries: Collection[RootedPath]) -> str:
    # The real library files carry the driver version: libnvidia-ml.so.580.95.05.
    for preferred in ("libnvidia-ml.so.", "libcuda.so."):
        for lib in libraries:
            name = PurePosixPath(lib.container_path).name
            if name.startswith(preferred):
                candidate = name[len(preferred):]
                if _DRIVER_VERSION.fullmatch(candidate):
                    return candidate
    raise DriverRootError("cannot tell the driver version from the library file names "
                          "(expected e.g. libcuda.so.580.95.05, libnvidia-ml.so.580.95.05): the driver's "
                          "libraries are missing or renamed in this driver root")


def _read_cap_minor(access: Path) -> int:
    try:
        text = access.read_text()
    except OSError as err:
        raise DriverRootError(f"cannot read MIG capability file {access}: {err.strerror or err}") from None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "DeviceFileMinor":
            try:
                return int(value.strip())
            except ValueError:
                break
    raise DriverRootError(f"MIG capability file {access} has no valid 'DeviceFileMinor: <n>' line")
