"""Which image the chart's pods run: a released chart pins its own version's image by the digest its release
recorded in Chart.yaml (so that `helm upgrade --reuse-values` to a newer chart takes the newer image); a tag of
one's own is not pinned; image.digest pins any image; imagePullSecrets reach every pod; and nothing selects nodes
by kubernetes.io/arch (one image index serves amd64 and arm64 nodes)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.helmchart import CHART, helm, kube_version

DIGEST = "sha256:" + "0123456789abcdef" * 4
OTHER = "sha256:" + "f" * 64
WORKLOADS = {"DaemonSet", "Deployment"}


def images(chart: Path, *args: str) -> set[str]:
    proc = helm("template", "gpu-dra", str(chart), "--kube-version", kube_version(), *args)
    assert proc.returncode == 0, proc.stderr
    return {c["image"] for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] in WORKLOADS
            for c in [*d["spec"]["template"]["spec"]["containers"],
                      *d["spec"]["template"]["spec"].get("initContainers", [])]}


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart as hack/release.py leaves it: its Chart.yaml annotated with the image's digest."""
    chart = tmp_path_factory.mktemp("chart") / "gpu-dra-driver"
    shutil.copytree(CHART, chart)
    with open(chart / "Chart.yaml", "a") as f:
        f.write(f"annotations:\n  gpu.dra-driver.io/image-digest: {DIGEST}\n")
    return chart


def test_a_checkout_chart_names_its_tag_only() -> None:
    assert images(CHART) == {"registry.local/gpu-dra/driver:0.1.0"}


def test_a_released_chart_pins_its_image_by_digest(released: Path) -> None:
    assert images(released) == {f"registry.local/gpu-dra/driver:0.1.0@{DIGEST}"}
    assert images(released, "--set", "image.repository=mirror.example.com/gpu") == {
        f"mirror.example.com/gpu:0.1.0@{DIGEST}"}   # a mirror copied by digest keeps it


def test_a_tag_of_ones_own_is_not_pinned_with_the_releases_digest(released: Path) -> None:
    assert images(released, "--set", "image.tag=0.0.9") == {"registry.local/gpu-dra/driver:0.0.9"}


@pytest.mark.parametrize("chart", ["checkout", "released"])
def test_image_digest_pins_any_image(released: Path, chart: str) -> None:
    path = CHART if chart == "checkout" else released
    assert images(path, "--set", f"image.digest={OTHER}") == {f"registry.local/gpu-dra/driver:0.1.0@{OTHER}"}
    assert images(path, "--set", "image.tag=2.0.0", "--set", f"image.digest={OTHER}") == {
        f"registry.local/gpu-dra/driver:2.0.0@{OTHER}"}


def test_a_digest_that_is_not_sha256_is_refused() -> None:
    proc = helm("template", "gpu-dra", str(CHART), "--kube-version", kube_version(), "--set", "image.digest=latest")
    assert proc.returncode != 0 and "/image/digest" in proc.stderr, proc.stderr


def test_pull_secrets_reach_every_pod_and_no_pod_selects_an_architecture() -> None:
    proc = helm("template", "gpu-dra", str(CHART), "--kube-version", kube_version(),
                "--set", "imagePullSecrets[0].name=regcred")
    assert proc.returncode == 0, proc.stderr
    pods: list[dict[str, Any]] = [d["spec"]["template"]["spec"] for d in yaml.safe_load_all(proc.stdout)
                                  if d and d["kind"] in WORKLOADS]
    assert len(pods) == 3
    for pod in pods:
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert "kubernetes.io/arch" not in proc.stdout
