"""Which opaque config applies to a request: the precedence rules over a claim's allocation config.

The scheduler copies the configs of the DeviceClasses (source FromClass) and of the claim (FromClaim)
into `status.allocation.devices.config`; each entry may name the requests it is for. For one request:

1. claim configs win over class configs;
2. within one source, a config naming the request wins over one naming its parent request (for
   "gpu/h200", an entry for "gpu"), which wins over a config for all requests;
3. otherwise the later entry wins.

Entries for other drivers, and entries without an opaque part, are ignored. With `device_type`, a config
for all requests applies only when its kind fits the device (a general GpuConfig does not configure a MIG
device); a config naming the request is returned whatever its kind, and decoding then rejects a mismatch.

The scheduler (1.37) clears `requests` of a claim config that names every request of the claim, which would
turn a config the user aimed at a request into one for all requests: `restore_claim_request_scopes` puts the
claim's own `requests` back before these rules are applied.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from api.config.decode import CONFIG_KIND_FOR_DEVICE_TYPE
from api.names import DEFAULT_DRIVER_NAME

Source = Literal["FromClass", "FromClaim"]
_SOURCE_RANK: dict[str, int] = {"FromClass": 0, "FromClaim": 1}


@dataclass(frozen=True)
class ConfigEntry:
    """The config that applies: where it came from, its position in that list, and its opaque parameters.

    Devices whose effective entry is the same (source, position) share one config object, e.g. one MPS
    control daemon.
    """

    source: Source
    position: int
    requests: tuple[str, ...]
    parameters: Any


def _specificity(requests: Sequence[str], request: str) -> int | None:
    """2: names the request, 1: names its parent request, 0: for all requests, None: not for this request."""
    if not requests:
        return 0
    if request in requests:
        return 2
    parent = request.split("/", 1)[0]
    if parent != request and parent in requests:
        return 1
    return None


def _candidates(source: Source, configs: Iterable[Mapping[str, Any]], driver_name: str) -> Iterable[ConfigEntry]:
    for position, entry in enumerate(configs):
        opaque = entry.get("opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver_name:
            continue
        yield ConfigEntry(source, position, tuple(entry.get("requests") or ()), opaque.get("parameters"))


def merge_configs(class_configs: Iterable[Mapping[str, Any]], claim_configs: Iterable[Mapping[str, Any]],
                  request: str, *, driver_name: str = DEFAULT_DRIVER_NAME,
                  device_type: str | None = None) -> ConfigEntry | None:
    """The effective config entry for `request` ("gpu" or "gpu/h200"), or None when no config applies.

    Entries are wire-format dicts `{requests?: [...], opaque: {driver, parameters}}` (DeviceClass
    `spec.config` items or allocation config items).
    """
    return _pick([*_candidates("FromClass", class_configs, driver_name),
                  *_candidates("FromClaim", claim_configs, driver_name)], request, device_type)


def merge_allocation_configs(allocation_configs: Iterable[Mapping[str, Any]], request: str, *,
                             driver_name: str = DEFAULT_DRIVER_NAME,
                             device_type: str | None = None) -> ConfigEntry | None:
    """merge_configs over `status.allocation.devices.config`, split by each entry's `source`.

    Positions in the result index `allocation_configs` itself.
    """
    entries = list(allocation_configs)
    candidates = []
    for source in ("FromClass", "FromClaim"):
        for c in _candidates(source, entries, driver_name):
            if entries[c.position].get("source") == source:
                candidates.append(c)
    return _pick(candidates, request, device_type)


def restore_claim_request_scopes(allocation_configs: Iterable[Mapping[str, Any]],
                                 claim_configs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`status.allocation.devices.config` with each FromClaim entry's `requests` as the claim spec wrote them.

    The scheduler copies the claim's configs in order, leaving out configs only for sub-requests it did not
    pick, and empties `requests` when a config names every request ("empty means all"). That loses the
    difference between "for this request" (applies whatever its kind; a mismatch is an error) and "for all
    requests" (applies only where its kind fits), and the precedence of the first over the second. Entries
    are matched to `spec.devices.config` in order by their `opaque` part; unmatched entries stay as they are.
    Positions are unchanged, so they still index the allocation's list.
    """
    spec = list(claim_configs)
    out: list[dict[str, Any]] = []
    next_spec = 0
    for entry in allocation_configs:
        entry = dict(entry)
        if entry.get("source") == "FromClaim":
            match = next((k for k in range(next_spec, len(spec)) if spec[k].get("opaque") == entry.get("opaque")),
                         None)
            if match is not None:
                next_spec = match + 1
                if not entry.get("requests") and spec[match].get("requests"):
                    entry["requests"] = list(spec[match]["requests"])
        out.append(entry)
    return out


def _pick(candidates: list[ConfigEntry], request: str, device_type: str | None) -> ConfigEntry | None:
    wanted_kind = CONFIG_KIND_FOR_DEVICE_TYPE.get(device_type) if device_type else None
    best: tuple[tuple[int, int, int], ConfigEntry] | None = None
    for entry in candidates:
        specificity = _specificity(entry.requests, request)
        if specificity is None:
            continue
        if specificity == 0 and device_type is not None:
            kind = entry.parameters.get("kind") if isinstance(entry.parameters, Mapping) else None
            if kind != wanted_kind:
                continue
        key = (_SOURCE_RANK[entry.source], specificity, entry.position)
        if best is None or key > best[0]:
            best = (key, entry)
    return best[1] if best else None
