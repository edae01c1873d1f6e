"""`helm install`, `helm upgrade` and `helm uninstall` of the chart with the pinned Helm against the real API server:
every object the chart renders is accepted (the server validates them, CEL of the admission policy and the webhook's
match conditions included), Helm's webhook certificate survives an upgrade, and nothing is left after uninstall.
The pods do not run here (the control plane has no node for them); the real-node tests install it for that."""
from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from testbed.helmchart import CHART, ROOT, helm

pytestmark = pytest.mark.e2e

RELEASE = "gpu-dra-e2e"
NAMESPACE = "gpu-dra-helm-e2e"
DRIVER = "helm.e2e.dra-driver.io"
FULLNAME = f"{RELEASE}-gpu-dra-driver"


def kubectl_json(cluster: Any, *args: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def webhook_state(cluster: Any) -> tuple[set[str], str]:
    vwc = kubectl_json(cluster, "get", "validatingwebhookconfiguration", f"{FULLNAME}-webhook")
    bundles = {h["clientConfig"]["caBundle"] for h in vwc["webhooks"]}
    secret = kubectl_json(cluster, "get", "secret", "-n", NAMESPACE, f"{FULLNAME}-webhook-tls")
    return bundles, secret["data"]["tls.crt"]


def test_install_upgrade_and_uninstall(cluster: Any) -> None:
    kube = ["--kubeconfig", str(cluster.kubeconfig), "--namespace", NAMESPACE]
    try:
        # The kind walkthrough's values (deploy/README.md), under a driver name of the test's own.
        proc = helm("install", RELEASE, str(CHART), *kube, "--create-namespace", "--set", f"driverName={DRIVER}",
                    "-f", str(ROOT / "deploy" / "kind" / "values-simulated.yaml"))
        assert proc.returncode == 0, proc.stderr
        for kind, name in (("daemonset", f"{FULLNAME}-kubelet-plugin"), ("deployment", f"{FULLNAME}-controller"),
                           ("deployment", f"{FULLNAME}-webhook"), ("service", f"{FULLNAME}-webhook"),
                           ("poddisruptionbudget", f"{FULLNAME}-webhook"), ("configmap", f"{FULLNAME}-config")):
            cluster.kubectl("get", "-n", NAMESPACE, kind, name)
        classes = kubectl_json(cluster, "get", "deviceclasses")["items"]
        assert len([c for c in classes if DRIVER in c["metadata"]["name"]]) == 8
        cluster.kubectl("get", "validatingadmissionpolicy", f"{FULLNAME}-resourceslices")
        config = kubectl_json(cluster, "get", "configmap", "-n", NAMESPACE, f"{FULLNAME}-config")
        assert "kind-worker2" in config["data"]["fleet.yaml"]
        bundles, cert = webhook_state(cluster)
        [bundle] = bundles
        assert base64.b64decode(bundle).startswith(b"-----BEGIN CERTIFICATE-----")

        proc = helm("upgrade", RELEASE, str(CHART), *kube, "--reuse-values", "--set", "image.tag=0.1.1")
        assert proc.returncode == 0, proc.stderr
        ds = kubectl_json(cluster, "get", "daemonset", "-n", NAMESPACE, f"{FULLNAME}-kubelet-plugin")
        assert ds["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.local/gpu-dra/driver:0.1.1"
        # The generated certificate is looked up and kept: webhook pods are not restarted by an upgrade.
        assert webhook_state(cluster) == (bundles, cert)
        status = json.loads(helm("status", RELEASE, *kube, "-o", "json").stdout)
        assert status["version"] == 2 and status["info"]["status"] == "deployed"

        proc = helm("uninstall", RELEASE, *kube)
        assert proc.returncode == 0, proc.stderr
        assert not [c for c in kubectl_json(cluster, "get", "deviceclasses")["items"]
                    if DRIVER in c["metadata"]["name"]]
        for kind, name in (("validatingwebhookconfiguration", f"{FULLNAME}-webhook"),
                           ("validatingadmissionpolicy", f"{FULLNAME}-resourceslices"),
                           ("clusterrole", f"{FULLNAME}-kubelet-plugin")):
            assert cluster.kubectl("get", kind, name, check=False).returncode != 0, f"{kind} {name} left behind"
    finally:
        helm("uninstall", RELEASE, *kube, "--ignore-not-found")
        cluster.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false")
