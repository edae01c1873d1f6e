"""A corpus of kubeconfigs that behaves as with kubectl: for each, the real kubectl (`get --raw /version`, the pinned
release's, from the control plane's cache) and kube.connect + KubeApi against the same little TLS server both get
an answer, with the same Authorization header (and the same Proxy-Authorization at a proxy), or both refuse."""
from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from scripted_http import Proxy, Request, Scripted, response
from tlscerts import ServingCert, make_serving_cert

from kube.client import ApiError, ApiUnavailable, KubeApi
from kube.connect import ConnectError, api_client_from

pytestmark = pytest.mark.e2e

VERSION = {"major": "1", "minor": "37", "gitVersion": "v1.37.2"}


@pytest.fixture(scope="module")
def kubectl() -> str:
    from testbed.localcluster import ClusterError, find_binaries

    try:
        return str(find_binaries(build=False) / "kubectl")
    except ClusterError as exc:
        pytest.fail(f"kubectl is not built: {exc}", pytrace=False)


@dataclass
class Bed:
    tmp: Path
    serving: ServingCert          # 127.0.0.1
    named: ServingCert            # only DNS:apiserver.test
    client: ServingCert           # a client certificate, from a CA of its own
    server: Scripted              # asks for a client certificate, takes one signed by client.ca
    named_server: Scripted
    proxy: Proxy                  # in front of server


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    tmp = tmp_path_factory.mktemp("kubectl-agreement")
    serving = make_serving_cert(tmp / "srv", "apiserver")
    named = make_serving_cert(tmp / "named", "named", ips=(), dns=("apiserver.test",))
    cert = make_serving_cert(tmp / "cli", "admin", ips=(), dns=(), usage="clientAuth")

    def tls(cert_: ServingCert) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert_.cert), str(cert_.key))
        ctx.verify_mode = ssl.CERT_OPTIONAL
        ctx.load_verify_locations(cafile=str(cert.ca))
        return ctx

    def answer(r: Request) -> bytes:
        return response(VERSION) if r.target == "/version" else response({"kind": "Status"}, status=404)

    server, named_server = Scripted(answer, tls=tls(serving)), Scripted(answer, tls=tls(named))
    proxy = Proxy(server.port)
    yield Bed(tmp, serving, named, cert, server, named_server, proxy)
    for s in (server, named_server, proxy):
        s.stop()


def kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any], current: str = "c",
               contexts: dict[str, str] | None = None) -> Path:
    """One cluster k and user u; contexts name -> cluster (default: c -> k)."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": current,
        "clusters": [{"name": "k", "cluster": cluster}, {"name": "elsewhere",
                                                        "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": n, "context": {"cluster": c, "user": "u"}}
                     for n, c in (contexts or {"c": "k"}).items()]}))
    return path


@dataclass
class Case:
    name: str
    make: Callable[[Bed, Path], tuple[Path | None, str | None, dict[str, str]]]   # kubeconfig, --context, env
    refused: str = ""             # what both refusals say, when both must refuse
    via_proxy: bool = False
    server: str = "server"


def _ca(bed: Bed) -> dict[str, Any]:
    return {"server": bed.server.url, "certificate-authority": str(bed.serving.ca)}


def _exec_plugin(tmp: Path) -> dict[str, Any]:
    plugin = tmp / "credential-plugin.sh"
    plugin.write_text("#!/bin/sh\ncat <<'EOF'\n" + json.dumps({
        "apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
        "status": {"token": "from-the-plugin"}}) + "\nEOF\n")
    plugin.chmod(0o755)
    return {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin),
                     "interactiveMode": "Never"}}


def _merged(bed: Bed, tmp: Path) -> tuple[Path | None, str | None, dict[str, str]]:
    """$KUBECONFIG: the context in the first file, its cluster and user in the second."""
    first, second = tmp / "contexts", tmp / "credentials"
    first.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "current-context": "split",
                                     "contexts": [{"name": "split", "context": {"cluster": "k", "user": "u"}}]}))
    kubeconfig(second, _ca(bed), {"token": "merged-token"}, current="elsewhere",
               contexts={"elsewhere": "elsewhere"})
    return None, None, {"KUBECONFIG": f"{tmp / 'missing'}{os.pathsep}{first}{os.pathsep}{second}"}


CASES = [
    Case("token", lambda b, t: (kubeconfig(t / "kc", _ca(b), {"token": "a-token"}), None, {})),
    Case("client-certificate", lambda b, t: (kubeconfig(t / "kc", _ca(b), {
        "client-certificate-data": base64.b64encode(b.client.cert.read_bytes()).decode(),
        "client-key": str(b.client.key)}), None, {})),
    Case("basic-auth", lambda b, t: (kubeconfig(t / "kc", _ca(b), {"username": "ann", "password": "s3:cret"}),
                                     None, {})),
    Case("exec-plugin", lambda b, t: (kubeconfig(t / "kc", _ca(b), _exec_plugin(t)), None, {})),
    Case("merged-list", _merged),
    Case("named-context", lambda b, t: (kubeconfig(t / "kc", _ca(b), {"token": "t"}, current="other",
                                                   contexts={"other": "elsewhere", "mine": "k"}), "mine", {})),
    Case("tls-server-name", lambda b, t: (kubeconfig(t / "kc", {
        "server": b.named_server.url, "certificate-authority": str(b.named.ca), "tls-server-name": "apiserver.test"},
        {"token": "t"}), None, {}), server="named_server"),
    Case("no-tls-server-name", lambda b, t: (kubeconfig(t / "kc", {
        "server": b.named_server.url, "certificate-authority": str(b.named.ca)}, {"token": "t"}), None, {}),
        refused="certificate", server="named_server"),
    Case("proxy-with-credentials", lambda b, t: (kubeconfig(t / "kc", {
        **_ca(b), "proxy-url": b.proxy.url.replace("http://", "http://proxy%20user:pa%3Ass@")}, {"token": "t"}),
        None, {}), via_proxy=True),
    Case("insecure-with-ca", lambda b, t: (kubeconfig(t / "kc", {**_ca(b), "insecure-skip-tls-verify": True},
                                                      {"token": "t"}), None, {}),
         refused="specifying a root certificates file with the insecure flag is not allowed"),
    Case("insecure-with-ca-data", lambda b, t: (kubeconfig(t / "kc", {
        "server": b.server.url, "insecure-skip-tls-verify": True,
        "certificate-authority-data": base64.b64encode(b.serving.ca.read_bytes()).decode()}, {"token": "t"}),
        None, {}), refused="specifying a root certificates file with the insecure flag is not allowed"),
    Case("not-yaml", lambda b, t: (_write(t / "kc", "clusters: [\n  - name: k\n    cluster: {server: x\n"), None, {}),
         refused="yaml"),
    Case("missing-current-context", lambda b, t: (kubeconfig(t / "kc", _ca(b), {"token": "t"}, current="gone"),
                                                  None, {}), refused="gone"),
    Case("missing-named-context", lambda b, t: (kubeconfig(t / "kc", _ca(b), {"token": "t"}), "nosuch", {}),
         refused="nosuch"),
]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_kubeconfig_behaves_as_with_kubectl(case: Case, bed: Bed, kubectl: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    server: Scripted = getattr(bed, case.server)
    path, context, env = case.make(bed, tmp_path)
    args = ([f"--kubeconfig={path}"] if path else []) + ([f"--context={context}"] if context else [])

    server.requests.clear()
    bed.proxy.heads.clear()
    proc = subprocess.run([kubectl, *args, "get", "--raw", "/version"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env})
    theirs = _seen(server, bed.proxy)

    server.requests.clear()
    bed.proxy.heads.clear()
    for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY",
                 "https_proxy", "http_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    error: Exception | None = None
    try:
        answer = KubeApi(api_client_from(str(path) if path else None, context), timeout=30).get("/version")
        assert answer == VERSION
    except (ConnectError, ApiUnavailable, ApiError) as exc:
        error = exc
    ours = _seen(server, bed.proxy)

    if case.refused:
        assert proc.returncode != 0, f"kubectl took {case.name}: {proc.stdout}"
        assert error is not None, f"kube.connect took {case.name}, which kubectl refuses: {proc.stderr}"
        assert case.refused.lower() in proc.stderr.lower() and case.refused.lower() in str(error).lower(), \
            (proc.stderr, str(error))
        if isinstance(error, ConnectError):
            assert str(path or "") in str(error) or case.name == "missing-named-context"
        return
    assert proc.returncode == 0, f"kubectl refused {case.name}: {proc.stderr}"
    assert json.loads(proc.stdout) == VERSION
    assert error is None, f"kubectl took {case.name}, kube.connect did not: {error}"
    assert theirs == ours and theirs["version requests"] == 1, (theirs, ours)
    if case.name == "client-certificate":
        assert ours["client certificate"] == ["admin"]
    if case.via_proxy:
        assert ours["proxy authorization"] == ["Basic " + base64.b64encode(b"proxy user:pa:ss").decode()]


def _seen(server: Scripted, proxy: Proxy) -> dict[str, Any]:
    """What reached the server (the /version requests' credentials) and the proxy (its credentials)."""
    asked = [r for r in server.requests if r.target == "/version"]
    return {"version requests": len(asked),
            "authorization": sorted({r.headers.get("authorization", "") for r in asked}),
            "client certificate": sorted({r.client_cert for r in asked}),
            "proxy authorization": sorted({h.get("proxy-authorization", "") for _, h in proxy.heads})}
