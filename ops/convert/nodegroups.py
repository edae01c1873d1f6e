"""Node groups: the nodes that share a device plugin config and a MIG config, each with one node policy and the
chart values that deploy the kubelet plugin there with it.

The device plugin config of a node is named by its ``nvidia.com/device-plugin.config`` label (the default config
where the label is missing), its mig-parted config by ``nvidia.com/mig.config``. Given Node objects, the groups are
the pairs that occur; without them, every pair. The chart takes one node policy, so each group is one release of
the chart whose plugin runs on that group's nodes; the first release also runs the controller, the webhook and
the DeviceClasses.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import product
from typing import Any

from api.k8snames import is_dns_label
from dra.model.catalog import CATALOG, GpuModel
from dra.model.policy import PolicyError, parse_node_policy
from ops.convert.deviceplugin import ConvertError, DevicePluginConfig, Meaning
from ops.convert.findings import Findings
from ops.convert.migparted import MigConfig, check, gpu_policy

DP_LABEL = "nvidia.com/device-plugin.config"
MIG_LABEL = "nvidia.com/mig.config"
PRODUCT_LABEL = "nvidia.com/gpu.product"
COUNT_LABEL = "nvidia.com/gpu.count"


def node_model(labels: dict[str, Any]) -> GpuModel | None:
    """The catalog model of GFD's product label (the product name with '-' for ' ', and GFD's ``-SHARED`` or
    ``-MIG-<profile>`` suffix where sharing or the single MIG strategy is on)."""
    product = str(labels.get(PRODUCT_LABEL) or "")
    product = re.sub(r"-MIG-.*$", "", product.removesuffix("-SHARED"))
    return next((m for m in CATALOG.values() if m.product_name.replace(" ", "-") == product), None) if product \
        else None


def _gpu_count(labels: dict[str, Any]) -> int | None:
    try:
        count = int(str(labels.get(COUNT_LABEL)))
    except ValueError:
        return None
    return count if count > 0 else None


def _mig_problem(cfg: MigConfig, model: GpuModel, count: int | None) -> str | None:
    """Why the node's GPUs cannot take the MIG config (catalog geometry), or None."""
    entries = cfg.entries_for(model.name)
    if not entries:
        return (f"no entry of {cfg.name} is for {model.name} (its device-filters name other GPUs): the config "
                "does not describe this node")
    for e in entries:
        why = check(e, model)
        if why:
            return why
        if count is not None and isinstance(e.devices, tuple) and max(e.devices) >= count:
            return f"the entry for GPUs {', '.join(map(str, e.devices))} names a GPU the node does not have " \
                   f"({count} GPUs)"
    return None


@dataclass
class NodeGroup:
    name: str
    dp: DevicePluginConfig | None
    mig: MigConfig | None
    node_policy: dict[str, Any]
    values: dict[str, Any]
    nodes: list[str] = field(default_factory=list)
    # (catalog model, GPU count or None) -> the group's nodes with those GPUs (from GFD's labels)
    layouts: dict[tuple[str, int | None], list[str]] = field(default_factory=dict)

    def meaning(self, resource: str) -> Meaning | None:
        """What one unit of an extended resource gave a container on these nodes."""
        if self.dp is None:
            return Meaning("gpu") if resource == "nvidia.com/gpu" else None
        m = self.dp.resources.get(resource)
        if m is not None and m.kind == "mig" and self.mig is not None and len(self.mig.profiles()) == 1:
            return Meaning("mig", profile=next(iter(self.mig.profiles())))
        return m


def _group_name(dp: DevicePluginConfig | None, mig: MigConfig | None) -> str:
    parts = [c.name for c in (dp, mig) if c is not None] or ["default"]
    name = "-".join(parts).lower().replace(".", "-").replace("_", "-")
    return name if is_dns_label(name) else "group"


def node_policy(dp: DevicePluginConfig | None, mig: MigConfig | None, dynamic: bool,
                mig_capacity: bool = False) -> dict[str, Any]:
    default: dict[str, Any] = dict(dp.gpu_policy) if dp else {"wholeGpu": True}
    shared = dict(default)
    rules: list[dict[str, Any]] = []
    for entry in (mig.entries if mig else []):
        policy = gpu_policy(entry, dynamic, mig_capacity) if entry.enabled else shared
        matches = entry.matches()
        if not matches:
            default = dict(policy)
        rules += [{"match": m, **policy} for m in matches]
    # A rule that repeats the default matters only where an earlier rule matches the same GPUs.
    rules = [r for i, r in enumerate(rules)
             if {k: v for k, v in r.items() if k != "match"} != default
             or any(_overlap(r["match"], q["match"]) for q in rules[:i])]
    out: dict[str, Any] = {"default": default}
    if rules:
        out["rules"] = rules
    return out


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a[k] == b[k] for k in a.keys() & b.keys())


