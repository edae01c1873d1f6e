"""Where the API server is and how to authenticate to it, read without the `kubernetes` package: the in-cluster
service account, or a kubeconfig (server, certificate-authority(-data), client-certificate(-data) and
client-key(-data), token/tokenFile, username/password, insecure-skip-tls-verify, tls-server-name, proxy-url,
contexts, $KUBECONFIG lists merged as kubectl merges them).

Importing the `kubernetes` package costs about 10 MiB of memory in every process; it is imported only for
kubeconfigs that need its machinery (exec credential plugins, auth-provider), and for callers that hand over a
`kubernetes.client.ApiClient` of their own.
"""
from __future__ import annotations

import base64
import ipaddress
import os
import ssl
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kube.httpclient import HttpTransport, Server


class ConnectError(RuntimeError):
    """No usable cluster credentials; the message says what was tried and what was wrong."""


SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# client-go re-reads a token file at most once a minute (a projected service-account token is rotated well
# before it expires); a 401 re-reads it at once.
TOKEN_REREAD_S = 60.0
# How long headers built by a kubernetes ApiClient are reused: building them runs its kubeconfig refresh hook,
# which re-reads credentials and scans the environment for proxy variables (0.06-0.15 ms of CPU per request).
API_CLIENT_HEADERS_REUSE_S = 10.0


class Credentials(Protocol):
    def headers(self) -> dict[str, str]:
        """The headers that authenticate a request (may be empty)."""

    def refresh(self) -> bool:
        """After a 401: read the credentials again; True when they changed (a resend may succeed)."""


class TokenCredentials:
    """A bearer token, given or read from a file (re-read at most every TOKEN_REREAD_S), or basic auth."""

    def __init__(self, token: str | None = None, token_file: str | None = None,
                 basic: tuple[str, str] | None = None) -> None:
        self._file, self._read_at = token_file, 0.0
        self._headers: dict[str, str] = {}
        if token:
            self._headers = {"Authorization": f"Bearer {token}"}
        elif basic:
            pair = base64.b64encode(f"{basic[0]}:{basic[1]}".encode()).decode()
            self._headers = {"Authorization": f"Basic {pair}"}
        self._lock = threading.Lock()
        if token_file:
            self._reread()           # a missing or unreadable file is an error now, not at the first request

    def headers(self) -> dict[str, str]:
        if self._file is not None and time.monotonic() - self._read_at >= TOKEN_REREAD_S:
            with self._lock:
                try:
                    self._reread()
                except ConnectError:
                    pass             # keep the token read before: it may still be good (the file is being rotated)
        return self._headers

    def refresh(self) -> bool:
        if self._file is None:
            return False
        before = self._headers
        with self._lock:
            try:
                self._reread()
            except ConnectError:
                return False
        return self._headers != before

    def _reread(self) -> None:
        assert self._file is not None
        try:
            token = Path(self._file).read_text().strip()
        except OSError as exc:
            raise ConnectError(f"token file {self._file}: {exc.strerror or exc}") from exc
        self._headers, self._read_at = {"Authorization": f"Bearer {token}"}, time.monotonic()


class ApiClientCredentials:
    """The headers a kubernetes ApiClient builds (exec plugins, auth-provider, its own config, default headers)."""

    def __init__(self, api_client: Any) -> None:
        self._client = api_client
        self._built: tuple[float, dict[str, str]] | None = None

    def headers(self) -> dict[str, str]:
        built, now = self._built, time.monotonic()
        if built is not None and now - built[0] < API_CLIENT_HEADERS_REUSE_S:
            return built[1]
        _, _, headers, _, _ = self._client.param_serialize(
            method="GET", resource_path="", header_params={}, auth_settings=["BearerToken"])
        # Credentials and the client's default headers (Impersonate-User, say); the request sets its own Accept,
        # Content-Type and User-Agent.
        fresh = {k: v for k, v in headers.items() if k.lower() not in ("accept", "content-type", "user-agent")}
        self._built = (now, fresh)
        return fresh

    def refresh(self) -> bool:
        before = self._built[1] if self._built else None
        self._built = None
        return self.headers() != before


