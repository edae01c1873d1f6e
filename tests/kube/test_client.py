"""kube.client over urllib3 and kube.connect's ApiClients, against an in-process HTTP/1.1 server whose answers each
test writes byte by byte: keep-alive, bodies by length and chunks, bounds on bodies, lines and interim answers,
malformed answers, a 401 and rotated credentials, TLS (CA, client certificate, tls-server-name), proxies with
credentials, streamed watches, kubeconfig lists and the service account."""
from __future__ import annotations

import base64
import json
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml
from scripted_http import Answer, Proxy, Request, Scripted, response
from tlscerts import ServingCert, make_serving_cert

import kube.client as client
from kube.client import ApiError, ApiUnavailable, KubeApi, iter_json_lines
from kube.connect import ConnectError, api_client_from

MIB = 1024 * 1024


@pytest.fixture
def serve() -> Iterator[Callable[..., Scripted]]:
    started: list[Scripted] = []

    def start(answer: Answer, **kw: Any) -> Scripted:
        started.append(Scripted(answer, **kw))
        return started[-1]

    yield start
    for s in started:
        s.stop()


@pytest.fixture(autouse=True)
def no_proxy_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)


def write_kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": cluster}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return str(path)


def kube_of(server: Scripted, tmp_path: Path, user: dict[str, Any] | None = None, timeout: float = 5.0) -> KubeApi:
    config = write_kubeconfig(tmp_path / f"kc-{time.monotonic_ns()}", {"server": server.url},
                              user if user is not None else {"token": "t"})
    return KubeApi(api_client_from(config), timeout=timeout)


