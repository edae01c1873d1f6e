"""What NVIDIA's DRA driver publishes for the same GPUs, for the scheduler benchmark's side-by-side shape.

NVIDIA's GPU kubelet plugin (``gpu-kubelet-plugin`` of kubernetes-sigs/dra-driver-nvidia-gpu, formerly
NVIDIA/k8s-dra-driver-gpu; as of its 2026-08-07 state) with the ``DynamicMIG`` feature gate, against an API
server of 1.35 or later, publishes one pool per node, named after the node, of driver ``gpu.nvidia.com``:

* a first slice of only ``sharedCounters``: one counter set per GPU, ``gpu-<minor>-counter-set``, with one
  counter per capacity dimension (``memory``, ``multiprocessors``, ``copy-engines``, ``decoders``,
  ``encoders``, ``jpeg-engines``, ``ofa-engines``: the capacity names in DNS form, each the largest value of any
  MIG profile of the GPU) and ``memory-slice-<i>`` = 1 for each memory slice (as many as the largest placement
  covers);
* then one slice of devices per GPU, GPUs by PCI bus ID, each slice's devices sorted by name: the whole GPU
  ``gpu-<minor>`` and every possible placement of every MIG profile whose compute-instance and GPU-instance
  slice counts agree (so ``+me`` profiles too), named
  ``gpu-<minor>-mig-<profile, lower case, dots dropped, other characters as '-'>-<GI profile id>-<start>``;
* the whole GPU consumes every counter of its set (its capacities are the per-dimension maxima, so its
  ``memory`` is the largest profile's, not the GPU's total); a placement consumes its own capacities and the
  memory slices it covers, each 1;
* attributes of the whole GPU: ``type: gpu``, ``uuid``, ``productName``, ``brand``, ``architecture``,
  ``cudaComputeCapability``, ``driverVersion``, ``cudaDriverVersion`` (versions), and
  ``resource.kubernetes.io/pciBusID``, ``/pcieRoot``, ``/numaNode`` (when known); of a placement the same
  without ``uuid`` (it has none until prepared), with ``type: mig``, ``parentUUID`` and ``profile``;
* capacities of a placement: ``multiprocessors``, ``copyEngines``, ``decoders``, ``encoders``,
  ``jpegEngines``, ``ofaEngines`` and ``memory`` (the profile's MiB as bytes).

Its chart's classes: ``gpu.nvidia.com`` (``type == 'gpu'``, with ``extendedResourceName: nvidia.com/gpu``) and
``mig.nvidia.com`` (``type == 'mig'``). A GPU without MIG is published whole, without counters.

The slices are built here from those facts on our simulated GPUs' discovery (the fleet document of
bench/scheduler.py), so both drivers' shapes describe the very same GPUs. Deliberate differences: slice names
are ``<node>-gpu.nvidia.com-<index>`` (NVIDIA's slice controller uses generateName, a random suffix) so that
runs are repeatable, and counter sets beyond 8 per node go to further counters-only slices (NVIDIA's one slice
would exceed the API's 8 counter sets; the benchmark's nodes have 8 GPUs, where both agree).
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from api.quantity import format_mib
from dra.model.devices import STANDARD_DOMAIN, pcie_root, semver
from dra.model.gpu import GpuInfo, MigProfile, NodeInventory
from dra.model.slices import MAX_COUNTER_SETS
from dra.node.inventory import discover_once
from dra.sim.fleet import gpu_uuid, nvml_for_node, parse_fleet

NVIDIA_DRIVER = "gpu.nvidia.com"
GPU_CLASS = "gpu.nvidia.com"
MIG_CLASS = "mig.nvidia.com"
EXTENDED_RESOURCE = "nvidia.com/gpu"

# Capacity name -> MigProfile field, in the order NVIDIA lists them; counters take the capacity name in DNS form.
_CAPACITIES = (("multiprocessors", "multiprocessors"), ("copyEngines", "copy_engines"), ("decoders", "decoders"),
               ("encoders", "encoders"), ("jpegEngines", "jpeg_engines"), ("ofaEngines", "ofa_engines"),
               ("memory", "memory_mib"))


def device_classes() -> list[dict[str, Any]]:
    """The two DeviceClasses of NVIDIA's chart that whole GPUs and MIG devices are claimed with."""
    def cls(name: str, device_type: str, extended: str | None = None) -> dict[str, Any]:
        spec: dict[str, Any] = {"selectors": [{"cel": {"expression": (
            f"device.driver == '{NVIDIA_DRIVER}' && device.attributes['{NVIDIA_DRIVER}'].type == '{device_type}'")}}]}
        if extended:
            spec["extendedResourceName"] = extended
        return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name}, "spec": spec}
    return [cls(GPU_CLASS, "gpu", EXTENDED_RESOURCE), cls(MIG_CLASS, "mig")]


def dns_name(camel: str) -> str:
    """``copyEngines`` -> ``copy-engines``: how NVIDIA names a counter after its capacity."""
    return re.sub(r"([a-z0-9])([A-Z])", r"\1-\2", camel).lower()


def profile_slug(profile: str) -> str:
    """``1g.10gb`` -> ``1g10gb``, ``1g.10gb+me`` -> ``1g10gb-me`` (dots dropped, then RFC 1123)."""
    return re.sub(r"[^a-z0-9-.]", "-", profile.replace(".", "").lower()).strip("-")


def counter_set_name(minor: int) -> str:
    return f"gpu-{minor}-counter-set"


def mig_device_name(minor: int, profile: MigProfile, start: int) -> str:
    return f"gpu-{minor}-mig-{profile_slug(profile.name)}-{profile.profile_id}-{start}"


def _value(name: str, n: int) -> dict[str, str]:
    return {"value": format_mib(n) if name == "memory" else str(n)}


