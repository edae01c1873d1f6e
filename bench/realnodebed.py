"""The set-up the real-node benchmarks share: a LocalCluster, one real node (kubelet, containerd, runc) and, once a
benchmark starts it, `gpu-dra kubelet-plugin` for the node's simulated GPUs; stopped in reverse order."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kube.client import KubeApi
from testbed.hostplumbing import cleanup_leftovers
from testbed.localcluster import LocalCluster
from testbed.localnode import LocalNode
from testbed.nodeplugin import LocalNodePlugin


class RealNodeBed:
    def __init__(self, work: Path) -> None:
        self.cluster = LocalCluster(workdir=work / "cluster")
        self.node: LocalNode | None = None
        self.plugin: LocalNodePlugin | None = None
        self.kube: KubeApi | None = None

    def start_node(self, fleet: dict[str, list[dict[str, Any]]] | None = None, **node_args: Any) -> Path:
        """Starts the cluster and the node (`node_args` go to LocalNode) after removing what an earlier run left;
        writes the fleet of the node's one entry `fleet` (its GPUs: {"gpus": [...]}) and returns its path."""
        cleanup_leftovers()
        self.cluster.start()
        self.kube = KubeApi(self.cluster.api_client())
        self.node = LocalNode(self.cluster, **node_args).start()
        assert self.node.workdir is not None
        path = self.node.workdir / "fleet.yaml"
        path.write_text(yaml.safe_dump({"nodes": [{"name": self.node.name, **(fleet or {})}]}, sort_keys=False))
        return path

    def stop(self) -> None:
        if self.plugin is not None:
            self.plugin.stop()
        try:
            if self.node is not None:
                self.node.stop()
        finally:
            self.cluster.stop()