def in_thread(call: Callable[[], Any], timeout: float) -> BaseException | Any:
    """`call`'s result or exception; fails when it has not returned within `timeout` seconds (a hung client)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the client still waits after {timeout} s"
    return out[0]


# --------------------------------------------------------------------------------------------- plain HTTP


def test_requests_reuse_one_kept_alive_connection(serve: Callable[..., Scripted], tmp_path: Path) -> None:
    server = serve(lambda r: response({"path": r.target, "body": r.body.decode()}, chunks=3 if "c" in r.target else 0))
    kube = kube_of(server, tmp_path)
    assert kube.get("/a", limit=5, watch=False) == {"path": "/a?limit=5&watch=false", "body": ""}
    assert kube.get("/c") == {"path": "/c", "body": ""}                  # chunked, extensions and a trailer
    created = kube.create("/things", {"metadata": {"name": "x"}})
    assert json.loads(created["body"]) == {"metadata": {"name": "x"}}
    assert server.connections == 1 and [r.conn for r in server.requests] == [1, 1, 1]
    first = server.requests[0]
    assert first.headers["authorization"] == "Bearer t" and first.headers["user-agent"] == "gpu-dra"
    assert first.headers["host"] == f"127.0.0.1:{server.port}" and first.headers["accept"] == "application/json"
    assert server.requests[2].headers["content-type"] == "application/json"


def test_a_connection_the_server_closed_while_idle_is_replaced(serve: Callable[..., Scripted],
                                                                tmp_path: Path) -> None:
    server = serve(lambda r: response({"n": len(server.requests)}), close_after_answer=True)
    kube = kube_of(server, tmp_path)
    assert kube.get("/a") == {"n": 1}
    deadline = time.monotonic() + 10
    while server.closed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert kube.get("/b") == {"n": 2}
    assert server.connections == 2 and [r.target for r in server.requests] == ["/a", "/b"]


def test_a_dropped_request_is_unavailable_and_not_sent_again(serve: Callable[..., Scripted],
                                                            tmp_path: Path) -> None:
    server = serve(lambda r: None)
    with pytest.raises(ApiUnavailable, match=r"GET http://127.0.0.1:\d+/a: .*Remote end closed"):
        kube_of(server, tmp_path).get("/a")
    assert len(server.requests) == 1


def test_a_slow_answer_times_out_and_is_not_sent_again(serve: Callable[..., Scripted], tmp_path: Path) -> None:
    release = threading.Event()
    server = serve(lambda r: response({}) if r.target == "/first" or release.wait(10) else None)
    kube = kube_of(server, tmp_path, timeout=0.3)
    kube.get("/first")
    with pytest.raises(ApiUnavailable, match="timed out"):
        kube.get("/slow")
    release.set()
    assert [r.target for r in server.requests] == ["/first", "/slow"]
    assert kube.get("/first") == {}                            # a fresh connection after the broken one


def test_an_error_status_is_an_api_error_and_the_connection_stays(serve: Callable[..., Scripted],
                                                                 tmp_path: Path) -> None:
    server = serve(lambda r: response({"kind": "Status", "reason": "NotFound", "message": "gone"}, status=404)
                   if r.target == "/missing" else b"HTTP/1.1 204 No Content\r\n\r\n")
    kube = kube_of(server, tmp_path)
    with pytest.raises(ApiError) as err:
        kube.get("/missing")
    assert err.value.not_found and err.value.reason == "NotFound"
    assert kube.get("/empty") == {} and server.connections == 1


def test_malformed_answers_are_unavailable_servers(serve: Callable[..., Scripted], tmp_path: Path) -> None:
    big = "".join(f"X-Filler-{i}: {'a' * 100}\r\n" for i in range(300))
    for raw, needle in ((b"SSH-2.0-OpenSSH\r\n\r\n", "BadStatusLine"),
                        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "IncompleteRead"),
                        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "InvalidChunkLength"),
                        (response({}, headers=big), "more than 100 headers")):
        server = serve(lambda r, raw=raw: raw, close_after_answer=True)
        with pytest.raises(ApiUnavailable, match=needle):
            kube_of(server, tmp_path).get("/a")


# ------------------------------------------------------------------------------ what an answer may cost


@pytest.mark.parametrize("chunks", [0, 4])
def test_an_answer_over_the_body_limit_is_refused_naming_it(serve: Callable[..., Scripted], tmp_path: Path,
                                                           chunks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "MAX_BODY", 1000)
    server = serve(lambda r: response({"x": "y" * 2000}, chunks=chunks))
    with pytest.raises(ApiUnavailable, match="larger than the limit of 1000 bytes"):
        kube_of(server, tmp_path).get("/a")


def test_a_body_over_the_limit_is_not_read_to_its_end(serve: Callable[..., Scripted], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """64 MiB in chunks against a 1 MiB limit: the client stops reading (the server cannot send it all)."""
    monkeypatch.setattr(client, "MAX_BODY", MIB)
    sent: list[int] = []

    def answer(r: Request) -> Iterator[bytes]:
        yield b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        for i in range(64):
            yield b"100000\r\n" + b"x" * MIB + b"\r\n"
            sent.append(i)

    server = serve(answer)
    result = in_thread(lambda: kube_of(server, tmp_path).get("/a"), 60)
    assert isinstance(result, ApiUnavailable) and "larger than the limit" in str(result)
    time.sleep(0.5)
    assert len(sent) < 32, f"the server sent {len(sent)} MiB: the client read on past its limit"


def test_a_negative_chunk_size_is_an_error_not_a_read_to_the_end(serve: Callable[..., Scripted], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk size of -1 made http.client (and the client before) read to the end of the connection, in memory,
    past any body limit; it is refused before a byte of it is read."""
    monkeypatch.setattr(client, "MAX_BODY", MIB)
    sent: list[int] = []

    def answer(r: Request) -> Iterator[bytes]:
        yield b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n"
        for i in range(64):
            yield b"x" * MIB
            sent.append(i)

    server = serve(answer, close_after_answer=True)
    result = in_thread(lambda: kube_of(server, tmp_path).get("/a"), 60)
    assert isinstance(result, ApiUnavailable) and "negative chunk size" in str(result), result
    time.sleep(0.5)
    assert len(sent) < 32, f"the server sent {len(sent)} MiB: the client read to the end of the connection"

    watch = serve(answer, close_after_answer=True)         # a watch the same
    with kube_of(watch, tmp_path).request("GET", "/w", stream=True) as stream:
        with pytest.raises(ApiUnavailable, match="negative chunk size"):
            list(iter_json_lines(stream))


