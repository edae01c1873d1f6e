"""The kubelet's DRA manager, as far as a test needs it: prepare a pod's claims before its containers would
start, unprepare them after the pod is gone, with the kubelet's claim cache (shared claims are prepared once
and unprepared when their last pod is gone)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from standin.dra_client import DEFAULT_CALL_TIMEOUT, DraClient
from standin.registry import PluginWatcher, RegisteredPlugin
from standin.rules import AllocatedDevice, ClaimOutcome, ClaimRef, PreparedDevice, cdi_ids_for_container
from standin.stubs import KUBELET_DRA_SERVICES

# Key of the scheduler-made claim for a pod's extended resources (``nvidia.com/gpu: 1`` served by a DeviceClass
# with extendedResourceName) in PreparedPod; not a DNS label, so it never collides with a pod claim name.
EXTENDED_RESOURCE_CLAIM = "resource.kubernetes.io/extended-resource-claim"


class PodNotReady(Exception):
    """The kubelet would not (yet) prepare this pod: claim missing, not allocated, not reserved, wrong node."""


class DriverNotRegistered(Exception):
    def __init__(self, driver: str):
        self.driver = driver
        super().__init__(f"DRA driver {driver} is not registered")


class PodPrepareError(Exception):
    """At least one claim of the pod failed to prepare; ``errors`` maps claim UID -> the plugin's message."""

    def __init__(self, pod: str, errors: dict[str, str], claims: dict[str, ClaimRef]):
        self.errors = errors
        self.claims = claims
        text = "; ".join(f"{claims[u].namespace}/{claims[u].name}: {e}" for u, e in errors.items())
        super().__init__(f"prepare of pod {pod} failed: {text}")


class PodUnprepareError(Exception):
    def __init__(self, pod: str, errors: dict[str, str]):
        self.errors = errors
        super().__init__(f"unprepare after pod {pod} failed: {errors}")


@dataclass
class CachedClaim:
    """The kubelet's ClaimInfo: one ResourceClaim on this node and the pods using it."""

    ref: ClaimRef
    allocated: dict[str, list[AllocatedDevice]]          # driver -> its allocation results
    pods: set[str] = field(default_factory=set)          # pod UIDs
    prepared: dict[str, tuple[PreparedDevice, ...]] = field(default_factory=dict)  # driver -> devices

    @property
    def is_prepared(self) -> bool:
        return set(self.prepared) == set(self.allocated)

    def devices(self) -> list[PreparedDevice]:
        return [d for devs in self.prepared.values() for d in devs]


@dataclass(frozen=True)
class PreparedPod:
    """What prepare_pod produced: pod claim name (EXTENDED_RESOURCE_CLAIM for the scheduler's extended-resource
    claim) -> its ResourceClaim and devices, plus CDI IDs per container."""

    claims: dict[str, ClaimRef]
    devices: dict[str, tuple[PreparedDevice, ...]]
    container_cdi_ids: dict[str, list[str]]


@dataclass(frozen=True)
class Call:
    """One gRPC call the stand-in made, for tests that count calls (shared claims, idempotency)."""

    method: str
    driver: str
    claim_uids: tuple[str, ...]


def as_dict(obj: Any) -> dict[str, Any]:
    """A Kubernetes object in wire format (camelCase), from a typed client model or a dict."""
    if isinstance(obj, dict):
        return obj
    from kubernetes.client import ApiClient

    return ApiClient().sanitize_for_serialization(obj)


def pod_claim_name(pod: dict[str, Any], pod_claim: dict[str, Any]) -> str | None:
    """The ResourceClaim name behind one ``spec.resourceClaims[]`` entry.

    Direct references name the claim; template references are looked up in
    ``status.resourceClaimStatuses`` (None there means no claim was needed). Raises PodNotReady while the
    claim controller has not recorded the generated claim yet.
    """
    if pod_claim.get("resourceClaimName"):
        return pod_claim["resourceClaimName"]
    for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
        if status.get("name") == pod_claim["name"]:
            return status.get("resourceClaimName")
    raise PodNotReady(f"pod claim {pod_claim['name']!r}: no generated ResourceClaim recorded in the pod status yet")


def extended_resource_claim_name(pod: dict[str, Any]) -> str | None:
    """The claim the scheduler made for the pod's extended resources (``status.extendedResourceClaimStatus``)."""
    status = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
    return status.get("resourceClaimName") or None


def extended_resource_refs(pod: dict[str, Any], container: str) -> list[dict[str, str]]:
    """A container's extended-resource requests as ``resources.claims``-style references into that claim."""
    status = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
    return [{"name": EXTENDED_RESOURCE_CLAIM, "request": m["requestName"]}
            for m in status.get("requestMappings") or [] if m.get("containerName") == container]


