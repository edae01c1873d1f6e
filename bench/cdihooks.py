"""What the CDI hooks of our specs cost a container's start, on the real node: ``python -m bench.cdihooks``.

A one-off measurement (root and ``make node-binaries``, as the real-node tests; it takes the e2e lock's place as
a benchmark does), not part of ``make bench``. One local control plane and one real node (kubelet, containerd,
runc) with five ``gpu-dra kubelet-plugin`` processes at once, each its own driver name for 2 simulated L4 GPUs,
differing only in the driver root and the hook program they name in their specs:

=========  ==============================  ====================================================================
variant    driver root                     hooks in every spec (createContainer)
=========  ==============================  ====================================================================
host-3     the stand-in in the host layout create-symlinks, update-ldcache, disable-device-node-modification
host-0     the same                        none (no hook program: each soname link bind-mounted instead)
empty-1    empty (the testbed's default)   disable-device-node-modification
empty-0    empty                           none
timed-3    the host layout                 the three, each through a wrapper that logs its wall time
=========  ==============================  ====================================================================

Pods (the cuda-probe image: Debian's glibc, as a CUDA image) are created round-robin over the variants, each
deleted and its claim unprepared before the next. Per variant: containerd's StartContainer (its log: runc's
create, where createContainer hooks run, and start) and create → Running; each hook variant against its hook-less
twin as a paired difference over rounds; from ``timed-3`` each hook's own wall time as runc ran it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from api.deviceclasses import device_classes
from bench import pairstats
from bench.containerdlog import start_container_seconds
from bench.peer import kubelet_samples
from kube.client import DEVICE_CLASSES, RESOURCE_V1, KubeApi
from testbed.hostplumbing import cleanup_leftovers
from testbed.localcluster import LocalCluster
from testbed.localnode import LocalNode, cuda_probe_image, install_driver_root
from testbed.nodeplugin import LocalNodePlugin

# variant -> (driver root layout or None for empty, hook: "real", "none" or "timed")
VARIANTS: dict[str, tuple[str | None, str]] = {
    "host-3": ("host", "real"), "host-0": ("host", "none"), "empty-1": (None, "real"), "empty-0": (None, "none"),
    "timed-3": ("host", "timed"),
}
TWINS = (("host-3", "host-0"), ("empty-1", "empty-0"))
POLL_S = 0.01


class _Plugin(LocalNodePlugin):
    """A node plugin whose specs name ``hook`` (None: no hook program at all)."""

    hook: str | None = None

    def argv(self) -> list[str]:
        argv = super().argv()
        i = argv.index("--cdi-hook-path")
        if self.hook is None:
            del argv[i:i + 2]
        else:
            argv[i + 1] = self.hook
        return argv


def timing_wrapper(path: Path, hook: Path, log: Path) -> Path:
    """A hook program that runs ``hook`` with its arguments and appends "<subcommand> <ns>" to ``log``. runc runs
    createContainer hooks before the container's root is pivoted, so host paths resolve; a hook's environment is
    the spec's (none here), hence the PATH."""
    path.write_text(f"""#!/bin/sh
PATH=/usr/bin:/bin
s=$(date +%s%N)
{hook} "$@"
rc=$?
e=$(date +%s%N)
echo "$1 $((e - s))" >> {log}
exit $rc
""")
    path.chmod(0o755)
    return path


def driver_name(variant: str) -> str:
    return f"{variant}.hooks.example.com"


def _pod(node: LocalNode, name: str, template: str) -> dict[str, Any]:
    pod = node.pod_manifest(name, ["sh", "-c", "trap 'exit 0' TERM; sleep 86400 & wait"], namespace="hooks",
                            image=cuda_probe_image(),
                            resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": template}])
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return pod


def measure(rounds: int, work: Path) -> dict[str, Any]:
    cluster = LocalCluster(workdir=work / "cluster")
    node: LocalNode | None = None
    plugins: dict[str, _Plugin] = {}
    results: dict[str, Any] = {"running": defaultdict(list), "start": defaultdict(list), "hooks": defaultdict(list),
                               "specs": {}}
    try:
        cleanup_leftovers()
        cluster.start()
        kube = KubeApi(cluster.api_client())
        node = LocalNode(cluster, cdi_dirs=[work / "cdi"]).start()
        assert node.workdir is not None
        fleet = node.workdir / "fleet.yaml"
        fleet.write_text(yaml.safe_dump({"nodes": [{"name": node.name, "gpus": [{"model": "L4", "count": 2}]}]}))
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "hooks"}})
        hook_log = node.workdir / "hook-times.log"
        for variant, (layout, hook) in VARIANTS.items():
            driver = driver_name(variant)
            for cls in device_classes(driver):
                kube.create(DEVICE_CLASSES, cls)
            kube.create(f"{RESOURCE_V1}/namespaces/hooks/resourceclaimtemplates", {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": variant},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": driver}}]}}}})
            plugin = _Plugin(node, fleet, driver, log_level="warning", extra_args=["--sim-state", "none"])
            plugin.hook = {"real": str(plugin.cdi_hook), "none": None,
                           "timed": str(timing_wrapper(plugin.base / "timed-hook", plugin.cdi_hook, hook_log))}[hook]
            if layout:
                install_driver_root(plugin.driver_root, node.bin_dir, layout, fleet=fleet, node_name=node.name)
            plugins[variant] = plugin
            plugin.start()
        for plugin in plugins.values():
            plugin.wait_registered(90)
        _wait_devices(kube, node.name, [driver_name(v) for v in VARIANTS])
        containers: dict[str, list[str]] = defaultdict(list)
        names = list(VARIANTS)
        for r in range(rounds + 1):                         # round 0 warms every variant up
            order = names[r % len(names):] + names[:r % len(names)]
            for variant in order:
                name = f"{variant}-{r}"
                seconds = _run_pod(kube, node, variant, name)
                cid = next(iter(node.container_ids("hooks", name).values()), "")
                if r == 0:
                    results["specs"][variant] = _hooks_in_specs(Path(node.cdi_dirs[0]), driver_name(variant))
                _delete(kube, node, variant, name)
                if r:
                    results["running"][variant].append(seconds)
                    containers[variant].append(cid)
        starts = start_container_seconds(node.containerd_log.read_text(errors="replace"))
        for variant, ids in containers.items():
            results["start"][variant] = [starts[c] for c in ids if c in starts]
        if hook_log.exists():
            for line in hook_log.read_text().splitlines():
                name, _, ns = line.partition(" ")
                results["hooks"][name].append(int(ns) / 1e9)
    finally:
        for plugin in plugins.values():
            plugin.stop()
        try:
            if node is not None:
                node.stop()
        finally:
            cluster.stop()
    return results


