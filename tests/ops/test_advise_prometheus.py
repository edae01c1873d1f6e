"""`gpu-dra advise`'s Prometheus client against a scripted server: the queries of a window and what they give, the
credentials Prometheus users have (basic auth in the URL or from a file, a bearer token, a CA, promtool's HTTP
config), and one clear line for each way it fails: refused, unknown host, TLS, not a Prometheus API at that URL,
credentials refused, a query refused."""
from __future__ import annotations

import socket
import ssl
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scripted_http import Request, Scripted, response
from tlscerts import make_serving_cert

from ops.advise.history import parse_duration, queries, read_window
from ops.advise.prometheus import HttpConfig, PrometheusApi, PrometheusError, load_http_config, read_page

PRODUCT = "NVIDIA H100 80GB HBM3"
LABELS = {"namespace": "ml", "pod": "nb-0", "container": "main", "claim": "nb-0-gpu-x7k2p", "request": "gpu",
          "device": "gpu-0", "gpu_uuid": "GPU-0", "mig_profile": "", "sharing": "none", "Hostname": "node-a",
          "gpu": "0", "UUID": "GPU-0", "modelName": PRODUCT, "instance": "10.0.0.1:8080", "job": "gpu-dra"}


def form(req: Request) -> dict[str, str]:
    return {k: v[0] for k, v in urllib.parse.parse_qs(req.body.decode()).items()}


def vector(*values: tuple[dict[str, str], float]) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": "vector",
                                          "result": [{"metric": m, "value": [1.0, str(v)]} for m, v in values]}}


def fake_prometheus(figures: dict[str, float], alive: list[list[Any]]) -> Any:
    """Answers each of the window's queries by the function it starts with."""
    def answer(req: Request) -> bytes:
        q = form(req)["query"]
        if req.target.endswith("/query_range"):
            return response({"status": "success", "data": {"resultType": "matrix", "result": [
                {"metric": {"instance": "10.0.0.1:8080"}, "values": alive}]}})
        for figure, expr in queries(7 * 86400, "").items():
            if q == expr:
                return response(vector((LABELS, figures[figure])))
        return response(vector())
    return answer


@pytest.fixture
def closed_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_a_window_read_through_the_http_api() -> None:
    end = 1_000_000.0
    alive = [[end - 7 * 86400 + t, "3"] for t in range(0, 7 * 86400, 61)]
    server = Scripted(fake_prometheus({"peak": 6e9, "p95": 5e9, "samples": 20000, "first": end - 7 * 86400,
                                       "last": end, "sm_peak": 80, "sm_p95": 35}, alive))
    try:
        prom = PrometheusApi(f"http://ann:s%3Acret@127.0.0.1:{server.port}/prom/")
        got = read_window(prom, end, 7 * 86400, max_gap=600)
    finally:
        server.stop()
    s, = got.series
    assert (s.pod, s.model, s.memory_peak, s.memory_p95, s.samples, s.sm_p95) == ("nb-0", PRODUCT, 6e9, 5e9, 20000, 35)
    assert got.gaps == [] and prom.base == f"http://127.0.0.1:{server.port}/prom"
    first = server.requests[0]
    assert first.method == "POST" and first.target == "/prom/api/v1/query"
    assert first.headers["authorization"] == "Basic YW5uOnM6Y3JldA=="        # ann:s:cret, from the URL
    assert form(first) == {"query": "max_over_time(gpu_dra_claim_gpu_memory_used_bytes[604800s])",
                           "time": "1000000.000"}
    ranged = next(r for r in server.requests if r.target.endswith("query_range"))
    assert form(ranged)["query"] == "count by (instance) (gpu_dra_prepared_claims)" and form(ranged)["step"] == \
        "60.480"


def test_a_namespace_narrows_every_query_and_a_gap_is_found() -> None:
    end = 100_000.0
    alive = [[end - 3600 + t, "1"] for t in range(0, 3600) if not 1000 <= t < 2000]
    matrix = {"status": "success", "data": {"resultType": "matrix", "result": [{"metric": {"instance": "a"},
                                                                                "values": alive}]}}
    server = Scripted(lambda req: response(matrix if req.target.endswith("query_range") else vector((LABELS, 1.0))))
    try:
        got = read_window(PrometheusApi(server.url), end, 3600, namespace="ml", max_gap=300)
    finally:
        server.stop()
    per_claim = [form(r)["query"] for r in server.requests if "gpu_dra_claim_" in form(r)["query"]]
    assert len(per_claim) == 7 and all('gpu_dra_claim_gpu_memory_used_bytes{namespace="ml"}' in q or
                                       'gpu_dra_claim_gpu_sm_utilization_percent{namespace="ml"}' in q
                                       for q in per_claim)
    assert any('reason="OOMKilled",namespace="ml"' in form(r)["query"] for r in server.requests)
    gap, = got.gaps
    assert (gap.instance, gap.start, gap.end) == ("a", end - 3600 + 1000, end - 3600 + 2000)


