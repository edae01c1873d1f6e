"""The API server goes away in the middle of a prepare loop (its process is stopped, then continued): claims
read meanwhile fail alone as "unavailable" (one line, no traceback, the kubelet retries), the plugin needs no
restart, and once the API server is back every claim prepares; nothing is left afterwards. Prints tried /
survived / leaked."""
from __future__ import annotations

import os
import signal
import time

import structlog
from driver_node import Node

from bench.plugin_api import DRIVER, GPUS, NAMESPACE, NODE, allocated_claims
from dra.node.cdi import CdiSpecWriter
from dra.node.checkpoint import CheckpointStore
from dra.node.sharing import MpsDaemons, TimeSlicing
from kube.client import KubeApi
from kubeletplugin.claims import KubernetesClaimSource
from kubeletplugin.driver import Driver
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.transport.nodedriver import ClaimRef
from testbed.localcluster import LocalCluster


def test_an_api_server_outage_in_a_prepare_loop_fails_claims_cleanly_and_recovers(tmp_path, caplog) -> None:
    cluster = LocalCluster(workdir=tmp_path / "cluster")
    cluster.start()
    try:
        cluster.add_node(NODE)
        kube = KubeApi(cluster.api_client())
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        claims = [ClaimRef(namespace=NAMESPACE, name=n, uid=u) for n, u in allocated_claims(kube, GPUS)]
        node = Node(tmp_path / "node", {"default": {"wholeGpu": True}}, gpus=[{"model": "L4", "count": GPUS}])
        metrics = PluginMetrics()
        driver = Driver(driver_name=DRIVER, pool_name=NODE, devices=node.model.by_name,
                        claims=KubernetesClaimSource(cluster.api_client(), timeout_s=1.0),
                        checkpoint=CheckpointStore(tmp_path / "state" / "checkpoint.json", boot_id_path=node.boot_id),
                        cdi=CdiSpecWriter(tmp_path / "cdi", node.tree.driver_root()), nvml=node.nvml,
                        mps=MpsDaemons(node.control, tmp_path / "state"), time_slicing=TimeSlicing(node.control),
                        metrics=metrics)
        driver.start()
        apiserver = cluster.component_pids()["kube-apiserver"]
        counts = {"tried": 0, "survived": 0, "unavailable": 0}
        internal = []
        with structlog.testing.capture_logs() as logs:
            for i, ref in enumerate(claims):
                if i == 8:
                    os.killpg(apiserver, signal.SIGSTOP)          # away: connections hang, then time out
                if i == 14:
                    os.killpg(apiserver, signal.SIGCONT)
                    time.sleep(1.0)
                error = driver.prepare([ref])[ref.uid].error
                counts["tried"] += 1
                if not error:
                    counts["survived"] += 1
                elif "unavailable" in error:
                    counts["unavailable"] += 1
                else:
                    internal.append(error)
        assert counts["unavailable"] >= 5 and internal == []
        assert not any(e.get("exc_info") or "Traceback" in str(e) for e in logs)   # one line each, no traceback
        assert metrics.prepare_errors.labels(reason="unavailable")._value.get() == counts["unavailable"]
        again = driver.prepare(claims)                            # the kubelet retries: all prepare now
        assert [r.error for r in again.values() if r.error] == []
        assert [r.error for r in driver.unprepare(claims).values() if r.error] == []
        leaked = list(driver.checkpoint.claims()) + list(driver.cdi.list_claim_specs())
        print(f"\noutage: tried {counts['tried']}, prepared {counts['survived']}, unavailable "
              f"{counts['unavailable']}, internal {len(internal)}, leaked {len(leaked)}")
        assert leaked == []
        driver.close()
    finally:
        try:
            os.killpg(cluster.component_pids()["kube-apiserver"], signal.SIGCONT)
        except (KeyError, ProcessLookupError):
            pass
        cluster.stop()
