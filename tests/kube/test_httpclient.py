"""kube.httpclient under KubeApi, against an in-process HTTP/1.1 server whose answers each test writes byte by
byte: keep-alive reuse, Content-Length and chunked bodies, a server that closed an idle connection, bounds on
headers and bodies, 401 then fresh credentials, TLS with a CA, a client certificate and tls-server-name,
streamed watches, an http proxy's CONNECT tunnel."""
from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from scripted_http import Answer, Request, Scripted, response
from tlscerts import ServingCert, make_serving_cert

import kube.httpclient as httpclient
from kube.client import ApiError, ApiUnavailable, KubeApi, iter_json_lines
from kube.kubeconfig import ClusterAccess, ConnectError, TokenCredentials, from_kubeconfig


@pytest.fixture
def serve() -> Iterator[Callable[..., Scripted]]:
    started: list[Scripted] = []

    def start(answer: Answer, **kw: Any) -> Scripted:
        started.append(Scripted(answer, **kw))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def kube_of(server: Scripted, token: str = "t", timeout: float = 5.0) -> KubeApi:
    return KubeApi(ClusterAccess(server.url, TokenCredentials(token=token)), timeout=timeout)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_requests_of_a_thread_share_one_kept_alive_connection(serve: Callable[..., Scripted]) -> None:
    server = serve(lambda r: response({"path": r.target, "body": r.body.decode()}, chunks=3 if "c" in r.target else 0))
    kube = kube_of(server)
    assert kube.get("/a", limit=5, watch=False) == {"path": "/a?limit=5&watch=false", "body": ""}
    assert kube.get("/c") == {"path": "/c", "body": ""}                  # chunked, extensions and a trailer
    created = kube.create("/things", {"metadata": {"name": "x"}})
    assert json.loads(created["body"]) == {"metadata": {"name": "x"}}
    assert server.connections == 1 and [r.conn for r in server.requests] == [1, 1, 1]
    first = server.requests[0]
    assert first.headers["authorization"] == "Bearer t" and first.headers["host"] == f"127.0.0.1:{server.port}"
    assert server.requests[2].headers["content-type"] == "application/json"

    other: list[Any] = []
    t = threading.Thread(target=lambda: other.append(kube.get("/b")))
    t.start()
    t.join(10)
    assert other == [{"path": "/b", "body": ""}] and server.connections == 2    # a connection per thread


def test_a_request_on_a_connection_the_server_closed_is_sent_again_on_a_fresh_one(
        serve: Callable[..., Scripted]) -> None:
    server = serve(lambda r: response({"n": len(server.requests)}), close_after_answer=True)
    kube = kube_of(server)
    assert kube.get("/a") == {"n": 1}
    wait_until(lambda: server.closed == 1)                     # the idle connection is gone
    assert kube.get("/b") == {"n": 2}
    assert server.connections == 2 and [r.target for r in server.requests] == ["/a", "/b"]


def test_a_request_dropped_on_a_fresh_connection_is_not_sent_again(serve: Callable[..., Scripted]) -> None:
    server = serve(lambda r: None)
    with pytest.raises(ApiUnavailable, match=r"GET http://127.0.0.1:\d+/a: remote end closed"):
        kube_of(server).get("/a")
    assert len(server.requests) == 1


def test_a_dropped_request_on_a_reused_connection_is_sent_once_more_only(serve: Callable[..., Scripted]) -> None:
    server = serve(lambda r: response({}) if r.target == "/first" else None)
    kube = kube_of(server)
    kube.get("/first")
    with pytest.raises(ApiUnavailable, match="remote end closed"):
        kube.request("POST", "/things", body={"a": 1})
    assert [(r.conn, r.target) for r in server.requests] == [(1, "/first"), (1, "/things"), (2, "/things")]


def test_a_slow_answer_times_out_and_is_not_sent_again(serve: Callable[..., Scripted]) -> None:
    release = threading.Event()
    server = serve(lambda r: response({}) if r.target == "/first" or release.wait(10) else None)
    kube = kube_of(server, timeout=0.3)
    kube.get("/first")
    with pytest.raises(ApiUnavailable, match="timed out"):
        kube.get("/slow")
    release.set()
    assert [r.target for r in server.requests] == ["/first", "/slow"]
    assert kube.get("/first") == {}                            # a fresh connection after the broken one