def _profile_capacity(p: MigProfile) -> dict[str, int]:
    return {name: int(getattr(p, field)) for name, field in _CAPACITIES}


def _max_capacity(profiles: Sequence[MigProfile]) -> dict[str, int]:
    return {name: max(int(getattr(p, field)) for p in profiles) for name, field in _CAPACITIES}


def _memory_slices(profiles: Sequence[MigProfile]) -> int:
    # NVIDIA takes the largest placement's size as the GPU's memory-slice count.
    return max(p.memory_slices for p in profiles)


def _counters(capacity: Mapping[str, int], slices: range) -> dict[str, dict[str, str]]:
    out = {dns_name(name): _value(name, n) for name, n in capacity.items()}
    out.update({f"memory-slice-{i}": {"value": "1"} for i in slices})
    return out


def _attributes(gpu: GpuInfo, inv: NodeInventory) -> dict[str, dict[str, Any]]:
    """The parent's attributes every device of a GPU carries."""
    cc = gpu.cuda_compute_capability
    attrs: dict[str, dict[str, Any]] = {
        "productName": {"string": gpu.product_name},
        "brand": {"string": gpu.brand},
        "architecture": {"string": gpu.architecture},
        "cudaComputeCapability": {"version": f"{cc[0]}.{cc[1]}.0"},
        "driverVersion": {"version": semver(inv.driver_version)},
        "cudaDriverVersion": {"version": semver(inv.cuda_driver_version)},
        f"{STANDARD_DOMAIN}/pciBusID": {"string": gpu.pci_bus_id},
    }
    root = pcie_root(gpu)
    if root:
        attrs[f"{STANDARD_DOMAIN}/pcieRoot"] = {"string": root}
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        attrs[f"{STANDARD_DOMAIN}/numaNode"] = {"int": gpu.numa_node}
    return attrs


def gpu_devices(gpu: GpuInfo, inv: NodeInventory) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the GPU's counter set or None, its devices sorted by name) as NVIDIA's plugin publishes them."""
    common = _attributes(gpu, inv)
    whole: dict[str, Any] = {"name": f"gpu-{gpu.minor}", "attributes": {"type": {"string": "gpu"},
                                                                          "uuid": {"string": gpu.uuid}, **common}}
    profiles = gpu.mig_profiles if gpu.mig_capable else ()
    if not profiles:
        whole["capacity"] = {"memory": _value("memory", gpu.memory_mib)}
        return None, [whole]
    cs_name = counter_set_name(gpu.minor)
    everything = _counters(_max_capacity(profiles), range(_memory_slices(profiles)))
    whole["capacity"] = {name: _value(name, n) for name, n in _max_capacity(profiles).items()}
    whole["consumesCounters"] = [{"counterSet": cs_name, "counters": everything}]
    devices = [whole]
    for p in profiles:
        cap = _profile_capacity(p)
        attrs = {"type": {"string": "mig"}, "parentUUID": {"string": gpu.uuid}, "profile": {"string": p.name},
                 **common}
        for start in p.starts:
            devices.append({"name": mig_device_name(gpu.minor, p, start), "attributes": attrs,
                            "capacity": {name: _value(name, n) for name, n in cap.items()},
                            "consumesCounters": [{"counterSet": cs_name,
                                                  "counters": _counters(cap, range(start, start + p.memory_slices))}]})
    devices.sort(key=lambda d: d["name"])
    return {"name": cs_name, "counters": everything}, devices


def node_slice_specs(inv: NodeInventory, node_name: str) -> list[dict[str, Any]]:
    """The node's pool: counters-only slice(s) first, then one devices-only slice per GPU (by PCI bus ID)."""
    counter_sets: list[dict[str, Any]] = []
    per_gpu: list[list[dict[str, Any]]] = []
    for gpu in sorted(inv.gpus, key=lambda g: g.pci_bus_id):
        cs, devices = gpu_devices(gpu, inv)
        if cs is not None:
            counter_sets.append(cs)
        per_gpu.append(devices)
    parts: list[dict[str, Any]] = [{"sharedCounters": counter_sets[i:i + MAX_COUNTER_SETS]}
                                   for i in range(0, len(counter_sets), MAX_COUNTER_SETS)]
    parts += [{"devices": devices} for devices in per_gpu]
    pool = {"name": node_name, "generation": 1, "resourceSliceCount": len(parts)}
    return [{"driver": NVIDIA_DRIVER, "pool": pool, "nodeName": node_name, **part} for part in parts]


def fleet_slice_specs(fleet_doc: Mapping[str, Any]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(node name, slice specs) for every node of a fleet document (dra/sim/fleet.py). Nodes alike but for their
    name are discovered once: a simulated GPU's identity differs between nodes only in its UUID."""
    fleet = parse_fleet(dict(fleet_doc), "<nvidia shape fleet>")
    seen: dict[str, NodeInventory] = {}
    for node in fleet.nodes:
        key = node.model_dump_json(exclude={"name", "policy"})
        if key not in seen:
            seen[key] = discover_once(nvml_for_node(node))
        inv = seen[key]
        inv = replace(inv, gpus=tuple(replace(g, uuid=gpu_uuid(node.name, g.index)) for g in inv.gpus))
        yield node.name, node_slice_specs(inv, node.name)


def slice_objects(node_name: str, specs: Sequence[Mapping[str, Any]], node_uid: str) -> list[dict[str, Any]]:
    """ResourceSlice objects of one node's pool (``<node>-<driver>-<index>``), owned by its Node as the kubelet
    plugin helper's slice controller sets it."""
    owner = {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
             "metadata": {"name": f"{node_name}-{spec['driver']}-{i:04d}", "ownerReferences": [owner]},
             "spec": dict(spec)} for i, spec in enumerate(specs)]
