"""Kueue for the tests: the manager that hack/build-kueue.sh builds (or reuses) from the pin in hack/versions.env,
its CRDs installed into a LocalCluster, and the manager run as a process against that cluster.

Out of a cluster, Kueue runs as its in-cluster manifests run it, less what needs a Service in front of it:
- its webhooks: the API server could only call them through a Service's DNS name, the name Kueue's own
  certificates are made for; no webhook configuration is installed, so Jobs are created with ``suspend: true``
  and the queue-name label (what Kueue's mutating webhook would do) and nothing validates Kueue's objects
  before it reads them;
- the conversion webhook of its CRDs: installed as Kueue's manifests install it (Kueue's certificate manager
  injects its CA there and waits for that), never called, since everything here speaks the stored version
  (v1beta2);
- the visibility API (an aggregated API server for pending workloads) and the metrics endpoint: off.
The certificates Kueue makes for itself (internalCertManagement) land in its Secret; the test bed writes them into
a directory of the run, as the kubelet mounts that Secret into Kueue's pod.
"""
from __future__ import annotations

import base64
import copy
import functools
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from testbed.localcluster import LocalCluster, free_port

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "kueue-system"
# The CRDs whose conversion webhook Kueue's manifests enable (config/components/crd/kustomization.yaml), so the
# ones its certificate manager injects a CA into.
CONVERTED = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
CRD_GROUP = "kueue.x-k8s.io"
SERVICE = "kueue-webhook-service"
SECRET = "kueue-webhook-server-cert"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


class KueueError(RuntimeError):
    """The build failed, or the manager did not start or stopped."""


@functools.cache
def kueue_dir() -> Path:
    """The pinned version's directory (bin/kueue, crd/); built on first use, then reused from ~/.cache/gpu-dra."""
    proc = subprocess.run(["bash", str(ROOT / "hack" / "build-kueue.sh")], capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:
        raise KueueError(f"hack/build-kueue.sh failed:\n{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def crds(directory: Path) -> list[dict[str, Any]]:
    """Kueue's CRDs as its manifests install them: the bases, with the conversion webhook on the converted ones
    (pointing at the Service an in-cluster install has)."""
    out = []
    for path in sorted((directory / "crd").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in CONVERTED:
            crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                "clientConfig": {"service": {"namespace": NAMESPACE, "name": SERVICE, "path": "/convert"}},
                "conversionReviewVersions": ["v1"]}}
        out.append(crd)
    return out


def local_configuration(config: dict[str, Any], *, webhook_port: int, health_port: int,
                        cert_dir: Path) -> dict[str, Any]:
    """`config` (a Kueue Configuration, e.g. examples/quota/kueue-config.yaml) with what running out of the
    cluster needs (module docstring); the feature gates and resources of `config` are kept."""
    out = copy.deepcopy(config)
    out.update({
        "namespace": NAMESPACE,
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True, "webhookServiceName": SERVICE, "webhookSecretName": SECRET},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
    })
    out["featureGates"] = {**(out.get("featureGates") or {}), "VisibilityOnDemand": False}
    return out


class LocalKueue:
    """The Kueue manager for `cluster`, with `config` (module docstring); its files under `workdir`."""

    def __init__(self, cluster: LocalCluster, config: dict[str, Any], workdir: Path) -> None:
        self.cluster = cluster
        self.config = config
        self.workdir = workdir
        self.log_path = workdir / "kueue.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def install_crds(self, timeout: float = 60.0) -> None:
        """Kueue's CRDs applied (server-side: some are over the size client-side apply can annotate) and
        Established."""
        path = self.workdir / "kueue-crds.yaml"
        path.write_text(yaml.safe_dump_all(crds(kueue_dir()), sort_keys=False))
        self._kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
        names = [f"{c['spec']['names']['plural']}.{CRD_GROUP}" for c in crds(kueue_dir())]
        self._kubectl("wait", "--for=condition=Established", f"--timeout={int(timeout)}s",
                      *[f"crd/{n}" for n in names])

    def start(self, timeout: float = 180.0) -> "LocalKueue":
        """CRDs installed, the namespace made, the manager started and ready (its /readyz: certificates made
        and injected, webhook server listening)."""
        binary = kueue_dir() / "bin" / "kueue"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.install_crds()
        if self._kubectl("get", "namespace", NAMESPACE, check=False).returncode != 0:
            self._kubectl("create", "namespace", NAMESPACE)
        # The Secret Kueue's manifests ship empty: its certificate manager fills it and will not create it.
        if self._kubectl("get", "secret", "-n", NAMESPACE, SECRET, check=False).returncode != 0:
            self._kubectl("create", "secret", "generic", "-n", NAMESPACE, SECRET)
        health = free_port()
        config = local_configuration(self.config, webhook_port=free_port(), health_port=health,
                                     cert_dir=self.workdir / "certs")
        config_path = self.workdir / "kueue-config.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        env = {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig)}
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen([str(binary), f"--config={config_path}", "--zap-log-level=2"],
                                          stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self._ready(health):
            self.check_running()
            self._mount_certs()
            if time.monotonic() > deadline:
                self.stop()
                raise KueueError(f"kueue not ready after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.5)
        return self

    def _mount_certs(self) -> None:
        """What the kubelet does for Kueue's pod: the Secret its certificate manager filled, as files in the
        certificate directory (the manager waits for them before it injects its CA and goes on)."""
        cert_dir = self.workdir / "certs"
        if (cert_dir / "tls.key").exists():
            return
        proc = self._kubectl("get", "secret", "-n", NAMESPACE, SECRET, "-o", "json", check=False)
        data = json.loads(proc.stdout or "{}").get("data") or {} if proc.returncode == 0 else {}
        if not {"tls.crt", "tls.key"} <= set(data):
            return
        cert_dir.mkdir(mode=0o700, exist_ok=True)
        for name in ("ca.crt", "tls.crt", "tls.key"):     # the key last: its presence means all are there
            if name in data:
                tmp = cert_dir / f".{name}.tmp"
                tmp.write_bytes(base64.b64decode(data[name]))
                tmp.rename(cert_dir / name)

    def _ready(self, port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=3) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.HTTPError):
            return False

    def check_running(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            raise KueueError(f"kueue exited with {self._proc.returncode}:\n{self.log_tail()}")

    def stop(self, grace: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace)

    def log_tail(self, lines: int = 20, width: int = 400) -> str:
        """The log's last lines, each cut to `width` characters (Kueue logs JSON with stack traces)."""
        if not self.log_path.exists():
            return ""
        return "\n".join(ln[:width] for ln in self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = self.cluster.kubectl(*args, check=False)
        if check and proc.returncode != 0:
            raise KueueError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc
