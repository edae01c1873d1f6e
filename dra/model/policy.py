"""Node policy: what to publish for each GPU of a node.

A node policy has a ``default`` GPU policy and an ordered list of ``rules``. Each rule has a ``match``
(GPU ``index``, ``uuid`` and/or ``model``; all given keys must match) and the GPU policy fields. The first
matching rule wins; its fields are taken as they are (they are not merged with ``default``). GPUs that no
rule matches get ``default``.

A GPU policy says what is published for that GPU:

* ``wholeGpu`` (default true): the GPU as one device (``type=gpu``).
* ``mig``: ``none`` (default), ``static`` (publish the MIG partitions that exist now; the whole GPU is
  never published then, because a GPU in MIG mode cannot run work as a whole) or ``dynamic`` (publish every
  MIG profile at every valid placement; the partition is created when a claim is prepared).
* ``dynamicMig``: ``{profiles: [1g.10gb, 3g.40gb]}`` (with ``mig: dynamic``): publish only these profiles, each
  at every valid placement, instead of all of them. Every published device costs the scheduler work on each
  node it considers, so a cluster that uses two profiles should publish two (docs/devices.md, "What the
  scheduler pays"). A name the GPU does not have is an error naming the GPU's profiles (judged when devices
  are built, where the GPU is known). ``layout: placements`` (default) publishes one device per profile and
  placement; ``layout: capacity`` (exactly one profile) publishes one partition device per GPU with consumable
  capacity ``instances: N`` that up to N claims share, each taking 1 instance unless it asks for more; the
  plugin picks free placements when a share is prepared (Kubernetes 1.36+; docs/devices.md "One MIG profile
  as capacity").
* ``slots``: ``{count: N (1..64), strategy: time-slicing|mps, layout: devices|capacity}``: N shared slots per
  GPU. Any slot excludes the whole GPU and every MIG partition; up to N slots coexist. ``layout: devices``
  (default) publishes N slot devices; ``layout: capacity`` publishes one slot device with consumable capacity
  ``slots: N`` that up to N claims share, each taking 1 slot unless it asks for more (Kubernetes 1.36+; fewer
  devices for the scheduler to walk, docs/devices.md "Slots as capacity").
* ``memoryShares``: consumable-capacity mode: one device per GPU that many claims may share, each asking for
  an amount of ``memory``. It excludes ``wholeGpu``, ``mig`` and ``slots`` (a GPU shared by memory is
  shared by memory only; ``slots.layout: capacity`` is the layout that combines a shared device with them).
  ``{minimum: 1Gi, step: 1Gi, default: <minimum>, strategy: mps|time-slicing}``.

Field names are accepted in camelCase (``wholeGpu``, ``memoryShares``) and in snake_case (``whole_gpu``,
``memory_shares``). Unknown fields and wrongly typed values are errors that name the field.

Example::

    default:
      wholeGpu: true
    rules:
    - match: {model: H100}          # product-name substring or catalog model name, case-insensitive
      mig: dynamic
      dynamicMig: {profiles: [1g.10gb, 3g.40gb]}
      slots: {count: 4, strategy: mps}
    - match: {index: 3}
      wholeGpu: false
      mig: static
    - match: {uuid: GPU-5f1c...}
      memoryShares: {minimum: 2Gi, step: 1Gi}
    mps:                            # node-wide MPS settings (MpsNodePolicy)
      shareAcrossNamespaces: false
      shmSize: 1Gi

Combinations that depend on the GPU itself (dynamic MIG on a GPU without MIG, static MIG while MIG mode is
off) are judged when devices are built (dra/model/devices.py), where the GPU is known.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from api.quantity import parse_quantity
from dra.model.gpu import GpuInfo

MAX_SLOTS = 64

MigMode = Literal["none", "static", "dynamic"]
# NVML's MIG profile names: "1g.10gb", "1g.10gb+me", "7g.80gb". Whether the GPU has one is judged per GPU.
MIG_PROFILE_NAME = re.compile(r"^[1-9][0-9]*g\.[1-9][0-9]*gb(\+[a-z]+)*$")
SharingStrategy = Literal["time-slicing", "mps"]


class PolicyError(ValueError):
    """A node policy that cannot be used. ``problems`` lists (field path, reason)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        text = "; ".join(f"{path}: {reason}" if path else reason for path, reason in problems)
        super().__init__(f"node policy {source}: {text}")