def test_endless_interim_answers_end_in_a_timeout(serve: Callable[..., Scripted], tmp_path: Path) -> None:
    """A server that sends `100 Continue` without end: the head must be complete within the read timeout."""
    def answer(r: Request) -> Iterator[bytes]:
        for _ in range(2000):
            yield b"HTTP/1.1 100 Continue\r\n\r\n"
            time.sleep(0.02)

    server = serve(answer)
    started = time.monotonic()
    result = in_thread(lambda: kube_of(server, tmp_path, timeout=1.0).get("/a"), 20)
    assert isinstance(result, ApiUnavailable) and "timed out" in str(result), result
    assert time.monotonic() - started < 5


def test_a_watch_line_over_its_limit_is_refused(serve: Callable[..., Scripted], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "MAX_LINE", 1000)
    body = json.dumps({"type": "ADDED", "object": {"x": "y" * 5000}}).encode() + b"\n"
    server = serve(lambda r: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" +
                   b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in (body[:600], body[600:])) +
                   b"0\r\n\r\n")
    with kube_of(server, tmp_path).request("GET", "/w", stream=True) as stream:
        with pytest.raises(ApiUnavailable, match="a streamed line longer than 1000 bytes"):
            list(iter_json_lines(stream))


# -------------------------------------------------------------------------------------- streamed watches


def test_a_watch_streams_events_on_a_connection_of_its_own(serve: Callable[..., Scripted], tmp_path: Path) -> None:
    events = [{"type": "ADDED", "object": {"n": i}} for i in range(3)]

    def answer(r: Request) -> bytes:
        if "watch" not in r.target:
            return response({})
        out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        lines = [json.dumps(e).encode() + b"\n" for e in events]
        split = [lines[0], lines[1] + lines[2][:5], lines[2][5:]]     # one per chunk, then two across chunks
        return out + b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in split) + b"0\r\n\r\n"

    server = serve(answer)
    kube = kube_of(server, tmp_path)
    kube.get("/plain")
    with kube.request("GET", "/things", query={"watch": "true"}, stream=True) as resp:
        kube.get("/plain")                                    # meanwhile, on the kept-alive connection
        assert list(iter_json_lines(resp)) == events
    assert [r.conn for r in server.requests] == [1, 1, 2] or [r.conn for r in server.requests] == [1, 2, 2]


def test_a_blocked_watch_read_ends_when_shut_down(serve: Callable[..., Scripted], tmp_path: Path) -> None:
    def answer(r: Request) -> Iterator[bytes]:
        yield b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        time.sleep(30)

    server = serve(answer)
    stream = kube_of(server, tmp_path, timeout=60).request("GET", "/w", stream=True)
    threading.Timer(0.3, stream.shutdown).start()
    result = in_thread(lambda: list(iter_json_lines(stream)), 10)
    stream.close()
    assert result == [] or isinstance(result, ApiUnavailable)


def test_a_watch_refused_is_an_api_error(serve: Callable[..., Scripted], tmp_path: Path) -> None:
    server = serve(lambda r: response({"kind": "Status", "reason": "Forbidden", "message": "no"}, status=403))
    with pytest.raises(ApiError, match="HTTP 403 Forbidden: no"):
        kube_of(server, tmp_path).request("GET", "/w", stream=True)


# ----------------------------------------------------------------------------------------- credentials


def test_a_401_sends_once_more_with_a_rotated_token_file(serve: Callable[..., Scripted], tmp_path: Path) -> None:
    server = serve(lambda r: response({"who": r.headers["authorization"]}) if r.headers["authorization"] == "Bearer new"
                   else response({"kind": "Status", "reason": "Unauthorized"}, status=401))
    token = tmp_path / "token"
    token.write_text("old\n")
    kube = kube_of(server, tmp_path, user={"tokenFile": str(token)})
    token.write_text("new\n")                     # rotated while the old one is reused
    assert kube.get("/a") == {"who": "Bearer new"}
    assert [r.headers["authorization"] for r in server.requests] == ["Bearer old", "Bearer new"]
    assert kube.get("/b") == {"who": "Bearer new"}

    server.requests.clear()
    with pytest.raises(ApiError, match="HTTP 401 Unauthorized"):   # a static token cannot change: no second try
        kube_of(server, tmp_path, user={"token": "wrong"}).get("/a")
    assert len(server.requests) == 1


