"""The kubelet plugin reaches the API server without the `kubernetes` package (about 10 MiB of RSS) or urllib3:
with a token or client-certificate kubeconfig and in a pod, at start and per pod (a claim read, a status apply)."""
from __future__ import annotations

import json
import ssl
import subprocess
import sys
from pathlib import Path

import yaml
from scripted_http import Request, Scripted, response
from tlscerts import make_serving_cert

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, os, sys
import cli.kubeletplugin_cmd, kubeletplugin.plugin, kube.events, kube.resourceslices
from kube.connect import api_client_from
from kubeletplugin.claims import KubernetesClaimSource
from kubeletplugin.claimstatus import KubernetesClaimStatusWriter
from kubeletplugin.transport.nodedriver import ClaimRef

api = api_client_from(sys.argv[1] or None)
claim = KubernetesClaimSource(api).get_claim("ns", "c", "uid-1")
KubernetesClaimStatusWriter(api, "gpu.example.com", "node-a").publish(ClaimRef("ns", "uid-1", "c"), [], 0.0)
print(json.dumps({"claim": claim["metadata"]["name"],
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("kubernetes", "urllib3"))}))
"""


def answer(r: Request) -> bytes:
    if r.method == "GET":
        return response({"metadata": {"name": "c", "namespace": "ns", "uid": "uid-1"}})
    return response({"metadata": {"name": "c"}})


def probe(kubeconfig: str, env: dict[str, str] | None = None) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROBE, kubeconfig], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_no_kubernetes_package_with_a_token_or_client_certificate_kubeconfig(tmp_path: Path) -> None:
    serving = make_serving_cert(tmp_path / "srv", "apiserver")
    client = make_serving_cert(tmp_path / "cli", "node", ips=(), dns=(), usage="clientAuth")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(str(serving.cert), str(serving.key))
    tls.verify_mode = ssl.CERT_OPTIONAL
    tls.load_verify_locations(cafile=str(client.ca))
    server = Scripted(answer, tls=tls)
    try:
        for name, user in (("token", {"token": "t"}),
                           ("cert", {"client-certificate": str(client.cert), "client-key": str(client.key)})):
            kubeconfig = tmp_path / name
            kubeconfig.write_text(yaml.safe_dump({
                "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [{"name": "k", "cluster": {"server": server.url, "certificate-authority": str(serving.ca)}}],
                "users": [{"name": "u", "user": user}]}))
            assert probe(str(kubeconfig)) == {"claim": "c", "loaded": []}, name
        patches = [r for r in server.requests if r.method == "PATCH"]
        assert len(patches) == 2 and patches[0].headers["content-type"] == "application/apply-patch+yaml"
        assert patches[0].headers["authorization"] == "Bearer t" and "authorization" not in patches[1].headers
    finally:
        server.stop()


def test_no_kubernetes_package_in_a_pod(tmp_path: Path) -> None:
    """In a pod: the service account's token and CA (read from where kube.kubeconfig looks for them)."""
    serving = make_serving_cert(tmp_path / "srv", "apiserver")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(str(serving.cert), str(serving.key))
    server = Scripted(answer, tls=tls)
    account = tmp_path / "sa"
    account.mkdir()
    (account / "ca.crt").write_bytes(serving.ca.read_bytes())
    (account / "token").write_text("pod-token")
    probe_in_pod = PROBE.replace("import json, os, sys",
                                 f"import json, os, sys, pathlib\nimport kube.kubeconfig as k\n"
                                 f"k.SERVICE_ACCOUNT_DIR = pathlib.Path({str(account)!r})")
    try:
        out = subprocess.run([sys.executable, "-c", probe_in_pod, ""], cwd=REPO, capture_output=True, text=True,
                             timeout=120, env={"PATH": "/usr/bin:/bin", "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                                               "KUBERNETES_SERVICE_PORT": str(server.port)})
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout.splitlines()[-1]) == {"claim": "c", "loaded": []}
        assert {r.headers["authorization"] for r in server.requests} == {"Bearer pod-token"}
    finally:
        server.stop()
