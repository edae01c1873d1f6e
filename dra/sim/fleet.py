"""Fleet files: simulated nodes and their GPUs, by catalog model name.

Example::

    nodes:
      - name: node-a
        driverVersion: "580.95.05"        # optional (default 580.95.05)
        cudaDriverVersion: "13.0"         # optional (default 13.0)
        gpus:
          - model: H100-80GB
            count: 8
            mig: {enabled: true, instances: [{profile: 3g.40gb, start: 4}]}   # layout that exists at start
          - model: L4
            count: 2
            broken: "fell off the bus"    # these GPUs are lost
            xids: [79]                    # XID events raised at start
        policy: {...}                     # node policy, see dra/model/policy.py

A MIG instance without ``start`` is placed as NVML places it (``nvmlDeviceCreateGpuInstance``). Every GPU of
a group gets the same layout.

``nvml_for_node`` builds the simulated NVML library for a node. Identities are derived from the node name and
GPU index, so they are the same on every start: UUID ``GPU-<uuid5(node/index)>``, minor number = index, PCI
bus ids as on an 8-GPU HGX board, and on nodes with 8 or more GPUs the first half on NUMA node 0 and the second
half on NUMA node 1 (smaller nodes: all on node 0).

With a ``state_file`` the node's GPUs keep their state there (dra/sim/state.py), like hardware outliving
the process: the fleet's MIG layout and broken GPUs describe the first boot only, when the file does not exist
yet; later the file says what exists. The fleet's ``xids`` are events and are raised on every start.
"""
from __future__ import annotations

import re
import uuid as uuidlib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from api.k8snames import is_dns_subdomain
from api.yamlfiles import load_yaml_file
from dra.model.catalog import get_model
from dra.model.gpu import MigProfile
from dra.sim.fakenvml import FakeNvml, SimulatedGpu, auto_start, place_problem

_FLEET_NAMESPACE = uuidlib.UUID("0b7d3c52-8e0a-4a8e-bd7e-3f3b9c1f6a10")
# PCI bus numbers of the GPUs on an 8-GPU HGX board; further GPUs continue above them.
_HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
_DRIVER_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?$")
_CUDA_VERSION = re.compile(r"^(\d+)\.(\d)$")


