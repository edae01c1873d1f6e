"""What MPS tenancy at scheduling time costs a pod: create → Running on the real node, an MPS slot of a GPU held by
the pod's own namespace (its daemon runs, its slots carry the tenancy taint, the claim the chart's admission
policy's toleration) against a whole GPU, in the same run, interleaved.

A local control plane, one real node (kubelet, containerd, runc; ``testbed.localnode``) and ``gpu-dra
kubelet-plugin`` for three simulated H100s: GPUs 0 and 1 with four MPS slots each, GPU 2 whole. The chart's
MutatingAdmissionPolicy is rendered with ``helm template`` and applied. Namespace ``tenant-a`` keeps a pod on a
slot of GPU 0 throughout. Each round creates, one after the other and each deleted before the next:

* ``tenant``: a pod of tenant-a on GPU 0's slots (joins the running daemon);
* ``whole``: a pod of tenant-b on the whole GPU 2 (the floor: no sharing, no tenancy);
* ``elsewhere``: a pod of tenant-b on any MPS slot, which the taint keeps off GPU 0: it lands on GPU 1 and starts
  that GPU's daemon (shown, not judged: a daemon start is not the tenancy's cost).

Create → Running is from the create request to the pod's first Running status seen by a 10 ms poll of the API
server; medians over the rounds. Each pod is deleted as users delete pods and its claim unprepared before the
next: a new claim allocated the device of a claim the node has not unprepared yet is refused at prepare until
it has, and the kubelet's retry back-off would be measured instead. Needs root and the node binaries (``make node-binaries``), as the real-node
tests do.
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from api.deviceclasses import device_classes
from api.names import DEFAULT_DRIVER_NAME
from bench.core import Figure
from bench.params import Params
from bench.realnodebed import RealNodeBed
from kube.client import DEVICE_CLASSES
from testbed.helmchart import render
from testbed.localnode import cuda_probe_image, install_driver_root
from testbed.nodeplugin import LocalNodePlugin
from testbed.podprobe import for_local_node

NAME = "tenancy"
DESCRIPTION = "pod create → Running on the real node: MPS slot of its tenant's GPU vs a whole GPU"
DRIVER = DEFAULT_DRIVER_NAME
POLL_S = 0.01


# GPUs 0 and 1: MPS slots only; GPU 2: whole.
FLEET: dict[str, Any] = {"gpus": [{"model": "H100-80GB", "count": 3}], "policy": {
    "default": {"wholeGpu": False, "mig": "none", "slots": {"count": 4, "strategy": "mps"}},
    "rules": [{"match": {"index": 2}, "wholeGpu": True, "mig": "none"}]}}


def _template(name: str, device_class: str, expression: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": device_class, "selectors": [{"cel": {"expression": expression}}]}}]}}}}


class _Bench(RealNodeBed):
    def start(self) -> None:
        fleet = self.start_node(FLEET)
        assert self.kube is not None and self.node is not None
        for cls in device_classes(DRIVER):
            self.kube.create(DEVICE_CLASSES, cls)
        for obj in render("--set", f"driverName={DRIVER}"):
            if obj["kind"] in ("MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"):
                plural = {"MutatingAdmissionPolicy": "mutatingadmissionpolicies",
                          "MutatingAdmissionPolicyBinding": "mutatingadmissionpolicybindings"}[obj["kind"]]
                self.kube.create(f"/apis/admissionregistration.k8s.io/v1/{plural}", obj)
        self.plugin = LocalNodePlugin(self.node, fleet, DRIVER, log_level="warning")
        install_driver_root(self.plugin.driver_root, self.node.bin_dir, "host", fleet=fleet, node_name=self.node.name)
        self.plugin.start()
        self.plugin.wait_registered(60)
        uuids = self._gpu_uuids()
        a = f"device.attributes['{DRIVER}']"
        for ns in ("tenant-a", "tenant-b"):
            self.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                   "metadata": {"name": ns}})
        slot = f"slot.{DRIVER}"
        self._create("tenant-a", _template("gpu0-slot", slot, f"{a}.parentUUID == '{uuids[0]}'"))
        self._create("tenant-b", _template("whole", DRIVER, f"{a}.uuid == '{uuids[2]}'"))   # the whole-GPU class
        self._create("tenant-b", _template("any-slot", slot, f"{a}.sharing == 'mps'"))
        self._wait_mutating()
        self.pod_running("tenant-a", "holder", "gpu0-slot")

    def _create(self, ns: str, obj: dict[str, Any]) -> None:
        assert self.kube is not None
        plural = {"Pod": "/api/v1/namespaces/{ns}/pods",
                  "ResourceClaimTemplate": "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates",
                  "ResourceClaim": "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"}[obj["kind"]]
        self.kube.create(plural.format(ns=ns), {**obj, "metadata": {**obj["metadata"], "namespace": ns}})

    def _gpu_uuids(self) -> list[str]:
        """GPU UUIDs by index, from the published devices (gpu-<minor>-slot-0, gpu-<minor>)."""
        assert self.kube is not None and self.node is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            slices = self.kube.list("/apis/resource.k8s.io/v1/resourceslices",
                                    field_selector=f"spec.nodeName={self.node.name}")["items"]
            attrs = {d["name"]: d["attributes"] for s in slices for d in s["spec"].get("devices") or []}
            if {"gpu-0-slot-0", "gpu-1-slot-0", "gpu-2"} <= attrs.keys():
                return [attrs["gpu-0-slot-0"]["parentUUID"]["string"], attrs["gpu-1-slot-0"]["parentUUID"]["string"],
                        attrs["gpu-2"]["uuid"]["string"]]
            time.sleep(0.2)
        raise RuntimeError(f"the plugin on {self.node.name} published no complete pool within 60 s")

    def _wait_mutating(self) -> None:
        """Admission policies load asynchronously: wait until a claim comes back with the toleration."""
        assert self.kube is not None
        deadline, n = time.monotonic() + 60, 0
        while time.monotonic() < deadline:
            n += 1
            claim = self.kube.create("/apis/resource.k8s.io/v1/namespaces/tenant-b/resourceclaims", {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": f"probe-{n}"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"slot.{DRIVER}"}}]}}})
            if claim["spec"]["devices"]["requests"][0]["exactly"].get("tolerations"):
                return
            time.sleep(0.5)
        raise RuntimeError("the MPS tenancy MutatingAdmissionPolicy did not take effect within 60 s")

    def pod_running(self, ns: str, name: str, template: str) -> float:
        """Seconds from the create request to the first Running status."""
        assert self.kube is not None and self.node is not None
        pod = for_local_node({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                              "spec": {"containers": [{"name": "cuda", "image": "unused",
                                                       "resources": {"claims": [{"name": "gpu"}]}}],
                                       "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}]}},
                             cuda_probe_image(), self.node.name)
        path = f"/api/v1/namespaces/{ns}/pods/{name}"
        start = time.perf_counter()
        self._create(ns, pod)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = self.kube.get(path).get("status") or {}
            if status.get("phase") == "Running":
                return time.perf_counter() - start
            if status.get("phase") in ("Failed", "Succeeded"):
                break
            time.sleep(POLL_S)
        raise RuntimeError(f"pod {ns}/{name} did not run within 120 s (phase {status.get('phase')})")

    def delete(self, ns: str, name: str) -> None:
        """Deletes the pod as users do (its grace period) and waits until the plugin has unprepared its claim: the
        next round's claim may get the same device, whose prepare is refused while the old claim holds it."""
        assert self.kube is not None and self.plugin is not None
        path = f"/api/v1/namespaces/{ns}/pods/{name}"
        pod = self.kube.get(path)
        claim = next(s["resourceClaimName"] for s in pod["status"]["resourceClaimStatuses"])
        uid = self.kube.get(f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{claim}")["metadata"]["uid"]
        self.kube.request("DELETE", path)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not any(uid in p.name for p in self.plugin.cdi_dir.iterdir()):
                return
            time.sleep(0.05)
        raise RuntimeError(f"pod {ns}/{name}: claim {claim} was not unprepared within 60 s")


def run(params: Params) -> list[Figure]:
    rounds = max(1, min(params.repeats, 15))
    work = Path(tempfile.mkdtemp(prefix="gpu-dra-bench-tenancy-"))
    bench = _Bench(work)
    times: dict[str, list[float]] = {"tenant": [], "whole": [], "elsewhere": []}
    try:
        bench.start()
        for i in range(rounds + 1):             # the first round is a warm-up
            for kind, ns, template in (("tenant", "tenant-a", "gpu0-slot"), ("whole", "tenant-b", "whole"),
                                       ("elsewhere", "tenant-b", "any-slot")):
                name = f"{kind}-{i}"
                seconds = bench.pod_running(ns, name, template)
                if i:
                    times[kind].append(seconds)
                bench.delete(ns, name)
    finally:
        bench.stop()
        shutil.rmtree(work, ignore_errors=True)
    ms = {k: statistics.median(v) * 1000 for k, v in times.items()}
    spread = {k: f"{min(v) * 1000:.0f}–{max(v) * 1000:.0f}" for k, v in times.items()}
    how = f"median of {rounds} interleaved rounds after a warm-up, 10 ms poll"
    return [
        Figure(f"{NAME}.tenant_slot_added_ms", "create → Running: MPS slot of its tenant's GPU minus a whole GPU",
               max(0.0, ms["tenant"] - ms["whole"]), "ms", stat="median",
               detail=f"{how}; slot {ms['tenant']:.0f} ms ({spread['tenant']}), whole GPU {ms['whole']:.0f} ms "
                      f"({spread['whole']}); difference {ms['tenant'] - ms['whole']:+.0f} ms (0 when the slot "
                      "was faster)"),
        Figure(f"{NAME}.other_namespace_ms", "create → Running: another namespace's MPS pod (on the next GPU, "
               "its daemon started)", ms["elsewhere"], "ms", stat="median",
               detail=f"{how}; {spread['elsewhere']} ms; the taint kept every one off the tenant's GPU"),
    ]
