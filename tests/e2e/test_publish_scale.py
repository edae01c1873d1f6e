"""Publishing a fleet on real API servers (1.37 and the oldest supported, 1.34): pools streamed in and written by
several workers, a restart that reads one metadata-only LIST and writes nothing, and the rule the digests rely
on — the server raises metadata.generation when, and only when, a slice's spec changes — checked on both."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_helpers import gpu_devices, run_publish, slices_of

from cli.publish_cmd import iter_fleet_pools, register_missing_nodes
from dra.model.slices import ApiFeatures
from dra.sim.fleet import load_fleet
from kube.client import SLICES, KubeApi
from kube.resourceslices import SPEC_ANNOTATION, DesiredPool, Owner, ResourceSliceController
from testbed.localcluster import ClusterError, LocalCluster, find_binaries, pinned_version

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def old_cluster() -> Iterator[LocalCluster]:
    version = pinned_version("K8S_SKEW_VERSION")
    try:
        cluster = LocalCluster(bin_dir=find_binaries(version=version)).start()
    except ClusterError as exc:   # a failure, never a skip: the oldest supported release must be tested
        pytest.fail(f"the Kubernetes {version} control plane could not be built or started: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


class CountingKube(KubeApi):
    """The real client, counting reads by kind."""

    def __init__(self, api_client: Any) -> None:
        super().__init__(api_client)
        self.reads: dict[str, int] = {}

    def request(self, method: str, path: str, query: dict[str, Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        if method == "GET" and not (query or {}).get("watch"):
            kind = "metadata" if "PartialObjectMetadata" in kwargs.get("accept", "") else "full"
            key = f"{kind} {'list' if path.rstrip('/').endswith('resourceslices') else 'get'}"
            self.reads[key] = self.reads.get(key, 0) + 1
        return super().request(method, path, query, *args, **kwargs)


def counted(api_client: Any, driver: str, workers: int = 4) -> tuple[ResourceSliceController, CountingKube]:
    ctl = ResourceSliceController(api_client, driver, Owner.cluster(), workers=workers)
    kube = CountingKube(api_client)
    ctl.kube = kube
    return ctl, kube


def test_a_streamed_fleet_is_published_by_several_workers_and_a_restart_writes_nothing(
        cluster: Any, api_client: Any, driver_name: str, tmp_path: Path) -> None:
    prefix = driver_name.split(".")[0]
    doc = {"nodes": [{"name": f"{prefix}-n{i}", "gpus": [{"model": "H100-80GB", "count": 2}],
                      "policy": {"default": {"mig": "dynamic", "slots": {"count": 4, "strategy": "mps"}}}}
                     for i in range(10)]}
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(doc))
    fleet = load_fleet(tmp_path / "fleet.yaml")
    register_missing_nodes(api_client, fleet.node_names)

    def pools() -> Iterator[tuple[str, DesiredPool]]:
        return iter_fleet_pools(fleet, "fleet.yaml", driver_name, ApiFeatures.for_server(37))

    first, _ = counted(api_client, driver_name)
    first.run_once(timeout=120, pools=pools())
    stored = slices_of(api_client, driver_name)
    assert first.writes_by_operation == {"create": len(stored)} and len(stored) >= 10
    for obj in stored:
        note = json.loads(obj["metadata"]["annotations"][SPEC_ANNOTATION])
        assert note["generation"] == obj["metadata"]["generation"] == 1
        assert note["pool"] == obj["spec"]["pool"]["name"] == obj["spec"]["nodeName"]

    restarted, kube = counted(api_client, driver_name)
    restarted.run_once(timeout=120, pools=pools())
    assert restarted.writes == 0
    assert kube.reads == {"metadata list": 1}            # one LIST of metadata, no slice read in full
    assert [o["metadata"]["resourceVersion"] for o in slices_of(api_client, driver_name)] == \
        [o["metadata"]["resourceVersion"] for o in stored]


@pytest.mark.parametrize("server", ["target", "oldest"])
def test_the_server_raises_the_generation_on_spec_changes_only(server: str, request: pytest.FixtureRequest,
                                                                driver_name: str) -> None:
    """What lets a digest vouch for a stored spec: an edit of labels keeps the slice trusted (nothing written),
    an edit of the spec that keeps our annotation is noticed all the same and put back with one update."""
    cluster: LocalCluster = request.getfixturevalue("cluster" if server == "target" else "old_cluster")
    api_client = cluster.api_client()
    node = f"{driver_name.split('.')[0]}-{server}"
    cluster.add_node(node)
    pool = {node: DesiredPool(node_name=node, slices=[gpu_devices("gpu", 2), gpu_devices("big", 1)])}
    ctl, _ = counted(api_client, driver_name)
    ctl.update(pool)
    ctl.run_once(timeout=60)
    kube = KubeApi(api_client)

    labelled = slices_of(api_client, driver_name)[0]
    labelled["metadata"]["labels"] = {"team": "ml"}
    after = kube.replace(SLICES, labelled)
    assert after["metadata"]["generation"] == 1
    edited = slices_of(api_client, driver_name)[1]
    edited["spec"]["devices"][0]["capacity"]["memory"]["value"] = "1Gi"
    after = kube.replace(SLICES, edited)
    assert after["metadata"]["generation"] == 2
    assert json.loads(after["metadata"]["annotations"][SPEC_ANNOTATION])["generation"] == 1

    restarted, reads = counted(api_client, driver_name)
    restarted.update(pool)
    restarted.run_once(timeout=60)
    assert restarted.writes_by_operation == {"update": 1}
    final = slices_of(api_client, driver_name)
    assert final[1]["spec"]["devices"][0]["capacity"]["memory"]["value"] == "80Gi"
    assert final[0]["metadata"]["labels"] == {"team": "ml"}
    assert [o["metadata"]["generation"] for o in final] == [1, 3]
    again, _ = counted(api_client, driver_name)
    again.update(pool)
    again.run_once(timeout=60)
    assert again.writes == 0
    api_client.close()


def test_publish_takes_workers_and_refuses_none(cluster: Any, api_client: Any, driver_name: str,
                                                tmp_path: Path) -> None:
    prefix = driver_name.split(".")[0]
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"nodes": [{"name": f"{prefix}-l4-{i}", "gpus": [{"model": "L4", "count": 1}]}
                                               for i in range(5)]}))
    bad = run_publish(cluster, fleet, driver_name, "--once", "--workers", "0")
    assert bad.returncode == 2 and "--workers and --jobs must be at least 1" in bad.stderr
    done = run_publish(cluster, fleet, driver_name, "--once", "--create-nodes", "--workers", "3")
    assert done.returncode == 0, done.stderr
    assert "5 pool(s), 5 ResourceSlice(s) in line; writes: create 5" in done.stdout
    again = run_publish(cluster, fleet, driver_name, "--once", "--workers", "3")
    assert again.returncode == 0 and "writes: none" in again.stdout, again.stderr
