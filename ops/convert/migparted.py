"""mig-parted configs (``version: v1``, ``mig-configs``) -> MIG node policy rules and the MIG state they imply.

An entry selects GPUs by index (``devices: all | [0, 1]``) and PCI device id (``device-filter``) and says whether
MIG is on and which partitions to create. Static MIG (the default) publishes the partitions that exist, so the
state must be created first (``nvidia-smi`` commands, or mig-parted itself, which keeps working); dynamic MIG
(``--dynamic-mig``) publishes every profile at every placement and creates the partition a claim gets.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from dra.model.catalog import CATALOG, GpuModel
from ops.convert.deviceplugin import ConvertError
from ops.convert.findings import Findings

_PROFILE = re.compile(r"^(?:(?P<c>\d+)c\.)?(?P<g>\d+)g\.(?P<gb>\d+)gb(?P<attr>(?:\+[a-z.]+|-me))?$")


@dataclass(frozen=True)
class MigEntry:
    devices: str | tuple[int, ...]        # "all" or GPU indices
    models: tuple[str, ...] = ()          # catalog model names from device-filter; () = any
    enabled: bool = False
    instances: tuple[str, ...] = ()       # one profile name per partition to create

    def matches(self) -> list[dict[str, Any]]:
        """Node policy ``match`` blocks for the GPUs of this entry ([] when it is every GPU)."""
        indices: list[int | None] = list(self.devices) if isinstance(self.devices, tuple) else [None]
        models: list[str | None] = list(self.models) or [None]
        out = []
        for i in indices:
            for m in models:
                sel = {k: v for k, v in (("index", i), ("model", m)) if v is not None}
                if sel:
                    out.append(sel)
        return out


@dataclass
class MigConfig:
    name: str
    source: str
    entries: list[MigEntry] = field(default_factory=list)

    def profiles(self) -> set[str]:
        return {p for e in self.entries if e.enabled for p in e.instances}


def _model_for_filter(value: Any) -> GpuModel | None:
    """``0x233010DE`` (device id << 16 | vendor) -> the catalog model with that PCI device id."""
    try:
        number = int(str(value), 16)
    except ValueError:
        return None
    if number & 0xFFFF != 0x10DE:
        return None
    return next((m for m in CATALOG.values() if m.pci_device_id == number >> 16), None)


def _devices(value: Any, where: str) -> str | tuple[int, ...]:
    if value == "all":
        return "all"
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                 for i in value):
        return tuple(value)
    raise ConvertError(f"{where}.devices must be all or a list of GPU indices, got {value!r}")


def _entry(source: str, path: str, raw: Any, f: Findings) -> MigEntry | None:
    if not isinstance(raw, dict):
        raise ConvertError(f"{source}: {path} must be a mapping")
    devices = _devices(raw.get("devices"), f"{source}: {path}")
    f.converted(source, f"{path}.devices", "all GPUs: the node policy's default" if devices == "all"
                else f"node policy rules matching index {', '.join(map(str, devices))}")
    models: list[str] = []
    if "device-filter" in raw:
        filters = raw["device-filter"] if isinstance(raw["device-filter"], list) else [raw["device-filter"]]
        for flt in filters:
            model = _model_for_filter(flt)
            if model is None:
                f.refused(source, f"{path}.device-filter", f"{flt}: no GPU model with this PCI id in the catalog; "
                                                           "the entry is left out")
                return None
            models.append(model.name)
        f.converted(source, f"{path}.device-filter", f"node policy match model: {', '.join(models)}")
    enabled = raw.get("mig-enabled", False)
    if not isinstance(enabled, bool):
        raise ConvertError(f"{source}: {path}.mig-enabled must be true or false, got {enabled!r}")
    f.converted(source, f"{path}.mig-enabled", "mig: static (or dynamic), wholeGpu: false" if enabled
                else "mig: none; the GPUs get the device plugin config's sharing")
    instances: list[str] = []
    for profile, count in (raw.get("mig-devices") or {}).items():
        where = f"{path}.mig-devices.{profile}"
        m = _PROFILE.match(str(profile))
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ConvertError(f"{source}: {where} must be a count, got {count!r}")
        if m is None:
            raise ConvertError(f"{source}: {where}: not a MIG profile name like 1g.10gb")
        if m.group("c") and m.group("c") != m.group("g"):
            f.refused(source, where, "a compute instance smaller than its GPU instance is not published by this "
                                     "driver (every partition here spans its GPU instance)")
            continue
        name = f"{m.group('g')}g.{m.group('gb')}gb{m.group('attr') or ''}"
        unknown = [mod for mod in models if name not in {p.name for p in CATALOG[mod].mig_profiles}]
        if unknown:
            f.refused(source, where, f"{', '.join(unknown)} has no MIG profile {name}")
            continue
        instances += [name] * count
        f.converted(source, where, f"{count} x {name}")
    if "mig-devices" in raw and not raw["mig-devices"]:
        f.converted(source, f"{path}.mig-devices", "no partitions")
    return MigEntry(devices, tuple(models), enabled, tuple(instances))


def parse_mig_parted_config(source: str, doc: dict[str, Any], f: Findings) -> list[MigConfig]:
    if doc.get("version") != "v1":
        raise ConvertError(f"{source}: version must be v1, got {doc.get('version')!r}")
    f.converted(source, "version", "v1")
    configs = doc.get("mig-configs")
    if not isinstance(configs, dict) or not configs:
        raise ConvertError(f"{source}: mig-configs must be a mapping of config names to lists of entries")
    out = []
    for name, entries in configs.items():
        if not isinstance(entries, list):
            raise ConvertError(f"{source}: mig-configs.{name} must be a list of entries")
        cfg = MigConfig(name=str(name), source=source)
        for i, raw in enumerate(entries):
            entry = _entry(source, f"mig-configs.{name}[{i}]", raw, f)
            if entry is not None:
                cfg.entries.append(entry)
        out.append(cfg)
    f.cover_rest(source, doc)
    return out


def gpu_policy(entry: MigEntry, dynamic: bool) -> dict[str, Any]:
    return {"wholeGpu": False, "mig": "dynamic" if dynamic else "static"}


def state(cfg: MigConfig, dynamic: bool) -> dict[str, Any]:
    """The MIG state the config implies, per entry, with the ``nvidia-smi`` commands that create it."""
    gpus, commands = [], []
    for e in cfg.entries:
        target = "" if e.devices == "all" else f" -i {','.join(map(str, e.devices))}"
        if e.models:
            target += f"   # GPUs of model {', '.join(e.models)} only"
        gpus.append({"devices": "all" if e.devices == "all" else list(e.devices),
                     **({"models": list(e.models)} if e.models else {}),
                     "migEnabled": e.enabled, "instances": [] if dynamic else list(e.instances)})
        if not e.enabled:
            commands.append(f"nvidia-smi{target.split('#')[0].rstrip()} -mig 0")
            continue
        commands.append(f"nvidia-smi{target.split('#')[0].rstrip()} -mig 1")
        if dynamic:
            # The plugin creates each claim's partition; existing ones would be published by nothing.
            commands.append(f"nvidia-smi mig{target.split('#')[0].rstrip()} -dci && "
                            f"nvidia-smi mig{target.split('#')[0].rstrip()} -dgi")
        elif e.instances:
            commands.append(f"nvidia-smi mig{target} -cgi {','.join(e.instances)} -C")
    return {"migConfig": cfg.name, "dynamic": dynamic, "gpus": gpus, "commands": commands}
