"""Per-claim GPU metrics from the chart's plugin pod on the real node: the chart's mount of the kubelet's
pod-resources directory, its hostPID and its RBAC (the plugin's own service account, which may read no pods: the
claims' reservedFor and the processes' cgroups place them) are what the plugin works with, in a container of its
own cgroup namespace. Same scenario as test_claim_metrics_realnode: two pods
on MPS slots of one GPU allocating different amounts are two series with those amounts."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from realnode_helpers import RealNode
from test_claim_metrics_realnode import two_pods_on_mps_slots_are_two_series
from test_helm_realnode import Installation, installation

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installation]:
    """The chart of the checkout with `make image`'s archive imported into the node (the release's registry path is
    test_helm_realnode's): the plugin's metrics do not depend on where its image came from."""
    with installation(tmp_path_factory.mktemp("chart"), from_release=False) as inst:
        yield inst


def test_the_chart_plugin_shows_two_pods_on_mps_slots_as_two_series(installed: Installation) -> None:
    plugin = installed.plugin
    installed.component_pod("kubelet-plugin", timeout=180)
    installed.component_pod("webhook", timeout=120, ready=True)   # it admits the claim templates
    real: RealNode = installed.real
    real.wait_for_slices(plugin, timeout=120)
    two_pods_on_mps_slots_are_two_series(real, plugin, "claim-metrics-chart")
