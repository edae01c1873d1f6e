"""The real-node tier: one local control plane, one real node (kubelet, containerd, runc) and
``gpu-dra kubelet-plugin`` for it with simulated GPUs, shared by the tests of a module.

Pods come from the examples (or are written like them) and run through `testbed.podprobe.for_local_node`: the
cuda-probe image prints the NVIDIA device nodes, environment and mounts its container got and the devices
libcuda.so.1 and libnvidia-ml.so.1 show it, then sleeps. Each plugin's driver root holds the CUDA stand-in
laid out as a real driver install (host Debian layout unless a test picks another). The tests assert on that
output, and on what the plugin left on the node after the kubelet unprepared.
Nothing here skips: a node that cannot start fails the tests with the reason.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import cdivalidate
import pytest
import yaml
from standin.workloads import complete_pool, create, get, node_slices, slice_devices, wait_until

from api.deviceclasses import device_classes
from api.names import DEFAULT_DRIVER_NAME
from kube.client import DEVICE_CLASSES, ApiError, KubeApi, namespaced_collection
from testbed.hostplumbing import cleanup_leftovers
from testbed.localcluster import ClusterError, LocalCluster
from testbed.localnode import LocalNode, NodeError, cuda_probe_image, install_driver_root
from testbed.nodeplugin import LocalNodePlugin, NodePluginError
from testbed.podprobe import ContainerView, for_local_node, parse_probe

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
NVIDIA_MAJOR = 195
NVIDIACTL = ("/dev/nvidiactl", (NVIDIA_MAJOR, 255))

# One node for every scenario: GPU 0 whole or dynamic MIG; 1 also four MPS slots; 2 whole or four time-slicing
# slots; 3 memory shares; 4 static MIG with a 2g.20gb and a 3g.40gb partition (no 1g.10gb, so the mig-partition
# example always gets a dynamic one); modules may add GPUs from index 5 on (fleet_node extra).
STATIC_MIG = [{"profile": "2g.20gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]


def fleet_node(name: str, extra: Sequence[tuple[dict[str, Any], dict[str, Any]]] = ()) -> dict[str, Any]:
    """The real node's GPUs and policy; ``extra``: further GPUs (one each, indexes 5 on) with their policy."""
    return {
        "name": name,
        "gpus": [{"model": "H100-80GB", "count": 4},
                 {"model": "H100-80GB", "count": 1, "mig": {"enabled": True, "instances": STATIC_MIG}},
                 *(gpu for gpu, _ in extra)],
        "policy": {
            "default": {"wholeGpu": True, "mig": "dynamic"},
            "rules": [
                {"match": {"index": 1}, "wholeGpu": True, "mig": "dynamic", "slots": {"count": 4, "strategy": "mps"}},
                {"match": {"index": 2}, "wholeGpu": True, "mig": "none",
                 "slots": {"count": 4, "strategy": "time-slicing"}},
                {"match": {"index": 3}, "wholeGpu": False, "mig": "none",
                 "memoryShares": {"minimum": "1Gi", "step": "1Gi"}},
                {"match": {"index": 4}, "wholeGpu": False, "mig": "static"},
                *({"match": {"index": 5 + i}, **policy} for i, (_, policy) in enumerate(extra)),
            ],
        },
    }