def test_a_header_block_over_the_limit_is_refused_naming_it(serve: Callable[..., Scripted]) -> None:
    big = "".join(f"X-Filler-{i}: {'a' * 1000}\r\n" for i in range(300))
    server = serve(lambda r: response({}, headers=big))
    with pytest.raises(ApiUnavailable, match=f"header block larger than {httpclient.MAX_HEADER_BLOCK} bytes"):
        kube_of(server).get("/a")


@pytest.mark.parametrize("chunks", [0, 4])
def test_a_body_over_the_limit_is_refused_naming_it(serve: Callable[..., Scripted], chunks: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httpclient, "MAX_BODY", 1000)
    server = serve(lambda r: response({"x": "y" * 2000}, chunks=chunks))
    with pytest.raises(ApiUnavailable, match="larger than 1000 bytes"):
        kube_of(server).get("/a")


def test_malformed_answers_are_unavailable_servers(serve: Callable[..., Scripted]) -> None:
    for raw, needle in ((b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
                        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "after 3 of 10 body bytes"),
                        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed chunk size"),
                        (b"HTTP/1.1 200 OK\r\nbroken\r\n\r\n", "malformed response header line")):
        server = serve(lambda r, raw=raw: raw, close_after_answer=True)
        with pytest.raises(ApiUnavailable, match=needle):
            kube_of(server).get("/a")


def test_an_error_status_is_an_api_error_and_the_connection_stays(serve: Callable[..., Scripted]) -> None:
    server = serve(lambda r: response({"kind": "Status", "reason": "NotFound", "message": "gone"}, status=404)
                   if r.target == "/missing" else b"HTTP/1.1 204 No Content\r\n\r\n")
    kube = kube_of(server)
    with pytest.raises(ApiError) as err:
        kube.get("/missing")
    assert err.value.not_found and err.value.reason == "NotFound"
    assert kube.get("/empty") == {} and server.connections == 1


def test_a_401_sends_once_more_with_a_rotated_token(serve: Callable[..., Scripted], tmp_path: Path) -> None:
    server = serve(lambda r: response({"who": r.headers["authorization"]}) if r.headers["authorization"] == "Bearer new"
                   else response({"kind": "Status", "reason": "Unauthorized"}, status=401))
    token = tmp_path / "token"
    token.write_text("old\n")
    kube = KubeApi(ClusterAccess(server.url, TokenCredentials(token_file=str(token))))
    token.write_text("new\n")                     # rotated within the minute the old one is reused
    assert kube.get("/a") == {"who": "Bearer new"}
    assert [r.headers["authorization"] for r in server.requests] == ["Bearer old", "Bearer new"]
    assert kube.get("/b") == {"who": "Bearer new"}

    server.requests.clear()
    with pytest.raises(ApiError, match="HTTP 401"):   # a static token cannot change: no second try
        kube_of(server, token="wrong").get("/a")
    assert len(server.requests) == 1


def test_a_watch_streams_events_on_a_connection_of_its_own(serve: Callable[..., Scripted]) -> None:
    events = [{"type": "ADDED", "object": {"n": i}} for i in range(3)]

    def answer(r: Request) -> bytes:
        if "watch" not in r.target:
            return response({})
        out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        lines = [json.dumps(e).encode() + b"\n" for e in events]
        split = [lines[0], lines[1] + lines[2][:5], lines[2][5:]]     # one per chunk, then two across chunks
        return out + b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in split) + b"0\r\n\r\n"

    server = serve(answer)
    kube = kube_of(server)
    kube.get("/plain")
    with kube.request("GET", "/things", query={"watch": "true"}, stream=True) as resp:
        assert list(iter_json_lines(resp)) == events
    assert [r.conn for r in server.requests] == [1, 2]
    kube.get("/plain")
    assert server.requests[-1].conn == 1                   # the kept-alive connection was not the watch's


def tls_server_context(serving: ServingCert, client_ca: Path | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(serving.cert), str(serving.key))
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(client_ca))
    return ctx


def write_kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": cluster}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return str(path)


def b64(path: Path) -> str:
    import base64

    return base64.b64encode(path.read_bytes()).decode()


