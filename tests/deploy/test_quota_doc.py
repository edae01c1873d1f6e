"""docs/quota.md and examples/quota/ stay one: the page shows every manifest as the file has it (the e2e tests
apply the files), the ResourceQuota covers every DeviceClass of the driver, and Kueue's mappings, ClusterQueue and
Jobs fit together and use only what Kueue v0.17 counts."""
from __future__ import annotations

from typing import Any

import pytest
import yaml

from api.deviceclasses import device_classes
from testbed.helmchart import ROOT

QUOTA = ROOT / "examples" / "quota"
DOC = (ROOT / "docs" / "quota.md").read_text()
PER_CLASS = ".deviceclass.resource.k8s.io/devices"


def objects(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((QUOTA / name).read_text()) if d]


@pytest.mark.parametrize("path", sorted(QUOTA.glob("*.yaml")), ids=lambda p: p.name)
def test_the_page_shows_the_manifest_as_the_file_has_it(path: Any) -> None:
    assert f"```yaml\n{path.read_text().rstrip()}\n```" in DOC, f"docs/quota.md does not show {path.name} as it is"


def test_the_readme_and_the_examples_point_to_the_page() -> None:
    assert "docs/quota.md" in (ROOT / "README.md").read_text()
    assert "../../docs/quota.md" in (QUOTA / "README.md").read_text()


def test_the_resourcequota_covers_every_class_of_the_driver() -> None:
    quota, = objects("resourcequota.yaml")
    assert set(quota["spec"]["hard"]) == {f"{c['metadata']['name']}{PER_CLASS}" for c in device_classes()}


def _whole_gpu_classes() -> set[str]:
    return {c["metadata"]["name"] for c in device_classes()
            if "].type == 'gpu'" in c["spec"]["selectors"][0]["cel"]["expression"]}


def test_kueue_counts_every_whole_gpu_class_as_one_resource() -> None:
    config, = objects("kueue-config.yaml")
    assert config["featureGates"] == {"DynamicResourceAllocation": True}
    mappings = {m["name"]: set(m["deviceClassNames"]) for m in config["resources"]["deviceClassMappings"]}
    assert mappings["gpu.dra-driver.io/gpus"] == _whole_gpu_classes()
    assert mappings["gpu.dra-driver.io/mig-partitions"] == {"mig.gpu.dra-driver.io"}
    mps_class, = objects("kueue-mps-class.yaml")
    assert mappings["gpu.dra-driver.io/mps-slots"] == {mps_class["metadata"]["name"]}


def test_the_cluster_queue_covers_the_mapped_resources_and_the_jobs_use_its_local_queue() -> None:
    config, = objects("kueue-config.yaml")
    mapped = [m["name"] for m in config["resources"]["deviceClassMappings"]]
    queues = {o["kind"]: o for o in objects("kueue-queues.yaml")}
    group, = queues["ClusterQueue"]["spec"]["resourceGroups"]
    assert group["coveredResources"] == mapped
    assert [r["name"] for r in group["flavors"][0]["resources"]] == mapped
    assert queues["LocalQueue"]["spec"]["clusterQueue"] == queues["ClusterQueue"]["metadata"]["name"]
    jobs = [o for o in objects("kueue-jobs.yaml") if o["kind"] == "Job"]
    templates = {o["metadata"]["name"]: o for o in objects("kueue-jobs.yaml") if o["kind"] == "ResourceClaimTemplate"}
    classes = {c for m in config["resources"]["deviceClassMappings"] for c in m["deviceClassNames"]}
    for job in jobs:
        assert job["spec"]["suspend"] is True
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == queues["LocalQueue"]["metadata"]["name"]
        for ref in job["spec"]["template"]["spec"]["resourceClaims"]:
            devices = templates[ref["resourceClaimTemplateName"]]["spec"]["spec"]["devices"]
            # The only form Kueue v0.17 counts: a mapped class and a count, nothing else.
            assert "config" not in devices and "constraints" not in devices
            for request in devices["requests"]:
                assert set(request) == {"name", "exactly"}
                assert set(request["exactly"]) <= {"deviceClassName", "count"}
                assert request["exactly"]["deviceClassName"] in classes
