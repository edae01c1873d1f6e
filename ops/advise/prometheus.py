"""Prometheus' HTTP API (``/api/v1/query``, ``/api/v1/query_range``) over urllib3, with the credentials Prometheus
users already have: basic auth (in the URL, or a user and a password file), a bearer token file, a CA file and a
client certificate, or all of these in promtool's ``--http.config.file`` format.

Every failure is a PrometheusError whose text is one line naming the server and what to check; the library's
own words (urllib3's connection objects, errno numbers) never reach it.
"""
from __future__ import annotations

import json
import socket
import ssl
import urllib.parse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import urllib3
import yaml

# A query's answer larger than this is refused instead of read without bound (a week of a few thousand series'
# aggregates is a few MiB).
MAX_ANSWER = 256 << 20
_READ = 64 << 10


class PrometheusError(RuntimeError):
    """Prometheus could not answer: unreachable, not a Prometheus API at that URL, credentials refused, or a
    query it refused. The message is one line."""


@dataclass(frozen=True)
class HttpConfig:
    """How to reach the server: what promtool's --http.config.file holds, in the parts this client uses."""

    username: str = ""
    password: str = ""
    bearer_token: str = ""
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    insecure_skip_verify: bool = False


def read_secret(path: str, what: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as err:
        raise PrometheusError(f"cannot read {what} {path}: {(err.strerror or str(err)).lower()}") from err


def load_http_config(path: str) -> HttpConfig:
    """promtool's --http.config.file: ``basic_auth`` (username, password or password_file), ``authorization``
    (credentials or credentials_file, type Bearer), ``bearer_token``/``bearer_token_file`` and ``tls_config``
    (ca_file, cert_file, key_file, server_name, insecure_skip_verify)."""
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise PrometheusError(f"cannot read the HTTP config {path}: {err}") from err
    if not isinstance(doc, dict):
        raise PrometheusError(f"HTTP config {path}: not a mapping (promtool's --http.config.file format)")
    out = HttpConfig()
    basic = doc.get("basic_auth") or {}
    if basic:
        password = basic.get("password") or (read_secret(basic["password_file"], "the password file")
                                             if basic.get("password_file") else "")
        out = replace(out, username=str(basic.get("username", "")), password=str(password))
    auth = doc.get("authorization") or {}
    if auth and str(auth.get("type", "Bearer")).lower() != "bearer":
        raise PrometheusError(f"HTTP config {path}: authorization type {auth.get('type')!r}: only Bearer is supported")
    token = auth.get("credentials") or doc.get("bearer_token") or ""
    token_file = auth.get("credentials_file") or doc.get("bearer_token_file")
    if token_file:
        token = read_secret(str(token_file), "the token file")
    tls = doc.get("tls_config") or {}
    return replace(out, bearer_token=str(token), ca_file=str(tls.get("ca_file", "")),
                   cert_file=str(tls.get("cert_file", "")), key_file=str(tls.get("key_file", "")),
                   server_name=str(tls.get("server_name", "")),
                   insecure_skip_verify=bool(tls.get("insecure_skip_verify", False)))


class PrometheusApi:
    """Instant and range queries against one server. ``url``: the server's base URL (a path prefix such as
    ``/prometheus`` kept); user:password in it is basic auth."""

    def __init__(self, url: str, config: HttpConfig = HttpConfig(), timeout: float = 60.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PrometheusError(f"--prometheus {url!r}: not an http(s) URL (e.g. http://prometheus.monitoring:9090)")
        if parts.username is not None and not config.username:
            config = replace(config, username=urllib.parse.unquote(parts.username),
                             password=urllib.parse.unquote(parts.password or ""))
        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        netloc = host + (f":{parts.port}" if parts.port else "")
        self.base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        self.timeout = timeout
        self.config = config
        self._headers = {"Accept": "application/json", "User-Agent": "gpu-dra-advise"}
        if config.username:
            self._headers.update(urllib3.make_headers(basic_auth=f"{config.username}:{config.password}"))
        elif config.bearer_token:
            self._headers["Authorization"] = f"Bearer {config.bearer_token}"
        tls: dict[str, Any] = {}
        if parts.scheme == "https":
            for name in ("ca_file", "cert_file", "key_file"):
                path = getattr(config, name)
                if path and not Path(path).is_file():
                    raise PrometheusError(f"the Prometheus {name.replace('_', ' ')} {path}: no such file")
            tls = {"cert_reqs": "CERT_NONE" if config.insecure_skip_verify else "CERT_REQUIRED",
                   "ca_certs": config.ca_file or None, "cert_file": config.cert_file or None,
                   "key_file": config.key_file or None}
            if config.server_name:
                tls["server_hostname"] = config.server_name
        self._pool = urllib3.PoolManager(num_pools=1, maxsize=2, **tls)

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        """An instant query's vector: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        data = self._call("query", {"query": expr, "time": f"{at:.3f}"})
        return _result(data, "vector", expr)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query's matrix: [{"metric": {...}, "values": [[t, "v"], ...]}, ...]."""
        data = self._call("query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                          "step": f"{step:.3f}"})
        return _result(data, "matrix", expr)

    def close(self) -> None:
        self._pool.clear()

    def _call(self, endpoint: str, fields: dict[str, str]) -> Any:
        url = f"{self.base}/api/v1/{endpoint}"
        try:
            # POST with a form, as Grafana does: a long selector does not run into URL length limits.
            resp = self._pool.request("POST", url, fields=fields, encode_multipart=False, headers=self._headers,
                                      timeout=urllib3.Timeout(connect=min(10.0, self.timeout), read=self.timeout),
                                      retries=False, preload_content=False, redirect=False)
            body = _read(resp, self.base)
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise PrometheusError(unreachable(f"Prometheus at {self.base}", err, self.timeout)) from err
        doc = _json(body)
        if resp.status in (401, 403):
            raise PrometheusError(f"Prometheus at {self.base} refused the query ({resp.status} "
                                  f"{'Unauthorized' if resp.status == 401 else 'Forbidden'}) - check the credentials "
                                  "(user:password in the URL, --prometheus-user/--prometheus-password-file, "
                                  "--prometheus-token-file or --http-config)")
        if not isinstance(doc, dict) or doc.get("status") not in ("success", "error"):
            raise PrometheusError(f"{self.base} is not a Prometheus HTTP API (POST /api/v1/{endpoint} answered "
                                  f"{resp.status}{' with no JSON' if doc is None else ''}) - --prometheus takes the "
                                  "server's base URL, e.g. http://prometheus.monitoring:9090")
        if doc["status"] == "error":
            raise PrometheusError(f"Prometheus at {self.base} refused the query {fields['query']!r}: "
                                  f"{doc.get('errorType', '')}: {' '.join(str(doc.get('error', '')).split())}")
        return doc.get("data")


def unreachable(where: str, err: BaseException, timeout: float) -> str:
    """Why ``where`` (e.g. "Prometheus at http://...") could not be reached, in one line."""
    root = _root(err)
    if isinstance(root, ssl.SSLCertVerificationError):
        return (f"cannot reach {where}: tls: failed to verify certificate: {root.verify_message or 'unknown'} - "
                "give its CA with --prometheus-ca-file (or tls_config.ca_file in --http-config)")
    if isinstance(root, ssl.SSLError):
        return f"cannot reach {where}: tls: {root.reason or 'handshake failed'} - is that its HTTPS address?"
    if isinstance(root, ConnectionRefusedError):
        return f"cannot reach {where}: connection refused - is the URL right and the server up?"
    if isinstance(root, socket.gaierror):
        return f"cannot reach {where}: no such host - check the URL"
    if isinstance(root, (TimeoutError, socket.timeout)) or isinstance(err, urllib3.exceptions.TimeoutError):
        return f"cannot reach {where}: no answer within {timeout:g}s - is it up and reachable from here?"
    if isinstance(root, ConnectionError) or isinstance(err, urllib3.exceptions.ProtocolError):
        return f"cannot reach {where}: the connection was closed - is that the server's address?"
    return f"cannot reach {where}: {type(root).__name__}"


def read_page(url: str, timeout: float = 30.0) -> str:
    """A plugin's /metrics page (text), or PrometheusError in one line."""
    pool = urllib3.PoolManager(num_pools=1)
    where = f"the /metrics at {url}"
    try:
        resp = pool.request("GET", url, timeout=urllib3.Timeout(connect=min(10.0, timeout), read=timeout),
                            retries=False, preload_content=False)
        body = _read(resp, url)
    except (urllib3.exceptions.HTTPError, OSError, ValueError) as err:
        raise PrometheusError(unreachable(where, err, timeout)) from err
    finally:
        pool.clear()
    if resp.status != 200:
        raise PrometheusError(f"{where} answered {resp.status}: is it the kubelet plugin's metrics port?")
    return body.decode(errors="replace")


def _read(resp: urllib3.BaseHTTPResponse, base: str) -> bytes:
    parts, total = [], 0
    try:
        for chunk in resp.stream(_READ):
            total += len(chunk)
            if total > MAX_ANSWER:
                raise PrometheusError(f"Prometheus at {base} answered with more than {MAX_ANSWER >> 20} MiB: narrow "
                                      "the query (-n NAMESPACE, a shorter --window)")
            parts.append(chunk)
    finally:
        resp.release_conn()
    return b"".join(parts)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _result(data: Any, kind: str, expr: str) -> list[dict[str, Any]]:
    if not isinstance(data, dict) or data.get("resultType") != kind or not isinstance(data.get("result"), list):
        got = data.get("resultType") if isinstance(data, dict) else type(data).__name__
        raise PrometheusError(f"the query {expr!r} gave a {got}, not a {kind}")
    return [r for r in data["result"] if isinstance(r, dict)]


def _root(exc: BaseException) -> BaseException:
    """The innermost cause of an error (urllib3 wraps the socket's or TLS's)."""
    seen: set[int] = set()
    cur: BaseException = exc
    while id(cur) not in seen:
        seen.add(id(cur))
        nxt = cur.__cause__ or cur.__context__ or getattr(cur, "reason", None)
        if not isinstance(nxt, BaseException):
            break
        cur = nxt
    return cur
