"""Per-claim CDI specs: what the container runtime injects for each prepared device.

One spec file per claim, ``<specDir>/<vendor>-<class>_<claimUID>.json`` (JSON is valid CDI and several times faster to write than YAML) with kind ``<vendor>/<class>``
(default ``k8s.gpu.dra-driver.io/claim``) and one CDI device per prepared device, named
``<claimUID>-<deviceName>`` (plus ``-<shareID>`` for a consumable-capacity share). The kubelet hands the
fully qualified ids (``<vendor>/<class>=<name>``) to the runtime.

Two ways to describe a GPU:

* **Own edits** (default): enough for CUDA in a plain runc container with no NVIDIA runtime. Spec-level edits
  (applied once whenever any device of the claim is injected) carry ``/dev/nvidiactl``, ``/dev/nvidia-uvm*``,
  the driver's compute libraries, tools and firmware, mounted read-only. Each device adds its own
  ``/dev/nvidia<minor>`` and, for MIG, the ``/dev/nvidia-caps`` nodes of its GPU and compute instance.
  Library lookup: with a hook program (the driver's own ``nvidia-cdi-hook``, ``--cdi-hook-path``, or a host
  toolkit's in the driver root) the soname links are created by a ``create-symlinks`` hook, the container's
  loader cache learns the library folders through an ``update-ldcache`` hook, and a
  ``disable-device-node-modification`` hook keeps the driver from creating device nodes in the container, as
  NVIDIA's toolkit does. A real node always has one (start-up fails without). Only a simulated node may run
  without: then every soname link is bind-mounted as well (at its own path, showing the file it points to) and
  libraries are found only where the image's loader searches by default.
* **NVIDIA Container Toolkit specs**: when the host already has the toolkit's generated spec (``nvidia.com/gpu``
  or ``nvidia.com/mig`` in ``/etc/cdi`` or ``/var/run/cdi``) naming the device by UUID (or a whole GPU by
  index), its id is returned next to ours and our device keeps only env and mounts (MPS). Devices the
  toolkit spec does not know (e.g. a MIG device created just now) fall back to own edits.

``NVIDIA_VISIBLE_DEVICES`` lists, by UUID, the devices allocated for the same request(s) as the device; the
device nodes do the isolation, the variable only informs tools inside the container.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml

from dra.node.atomicfile import remove_file, remove_leftover_temp_files, write_atomic
from dra.node.driverroot import DeviceNodeInfo, DriverFiles, DriverRoot

log = logging.getLogger(__name__)

DEFAULT_VENDOR = "k8s.gpu.dra-driver.io"
DEFAULT_CLASS = "claim"
DEFAULT_SPEC_DIR = "/var/run/cdi"
TOOLKIT_SPEC_DIRS: tuple[str, ...] = ("/etc/cdi", "/var/run/cdi")
TOOLKIT_KINDS: tuple[str, ...] = ("nvidia.com/gpu", "nvidia.com/mig")

# Container paths of the MPS directories inside workload containers.
MPS_PIPE_CONTAINER_DIR = "/tmp/nvidia-mps"
MPS_SHM_CONTAINER_DIR = "/dev/shm"
MPS_PROGRAMS = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")

READ_ONLY_BIND = ["ro", "nosuid", "nodev", "rbind", "rprivate"]
READ_WRITE_BIND = ["rw", "nosuid", "nodev", "rbind", "rprivate"]
# An MPS daemon's shm directory as a client's /dev/shm: writable by every client of the daemon (other pods), so
# nothing there runs (noexec), as the tmpfs it is on a real node is mounted.
SHM_BIND = ["rw", "nosuid", "nodev", "noexec", "rbind", "rprivate"]

# CDI spec versions the container-device-interface library knows, oldest first, and what each added.
CDI_VERSIONS: tuple[str, ...] = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")

SpecFormat = Literal["yaml", "json"]


class CdiSpecError(ValueError):
    """A CDI spec that a runtime would reject; the message lists each problem with its field path."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid CDI spec: " + "; ".join(problems))


# ----- inputs ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MpsMounts:
    """Host directories of the MPS control daemon serving a device that its clients need: the control pipes
    and the shared memory it talks to them through. Never the daemon's log directory."""

    pipe_dir: str
    shm_dir: str


