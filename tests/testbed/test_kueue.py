"""testbed/kueue.py without a cluster: the Configuration it runs Kueue with keeps the caller's feature gates and
DeviceClass mappings and adds only what running out of a cluster needs; the CRDs get the conversion webhook Kueue's
manifests give them, on the resources its certificate manager injects a CA into, and no other."""
from __future__ import annotations

from pathlib import Path

import yaml

from testbed.kueue import CONVERTED, NAMESPACE, crds, local_configuration

ROOT = Path(__file__).resolve().parents[2]


def test_the_local_configuration_keeps_the_mappings_and_turns_off_what_needs_a_service(tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "examples" / "quota" / "kueue-config.yaml").read_text())
    out = local_configuration(config, webhook_port=1234, health_port=5678, cert_dir=tmp_path)
    assert out["resources"] == config["resources"] and out["integrations"] == config["integrations"]
    assert out["featureGates"] == {"DynamicResourceAllocation": True, "VisibilityOnDemand": False}
    assert out["namespace"] == NAMESPACE and out["leaderElection"] == {"leaderElect": False}
    assert out["webhook"] == {"host": "127.0.0.1", "port": 1234, "certDir": str(tmp_path)}
    assert out["health"] == {"healthProbeBindAddress": "127.0.0.1:5678"} and out["metrics"] == {"bindAddress": "0"}
    assert "VisibilityOnDemand" not in config["featureGates"], "the caller's configuration was changed"


def test_the_converted_crds_get_the_conversion_webhook_and_the_others_not(tmp_path: Path) -> None:
    (tmp_path / "crd").mkdir()
    for plural in ("clusterqueues", "resourceflavors"):
        (tmp_path / "crd" / f"kueue.x-k8s.io_{plural}.yaml").write_text(yaml.safe_dump(
            {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
             "spec": {"names": {"plural": plural}}}))
    by_name = {c["spec"]["names"]["plural"]: c["spec"] for c in crds(tmp_path)}
    assert "clusterqueues" in CONVERTED and "resourceflavors" not in CONVERTED
    assert by_name["clusterqueues"]["conversion"]["strategy"] == "Webhook"
    assert by_name["clusterqueues"]["conversion"]["webhook"]["clientConfig"]["service"]["namespace"] == NAMESPACE
    assert "conversion" not in by_name["resourceflavors"]
