"""Device model: from what discovery found (NodeInventory) and the node policy to DRA devices and counters.

Device kinds (attribute ``type``):

* ``gpu``    the whole GPU, ``gpu-<minor>``.
* ``mig``    a MIG partition, ``gpu-<minor>-mig-<profile slug>-<GI profile id>-<start>``. *Static* partitions
             exist now (their MIG uuid is published); *dynamic* ones are every profile at every valid placement
             and are created when a claim is prepared. With ``dynamicMig.layout: capacity`` (one profile) instead
             one device ``gpu-<minor>-mig-<profile slug>-<GI profile id>`` with consumable capacity ``instances: N``
             (``allowMultipleAllocations``): each claim takes a share of 1 or more instances, and the node plugin
             creates them at free placements when the share is prepared.
* ``slot``   one of N shared slots of a GPU, ``gpu-<minor>-slot-<k>`` (``sharing`` = time-slicing or mps); with
             the policy's ``slots.layout: capacity`` instead one device ``gpu-<minor>-slots`` with consumable
             capacity ``slots: N`` (``allowMultipleAllocations``): each claim takes a share of 1 or more slots.
* ``shared`` a consumable-capacity device, ``gpu-<minor>-shared``: many claims share it, each asking for an
             amount of ``memory`` (``allowMultipleAllocations``).

Names depend only on the minor number, MIG profile and placement, and slot index, so they are stable across
restarts (and across index shifts when a GPU falls off the bus).

Mutual exclusion is expressed with counters (partitionable devices). A GPU gets one CounterSet,
``gpu-<minor>-counters``, when it publishes devices that exclude each other. With S = slot count (1 without
slots) and M = MIG memory slices (1 for a GPU without dynamic MIG), it holds ``memory-slice-0..M-1`` with
value S each, and for dynamic MIG the engine budgets of the placement model (dra/model/mig.py): ``compute-slices``,
``ofa-engines`` (this is what allows only one ``+me`` partition) and ``instances-<id>`` where a profile's
instance limit is not already implied by the geometry.

* the whole GPU consumes S of every memory slice: it excludes every partition and every slot;
* a MIG partition consumes S of each memory slice it covers, plus its compute slices and OFA engines:
  overlapping partitions exclude each other, and any slot excludes it;
* a slot consumes 1 of every memory slice: up to S slots coexist, and any slot excludes the whole GPU and
  every partition.

With ``slots.layout: capacity`` S is 1 in the counters: the one slots device consumes 1 of every memory slice,
and the scheduler charges a multi-allocatable device's counters once, when its first share is allocated
(later shares skip the counter check; k8s.io/dynamic-resource-allocation structured/internal/incubating,
``skipCounterCheck``), while its ``slots`` capacity bounds the shares. So while any share is out the whole GPU
and every partition are excluded, and the device is free of counters again when its last share is gone.

With ``dynamicMig.layout: capacity`` the GPU publishes one profile as one partition device, and no device per
placement. It consumes S of every memory slice (it stands for any of the profile's placements, so it excludes
the whole GPU and every slot while a share is out), and no engine or instance counters: nothing else on the
GPU competes for them. Its ``instances`` capacity, N = the most instances of the profile that fit together,
bounds the shares. That is exact because a profile's placements never overlap each other (checked for every
profile of the catalog; a profile whose placements do overlap is refused for this layout), so any k ≤ N
instances fit at whatever placements are free: the counts (instances, compute slices, OFA engines) are all
that limits them.

Device order is the driver's only lever on placement (the scheduler takes the first device that fits), so it
is deliberate. GPUs in ascending minor; per GPU: the whole GPU, then MIG partitions, then slots, then the
shared device. Partitions are ordered by size (memory slices, compute slices, then engines, so plain profiles
come before their ``+me`` twin), and within a profile by start from the *highest* placement down. NVIDIA's
large profiles all anchor at the low end (4g only at 0, 3g at 0 or 4, 7g at 0); filling small partitions from
the top keeps the low contiguous slices free for them. Nobody knows how many partitions of a profile will be
asked for, so the order keeps the largest profile placeable for as long as possible: the sequence "largest
profile still placeable after the 1st, 2nd, ... first-fit allocation" is the lexicographic maximum over all
orders of the profile's starts (tested exhaustively on both geometries). No order is best for every count at
once: three 1g at slices 4-6 keep a 4g placeable, whereas four 1g keep a 3g only if they sit at 0-3.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from api.names import DEFAULT_DRIVER_NAME
from api.quantity import MIB, format_bytes, format_mib
from dra.model.catalog import CATALOG, family_of, model_for_product_name
from dra.model.gpu import GpuInfo, MigInstance, MigProfile, NodeInventory, mig_mode_switches_at_runtime
from dra.model.mig import budget_of, can_place, interval, max_instances_alone, memory_slice_count
from dra.model.policy import GpuPolicy, NodePolicy

DEFAULT_DRIVER = DEFAULT_DRIVER_NAME
STANDARD_DOMAIN = "resource.kubernetes.io"
MAX_STRING = 64
MAX_TAINTS = 16

KIND_GPU = "gpu"
KIND_MIG = "mig"
KIND_SLOT = "slot"
KIND_SHARED = "shared"


def _copy_json(value: Any) -> Any:
    """A deep copy of JSON-shaped data (dicts, lists, tuples, scalars): what copy.deepcopy gives for it at a
    fraction of the cost (no memo of visited objects), which matters at 240 devices a node."""
    if isinstance(value, dict):
        return {k: _copy_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_json(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy_json(v) for v in value)
    return value


class DeviceModelError(ValueError):
    """A node policy that cannot be applied to a GPU (the message names the GPU and the policy field)."""


# --------------------------------------------------------------------------------------------------- names

def gpu_device_name(minor: int) -> str:
    return f"gpu-{minor}"


def profile_slug(profile_name: str) -> str:
    """"1g.10gb+me" -> "1g10gbme": a DNS-label-safe form of a MIG profile name."""
    return re.sub(r"[^a-z0-9-]", "", profile_name.lower()).strip("-")


def mig_device_name(minor: int, profile_name: str, profile_id: int, start: int) -> str:
    return f"gpu-{minor}-mig-{profile_slug(profile_name)}-{profile_id}-{start}"


def slot_device_name(minor: int, slot: int) -> str:
    return f"gpu-{minor}-slot-{slot}"


def shared_device_name(minor: int) -> str:
    return f"gpu-{minor}-shared"


def slots_device_name(minor: int) -> str:
    return f"gpu-{minor}-slots"


def mig_instances_device_name(minor: int, profile_name: str, profile_id: int) -> str:
    return f"gpu-{minor}-mig-{profile_slug(profile_name)}-{profile_id}"


def counter_set_name(minor: int) -> str:
    return f"gpu-{minor}-counters"


@dataclass(frozen=True)
class DeviceName:
    """A device name taken apart (what the node plugin needs to find the hardware again)."""

    kind: str
    minor: int
    profile_slug: str | None = None
    profile_id: int | None = None
    start: int | None = None
    slot: int | None = None


_NAME_PATTERNS = (
    (re.compile(r"^gpu-(\d+)$"), KIND_GPU),
    (re.compile(r"^gpu-(\d+)-mig-([a-z0-9-]+)-(\d+)-(\d+)$"), KIND_MIG),
    (re.compile(r"^gpu-(\d+)-mig-([a-z0-9]+)-(\d+)$"), KIND_MIG),         # one profile as capacity: no start
    (re.compile(r"^gpu-(\d+)-slot-(\d+)$"), KIND_SLOT),
    (re.compile(r"^gpu-(\d+)-slots$"), KIND_SLOT),
    (re.compile(r"^gpu-(\d+)-shared$"), KIND_SHARED),
)


def parse_device_name(name: str) -> DeviceName:
    """Inverse of the *_device_name functions. Raises ValueError for names this driver never publishes."""
    for pattern, kind in _NAME_PATTERNS:
        m = pattern.fullmatch(name)
        if not m:
            continue
        minor = int(m.group(1))
        if kind == KIND_MIG:
            start = int(m.group(4)) if m.lastindex == 4 else None
            return DeviceName(kind, minor, profile_slug=m.group(2), profile_id=int(m.group(3)), start=start)
        if kind == KIND_SLOT:
            return DeviceName(kind, minor, slot=int(m.group(2)) if m.lastindex == 2 else None)
        return DeviceName(kind, minor)
    raise ValueError(f"not a device name of this driver: {name!r}")


# --------------------------------------------------------------------------------------------------- records

@dataclass(frozen=True)
class CounterSet:
    """One GPU's shared counters (wire: spec.sharedCounters[])."""

    name: str
    gpu_minor: int
    counters: Mapping[str, int]

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "counters": {k: {"value": str(v)} for k, v in self.counters.items()}}


