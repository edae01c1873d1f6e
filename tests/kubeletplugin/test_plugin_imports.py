"""The kubelet plugin reaches the API server through urllib3 and the kubernetes package's configuration (the
ApiClient's pool manager): with a token or client-certificate kubeconfig and in a pod (the service account's
token and CA), at start and per pod (a claim read, a status apply); in a pod, a rotated token is used once the
old one is refused."""
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
import json, sys
import cli.kubeletplugin_cmd, kubeletplugin.plugin, kube.events, kube.resourceslices
from kube.connect import api_client_from
from kubeletplugin.claims import KubernetesClaimSource
from kubeletplugin.claimstatus import KubernetesClaimStatusWriter
from kubeletplugin.transport.nodedriver import ClaimRef

api = api_client_from(sys.argv[1] or None)
claim = KubernetesClaimSource(api).get_claim("ns", "c", "uid-1")
KubernetesClaimStatusWriter(api, "gpu.example.com", "node-a").publish(ClaimRef("ns", "uid-1", "c"), [], 0.0)
if len(sys.argv) > 2:                      # the service account's token rotated, the old one refused from now on
    open(sys.argv[2], "w").write("rotated-token")
    claim = KubernetesClaimSource(api).get_claim("ns", "c", "uid-1")
print(json.dumps({"claim": claim["metadata"]["name"], "pools": len(api.rest_client.pool_manager.pools),
                  "loaded": sorted({m for m in ("urllib3", "kubernetes.config", "kube.pool") if m in sys.modules})}))
"""

IN_A_POD = """
import kubernetes.config.incluster_config as incluster
incluster.SERVICE_TOKEN_FILENAME, incluster.SERVICE_CERT_FILENAME = {token!r}, {ca!r}
"""

THROUGH_URLLIB3 = {"claim": "c", "pools": 1, "loaded": ["kube.pool", "kubernetes.config", "urllib3"]}


def answer(r: Request, refused: str = "") -> bytes:
    if refused and r.headers.get("authorization") == refused:
        return response({"kind": "Status", "reason": "Unauthorized"}, status=401)
    if r.method == "GET":
        return response({"metadata": {"name": "c", "namespace": "ns", "uid": "uid-1"}})
    return response({"metadata": {"name": "c"}})


def probe(code: str, *args: str, env: dict[str, str] | None = None) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_through_urllib3_with_a_token_or_client_certificate_kubeconfig(tmp_path: Path) -> None:
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
            assert probe(PROBE, str(kubeconfig)) == THROUGH_URLLIB3, name
        patches = [r for r in server.requests if r.method == "PATCH"]
        assert len(patches) == 2 and patches[0].headers["content-type"] == "application/apply-patch+yaml"
        assert patches[0].headers["authorization"] == "Bearer t" and "authorization" not in patches[1].headers
        assert [r.client_cert for r in patches] == ["", "node"]
        assert {r.headers["user-agent"] for r in server.requests} == {"gpu-dra"}
        assert {r.conn for r in server.requests if r.client_cert} == {server.connections}   # one kept-alive
    finally:
        server.stop()


def test_through_urllib3_in_a_pod_with_a_rotated_token(tmp_path: Path) -> None:
    """In a pod: the service account's token and CA, where the kubernetes package looks for them; the package
    re-reads the token once a minute, the client at once when the old one is refused."""
    serving = make_serving_cert(tmp_path / "srv", "apiserver")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(str(serving.cert), str(serving.key))
    account = tmp_path / "sa"
    account.mkdir()
    (account / "ca.crt").write_bytes(serving.ca.read_bytes())
    token = account / "token"
    token.write_text("pod-token")
    # Once the token file is rotated, the old token is refused.
    server = Scripted(lambda r: answer(r, "Bearer pod-token" if token.read_text() != "pod-token" else ""), tls=tls)
    in_a_pod = IN_A_POD.format(token=str(token), ca=str(account / "ca.crt")) + PROBE
    try:
        result = probe(in_a_pod, "", str(token), env={"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                                                      "KUBERNETES_SERVICE_PORT": str(server.port)})
        assert result == THROUGH_URLLIB3
        assert [(r.method, r.headers["authorization"]) for r in server.requests] == [
            ("GET", "Bearer pod-token"), ("PATCH", "Bearer pod-token"),
            ("GET", "Bearer pod-token"), ("GET", "Bearer rotated-token")]
    finally:
        server.stop()
