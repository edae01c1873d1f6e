"""The node side of the demo: `gpu-dra kubelet-plugin` for a simulated node, asked over its DRA socket to
prepare one allocated claim, as the kubelet would; the CDI spec it writes is what a container runtime reads.
The demo uses it when there is no real node (`testbed.demo_node`), whose kubelet would do this itself.

Each plugin runs as a subprocess with its own temporary directories (registry, plugin socket, CDI root,
state, an empty driver root). It publishes no ResourceSlices: a plugin publishes only once a kubelet has
confirmed its registration, and none watches this registry directory; the demo's fleet-wide publisher keeps
the node's slices.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.demo_examples import PodClaim

PREPARE_TIMEOUT = 45.0     # the kubelet's per-call timeout
_LOG_TAIL_LINES = 30


class NodePluginError(RuntimeError):
    """The plugin did not start, or the prepare call failed; the message says which and why."""


def node_plugin_available() -> bool:
    """True when this build has the kubelet plugin (its command and its process module)."""
    return all(importlib.util.find_spec(m) is not None for m in ("cli.kubeletplugin_cmd", "kubeletplugin.plugin"))


@dataclass
class PreparedClaim:
    claim: PodClaim
    cdi_device_ids: list[str]
    spec_path: Path
    spec_text: str


class NodePlugin:
    """`gpu-dra kubelet-plugin --fleet FLEET --node-name NODE` in temporary directories."""

    def __init__(self, node: str, fleet: Path | str, driver: str, kubeconfig: Path | str) -> None:
        self.node, self.fleet, self.driver, self.kubeconfig = node, Path(fleet), driver, Path(kubeconfig)
        # Short base directory: unix socket paths are limited to 107 bytes.
        self.base = Path(tempfile.mkdtemp(prefix="gpu-dra-node-", dir="/tmp"))
        self.dirs = {name: self.base / name for name in ("registry", "plugins", "cdi", "state", "driver-root")}
        for d in self.dirs.values():
            d.mkdir()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.dirs["plugins"] / "dra.sock"

    @property
    def log_path(self) -> Path:
        return self.base / "plugin.log"

    def argv(self) -> list[str]:
        d = self.dirs
        return [sys.executable, "-m", "cli.main", "kubelet-plugin", "--node-name", self.node,
                "--driver-name", self.driver, "--kubeconfig", str(self.kubeconfig), "--fleet", str(self.fleet),
                "--registry-dir", str(d["registry"]), "--plugin-dir", str(d["plugins"]), "--cdi-root", str(d["cdi"]),
                "--state-dir", str(d["state"]), "--driver-root", str(d["driver-root"]),
                "--dev-root", str(d["driver-root"]), "--log-format", "text", "--log-level", "warning"]

    def start(self, timeout: float = 60.0) -> None:
        repo = Path(__file__).resolve().parents[1]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv(), cwd=repo, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise NodePluginError(f"kubelet plugin of {self.node} exited with {self.proc.returncode}:\n"
                                      f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise NodePluginError(f"kubelet plugin of {self.node}: no DRA socket after {timeout:.0f}s:\n"
                                      f"{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, grace: float = 15.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=grace)
        shutil.rmtree(self.base, ignore_errors=True)

    def log_tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:])
        except OSError as exc:
            return f"(no log: {exc})"

    def _stub(self) -> tuple[Any, Any, Any]:
        import grpc

        from api.generated.dra.v1 import api_pb2, api_pb2_grpc

        channel = grpc.insecure_channel(f"unix:{self.socket}")
        grpc.channel_ready_future(channel).result(timeout=PREPARE_TIMEOUT)
        return channel, api_pb2, api_pb2_grpc.DRAPluginStub(channel)

    def prepare(self, claim: PodClaim, namespace: str) -> PreparedClaim:
        """NodePrepareResources for one claim over the DRA socket; returns the CDI spec it wrote."""
        if not claim.uid or not claim.claim:
            raise NodePluginError(f"claim of pod {claim.pod} has no name/uid yet")
        channel, pb, stub = self._stub()
        try:
            request = pb.NodePrepareResourcesRequest(
                claims=[pb.Claim(namespace=namespace, name=claim.claim, uid=claim.uid)])
            answer = stub.NodePrepareResources(request, timeout=PREPARE_TIMEOUT).claims.get(claim.uid)
        finally:
            channel.close()
        if answer is None:
            raise NodePluginError(f"NodePrepareResources answered nothing for claim {claim.claim}")
        if answer.error:
            raise NodePluginError(f"NodePrepareResources for claim {claim.claim}: {answer.error}")
        ids = [i for d in answer.devices for i in d.cdi_device_ids]
        specs = sorted(p for p in self.dirs["cdi"].iterdir() if p.is_file() and claim.uid in p.name)
        if not specs:
            raise NodePluginError(f"claim {claim.claim} was prepared, but no CDI spec for it is in "
                                  f"{self.dirs['cdi']}")
        return PreparedClaim(claim, ids, specs[0], specs[0].read_text())

    def unprepare(self, claim: PodClaim, namespace: str) -> str:
        """NodeUnprepareResources for one claim; returns the plugin's error ("" when done)."""
        channel, pb, stub = self._stub()
        try:
            request = pb.NodeUnprepareResourcesRequest(
                claims=[pb.Claim(namespace=namespace, name=claim.claim or "", uid=claim.uid or "")])
            answer = stub.NodeUnprepareResources(request, timeout=PREPARE_TIMEOUT).claims.get(claim.uid or "")
        finally:
            channel.close()
        return "no answer for the claim" if answer is None else answer.error


def pick_claim(claims: list[PodClaim], slices_index: dict[tuple[str, str, str], dict[str, Any]],
               driver: str) -> PodClaim | None:
    """The claim whose preparation shows the most: a MIG partition (created at prepare), else the first
    allocated claim."""
    allocated = [c for c in claims if c.done and c.uid]
    for c in allocated:
        for r in c.results:
            device = slices_index.get((r.get("driver", ""), r.get("pool", ""), r.get("device", "")), {})
            kind = ((device.get("attributes") or {}).get("type") or {}).get("string")
            if r.get("driver") == driver and kind == "mig":
                return c
    return allocated[0] if allocated else None