def test_credentials_are_built_once_per_api_client_and_reused(serve: Callable[..., Scripted],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every KubeApi on a kubernetes ApiClient gets its token and default headers (an impersonated user), built
    once for all of them within CREDENTIALS_REUSE_S, on one kept-alive connection."""
    from kubernetes import client as kclient

    server = serve(lambda r: response({}))
    config = kclient.Configuration()
    config.host = server.url
    config.api_key = {"BearerToken": "Bearer from-client"}
    hooks: list[int] = []
    config.refresh_api_key_hook = lambda cfg: hooks.append(1)
    api_client = kclient.ApiClient(config)
    api_client.set_default_header("Impersonate-User", "someone")
    for path in ("/a", "/b", "/c"):
        KubeApi(api_client).get(path)
    assert [(r.conn, r.headers["authorization"], r.headers["impersonate-user"], r.headers["user-agent"])
            for r in server.requests] == [(1, "Bearer from-client", "someone", "gpu-dra")] * 3
    assert len(hooks) == 1
    monkeypatch.setattr(client, "CREDENTIALS_REUSE_S", 0.0)
    KubeApi(api_client).get("/d")
    assert len(hooks) == 2


def test_basic_auth_and_an_exec_plugin(serve: Callable[..., Scripted], tmp_path: Path) -> None:
    server = serve(lambda r: response({}))
    kube_of(server, tmp_path, user={"username": "ann", "password": "p:w"}).get("/a")
    plugin = tmp_path / "plugin.sh"
    plugin.write_text('#!/bin/sh\necho \'{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",'
                      ' "status": {"token": "from-plugin"}}\'\n')
    plugin.chmod(0o755)
    kube_of(server, tmp_path, user={"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                                             "command": str(plugin), "interactiveMode": "Never"}}).get("/b")
    assert [r.headers["authorization"] for r in server.requests] == [
        "Basic " + base64.b64encode(b"ann:p:w").decode(), "Bearer from-plugin"]

    broken = tmp_path / "broken.sh"
    broken.write_text("#!/bin/sh\necho 'no credentials for you' >&2\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(ConnectError, match="exec credential plugin gave no credentials: exec: process returned 3. "
                                           "no credentials for you"):
        kube_of(server, tmp_path, user={"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                                                 "command": str(broken), "interactiveMode": "Never"}})


# ----------------------------------------------------------------------------------------------------- TLS


def tls_server_context(serving: ServingCert, client_ca: Path | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(serving.cert), str(serving.key))
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(client_ca))
    return ctx


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def test_tls_with_the_kubeconfigs_ca_and_client_certificate(serve: Callable[..., Scripted], tmp_path: Path) -> None:
    serving = make_serving_cert(tmp_path / "srv", "apiserver")
    cert = make_serving_cert(tmp_path / "cli", "admin", ips=(), dns=(), usage="clientAuth")
    server = serve(lambda r: response({"ok": True}), tls=tls_server_context(serving, cert.ca))
    user = {"client-certificate": str(cert.cert), "client-key": str(cert.key)}

    def get(name: str, cluster: dict[str, Any], user: dict[str, Any]) -> Any:
        return KubeApi(api_client_from(write_kubeconfig(tmp_path / name, {"server": server.url, **cluster}, user)),
                       timeout=5).get("/a")

    assert get("files", {"certificate-authority": str(serving.ca)}, user) == {"ok": True}
    assert get("inline", {"certificate-authority-data": b64(serving.ca)},
               {"client-certificate-data": b64(cert.cert), "client-key-data": b64(cert.key)}) == {"ok": True}
    with pytest.warns(urllib3.exceptions.InsecureRequestWarning):  # what the kubeconfig asked for, said aloud
        assert get("insecure", {"insecure-skip-tls-verify": True}, user) == {"ok": True}
    with pytest.raises(ApiUnavailable):
        get("nocert", {"certificate-authority": str(serving.ca)}, {})
    with pytest.raises(ApiUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
        get("wrongca", {"certificate-authority": str(cert.ca)}, user)


def test_tls_server_name_is_what_the_certificate_is_checked_against(serve: Callable[..., Scripted],
                                                                     tmp_path: Path) -> None:
    serving = make_serving_cert(tmp_path / "srv", "apiserver", ips=(), dns=("apiserver.test",))
    server = serve(lambda r: response({"ok": True}), tls=tls_server_context(serving, None))
    cluster = {"server": server.url, "certificate-authority": str(serving.ca)}
    with pytest.raises(ApiUnavailable, match="CERTIFICATE_VERIFY_FAILED|match"):
        KubeApi(api_client_from(write_kubeconfig(tmp_path / "ip", cluster, {"token": "t"}))).get("/a")
    named = api_client_from(write_kubeconfig(tmp_path / "named", {**cluster, "tls-server-name": "apiserver.test"},
                                             {"token": "t"}))
    assert KubeApi(named).get("/a") == {"ok": True}


# ---------------------------------------------------------------------------------------------- proxies


@pytest.mark.parametrize("tls", [True, False], ids=["https-connect", "http-absolute-uri"])
def test_a_proxy_url_with_credentials_sends_them_to_the_proxy(serve: Callable[..., Scripted], tmp_path: Path,
                                                             tls: bool) -> None:
    serving = make_serving_cert(tmp_path / "srv", "apiserver")
    server = serve(lambda r: response({"ok": True, "target": r.target}),
                   tls=tls_server_context(serving, None) if tls else None)
    proxy = Proxy(server.port)
    try:
        port = proxy.url.rsplit(":", 1)[1]
        cluster = {"server": server.url, "proxy-url": f"http://us%40er:p%3Ass@127.0.0.1:{port}",
                   **({"certificate-authority": str(serving.ca)} if tls else {})}
        kube = KubeApi(api_client_from(write_kubeconfig(tmp_path / "kc", cluster, {"token": "t"})), timeout=5)
        answer = kube.get("/version")
        assert answer["ok"] is True
        first, headers = proxy.heads[0]
        assert headers["proxy-authorization"] == "Basic " + base64.b64encode(b"us@er:p:ss").decode()
        if tls:
            assert first == f"CONNECT 127.0.0.1:{server.port} HTTP/1.1" or first.startswith("CONNECT 127.0.0.1:")
            assert "authorization" not in headers            # the API server's token never goes to the proxy
        else:
            assert first == f"GET {server.url}/version HTTP/1.1"
        assert server.requests[0].headers["authorization"] == "Bearer t"
        assert "proxy-authorization" not in server.requests[0].headers or not tls
    finally:
        proxy.stop()


# ------------------------------------------------------------------------------------ kubeconfig reading


def test_kubeconfig_lists_merge_as_kubectl_merges_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first definition of a name and the first current-context win; a relative path is taken from its own
    file's directory; a missing file of the list is skipped."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "token").write_text("from-a\n")
    (tmp_path / "a" / "config").write_text(yaml.safe_dump({
        "current-context": "one",
        "clusters": [{"name": "k", "cluster": {"server": "http://first:1/prefix/"}}],
        "users": [{"name": "u", "user": {"tokenFile": "token"}}],
        "contexts": [{"name": "one", "context": {"cluster": "k", "user": "u"}}]}))
    (tmp_path / "b").write_text(yaml.safe_dump({
        "current-context": "two",
        "clusters": [{"name": "k", "cluster": {"server": "http://second:2"}},
                     {"name": "k2", "cluster": {"server": "http://[::1]:3"}}],
        "contexts": [{"name": "two", "context": {"cluster": "k2"}}]}))
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}:{tmp_path / 'a' / 'config'}:{tmp_path / 'b'}")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    one = api_client_from()
    assert one.configuration.host == "http://first:1/prefix"
    assert client.credentials_of(one).headers()["authorization"] == "Bearer from-a"
    two = api_client_from(context="two")
    assert two.configuration.host == "http://[::1]:3" and "authorization" not in client.credentials_of(two).headers()


def test_kubeconfigs_kubectl_refuses_are_refused_naming_the_file(tmp_path: Path) -> None:
    def error(cluster: dict[str, Any], user: dict[str, Any]) -> str:
        path = write_kubeconfig(tmp_path / "kc", cluster, user)
        with pytest.raises(ConnectError) as err:
            api_client_from(path)
        return str(err.value)

    kc, ca = tmp_path / "kc", str(tmp_path / "kc")
    assert error({"server": "https://x", "insecure-skip-tls-verify": True, "certificate-authority": ca}, {}) == (
        f"kubeconfig {kc}: specifying a root certificates file with the insecure flag is not allowed (cluster k: "
        f"insecure-skip-tls-verify together with certificate-authority)")
    assert "insecure flag is not allowed" in error(
        {"server": "https://x", "insecure-skip-tls-verify": True, "certificate-authority-data": "bm90"}, {})
    assert error({}, {}) == f'kubeconfig {kc}: no server found for cluster "k"'
    assert error({"server": "https://x"}, {"token": "t", "username": "a", "password": "b"}) == (
        f"kubeconfig {kc}: more than one authentication method found for u; found [token basicAuth], "
        f"only one is allowed")
    assert error({"server": "https://x"}, {"client-certificate": ca}) == (
        f"kubeconfig {kc}: client-key-data or client-key must be specified for u to use the clientCert "
        f"authentication method.")
    assert error({"server": "https://x"}, {"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                                                    "command": "x"}}) == (
        f"kubeconfig {kc}: interactiveMode must be specified for u to use exec authentication plugin")
    assert error({"server": "https://x", "proxy-url": "ftp://p:1"}, {}).startswith(
        f"kubeconfig {kc}: invalid 'proxy-url' \"ftp://p:1\" for cluster \"k\": unsupported scheme")
    assert error({"server": "https://x", "certificate-authority": "nosuch.crt"}, {}) == (
        f"kubeconfig {kc} context c: File does not exist: {tmp_path / 'nosuch.crt'}")
    kc.write_text("this: is: not: yaml: [")
    with pytest.raises(ConnectError) as not_yaml:
        api_client_from(str(kc))
    assert str(not_yaml.value) == f'error loading config file "{kc}": yaml: line 1, column 9: mapping values are not allowed here'
    write_kubeconfig(kc, {"server": "https://x"}, {})
    with pytest.raises(ConnectError, match="--context nosuch: no such context"):
        api_client_from(str(kc), "nosuch")


def test_in_cluster_reads_the_service_account_and_a_401_rereads_a_rotated_token(
        serve: Callable[..., Scripted], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service account's token and CA, where the kubernetes package looks for them; the package re-reads the
    token once a minute, and a 401 at once."""
    from kubernetes.config import incluster_config

    serving = make_serving_cert(tmp_path / "srv", "apiserver")
    accepted = ["Bearer one"]
    server = serve(lambda r: response({"who": r.headers["authorization"]})
                   if r.headers["authorization"] in accepted else response({"reason": "Unauthorized"}, status=401),
                   tls=tls_server_context(serving, None))
    (tmp_path / "ca.crt").write_bytes(serving.ca.read_bytes())
    (tmp_path / "token").write_text("one")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
    kube = KubeApi(api_client_from(), timeout=5)
    assert kube.host == f"https://127.0.0.1:{server.port}"
    assert kube.get("/a") == {"who": "Bearer one"}
    (tmp_path / "token").write_text("two\n")
    accepted[:] = ["Bearer two"]
    assert kube.get("/b") == {"who": "Bearer two"}
    assert [r.headers["authorization"] for r in server.requests] == ["Bearer one", "Bearer one", "Bearer two"]
    (tmp_path / "ca.crt").unlink()
    with pytest.raises(ConnectError, match="in-cluster configuration: Service certification file does not exist"):
        api_client_from()