class RealNode:
    """A LocalCluster, a LocalNode and the plugins running for it. `start` fails the test (never skips).
    `cluster_options` go to LocalCluster (e.g. service_accounts=True), `labels` to the node's kubelet,
    `node_options` to LocalNode (e.g. registry_cas)."""

    def __init__(self, kubelet_config: dict[str, Any] | None = None, *,
                 cluster_options: dict[str, Any] | None = None, labels: dict[str, str] | None = None,
                 extra_gpus: Sequence[tuple[dict[str, Any], dict[str, Any]]] = (),
                 node_options: dict[str, Any] | None = None) -> None:
        self.kubelet_config = kubelet_config
        self.node_options = dict(node_options or {})
        self.extra_gpus = list(extra_gpus)
        self.cluster_options = dict(cluster_options or {})
        self.labels = dict(labels or {})
        self.cluster: LocalCluster | None = None
        self.node: LocalNode | None = None
        self.api_client: Any = None
        self.kube: KubeApi | None = None
        self.fleet: Path | None = None
        self.plugins: list[LocalNodePlugin] = []

    def start(self) -> "RealNode":
        try:
            cleanup_leftovers()
            self.cluster = LocalCluster(**self.cluster_options).start()
            self.node = LocalNode(self.cluster, labels=self.labels, kubelet_config=self.kubelet_config,
                                  **self.node_options).start()
        except ClusterError as exc:  # NodeError included
            self.stop()
            pytest.fail(f"the real node did not start: {exc}", pytrace=False)
        assert self.node.workdir is not None
        self.fleet = self.node.workdir / "fleet.yaml"
        self.fleet.write_text(yaml.safe_dump({"nodes": [fleet_node(self.node.name, self.extra_gpus)]},
                                             sort_keys=False))
        self.api_client = self.cluster.api_client()
        self.kube = KubeApi(self.api_client)
        return self

    @contextmanager
    def running(self, classes: bool = True) -> Iterator["RealNode"]:
        """Started, with our DeviceClasses unless ``classes`` is false, for the ``with`` block and stopped after
        it: the whole body of a module's node fixture."""
        self.start()
        try:
            if classes:
                self.add_classes()
            yield self
        finally:
            self.stop()

    def stop(self) -> None:
        """Plugins first (their files are in the node's work dir), then the node and the cluster."""
        for plugin in self.plugins:
            plugin.stop()
        self.plugins.clear()
        if self.api_client is not None:
            self.api_client.close()
            self.api_client = None
        try:
            if self.node is not None:
                self.node.stop()
        finally:
            if self.cluster is not None:
                self.cluster.stop()

    # ---- plugins ----------------------------------------------------------------------------------

    def add_classes(self, compat_nvidia: bool = False, driver: str = DEFAULT_DRIVER_NAME) -> None:
        assert self.kube is not None
        classes = device_classes(compat_nvidia=True) if compat_nvidia else device_classes(driver)
        for cls in classes:
            try:
                self.kube.create(DEVICE_CLASSES, cls)
            except ApiError as exc:
                if not exc.conflict:
                    raise

    def plugin(self, driver: str = DEFAULT_DRIVER_NAME, *extra_args: str, layout: str = "host") -> LocalNodePlugin:
        """A plugin process for this node (not started); stopped with the node. Its driver root gets the CUDA
        stand-in in `layout` (dra.sim.driverlayout.LAYOUTS)."""
        assert self.node is not None and self.fleet is not None
        plugin = LocalNodePlugin(self.node, self.fleet, driver, extra_args=extra_args)
        self.plugins.append(plugin)
        try:
            install_driver_root(plugin.driver_root, self.node.bin_dir, layout, fleet=self.fleet,
                                node_name=self.node.name)
        except NodeError as exc:
            pytest.fail(str(exc), pytrace=False)
        return plugin

    def start_plugin(self, plugin: LocalNodePlugin, timeout: float = 60.0) -> LocalNodePlugin:
        """Starts it and waits until the kubelet registered it and its slices are complete."""
        plugin.start()
        try:
            plugin.wait_registered(timeout)
        except NodePluginError as exc:
            pytest.fail(str(exc), pytrace=False)
        self.wait_for_slices(plugin)
        return plugin

    def start_metrics_plugin(self, driver: str = DEFAULT_DRIVER_NAME) -> LocalNodePlugin:
        """A started plugin that reads the kubelet's PodResources socket (which container holds which claim
        device), as the per-claim metrics need."""
        assert self.node is not None
        socket = self.node.root_dir / "pod-resources" / "kubelet.sock"
        plugin = self.start_plugin(self.plugin(driver, "--pod-resources-socket", str(socket)))
        assert socket.is_socket(), f"the kubelet serves no PodResources socket at {socket}"
        return plugin

    def wait_for_slices(self, plugin: LocalNodePlugin, timeout: float = 60.0) -> list[dict[str, Any]]:
        assert self.kube is not None and self.node is not None

        def ready() -> list[dict[str, Any]] | None:
            plugin.check_alive()
            slices = node_slices(self.kube, plugin.driver, self.node.name)
            return slices if complete_pool(slices) else None

        return wait_until(ready, timeout, f"ResourceSlices of {plugin.driver} on {self.node.name}")

    def devices(self, plugin: LocalNodePlugin) -> dict[str, dict[str, Any]]:
        """Published devices by name, attributes flattened to plain values."""
        return {d["name"]: {k: next(iter(v.values())) for k, v in (d.get("attributes") or {}).items()}
                for d in slice_devices(self.wait_for_slices(plugin))}

    # ---- namespaces and pods ----------------------------------------------------------------------

    def namespace(self, name: str) -> str:
        assert self.kube is not None
        self.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        if self.cluster is not None and self.cluster.service_accounts:
            # ServiceAccount admission refuses pods until the controller-manager has made the default account.
            wait_until(lambda: self.exists(f"/api/v1/namespaces/{name}/serviceaccounts/default"), 30,
                       f"the default ServiceAccount of namespace {name}")
        return name

    def exists(self, path: str) -> bool:
        assert self.kube is not None
        try:
            self.kube.get(path)
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return True

    def apply(self, namespace: str, objects: list[dict[str, Any]]) -> list[str]:
        """Creates the objects, pods made runnable here and pinned to the node; returns the pod names."""
        assert self.kube is not None and self.node is not None
        pods = []
        order = {"ResourceClaimTemplate": 0, "ResourceClaim": 1, "Pod": 2}
        for obj in sorted(objects, key=lambda o: order.get(o["kind"], 9)):
            if obj["kind"] == "Pod":
                obj = for_local_node(obj, cuda_probe_image(), self.node.name)
                pods.append(obj["metadata"]["name"])
            create(self.kube, namespace, obj)
        return pods

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        assert self.kube is not None
        return self.kube.get(f"{namespaced_collection('Pod', namespace)}/{name}")

    def wait_running(self, namespace: str, name: str, timeout: float = 60.0) -> dict[str, Any]:
        """The pod once Running with every container's probe complete; fails with the pod's events if not."""
        assert self.node is not None
        deadline = time.monotonic() + timeout
        pod: dict[str, Any] = {}
        while time.monotonic() < deadline:
            pod = self.pod(namespace, name)
            phase = pod.get("status", {}).get("phase")
            if phase == "Running" and all(self.view(namespace, name, c["name"]).complete
                                          for c in pod["spec"]["containers"]):
                self.check_cdi_specs(namespace, pod)
                return pod
            if phase in ("Failed", "Succeeded"):
                break
            self.node.check_running()
            time.sleep(0.3)
        raise AssertionError(f"pod {namespace}/{name} not Running with its probes done within {timeout:.0f}s "
                             f"(phase {pod.get('status', {}).get('phase')}); events:\n{self.events(namespace, name)}\n"
                             f"{self.node.logs_tail(10)}\n" + "\n".join(
                                 f"--- plugin {p.driver} ---\n{p.log_tail(15)}" for p in self.plugins))

    def view(self, namespace: str, pod: str, container: str) -> ContainerView:
        assert self.node is not None
        try:
            return parse_probe(self.node.container_log(namespace, pod, container))
        except NodeError:
            return ContainerView()   # no log file yet

    def events(self, namespace: str, pod: str) -> str:
        assert self.kube is not None
        items = self.kube.list(f"/api/v1/namespaces/{namespace}/events",
                               field_selector=f"involvedObject.name={pod}")["items"]
        return "\n".join(f"{e.get('type')} {e.get('reason')}: {e.get('message')}" for e in items)

    def delete_pod(self, namespace: str, name: str, timeout: float = 60.0) -> None:
        """Deletes the pod and waits until the kubelet has stopped it and the API object is gone."""
        assert self.kube is not None
        try:
            self.kube.request("DELETE", f"{namespaced_collection('Pod', namespace)}/{name}")
        except ApiError as exc:
            if not exc.not_found:
                raise
        wait_until(lambda: get(self.kube, "Pod", namespace, name) is None, timeout,  # type: ignore[arg-type]
                   f"pod {namespace}/{name} to be gone")

    def claim_of(self, namespace: str, pod: dict[str, Any], pod_claim: str) -> dict[str, Any]:
        """The ResourceClaim behind one of the pod's resourceClaims entries."""
        assert self.kube is not None
        ref = next(c for c in pod["spec"]["resourceClaims"] if c["name"] == pod_claim)
        name = ref.get("resourceClaimName") or next(
            s["resourceClaimName"] for s in pod["status"]["resourceClaimStatuses"] if s["name"] == pod_claim)
        return self.kube.get(f"{namespaced_collection('ResourceClaim', namespace)}/{name}")

    # ---- what the plugin left on the node ---------------------------------------------------------

    def check_cdi_specs(self, namespace: str, pod: dict[str, Any]) -> None:
        """The running pod's claims have their CDI specs on the node, and the CDI reference library loads them."""
        for ref in pod["spec"].get("resourceClaims") or []:
            uid = self.claim_of(namespace, pod, ref["name"])["metadata"]["uid"]
            files = self.cdi_files(uid)
            assert files, f"pod {namespace}/{pod['metadata']['name']} runs but claim {uid} has no CDI spec"
            cdivalidate.check_files(files)

    def cdi_files(self, uid: str | None = None) -> list[Path]:
        """CDI spec files in the node's CDI directory (those naming the claim `uid`, when given)."""
        assert self.node is not None
        files = sorted(p for p in Path(self.node.cdi_dirs[0]).iterdir() if p.is_file())
        return [p for p in files if uid is None or uid in p.name]

    @staticmethod
    def checkpoint_claims(plugin: LocalNodePlugin) -> dict[str, Any]:
        """The plugin's checkpointed claims by UID, as raw records: the snapshot with its journal replayed
        (read again if the plugin folded the journal into a new snapshot meanwhile)."""
        snapshot = plugin.state_dir / "checkpoint.json"
        journal = snapshot.with_name(snapshot.name + ".journal")
        for _ in range(5):
            before = _identity(snapshot)
            claims = dict(json.loads(snapshot.read_text()).get("claims") or {}) if before else {}
            try:
                lines = journal.read_text().split("\n")[:-1]   # after the last newline: a write in progress
            except FileNotFoundError:
                lines = []
            if _identity(snapshot) != before:
                continue
            for line in filter(str.strip, lines):
                op = json.loads(line)
                if isinstance(op.get("put"), dict):
                    claims[op["put"]["uid"]] = op["put"]
                elif "remove" in op:
                    claims.pop(op["remove"], None)
            return claims
        raise AssertionError(f"the checkpoint {snapshot} kept changing while being read")

    def hardware(self, plugin: LocalNodePlugin) -> Any:
        """The node's simulated GPUs as the plugin left them (a FakeNvml over its --sim-state file)."""
        from dra.sim.fleet import load_fleet, nvml_for_node

        assert self.fleet is not None and self.node is not None
        nvml = nvml_for_node(load_fleet(self.fleet).node(self.node.name), state_file=plugin.sim_state)
        nvml.nvmlInit()
        return nvml

    def mig_devices(self, plugin: LocalNodePlugin) -> list[Any]:
        from dra.node import migdevices

        nvml = self.hardware(plugin)
        return [m for uuid in nvml.gpu_uuids for m in migdevices.list_mig_devices(nvml, uuid)]

    def wait_unprepared(self, plugin: LocalNodePlugin, uids: list[str], timeout: float = 30.0) -> None:
        """Waits until the claims are gone from the plugin's checkpoint and their CDI specs are removed."""
        def done() -> bool:
            claims = self.checkpoint_claims(plugin)
            return not any(u in claims for u in uids) and not any(self.cdi_files(u) for u in uids)

        try:
            wait_until(done, timeout, f"claims {uids} to be unprepared")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- plugin ---\n{plugin.log_tail(20)}") from None


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns)


def simulate(plugin: LocalNodePlugin, *args: str) -> str:
    """``gpu-dra simulate ...`` on the plugin's simulated-GPU state file, as its own process."""
    proc = subprocess.run([sys.executable, "-m", "cli.main", "simulate", *args, "--sim-state", str(plugin.sim_state)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"gpu-dra simulate {' '.join(args)} failed:\n{proc.stderr}"
    return proc.stdout


def load_objects(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]
