"""The example folders as objects in a cluster: loading them (for any driver name), applying them to a
namespace, and waiting until the scheduler has allocated every claim and bound every pod.

Nothing here runs a pod: without a kubelet a bound pod stays Pending, which is all allocation needs.
The demo and the end-to-end tests share this code, so the tests exercise exactly what the demo shows.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.names import DEFAULT_DRIVER_NAME
from api.yamlfiles import parse_yaml, read_text
from kube.client import ApiError, KubeApi, namespaced_collection

CLAIM_FILE = "claim.yaml"
NAMESPACES = "/api/v1/namespaces"

# Namespaced kinds an example may contain -> (API group path, plural).
_KINDS = ("Pod", "ResourceClaim", "ResourceClaimTemplate", "ConfigMap")   # what an example may hold
# The default driver name wherever it names the driver: CEL domains, DeviceClass names and opaque config
# `driver` fields, but not the config's `apiVersion` (gpu.dra-driver.io/v1alpha1), which stays ours.
_DRIVER_IN_TEXT = re.compile(re.escape(DEFAULT_DRIVER_NAME) + r"(?![\w/.-])")


class ExampleError(ValueError):
    """An example folder that cannot be used; the message names the file and the reason."""


@dataclass
class Example:
    """One example folder: its name and the objects of its claim.yaml (driver name already substituted)."""

    name: str
    path: Path
    objects: list[dict[str, Any]]

    @property
    def pods(self) -> list[dict[str, Any]]:
        return [o for o in self.objects if o.get("kind") == "Pod"]


def retarget_driver(text: str, driver: str) -> str:
    """The YAML of an example with the default driver name replaced by `driver`."""
    return text if driver == DEFAULT_DRIVER_NAME else _DRIVER_IN_TEXT.sub(driver, text)


def load_example(folder: Path, driver: str = DEFAULT_DRIVER_NAME) -> Example:
    path = folder / CLAIM_FILE
    text = read_text(path, error=ExampleError)
    docs = parse_yaml(retarget_driver(text, driver), str(path), documents=True, error=ExampleError)
    if not docs:
        raise ExampleError(f"{path}: no objects")
    for i, doc in enumerate(docs):
        where = f"{path}: document {i + 1}"
        if not isinstance(doc, dict):
            raise ExampleError(f"{where}: must be a mapping, got {type(doc).__name__}")
        kind = doc.get("kind")
        if kind not in _KINDS:
            raise ExampleError(f"{where}: kind {kind!r} is not supported here (supported: {', '.join(_KINDS)})")
        if not (doc.get("metadata") or {}).get("name"):
            raise ExampleError(f"{where}: {kind} without metadata.name")
    example = Example(folder.name, path, docs)
    if not example.pods:
        raise ExampleError(f"{path}: no Pod: nothing would ask the scheduler to allocate the claims")
    return example


def load_examples(examples_dir: Path | str, driver: str = DEFAULT_DRIVER_NAME) -> list[Example]:
    """Every sub-folder of `examples_dir` that has a claim.yaml, in name order."""
    root = Path(examples_dir)
    if not root.is_dir():
        raise ExampleError(f"{root}: not a directory")
    examples = [load_example(d, driver) for d in sorted(root.iterdir()) if (d / CLAIM_FILE).is_file()]
    if not examples:
        raise ExampleError(f"{root}: no sub-folder with a {CLAIM_FILE}")
    return examples


def create_namespace(kube: KubeApi, name: str) -> None:
    """Creates the namespace; an existing one is fine."""
    try:
        kube.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    except ApiError as exc:
        if not exc.conflict:
            raise


def apply_objects(kube: KubeApi, objects: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """Creates the objects in `namespace`, templates and claims before pods. Returns what was stored."""
    order = {"ConfigMap": 0, "ResourceClaimTemplate": 1, "ResourceClaim": 2, "Pod": 3}
    stored = []
    for obj in sorted(objects, key=lambda o: order.get(o["kind"], 9)):
        body = {**obj, "metadata": {**obj["metadata"], "namespace": namespace}}
        stored.append(kube.create(namespaced_collection(obj["kind"], namespace), body))
    return stored


def delete_namespace(kube: KubeApi, name: str) -> None:
    """Best-effort clean-up: pods first with no grace period (no kubelet would ever confirm a graceful
    deletion of a bound pod), then the namespace. Does not wait."""
    try:
        for pod in kube.list(namespaced_collection("Pod", name))["items"]:
            kube.request("DELETE", f"{namespaced_collection('Pod', name)}/{pod['metadata']['name']}",
                         body={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        kube.request("DELETE", f"{NAMESPACES}/{name}")
    except ApiError as exc:
        if not exc.not_found:
            raise


# --------------------------------------------------------------------------------------------------- waiting

@dataclass
class PodClaim:
    """One claim of one pod, as far as the scheduler got with it."""

    example: str
    pod: str
    pod_claim: str                      # the name in pod.spec.resourceClaims
    claim: str | None                   # the ResourceClaim's name (None: not created yet)
    node: str | None                    # the pod's node once bound
    allocation: dict[str, Any] | None   # claim.status.allocation
    uid: str | None = None

    @property
    def done(self) -> bool:
        return self.node is not None and self.allocation is not None

    @property
    def results(self) -> list[dict[str, Any]]:
        return list(((self.allocation or {}).get("devices") or {}).get("results") or [])


@dataclass
class AllocationState:
    """Every pod claim of the applied examples; `pending` names what is not allocated or bound yet."""

    claims: list[PodClaim] = field(default_factory=list)

    @property
    def pending(self) -> list[PodClaim]:
        return [c for c in self.claims if not c.done]

    @property
    def complete(self) -> bool:
        return bool(self.claims) and not self.pending


def allocation_state(kube: KubeApi, examples: list[Example], namespace: str) -> AllocationState:
    """Reads pods and claims once and pairs them up."""
    pods = {p["metadata"]["name"]: p for p in kube.list(namespaced_collection("Pod", namespace))["items"]}
    claims = {c["metadata"]["name"]: c for c in kube.list(namespaced_collection("ResourceClaim", namespace))["items"]}
    state = AllocationState()
    for example in examples:
        for spec_pod in example.pods:
            name = spec_pod["metadata"]["name"]
            pod = pods.get(name, {})
            generated = {s["name"]: s.get("resourceClaimName")
                         for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
            for ref in (spec_pod.get("spec") or {}).get("resourceClaims") or []:
                claim_name = ref.get("resourceClaimName") or generated.get(ref["name"])
                claim = claims.get(claim_name or "", {})
                state.claims.append(PodClaim(
                    example=example.name, pod=name, pod_claim=ref["name"], claim=claim_name,
                    node=(pod.get("spec") or {}).get("nodeName"),
                    allocation=(claim.get("status") or {}).get("allocation"),
                    uid=(claim.get("metadata") or {}).get("uid")))
    return state


def wait_for_allocation(kube: KubeApi, examples: list[Example], namespace: str, timeout: float,
                        interval: float = 0.25) -> AllocationState:
    """Polls until every pod is bound and every claim allocated, or the timeout passes; returns the last
    state either way (check `.complete`)."""
    deadline = time.monotonic() + timeout
    while True:
        state = allocation_state(kube, examples, namespace)
        if state.complete or time.monotonic() >= deadline:
            return state
        time.sleep(interval)


def scheduler_reason(kube: KubeApi, namespace: str, pod: str) -> str:
    """Why the scheduler has not bound `pod`: its PodScheduled condition and the latest scheduling event."""
    parts: list[str] = []
    try:
        obj = kube.get(f"{namespaced_collection('Pod', namespace)}/{pod}")
    except ApiError as exc:
        return f"pod {pod} cannot be read: {exc.message}"
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") != "True":
            parts.append(f"{cond.get('reason', 'NotScheduled')}: {cond.get('message', '').strip()}")
    events = kube.list(f"/api/v1/namespaces/{namespace}/events",
                       field_selector=f"involvedObject.kind=Pod,involvedObject.name={pod}")["items"]
    events = [e for e in events if e.get("type") == "Warning"]
    if events:
        last = max(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        text = f"event {last.get('reason')}: {(last.get('message') or '').strip()}"
        if not any(last.get("message", "").strip() and last["message"].strip() in p for p in parts):
            parts.append(text)
    if not parts:
        parts.append("the scheduler has not reported on this pod yet")
    return "; ".join(parts)


def describe_pending(kube: KubeApi, state: AllocationState, namespace: str,
                     explain: Callable[[KubeApi, str, str], Any] | None = None) -> list[str]:
    """One line per pending pod claim: which claim, what is missing, and why: for a claim not allocated,
    `gpu-dra explain`'s verdict on it (which device is taken by whom, which selector fails, node by node), more
    useful than the scheduler's "cannot allocate all claims"; the scheduler's reason where explain finds the
    claim allocatable or cannot evaluate it, and for a pod not bound. ``explain``: ops.explain.reads.explain_target
    (a parameter for tests)."""
    if explain is None:
        from ops.explain.reads import explain_target

        explain = explain_target
    lines = []
    for c in state.pending:
        claim = c.claim or f"(claim {c.pod_claim} of pod {c.pod} not created yet)"
        missing = "not allocated" if c.allocation is None else "allocated, pod not bound"
        reason = None
        if c.allocation is None:
            target = f"claim/{c.claim}" if c.claim else f"pod/{c.pod}"
            try:
                verdict = explain(kube, target, namespace)
            except (LookupError, ApiError, ValueError) as exc:   # cannot evaluate: the scheduler's word instead
                reason = f"{scheduler_reason(kube, namespace, c.pod)} (gpu-dra explain {target}: {exc})"
            else:
                if not verdict.allocatable:
                    reason = f"gpu-dra explain {target}: {verdict.sentence}"
        lines.append(f"{c.example}: claim {claim} ({missing}), pod {c.pod}: "
                     f"{reason or scheduler_reason(kube, namespace, c.pod)}")
    return lines
