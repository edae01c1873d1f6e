"""A kubelet plugin's claim work on one simulated node, for the tests that drive it directly: FakeNvml GPUs,
simulated sharing tools, a fake driver root and claims from a dict, behind a real Driver over a state directory.
Helpers to write the claims' opaque configs and to prepare one claim that must succeed come with it."""
from __future__ import annotations

import uuid as uuidlib
from pathlib import Path
from typing import Any

from claims import reserved, resource_claim
from fixtures.fake_driver_root import build_fake_driver_root

from dra.model.devices import build_devices
from dra.model.policy import parse_node_policy
from dra.node import migdevices as mig
from dra.node.cdi import CdiSpecWriter, load_spec
from dra.node.checkpoint import CheckpointStore
from dra.node.inventory import discover
from dra.node.sharing import MpsDaemons, TimeSlicing
from dra.sim.fleet import nvml_for_node, parse_fleet
from dra.sim.sharingtools import SimulatedSharingControl
from kubeletplugin.claims import DictClaimSource
from kubeletplugin.driver import Driver
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.transport.nodedriver import ClaimRef

DRIVER = "gpu.dra-driver.io"
NODE = "node-a"
CDI_KIND = "k8s.gpu.dra-driver.io/claim"


class Node:
    """One simulated node: hardware that outlives plugin restarts, and a driver over a state directory."""

    def __init__(self, base: Path, policy: dict[str, Any], gpus: list[dict[str, Any]] | None = None,
                 time_slice_unsupported: bool = False, state_file: Path | None = None):
        fleet = parse_fleet({"nodes": [{"name": NODE, "gpus": gpus or [{"model": "H100-80GB", "count": 2}]}]})
        self.fleet_node = fleet.node(NODE)
        self.state_file = state_file      # simulated GPUs kept in a file: a restart can be a new process
        self.nvml = nvml_for_node(self.fleet_node, state_file=state_file)
        self.nvml.nvmlInit()
        self.inventory = discover(self.nvml)
        self.policy = parse_node_policy(policy, "test policy")
        self.model = build_devices(self.inventory, self.policy, driver=DRIVER)
        self.uuids = [g.uuid for g in self.inventory.gpus]
        self.tree = build_fake_driver_root(base / "host", gpu_minors=tuple(g.minor for g in self.inventory.gpus))
        for g in self.inventory.gpus:
            for gi in range(15):  # GPU-instance ids follow the placement: 0..14 on 8-slice GPUs
                self.tree.add_mig(g.minor, gi, 0)
        self.control = SimulatedSharingControl(
            nvml=self.nvml, time_slice_unsupported=self.uuids if time_slice_unsupported else ())
        self.state = base / "state"
        self.cdi_dir = base / "cdi"
        self.boot_id = base / "boot_id"
        self.boot_id.write_text("boot-1\n")
        self.claims = DictClaimSource()
        self.metrics = PluginMetrics()
        self.driver = self.new_driver()

    def new_driver(self) -> Driver:
        """A fresh plugin process on the same state: new objects, same files and hardware."""
        d = Driver(
            driver_name=DRIVER, pool_name=NODE, devices=self.model.by_name, claims=self.claims,
            checkpoint=CheckpointStore(self.state / "checkpoint.json", boot_id_path=self.boot_id),
            cdi=CdiSpecWriter(self.cdi_dir, self.tree.driver_root()), nvml=self.nvml,
            mps=MpsDaemons(self.control, self.state, policy=self.policy.mps), time_slicing=TimeSlicing(self.control),
            metrics=self.metrics)
        self.startup = d.start()
        return d

    def restart(self) -> Driver:
        self.driver.close()
        self.driver = self.new_driver()
        return self.driver

    def restart_process(self) -> Driver:
        """A new plugin process: even NVML is new and knows the GPUs only from the state file."""
        assert self.state_file is not None
        self.driver.close()
        self.nvml = nvml_for_node(self.fleet_node, state_file=self.state_file)
        self.nvml.nvmlInit()
        self.control.nvml = self.nvml
        self.driver = self.new_driver()
        return self.driver

    def add_claim(self, name: str, results: list[dict[str, Any]], config: list[dict[str, Any]] | None = None,
                  uid: str | None = None, namespace: str = "default") -> ClaimRef:
        uid = uid or str(uuidlib.uuid4())
        full = []
        for r in results:
            r = dict(r)
            r.setdefault("driver", DRIVER)
            r.setdefault("pool", NODE)
            full.append(r)
        self.claims.put(resource_claim(name, namespace, uid=uid, requests=[], results=full,
                                       allocation_config=config or [],
                                       reserved_for=reserved((f"{name}-pod", "pod-" + uid[:8]))))
        return ClaimRef(namespace=namespace, uid=uid, name=name)

    def spec_of(self, ref: ClaimRef) -> dict[str, Any]:
        return load_spec(self.driver.cdi.spec_path(ref.uid))

    def mig_devices(self, gpu: int = 0) -> list[mig.MigLive]:
        return mig.list_mig_devices(self.nvml, self.uuids[gpu])


def opaque(parameters: dict[str, Any], requests: list[str] | None = None, source: str = "FromClaim",
           driver: str = DRIVER) -> dict[str, Any]:
    entry: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": parameters}}
    if requests:
        entry["requests"] = requests
    return entry


def gpu_config(**sharing: Any) -> dict[str, Any]:
    return {"apiVersion": "gpu.dra-driver.io/v1alpha1", "kind": "GpuConfig", "sharing": sharing}


def ok(driver: Driver, ref: ClaimRef):
    result = driver.prepare([ref])[ref.uid]
    assert result.error == "", result.error
    return result


# A node policy of four MPS slots per GPU, and a claim allocated one of them.
SLOTS = {"wholeGpu": False, "slots": {"count": 4, "strategy": "mps"}}


def slot_claim(node: Node, name: str, slot: int, namespace: str = "default", gpu: int = 0,
               config: list | None = None) -> ClaimRef:
    return node.add_claim(name, [{"request": "s", "device": f"gpu-{gpu}-slot-{slot}"}], config, namespace=namespace)
