"""mig-parted configs (``version: v1``, ``mig-configs``) -> MIG node policy rules and the MIG state they imply.

An entry selects GPUs by index (``devices: all | [0, 1]``) and PCI device id (``device-filter``) and says whether
MIG is on and which partitions to create. Static MIG (the default) publishes the partitions that exist, so the
state must be created first (``nvidia-smi`` commands, or mig-parted itself, which keeps working); dynamic MIG
(``--dynamic-mig``) publishes the profiles an entry names (``dynamicMig.profiles``; every profile where it names
none) at every placement and creates the partition a claim gets; with ``--mig-capacity`` an entry that names
exactly one profile publishes it as one device per GPU with ``instances`` capacity (``dynamicMig.layout:
capacity``, Kubernetes 1.36+), which costs the scheduler far less than one device per placement.

A ``device-filter`` (one PCI id or a list, as in the GPU operator's default config) limits an entry to those GPU
models: ids the catalog knows become node policy rules by model, each unknown id is one report line and the
rest of the entry is kept. Whether an entry can be made on a GPU (the profile exists there, counts and
placements fit its slices) is checked from the catalog's geometry: here, per model for the models a filter
names, and for an entry without a filter against every MIG-capable model of the catalog (an entry no GPU can
hold is refused, whether or not a Node uses its config); per node (GFD's product label) in ``nodegroups``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import pynvml

from dra.model.catalog import CATALOG, GpuModel
from dra.model.gpu import MigProfile
from ops.convert.deviceplugin import ConvertError
from ops.convert.findings import Findings

_PROFILE = re.compile(r"^(?:(?P<c>\d+)c\.)?(?P<g>\d+)g\.(?P<gb>\d+)gb(?P<attr>(?:\+[a-z.]+|-me))?$")


@dataclass(frozen=True)
class MigEntry:
    devices: str | tuple[int, ...]        # "all" or GPU indices
    models: tuple[str, ...] = ()          # catalog model names from device-filter
    filtered: bool = False                # a device-filter was given: the entry is for ``models`` only
    enabled: bool = False
    instances: tuple[str, ...] = ()       # one profile name per partition to create
    problem: str | None = None            # why the entry cannot be made on any GPU

    def applies_to(self, model: str) -> bool:
        return not self.filtered or model in self.models

    def applies_to_index(self, model: str, index: int) -> bool:
        return self.applies_to(model) and (self.devices == "all" or index in self.devices)

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

    def entries_for(self, model: str) -> list[MigEntry]:
        return [e for e in self.entries if e.applies_to(model)]


def check(entry: MigEntry, model: GpuModel) -> str | None:
    """Why ``entry`` cannot be made on a GPU of ``model`` (from the catalog's MIG geometry), or None."""
    if not entry.enabled:
        return None
    if entry.problem:
        return entry.problem
    if not model.mig_capable:
        return f"{model.name} does not support MIG"
    profiles = []
    for name in entry.instances:
        try:
            profiles.append(model.profile(name))
        except ValueError as exc:
            return str(exc)
    for p in {p.name: p for p in profiles}.values():
        n = sum(1 for q in profiles if q.name == p.name)
        if n > p.max_instances:
            return f"{n} x {p.name}: at most {p.max_instances} on {model.name}"
    compute = sum(p.compute_slices for p in profiles)
    if compute > model.mig_compute_slices:
        return (f"{' + '.join(entry.instances)} needs {compute} compute slices; {model.name} has "
                f"{model.mig_compute_slices}")
    memory = sum(p.memory_slices for p in profiles)
    if memory > model.mig_memory_slices:
        return (f"{' + '.join(entry.instances)} needs {memory} memory slices; {model.name} has "
                f"{model.mig_memory_slices}")
    if _placements(profiles, model.mig_memory_slices) is None:
        return f"{' + '.join(entry.instances)}: no placement of these partitions fits on {model.name}"
    return None


def no_gpu_holds(entry: MigEntry) -> str | None:
    """Why no MIG-capable GPU of the catalog can hold ``entry`` (an entry without a device-filter may be used
    on any of them), or None when one can. Only the models that have every profile it names are judged on
    counts and slices: the others' lack of a profile says nothing about the entry's layout."""
    names = list(dict.fromkeys(entry.instances))
    models = [m for m in CATALOG.values() if m.mig_capable]
    candidates = [m for m in models if all(any(p.name == n for p in m.mig_profiles) for n in names)]
    if not candidates:
        unknown = [n for n in names if not any(p.name == n for m in models for p in m.mig_profiles)]
        if unknown:
            return f"no GPU of the catalog has MIG profile {', '.join(unknown)}"
        return f"no GPU of the catalog has all of the MIG profiles {', '.join(names)}"
    reasons = []
    for model in candidates:
        why = check(entry, model)
        if why is None:
            return None
        reasons.append(why)
    return "; ".join(reasons)


def _placements(profiles: list[MigProfile], slices: int) -> list[int] | None:
    """A start per partition (largest first) such that none overlap, or None where no such placement exists:
    a search over the valid starts, as the profiles of one GPU are few."""
    order = sorted(profiles, key=lambda p: -p.memory_slices)

    def place(i: int, used: frozenset[int]) -> list[int] | None:
        if i == len(order):
            return []
        p = order[i]
        for s in p.starts:
            span = set(range(s, s + p.memory_slices))
            if s + p.memory_slices <= slices and not span & used:
                rest = place(i + 1, used | span)
                if rest is not None:
                    return [s, *rest]
        return None

    return place(0, frozenset())


def model_for_filter(value: Any) -> GpuModel | None:
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
    if devices != "all":
        f.converted(source, f"{path}.devices", f"node policy rules matching index {', '.join(map(str, devices))}")
    else:
        f.converted(source, f"{path}.devices", "all GPUs of the device-filter's models: node policy rules by model"
                    if "device-filter" in raw else "all GPUs: the node policy's default")
    models: list[str] = []
    filtered = "device-filter" in raw
    if filtered:
        listed = isinstance(raw["device-filter"], list)
        filters = raw["device-filter"] if listed else [raw["device-filter"]]
        for j, flt in enumerate(filters):
            model = model_for_filter(flt)
            at = f"{path}.device-filter[{j}]" if listed else f"{path}.device-filter"
            if model is None:
                f.refused(source, at, f"{flt}: no GPU model with this PCI id in the catalog; GPUs with this id "
                                      "are not converted (the entry's other ids are)")
            elif model.name not in models:
                models.append(model.name)
                f.converted(source, at, f"{flt}: node policy match model: {model.name}")
            else:
                f.converted(source, at, f"{flt}: {model.name} again")
        if not models:
            f.refused(source, path, "no PCI id of its device-filter is in the catalog: the entry is left out")
            return None
    enabled = raw.get("mig-enabled", False)
    if not isinstance(enabled, bool):
        raise ConvertError(f"{source}: {path}.mig-enabled must be true or false, got {enabled!r}")
    f.converted(source, f"{path}.mig-enabled", "mig: static (or dynamic), wholeGpu: false" if enabled
                else "mig: none; the GPUs get the device plugin config's sharing")
    instances: list[str] = []
    problem = None
    for profile, count in (raw.get("mig-devices") or {}).items():
        where = f"{path}.mig-devices.{profile}"
        m = _PROFILE.match(str(profile))
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ConvertError(f"{source}: {where} must be a count, got {count!r}")
        if m is None:
            raise ConvertError(f"{source}: {where}: not a MIG profile name like 1g.10gb")
        if m.group("c") and m.group("c") != m.group("g"):
            problem = (f"{profile}: a compute instance smaller than its GPU instance is not published by this "
                       "driver (every partition here spans its GPU instance)")
            f.refused(source, where, problem + "; nodes with this config are refused")
            continue
        name = f"{m.group('g')}g.{m.group('gb')}gb{m.group('attr') or ''}"
        instances += [name] * count
        f.converted(source, where, f"{count} x {name}")
    if "mig-devices" in raw and not raw["mig-devices"]:
        f.converted(source, f"{path}.mig-devices", "no partitions")
    entry = MigEntry(devices, tuple(models), filtered, enabled, tuple(instances), problem)
    if problem:
        return entry
    for mod in models:   # the filter's models are known now; nodes of other models are checked per node
        why = check(entry, CATALOG[mod])
        if why:
            f.refused(source, path, f"not possible on {mod}: {why}; nodes with this GPU are refused")
    why = no_gpu_holds(entry) if enabled and not filtered else None
    if why:
        why = f"no GPU of the catalog can hold it: {why}"
        f.refused(source, path, f"{why}; nodes of the catalog's GPUs with this config are refused")
        return replace(entry, problem=why)
    return entry


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


def gpu_policy(entry: MigEntry, dynamic: bool, capacity: bool = False) -> dict[str, Any]:
    """The node policy fields of an enabled entry. Dynamic MIG publishes only the profiles the entry names (each
    at every placement): the scheduler pays for every published device, and the config says which profiles the
    cluster uses. An entry that names none (MIG on, partitions left to others) publishes every profile.
    ``capacity``: an entry of one profile publishes it as one device with instances capacity."""
    if not dynamic:
        return {"wholeGpu": False, "mig": "static"}
    out: dict[str, Any] = {"wholeGpu": False, "mig": "dynamic"}
    if entry.instances:
        profiles = list(dict.fromkeys(entry.instances))
        out["dynamicMig"] = {"profiles": profiles}
        if capacity and len(profiles) == 1:
            out["dynamicMig"]["layout"] = "capacity"
    return out


def commands(cfg: MigConfig, model: str, count: int, dynamic: bool) -> list[str]:
    """The ``nvidia-smi`` commands that make the config's MIG state on a node with ``count`` GPUs of ``model``:
    one GPU each (``-i``), MIG mode changed only on the GPUs an entry names, partitions on those it enables.
    Plain commands without shell syntax, each runnable as written. Ampere GPUs switch MIG mode at a reset
    (``-r``, which needs the GPU idle); later ones at once. Partitions are created largest first: NVML places
    each one itself (one-slice profiles low, larger ones high), and that order leaves room for the small ones."""
    gpu = CATALOG[model]
    out: list[str] = []
    for i in range(count):
        e = next((e for e in cfg.entries if e.applies_to_index(model, i)), None)
        if e is None:
            continue   # as mig-parted: a GPU no entry selects is left as it is
        out.append(f"nvidia-smi -i {i} -mig {1 if e.enabled else 0}")
        if gpu.architecture == pynvml.NVML_DEVICE_ARCH_AMPERE:
            out.append(f"nvidia-smi -i {i} -r")
        if not e.enabled:
            continue
        if dynamic:   # the plugin creates each claim's partition; existing ones would be published by nothing
            out += [f"nvidia-smi mig -i {i} -dci", f"nvidia-smi mig -i {i} -dgi"]
        elif e.instances:
            ordered = sorted(e.instances, key=lambda n: -gpu.profile(n).memory_slices)
            out.append(f"nvidia-smi mig -i {i} -cgi {','.join(ordered)} -C")
    return out


def state(cfg: MigConfig, dynamic: bool,
          layouts: dict[tuple[str, int | None], list[str]] | None = None) -> dict[str, Any]:
    """The MIG state the config implies, per entry, and per kind of node that uses it (GPU model and count:
    ``layouts`` -> node names) the ``nvidia-smi`` commands that create it."""
    gpus = [{"devices": "all" if e.devices == "all" else list(e.devices),
             **({"models": list(e.models)} if e.filtered else {}),
             "migEnabled": e.enabled, "instances": [] if dynamic else list(e.instances),
             **({"problem": f"{e.problem}: no node can take this entry"} if e.problem else {})}
            for e in cfg.entries]
    nodes = []
    for (model, count), names in sorted((layouts or {}).items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        item: dict[str, Any] = {"model": model, "gpuCount": count, "nodes": sorted(names)}
        if count is None:
            item["commands"] = []
            item["note"] = "no nvidia.com/gpu.count label: the GPUs to run commands for are not known"
        else:
            item["commands"] = commands(cfg, model, count, dynamic)
        nodes.append(item)
    return {"migConfig": cfg.name, "dynamic": dynamic, "gpus": gpus, "nodes": nodes}