@dataclass
class ClusterAccess:
    """An API server and the credentials for it. `transport` is shared by everyone using this access: one
    kept-alive connection per thread."""

    server: str
    credentials: Credentials
    ssl_context: ssl.SSLContext | None = None
    tls_server_name: str | None = None
    proxy: str | None = None
    source: str = ""              # where it came from, for messages
    _transport: HttpTransport | None = field(default=None, repr=False)

    @property
    def host(self) -> str:
        return self.server

    def __post_init__(self) -> None:
        try:
            self._transport = HttpTransport(Server(self.server, self.ssl_context, self.tls_server_name, self.proxy))
        except ValueError as exc:
            raise ConnectError(f"{self.source or 'API server'}: {exc}") from exc

    @property
    def transport(self) -> HttpTransport:
        assert self._transport is not None
        return self._transport

    def close(self) -> None:
        """Closes the calling thread's kept-alive connection."""
        if self._transport is not None:
            self._transport.close()


def in_cluster(directory: Path | None = None) -> ClusterAccess:
    """The pod's service account (in `directory`, else SERVICE_ACCOUNT_DIR): KUBERNETES_SERVICE_HOST/PORT, its
    token (re-read) and CA."""
    directory = directory or SERVICE_ACCOUNT_DIR
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise ConnectError("in-cluster configuration: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT "
                           "must both be set")
    if not port.isdigit():
        raise ConnectError(f"in-cluster configuration: KUBERNETES_SERVICE_PORT {port!r} is not a port number")
    bracketed = f"[{host}]" if ":" in host else host
    ca = directory / "ca.crt"
    if not ca.is_file():
        raise ConnectError(f"in-cluster configuration: CA file {ca}: no such file")
    context = _ssl_context(f"in-cluster CA file {ca}", ca_file=str(ca))
    creds = TokenCredentials(token_file=str(directory / "token"))
    server = f"https://{bracketed}:{port}"
    return ClusterAccess(server, creds, context, source="in-cluster service account",
                         proxy=_env_proxy(server, "in-cluster configuration"))


@dataclass
class _Merged:
    """A kubeconfig file list merged: first definition of a name wins, the first current-context wins."""

    files: list[Path]
    clusters: dict[str, tuple[dict[str, Any], Path]] = field(default_factory=dict)
    users: dict[str, tuple[dict[str, Any], Path]] = field(default_factory=dict)
    contexts: dict[str, tuple[dict[str, Any], Path]] = field(default_factory=dict)
    current: str = ""


def kubeconfig_files(kubeconfig: str | None) -> list[Path]:
    """The files a kubeconfig argument names: the file itself, else $KUBECONFIG (a list), else ~/.kube/config."""
    if kubeconfig:
        return [Path(kubeconfig)]
    env = os.environ.get("KUBECONFIG", "")
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    return [Path.home() / ".kube" / "config"]


def read_kubeconfigs(files: list[Path]) -> _Merged:
    merged = _Merged(files)
    for path in files:
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue                 # kubectl skips missing files of a $KUBECONFIG list
        except OSError as exc:
            raise ConnectError(f"kubeconfig {path}: {exc.strerror or exc}") from exc
        import yaml  # only for kubeconfigs: the in-cluster path does without it

        try:
            doc = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConnectError(f"kubeconfig {path}: not YAML: {exc}") from exc
        if not isinstance(doc, dict):
            raise ConnectError(f"kubeconfig {path}: not a mapping")
        for key, kind, into in (("clusters", "cluster", merged.clusters), ("users", "user", merged.users),
                                ("contexts", "context", merged.contexts)):
            for entry in doc.get(key) or []:
                if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                    raise ConnectError(f"kubeconfig {path}: {key}: an entry without a name")
                body = entry.get(kind) or {}
                if not isinstance(body, dict):
                    raise ConnectError(f"kubeconfig {path}: {key}[{entry['name']}].{kind}: not a mapping")
                into.setdefault(entry["name"], (body, path))
        if not merged.current and isinstance(doc.get("current-context"), str):
            merged.current = doc["current-context"]
    if not any(p.is_file() for p in files):
        raise ConnectError(f"kubeconfig {_names(files)}: no such file")
    return merged


