"""A ResourceClaim spec read as the scheduler reads it: requests with their alternatives (`exactly`, or the
`firstAvailable` subrequests in order), tolerations, capacity requests and constraints. Plain dicts in."""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from api.quantity import quantity_value
from dra.scheduling.devicefit import format_amount

ALL = "All"
EXACT_COUNT = "ExactCount"


@dataclass(frozen=True)
class Alternative:
    """One way to satisfy a request: the request itself (`exactly`) or one firstAvailable subrequest."""

    request: str                        # "gpu", or "gpu/h100" for a subrequest
    device_class: str
    selectors: tuple[str, ...]
    mode: str = EXACT_COUNT
    count: int = 1
    admin_access: bool = False
    tolerations: tuple[dict[str, Any], ...] = ()
    capacity: tuple[tuple[str, Fraction], ...] = ()    # capacity.requests, in the claim's spelling

    def describe(self) -> str:
        amount = "all matching devices" if self.mode == ALL else f"{self.count} device{'s' * (self.count != 1)}"
        extras = [f"{n} {format_amount(v)}" for n, v in self.capacity]
        if self.admin_access:
            extras.append("admin access")
        return f"{amount} of class {self.device_class}" + (f" ({', '.join(extras)})" if extras else "")


@dataclass(frozen=True)
class Request:
    name: str
    alternatives: tuple[Alternative, ...]


@dataclass(frozen=True)
class Constraint:
    requests: tuple[str, ...]           # empty: every request
    match_attribute: str | None = None
    distinct_attribute: str | None = None

    def applies_to(self, request: str) -> bool:
        """A constraint naming "gpu" covers its subrequests "gpu/<sub>" too."""
        return not self.requests or request in self.requests or request.split("/", 1)[0] in self.requests


@dataclass
class ClaimSpec:
    requests: list[Request] = field(default_factory=list)
    constraints: list[Constraint] = field(default_factory=list)


class ClaimSpecError(ValueError):
    """A claim spec this reader cannot follow; the message names the field."""


def _alternative(name: str, body: dict[str, Any], admin_ok: bool) -> Alternative:
    if not body.get("deviceClassName"):
        raise ClaimSpecError(f"request {name}: no deviceClassName")
    selectors = tuple(str((s.get("cel") or {}).get("expression", "")) for s in body.get("selectors") or [])
    mode = body.get("allocationMode") or EXACT_COUNT
    if mode not in (ALL, EXACT_COUNT):
        raise ClaimSpecError(f"request {name}: allocationMode {mode!r} is not ExactCount or All")
    count = int(body.get("count") or 1)
    capacity = tuple((n, quantity_value(str(v)))
                     for n, v in sorted(((body.get("capacity") or {}).get("requests") or {}).items()))
    return Alternative(name, str(body["deviceClassName"]), selectors, mode, count,
                       bool(body.get("adminAccess")) and admin_ok, tuple(body.get("tolerations") or ()), capacity)


def read_claim_spec(spec: dict[str, Any]) -> ClaimSpec:
    """The requests and constraints of a ResourceClaimSpec (`spec` of a claim, `spec.spec` of a template)."""
    devices = (spec or {}).get("devices") or {}
    out = ClaimSpec()
    for req in devices.get("requests") or []:
        name = str(req.get("name", ""))
        if req.get("firstAvailable"):
            alts = tuple(_alternative(f"{name}/{sub.get('name', '')}", sub, False) for sub in req["firstAvailable"])
        elif req.get("exactly") is not None:
            alts = (_alternative(name, req["exactly"], True),)
        else:
            raise ClaimSpecError(f"request {name}: neither exactly nor firstAvailable")
        out.requests.append(Request(name, alts))
    for c in devices.get("constraints") or []:
        out.constraints.append(Constraint(tuple(c.get("requests") or ()), c.get("matchAttribute"),
                                          c.get("distinctAttribute")))
    return out
