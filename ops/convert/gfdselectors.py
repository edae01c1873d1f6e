"""GPU Feature Discovery node labels -> CEL device selectors (docs/devices.md, "From GFD nodeSelectors to CEL").

With DRA the scheduler picks the node from the claim, so a requirement on a GFD label becomes a selector on the
device's attribute or capacity of the same meaning. A ``nodeSelector`` entry is the requirement ``In [value]``;
node affinity brings ``NotIn``, ``Exists``, ``DoesNotExist``, ``Gt`` and ``Lt``. Labels that other NVIDIA
components or administrators set (``nvidia.com/gpu.present``, ``.deploy.*``, the config labels) stay node labels.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

GFD_PREFIX = "nvidia.com/"
# Node labels that are not GFD's: set by the GPU operator or by administrators; they stay on the nodes.
NODE_LABELS = ("nvidia.com/gpu.present", "nvidia.com/device-plugin.config", "nvidia.com/mig.config",
               "nvidia.com/mig.config.state", "nvidia.com/gpu.workload.config", "nvidia.com/cc.capable",
               "nvidia.com/gpu-operator.resource-allocation.mode")
NODE_LABEL_PREFIXES = ("nvidia.com/gpu.deploy.",)
# GFD labels without a device attribute here, and why.
NO_EQUIVALENT = {
    "nvidia.com/gpu.count": "a node's GPU count is no device property: ask for a count in the request",
    "nvidia.com/gpu.replicas": "a GPU shared N ways has N slot devices here: ask for a slot",
    "nvidia.com/gpu.machine": "the machine type is no device attribute here",
    "nvidia.com/gpu.mode": "the display mode is no device attribute here",
    "nvidia.com/gpu.clique": "NVLink fabric cliques are not published by this driver",
    "nvidia.com/mps.capable": "every GPU without MIG can have MPS slots here (node policy slots strategy mps)",
    "nvidia.com/mig.strategy": "MIG devices are their own device type here (class mig.<driver>)",
    "nvidia.com/gfd.timestamp": "a labelling time, not a device property",
    "nvidia.com/gpu.slices.gi": "MIG slice counts are not attributes here: select the profile",
    "nvidia.com/gpu.slices.ci": "MIG slice counts are not attributes here: select the profile",
}
NO_EQUIVALENT_PREFIXES = {"nvidia.com/vgpu.": "vGPU guests are not supported by this driver"}

_STR_ATTRS = {"nvidia.com/gpu.family": "family"}
# label -> (CEL on the attributes A, given A) for integer-valued labels
_INT_EXPRS: dict[str, Callable[[str], str]] = {
    "nvidia.com/gpu.compute.major": lambda a: f"{a}.cudaComputeCapability.major()",
    "nvidia.com/gpu.compute.minor": lambda a: f"{a}.cudaComputeCapability.minor()",
    "nvidia.com/cuda.driver-version.major": lambda a: f"{a}.driverVersion.major()",
    "nvidia.com/cuda.driver-version.minor": lambda a: f"{a}.driverVersion.minor()",
    "nvidia.com/cuda.driver-version.revision": lambda a: f"{a}.driverVersion.patch()",
    "nvidia.com/cuda.driver.major": lambda a: f"{a}.driverVersion.major()",
    "nvidia.com/cuda.driver.minor": lambda a: f"{a}.driverVersion.minor()",
    "nvidia.com/cuda.driver.rev": lambda a: f"{a}.driverVersion.patch()",
    "nvidia.com/cuda.runtime-version.major": lambda a: f"{a}.cudaDriverVersion.major()",
    "nvidia.com/cuda.runtime-version.minor": lambda a: f"{a}.cudaDriverVersion.minor()",
    "nvidia.com/cuda.runtime.major": lambda a: f"{a}.cudaDriverVersion.major()",
    "nvidia.com/cuda.runtime.minor": lambda a: f"{a}.cudaDriverVersion.minor()",
}
_VERSION_ATTRS = {"nvidia.com/cuda.driver-version.full": "driverVersion",
                  "nvidia.com/cuda.runtime-version.full": "cudaDriverVersion"}
# label -> (capacity, unit suffix of the label's number)
_CAPACITIES = {
    "nvidia.com/gpu.memory": ("memory", "Mi"),
    "nvidia.com/gpu.multiprocessors": ("multiprocessors", ""),
    "nvidia.com/gpu.engines.copy": ("copyEngines", ""),
    "nvidia.com/gpu.engines.decoder": ("decoders", ""),
    "nvidia.com/gpu.engines.encoder": ("encoders", ""),
    "nvidia.com/gpu.engines.jpeg": ("jpegEngines", ""),
    "nvidia.com/gpu.engines.ofa": ("ofaEngines", ""),
}
_MIG_LABEL = re.compile(r"^nvidia\.com/mig-(?P<profile>[0-9a-z.+-]+?)\.(?P<what>count|product|memory|replicas|"
                        r"sharing-strategy|multiprocessors|slices\.gi|slices\.ci|engines\.[a-z]+)$")
_PRODUCT_MIG = re.compile(r"^(?P<product>.+)-MIG-(?P<profile>\d+(?:c\.\d+)?g\.\d+gb.*)$")
OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str
    values: tuple[str, ...] = ()

    def text(self) -> str:
        return f"{self.key} {self.operator} {list(self.values)}" if self.values else f"{self.key} {self.operator}"


@dataclass(frozen=True)
class Translation:
    """One requirement, translated. ``cel`` uses ``{A}`` / ``{C}`` for the driver's attributes / capacities.
    ``kind``/``profile``/``sharing`` say what the label implies about the device (a slot, a MIG profile).
    ``node_label``: the requirement stays on the node; ``problem``: why it cannot be translated."""

    cel: str | None = None
    kind: str | None = None            # "mig" or "slot"
    profile: str | None = None
    sharing: str | None = None         # "time-slicing" | "mps" | "shared" (a -SHARED product, strategy unknown)
    node_label: bool = False
    problem: str | None = None
    capacity: str | None = None        # the capacity it compares, when one


def is_nvidia_label(key: str) -> bool:
    return key.startswith(GFD_PREFIX)


def quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _in(expr: str, literals: list[str]) -> str:
    return f"{expr} == {literals[0]}" if len(literals) == 1 else f"{expr} in [{', '.join(literals)}]"


def _ints(values: tuple[str, ...]) -> list[int] | None:
    try:
        return [int(v) for v in values]
    except ValueError:
        return None


def semver(text: str) -> str | None:
    """GFD's version text (``580.95.05``, ``13.0``) as the semver this driver publishes (``580.95.5``)."""
    parts = text.split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    return ".".join(str(int(p)) for p in parts + ["0"] * (3 - len(parts)))