class FleetError(ValueError):
    """A fleet file that cannot be used; the message names the file, the field and the reason."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)


class MigInstanceSpec(_Strict):
    profile: str
    start: int | None = Field(default=None, ge=0)


class MigSpec(_Strict):
    enabled: bool = False
    instances: list[MigInstanceSpec] = []


class GpuGroupSpec(_Strict):
    model: str
    count: int = Field(default=1, ge=1, le=64)
    mig: MigSpec = MigSpec()
    broken: str | None = None
    xids: list[int] = []

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        get_model(value)  # UnknownModelError (a ValueError) lists the known models
        return value

    @field_validator("broken")
    @classmethod
    def _reason_given(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("give a reason, e.g. 'fell off the bus'")
        return value

    @field_validator("xids")
    @classmethod
    def _xid_range(cls, value: list[int]) -> list[int]:
        for x in value:
            if not 1 <= x <= 0xFFFF:
                raise ValueError(f"XID {x} is out of range 1..65535")
        return value


class NodeSpec(_Strict):
    name: str
    driver_version: str = Field(default="580.95.05", alias="driverVersion")
    cuda_driver_version: str = Field(default="13.0", alias="cudaDriverVersion")
    gpus: list[GpuGroupSpec] = []
    policy: dict[str, Any] | None = None

    @field_validator("name")
    @classmethod
    def _dns_name(cls, value: str) -> str:
        if not is_dns_subdomain(value):
            raise ValueError("must be a lower-case DNS name (RFC 1123), e.g. node-a")
        return value

    @field_validator("driver_version")
    @classmethod
    def _driver(cls, value: str) -> str:
        if not _DRIVER_VERSION.fullmatch(value):
            raise ValueError("must look like 580.95.05")
        return value

    @field_validator("cuda_driver_version")
    @classmethod
    def _cuda(cls, value: str) -> str:
        if not _CUDA_VERSION.fullmatch(value):
            raise ValueError("must look like 13.0")
        return value

    @property
    def cuda_driver_version_int(self) -> int:
        """As NVML reports it: "12.8" -> 12080."""
        m = _CUDA_VERSION.fullmatch(self.cuda_driver_version)
        assert m is not None
        return int(m.group(1)) * 1000 + int(m.group(2)) * 10

    @property
    def gpu_count(self) -> int:
        return sum(g.count for g in self.gpus)


class Fleet(_Strict):
    nodes: list[NodeSpec]
    _source: str = PrivateAttr(default="<fleet>")

    @property
    def source(self) -> str:
        """Where the fleet was read from (for messages)."""
        return self._source

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise FleetError(f"{self.source}: no node {name!r} (nodes: {', '.join(n.name for n in self.nodes)})")

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]


# ---------------------------------------------------------------------------------------------------------------
# Loading


def _field_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def load_fleet(path: str | Path) -> Fleet:
    """Read and validate a fleet file; FleetError names the file, the field path and the reason."""
    source = str(path)
    return parse_fleet(load_yaml_file(path, source=source, error=FleetError), source)


def parse_fleet(data: Any, source: str = "<fleet>") -> Fleet:
    """Validate fleet data already parsed from YAML/JSON."""
    if not isinstance(data, dict):
        raise FleetError(f"{source}: must be a mapping with a 'nodes' list")
    try:
        fleet = Fleet.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown field"
            problems.append(f"{_field_path(tuple(err['loc']))}: {msg}")
        raise FleetError(f"{source}: " + "; ".join(problems)) from None
    fleet._source = source
    _check_nodes(fleet, source)
    return fleet


def _check_nodes(fleet: Fleet, source: str) -> None:
    seen: set[str] = set()
    for i, node in enumerate(fleet.nodes):
        where = f"{source}: nodes[{i}]"
        if node.name in seen:
            raise FleetError(f"{where}.name: node {node.name!r} appears twice")
        seen.add(node.name)
        for j, group in enumerate(node.gpus):
            _check_mig(group, f"{where}.gpus[{j}].mig")
        _check_policy(node, f"{where}.policy", f"{source} node {node.name}")


def _check_mig(group: GpuGroupSpec, where: str) -> None:
    model = get_model(group.model)
    if group.mig.enabled and not model.mig_capable:
        raise FleetError(f"{where}.enabled: {model.name} does not support MIG")
    if group.mig.instances and not group.mig.enabled:
        raise FleetError(f"{where}.instances: MIG instances need enabled: true")
    placed: list[tuple[MigProfile, int]] = []
    for k, inst in enumerate(group.mig.instances):
        at = f"{where}.instances[{k}]"
        try:
            profile = model.profile(inst.profile)
        except ValueError as exc:
            raise FleetError(f"{at}.profile: {exc}") from None
        start = inst.start if inst.start is not None else auto_start(placed, profile)
        if start is None:
            raise FleetError(f"{at}: no free placement left for {profile.name} "
                             f"(layout so far: {_layout_text(placed)})")
        problem = place_problem(model, placed, profile, start)
        if problem is not None:
            raise FleetError(f"{at}{'.start' if problem[0] == 'start' else ''}: {problem[1]}")
        placed.append((profile, start))


def _layout_text(placed: list[tuple[MigProfile, int]]) -> str:
    return ", ".join(f"{p.name}@{s}" for p, s in placed) or "empty"


def _check_policy(node: NodeSpec, where: str, source: str) -> None:
    if node.policy is None:
        return
    from dra.model.policy import PolicyError, parse_node_policy

    try:
        parse_node_policy(node.policy, source=source)
    except PolicyError as exc:
        details = "; ".join(f"{where}.{p}: {r}" if p else f"{where}: {r}" for p, r in exc.problems)
        raise FleetError(details) from None


# ---------------------------------------------------------------------------------------------------------------
# Simulated NVML for a node


def gpu_uuid(node_name: str, index: int) -> str:
    return "GPU-" + str(uuidlib.uuid5(_FLEET_NAMESPACE, f"{node_name}/{index}"))


def pci_bus_id(index: int) -> str:
    """NVML form of the i-th GPU's PCI address."""
    bus = _HGX_BUSES[index] if index < len(_HGX_BUSES) else 0xDC + (index - len(_HGX_BUSES))
    domain = 0 if bus <= 0xFF else bus >> 8
    return "%08X:%02X:00.0" % (domain, bus & 0xFF)