def test_tls_with_the_kubeconfigs_ca_and_client_certificate(serve: Callable[..., Scripted], tmp_path: Path) -> None:
    serving = make_serving_cert(tmp_path / "srv", "apiserver")
    client = make_serving_cert(tmp_path / "cli", "admin", ips=(), dns=(), usage="clientAuth")
    server = serve(lambda r: response({"ok": True}), tls=tls_server_context(serving, client.ca))
    files = write_kubeconfig(tmp_path / "files", {"server": server.url, "certificate-authority": str(serving.ca)},
                             {"client-certificate": str(client.cert), "client-key": str(client.key)})
    inline = write_kubeconfig(tmp_path / "inline", {"server": server.url, "certificate-authority-data": b64(serving.ca)},
                              {"client-certificate-data": b64(client.cert), "client-key-data": b64(client.key)})
    for kubeconfig in (files, inline):
        access = from_kubeconfig(kubeconfig)
        assert access is not None
        assert KubeApi(access).get("/a") == {"ok": True}

    no_cert = from_kubeconfig(write_kubeconfig(tmp_path / "nocert", {"server": server.url,
                                                                      "certificate-authority": str(serving.ca)}, {}))
    assert no_cert is not None
    with pytest.raises(ApiUnavailable):
        KubeApi(no_cert).get("/a")
    wrong_ca = from_kubeconfig(write_kubeconfig(tmp_path / "wrongca", {"server": server.url,
                                                                        "certificate-authority": str(client.ca)},
                                                {"client-certificate": str(client.cert), "client-key": str(client.key)}))
    assert wrong_ca is not None
    with pytest.raises(ApiUnavailable, match="certificate verify failed"):
        KubeApi(wrong_ca).get("/a")
    insecure = from_kubeconfig(write_kubeconfig(tmp_path / "insecure", {"server": server.url,
                                                                         "insecure-skip-tls-verify": True},
                                                {"client-certificate": str(client.cert), "client-key": str(client.key)}))
    assert insecure is not None and KubeApi(insecure).get("/a") == {"ok": True}


def test_tls_server_name_is_what_the_certificate_is_checked_against(serve: Callable[..., Scripted],
                                                                     tmp_path: Path) -> None:
    serving = make_serving_cert(tmp_path / "srv", "apiserver", ips=(), dns=("apiserver.test",))
    server = serve(lambda r: response({"ok": True}), tls=tls_server_context(serving, None))
    cluster = {"server": server.url, "certificate-authority": str(serving.ca)}
    by_ip = from_kubeconfig(write_kubeconfig(tmp_path / "ip", cluster, {"token": "t"}))
    assert by_ip is not None
    with pytest.raises(ApiUnavailable, match="certificate verify failed"):
        KubeApi(by_ip).get("/a")
    named = from_kubeconfig(write_kubeconfig(tmp_path / "named", {**cluster, "tls-server-name": "apiserver.test"},
                                             {"token": "t"}))
    assert named is not None and KubeApi(named).get("/a") == {"ok": True}


def test_https_through_an_http_proxy_tunnel(serve: Callable[..., Scripted], tmp_path: Path) -> None:
    serving = make_serving_cert(tmp_path / "srv", "apiserver")
    server = serve(lambda r: response({"ok": True}), tls=tls_server_context(serving, None))
    tunnels: list[str] = []
    proxy = socket.create_server(("127.0.0.1", 0))

    def tunnel() -> None:
        conn, _ = proxy.accept()
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            head += conn.recv(1)
        tunnels.append(head.split(b" ")[1].decode())
        upstream = socket.create_connection(("127.0.0.1", server.port))
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=lambda a=a, b=b: [b.sendall(d) for d in iter(lambda: a.recv(65536), b"")],
                             daemon=True).start()

    threading.Thread(target=tunnel, daemon=True).start()
    access = from_kubeconfig(write_kubeconfig(tmp_path / "kc", {
        "server": server.url, "certificate-authority": str(serving.ca),
        "proxy-url": f"http://127.0.0.1:{proxy.getsockname()[1]}"}, {"token": "t"}))
    assert access is not None and KubeApi(access).get("/a") == {"ok": True}
    assert tunnels == [f"127.0.0.1:{server.port}"]
    proxy.close()