def allocated_devices(claim: dict[str, Any]) -> dict[str, list[AllocatedDevice]]:
    """driver -> allocation results of a ResourceClaim."""
    results = ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")) or []
    by_driver: dict[str, list[AllocatedDevice]] = {}
    for r in results:
        by_driver.setdefault(r["driver"], []).append(
            AllocatedDevice(request=r["request"], driver=r["driver"], pool=r["pool"], device=r["device"], share_id=r.get("shareID"))
        )
    return by_driver


def _pod_key(pod: dict[str, Any]) -> str:
    return f"{pod['metadata'].get('namespace', 'default')}/{pod['metadata']['name']}"


class KubeletStandin:
    """Plays the kubelet of one node toward DRA plugins.

    ``api_client`` (a kubernetes.client.ApiClient) is needed for prepare_pod, which reads ResourceClaims
    like the kubelet; plugin registration and raw prepare/unprepare work without it. ``dra_services`` is the
    list of DRA service versions this kubelet speaks: ("v1.DRAPlugin", "v1beta1.DRAPlugin") like 1.34+, or
    ("v1beta1.DRAPlugin",) to exercise the v1beta1 path.
    """

    def __init__(
        self,
        node_name: str,
        registry_dir: str | Path,
        api_client: Any = None,
        *,
        dra_services: Sequence[str] = KUBELET_DRA_SERVICES,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        poll_interval: float = 0.2,
    ):
        self.node_name = node_name
        self.api_client = api_client
        self.watcher = PluginWatcher(
            registry_dir, kubelet_services=dra_services, call_timeout=call_timeout, poll_interval=poll_interval
        )
        self.claim_cache: dict[str, CachedClaim] = {}   # by claim UID
        self.calls: list[Call] = []

    # --- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> KubeletStandin:
        self.watcher.start()
        return self

    def stop(self) -> None:
        self.watcher.stop()

    def __enter__(self) -> KubeletStandin:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- plugins ----------------------------------------------------------------------------------------

    def wait_for_plugin(self, driver: str, timeout: float = 30.0, *, newer_than: float | None = None) -> RegisteredPlugin:
        return self.watcher.wait_for_plugin(driver, timeout, newer_than=newer_than)

    def client(self, driver: str) -> DraClient:
        plugin = self.watcher.plugin(driver)
        if plugin is None:
            raise DriverNotRegistered(driver)
        return plugin.client

    # --- claims -----------------------------------------------------------------------------------------

    def read_claim(self, namespace: str, name: str) -> dict[str, Any]:
        from kube.client import RESOURCE_V1, KubeApi

        if self.api_client is None:
            raise RuntimeError("KubeletStandin needs an api_client to read ResourceClaims")
        return KubeApi(self.api_client).get(f"{RESOURCE_V1}/namespaces/{namespace}/resourceclaims/{name}")

    def _pod_claims(self, pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """(pod claim name, ResourceClaim) for every claim the pod needs, checked as the kubelet checks; the
        scheduler's claim for extended resources comes last, under EXTENDED_RESOURCE_CLAIM."""
        out = []
        for pod_claim in (pod.get("spec") or {}).get("resourceClaims") or []:
            name = pod_claim_name(pod, pod_claim)
            if name is None:
                continue
            owned = bool(pod_claim.get("resourceClaimTemplateName"))
            out.append((pod_claim["name"], self._checked_claim(pod, name, owned)))
        extended = extended_resource_claim_name(pod)
        if extended is not None:
            out.append((EXTENDED_RESOURCE_CLAIM, self._checked_claim(pod, extended, owned=True)))
        return out

    def _checked_claim(self, pod: dict[str, Any], name: str, owned: bool) -> dict[str, Any]:
        """The ResourceClaim, once it is allocated and reserved for the pod (and owned by it when ``owned``)."""
        meta = pod["metadata"]
        claim = self.read_claim(meta["namespace"], name)
        where = f"ResourceClaim {meta['namespace']}/{name}"
        if owned:
            owners = claim["metadata"].get("ownerReferences") or []
            if not any(o.get("uid") == meta["uid"] and o.get("controller") for o in owners):
                raise PodNotReady(f"{where} was not created for pod {_pod_key(pod)}")
        status = claim.get("status") or {}
        if not status.get("allocation"):
            raise PodNotReady(f"{where} is not allocated")
        if not any(r.get("uid") == meta["uid"] for r in status.get("reservedFor") or []):
            raise PodNotReady(f"{where} is not reserved for pod {_pod_key(pod)}")
        return claim

    def prepare_claims(
        self, driver: str, claims: Sequence[ClaimRef], allocations: dict[str, list[AllocatedDevice]] | None = None
    ) -> dict[str, ClaimOutcome]:
        """One NodePrepareResources call to ``driver``, recorded in ``calls``."""
        self.calls.append(Call("NodePrepareResources", driver, tuple(c.uid for c in claims)))
        return self.client(driver).prepare(claims, allocations)

    def unprepare_claims(self, driver: str, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """One NodeUnprepareResources call to ``driver``, recorded in ``calls``."""
        self.calls.append(Call("NodeUnprepareResources", driver, tuple(c.uid for c in claims)))
        return self.client(driver).unprepare(claims)

    # --- pods ---------------------------------------------------------------------------------------------

    def prepare_pod(self, pod: Any) -> PreparedPod:
        """Prepare every allocated claim of a bound pod on this node, as the kubelet does before starting
        its containers. Pass the pod as currently stored (after binding and claim creation).

        Raises PodNotReady (the kubelet would wait), DriverNotRegistered, DraCallError, ProtocolViolation,
        or PodPrepareError when the plugin reported per-claim errors (claims that succeeded stay prepared).
        """
        pod = as_dict(pod)
        key = _pod_key(pod)
        node = (pod.get("spec") or {}).get("nodeName")
        if node != self.node_name:
            raise PodNotReady(f"pod {key} is bound to {node!r}, not to {self.node_name}")
        pod_uid = pod["metadata"]["uid"]
        pod_claims = self._pod_claims(pod)

        refs: dict[str, ClaimRef] = {}
        for _, claim in pod_claims:
            meta = claim["metadata"]
            ref = ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])
            refs[ref.uid] = ref
            cached = self.claim_cache.setdefault(ref.uid, CachedClaim(ref=ref, allocated=allocated_devices(claim)))
            cached.pods.add(pod_uid)

        # One call per driver with the claims not prepared yet for it (shared claims are prepared once).
        batches: dict[str, list[CachedClaim]] = {}
        for uid in refs:
            cached = self.claim_cache[uid]
            for driver in cached.allocated:
                if driver not in cached.prepared:
                    batches.setdefault(driver, []).append(cached)
        errors: dict[str, str] = {}
        for driver, batch in sorted(batches.items()):
            allocations = {c.ref.uid: c.allocated[driver] for c in batch}
            outcomes = self.prepare_claims(driver, [c.ref for c in batch], allocations)
            for cached in batch:
                outcome = outcomes[cached.ref.uid]
                if outcome.ok:
                    cached.prepared[driver] = outcome.devices
                else:
                    errors[cached.ref.uid] = outcome.error
        if errors:
            raise PodPrepareError(key, errors, refs)
        return self.prepared_pod(pod)

    def prepared_pod(self, pod: Any) -> PreparedPod:
        """The prepared devices and per-container CDI IDs of an already prepared pod (no gRPC calls)."""
        pod = as_dict(pod)
        claims: dict[str, ClaimRef] = {}
        devices: dict[str, tuple[PreparedDevice, ...]] = {}
        names = [(pc["name"], pod_claim_name(pod, pc)) for pc in (pod.get("spec") or {}).get("resourceClaims") or []]
        names.append((EXTENDED_RESOURCE_CLAIM, extended_resource_claim_name(pod)))
        for pod_claim, name in names:
            if name is None:
                continue
            cached = next(
                (c for c in self.claim_cache.values() if c.ref.name == name and c.ref.namespace == pod["metadata"]["namespace"]),
                None,
            )
            if cached is None or not cached.is_prepared:
                raise PodNotReady(f"claim {name} of pod {_pod_key(pod)} is not prepared")
            claims[pod_claim] = cached.ref
            devices[pod_claim] = tuple(cached.devices())
        containers = (pod.get("spec") or {}).get("containers") or []
        # Extended resources reach a container through the request mappings the scheduler recorded.
        cdi = {
            c["name"]: cdi_ids_for_container(
                [*((c.get("resources") or {}).get("claims") or []), *extended_resource_refs(pod, c["name"])], devices)
            for c in containers
        }
        return PreparedPod(claims=claims, devices=devices, container_cdi_ids=cdi)

    def unprepare_pod(self, pod: Any) -> list[ClaimRef]:
        """After the pod is gone: drop it from every cached claim and unprepare the claims no pod uses any
        more, from the cache alone (the ResourceClaims may already be deleted). Returns the claims
        unprepared. Claims whose unprepare failed stay cached and are retried by the next call."""
        pod = as_dict(pod)
        pod_uid = pod["metadata"]["uid"]
        for cached in self.claim_cache.values():
            cached.pods.discard(pod_uid)
        unused = [c for c in self.claim_cache.values() if not c.pods]
        batches: dict[str, list[CachedClaim]] = {}
        for cached in unused:
            for driver in cached.allocated:
                batches.setdefault(driver, []).append(cached)
        errors: dict[str, str] = {}
        for driver, batch in sorted(batches.items()):
            answers = self.unprepare_claims(driver, [c.ref for c in batch])
            for cached in batch:
                if answers[cached.ref.uid]:
                    errors[cached.ref.uid] = answers[cached.ref.uid]
                else:
                    cached.prepared.pop(driver, None)
        done = [c.ref for c in unused if c.ref.uid not in errors]
        for ref in done:
            del self.claim_cache[ref.uid]
        if errors:
            raise PodUnprepareError(_pod_key(pod), errors)
        return done