class _Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
    )


SlotLayout = Literal["devices", "capacity"]


class SlotPolicy(_Strict):
    """N shared slots per GPU: N devices, or one device whose consumable capacity is N slots."""

    count: int = Field(ge=1, le=MAX_SLOTS)
    strategy: SharingStrategy = "time-slicing"
    layout: SlotLayout = "devices"


class MemorySharePolicy(_Strict):
    """Consumable-capacity share device: claims ask for ``memory`` in ``step`` units of at least ``minimum``."""

    minimum: str = "1Gi"
    step: str = "1Gi"
    default: str | None = None
    strategy: SharingStrategy = "mps"

    @field_validator("minimum", "step", "default")
    @classmethod
    def _quantity(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if parse_quantity(v) <= 0:
            raise ValueError(f"must be a positive quantity, got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "MemorySharePolicy":
        lo, step = parse_quantity(self.minimum), parse_quantity(self.step)
        if self.default is not None:
            d = parse_quantity(self.default)
            if d < lo or (d - lo) % step:
                raise ValueError(f"default {self.default} must be minimum {self.minimum} plus a multiple of step {self.step}")
        return self

    @property
    def minimum_bytes(self) -> int:
        return parse_quantity(self.minimum)

    @property
    def step_bytes(self) -> int:
        return parse_quantity(self.step)

    @property
    def default_bytes(self) -> int:
        return parse_quantity(self.default) if self.default is not None else self.minimum_bytes


MigLayout = Literal["placements", "capacity"]


class DynamicMigPolicy(_Strict):
    """Which MIG profiles ``mig: dynamic`` publishes: each named profile at every valid placement, or one
    profile as one device whose consumable capacity is its instances."""

    profiles: list[str] = Field(min_length=1)
    layout: MigLayout = "placements"

    @field_validator("profiles")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not MIG_PROFILE_NAME.fullmatch(p)]
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))}: not a MIG profile name like 1g.10gb or 1g.10gb+me")
        twice = sorted({p for p in v if v.count(p) > 1})
        if twice:
            raise ValueError(f"{', '.join(map(repr, twice))} named more than once")
        return v

    @model_validator(mode="after")
    def _one_profile_as_capacity(self) -> "DynamicMigPolicy":
        # Instances of one profile are interchangeable (any free placement will do); two profiles compete for
        # memory slices, which one capacity cannot express.
        if self.layout == "capacity" and len(self.profiles) != 1:
            raise ValueError(f"layout: capacity needs exactly one profile in dynamicMig.profiles, got "
                             f"{len(self.profiles)} ({', '.join(self.profiles)})")
        return self


class MpsNodePolicy(_Strict):
    """How MPS daemons on this node treat the claims they serve (docs/security.md: the trust boundary).

    shareAcrossNamespaces:  one daemon (and its control socket and /dev/shm) may serve claims of several
                            namespaces at once; by default a device's daemon serves one namespace, and a claim
                            from another namespace waits (its prepare fails, naming the namespace) until the
                            device's claims are gone
    shmSize:                size of each daemon's /dev/shm, a tmpfs shared with its clients
    limitsAboveShare:       a claim config may raise an MPS slot's thread percentage and pinned memory above
                            the slot's share of the GPU (by default it may only lower them)
    controlInContainers:    client containers get the MPS control programs (by default they get none: clients
                            need only the pipe directory, and a root client could stop the daemon with them)
    """

    share_across_namespaces: bool = False
    shm_size: str = "1Gi"
    limits_above_share: bool = False
    control_in_containers: bool = False

    @field_validator("shm_size")
    @classmethod
    def _size(cls, v: str) -> str:
        if parse_quantity(v) < 1 << 20:
            raise ValueError(f"must be a quantity of at least 1Mi, got {v!r}")
        return v

    @property
    def shm_size_bytes(self) -> int:
        return parse_quantity(self.shm_size)


