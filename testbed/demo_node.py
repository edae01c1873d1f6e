"""The demo's real nodes: nodes of the fleet run a real kubelet, containerd and runc each (`testbed.localnode`:
own work dir, sockets, ports, cgroup root and CDI directory) and `gpu-dra kubelet-plugin` for their simulated GPUs
(`testbed.nodeplugin`), so the example pods that the scheduler puts there actually run; each prints what its
container sees (`testbed.podprobe`), the devices libcuda and NVML show it included: each plugin's driver root
holds the CUDA stand-in laid out as a host driver install.

When a node cannot start (not root, no cgroups, the node binaries cannot be built) the demo goes on without
it and says why in one line (`RealNodeUnavailable`); its pods stay Pending.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kube.client import namespaced_collection
from testbed.demo_examples import PodClaim
from testbed.hostplumbing import NodeError
from testbed.localcluster import ClusterError
from testbed.localnode import LocalNode, install_driver_root
from testbed.nodeplugin import LocalNodePlugin, NodePluginError
from testbed.podprobe import ContainerView, parse_probe

PLUGIN_TIMEOUT = 60.0


class RealNodeUnavailable(RuntimeError):
    """The real node could not be started; the message is one line saying why."""


def one_line(exc: BaseException) -> str:
    """The first line of an error (node errors carry log tails after it)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass
class RealNode:
    """A started LocalNode and, once `start_plugin` ran, its kubelet plugin."""

    node: LocalNode
    plugin: LocalNodePlugin | None = None

    @property
    def name(self) -> str:
        return self.node.name

    @classmethod
    def start(cls, cluster: Any, name: str, labels: dict[str, str] | None = None) -> "RealNode":
        """Starts the kubelet and containerd of node `name` (it registers its Node itself)."""
        node = LocalNode(cluster, name=name, labels=labels)
        try:
            node.start()
        except ClusterError as exc:   # NodeError included; start() has cleaned up after itself
            raise RealNodeUnavailable(one_line(exc)) from exc
        return cls(node)

    def start_plugin(self, fleet: Path, driver: str) -> LocalNodePlugin:
        """`gpu-dra kubelet-plugin` for this node, registered with its kubelet. Raises NodePluginError."""
        self.plugin = LocalNodePlugin(self.node, fleet, driver, log_level="warning")
        try:
            install_driver_root(self.plugin.driver_root, self.node.bin_dir, "host", fleet=fleet, node_name=self.name)
        except NodeError as exc:
            raise NodePluginError(str(exc)) from exc
        self.plugin.start()
        self.plugin.wait_registered(PLUGIN_TIMEOUT)
        return self.plugin

    def stop(self) -> None:
        """The plugin, then the node: its containers (and any MPS daemon of the plugin) stop, the host is put
        back as found and the Node object is deleted."""
        if self.plugin is not None:
            self.plugin.stop()
        self.node.stop()


def start_real_nodes(cluster: Any, names: Sequence[str], labels: dict[str, str],
                     start: Callable[..., RealNode] | None = None) -> dict[str, RealNode | RealNodeUnavailable]:
    """Starts the nodes `names` at once (their containerd and kubelet start-ups overlap, which halves the wait
    on a small machine) with `start` (default `RealNode.start`): name -> the started node, or why it could not
    start."""
    if not names:
        return {}
    starter = start or RealNode.start

    def one(name: str) -> RealNode | RealNodeUnavailable:
        try:
            return starter(cluster, name, labels)
        except RealNodeUnavailable as exc:
            return exc

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        return dict(zip(names, pool.map(one, names)))


@dataclass
class PodRun:
    """One example pod as the cluster and, on the real node, its containers report it."""

    phase: str
    node: str | None
    views: dict[str, ContainerView] = field(default_factory=dict)   # container -> what it saw (real node only)


def wait_for_pods(kube: Any, reals: Sequence[RealNode], namespace: str, pods: list[str],
                  timeout: float) -> dict[str, PodRun]:
    """Every pod's phase; pods bound to a real node are waited for until Running with every container's
    probe done (or `timeout`), the others are read once."""
    by_name = {r.name: r for r in reals}
    deadline = time.monotonic() + timeout
    runs: dict[str, PodRun] = {}
    while True:
        runs = {}
        for name in pods:
            pod = kube.get(f"{namespaced_collection('Pod', namespace)}/{name}")
            node = pod["spec"].get("nodeName")
            run = PodRun(pod.get("status", {}).get("phase", "Unknown"), node)
            real = by_name.get(node or "")
            if real is not None and run.phase == "Running":
                for c in pod["spec"]["containers"]:
                    try:
                        run.views[c["name"]] = parse_probe(real.node.container_log(namespace, name, c["name"]))
                    except NodeError:
                        run.views[c["name"]] = ContainerView()
            runs[name] = run
        waiting = [r for r in runs.values() if r.node in by_name and
                   (r.phase != "Running" or not all(v.complete for v in r.views.values()))]
        if not waiting or time.monotonic() >= deadline:
            return runs
        time.sleep(0.3)


@dataclass
class NodeCdiSpec:
    """A CDI spec the plugin wrote on the real node when the kubelet prepared a claim."""

    claim: PodClaim
    cdi_device_ids: list[str]
    spec_path: Path
    spec_text: str


def prepared_cdi_spec(real: RealNode, claim: PodClaim) -> NodeCdiSpec | None:
    """The CDI spec of `claim` in the real node's CDI directory (None when there is none)."""
    if not claim.uid:
        return None
    specs = sorted(p for p in Path(real.node.cdi_dirs[0]).iterdir() if p.is_file() and claim.uid in p.name)
    if not specs:
        return None
    text = specs[0].read_text()
    try:
        doc = json.loads(text)
    except ValueError:
        import yaml

        doc = yaml.safe_load(text)
    ids = [f"{doc['kind']}={d['name']}" for d in doc.get("devices") or []]
    return NodeCdiSpec(claim, ids, specs[0], text)


__all__ = ["NodePluginError", "NodeCdiSpec", "PodRun", "RealNode", "RealNodeUnavailable", "one_line",
           "prepared_cdi_spec", "start_real_nodes", "wait_for_pods"]
