"""The ResourceClaimTemplate (or, for a claim pods share by name, the ResourceClaim) that asks for the advised
device through the driver's DeviceClasses, ready for ``kubectl apply``. Pure.

A template's spec cannot be changed once created, so the advice is a new object beside the old one: a copy of it
(its other requests and their configs as they were) under a new name, with each advised request asking for its
device on the GPU model it ran on; and the change that points the workload at it (a JSON patch of its pod
template, or, for a Job or a bare pod whose template cannot change, what to create again).
"""
from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from api.deviceclasses import device_classes, selector
from api.k8snames import is_dns_subdomain
from api.names import CONFIG_API_VERSION, NVIDIA_DRIVER_NAME
from api.quantity import format_bytes
from dra.model.devices import profile_slug
from ops.advise.advice import Advice
from ops.advise.owners import ClaimSource, Workload
from ops.advise.sizing import KIND_GPU, KIND_MIG, KIND_SHARE, KIND_SLOT, Candidate

RESOURCE_API_VERSION = "resource.k8s.io/v1"
_DEVICE_TYPE = {KIND_GPU: "gpu", KIND_MIG: "mig", KIND_SLOT: "slot", KIND_SHARE: "shared"}


@dataclass(frozen=True)
class Emitted:
    """One object to apply, the lines that say why (as YAML comments), and how to point the workload at it."""

    obj: dict[str, Any]
    resource: str               # resourceclaimtemplates | resourceclaims
    why: list[str]
    switch: str


def class_name(driver: str, device_type: str) -> str:
    """The driver's DeviceClass for ``device_type``, as api.deviceclasses names it (NVIDIA's names in
    compatibility mode)."""
    compat = driver == NVIDIA_DRIVER_NAME
    wanted = selector(driver, device_type)
    for cls in device_classes(driver, compat_nvidia=compat):
        if cls["spec"]["selectors"][0]["cel"]["expression"] == wanted:
            return str(cls["metadata"]["name"])
    raise ValueError(f"no DeviceClass of {driver} for devices of type {device_type!r}")


def slug(c: Candidate) -> str:
    if c.kind == KIND_MIG:
        return profile_slug(c.profile)
    if c.kind == KIND_SLOT:
        return "mps-slot" if c.slots == 1 else f"mps-{c.slots}-slots"
    if c.kind == KIND_SHARE:
        return f"share-{format_bytes(c.memory_bytes).lower()}"
    return "gpu"


def _cel(driver: str, product: str, c: Candidate) -> str:
    a = f"device.attributes['{driver}']"
    quoted = "'" + product.replace("\\", "\\\\").replace("'", "\\'") + "'"
    terms = [f"{a}.productName == {quoted}"]
    if c.kind == KIND_MIG:
        terms.append(f"{a}.profile == '{c.profile}'")
    elif c.kind == KIND_SLOT:
        terms.append(f"{a}.sharing == 'mps'")
    elif c.kind == KIND_SHARE:
        terms.append(f"{a}.sharing == '{c.share_strategy}'")
    return " && ".join(terms)


def device_request(name: str, c: Candidate, driver: str, product: str,
                   old: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A request for one device like ``c`` (as many as ``old`` asked for, with its tolerations)."""
    old_exactly: Mapping[str, Any] = ((old or {}).get("exactly")
                                      or next(iter((old or {}).get("firstAvailable") or []), None) or {})
    exactly: dict[str, Any] = {"deviceClassName": class_name(driver, _DEVICE_TYPE[c.kind])}
    if int(old_exactly.get("count") or 1) > 1:
        exactly["count"] = int(old_exactly["count"])
    exactly["selectors"] = [{"cel": {"expression": _cel(driver, product, c)}}]
    if c.kind == KIND_SHARE:
        exactly["capacity"] = {"requests": {"memory": format_bytes(c.memory_bytes)}}
    elif c.kind == KIND_SLOT and c.slot_capacity and c.slots > 1:
        exactly["capacity"] = {"requests": {"slots": str(c.slots)}}
    if old_exactly.get("tolerations"):
        exactly["tolerations"] = copy.deepcopy(old_exactly["tolerations"])
    return {"name": name, "exactly": exactly}


def device_config(request: str, c: Candidate, driver: str) -> dict[str, Any] | None:
    """The opaque config the device needs: an MPS slot's thread percentage, said outright."""
    if c.kind != KIND_SLOT:
        return None
    return {"requests": [request], "opaque": {"driver": driver, "parameters": {
        "apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": c.thread_percentage}}}}}