@dataclass(frozen=True)
class Device:
    """A published device plus what the node plugin needs to prepare it."""

    name: str
    kind: str                                   # gpu | mig | slot | shared
    gpu_uuid: str
    gpu_index: int
    gpu_minor: int
    gpu_pci_bus_id: str
    # MIG partitions
    mig_dynamic: bool = False                   # created at prepare (dynamic) or existing (static)
    mig_profile_id: int | None = None
    mig_profile_name: str | None = None
    mig_start: int | None = None                # None for the one-profile device of the capacity layout
    mig_instances: int | None = None            # capacity layout: instances N that fit together
    mig_starts: tuple[int, ...] = ()            # capacity layout: the profile's placements
    mig_size: int | None = None                 # memory slices
    mig_uuid: str | None = None                 # static only
    mig_gi_id: int | None = None                # static only
    mig_ci_id: int | None = None                # static only
    # slots and shares
    sharing: str = "none"                       # none | time-slicing | mps
    slot_index: int | None = None               # None for the slots device of the capacity layout
    slot_count: int | None = None
    mps_thread_percentage: int | None = None    # default for MPS slots: 100/N (per slot of a share)
    mps_memory_limit_mib: int | None = None     # default for MPS slots: total/N (per slot of a share)
    share_min_bytes: int | None = None          # consumable share device
    share_step_bytes: int | None = None
    # wire format
    attributes: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    capacity: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    consumes_counters: tuple[dict[str, Any], ...] = ()
    taints: tuple[dict[str, Any], ...] = ()
    allow_multiple_allocations: bool = False

    @property
    def needs_partitionable(self) -> bool:
        """Only meaningful with partitionable devices (counters) on the server."""
        return bool(self.consumes_counters) or self.kind == KIND_SLOT or (self.kind == KIND_MIG and self.mig_dynamic)

    @property
    def needs_consumable_capacity(self) -> bool:
        return self.allow_multiple_allocations

    def to_wire(self, *, with_taints: bool = True, with_counters: bool = True) -> dict[str, Any]:
        """The device as the API server expects it (a fresh deep copy: callers may mutate it)."""
        out: dict[str, Any] = {"name": self.name, "attributes": self.attributes}
        if self.capacity:
            out["capacity"] = self.capacity
        if self.allow_multiple_allocations:
            out["allowMultipleAllocations"] = True
        if with_counters and self.consumes_counters:
            out["consumesCounters"] = list(self.consumes_counters)
        if with_taints and self.taints:
            out["taints"] = list(self.taints)
        return _copy_json(out)