class GpuPolicy(_Strict):
    """What to publish for one GPU. ``whole_gpu`` None means "default": true unless memoryShares is set."""

    whole_gpu: bool | None = None
    mig: MigMode = "none"
    dynamic_mig: DynamicMigPolicy | None = None
    slots: SlotPolicy | None = None
    memory_shares: MemorySharePolicy | None = None

    @model_validator(mode="after")
    def _combinations(self) -> "GpuPolicy":
        if self.memory_shares is not None:
            clash = []
            if self.whole_gpu:
                clash.append("wholeGpu: true")
            if self.mig != "none":
                clash.append(f"mig: {self.mig}")
            if self.slots is not None:
                clash.append("slots")
            if clash:
                raise ValueError(f"memoryShares cannot be combined with {', '.join(clash)}")
        if self.dynamic_mig is not None and self.mig != "dynamic":
            raise ValueError(f"dynamicMig needs mig: dynamic (the policy has mig: {self.mig})")
        if self.mig == "static" and self.slots is not None:
            raise ValueError("slots cannot be combined with mig: static (a GPU in MIG mode has no whole GPU to share)")
        if self.mig == "static" and self.whole_gpu:
            raise ValueError("wholeGpu: true cannot be combined with mig: static (a GPU in MIG mode cannot run work as a whole)")
        return self

    @property
    def publish_whole(self) -> bool:
        if self.whole_gpu is not None:
            return self.whole_gpu
        return self.memory_shares is None and self.mig != "static"


class GpuSelector(_Strict):
    """Which GPUs a rule applies to; every given key must match."""

    index: int | None = Field(default=None, ge=0)
    uuid: str | None = None
    model: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _not_empty(self) -> "GpuSelector":
        if self.index is None and self.uuid is None and self.model is None:
            raise ValueError("match needs at least one of index, uuid, model")
        return self

    def matches(self, gpu: GpuInfo, model_name: str | None) -> bool:
        if self.index is not None and gpu.index != self.index:
            return False
        if self.uuid is not None and gpu.uuid.lower() != self.uuid.lower():
            return False
        if self.model is not None:
            want = self.model.lower()
            by_catalog = model_name is not None and model_name.lower() == want
            if not by_catalog and want not in gpu.product_name.lower():
                return False
        return True


class PolicyRule(GpuPolicy):
    match: GpuSelector

    def policy(self) -> GpuPolicy:
        return GpuPolicy.model_validate(self.model_dump(exclude={"match"}, exclude_unset=True))


class NodePolicy(_Strict):
    default: GpuPolicy = GpuPolicy()
    rules: list[PolicyRule] = Field(default_factory=list)
    mps: MpsNodePolicy = MpsNodePolicy()

    def for_gpu(self, gpu: GpuInfo, model_name: str | None = None) -> GpuPolicy:
        """The policy of the first rule matching ``gpu`` (``model_name``: catalog model name, if known)."""
        return self.select(gpu, model_name)[1]

    def select(self, gpu: GpuInfo, model_name: str | None = None) -> tuple[str, GpuPolicy]:
        """Like for_gpu, plus where the policy came from ("rules[2]" or "default"), for messages."""
        for i, rule in enumerate(self.rules):
            if rule.match.matches(gpu, model_name):
                return f"rules[{i}]", rule.policy()
        return "default", self.default


DEFAULT_NODE_POLICY = NodePolicy()


def _field_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + to_camel(str(item)))
    return "".join(parts)


def parse_node_policy(data: dict[str, Any] | None, source: str) -> NodePolicy:
    """Validate a node policy read from YAML/JSON. ``source`` names where it came from (file, node) for errors."""
    if data is None:
        return DEFAULT_NODE_POLICY
    if not isinstance(data, dict):
        raise PolicyError(source, [("", f"must be a mapping, got {type(data).__name__}")])
    try:
        return NodePolicy.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            if err["type"] == "extra_forbidden":
                msg = "unknown field"
            problems.append((_field_path(tuple(err["loc"])), msg))
        raise PolicyError(source, problems) from None
