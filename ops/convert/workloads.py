"""Workloads written for the device plugin -> the same workloads with a ResourceClaimTemplate.

A container's ``nvidia.com/gpu: N`` (``nvidia.com/gpu.shared``, ``nvidia.com/mig-<profile>``) becomes a request
for N devices of the class that gives what the old setup gave: a whole GPU, a slot of the node group's sharing
strategy, or a MIG device of that profile. Its GFD node selectors become CEL selectors of each request; the rest
of the workload is copied as it is. The pod gets one claim (``gpus``) from the template, and each container its
own requests of it. With ``extended_resource`` (NVIDIA compatibility mode, whose DeviceClass ``gpu.nvidia.com``
serves ``nvidia.com/gpu`` through DRA), whole-GPU requests without selectors stay as they are.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from api.deviceclasses import device_classes
from api.k8snames import is_dns_label
from api.names import NVIDIA_DRIVER_NAME
from ops.convert import gfdselectors as gfd
from ops.convert.deviceplugin import GPU_RESOURCE, SHARED_SUFFIX, Meaning
from ops.convert.findings import Findings
from ops.convert.nodegroups import DP_LABEL, MIG_LABEL, NodeGroup

CLAIM_NAME = "gpus"
_TEMPLATE_PATHS = {
    "Pod": ("spec",),
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
}
_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


@dataclass
class WorkloadOptions:
    driver: str
    groups: list[NodeGroup] = field(default_factory=list)
    extended_resource: bool = False


def class_names(driver: str) -> dict[str, str]:
    """Device type -> the DeviceClass of this driver that selects it (NVIDIA's names in compatibility mode)."""
    classes = device_classes(driver, compat_nvidia=driver == NVIDIA_DRIVER_NAME)
    names: dict[str, str] = {}
    for cls in classes:
        expression = cls["spec"]["selectors"][0]["cel"]["expression"]
        for kind in ("gpu", "mig", "slot", "shared"):
            if expression.endswith(f".type == '{kind}'"):
                names.setdefault(kind, cls["metadata"]["name"])
    return names


def is_gpu_resource(name: str) -> bool:
    return name in (GPU_RESOURCE, GPU_RESOURCE + SHARED_SUFFIX) or name.startswith("nvidia.com/mig-")


def convert_objects(objects: list[tuple[str, dict[str, Any]]], opts: WorkloadOptions,
                    f: Findings) -> list[dict[str, Any]]:
    """(source file, object) pairs -> the objects to apply, templates before the workloads that use them."""
    out: list[dict[str, Any]] = []
    for where, obj in objects:
        if obj.get("kind") == "List":
            out += convert_objects([(where, item) for item in obj.get("items") or []], opts, f)
            continue
        out += convert_workload(where, obj, opts, f)
    return out


def _source(where: str, obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')} {(obj.get('metadata') or {}).get('name', '?')} ({where})"


def convert_workload(where: str, obj: dict[str, Any], opts: WorkloadOptions, f: Findings) -> list[dict[str, Any]]:
    src = _source(where, obj)
    path = _TEMPLATE_PATHS.get(str(obj.get("kind")))
    if path is None:
        f.kept(src, "", "kept as it is: no pod template")
        return [obj]
    out = copy.deepcopy(obj)
    spec: Any = out
    for key in path:
        spec = spec.get(key) if isinstance(spec, dict) else None
    if not isinstance(spec, dict):
        f.kept(src, ".".join(path), "kept as it is: no pod spec")
        return [out]
    prefix = ".".join(path)
    converter = _PodConverter(src, prefix, spec, opts, f)
    try:
        template = converter.run(_template_name(out))
    except _Refused as exc:
        f.refused(src, exc.path, f"{exc.reason}; the workload is not written")
        return []
    if template is None:
        return [out]
    namespace = (out.get("metadata") or {}).get("namespace")
    if namespace:
        template["metadata"]["namespace"] = namespace
    return [template, out]


def _template_name(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    base = str(meta.get("name") or meta.get("generateName") or "workload").rstrip("-")
    return f"{base[:240]}-{CLAIM_NAME}"


class _Refused(Exception):
    """A workload that is not converted: the device plugin (or the API server) refused it, or nothing here would
    serve it; converting it would change what runs."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(reason)
        self.path, self.reason = path, reason


@dataclass
class _Ask:
    path: str                 # the container's path
    container: dict[str, Any]
    resource: str
    count: int
    init: bool                # an init container that runs before the app containers (not a sidecar)


@dataclass
class _Translated:
    req: gfd.Requirement
    path: str
    t: gfd.Translation


class _PodConverter:
    def __init__(self, src: str, prefix: str, spec: dict[str, Any], opts: WorkloadOptions, f: Findings) -> None:
        self.src, self.prefix, self.spec, self.opts, self.f = src, prefix, spec, opts, f

    # ---- GPU resources ----------------------------------------------------------------------------

    def _gpu_asks(self) -> list[_Ask]:
        """Every GPU resource of every container, checked as the API server checks extended resources."""
        asks = []
        for group in ("initContainers", "containers"):
            for i, c in enumerate(self.spec.get(group) or []):
                res = c.get("resources") or {}
                limits, reqs = res.get("limits") or {}, res.get("requests") or {}
                names = sorted({n for n in (*limits, *reqs) if gfd.is_nvidia_label(n)})
                cpath = f"{self.prefix}.{group}[{i}]"
                for n in names:
                    where = f"{cpath}.resources.limits.{n}"
                    if not is_gpu_resource(n):
                        self.f.refused(self.src, where, "not a GPU resource of the device plugin; kept as it is")
                        continue
                    if n not in limits:
                        raise _Refused(f"{cpath}.resources.requests.{n}", f"{n} in requests without limits: the "
                                       "API server refuses this pod (an extended resource needs limits)")
                    raw = limits[n]
                    if n in reqs and str(reqs[n]) != str(raw):
                        raise _Refused(where, f"requests {reqs[n]!r} != limits {raw!r}: the API server refuses "
                                              "this pod (an extended resource's requests must equal its limits)")
                    text = str(raw)
                    if not text.isdigit():
                        raise _Refused(where, f"{raw!r} is not a whole number of devices: the API server refuses "
                                              "this pod")
                    if int(text) == 0:
                        self.f.kept(self.src, where, "0: asks for no device; kept as it is")
                        continue
                    sidecar = group == "initContainers" and c.get("restartPolicy") == "Always"
                    asks.append(_Ask(cpath, c, n, int(text), group == "initContainers" and not sidecar))
        return asks

    # ---- GFD selectors ----------------------------------------------------------------------------

    def _requirements(self) -> tuple[list[_Translated], list[list[_Translated]]]:
        """The nodeSelector's nvidia.com requirements, and those of each required affinity term."""
        sel = [_Translated(gfd.Requirement(k, "In", (str(v),)), f"{self.prefix}.nodeSelector.{k}",
                           gfd.translate(gfd.Requirement(k, "In", (str(v),))))
               for k, v in (self.spec.get("nodeSelector") or {}).items() if gfd.is_nvidia_label(k)]
        terms: list[list[_Translated]] = []
        node_aff = (self.spec.get("affinity") or {}).get("nodeAffinity") or {}
        for i, term in enumerate((node_aff.get(_REQUIRED) or {}).get("nodeSelectorTerms") or []):
            reqs = []
            for j, e in enumerate(term.get("matchExpressions") or []):
                if gfd.is_nvidia_label(str(e.get("key"))):
                    r = gfd.Requirement(str(e["key"]), str(e.get("operator")),
                                        tuple(str(v) for v in e.get("values") or []))
                    reqs.append(_Translated(r, f"{self.prefix}.affinity.nodeAffinity.{_REQUIRED}.nodeSelectorTerms"
                                               f"[{i}].matchExpressions[{j}]", gfd.translate(r)))
            terms.append(reqs)
        for i, pref in enumerate(node_aff.get(_PREFERRED) or []):
            if any(gfd.is_nvidia_label(str(e.get("key")))
                   for e in (pref.get("preference") or {}).get("matchExpressions") or []):
                self.f.refused(self.src, f"{self.prefix}.affinity.nodeAffinity.{_PREFERRED}[{i}]",
                               "device requests have no preferences; kept as it is (it needs GFD's labels)")
        return sel, terms

    def _strip_translated(self, sel: list[_Translated], terms: list[list[_Translated]]) -> None:
        """Take the requirements that became device selectors out of the node's scheduling constraints."""
        moved = {t.req.key for t in sel if _moves(t)}
        ns = self.spec.get("nodeSelector")
        if ns:
            for k in moved:
                ns.pop(k, None)
            if not ns:
                self.spec.pop("nodeSelector")
        node_aff = (self.spec.get("affinity") or {}).get("nodeAffinity") or {}
        required = node_aff.get(_REQUIRED) or {}
        if not any(terms):
            return
        kept_terms = []
        for term, reqs in zip(required.get("nodeSelectorTerms") or [], terms):
            drop = {(t.req.key, t.req.operator, t.req.values) for t in reqs if _moves(t)}
            exprs = [e for e in term.get("matchExpressions") or []
                     if (str(e.get("key")), str(e.get("operator")), tuple(str(v) for v in e.get("values") or []))
                     not in drop]
            rest = {k: v for k, v in term.items() if k != "matchExpressions"}
            if exprs:
                rest["matchExpressions"] = exprs
            if rest:
                kept_terms.append(rest)
        if len(terms) > 1 and kept_terms and len(kept_terms) < len(terms):
            self.f.refused(self.src, f"{self.prefix}.affinity.nodeAffinity.{_REQUIRED}",
                           "terms mixed GPU and other node labels: the GPU parts became one device selector (or of "
                           "the terms) and the other parts stay node terms, which is looser than before")
        if kept_terms:
            required["nodeSelectorTerms"] = kept_terms
        else:
            node_aff.pop(_REQUIRED, None)
            if not node_aff:
                self.spec["affinity"].pop("nodeAffinity")
                if not self.spec["affinity"]:
                    self.spec.pop("affinity")

    # ---- meanings ---------------------------------------------------------------------------------

    def _meaning(self, resource: str, hints: list[gfd.Translation], node_reqs: list[gfd.Requirement],
                 where: str) -> Meaning:
        if resource.startswith("nvidia.com/mig-"):
            return Meaning("mig", profile=gfd.profile_from_resource(resource[len("nvidia.com/mig-"):]))
        groups = [g for g in self.opts.groups if _group_fits(g, node_reqs)]
        meanings = {m for g in groups if (m := g.meaning(resource)) is not None}
        for h in hints:
            if h.kind == "mig" and h.profile:
                meanings = {m for m in meanings if m.kind == "mig"} or {Meaning("mig", profile=h.profile)}
                meanings = {Meaning("mig", profile=h.profile) if m.profile is None else m for m in meanings}
            if h.sharing in ("time-slicing", "mps"):
                meanings = {m for m in meanings if m.strategy == h.sharing} or {Meaning("slot", h.sharing)}
            elif h.sharing == "shared":
                meanings = {m for m in meanings if m.kind == "slot"} or meanings
        if not self.opts.groups and not meanings:
            meanings = {Meaning("slot", "time-slicing") if resource.endswith(SHARED_SUFFIX) else Meaning("gpu")}
            self.f.converted(self.src, where, f"no device plugin config given: {resource} read as "
                                              f"{next(iter(meanings)).text()}")
        if not meanings:
            renamed = any(g.dp and GPU_RESOURCE + SHARED_SUFFIX in g.dp.resources for g in groups)
            raise _Refused(where, f"{resource} is advertised by none of the given device plugin configs for this "
                                  "workload's nodes" + (f" (with renameByDefault they advertise only "
                                                        f"{GPU_RESOURCE}{SHARED_SUFFIX})" if renamed else "")
                                  + ": the pod could not be scheduled there before either")
        ordered = sorted(meanings, key=lambda m: (m.kind, m.strategy or "", m.profile or ""))
        if len(ordered) > 1:
            self.f.refused(self.src, where, f"{resource} means {' or '.join(m.text() for m in ordered)} depending "
                                            f"on the node group; converted as {ordered[0].text()}: pin the "
                                            f"workload with a {DP_LABEL} nodeSelector to choose")
        return ordered[0]

    # ---- the conversion ---------------------------------------------------------------------------

    def run(self, template_name: str) -> dict[str, Any] | None:
        asks = self._gpu_asks()
        sel, terms = self._requirements()
        if not asks:
            for t in sel + [t for term in terms for t in term]:
                self.f.kept(self.src, t.path, "the workload asks for no GPU: the node requirement stays and needs "
                                              "GFD's labels on the nodes")
            return None
        node_reqs = [t.req for t in sel if t.t.node_label] + [t.req for term in terms for t in term
                                                              if t.t.node_label]
        for t in sel + [t for term in terms for t in term]:
            if t.t.node_label:
                self.f.kept(self.src, t.path, f"{t.req.key}: a node label, not GFD's; stays on the node")
            elif t.t.problem:
                self.f.refused(self.src, t.path, f"{t.req.text()}: {t.t.problem}; kept as a node requirement")
        hints = [t.t for t in sel + [t for term in terms for t in term] if t.t.kind or t.t.sharing]
        device_cel = _combined_cel(sel, terms)
        requests: list[dict[str, Any]] = []
        used_names: set[str] = set()
        # The kubelet gives an init container's devices to the app containers after it: the pod needs
        # max(largest init container, sum of the app containers) per resource, and init containers reuse the app
        # containers' requests (an extra request only for what the largest init container needs beyond them).
        served: dict[str, list[tuple[str, int]]] = {}
        for ask in sorted(asks, key=lambda a: a.init):
            where = f"{ask.path}.resources.limits.{ask.resource}"
            meaning = self._meaning(ask.resource, hints, node_reqs, where)
            if (self.opts.extended_resource and meaning.kind == "gpu" and ask.resource == GPU_RESOURCE
                    and not device_cel):
                self.f.kept(self.src, where, f"{ask.count} whole GPU(s) through the extended resource: DeviceClass "
                                             f"{self.opts.driver} (extendedResourceName {GPU_RESOURCE}) serves it")
                continue
            if (meaning.kind == "slot" and ask.count > 1
                    and any(g.dp and g.dp.fail_requests_greater_than_one and g.meaning(ask.resource) == meaning
                            for g in self.opts.groups)):
                raise _Refused(where, f"{ask.count} shared replicas: the device plugin refused this pod "
                                      "(failRequestsGreaterThanOne)")
            names: list[str] = []
            if ask.init:
                have = served.get(ask.resource, [])
                covered = 0
                for name, n in have:
                    if covered >= ask.count:
                        break
                    names.append(name)
                    covered += n
                if covered < ask.count:
                    name = _request_name(str(ask.container.get("name") or "init"), used_names)
                    requests.append(self._request(name, meaning, ask.count - covered, device_cel, sel, terms, where))
                    served.setdefault(ask.resource, []).append((name, ask.count - covered))
                    names.append(name)
                total = sum(n for _, n in served.get(ask.resource, []))
                self.f.converted(self.src, where, f"init container: reuses request(s) {', '.join(names)} (the "
                                                  "kubelet gives its devices to the app containers after it; the "
                                                  f"pod needs {total} x {meaning.text()} in all)")
            else:
                name = _request_name(str(ask.container.get("name") or "c"), used_names)
                requests.append(self._request(name, meaning, ask.count, device_cel, sel, terms, where))
                served.setdefault(ask.resource, []).append((name, ask.count))
                names.append(name)
            res = ask.container.get("resources") or {}
            for part in ("limits", "requests"):
                if part in res:
                    res[part].pop(ask.resource, None)
                    if not res[part]:
                        res.pop(part)
            claims = ask.container.setdefault("resources", {}).setdefault("claims", [])
            claims += [{"name": CLAIM_NAME, "request": n} for n in names]
        self._strip_translated(sel, terms)
        if not requests:
            return None
        self.spec.setdefault("resourceClaims", []).append(
            {"name": CLAIM_NAME, "resourceClaimTemplateName": template_name})
        self.f.converted(self.src, f"{self.prefix}.resourceClaims",
                         f"claim {CLAIM_NAME} from ResourceClaimTemplate {template_name}")
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": template_name},
                "spec": {"spec": {"devices": {"requests": requests}}}}

    def _request(self, name: str, meaning: Meaning, count: int, device_cel: list[_Translated],
                 sel: list[_Translated], terms: list[list[_Translated]], where: str) -> dict[str, Any]:
        driver = self.opts.driver
        a = f"device.attributes['{driver}']"
        selectors: list[str] = []
        cls = class_names(driver)[meaning.kind]
        if meaning.kind == "slot":
            selectors.append(f"{a}.sharing == {gfd.quote(str(meaning.strategy))}")
        elif meaning.kind == "mig":
            if meaning.profile:
                selectors.append(f"{a}.profile == {gfd.quote(meaning.profile)}")
            else:
                self.f.refused(self.src, where, "the MIG profile nvidia.com/gpu stood for is not known (give the "
                                                "node group's mig-parted config): any MIG device")
        own_memory = meaning.kind == "mig" or meaning.strategy == "mps"
        for t in device_cel:
            if t.t.capacity == "memory" and own_memory:
                self.f.refused(self.src, t.path, f"{t.req.text()}: the GPU's memory; {meaning.text()} publishes "
                                                 "its own share as memory, so this is left out of the request")
                continue
            selectors.append(gfd.render(str(t.t.cel), driver))
            self.f.converted(self.src, t.path, f"request {name}: {gfd.render(str(t.t.cel), driver)}")
        ors = _term_cel(terms)
        if ors:
            selectors.append(gfd.render(ors, driver))
            for term in terms:
                for t in term:
                    if t.t.cel:
                        self.f.converted(self.src, t.path, f"request {name}: part of {gfd.render(ors, driver)}")
        for t in sel + [t for term in terms for t in term]:
            if t.t.cel is None and not t.t.problem and not t.t.node_label:
                self.f.converted(self.src, t.path, f"{t.req.text()}: implied by {meaning.text()} of class {cls}")
        self.f.converted(self.src, where, f"request {name}: {count} x {meaning.text()} (class {cls})")
        exactly: dict[str, Any] = {"deviceClassName": cls}
        if count > 1:
            exactly["count"] = count
        if selectors:
            exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
        return {"name": name, "exactly": exactly}


def _moves(t: _Translated) -> bool:
    """Whether a requirement leaves the node constraints (it became, or is implied by, a device selector)."""
    return not t.t.node_label and t.t.problem is None


def _combined_cel(sel: list[_Translated], terms: list[list[_Translated]]) -> list[_Translated]:
    """The nodeSelector's translated requirements (ANDed), and a single affinity term's."""
    out = [t for t in sel if t.t.cel]
    if len(terms) == 1:
        out += [t for t in terms[0] if t.t.cel]
    return out


def _term_cel(terms: list[list[_Translated]]) -> str | None:
    """Several affinity terms are ORed: one selector that is the OR of each term's translated requirements."""
    if len(terms) < 2:
        return None
    parts = []
    for term in terms:
        cels = [str(t.t.cel) for t in term if t.t.cel]
        if not cels:
            return None   # a term without GPU requirements admits any GPU: no selector
        parts.append(" && ".join(cels))
    return " || ".join(f"({p})" for p in parts)


def _group_fits(group: NodeGroup, reqs: list[gfd.Requirement]) -> bool:
    for r in reqs:
        config = {DP_LABEL: group.dp.name if group.dp else None, MIG_LABEL: group.mig.name if group.mig else None}
        if r.key not in config or config[r.key] is None:
            continue
        inside = config[r.key] in r.values
        if (r.operator == "In" and not inside) or (r.operator == "NotIn" and inside):
            return False
    return True


def _request_name(container: str, used: set[str]) -> str:
    base = container if is_dns_label(container) else "gpu"
    name, n = base, 2
    while name in used:
        name, n = f"{base[:59]}-{n}", n + 1
    used.add(name)
    return name