@dataclass(frozen=True)
class DeviceModel:
    devices: tuple[Device, ...]
    counter_sets: tuple[CounterSet, ...]
    warnings: tuple[str, ...] = ()

    def by_name(self) -> dict[str, Device]:
        return {d.name: d for d in self.devices}


# --------------------------------------------------------------------------------------------------- attributes

def _s(v: str) -> dict[str, Any]:
    # The API caps strings at 64 characters; product names are far shorter, so this only guards odd input.
    return {"string": v[:MAX_STRING]}


def _i(v: int) -> dict[str, Any]:
    return {"int": int(v)}


def _b(v: bool) -> dict[str, Any]:
    return {"bool": bool(v)}


def semver(text: str) -> str:
    """NVIDIA's "580.95.05" / "13.0" as semver: "580.95.5" / "13.0.0" (no leading zeros, three parts)."""
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]]
    if not parts:
        raise ValueError(f"no version number in {text!r}")
    parts += [0] * (3 - len(parts))
    return ".".join(str(p) for p in parts)


def _v(text: str) -> dict[str, Any]:
    return {"version": semver(text)}


def gpu_family(cc: tuple[int, int]) -> str:
    """GPU Feature Discovery's ``gpu.family`` spelling, from the CUDA compute capability."""
    return family_of(*cc)


def catalog_model_name(gpu: GpuInfo) -> str | None:
    """The catalog's name for this GPU's model (by PCI device id, else product name), for policy rules."""
    for model in CATALOG.values():
        if model.nvml_pci_device_id == gpu.pci_device_id:
            return model.name
    named = model_for_product_name(gpu.product_name)
    return named.name if named else None


def pcie_root(gpu: GpuInfo) -> str | None:
    """``pci<domain>:<bus>`` of the PCIe root. Uses the value discovery found when it has one; otherwise the
    domain and bus of the GPU itself (correct where each GPU sits directly below its own root complex)."""
    if gpu.pcie_root:
        return gpu.pcie_root
    m = re.match(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):", gpu.pci_bus_id)
    if not m:
        return None
    return f"pci{m.group(1)[-4:].lower()}:{m.group(2).lower()}"