def _wait_devices(kube: KubeApi, node: str, drivers: Sequence[str]) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        slices = kube.list(f"{RESOURCE_V1}/resourceslices", field_selector=f"spec.nodeName={node}")["items"]
        if set(drivers) <= {s["spec"]["driver"] for s in slices if s["spec"].get("devices")}:
            return
        time.sleep(0.2)
    raise RuntimeError(f"not every variant's plugin published its devices within 90 s: {', '.join(drivers)}")


def _hooks_in_specs(cdi_dir: Path, driver: str) -> list[str]:
    """The hook subcommands the variant's spec files name (read while its pod runs)."""
    import json

    vendor = f"k8s.{driver}"
    found: list[str] = []
    for spec_file in sorted(cdi_dir.glob("*.json")):
        spec = json.loads(spec_file.read_text())
        if not str(spec.get("kind", "")).startswith(vendor + "/"):
            continue
        edits = [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec.get("devices", [])]
        for e in edits:
            found += [h["args"][1] if len(h.get("args", [])) > 1 else h["path"] for h in e.get("hooks") or []]
    return found


def _run_pod(kube: KubeApi, node: LocalNode, variant: str, name: str) -> float:
    path = f"/api/v1/namespaces/hooks/pods/{name}"
    started = time.perf_counter()
    kube.create("/api/v1/namespaces/hooks/pods", _pod(node, name, variant))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        phase = (kube.get(path).get("status") or {}).get("phase")
        if phase == "Running":
            return time.perf_counter() - started
        if phase in ("Failed", "Succeeded"):
            break
        time.sleep(POLL_S)
    raise RuntimeError(f"pod {name} did not run within 120 s\n{node.logs_tail()}")


def _delete(kube: KubeApi, node: LocalNode, variant: str, name: str) -> None:
    driver = driver_name(variant)
    before = pairstats.grpc_call_totals(kubelet_samples(node.ports["kubelet"]), driver, "NodeUnprepareResources")
    kube.request("DELETE", f"/api/v1/namespaces/hooks/pods/{name}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = pairstats.grpc_call_totals(kubelet_samples(node.ports["kubelet"]), driver, "NodeUnprepareResources")
        if now.count > before.count:
            return
        time.sleep(0.05)
    raise RuntimeError(f"pod {name}: its claim was not unprepared within 60 s")


def report(results: dict[str, Any]) -> str:
    med = statistics.median
    lines = ["| variant | hooks in its spec | StartContainer p50 (min–max) | create → Running p50 |", "|---|---|---|---|"]
    for variant in VARIANTS:
        start, running = results["start"][variant], results["running"][variant]
        hooks = ", ".join(results["specs"].get(variant) or []) or "none"
        lines.append(f"| {variant} | {hooks} | {med(start) * 1000:.1f} ms ({min(start) * 1000:.1f}–"
                     f"{max(start) * 1000:.1f}) | {med(running) * 1000:.0f} ms |")
    lines += ["", "| hooks against none, same layout | StartContainer: mean difference [95 % CI] | "
              "create → Running: mean difference [95 % CI] |", "|---|---|---|"]
    for with_hooks, without in TWINS:
        cells = []
        for what in ("start", "running"):
            a, b = results[what][with_hooks], results[what][without]
            n = min(len(a), len(b))
            d = pairstats.paired_difference([x * 1000 for x in a[:n]], [x * 1000 for x in b[:n]])
            cells.append(f"{d.difference:+.1f} ms [{d.low:+.1f}, {d.high:+.1f}]")
        lines.append(f"| {with_hooks} − {without} | {cells[0]} | {cells[1]} |")
    if results["hooks"]:
        lines += ["", "| hook (timed-3, as runc ran it) | wall time p50 (min–max) | runs |", "|---|---|---|"]
        for name, times in sorted(results["hooks"].items()):
            lines.append(f"| {name} | {med(times) * 1000:.1f} ms ({min(times) * 1000:.1f}–{max(times) * 1000:.1f}) "
                         f"| {len(times)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cdihooks", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="pods per variant after a warm-up round (default 15)")
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (a paired difference needs rounds)")
    if os.geteuid() != 0:
        print("python -m bench.cdihooks: runs a real node and needs root", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu-dra-bench-hooks-"))
    try:
        print(report(measure(args.rounds, work)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