def devices_with(old: Mapping[str, Any] | None, advised: Mapping[str, tuple[Candidate, str]],
                 driver: str) -> dict[str, Any]:
    """A claim spec's ``devices``: ``old``'s, each request of ``advised`` (request → (candidate, product))
    replaced, the configs of those requests dropped and theirs added."""
    devices = copy.deepcopy(dict((old or {}).get("devices") or {}))
    requests = [r for r in devices.get("requests") or [] if isinstance(r, dict)]
    names = [str(r.get("name", "")) for r in requests]
    out = []
    for r in requests:
        name = str(r.get("name", ""))
        if name in advised:
            c, product = advised[name]
            r = device_request(name, c, driver, product, r)
        out.append(r)
    for name, (c, product) in advised.items():
        if name not in names:
            out.append(device_request(name, c, driver, product))
    devices["requests"] = out
    configs = []
    others = [str(r["name"]) for r in out if r.get("name") not in advised]
    for entry in devices.get("config") or []:
        named = entry.get("requests")
        if not named:        # it applied to every request: now only to the ones not advised
            if others:
                configs.append({**entry, "requests": list(others)})
            continue
        kept = [n for n in named if n not in advised]
        if kept:
            configs.append({**entry, "requests": kept})
    configs += [cfg for name, (c, _) in advised.items() if (cfg := device_config(name, c, driver)) is not None]
    if configs:
        devices["config"] = configs
    else:
        devices.pop("config", None)
    return devices


def new_name(base: str, advices: Sequence[Advice]) -> str:
    slugs = sorted({slug(a.recommendation) for a in advices if a.recommendation is not None})
    tail = slugs[0] if len(slugs) == 1 else "advised"
    name = f"{base[:253 - len(tail) - 1]}-{tail}"
    if not is_dns_subdomain(name):
        raise ValueError(f"cannot name the advised object after {base!r}: {name!r} is not a Kubernetes name")
    return name


def emit(workload: Workload, source: ClaimSource | None, existing: Mapping[str, Any] | None,
         advices: Sequence[Advice], driver: str) -> Emitted:
    """The object for the advised requests of one workload's template (or claim)."""
    advised: dict[str, tuple[Candidate, str]] = {}
    for a in advices:
        c = a.recommendation
        # A request that ran on two GPU models has advice for each: one template asks for one, the larger.
        before = advised.get(a.group.request)
        if c is not None and (before is None or c.memory_bytes > before[0].memory_bytes):
            advised[a.group.request] = (c, a.group.model)
    kind = source.kind if source is not None else "ResourceClaimTemplate"
    base = source.name if source is not None else f"{workload.name}-{'-'.join(sorted(advised))}"
    name = new_name(base, advices)
    meta: dict[str, Any] = {"name": name, "namespace": workload.namespace}
    labels = ((existing or {}).get("metadata") or {}).get("labels")
    if labels:
        meta["labels"] = copy.deepcopy(labels)
    old_spec = (existing or {}).get("spec") or {}
    if kind == "ResourceClaimTemplate":
        spec: dict[str, Any] = {"spec": {**copy.deepcopy(dict(old_spec.get("spec") or {})),
                                         "devices": devices_with(old_spec.get("spec"), advised, driver)}}
        resource = "resourceclaimtemplates"
    else:
        spec = {**copy.deepcopy(dict(old_spec)), "devices": devices_with(old_spec, advised, driver)}
        resource = "resourceclaims"
    obj = {"apiVersion": RESOURCE_API_VERSION, "kind": kind, "metadata": meta, "spec": spec}
    why = [f"{workload.namespace}/{workload.ref} request {a.group.request} on {a.group.model}: {a.why}"
           for a in advices]
    return Emitted(obj, resource, why, switch_hint(workload, source, kind, name))


def switch_hint(workload: Workload, source: ClaimSource | None, kind: str, name: str) -> str:
    """How to make the workload use the new object."""
    field = "resourceClaimTemplateName" if kind == "ResourceClaimTemplate" else "resourceClaimName"
    if source is None:
        return f"then give {workload.namespace}/{workload.ref} a pod claim entry with {field}: {name}"
    if workload.patchable and workload.spec_path:
        patch = json.dumps([{"op": "replace", "path": f"{workload.spec_path}/resourceClaims/{source.index}/{field}",
                             "value": name}])
        return f"then: kubectl -n {workload.namespace} patch {workload.ref} --type=json -p '{patch}'"
    return (f"then create {workload.namespace}/{workload.ref} again with resourceClaims[{source.index}] "
            f"({source.entry}) {field}: {name} (its pod template cannot be changed)")