def common_attributes(gpu: GpuInfo, inv: NodeInventory) -> dict[str, dict[str, Any]]:
    """Attributes every device of a GPU carries (partitions and slots inherit them from the parent)."""
    cc = gpu.cuda_compute_capability
    attrs: dict[str, dict[str, Any]] = {
        "productName": _s(gpu.product_name),
        "brand": _s(gpu.brand),
        "family": _s(gpu_family(cc)),
        "architecture": _s(gpu.architecture),
        "cudaComputeCapability": {"version": f"{cc[0]}.{cc[1]}.0"},
        "driverVersion": _v(inv.driver_version),
        "cudaDriverVersion": _v(inv.cuda_driver_version),
        "migCapable": _b(gpu.mig_capable),
        f"{STANDARD_DOMAIN}/pciBusID": _s(gpu.pci_bus_id),
    }
    root = pcie_root(gpu)
    if root:
        attrs[f"{STANDARD_DOMAIN}/pcieRoot"] = _s(root)
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        attrs[f"{STANDARD_DOMAIN}/numaNode"] = _i(gpu.numa_node)
    return attrs


def _engine_capacity(copy: int, dec: int, enc: int, jpg: int, ofa: int) -> dict[str, dict[str, Any]]:
    return {
        "copyEngines": {"value": str(copy)},
        "decoders": {"value": str(dec)},
        "encoders": {"value": str(enc)},
        "jpegEngines": {"value": str(jpg)},
        "ofaEngines": {"value": str(ofa)},
    }


# --------------------------------------------------------------------------------------------------- taints

def _label_value(text: str) -> str:
    """A free-text reason as a label value (≤63, alphanumerics and -_. inside), or "" if nothing is left."""
    v = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", v)


def _merge_taints(*groups: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], ...]:
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for group in groups:
        for t in group:
            seen.setdefault((t["key"], t.get("effect", "")), dict(t))
    return tuple(list(seen.values())[:MAX_TAINTS])


# --------------------------------------------------------------------------------------------------- building

def _profile_order_key(p: MigProfile) -> tuple[int, ...]:
    # Smallest first (best fit for "any partition with at least X" requests); a +me twin after its plain
    # profile, so that requests for a plain 1g never use up the GPU's one media-extension partition.
    return (p.memory_slices, p.compute_slices, p.ofa_engines, p.jpeg_engines, p.decoders, p.encoders,
            p.copy_engines, p.profile_id)


def describe_gpu(gpu: GpuInfo) -> str:
    return f"GPU {gpu.index} (minor {gpu.minor}, {gpu.product_name}, {gpu.uuid})"


@dataclass
class _GpuPlan:
    whole: bool = False
    dynamic_profiles: tuple[MigProfile, ...] = ()
    static_instances: tuple[MigInstance, ...] = ()
    slots: int = 0
    slot_strategy: str = "time-slicing"
    slot_capacity: bool = False                 # slots as one consumable-capacity device
    mig_capacity: bool = False                  # the one dynamic profile as one consumable-capacity device
    shares: bool = False

    @property
    def slot_counter(self) -> int:
        """What each memory slice counter holds: one unit per slot device (N, or 1 for the slots device)."""
        return 1 if self.slot_capacity else max(self.slots, 1)


def _chosen_profiles(gpu: GpuInfo, pol: GpuPolicy, origin: str) -> tuple[MigProfile, ...]:
    """The GPU's MIG profiles that dynamic MIG publishes: those ``dynamicMig.profiles`` names, else all.
    A name this GPU does not have is an error (a typo would otherwise publish nothing for that profile)."""
    if pol.dynamic_mig is None:
        return tuple(gpu.mig_profiles)
    have = {p.name: p for p in gpu.mig_profiles}
    unknown = [name for name in pol.dynamic_mig.profiles if name not in have]
    if unknown:
        model = catalog_model_name(gpu) or gpu.product_name
        raise DeviceModelError(
            f"{describe_gpu(gpu)}: node policy {origin} dynamicMig.profiles names {', '.join(map(repr, unknown))}, "
            f"which {model} does not have (its profiles: {', '.join(have)})")
    wanted = set(pol.dynamic_mig.profiles)
    return tuple(p for p in gpu.mig_profiles if p.name in wanted)


def overlapping_placements(profile: MigProfile) -> tuple[int, int] | None:
    """Two starts of ``profile`` whose memory slices overlap, or None: the capacity layout's premise is that
    any free placement of the profile is as good as another, which holds only when none overlap."""
    for i, a in enumerate(profile.starts):
        for b in profile.starts[i + 1:]:
            if set(interval(profile, a)) & set(interval(profile, b)):
                return a, b
    return None


