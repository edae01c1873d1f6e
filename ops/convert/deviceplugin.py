"""NVIDIA device plugin config files (``version: v1``) -> what each config gives its GPUs here.

``sharing.timeSlicing`` / ``sharing.mps`` with ``replicas: N`` for ``nvidia.com/gpu`` become N slots per GPU with
that strategy, and no whole GPU (the device plugin advertised only the replicas). MPS wins when both have a
shared resource, as in the device plugin. A config file holds one config; the device plugin's chart and the GPU
operator keep several in a ConfigMap, one per key, chosen per node by the ``nvidia.com/device-plugin.config`` label.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dra.model.policy import MAX_SLOTS
from ops.convert.findings import Findings

SHARED_SUFFIX = ".shared"
GPU_RESOURCE = "nvidia.com/gpu"

# flags.* without a setting here, and why (the rest of flags is handled below).
_FLAG_REASONS = {
    "failOnInitError": "no such setting: the kubelet plugin does not start without NVML and says why",
    "nvidiaDevRoot": "kubelet-plugin --dev-root (not a chart value): the chart mounts the host's /dev",
    "mpsRoot": "MPS pipe and shm directories are the plugin's own, under its state directory (docs/mps.md)",
    "gdrcopyEnabled": "GDRCopy devices are not injected by this driver",
    "gdsEnabled": "GPUDirect Storage devices are not injected by this driver",
    "mofedEnabled": "MOFED devices are not injected by this driver",
    "useNodeFeatureAPI": "GFD labels are replaced by device attributes in ResourceSlices",
    "deviceDiscoveryStrategy": "GPUs are found through NVML",
    "gfd": "GFD labels are replaced by device attributes in ResourceSlices",
    "plugin.passDeviceSpecs": "devices reach containers through the CDI specs the plugin writes",
    "plugin.deviceListStrategy": "devices reach containers through the CDI specs the plugin writes",
    "plugin.deviceIDStrategy": "devices reach containers through the CDI specs the plugin writes",
    "plugin.cdiAnnotationPrefix": "devices reach containers through the CDI specs the plugin writes",
    "plugin.nvidiaCTKPath": "the CDI specs run nvidia-cdi-hook: chart value cdiHookPath (not nvidia-ctk)",
    "plugin.containerDriverRoot": "the chart mounts driverRoot at /driver-root in the plugin",
    "plugin.sharedDevicesAllocationPolicy": "the scheduler takes the first device that fits, in device order "
                                           "(docs/devices.md)",
}


@dataclass(frozen=True)
class Meaning:
    """What a device plugin resource name gave a container: a whole GPU, a shared slot or a MIG device."""

    kind: str                      # "gpu" | "slot" | "mig"
    strategy: str | None = None    # slots: "time-slicing" | "mps"
    profile: str | None = None     # mig

    def text(self) -> str:
        if self.kind == "slot":
            return f"a {self.strategy} slot"
        if self.kind == "mig":
            return f"a MIG device {self.profile}" if self.profile else "a MIG device"
        return "a whole GPU"


@dataclass
class DevicePluginConfig:
    name: str
    source: str
    gpu_policy: dict[str, Any] = field(default_factory=lambda: {"wholeGpu": True})
    mig_strategy: str = "none"
    # resource name -> what one unit of it is on nodes with this config
    resources: dict[str, Meaning] = field(default_factory=dict)
    fail_requests_greater_than_one: bool = False
    driver_root: str | None = None


class ConvertError(ValueError):
    """An input that cannot be read at all; the message names the document and the field."""


def _flags(cfg: DevicePluginConfig, flags: Any, f: Findings) -> None:
    src = cfg.source
    if not isinstance(flags, dict):
        raise ConvertError(f"{src}: flags must be a mapping")
    strategy = flags.get("migStrategy", "none")
    if "migStrategy" in flags:
        if strategy not in ("none", "single", "mixed"):
            raise ConvertError(f"{src}: flags.migStrategy must be none, single or mixed, got {strategy!r}")
        f.converted(src, "flags.migStrategy", {
            "none": "MIG devices were not advertised: GPUs with MIG on publish their partitions here only where "
                    "the MIG config says so",
            "single": "nvidia.com/gpu was a MIG device: such requests become claims for the node group's profile",
            "mixed": "nvidia.com/mig-<profile> requests become claims on class mig.<driver> for that profile"}[strategy])
    cfg.mig_strategy = strategy
    if "nvidiaDriverRoot" in flags:
        cfg.driver_root = str(flags["nvidiaDriverRoot"])
        f.converted(src, "flags.nvidiaDriverRoot", f"chart value driverRoot: {cfg.driver_root}")
    for key, reason in _FLAG_REASONS.items():
        head, _, sub = key.partition(".")
        if head in flags and (not sub or isinstance(flags[head], dict) and sub in flags[head]):
            f.refused(src, f"flags.{key}", reason)


def _sharing(cfg: DevicePluginConfig, sharing: Any, f: Findings) -> None:
    src = cfg.source
    if not isinstance(sharing, dict):
        raise ConvertError(f"{src}: sharing must be a mapping")
    blocks = {k: v for k, v in sharing.items() if k in ("timeSlicing", "mps")}
    for key, block in blocks.items():   # the device plugin refuses the whole file for one of these
        if not isinstance(block, dict) or not isinstance(block.get("resources") or [], list):
            raise ConvertError(f"{src}: sharing.{key} must be a mapping with a list of resources")
        for i, res in enumerate(block.get("resources") or []):
            if isinstance(res, dict) and "replicas" not in res:
                raise ConvertError(f"{src}: sharing.{key}.resources[{i}] has no replicas (its fields: "
                                   f"{', '.join(map(str, res)) or 'none'}; the device plugin requires replicas)")
            replicas = res.get("replicas") if isinstance(res, dict) else None
            if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 2:
                raise ConvertError(f"{src}: sharing.{key}.resources[{i}].replicas must be an integer of at least 2 "
                                   f"(as the device plugin requires), got {replicas!r}")
    active = next((k for k in ("mps", "timeSlicing") if _has_replicas(blocks.get(k))), None)
    for key, block in blocks.items():
        path = f"sharing.{key}"
        if key != active:
            f.refused(src, path, "not in effect: the device plugin uses MPS when both have shared resources"
                      if active else "no resource with replicas > 1: nothing is shared")
            continue
        strategy = "mps" if key == "mps" else "time-slicing"
        rename = block.get("renameByDefault", False)
        if "renameByDefault" in block:
            f.converted(src, f"{path}.renameByDefault",
                        f"requests for {GPU_RESOURCE}{SHARED_SUFFIX if rename else ''} become {strategy} slot claims")
        fail = block.get("failRequestsGreaterThanOne")
        if fail is not None:
            cfg.fail_requests_greater_than_one = bool(fail)
            f.converted(src, f"{path}.failRequestsGreaterThanOne",
                        "workloads asking for more than one slot are reported (the device plugin refused them)"
                        if fail else "a request for N replicas becomes a request for N slots")
        for i, res in enumerate(block.get("resources") or []):
            _resource(cfg, res, f"{path}.resources[{i}]", strategy, bool(rename), f)
        if strategy == "mps":
            f.changed(src, path, "the device plugin's MPS daemon served pods of every namespace; here each GPU's "
                                 "MPS daemon serves one namespace at a time (a claim from another namespace waits "
                                 "until the GPU's claims are gone). To keep sharing across namespaces, set chart "
                                 "value nodePolicy.mps.shareAcrossNamespaces: true (docs/security.md)")


def _has_replicas(block: Any) -> bool:
    return isinstance(block, dict) and any(isinstance(r, dict) and isinstance(r.get("replicas"), int)
                                           and r["replicas"] > 1 for r in block.get("resources") or [])


def _resource(cfg: DevicePluginConfig, res: Any, path: str, strategy: str, rename: bool, f: Findings) -> None:
    src = cfg.source
    if not isinstance(res, dict):
        raise ConvertError(f"{src}: {path} must be a mapping")
    name, replicas = res.get("name"), res["replicas"]
    if name != GPU_RESOURCE:
        f.refused(src, path, f"{name}: only whole GPUs ({GPU_RESOURCE}) have slots here; share a MIG device by "
                             "letting several pods use one ResourceClaim")
        return
    if replicas > MAX_SLOTS:
        f.refused(src, f"{path}.replicas", f"{replicas} replicas: at most {MAX_SLOTS} slots per GPU")
        return
    cfg.gpu_policy = {"wholeGpu": False, "slots": {"count": replicas, "strategy": strategy}}
    cfg.resources[GPU_RESOURCE + (SHARED_SUFFIX if rename else "")] = Meaning("slot", strategy)
    if rename:   # the device plugin advertised only the renamed resource: nvidia.com/gpu had no capacity
        cfg.resources.pop(GPU_RESOURCE, None)
    f.converted(src, f"{path}.name", f"{name}: slots on every GPU of the node group")
    f.converted(src, f"{path}.replicas", f"node policy slots: {{count: {replicas}, strategy: {strategy}}}, "
                                         "wholeGpu: false")
    devices = res.get("devices", "all")
    if "devices" in res:
        if devices == "all":
            f.converted(src, f"{path}.devices", "all: the node policy's default")
        else:
            f.refused(src, f"{path}.devices", f"{devices!r}: the device plugin shares all GPUs whatever this says; "
                                              "select GPUs with node policy rules (match: index, uuid, model)")
    if "rename" in res:
        f.refused(src, f"{path}.rename", "ignored by the device plugin too; DRA has no resource names: claims "
                                         "name a DeviceClass")


def parse_device_plugin_config(name: str, source: str, doc: dict[str, Any], f: Findings) -> DevicePluginConfig:
    cfg = DevicePluginConfig(name=name, source=source)
    version = doc.get("version")
    if version != "v1":
        raise ConvertError(f"{source}: version must be v1, got {version!r}")
    f.converted(source, "version", "v1")
    cfg.resources[GPU_RESOURCE] = Meaning("gpu")
    if "flags" in doc:
        _flags(cfg, doc["flags"], f)
    if "sharing" in doc:
        _sharing(cfg, doc["sharing"], f)
    if cfg.mig_strategy == "single" and GPU_RESOURCE in cfg.resources and cfg.resources[GPU_RESOURCE].kind == "gpu":
        cfg.resources[GPU_RESOURCE] = Meaning("mig")
    if "resources" in doc:
        f.refused(source, "resources", "DRA has no resource names: claims name a DeviceClass (gpu, mig, slot)")
    if "imex" in doc:
        f.refused(source, "imex", "IMEX channels are not published by this driver")
    f.cover_rest(source, doc)
    return cfg