@dataclass(frozen=True)
class ClaimDevice:
    """One prepared device of a claim, as far as CDI cares."""

    name: str                              # DRA device name, e.g. gpu-0 or gpu-0-mig-1g10gb-19-0
    uuid: str                              # GPU-... for a whole GPU or slot, MIG-... for a MIG device
    gpu_minor: int                         # /dev/nvidia<minor> of the (parent) GPU
    gpu_index: int | None = None           # NVML index, to match toolkit specs that name GPUs by index
    mig: tuple[int, int] | None = None     # (GPU instance id, compute instance id) for a MIG device
    more_mig: tuple[tuple[str, int, int], ...] = ()   # further MIG devices (uuid, GI, CI) of the same share
    requests: tuple[str, ...] = ()
    share_id: str | None = None            # consumable-capacity share: one CDI device per share
    mps: MpsMounts | None = None
    env: tuple[str, ...] = ()              # extra "KEY=VALUE" entries (e.g. from the claim's config)


# ----- naming ------------------------------------------------------------------------------------------------------
_VENDOR_RE = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_CLASS_RE = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def qualified_device_id(vendor: str, cdi_class: str, name: str) -> str:
    return f"{vendor}/{cdi_class}={name}"


def claim_device_name(claim_uid: str, device: ClaimDevice) -> str:
    name = f"{claim_uid}-{device.name}"
    return f"{name}-{device.share_id}" if device.share_id else name


def spec_file_name(vendor: str, cdi_class: str, claim_uid: str, fmt: SpecFormat = "json") -> str:
    # The CDI library's transient-spec convention: <vendor>-<class>_<id>, slashes in the id replaced.
    return f"{vendor}-{cdi_class}_{claim_uid.replace('/', '_')}.{fmt}"


# ----- version and validation --------------------------------------------------------------------------------------
def required_version(spec: dict[str, Any]) -> str:
    """Lowest cdiVersion that supports every feature the spec uses (CDI SPEC.md version table)."""
    need = 0

    def bump(version: str) -> None:
        nonlocal need
        need = max(need, CDI_VERSIONS.index(version))

    kind = str(spec.get("kind", ""))
    if "." in kind.partition("/")[2]:
        bump("0.6.0")
    if spec.get("annotations"):
        bump("0.6.0")
    edits = [spec.get("containerEdits") or {}]
    for device in spec.get("devices") or []:
        name = str(device.get("name", ""))
        if name[:1].isdigit():
            bump("0.5.0")
        if device.get("annotations"):
            bump("0.6.0")
        edits.append(device.get("containerEdits") or {})
    for edit in edits:
        if any("type" in m for m in edit.get("mounts") or []):
            bump("0.4.0")
        if any("hostPath" in d for d in edit.get("deviceNodes") or []):
            bump("0.5.0")
        if edit.get("intelRdt") is not None or edit.get("additionalGids"):
            bump("0.7.0")
        if edit.get("netDevices"):
            bump("1.1.0")
    return CDI_VERSIONS[need]