def instances_together(profiles: Sequence[MigProfile], profile: MigProfile) -> int:
    """How many instances of ``profile`` fit on the GPU at once: N of the capacity layout."""
    return min(profile.max_instances, max_instances_alone(profiles, profile.profile_id))


def _check_capacity_profile(gpu: GpuInfo, profile: MigProfile, origin: str) -> None:
    clash = overlapping_placements(profile)
    if clash is not None:
        a, b = clash
        raise DeviceModelError(
            f"{describe_gpu(gpu)}: node policy {origin} dynamicMig.layout: capacity cannot publish {profile.name}: "
            f"its placements at memory slices {a} and {b} overlap, so its instances are not interchangeable "
            "(use layout: placements)")


def _plan(gpu: GpuInfo, pol: GpuPolicy, origin: str, warnings: list[str]) -> _GpuPlan:
    """Decide what to publish for one GPU; raise DeviceModelError for impossible policies."""
    who = describe_gpu(gpu)
    plan = _GpuPlan()
    if pol.memory_shares is not None:
        if gpu.mig_enabled:
            warnings.append(f"{who}: MIG mode is enabled, so memoryShares cannot use the GPU as a whole; nothing published")
            return plan
        plan.shares = True
        return plan
    if pol.mig in ("static", "dynamic") and not gpu.mig_capable:
        raise DeviceModelError(f"{who}: node policy {origin} asks for mig: {pol.mig}, but this GPU does not support MIG")
    # Can the GPU be used as a whole (whole device, slots) while this policy is in force?
    whole_usable = not gpu.mig_enabled or (pol.mig == "dynamic" and mig_mode_switches_at_runtime(gpu.cuda_compute_capability))
    if pol.mig == "static":
        if not gpu.mig_enabled:
            warnings.append(f"{who}: node policy {origin} asks for mig: static, but MIG mode is disabled; nothing published")
            return plan
        if not gpu.mig_instances:
            warnings.append(f"{who}: MIG mode is enabled but no MIG devices exist; its capacity is stranded")
        known = {p.profile_id for p in gpu.mig_profiles}
        kept = []
        for inst in gpu.mig_instances:
            if inst.profile_id in known:
                kept.append(inst)
            else:
                warnings.append(f"{who}: MIG device {inst.uuid} has GPU-instance profile {inst.profile_id}, "
                                "which NVML did not list; not published")
        plan.static_instances = tuple(kept)
        return plan
    if pol.mig == "dynamic":
        if gpu.mig_enabled or mig_mode_switches_at_runtime(gpu.cuda_compute_capability):
            # Only profiles that can be placed at all on an empty GPU are worth publishing.
            plan.dynamic_profiles = tuple(
                p for p in _chosen_profiles(gpu, pol, origin)
                if any(can_place(gpu.mig_profiles, (), p.profile_id, s) is None for s in p.starts)
            )
            if pol.dynamic_mig is not None and pol.dynamic_mig.layout == "capacity":
                for p in plan.dynamic_profiles:
                    _check_capacity_profile(gpu, p, origin)
                plan.mig_capacity = True
        else:
            warnings.append(f"{who}: dynamic MIG needs MIG mode enabled before the driver starts on this GPU "
                            "(switching needs a GPU reset); publishing it without MIG partitions")
    elif gpu.mig_enabled:
        warnings.append(f"{who}: MIG mode is enabled but the policy has mig: none; nothing published "
                        "(set mig: static or mig: dynamic)")
        return plan
    if whole_usable:
        plan.whole = pol.publish_whole
        if pol.slots is not None:
            plan.slots = pol.slots.count
            plan.slot_strategy = pol.slots.strategy
            plan.slot_capacity = pol.slots.layout == "capacity"
    elif pol.publish_whole or pol.slots is not None:
        warnings.append(f"{who}: MIG mode is enabled and cannot be switched off at runtime; "
                        "the whole GPU and its slots are not published")
    return plan


def _counter_set(gpu: GpuInfo, plan: _GpuPlan) -> CounterSet | None:
    exclusive_kinds = int(plan.whole) + int(bool(plan.dynamic_profiles)) + int(plan.slots > 0)
    placements = bool(plan.dynamic_profiles) and not plan.mig_capacity    # partitions that exclude each other
    if not placements and exclusive_kinds < 2:
        return None  # nothing on this GPU excludes anything else
    s = plan.slot_counter
    m = max(gpu.memory_slices, memory_slice_count(gpu.mig_profiles)) if placements else 1
    counters: dict[str, int] = {f"memory-slice-{i}": s for i in range(m)}
    if placements:
        budget = budget_of(gpu.mig_profiles)
        if budget.compute_slices is not None:
            counters["compute-slices"] = budget.compute_slices
        if budget.ofa_engines is not None and any(p.ofa_engines for p in plan.dynamic_profiles):
            counters["ofa-engines"] = budget.ofa_engines
        for p in plan.dynamic_profiles:
            if p.max_instances < max_instances_alone(gpu.mig_profiles, p.profile_id):
                counters[f"instances-{p.profile_id}"] = p.max_instances
    return CounterSet(counter_set_name(gpu.minor), gpu.minor, counters)