def from_kubeconfig(kubeconfig: str | None = None, context: str | None = None) -> ClusterAccess | None:
    """The access a kubeconfig's context (`context`, else the current one) describes; None when it needs the
    kubernetes package (exec credential plugin, auth-provider)."""
    merged = read_kubeconfigs(kubeconfig_files(kubeconfig))
    where = _names(merged.files)
    name = context or merged.current
    if not name:
        raise ConnectError(f"kubeconfig {where}: no current-context and no --context given")
    if name not in merged.contexts:
        what = "--context" if context else "current-context"
        raise ConnectError(f"{what} {name}: no such context in kubeconfig {where}")
    ctx, ctx_file = merged.contexts[name]
    cluster_name, user_name = ctx.get("cluster"), ctx.get("user")
    if cluster_name not in merged.clusters:
        raise ConnectError(f"kubeconfig {ctx_file}: context {name}: cluster {cluster_name!r} is not defined")
    cluster, cluster_file = merged.clusters[cluster_name]
    user, user_file = merged.users.get(user_name, ({}, ctx_file)) if user_name else ({}, ctx_file)
    if user_name and user_name not in merged.users:
        raise ConnectError(f"kubeconfig {ctx_file}: context {name}: user {user_name!r} is not defined")
    if "exec" in user or "auth-provider" in user:
        return None
    cwhere, uwhere = f"kubeconfig {cluster_file}: cluster {cluster_name}", f"kubeconfig {user_file}: user {user_name}"
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise ConnectError(f"{cwhere}: server {server!r} is not an http(s) URL")
    insecure = bool(cluster.get("insecure-skip-tls-verify"))
    ca_file = _path(cluster.get("certificate-authority"), cluster_file)
    ca_data = _b64(cluster.get("certificate-authority-data"), f"{cwhere}: certificate-authority-data")
    cert_file = _path(user.get("client-certificate"), user_file)
    cert_data = _b64(user.get("client-certificate-data"), f"{uwhere}: client-certificate-data")
    key_file = _path(user.get("client-key"), user_file)
    key_data = _b64(user.get("client-key-data"), f"{uwhere}: client-key-data")
    for label, value, where_ in (("certificate-authority", ca_file, cwhere), ("client-certificate", cert_file, uwhere),
                                 ("client-key", key_file, uwhere)):
        if value is not None and not Path(value).is_file():
            raise ConnectError(f"{where_}: {label} {value}: no such file")
    if bool(cert_file or cert_data) != bool(key_file or key_data):
        raise ConnectError(f"{uwhere}: a client certificate needs both client-certificate(-data) and "
                           f"client-key(-data)")
    context_ = None
    if server.startswith("https://"):
        context_ = _ssl_context(f"{cwhere} / {uwhere}", ca_file=ca_file, ca_data=ca_data, cert_file=cert_file,
                                cert_data=cert_data, key_file=key_file, key_data=key_data, insecure=insecure)
    token_file = _path(user.get("tokenFile"), user_file)
    if token_file is not None and not Path(token_file).is_file():
        raise ConnectError(f"{uwhere}: tokenFile {token_file}: no such file")
    basic = (str(user["username"]), str(user.get("password", ""))) if user.get("username") else None
    creds = TokenCredentials(token=user.get("token") or None, token_file=None if user.get("token") else token_file,
                             basic=basic)
    proxy = cluster.get("proxy-url")
    proxy = _http_proxy(proxy, f"{cwhere}: proxy-url") if proxy else _env_proxy(server, cwhere)
    tls_name = cluster.get("tls-server-name")
    return ClusterAccess(server, creds, context_, tls_server_name=str(tls_name) if tls_name else None,
                         proxy=proxy, source=f"kubeconfig {where} context {name}")


_from_api_clients: "weakref.WeakKeyDictionary[Any, ClusterAccess]" = weakref.WeakKeyDictionary()
_from_api_clients_lock = threading.Lock()


def cluster_access(api: Any) -> ClusterAccess:
    """`api` as a ClusterAccess: itself, or the access a kubernetes ApiClient's configuration describes (built
    once per ApiClient, so that every user of it shares its connections)."""
    if isinstance(api, ClusterAccess):
        return api
    with _from_api_clients_lock:
        access = _from_api_clients.get(api)
        if access is None:
            access = _from_api_client(api)
            _from_api_clients[api] = access
        return access