_SPEC_FIELDS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
_DEVICE_FIELDS = {"name", "annotations", "containerEdits"}
_EDIT_FIELDS = {"env", "deviceNodes", "hooks", "mounts", "intelRdt", "additionalGids", "netDevices"}
_NODE_FIELDS = {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
_MOUNT_FIELDS = {"hostPath", "containerPath", "options", "type"}
_HOOK_FIELDS = {"hookName", "path", "args", "env", "timeout"}
_HOOK_NAMES = {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}


def validate_spec(spec: dict[str, Any]) -> None:
    """Check a spec the way the CDI Go library loads it: known fields only, names, kinds, version rule.

    Raises CdiSpecError listing every problem.
    """
    problems: list[str] = []
    _unknown(spec, _SPEC_FIELDS, "", problems)
    version = spec.get("cdiVersion")
    if version not in CDI_VERSIONS:
        problems.append(f"cdiVersion: {version!r} is not a known CDI version ({', '.join(CDI_VERSIONS)})")
    else:
        needed = required_version(spec)
        if CDI_VERSIONS.index(version) < CDI_VERSIONS.index(needed):
            problems.append(f"cdiVersion: {version} is lower than {needed}, which the spec's fields require")
    kind = spec.get("kind")
    vendor, slash, cdi_class = str(kind or "").partition("/")
    if not isinstance(kind, str) or not slash:
        problems.append(f"kind: {kind!r} must be '<vendor>/<class>'")
    else:
        if not _VENDOR_RE.fullmatch(vendor):
            problems.append(f"kind: vendor {vendor!r} must start with a letter, end with a letter or digit "
                            "and contain only letters, digits, '_', '-' and '.'")
        if not _CLASS_RE.fullmatch(cdi_class) or len(cdi_class) > 63:
            problems.append(f"kind: class {cdi_class!r} must start with a letter, end with a letter or digit, "
                            "contain only letters, digits, '_', '-' and '.' and be at most 63 characters")
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        problems.append("devices: must be a non-empty list")
        devices = []
    seen: set[str] = set()
    for i, device in enumerate(devices):
        where = f"devices[{i}]"
        if not isinstance(device, dict):
            problems.append(f"{where}: must be an object")
            continue
        _unknown(device, _DEVICE_FIELDS, where, problems)
        name = device.get("name")
        if not isinstance(name, str) or not _DEVICE_RE.fullmatch(name):
            problems.append(f"{where}.name: {name!r} must start and end with a letter or digit and contain only "
                            "letters, digits, '_', '-', '.' and ':'")
        elif name in seen:
            problems.append(f"{where}.name: {name!r} appears twice")
        else:
            seen.add(name)
        if "containerEdits" not in device:
            problems.append(f"{where}.containerEdits: required")
        else:
            _check_edits(device["containerEdits"], f"{where}.containerEdits", problems)
    if "containerEdits" in spec:
        _check_edits(spec["containerEdits"], "containerEdits", problems)
    if problems:
        raise CdiSpecError(problems)


def _unknown(obj: dict[str, Any], allowed: set[str], where: str, problems: list[str]) -> None:
    for key in obj:
        if key not in allowed:
            problems.append(f"{where + '.' if where else ''}{key}: unknown field")


def _check_edits(edits: Any, where: str, problems: list[str]) -> None:
    if not isinstance(edits, dict):
        problems.append(f"{where}: must be an object")
        return
    _unknown(edits, _EDIT_FIELDS, where, problems)
    for i, env in enumerate(edits.get("env") or []):
        if not isinstance(env, str) or not _ENV_RE.match(env):
            problems.append(f"{where}.env[{i}]: {env!r} must look like KEY=VALUE")
    for i, node in enumerate(edits.get("deviceNodes") or []):
        at = f"{where}.deviceNodes[{i}]"
        _unknown(node, _NODE_FIELDS, at, problems)
        if not str(node.get("path", "")).startswith("/"):
            problems.append(f"{at}.path: must be an absolute path")
        if "hostPath" in node and not str(node["hostPath"]).startswith("/"):
            problems.append(f"{at}.hostPath: must be an absolute path")
        if "permissions" in node and not set(str(node["permissions"])) <= set("rwm"):
            problems.append(f"{at}.permissions: only r, w and m are allowed")
        if "type" in node and node["type"] not in ("c", "b", "u", "p"):
            problems.append(f"{at}.type: {node['type']!r} is not a device type (c, b, u, p)")
    for i, mount in enumerate(edits.get("mounts") or []):
        at = f"{where}.mounts[{i}]"
        _unknown(mount, _MOUNT_FIELDS, at, problems)
        if not str(mount.get("containerPath", "")).startswith("/"):
            problems.append(f"{at}.containerPath: must be an absolute path")
        if not mount.get("hostPath"):
            problems.append(f"{at}.hostPath: required")
    for i, hook in enumerate(edits.get("hooks") or []):
        at = f"{where}.hooks[{i}]"
        _unknown(hook, _HOOK_FIELDS, at, problems)
        if hook.get("hookName") not in _HOOK_NAMES:
            problems.append(f"{at}.hookName: {hook.get('hookName')!r} is not one of {sorted(_HOOK_NAMES)}")
        if not str(hook.get("path", "")).startswith("/"):
            problems.append(f"{at}.path: must be an absolute path")


# ----- NVIDIA Container Toolkit specs ------------------------------------------------------------------------------
class ToolkitSpecs:
    """Device ids from the NVIDIA Container Toolkit's generated CDI specs on this host, if any.

    Files are re-read when their modification time changes (the toolkit's refresh service rewrites them).
    Later directories win on name conflicts, as in the runtimes.
    """

    def __init__(self, dirs: Sequence[Path | str] = TOOLKIT_SPEC_DIRS, ignore_vendor: str | None = None) -> None:
        self.dirs = [Path(d) for d in dirs]
        self.ignore_prefix = f"{ignore_vendor}-" if ignore_vendor else None
        self._cache: dict[Path, tuple[float, dict[str, str]]] = {}
        self._lock = threading.Lock()

    def _files(self) -> list[Path]:
        out: list[Path] = []
        for directory in self.dirs:
            if not directory.is_dir():
                continue
            for path in sorted(directory.iterdir()):
                if path.suffix not in (".yaml", ".json") or path.name.startswith("."):
                    continue
                if self.ignore_prefix and path.name.startswith(self.ignore_prefix):
                    continue  # our own claim specs
                out.append(path)
        return out

    def names(self) -> dict[str, str]:
        """Map device name (UUID or index) → fully qualified id, over all toolkit specs."""
        merged: dict[str, str] = {}
        with self._lock:
            for path in self._files():
                merged.update(self._load(path))
        return merged

    def _load(self, path: Path) -> dict[str, str]:
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return {}
        cached = self._cache.get(path)
        if cached and cached[0] == mtime:
            return cached[1]
        names: dict[str, str] = {}
        try:
            doc = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as err:
            log.warning("ignoring unreadable CDI spec %s: %s", path, err)
            doc = None
        if isinstance(doc, dict) and doc.get("kind") in TOOLKIT_KINDS:
            for device in doc.get("devices") or []:
                name = device.get("name") if isinstance(device, dict) else None
                if isinstance(name, str) and name:
                    vendor, cdi_class = doc["kind"].split("/", 1)
                    names[name] = qualified_device_id(vendor, cdi_class, name)
        self._cache[path] = (mtime, names)
        return names

    def lookup(self, device: ClaimDevice, names: dict[str, str] | None = None) -> str | None:
        """The toolkit id for ``device``: by UUID; a whole GPU also by NVML index."""
        names = self.names() if names is None else names
        if device.uuid in names:
            return names[device.uuid]
        if device.mig is None and device.gpu_index is not None:
            return names.get(str(device.gpu_index))
        return None


# ----- building ----------------------------------------------------------------------------------------------------
def _mount(host: str, container: str, options: list[str]) -> dict[str, Any]:
    return {"hostPath": host, "containerPath": container, "options": list(options)}


def common_edits(files: DriverFiles, mps_tools: bool = False) -> dict[str, Any]:
    """Edits every GPU container needs once: control nodes, libraries, tools, firmware, hooks. The MPS control
    programs only with ``mps_tools``: clients need just the pipe directory, and with the control program a root
    client could stop or reconfigure the daemon it shares."""
    mounts = [_mount(lib.host_path, lib.container_path, READ_ONLY_BIND) for lib in files.libraries]
    hooks: list[dict[str, Any]] = []
    if files.hook is None:
        # No hook to create soname links: show each link's target file at the link's path.
        mounts += [_mount(link.resolved.host_path, link.container_path, READ_ONLY_BIND) for link in files.soname_links]
    else:
        prefix = files.hook_args_prefix
        if files.soname_links:
            args = prefix + ["create-symlinks"]
            for link in files.soname_links:
                args += ["--link", f"{link.target}::{link.container_path}"]
            hooks.append({"hookName": "createContainer", "path": files.hook.host_path, "args": args})
        if files.lib_folders:
            # The container's loader cache learns the library folders: Debian/Ubuntu images search neither /lib64
            # nor a driver's own folder, so without it CUDA finds no libcuda there.
            args = prefix + ["update-ldcache"]
            for folder in files.lib_folders:
                args += ["--folder", folder]
            hooks.append({"hookName": "createContainer", "path": files.hook.host_path, "args": args})
        # A container's driver calls (as root) must not re-create /dev/nvidia* nodes it was not given
        # (ModifyDeviceFiles: 0 in its /proc/driver/nvidia/params); the device cgroup still decides access.
        hooks.append({"hookName": "createContainer", "path": files.hook.host_path,
                      "args": prefix + ["disable-device-node-modification"]})
    mounts += [_mount(b.host_path, b.container_path, READ_ONLY_BIND) for b in files.binaries
               if mps_tools or os.path.basename(b.container_path) not in MPS_PROGRAMS]
    mounts += [_mount(f.host_path, f.container_path, READ_ONLY_BIND) for f in files.firmware]
    mounts += [_mount(d.host_path, d.container_path, READ_ONLY_BIND) for d in files.data_dirs]
    mounts += [_mount(d.host_path, d.container_path, READ_WRITE_BIND) for d in files.writable_dirs]
    edits: dict[str, Any] = {"deviceNodes": [n.to_cdi() for n in files.control_nodes], "mounts": mounts}
    if hooks:
        edits["hooks"] = hooks
    return edits


def _visible_uuids(devices: Sequence[ClaimDevice]) -> list[str]:
    """Per device, the UUIDs of all devices sharing a request with it (the device itself when it has none)."""
    out = []
    for device in devices:
        mates = [u for d in devices if d is device or (set(d.requests) & set(device.requests))
                 for u in (d.uuid, *(m[0] for m in d.more_mig))]
        out.append(",".join(dict.fromkeys(mates)))
    return out


def _sharing_edits(device: ClaimDevice) -> tuple[list[str], list[dict[str, Any]]]:
    if device.mps is None:
        return [], []  # time-slicing needs nothing in the container: the GPU-wide setting does it
    env = [f"CUDA_MPS_PIPE_DIRECTORY={MPS_PIPE_CONTAINER_DIR}"]
    # Clients and the MPS server talk through shared memory, so the container's /dev/shm must be the daemon's.
    # The pipe directory is read-only: clients only connect to its sockets, while the (root) daemon writes its
    # PID file and log there following links.
    mounts = [_mount(device.mps.pipe_dir, MPS_PIPE_CONTAINER_DIR, READ_ONLY_BIND),
              _mount(device.mps.shm_dir, MPS_SHM_CONTAINER_DIR, SHM_BIND)]
    return env, mounts


def build_claim_spec(
    claim_uid: str,
    devices: Sequence[ClaimDevice],
    driver_root: DriverRoot | None,
    *,
    vendor: str = DEFAULT_VENDOR,
    cdi_class: str = DEFAULT_CLASS,
    toolkit_names: dict[str, str] | None = None,
    toolkit: ToolkitSpecs | None = None,
    mps_tools: bool = False,
) -> tuple[dict[str, Any], list[list[str]]]:
    """Build the claim's spec and the CDI ids per device (same order as ``devices``).

    ``driver_root`` may be None only when every device is covered by a toolkit spec; ``mps_tools``: containers
    get the MPS control programs (``common_edits``).
    """
    if not devices:
        raise ValueError(f"claim {claim_uid}: no devices to describe in a CDI spec")
    spec_devices: list[dict[str, Any]] = []
    ids: list[list[str]] = []
    need_common = False
    for device, visible in zip(devices, _visible_uuids(devices)):
        name = claim_device_name(claim_uid, device)
        env = [f"NVIDIA_VISIBLE_DEVICES={visible}", *device.env]
        mps_env, mounts = _sharing_edits(device)
        edits: dict[str, Any] = {"env": env + mps_env}
        parts = [device, *(replace(device, uuid=uuid, mig=(gi, ci), more_mig=()) for uuid, gi, ci in device.more_mig)]
        found = [toolkit.lookup(part, toolkit_names) for part in parts] if toolkit is not None else [None]
        toolkit_ids = [t for t in found if t is not None] if all(found) else []
        if not toolkit_ids:
            if driver_root is None:
                raise ValueError(f"device {device.name} ({device.uuid}) is in no toolkit CDI spec and no driver root "
                                 "is configured")
            nodes: list[DeviceNodeInfo] = [driver_root.gpu_node(device.gpu_minor)]
            for part in parts:
                if part.mig is not None:
                    nodes += list(driver_root.mig_cap_nodes(part.gpu_minor, *part.mig))
            edits["deviceNodes"] = [n.to_cdi() for n in nodes]
            need_common = True
        if mounts:
            edits["mounts"] = mounts
        spec_devices.append({"name": name, "containerEdits": edits})
        ids.append([qualified_device_id(vendor, cdi_class, name), *toolkit_ids])
    spec: dict[str, Any] = {"cdiVersion": "", "kind": f"{vendor}/{cdi_class}"}
    if need_common:
        assert driver_root is not None
        spec["containerEdits"] = common_edits(driver_root.files(), mps_tools)
    spec["devices"] = spec_devices
    spec["cdiVersion"] = required_version(spec)
    return spec, ids


# ----- writing -----------------------------------------------------------------------------------------------------
class CdiSpecWriter:
    """Writes, lists and deletes the per-claim spec files in one spec directory."""

    def __init__(
        self,
        spec_dir: Path | str = DEFAULT_SPEC_DIR,
        driver_root: DriverRoot | None = None,
        *,
        vendor: str = DEFAULT_VENDOR,
        cdi_class: str = DEFAULT_CLASS,
        fmt: SpecFormat = "json",
        toolkit: ToolkitSpecs | None = None,
        mps_tools: bool = False,
    ) -> None:
        if not _VENDOR_RE.fullmatch(vendor):
            raise ValueError(f"CDI vendor {vendor!r}: must start with a letter, end with a letter or digit and "
                             "contain only letters, digits, '_', '-' and '.'")
        if not _CLASS_RE.fullmatch(cdi_class):
            raise ValueError(f"CDI class {cdi_class!r}: must start with a letter, end with a letter or digit and "
                             "contain only letters, digits, '_', '-' and '.'")
        if fmt not in ("yaml", "json"):
            raise ValueError(f"CDI spec format {fmt!r}: must be 'yaml' or 'json'")
        self.spec_dir = Path(spec_dir)
        self.driver_root = driver_root
        self.vendor = vendor
        self.cdi_class = cdi_class
        self.fmt: SpecFormat = fmt
        self.toolkit = toolkit
        self.mps_tools = mps_tools      # the node policy's mps.controlInContainers

    @property
    def kind(self) -> str:
        return f"{self.vendor}/{self.cdi_class}"

    def spec_path(self, claim_uid: str) -> Path:
        return self.spec_dir / spec_file_name(self.vendor, self.cdi_class, claim_uid, self.fmt)

    def build(self, claim_uid: str, devices: Sequence[ClaimDevice]) -> tuple[dict[str, Any], list[list[str]]]:
        names = self.toolkit.names() if self.toolkit is not None else None
        return build_claim_spec(claim_uid, devices, self.driver_root, vendor=self.vendor, cdi_class=self.cdi_class,
                                toolkit_names=names, toolkit=self.toolkit, mps_tools=self.mps_tools)

    def write_claim_spec(self, claim_uid: str, devices: Sequence[ClaimDevice]) -> list[list[str]]:
        """Write (or replace) the claim's spec atomically; returns the CDI ids per device, in input order."""
        spec, ids = self.build(claim_uid, devices)
        validate_spec(spec)
        if self.fmt == "json":
            data = json.dumps(spec, separators=(",", ":")).encode() + b"\n"
        else:
            data = yaml.safe_dump(spec, sort_keys=False, default_flow_style=False).encode()
        # Not fsync'd: a spec names devices that exist only until the next reboot, and a reboot drops every
        # prepared claim anyway (the checkpoint's boot ID); the rename alone keeps it whole for readers.
        write_atomic(self.spec_path(claim_uid), data, durable=False)
        return ids

    def delete_claim_spec(self, claim_uid: str) -> bool:
        """Remove the claim's spec (either format). A missing file is fine; returns whether one was removed."""
        removed = False
        for fmt in ("json", "yaml"):
            removed |= remove_file(self.spec_dir / spec_file_name(self.vendor, self.cdi_class, claim_uid, fmt),
                                   durable=False)
        return removed

    def list_claim_specs(self) -> dict[str, Path]:
        """Claim UID → spec file, for every claim spec of this vendor/class present (to find orphans)."""
        prefix = f"{self.vendor}-{self.cdi_class}_"
        out: dict[str, Path] = {}
        if not self.spec_dir.is_dir():
            return out
        for path in sorted(self.spec_dir.iterdir()):
            if path.name.startswith(prefix) and path.suffix in (".yaml", ".json"):
                out[path.name[len(prefix):-len(path.suffix)]] = path
        return out

    def remove_leftover_temp_files(self) -> list[Path]:
        """Delete temporary files a crash during a write left behind (they never shadow real specs)."""
        return remove_leftover_temp_files(self.spec_dir)


def load_spec(path: Path | str) -> dict[str, Any]:
    """Read a spec file (YAML or JSON) as a dict."""
    text = Path(path).read_text()
    doc = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if not isinstance(doc, dict):
        raise CdiSpecError([f"{path}: not a CDI spec object"])
    return doc
