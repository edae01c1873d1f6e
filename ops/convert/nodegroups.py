"""Node groups: the nodes that share a device plugin config and a MIG config, each with one node policy and the
chart values that deploy the kubelet plugin there with it.

The device plugin config of a node is named by its ``nvidia.com/device-plugin.config`` label (the default config
where the label is missing), its mig-parted config by ``nvidia.com/mig.config``. Given Node objects, the groups are
the pairs that occur; without them, every pair. The chart takes one node policy, so each group is one release of
the chart whose plugin runs on that group's nodes; the first release also runs the controller, the webhook and
the DeviceClasses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Any

from api.k8snames import is_dns_label
from dra.model.policy import PolicyError, parse_node_policy
from ops.convert.deviceplugin import ConvertError, DevicePluginConfig, Meaning
from ops.convert.findings import Findings
from ops.convert.migparted import MigConfig, gpu_policy

DP_LABEL = "nvidia.com/device-plugin.config"
MIG_LABEL = "nvidia.com/mig.config"


@dataclass
class NodeGroup:
    name: str
    dp: DevicePluginConfig | None
    mig: MigConfig | None
    node_policy: dict[str, Any]
    values: dict[str, Any]
    nodes: list[str] = field(default_factory=list)

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


def node_policy(dp: DevicePluginConfig | None, mig: MigConfig | None, dynamic: bool) -> dict[str, Any]:
    default: dict[str, Any] = dict(dp.gpu_policy) if dp else {"wholeGpu": True}
    shared = dict(default)
    rules: list[dict[str, Any]] = []
    for entry in (mig.entries if mig else []):
        policy = gpu_policy(entry, dynamic) if entry.enabled else shared
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
                 default_dp: str | None, dynamic: bool, f: Findings) -> list[NodeGroup]:
    if default_dp is None and len(dps) == 1:
        default_dp = dps[0].name
    if default_dp is not None and dps and default_dp not in {c.name for c in dps}:
        raise ConvertError(f"--default-config {default_dp}: no device plugin config of that name "
                           f"(have {', '.join(c.name for c in dps)})")
    by_dp = {c.name: c for c in dps}
    by_mig = {c.name: c for c in migs}
    pairs: dict[tuple[str | None, str | None], list[str]] = {}
    if nodes:
        for node in nodes:
            meta = node.get("metadata") or {}
            labels = meta.get("labels") or {}
            name = str(meta.get("name"))
            src = f"Node {name}"
            dp_name = labels.get(DP_LABEL, default_dp) if dps else None
            mig_name = labels.get(MIG_LABEL) if migs else None
            if dp_name is not None and dp_name not in by_dp:
                f.refused(src, f"metadata.labels.{DP_LABEL}", f"{dp_name}: no device plugin config of that name "
                                                              "was given; the node is in no group")
                continue
            if mig_name is not None and mig_name not in by_mig:
                f.refused(src, f"metadata.labels.{MIG_LABEL}", f"{mig_name}: no mig-parted config of that name "
                                                               "was given; the node is in no group")
                continue
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
        policy = node_policy(dp, mig, dynamic)
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
        groups.append(NodeGroup(name, dp, mig, policy, values, members))
    if len(groups) > 1:
        for i, g in enumerate(groups):
            g.values = {"fullnameOverride": f"gpu-dra-{g.name}", **g.values}
            if i:   # one controller, webhook and set of DeviceClasses for the cluster: the first release's
                g.values |= {"controller": {"enabled": False}, "webhook": {"enabled": False},
                             "deviceClasses": {"create": False}}
    return groups
