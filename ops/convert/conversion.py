"""One conversion: read the input documents, convert them, and lay the results out as files.

Documents are told apart by shape: ``mig-configs`` is a mig-parted config; ``version`` with ``flags``, ``sharing``,
``resources`` or ``imex`` and no ``kind`` a device plugin config (named after its file, or the ConfigMap key
holding it); Nodes give the node groups; any other Kubernetes object is a workload (kept as it is when it has
no pod template).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import yaml

from ops.convert.deviceplugin import ConvertError, DevicePluginConfig, parse_device_plugin_config
from ops.convert.findings import Findings
from ops.convert.migparted import MigConfig, parse_mig_parted_config, state
from ops.convert.nodegroups import NodeGroup, build_groups
from ops.convert.workloads import WorkloadOptions, convert_objects

_DP_KEYS = {"flags", "sharing", "resources", "imex"}
# Exit statuses of gpu-dra convert (2: input that cannot be read, nothing written).
EXIT_CHANGED = 3    # written; some fields mean something else here
EXIT_REFUSED = 4    # written; some fields, nodes or workloads were refused (left out)


@dataclass
class Options:
    driver: str
    dynamic_mig: bool = False
    mig_capacity: bool = False             # with dynamic_mig: one-profile entries as dynamicMig.layout: capacity
    extended_resource: bool = False     # whole-GPU nvidia.com/gpu stays (compatibility mode's DeviceClass)
    default_config: str | None = None   # the device plugin config of nodes without the label
    all_configs: bool = False           # write the MIG state of configs that no given Node uses too


@dataclass
class Result:
    groups: list[NodeGroup] = field(default_factory=list)
    mig_states: list[dict[str, Any]] = field(default_factory=list)
    objects: list[dict[str, Any]] = field(default_factory=list)
    findings: Findings = field(default_factory=Findings)
    nodes: int = 0
    workloads: int = 0

    def summary(self) -> list[str]:
        grouped = sum(len(g.nodes) for g in self.groups)
        refused_wl = len({f.source for f in self.findings.items if f.status == "not-convertible"
                          and f.detail.endswith("the workload is not written")})
        out = [f"nodes: {self.nodes} ({grouped} in {len(self.groups)} node groups, {self.nodes - grouped} in "
               "none)" if self.nodes else f"nodes: none given ({len(self.groups)} node groups: every config pair)",
               f"workloads: {self.workloads} ({self.workloads - refused_wl} written, {refused_wl} refused)"]
        verdict = {0: "nothing refused, nothing changed meaning",
                   EXIT_CHANGED: "some fields change meaning: read the changed lines",
                   EXIT_REFUSED: "some fields were refused or left out: read the not-convertible lines"}
        return out + [f"result: {verdict[self.exit_code()]} (exit status {self.exit_code()})"]

    def exit_code(self) -> int:
        if self.findings.of("not-convertible"):
            return EXIT_REFUSED
        return EXIT_CHANGED if self.findings.of("changed") else 0


@dataclass
class _Sorted:
    dps: list[DevicePluginConfig] = field(default_factory=list)
    migs: list[MigConfig] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    objects: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def _is_dp(doc: dict[str, Any]) -> bool:
    return "kind" not in doc and "version" in doc and bool(_DP_KEYS & doc.keys())


def _config_name(where: str) -> str:
    stem = PurePath(where).name
    for ext in (".yaml", ".yml", ".json"):
        if stem.endswith(ext):
            stem = stem[: -len(ext)]
    return stem or "default"


def _sort(where: str, doc: Any, into: _Sorted, f: Findings, name: str | None = None) -> None:
    if doc is None:
        return
    if not isinstance(doc, dict):
        raise ConvertError(f"{where}: a document must be a mapping, got {type(doc).__name__}")
    if "mig-configs" in doc:
        into.migs += parse_mig_parted_config(f"mig-parted config ({where})", doc, f)
    elif _is_dp(doc):
        cfg_name = name or _config_name(where)
        into.dps.append(parse_device_plugin_config(cfg_name, f"device plugin config {cfg_name} ({where})", doc, f))
    elif doc.get("kind") == "ConfigMap" and _holds_configs(doc):
        cm = f"ConfigMap {(doc.get('metadata') or {}).get('name')} ({where})"
        for key, text in (doc.get("data") or {}).items():
            f.converted(cm, f"data.{key}", "read as a config")
            _sort(f"{where}: data.{key}", yaml.safe_load(str(text)), into, f, name=_config_name(str(key)))
    elif doc.get("kind") in ("Node", "NodeList"):
        into.nodes += doc.get("items") or [] if doc["kind"] == "NodeList" else [doc]
    elif doc.get("kind") == "List" and any(isinstance(i, dict) and i.get("kind") == "Node" for i in doc.get("items") or []):
        into.nodes += [i for i in doc["items"] if i.get("kind") == "Node"]
        rest = [i for i in doc["items"] if i.get("kind") != "Node"]
        into.objects += [(where, i) for i in rest]
    elif "kind" in doc and "apiVersion" in doc:
        into.objects.append((where, doc))
    else:
        raise ConvertError(f"{where}: neither a device plugin config (version, flags/sharing), a mig-parted config "
                           "(mig-configs) nor a Kubernetes object (apiVersion, kind)")


def _holds_configs(cm: dict[str, Any]) -> bool:
    """A ConfigMap whose every data value is a device plugin or mig-parted config."""
    data = cm.get("data") or {}
    if not data:
        return False
    for text in data.values():
        try:
            doc = yaml.safe_load(str(text))
        except yaml.YAMLError:
            return False
        if not isinstance(doc, dict) or not ("mig-configs" in doc or _is_dp(doc)):
            return False
    return True


def convert(documents: list[tuple[str, Any]], opts: Options) -> Result:
    """``documents``: (where it came from, parsed YAML document). ConvertError for input that cannot be read."""
    res = Result()
    f = res.findings
    into = _Sorted()
    for where, doc in documents:
        _sort(where, doc, into, f)
    names = [c.name for c in into.dps]
    if len(set(names)) != len(names):
        raise ConvertError(f"device plugin configs with the same name: {', '.join(sorted(names))} (name a file "
                           "after the config, or give them as keys of one ConfigMap)")
    mig_names = [c.name for c in into.migs]
    if len(set(mig_names)) != len(mig_names):
        raise ConvertError(f"mig-parted configs with the same name: {', '.join(sorted(mig_names))}")
    res.nodes = len(into.nodes)
    res.workloads = len(into.objects)
    if into.dps or into.migs:
        res.groups = build_groups(into.dps, into.migs, into.nodes, opts.default_config, opts.dynamic_mig, f,
                                  opts.mig_capacity)
        used = {g.mig.name for g in res.groups if g.mig is not None}
        unused = [m for m in into.migs if into.nodes and m.name not in used and not opts.all_configs]
        _unused(unused, f)
        for m in into.migs:
            if m in unused:
                continue
            layouts: dict[tuple[str, int | None], list[str]] = {}
            for g in res.groups:
                if g.mig is m:
                    for k, names in g.layouts.items():
                        layouts.setdefault(k, []).extend(names)
            res.mig_states.append(state(m, opts.dynamic_mig, layouts))
    res.objects = convert_objects(into.objects, WorkloadOptions(opts.driver, res.groups, opts.extended_resource), f)
    return res


def _unused(configs: list[MigConfig], f: Findings) -> None:
    """Configs no given Node names: one line per input instead of one per field (the GPU operator's default
    ConfigMap holds dozens)."""
    def of(x: Any, cfg: MigConfig) -> bool:
        prefix = f"mig-configs.{cfg.name}"
        return bool(x.source == cfg.source and (x.field == prefix or x.field.startswith((prefix + "[", prefix + "."))))
    f.drop(lambda x: not any(of(x, c) for c in configs))
    for source in dict.fromkeys(c.source for c in configs):
        names = [c.name for c in configs if c.source == source]
        f.kept(source, "mig-configs", f"{len(names)} configs no given Node uses, not written (--all-configs "
                                      f"writes them): {', '.join(names)}")


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data: object) -> bool:
        return True


def dump(docs: list[Any]) -> str:
    return yaml.dump_all(docs, Dumper=_NoAliases, sort_keys=False, explicit_start=True, width=10_000)


def output_files(res: Result, opts: Options) -> dict[str, str]:
    """File name -> content: chart values per node group, MIG state per mig-parted config, the workloads, the
    report."""
    files: dict[str, str] = {}
    for g in res.groups:
        values = dict(g.values)
        if opts.extended_resource:
            values["compatNvidia"] = True
        head = f"# Chart values of node group {g.name}"
        head += f" (nodes: {', '.join(g.nodes)})" if g.nodes else ""
        head += (f"\n# helm install {values.get('fullnameOverride', 'gpu-dra')} deploy/helm/gpu-dra-driver "
                 f"-n gpu-dra -f values-{g.name}.yaml\n")
        files[f"values-{g.name}.yaml"] = head + dump([values])
    for s in res.mig_states:
        files[f"mig-{s['migConfig']}.yaml"] = (f"# MIG state of mig-parted config {s['migConfig']}: what the GPUs "
                                               "need before the plugin starts, and the nvidia-smi commands\n"
                                               + dump([s]))
    if res.objects:
        files["workloads.yaml"] = "# Workloads with ResourceClaimTemplates\n" + dump(res.objects)
    files["report.txt"] = res.findings.text(res.summary()) + "\n"
    return files
