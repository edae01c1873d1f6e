"""Resolve CDI device IDs against spec files the way a container runtime does at container creation.

Strict like the CDI library: unknown fields, unknown ``cdiVersion`` values, fields newer than the declared
version and two specs defining the same device in one directory are errors. Later directories override
earlier ones (``/etc/cdi`` then ``/var/run/cdi`` in production).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from standin.rules import CDI_DEVICE_ID

KNOWN_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")

_SPEC_FIELDS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
_DEVICE_FIELDS = {"name", "annotations", "containerEdits"}
_EDIT_FIELDS = {"env", "deviceNodes", "mounts", "hooks", "intelRdt", "additionalGids", "netDevices"}
_NODE_FIELDS = {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
_MOUNT_FIELDS = {"hostPath", "containerPath", "type", "options"}
_HOOK_FIELDS = {"hookName", "path", "args", "env", "timeout"}


class CdiError(ValueError):
    """A spec file a runtime would refuse, or a device ID it cannot resolve."""


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


@dataclass
class ContainerEdits:
    """The merged edits a runtime applies to one container."""

    env: list[str] = field(default_factory=list)
    device_nodes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    hooks: list[dict[str, Any]] = field(default_factory=list)
    additional_gids: list[int] = field(default_factory=list)

    def env_map(self) -> dict[str, str]:
        """Environment as a dict; a later entry for the same key wins, as in the runtime."""
        out: dict[str, str] = {}
        for item in self.env:
            key, _, value = item.partition("=")
            out[key] = value
        return out

    def device_paths(self) -> list[str]:
        return [n["path"] for n in self.device_nodes]

    def mount_targets(self) -> list[str]:
        return [m["containerPath"] for m in self.mounts]

    def add(self, edits: dict[str, Any]) -> None:
        self.env.extend(edits.get("env") or [])
        self.device_nodes.extend(edits.get("deviceNodes") or [])
        self.mounts.extend(edits.get("mounts") or [])
        self.hooks.extend(edits.get("hooks") or [])
        self.additional_gids.extend(edits.get("additionalGids") or [])


@dataclass(frozen=True)
class CdiDevice:
    qualified_name: str          # vendor/class=name
    spec_path: Path
    spec: dict[str, Any]
    device: dict[str, Any]


def _unknown(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise CdiError(f"{where}: unknown field(s) {', '.join(extra)}")


def _check_edits(edits: Any, where: str, version: tuple[int, ...]) -> None:
    if not isinstance(edits, dict):
        raise CdiError(f"{where}: containerEdits must be an object")
    _unknown(edits, _EDIT_FIELDS, where)
    if version < (0, 7, 0) and ("intelRdt" in edits or "additionalGids" in edits):
        raise CdiError(f"{where}: intelRdt/additionalGids need cdiVersion >= 0.7.0")
    if version < (1, 1, 0) and "netDevices" in edits:
        raise CdiError(f"{where}: netDevices need cdiVersion >= 1.1.0")
    for item in edits.get("env") or []:
        if not isinstance(item, str) or "=" not in item:
            raise CdiError(f"{where}.env: {item!r} is not KEY=VALUE")
    for i, node in enumerate(edits.get("deviceNodes") or []):
        _unknown(node, _NODE_FIELDS, f"{where}.deviceNodes[{i}]")
        if not node.get("path"):
            raise CdiError(f"{where}.deviceNodes[{i}]: path is required")
        if "hostPath" in node and version < (0, 5, 0):
            raise CdiError(f"{where}.deviceNodes[{i}]: hostPath needs cdiVersion >= 0.5.0")
        perms = node.get("permissions")
        if perms is not None and (not perms or set(perms) - set("rwm")):
            raise CdiError(f"{where}.deviceNodes[{i}]: permissions {perms!r} must be a subset of 'rwm'")
    for i, mount in enumerate(edits.get("mounts") or []):
        _unknown(mount, _MOUNT_FIELDS, f"{where}.mounts[{i}]")
        if not mount.get("containerPath") or not mount.get("hostPath"):
            raise CdiError(f"{where}.mounts[{i}]: hostPath and containerPath are required")
        if "type" in mount and version < (0, 4, 0):
            raise CdiError(f"{where}.mounts[{i}]: type needs cdiVersion >= 0.4.0")
    for i, hook in enumerate(edits.get("hooks") or []):
        _unknown(hook, _HOOK_FIELDS, f"{where}.hooks[{i}]")
        if not hook.get("hookName") or not str(hook.get("path", "")).startswith("/"):
            raise CdiError(f"{where}.hooks[{i}]: hookName and an absolute path are required")


def load_spec(path: Path) -> list[CdiDevice]:
    """Parse and validate one spec file; return its devices."""
    text = path.read_text()
    try:
        spec = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise CdiError(f"{path}: not valid {path.suffix[1:]}: {exc}") from exc
    if not isinstance(spec, dict):
        raise CdiError(f"{path}: a CDI spec must be an object")
    _unknown(spec, _SPEC_FIELDS, str(path))
    version_text = spec.get("cdiVersion")
    if version_text not in KNOWN_VERSIONS:
        raise CdiError(f"{path}: unknown cdiVersion {version_text!r}")
    version = _version(version_text)
    kind = spec.get("kind", "")
    if "/" not in kind or not CDI_DEVICE_ID.match(f"{kind}=x"):
        raise CdiError(f"{path}: kind {kind!r} is not vendor/class")
    if "annotations" in spec and version < (0, 6, 0):
        raise CdiError(f"{path}: annotations need cdiVersion >= 0.6.0")
    if "." in kind.partition("/")[2] and version < (0, 6, 0):
        raise CdiError(f"{path}: a class with dots ({kind}) needs cdiVersion >= 0.6.0")
    if "containerEdits" in spec:
        _check_edits(spec["containerEdits"], f"{path}: containerEdits", version)
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        raise CdiError(f"{path}: devices must be a non-empty list")
    out = []
    names = set()
    for i, dev in enumerate(devices):
        where = f"{path}: devices[{i}]"
        _unknown(dev, _DEVICE_FIELDS, where)
        name = dev.get("name", "")
        if not CDI_DEVICE_ID.match(f"{kind}={name}"):
            raise CdiError(f"{where}: invalid device name {name!r}")
        if name in names:
            raise CdiError(f"{where}: device {name!r} defined twice")
        if name[:1].isdigit() and version < (0, 5, 0):
            raise CdiError(f"{where}: device name {name!r} starts with a digit, which needs cdiVersion >= 0.5.0")
        names.add(name)
        if "annotations" in dev and version < (0, 6, 0):
            raise CdiError(f"{where}: annotations need cdiVersion >= 0.6.0")
        if "containerEdits" not in dev:
            raise CdiError(f"{where}: containerEdits is required")
        _check_edits(dev["containerEdits"], where, version)
        out.append(CdiDevice(f"{kind}={name}", path, spec, dev))
    return out


def spec_files(cdi_dirs: Sequence[Path | str]) -> list[Path]:
    """Every spec file in the given directories (``*.json``, ``*.yaml``), hidden temp files excluded."""
    files = []
    for d in cdi_dirs:
        d = Path(d)
        if d.is_dir():
            files.extend(sorted(p for p in d.iterdir() if p.suffix in (".json", ".yaml") and not p.name.startswith(".")))
    return files


def load_registry(cdi_dirs: Sequence[Path | str]) -> dict[str, CdiDevice]:
    """All devices, keyed by qualified name. Later directories override earlier ones; a conflict inside
    one directory is an error, as in the CDI library."""
    registry: dict[str, CdiDevice] = {}
    for d in cdi_dirs:
        in_dir: dict[str, CdiDevice] = {}
        for path in spec_files([d]):
            for dev in load_spec(path):
                if dev.qualified_name in in_dir:
                    raise CdiError(
                        f"device {dev.qualified_name} defined in both {in_dir[dev.qualified_name].spec_path} and {path}"
                    )
                in_dir[dev.qualified_name] = dev
        registry.update(in_dir)
    return registry


def resolve(cdi_dirs: Sequence[Path | str], cdi_ids: Sequence[str]) -> ContainerEdits:
    """The container edits for ``cdi_ids``: spec-level edits once per spec used, then each device's."""
    registry = load_registry(cdi_dirs)
    unresolved = [i for i in cdi_ids if i not in registry]
    if unresolved:
        raise CdiError(f"unresolvable CDI devices {', '.join(unresolved)}")
    edits = ContainerEdits()
    specs_done: set[Path] = set()
    for cdi_id in cdi_ids:
        dev = registry[cdi_id]
        if dev.spec_path not in specs_done:
            specs_done.add(dev.spec_path)
            edits.add(dev.spec.get("containerEdits") or {})
        edits.add(dev.device["containerEdits"])
    return edits