def _selector(dp: DevicePluginConfig | None, mig: MigConfig | None, default_dp: str | None,
              dps: list[DevicePluginConfig], migs: list[MigConfig]) -> list[dict[str, Any]]:
    exprs: list[dict[str, Any]] = []
    if dp is not None and len(dps) > 1:
        if dp.name == default_dp:   # the default config also serves nodes without the label
            exprs.append({"key": DP_LABEL, "operator": "NotIn", "values": sorted(c.name for c in dps if c is not dp)})
        else:
            exprs.append({"key": DP_LABEL, "operator": "In", "values": [dp.name]})
    if mig is not None:
        exprs.append({"key": MIG_LABEL, "operator": "In", "values": [mig.name]})
    elif migs:
        exprs.append({"key": MIG_LABEL, "operator": "DoesNotExist"})
    return exprs


def build_groups(dps: list[DevicePluginConfig], migs: list[MigConfig], nodes: list[dict[str, Any]],
                 default_dp: str | None, dynamic: bool, f: Findings, mig_capacity: bool = False) -> list[NodeGroup]:
    if default_dp is None and len(dps) == 1:
        default_dp = dps[0].name
    if default_dp is not None and dps and default_dp not in {c.name for c in dps}:
        raise ConvertError(f"--default-config {default_dp}: no device plugin config of that name "
                           f"(have {', '.join(c.name for c in dps)})")
    by_dp = {c.name: c for c in dps}
    by_mig = {c.name: c for c in migs}
    pairs: dict[tuple[str | None, str | None], list[str]] = {}
    layouts: dict[tuple[str | None, str | None], dict[tuple[str, int | None], list[str]]] = {}
    if nodes:
        for node in nodes:
            meta = node.get("metadata") or {}
            labels = meta.get("labels") or {}
            name = str(meta.get("name"))
            src = f"Node {name}"
            dp_name = labels.get(DP_LABEL, default_dp) if dps else None
            mig_name = labels.get(MIG_LABEL)
            if dp_name is not None and dp_name not in by_dp:
                f.refused(src, f"metadata.labels.{DP_LABEL}", f"{dp_name}: no device plugin config of that name "
                                                              "was given; the node is in no group")
                continue
            if mig_name is not None and mig_name not in by_mig:
                f.refused(src, f"metadata.labels.{MIG_LABEL}", f"{mig_name}: no mig-parted config of that name "
                                                               "was given (the GPU operator's is the ConfigMap "
                                                               "default-mig-parted-config); the node is in no group")
                continue
            model, count = node_model(labels), _gpu_count(labels)
            if mig_name is not None:
                mig_cfg = by_mig[mig_name]
                if model is None:
                    f.refused(src, f"metadata.labels.{PRODUCT_LABEL}",
                              f"{labels.get(PRODUCT_LABEL) or 'missing'}: not a GPU of the catalog, so MIG config "
                              f"{mig_name} is not checked against it; compare the layout before switching "
                              "(docs/migration.md)")
                else:
                    why = _mig_problem(mig_cfg, model, count)
                    if why:
                        f.refused(src, f"metadata.labels.{MIG_LABEL}", f"MIG config {mig_name} on {model.name}: "
                                                                       f"{why}; the node is in no group")
                        continue
                    layouts.setdefault((dp_name, mig_name), {}).setdefault((model.name, count), []).append(name)
            pairs.setdefault((dp_name, mig_name), []).append(name)
            f.converted(src, "metadata.labels", f"node group {_group_name(by_dp.get(dp_name or ''), by_mig.get(mig_name or ''))}")
    else:
        dp_names: list[str | None] = [c.name for c in dps] or [None]
        mig_names: list[str | None] = [c.name for c in migs] or [None]
        for d, m in product(dp_names, mig_names):
            pairs[(d, m)] = []
    groups: list[NodeGroup] = []
    for (dp_name, mig_name), members in pairs.items():
        dp = by_dp.get(dp_name) if dp_name else None
        mig = by_mig.get(mig_name) if mig_name else None
        name = _group_name(dp, mig)
        policy = node_policy(dp, mig, dynamic, mig_capacity)
        try:
            parse_node_policy(policy, source=f"node group {name}")
        except PolicyError as exc:
            raise ConvertError(str(exc)) from None
        values: dict[str, Any] = {"nodePolicy": policy}
        if dp is not None and dp.driver_root:
            values["driverRoot"] = dp.driver_root
        exprs = _selector(dp, mig, default_dp, dps, migs)
        if exprs:
            values["kubeletPlugin"] = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": exprs}]}}}}
        groups.append(NodeGroup(name, dp, mig, policy, values, members, layouts.get((dp_name, mig_name), {})))
    if len(groups) > 1:
        for i, g in enumerate(groups):
            g.values = {"fullnameOverride": f"gpu-dra-{g.name}", **g.values}
            if i:   # one controller, webhook and set of DeviceClasses for the cluster: the first release's
                g.values |= {"controller": {"enabled": False}, "webhook": {"enabled": False},
                             "deviceClasses": {"create": False}}
    return groups