def _compare(expr: str, req: Requirement, literal: Callable[[str], str | None], equal: Callable[[str, str], str],
             order: Callable[[str, str], str] | None) -> Translation:
    """A requirement on a comparable value: ``equal(expr, lit)`` per value; ``order(expr, lit)`` for Gt and Lt,
    with ``{op}`` where the comparison goes."""
    lits = [literal(v) for v in req.values]
    if None in lits:
        return Translation(problem=f"value {list(req.values)} is not a number or version")
    ok = [x for x in lits if x is not None]
    if req.operator in ("In", "NotIn"):
        any_of = " || ".join(equal(expr, x) for x in ok)
        any_of = f"({any_of})" if len(ok) > 1 else any_of
        return Translation(cel=any_of if req.operator == "In" else f"!({any_of})")
    if req.operator in ("Gt", "Lt") and order is not None and len(ok) == 1:
        return Translation(cel=order(expr, ok[0]).replace("{op}", ">" if req.operator == "Gt" else "<"))
    return Translation(problem=f"operator {req.operator} has no CEL translation for this label")


def translate(req: Requirement) -> Translation:
    """The CEL (or why none) for one requirement on an ``nvidia.com/`` label."""
    key, op, values = req.key, req.operator, req.values
    if op not in OPERATORS:
        return Translation(problem=f"unknown operator {op!r}")
    if key in NODE_LABELS or key.startswith(NODE_LABEL_PREFIXES):
        return Translation(node_label=True)
    if key in NO_EQUIVALENT:
        return Translation(problem=NO_EQUIVALENT[key])
    for prefix, why in NO_EQUIVALENT_PREFIXES.items():
        if key.startswith(prefix):
            return Translation(problem=why)
    if op == "DoesNotExist":
        return Translation(problem="asks for nodes without GPUs, but the workload asks for a GPU device")
    if op == "Exists":
        mig = _MIG_LABEL.match(key)
        if mig:
            return Translation(kind="mig", profile=profile_from_resource(mig.group("profile")))
        return Translation()  # every device of this driver has the attribute: no selector needed
    if key in _STR_ATTRS:
        if op not in ("In", "NotIn"):
            return Translation(problem=f"operator {op} compares numbers; {key} is a name")
        expr = "{A}." + _STR_ATTRS[key]
        cel = _in(expr, [quote(v) for v in values])
        return Translation(cel=cel if op == "In" else f"!({cel})")
    if key == "nvidia.com/gpu.product":
        return _product(req)
    if key == "nvidia.com/gpu.sharing-strategy":
        if op != "In" or len(values) != 1 or values[0] not in ("none", "time-slicing", "mps"):
            return Translation(problem="only one of none, time-slicing, mps with In (or a nodeSelector) translates")
        if values[0] == "none":
            return Translation(cel="{A}.sharing == 'none'")
        return Translation(cel=f"{{A}}.sharing == {quote(values[0])}", kind="slot", sharing=values[0])
    if key == "nvidia.com/mig.capable":
        if op != "In" or len(values) != 1 or values[0] not in ("true", "false"):
            return Translation(problem="only In [true] or In [false] translates")
        return Translation(cel="{A}.migCapable" if values[0] == "true" else "!{A}.migCapable")
    if key in _INT_EXPRS:
        expr = _INT_EXPRS[key]("{A}")
        return _compare(expr, req, lambda v: str(int(v)) if v.isdigit() else None,
                        lambda e, x: f"{e} == {x}", lambda e, x: f"{e} {{op}} {x}")
    if key in _VERSION_ATTRS:
        expr = "{A}." + _VERSION_ATTRS[key]
        return _compare(expr, req, lambda v: (f"semver('{s}')" if (s := semver(v)) else None),
                        lambda e, x: f"{e}.compareTo({x}) == 0", lambda e, x: f"{e}.compareTo({x}) {{op}} 0")
    if key in _CAPACITIES:
        cap, unit = _CAPACITIES[key]
        expr = "{C}." + cap
        t = _compare(expr, req, lambda v: f"quantity('{v}{unit}')" if v.isdigit() else None,
                     lambda e, x: f"{e}.compareTo({x}) == 0", lambda e, x: f"{e}.compareTo({x}) {{op}} 0")
        return Translation(cel=t.cel, problem=t.problem, capacity=cap)
    mig = _MIG_LABEL.match(key)
    if mig:
        profile = profile_from_resource(mig.group("profile"))
        if mig.group("what") == "count" and ((op == "Gt" and values == ("0",)) or
                                             (op == "In" and all(v.isdigit() and int(v) > 0 for v in values))):
            return Translation(kind="mig", profile=profile)
        if mig.group("what") == "product" and op == "In":
            return Translation(kind="mig", profile=profile)
        return Translation(problem=f"only a positive count or the product of {key} translates (to the MIG profile)")
    return Translation(problem="not a GPU Feature Discovery label this driver has an attribute for")