def test_kubeconfig_mistakes_name_the_file_and_field(tmp_path: Path) -> None:
    def error(cluster: dict[str, Any], user: dict[str, Any]) -> str:
        path = write_kubeconfig(tmp_path / "kc", cluster, user)
        with pytest.raises(ConnectError) as err:
            from_kubeconfig(path)
        return str(err.value)

    kc = tmp_path / "kc"
    assert error({"server": "ftp://x"}, {}) == f"kubeconfig {kc}: cluster k: server 'ftp://x' is not an http(s) URL"
    assert error({"server": "https://x", "certificate-authority": "ca.crt"}, {}) == (
        f"kubeconfig {kc}: cluster k: certificate-authority {tmp_path / 'ca.crt'}: no such file")
    assert error({"server": "https://x", "certificate-authority-data": "%%%"}, {}).startswith(
        f"kubeconfig {kc}: cluster k: certificate-authority-data: not base64")
    assert error({"server": "https://x"}, {"client-key": str(kc)}) == (
        f"kubeconfig {kc}: user u: a client certificate needs both client-certificate(-data) and client-key(-data)")
    assert error({"server": "https://x"}, {"tokenFile": "nosuch"}) == (
        f"kubeconfig {kc}: user u: tokenFile {tmp_path / 'nosuch'}: no such file")
    assert error({"server": "https://x", "proxy-url": "socks5://p:1"}, {}) == (
        f"kubeconfig {kc}: cluster k: proxy-url: proxy 'socks5://p:1': only http:// proxies are supported")
    (tmp_path / "bad.pem").write_text("not a certificate")
    assert "certificate authority" in error({"server": "https://x", "certificate-authority": "bad.pem"}, {})
    assert from_kubeconfig(write_kubeconfig(kc, {"server": "https://x"}, {"exec": {"command": "x"}})) is None


def test_kubeconfig_lists_merge_as_kubectl_merges_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "token").write_text("from-a\n")
    (tmp_path / "a" / "config").write_text(yaml.safe_dump({
        "current-context": "one",
        "clusters": [{"name": "k", "cluster": {"server": "http://first:1/prefix/"}}],
        "users": [{"name": "u", "user": {"tokenFile": "token"}}],       # relative to its own file
        "contexts": [{"name": "one", "context": {"cluster": "k", "user": "u"}}]}))
    (tmp_path / "b").write_text(yaml.safe_dump({
        "current-context": "two",
        "clusters": [{"name": "k", "cluster": {"server": "http://second:2"}},
                     {"name": "k2", "cluster": {"server": "http://[::1]:3"}}],
        "contexts": [{"name": "two", "context": {"cluster": "k2"}}]}))
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}:{tmp_path / 'a' / 'config'}:{tmp_path / 'b'}")
    one = from_kubeconfig()
    assert one is not None and one.server == "http://first:1/prefix/"          # the first definition wins
    assert one.credentials.headers() == {"Authorization": "Bearer from-a"}
    assert one.transport.server.prefix == "/prefix" and one.transport.server.host_header == "first:1"
    two = from_kubeconfig(context="two")
    assert two is not None and two.transport.server.host_header == "[::1]:3" and two.credentials.headers() == {}


def test_in_cluster_reads_the_service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kube import kubeconfig

    serving = make_serving_cert(tmp_path / "srv", "apiserver")
    (tmp_path / "ca.crt").write_bytes(serving.ca.read_bytes())
    (tmp_path / "token").write_text("one")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    access = kubeconfig.in_cluster(tmp_path)
    assert access.server == "https://[fd00::1]:443"
    assert access.credentials.headers() == {"Authorization": "Bearer one"}
    (tmp_path / "token").write_text("two")
    assert access.credentials.headers() == {"Authorization": "Bearer one"}     # re-read at most once a minute
    monkeypatch.setattr(kubeconfig, "TOKEN_REREAD_S", 0.0)
    assert access.credentials.headers() == {"Authorization": "Bearer two"}
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "https")
    with pytest.raises(ConnectError, match="KUBERNETES_SERVICE_PORT 'https' is not a port number"):
        kubeconfig.in_cluster(tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    (tmp_path / "ca.crt").unlink()
    with pytest.raises(ConnectError, match=f"CA file {tmp_path / 'ca.crt'}: no such file"):
        kubeconfig.in_cluster(tmp_path)


def test_a_kubernetes_api_client_is_read_as_an_access_with_its_headers(serve: Callable[..., Scripted]) -> None:
    """Callers that hand over a kubernetes ApiClient (exec-plugin kubeconfigs, tests impersonating a user) get its
    token and default headers, and every KubeApi on it shares one connection per thread."""
    from kubernetes import client as kclient

    server = serve(lambda r: response({}))
    config = kclient.Configuration()
    config.host = server.url
    config.api_key = {"BearerToken": "Bearer from-client"}
    api_client = kclient.ApiClient(config)
    api_client.set_default_header("Impersonate-User", "someone")
    KubeApi(api_client).get("/a")
    KubeApi(api_client).get("/b")
    assert [(r.conn, r.headers["authorization"], r.headers["impersonate-user"]) for r in server.requests] == [
        (1, "Bearer from-client", "someone")] * 2