def test_bearer_token_basic_auth_and_a_ca_from_promtools_http_config(tmp_path: Path) -> None:
    cert = make_serving_cert(tmp_path, "prometheus")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert.cert, cert.key)
    server = Scripted(lambda req: response(vector()), tls=tls)
    (tmp_path / "token").write_text("t0ken\n")
    (tmp_path / "password").write_text("pw\n")
    config = tmp_path / "http.yml"
    config.write_text(f"authorization:\n  credentials_file: {tmp_path / 'token'}\n"
                      f"tls_config:\n  ca_file: {cert.ca}\n")
    try:
        PrometheusApi(server.url, load_http_config(str(config))).query("up", 1.0)
        assert server.requests[-1].headers["authorization"] == "Bearer t0ken"
        basic = tmp_path / "basic.yml"
        basic.write_text(f"basic_auth:\n  username: ann\n  password_file: {tmp_path / 'password'}\n"
                         f"tls_config:\n  ca_file: {cert.ca}\n")
        PrometheusApi(server.url, load_http_config(str(basic))).query("up", 1.0)
        assert server.requests[-1].headers["authorization"] == "Basic YW5uOnB3"
        with pytest.raises(PrometheusError) as err:
            PrometheusApi(server.url).query("up", 1.0)
    finally:
        server.stop()
    assert str(err.value) == (f"cannot reach Prometheus at {server.url}: tls: failed to verify certificate: unable "
                              "to get local issuer certificate - give its CA with --prometheus-ca-file (or "
                              "tls_config.ca_file in --http-config)")


def _fails(url: str, answer: Any = None, config: HttpConfig = HttpConfig()) -> str:
    server = Scripted(answer) if answer else None
    try:
        with pytest.raises(PrometheusError) as err:
            PrometheusApi(url.format(url=server.url if server else ""), config, timeout=5).query("up", 1.0)
    finally:
        if server:
            server.stop()
    text = str(err.value)
    assert "\n" not in text and "Errno" not in text and "urllib3" not in text and "HTTPConnection" not in text
    return text


def test_each_failure_is_one_line(closed_port: int) -> None:
    url = f"http://127.0.0.1:{closed_port}"
    assert _fails(url) == f"cannot reach Prometheus at {url}: connection refused - is the URL right and the server up?"
    assert _fails("http://prometheus.invalid:9090") == ("cannot reach Prometheus at http://prometheus.invalid:9090: "
                                                        "no such host - check the URL")
    html = b"HTTP/1.1 404 Not Found\r\nContent-Type: text/html\r\nContent-Length: 9\r\n\r\n<h1>x</h1"
    assert _fails("{url}/grafana", lambda req: html).endswith(
        "/grafana is not a Prometheus HTTP API (POST /api/v1/query answered 404 with no JSON) - --prometheus takes "
        "the server's base URL, e.g. http://prometheus.monitoring:9090")
    assert "refused the query (401 Unauthorized) - check the credentials" in _fails(
        "{url}", lambda req: response({"error": "unauthorized"}, 401))
    refused = _fails("{url}", lambda req: response({"status": "error", "errorType": "bad_data",
                                                    "error": "1:5: parse error:\n unexpected"}, 400))
    assert refused.endswith("refused the query 'up': bad_data: 1:5: parse error: unexpected")
    assert "gave a matrix, not a vector" in _fails("{url}", lambda req: response(
        {"status": "success", "data": {"resultType": "matrix", "result": []}}))
    assert _fails("ftp://x") == "--prometheus 'ftp://x': not an http(s) URL (e.g. http://prometheus.monitoring:9090)"


def test_a_plugins_metrics_page(closed_port: int) -> None:
    page = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 6\r\n\r\nup 1\n\n"
    server = Scripted(lambda req: page if req.target == "/metrics" else
                      b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    try:
        assert read_page(f"{server.url}/metrics") == "up 1\n\n"
        with pytest.raises(PrometheusError, match="answered 404: is it the kubelet plugin's metrics port"):
            read_page(f"{server.url}/other")
    finally:
        server.stop()
    with pytest.raises(PrometheusError, match=f"cannot reach the /metrics at http://127.0.0.1:{closed_port}/metrics: "
                                              "connection refused"):
        read_page(f"http://127.0.0.1:{closed_port}/metrics")


def test_durations() -> None:
    assert parse_duration("7d", "--window") == 7 * 86400 and parse_duration("1h30m", "-") == 5400
    assert parse_duration("2w", "-") == 14 * 86400 and parse_duration("90s", "-") == 90
    for bad in ("", "7", "1.5h", "0s", "1y"):
        with pytest.raises(ValueError, match="--window"):
            parse_duration(bad, "--window")