def _consumes(cs: CounterSet | None, counters: dict[str, int]) -> tuple[dict[str, Any], ...]:
    if cs is None:
        return ()
    used = {k: {"value": str(v)} for k, v in counters.items() if k in cs.counters and v > 0}
    return ({"counterSet": cs.name, "counters": used},)


class _GpuFields(TypedDict):
    """The fields every device of one GPU shares."""

    gpu_uuid: str
    gpu_index: int
    gpu_minor: int
    gpu_pci_bus_id: str


def _gpu_devices(gpu: GpuInfo, inv: NodeInventory, plan: _GpuPlan) -> tuple[list[Device], CounterSet | None]:
    cs = _counter_set(gpu, plan)
    slices = [k for k in (cs.counters if cs else {}) if k.startswith("memory-slice-")]
    s = plan.slot_counter
    common = common_attributes(gpu, inv)
    base = _GpuFields(gpu_uuid=gpu.uuid, gpu_index=gpu.index, gpu_minor=gpu.minor, gpu_pci_bus_id=gpu.pci_bus_id)
    devices: list[Device] = []

    if plan.whole:
        attrs = {"type": _s(KIND_GPU), "uuid": _s(gpu.uuid), **common, "sharing": _s("none")}
        cap = {"memory": {"value": format_mib(gpu.memory_mib)}, "multiprocessors": {"value": str(gpu.multiprocessors)},
               **_engine_capacity(gpu.copy_engines, gpu.decoders, gpu.encoders, gpu.jpeg_engines, gpu.ofa_engines)}
        devices.append(Device(name=gpu_device_name(gpu.minor), kind=KIND_GPU, **base, attributes=attrs, capacity=cap,
                              consumes_counters=_consumes(cs, {k: s for k in slices})))

    by_id = {p.profile_id: p for p in gpu.mig_profiles}
    placements: list[tuple[MigProfile, int, MigInstance | None]] = []
    if plan.mig_capacity:
        devices += [_mig_instances_device(gpu, prof, common, base, _consumes(cs, {k: s for k in slices}))
                    for prof in plan.dynamic_profiles]
    elif plan.dynamic_profiles:
        placements = [(p, start, None) for p in plan.dynamic_profiles for start in p.starts
                      if can_place(gpu.mig_profiles, (), p.profile_id, start) is None]
    else:
        placements = [(by_id[i.profile_id], i.start, i) for i in plan.static_instances]
    placements.sort(key=lambda t: (_profile_order_key(t[0]), -t[1]))
    for prof, start, inst in placements:
        attrs = {"type": _s(KIND_MIG)}
        if inst is not None:
            attrs["uuid"] = _s(inst.uuid)
        attrs.update({"parentUUID": _s(gpu.uuid), "profile": _s(prof.name), **common, "sharing": _s("none")})
        mem_mib = inst.memory_mib if inst is not None and inst.memory_mib else prof.memory_mib
        cap = {"memory": {"value": format_mib(mem_mib)}, "multiprocessors": {"value": str(prof.multiprocessors)},
               **_engine_capacity(prof.copy_engines, prof.decoders, prof.encoders, prof.jpeg_engines, prof.ofa_engines)}
        use = {f"memory-slice-{k}": s for k in interval(prof, start)}
        use.update({"compute-slices": prof.compute_slices, "ofa-engines": prof.ofa_engines,
                    f"instances-{prof.profile_id}": 1})
        devices.append(Device(
            name=mig_device_name(gpu.minor, prof.name, prof.profile_id, start), kind=KIND_MIG, **base,
            mig_dynamic=inst is None, mig_profile_id=prof.profile_id, mig_profile_name=prof.name, mig_start=start,
            mig_size=prof.memory_slices, mig_uuid=inst.uuid if inst else None, mig_gi_id=inst.gi_id if inst else None,
            mig_ci_id=inst.ci_id if inst else None, attributes=attrs, capacity=cap,
            consumes_counters=_consumes(cs, use)))

    if plan.slot_capacity and plan.slots:
        devices.append(_slots_device(gpu, plan, common, base, _consumes(cs, {key: 1 for key in slices})))
        return devices, cs
    for k in range(plan.slots):
        n = plan.slots
        mps = plan.slot_strategy == "mps"
        # MPS enforces a memory limit and an SM share per client, so the slot advertises its share; a
        # time-sliced slot can use the whole framebuffer and every SM (no isolation), so it says so.
        mem_mib = gpu.memory_mib // n if mps else gpu.memory_mib
        sms = max(1, gpu.multiprocessors // n) if mps else gpu.multiprocessors
        attrs = {"type": _s(KIND_SLOT), "parentUUID": _s(gpu.uuid), **common, "sharing": _s(plan.slot_strategy)}
        cap = {"memory": {"value": format_mib(mem_mib)}, "multiprocessors": {"value": str(sms)}}
        devices.append(Device(
            name=slot_device_name(gpu.minor, k), kind=KIND_SLOT, **base, sharing=plan.slot_strategy, slot_index=k,
            slot_count=n, mps_thread_percentage=100 // n if mps else None, mps_memory_limit_mib=mem_mib if mps else None,
            attributes=attrs, capacity=cap, consumes_counters=_consumes(cs, {key: 1 for key in slices})))
    return devices, cs


def _slots_device(gpu: GpuInfo, plan: _GpuPlan, common: Mapping[str, dict[str, Any]], base: _GpuFields,
                  consumes: tuple[dict[str, Any], ...]) -> Device:
    """The capacity layout's one slot device: ``slots: N`` consumable (``_units``). What a share gets (MPS
    threads and memory limit) follows from its slots, k/N of the GPU, when it is prepared."""
    n = plan.slots
    mps = plan.slot_strategy == "mps"
    attrs = {"type": _s(KIND_SLOT), "parentUUID": _s(gpu.uuid), **common, "sharing": _s(plan.slot_strategy)}
    cap = _units("slots", n)
    return Device(
        name=slots_device_name(gpu.minor), kind=KIND_SLOT, **base, sharing=plan.slot_strategy, slot_count=n,
        mps_thread_percentage=100 // n if mps else None, mps_memory_limit_mib=gpu.memory_mib // n if mps else None,
        attributes=attrs, capacity=cap, consumes_counters=consumes, allow_multiple_allocations=True)


def _mig_instances_device(gpu: GpuInfo, prof: MigProfile, common: Mapping[str, dict[str, Any]], base: _GpuFields,
                          consumes: tuple[dict[str, Any], ...]) -> Device:
    """The capacity layout's one partition device: ``instances: N`` consumable (``_units``); a share gets that
    many MIG devices of the profile. What one instance has (memory, multiprocessors, engines) is published as
    attributes ``instanceMemoryMiB``, ``instanceMultiprocessors``, ``instance<Engine>``: true of every share,
    whatever its instance count."""
    n = instances_together(gpu.mig_profiles, prof)
    attrs = {"type": _s(KIND_MIG), "parentUUID": _s(gpu.uuid), "profile": _s(prof.name), **common,
             "sharing": _s("none"), "instanceMemoryMiB": _i(prof.memory_mib),
             "instanceMultiprocessors": _i(prof.multiprocessors), "instanceCopyEngines": _i(prof.copy_engines),
             "instanceDecoders": _i(prof.decoders), "instanceEncoders": _i(prof.encoders),
             "instanceJpegEngines": _i(prof.jpeg_engines), "instanceOfaEngines": _i(prof.ofa_engines)}
    return Device(
        name=mig_instances_device_name(gpu.minor, prof.name, prof.profile_id), kind=KIND_MIG, **base,
        mig_dynamic=True, mig_profile_id=prof.profile_id, mig_profile_name=prof.name, mig_size=prof.memory_slices,
        mig_instances=n, mig_starts=tuple(prof.starts), attributes=attrs, capacity=_units("instances", n),
        consumes_counters=consumes, allow_multiple_allocations=True)


def _units(name: str, n: int) -> dict[str, dict[str, Any]]:
    """The one capacity of a multi-allocatable device whose shares are counted in whole units: ``name: n``, a
    share takes 1 unless it asks for more (up to n). Only this is published as capacity: every capacity of such a
    device is consumable, and one without a requestPolicy would be taken whole by a request that does not name
    it."""
    return {name: {"value": str(n), "requestPolicy": {
        "default": "1", "validRange": {"min": "1", "max": str(n), "step": "1"}}}}


def _shared_device(gpu: GpuInfo, inv: NodeInventory, pol: GpuPolicy) -> Device:
    shares = pol.memory_shares
    assert shares is not None
    total = gpu.memory_mib * MIB
    lo, step = shares.minimum_bytes, shares.step_bytes
    if lo > total:
        raise DeviceModelError(f"{describe_gpu(gpu)}: memoryShares.minimum {shares.minimum} exceeds the GPU's memory "
                               f"{format_mib(gpu.memory_mib)}")
    hi = lo + (total - lo) // step * step
    # Every capacity of a multi-allocatable device is consumable, and a request that does not name one
    # consumes all of it unless a requestPolicy says otherwise. So the share device publishes only `memory`
    # (with a policy); SM count and engines would make the first claim take them all.
    # The share device is the GPU's only device. It could exclude whole/MIG devices the way the slots device
    # does (counters charged once while any share is out), but the policy keeps memory shares on their own.
    cap = {"memory": {"value": format_bytes(total), "requestPolicy": {
        "default": format_bytes(shares.default_bytes),
        "validRange": {"min": format_bytes(lo), "max": format_bytes(hi), "step": format_bytes(step)},
    }}}
    attrs = {"type": _s(KIND_SHARED), "parentUUID": _s(gpu.uuid), **common_attributes(gpu, inv),
             "sharing": _s(shares.strategy)}
    return Device(name=shared_device_name(gpu.minor), kind=KIND_SHARED, gpu_uuid=gpu.uuid, gpu_index=gpu.index,
                  gpu_minor=gpu.minor, gpu_pci_bus_id=gpu.pci_bus_id, sharing=shares.strategy,
                  share_min_bytes=lo, share_step_bytes=step, attributes=attrs, capacity=cap,
                  allow_multiple_allocations=True)


def build_devices(
    inventory: NodeInventory,
    policy: NodePolicy,
    *,
    driver: str = DEFAULT_DRIVER,
    taints: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    model_name_of: Callable[[GpuInfo], str | None] | None = None,
) -> DeviceModel:
    """All devices and counter sets of one node, in the documented order.

    ``taints`` (from the health monitor) maps device names to DeviceTaints; a taint on a whole-GPU name
    (``gpu-<minor>``) applies to every device of that GPU, because the fault is in the physical GPU. GPUs
    that discovery found unhealthy are published as one whole GPU device, whatever the policy, with
    ``<driver>/unhealthy=<reason>:NoSchedule``.
    ``model_name_of`` gives the model name for rules that match on ``model`` (default: the catalog's).
    """
    if model_name_of is None:
        model_name_of = catalog_model_name
    taints = taints or {}
    warnings: list[str] = []
    devices: list[Device] = []
    counter_sets: list[CounterSet] = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.minor):
        origin, pol = policy.select(gpu, model_name_of(gpu))
        if gpu.healthy:
            plan = _plan(gpu, pol, origin, warnings)
        else:
            # An unhealthy (e.g. lost) GPU reports too little to apply any policy: no memory, no MIG profiles,
            # perhaps no name, so slots would come out with 0 memory and MIG would fail the node's whole pool.
            # Whatever rule matches, it is published as one whole GPU carrying the taint.
            warnings.append(f"{describe_gpu(gpu)} is unhealthy ({gpu.health_reason}): published as one tainted "
                            f"whole GPU instead of what node policy {origin} asks for")
            plan = _GpuPlan(whole=True)
        if plan.shares:
            gpu_devices, cs = [_shared_device(gpu, inventory, pol)], None
        else:
            gpu_devices, cs = _gpu_devices(gpu, inventory, plan)
        gpu_taints: list[Mapping[str, Any]] = list(taints.get(gpu_device_name(gpu.minor), ()))
        if not gpu.healthy:
            t: dict[str, Any] = {"key": f"{driver}/unhealthy", "effect": "NoSchedule"}
            reason = _label_value(gpu.health_reason)
            if reason:
                t["value"] = reason
            gpu_taints.insert(0, t)
        for d in gpu_devices:
            own = taints.get(d.name, ()) if d.name != gpu_device_name(gpu.minor) else ()
            merged = _merge_taints(gpu_taints, own)
            devices.append(d if not merged else _replace(d, taints=merged))
        if cs is not None:
            counter_sets.append(cs)
    known = {d.name for d in devices} | {gpu_device_name(g.minor) for g in inventory.gpus}
    for name in sorted(taints):
        if name not in known and taints[name]:
            warnings.append(f"taint for unknown device {name!r} ignored")
    return DeviceModel(tuple(devices), tuple(counter_sets), tuple(warnings))


def _replace(d: Device, **changes: Any) -> Device:
    from dataclasses import replace

    return replace(d, **changes)