def _from_api_client(api_client: Any) -> ClusterAccess:
    cfg = api_client.configuration
    context = None
    if str(cfg.host).startswith("https://"):
        context = _ssl_context(f"ApiClient of {cfg.host}", ca_file=cfg.ssl_ca_cert, cert_file=cfg.cert_file,
                               key_file=cfg.key_file, insecure=not cfg.verify_ssl)
        if cfg.verify_ssl and cfg.assert_hostname is False:
            context.check_hostname = False
    proxy = getattr(cfg, "proxy", None)
    host = urllib.parse.urlsplit(str(cfg.host)).hostname or ""
    if proxy and _no_proxy(host, getattr(cfg, "no_proxy", None) or ""):
        proxy = None
    proxy = _http_proxy(proxy, f"ApiClient of {cfg.host}") if proxy else None
    return ClusterAccess(str(cfg.host), ApiClientCredentials(api_client), context,
                         tls_server_name=getattr(cfg, "tls_server_name", None) or None, proxy=proxy,
                         source=f"ApiClient of {cfg.host}")


def _ssl_context(where: str, *, ca_file: str | None = None, ca_data: bytes | None = None,
                 cert_file: str | None = None, cert_data: bytes | None = None, key_file: str | None = None,
                 key_data: bytes | None = None, insecure: bool = False) -> ssl.SSLContext:
    """The TLS context of one access, built once: the given CA (else the system's), the client certificate."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    try:
        if insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        elif ca_file or ca_data:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)     # only the given CA, as client-go does
            if ca_file:
                context.load_verify_locations(cafile=ca_file)
            if ca_data:
                context.load_verify_locations(cadata=ca_data.decode("ascii", errors="replace"))
    except (ssl.SSLError, OSError) as exc:
        raise ConnectError(f"{where}: certificate authority {ca_file or '(data)'}: {exc}") from exc
    if cert_file or cert_data:
        try:
            if cert_data or key_data:
                _load_chain_from_data(context, cert_file, cert_data, key_file, key_data)
            else:
                context.load_cert_chain(str(cert_file), str(key_file))
        except (ssl.SSLError, OSError) as exc:
            raise ConnectError(f"{where}: client certificate {cert_file or '(data)'} / key "
                               f"{key_file or '(data)'}: {exc}") from exc
    return context


def _load_chain_from_data(context: ssl.SSLContext, cert_file: str | None, cert_data: bytes | None,
                          key_file: str | None, key_data: bytes | None) -> None:
    """ssl loads certificates and keys from files only: inline data goes through a private temporary
    directory that is removed at once."""
    with tempfile.TemporaryDirectory(prefix="gpu-dra-tls-") as tmp:
        if cert_data:
            cert_file = os.path.join(tmp, "cert.pem")
            Path(cert_file).write_bytes(cert_data)
        if key_data:
            key_file = os.path.join(tmp, "key.pem")
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(key_data)
        context.load_cert_chain(str(cert_file), str(key_file))


def _env_proxy(server: str, where: str) -> str | None:
    """The proxy $HTTPS_PROXY ($HTTP_PROXY for an http server) names for `server`, unless $NO_PROXY exempts it."""
    parts = urllib.parse.urlsplit(server)
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or _no_proxy(parts.hostname or "", proxies.get("no", "")):
        return None
    return _http_proxy(proxy, where)


def _no_proxy(host: str, no_proxy: str) -> bool:
    """Whether $NO_PROXY exempts `host`: "*", the host, a parent domain (".example.com" or "example.com") or a
    CIDR of its address."""
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if not entry:
            continue
        if entry == "*" or host.lower() == entry or host.lower().endswith("." + entry.lstrip(".")):
            return True
        try:
            if ipaddress.ip_address(host) in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


def _http_proxy(proxy: Any, where: str) -> str:
    if not (isinstance(proxy, str) and proxy.startswith("http://")):
        raise ConnectError(f"{where}: proxy {proxy!r}: only http:// proxies are supported")
    return proxy


def _path(value: Any, relative_to: Path) -> str | None:
    """A file path of a kubeconfig, relative paths taken from the kubeconfig's own directory (as kubectl does)."""
    if not value:
        return None
    path = Path(os.path.expanduser(str(value)))
    return str(path if path.is_absolute() else relative_to.parent / path)


def _b64(value: Any, where: str) -> bytes | None:
    if not value:
        return None
    try:
        return base64.b64decode(str(value), validate=True)
    except ValueError as exc:
        raise ConnectError(f"{where}: not base64: {exc}") from exc


def _names(files: list[Path]) -> str:
    return os.pathsep.join(str(p) for p in files)