def profile_from_resource(label_profile: str) -> str:
    """``1g.5gb.me`` (the device plugin's resource and label spelling) -> ``1g.5gb+me``."""
    return re.sub(r"\.(me(?:\.all)?|gfx)$", r"+\1", label_profile)


def _product(req: Requirement) -> Translation:
    """GFD writes NVML's name with spaces as dashes; a shared, not renamed GPU gets ``-SHARED``, a MIG device
    under the single strategy ``-MIG-<profile>``."""
    if req.operator not in ("In", "NotIn"):
        return Translation(problem=f"operator {req.operator} compares numbers; the product is a name")
    names, sharing, profile = [], None, None
    for v in req.values:
        if v.endswith("-SHARED"):
            v, sharing = v[: -len("-SHARED")], "shared"
        m = _PRODUCT_MIG.match(v)
        if m:
            v, profile = m.group("product"), m.group("profile")
        names.append(quote(v))
    if req.operator == "NotIn" and (sharing or profile):
        return Translation(problem="NotIn on a -SHARED or -MIG- product has no device translation")
    cel = _in("{A}.productName.replace(' ', '-')", names)
    return Translation(cel=cel if req.operator == "In" else f"!({cel})", kind="mig" if profile else
                       ("slot" if sharing else None), profile=profile, sharing=sharing)


def render(cel: str, driver: str) -> str:
    return cel.replace("{A}", f"device.attributes['{driver}']").replace("{C}", f"device.capacity['{driver}']")
