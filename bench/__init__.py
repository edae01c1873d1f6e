"""Speed and memory targets of gpu-dra-driver: ``python -m bench`` (see bench/README.md).

Each benchmark is a module with ``NAME``, ``DESCRIPTION`` and ``run(params) -> list[Figure]``; the targets
live in ``bench/targets.yaml``.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# name -> module, in the order they run
BENCHMARKS: dict[str, str] = {
    "slices": "bench.slices",
    "validate": "bench.validation",
    "mig": "bench.migcycle",
    "prepare": "bench.prepare",
    "plugin": "bench.plugin_api",
    "reconcile": "bench.reconcile",
    "publish": "bench.publish",
    "status": "bench.status",
    "scheduler": "bench.scheduler",
    "controlloops": "bench.controlloops",
    "tenancy": "bench.tenancy",
}
# Benchmarks that run a real node (root, the node binaries): their smoke test is an end-to-end test.
REAL_NODE = frozenset({"tenancy"})
# Run only when asked for with what they need: `peer` with --peer-bin (the Go reference driver's kubelet plugin,
# built by hack/build-peer-driver.sh). Never part of a plain run or of the smoke test.
ON_REQUEST: dict[str, str] = {
    "peer": "bench.peer",
}


def load(name: str) -> ModuleType:
    return importlib.import_module(BENCHMARKS.get(name) or ON_REQUEST[name])
