"""Helm for the tests and the benchmarks: the binary hack/build-helm.sh builds (or reuses) from the pin in
hack/versions.env, and `helm template` of the chart as parsed objects."""
from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "gpu-dra-driver"


@functools.cache
def helm_binary() -> str:
    """Path of the pinned Helm; built on first use (a few minutes), then reused from ~/.cache/gpu-dra/helm."""
    proc = subprocess.run(["bash", str(ROOT / "hack" / "build-helm.sh")], capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, f"hack/build-helm.sh failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120)


def kube_version() -> str:
    for line in (ROOT / "hack" / "versions.env").read_text().splitlines():
        if line.startswith("K8S_VERSION="):
            return line.split("=", 1)[1]
    raise AssertionError("K8S_VERSION is not pinned in hack/versions.env")


def template_args(*args: str, release: str = "gpu-dra", namespace: str = "gpu-dra") -> list[str]:
    return ["template", release, str(CHART), "--namespace", namespace, "--kube-version", kube_version(), *args]


def render(*args: str, release: str = "gpu-dra", namespace: str = "gpu-dra") -> list[dict[str, Any]]:
    """The chart's objects as `helm template` renders them with these extra arguments (-f, --set, ...)."""
    proc = helm(*template_args(*args, release=release, namespace=namespace))
    assert proc.returncode == 0, f"helm template {' '.join(args)} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]