def numa_node(index: int, gpu_count: int) -> int:
    return 0 if gpu_count < 8 else (0 if index < gpu_count // 2 else 1)


def nvml_for_node(node: NodeSpec, state_file: str | Path | None = None) -> FakeNvml:
    """The simulated NVML library of one node, with its MIG layouts created, broken GPUs lost and XIDs queued.
    Like the real library it needs ``nvmlInit`` before use. ``state_file``: keep the GPUs' state there (see the
    module docstring); SimulatedStateError (a ValueError) names a file that cannot be used."""
    total = node.gpu_count
    specs: list[SimulatedGpu] = []
    groups: list[tuple[GpuGroupSpec, int]] = []   # (group, first index)
    for group in node.gpus:
        groups.append((group, len(specs)))
        for _ in range(group.count):
            i = len(specs)
            specs.append(SimulatedGpu(model=get_model(group.model), uuid=gpu_uuid(node.name, i), minor=i,
                                      pci_bus_id=pci_bus_id(i), numa_node=numa_node(i, total),
                                      mig_enabled=group.mig.enabled))
    nvml = FakeNvml(specs, driver_version=node.driver_version,
                    cuda_driver_version=node.cuda_driver_version_int, state_file=state_file)
    nvml.nvmlInit()
    try:
        # Under the hardware lock, so two processes starting together boot the hardware once.
        with nvml.hardware_locked():
            if not nvml.has_saved_state():
                for group, first in groups:
                    for i in range(first, first + group.count):
                        _create_layout(nvml, i, group)
                        if group.broken is not None:
                            nvml.lose_gpu(specs[i].uuid, group.broken)
                nvml.save_state()
    finally:
        nvml.nvmlShutdown()
    for group, first in groups:
        for i in range(first, first + group.count):
            for xid in group.xids:
                nvml.inject_xid(specs[i].uuid, xid)
    return nvml


def _create_layout(nvml: FakeNvml, index: int, group: GpuGroupSpec) -> None:
    """Create the group's MIG instances through NVML calls, as an operator's tool would."""
    if not group.mig.instances:
        return
    model = get_model(group.model)
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    for inst in group.mig.instances:
        profile = model.profile(inst.profile)
        if inst.start is None:
            gi = nvml.nvmlDeviceCreateGpuInstance(h, profile.profile_id)
        else:
            place = nvml.c_nvmlGpuInstancePlacement_t(inst.start, profile.memory_slices)
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, profile.profile_id, place)
        nvml.nvmlGpuInstanceCreateComputeInstance(gi, _full_ci_profile_id(nvml, gi, profile.compute_slices))


def _full_ci_profile_id(nvml: FakeNvml, gi: Any, slices: int) -> int:
    """The compute-instance profile that spans the whole GPU instance (C == G)."""
    for idx in range(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, idx, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        except nvml.NVMLError:
            continue
        if info.sliceCount == slices:
            return int(info.id)
    raise LookupError(f"no {slices}-slice compute-instance profile")

__all__ = [
    "Fleet", "FleetError", "GpuGroupSpec", "MigInstanceSpec", "MigSpec", "NodeSpec",
    "gpu_uuid", "load_fleet", "numa_node", "nvml_for_node", "parse_fleet", "pci_bus_id",
]
