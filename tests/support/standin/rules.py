"""The checks the kubelet applies to a plugin's NodePrepareResources / NodeUnprepareResources answers.

Pure functions over plain records, so they can be tested without gRPC. A *violation* is an answer the kubelet
would reject as a whole (a plugin bug); a per-claim ``error`` string is a legitimate outcome and is not a
violation.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it on the wire: exactly these three fields."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class AllocatedDevice:
    """One ``status.allocation.devices.results[]`` entry of a ResourceClaim."""

    request: str            # "gpu" or "gpu/h100" (firstAvailable sub-request)
    driver: str
    pool: str
    device: str
    share_id: str | None = None

    @property
    def base_request(self) -> str:
        return self.request.split("/", 1)[0]


@dataclass(frozen=True)
class PreparedDevice:
    """One ``Device`` of a NodePrepareResourceResponse, as plain data."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True)
class ClaimOutcome:
    """What the plugin answered for one claim: devices, or an error message."""

    claim: ClaimRef
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


class ProtocolViolation(AssertionError):
    """The plugin's answer breaks a rule the kubelet enforces; ``violations`` lists each broken rule."""

    def __init__(self, method: str, violations: Sequence[str]):
        self.method = method
        self.violations = list(violations)
        super().__init__(f"{method}: " + "; ".join(self.violations))


# CDI names (CDI spec "Naming"): vendor and class start with a letter, end with a letter or digit and
# contain letters, digits, '_', '-', '.'; the device name starts and ends with a letter or digit and may
# also contain '_', '-', '.', ':'.
_CDI_VENDOR = r"[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?"
_CDI_CLASS = _CDI_VENDOR
_CDI_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?"
CDI_DEVICE_ID = re.compile(rf"^(?P<vendor>{_CDI_VENDOR})/(?P<class_>{_CDI_CLASS})=(?P<name>{_CDI_NAME})$")


def cdi_id_problem(cdi_id: str) -> str | None:
    """Why ``cdi_id`` is not a fully-qualified CDI device name, or None when it is one."""
    if not cdi_id:
        return "empty CDI device ID"
    if not CDI_DEVICE_ID.match(cdi_id):
        return f"CDI device ID {cdi_id!r} is not of the form vendor/class=name"
    vendor, rest = cdi_id.split("/", 1)
    class_ = rest.split("=", 1)[0]
    if len(vendor) > 253 or len(class_) > 63:
        return f"CDI device ID {cdi_id!r}: vendor longer than 253 or class longer than 63 characters"
    return None


def _answered_keys(requested: Sequence[ClaimRef], answered: Iterable[str], method: str) -> list[str]:
    """The kubelet's map rules: every requested UID answered, no unknown UIDs."""
    problems = []
    wanted = {c.uid for c in requested}
    answered = set(answered)
    for uid in sorted(answered - wanted):
        problems.append(f"{method} returned a result for unknown claim UID {uid!r}")
    missing = [c for c in requested if c.uid not in answered]
    if missing:
        names = ", ".join(f"{c.namespace}/{c.name} ({c.uid})" for c in missing)
        problems.append(f"{method} skipped {len(missing)} ResourceClaims: {names}")
    return problems


def check_prepare_response(
    requested: Sequence[ClaimRef],
    answered: Mapping[str, ClaimOutcome],
    allocations: Mapping[str, Sequence[AllocatedDevice]] | None = None,
    *,
    with_share_id: bool = True,
) -> list[str]:
    """Violations in a NodePrepareResources answer (``answered`` is keyed by claim UID).

    ``allocations`` (claim UID -> this driver's allocation results) enables the device checks: every device
    must be an allocated (pool, device[, shareID]) of that claim and name only requests it was allocated for.
    ``with_share_id`` is False for v1beta1, whose Device has no share_id field.
    """
    problems = _answered_keys(requested, answered.keys(), "NodePrepareResources")
    for uid, outcome in sorted(answered.items()):
        if outcome.error:
            continue  # the kubelet ignores devices of a failed claim
        allocated = None if allocations is None else list(allocations.get(uid, ()))
        seen: set[tuple[str, str, str | None]] = set()
        for dev in outcome.devices:
            where = f"claim {uid} device {dev.pool_name}/{dev.device_name}"
            problems.extend(_device_problems(dev, where, allocated, with_share_id))
            key = (dev.pool_name, dev.device_name, dev.share_id)
            if key in seen:
                problems.append(f"{where}: listed twice")
            seen.add(key)
    return problems


def _device_problems(
    dev: PreparedDevice, where: str, allocated: list[AllocatedDevice] | None, with_share_id: bool
) -> list[str]:
    problems = []
    if not dev.pool_name:
        problems.append(f"{where}: pool_name is empty")
    if not dev.device_name:
        problems.append(f"{where}: device_name is empty")
    for cdi_id in dev.cdi_device_ids:
        problem = cdi_id_problem(cdi_id)
        if problem:
            problems.append(f"{where}: {problem}")
    for name in dev.request_names:
        if not name:
            problems.append(f"{where}: empty request name")
        elif "/" in name:
            problems.append(f"{where}: request name {name!r} must be the base request (no /sub-request)")
    if allocated is None:
        return problems
    matches = [a for a in allocated if a.pool == dev.pool_name and a.device == dev.device_name]
    if not matches:
        problems.append(f"{where}: not allocated to this claim for this driver")
        return problems
    if with_share_id:
        if not any(a.share_id == dev.share_id for a in matches):
            allocated_ids = sorted(str(a.share_id) for a in matches)
            problems.append(f"{where}: share_id {dev.share_id!r} does not match the allocation ({', '.join(allocated_ids)})")
        matches = [a for a in matches if a.share_id == dev.share_id] or matches
    allowed = {a.base_request for a in matches}
    for name in dev.request_names:
        if name and "/" not in name and name not in allowed:
            problems.append(f"{where}: request {name!r} was not allocated this device (allocated for {sorted(allowed)})")
    return problems


def check_unprepare_response(requested: Sequence[ClaimRef], answered: Iterable[str]) -> list[str]:
    """Violations in a NodeUnprepareResources answer (only the UIDs matter; errors are outcomes)."""
    return _answered_keys(requested, answered, "NodeUnprepareResources")


def cdi_ids_for_container(
    container_claims: Sequence[Mapping[str, str]],
    pod_claim_devices: Mapping[str, Sequence[PreparedDevice]],
) -> list[str]:
    """The CDI IDs the kubelet hands the runtime for one container.

    ``container_claims`` is the container's ``resources.claims`` ([{name, request?}]); ``pod_claim_devices``
    maps a pod-level claim name to the prepared devices of its ResourceClaim. A device goes to the container
    when the container names no request, the device names no request, or the device names that request.
    """
    ids: list[str] = []
    for ref in container_claims:
        request = ref.get("request") or ""
        for dev in pod_claim_devices.get(ref["name"], ()):
            if not request or not dev.request_names or request in dev.request_names:
                for cdi_id in dev.cdi_device_ids:
                    if cdi_id not in ids:
                        ids.append(cdi_id)
    return ids
