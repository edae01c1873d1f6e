"""Plain-JSON access to the Kubernetes API over the urllib3 pool of a `kubernetes.client.ApiClient`.

Everything here sends and receives wire-format dicts (typed client models drop fields they do not know and
validate bodies before writing). The ApiClient supplies the connection (its pool manager: server, TLS, proxy, as
kube.connect or the kubernetes package's loaders configured it) and the credentials; kube.pool bounds what an
answer may cost, and the bounds on bodies are here. No request is retried by urllib3: a 401 reads the
credentials anew once, and the caller decides about everything else.
"""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import urllib3

from kube.pool import Pool, bounded_pool

RESOURCE_V1 = "/apis/resource.k8s.io/v1"
SLICES = f"{RESOURCE_V1}/resourceslices"
DEVICE_CLASSES = f"{RESOURCE_V1}/deviceclasses"
NODES = "/api/v1/nodes"
# The namespaced kinds the driver's tools and test bed name by kind, as (API prefix, plural): the one table every
# path built from a kind comes from.
NAMESPACED: dict[str, tuple[str, str]] = {
    "Pod": ("/api/v1", "pods"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "ResourceClaim": (RESOURCE_V1, "resourceclaims"),
    "ResourceClaimTemplate": (RESOURCE_V1, "resourceclaimtemplates"),
    "ReplicaSet": ("/apis/apps/v1", "replicasets"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "DaemonSet": ("/apis/apps/v1", "daemonsets"),
    "Job": ("/apis/batch/v1", "jobs"),
    "CronJob": ("/apis/batch/v1", "cronjobs"),
}
# Accept header that makes the API server answer a LIST (or a WATCH) with metadata only (PartialObjectMetadata):
# a thousandth of the bytes of full ResourceSlices, for readers that need names, versions and annotations.
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
METADATA_OBJECT = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
USER_AGENT = "gpu-dra"
# An answer larger than this is refused, naming the limit, instead of being read without bound; a streamed line (a
# watch event: one object, at most the API server's ~3 MiB request limit) likewise.
MAX_BODY = 256 * 1024 * 1024
MAX_LINE = 16 * 1024 * 1024
# How long the credential headers an ApiClient built are reused (see Credentials). The kubernetes package re-reads
# an in-cluster token at most once a minute; a token that expires meanwhile gets a 401, and the request is sent
# again with credentials read anew.
CREDENTIALS_REUSE_S = 10.0
_READ_SIZE = 64 * 1024


class EncodedObject(bytes):
    """A request body the caller already encoded as JSON (e.g. assembled from cached, encoded parts), with the
    object's name for verbs whose path needs it. Sent as is: no decoding and re-encoding in the client."""

    name: str

    def __new__(cls, data: bytes, name: str) -> "EncodedObject":
        obj = super().__new__(cls, data)
        obj.name = name
        return obj


class ApiError(Exception):
    """The API server answered with an error status (reason and message from its Status object)."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.method, self.path, self.status, self.body = method, path, status, body
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {}
        self.reason: str = doc.get("reason", "") if isinstance(doc, dict) else ""
        self.message: str = doc.get("message", body[:300]) if isinstance(doc, dict) else body[:300]
        super().__init__(f"{method} {path}: HTTP {status} {self.reason}: {self.message}")

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        # 409 covers both AlreadyExists and a failed resourceVersion/uid precondition.
        return self.status == 409


class ApiUnavailable(Exception):
    """No answer from the API server (connection refused, reset, timed out, TLS failure)."""


class CredentialsUnavailable(ApiUnavailable):
    """The credentials could not be read (an exec plugin that fails, a token file gone): nothing was sent."""


class Credentials:
    """The headers every request of one ApiClient carries (credentials, its default headers, our User-Agent), as
    the ApiClient builds them, shared by every KubeApi on it and reused for ``CREDENTIALS_REUSE_S``: building them
    runs the configuration's refresh hook, which re-reads credentials and scans the environment for proxy
    variables (tenths of a millisecond of CPU per request). ``reload``, where kube.connect knows where the
    credentials came from, reads that source again (a token file, an exec plugin) after a 401."""

    def __init__(self, api_client: Any) -> None:
        self._client = api_client
        self._lock = threading.Lock()
        self._built: tuple[float, dict[str, str]] | None = None
        self.reload: Callable[[], None] | None = None

    def headers(self) -> dict[str, str]:
        built = self._built
        if built is not None and time.monotonic() - built[0] < CREDENTIALS_REUSE_S:
            return built[1]
        with self._lock:
            try:
                return self._build()
            except Exception as exc:  # noqa: BLE001 - a refresh hook raises what its source makes it raise
                if built is not None:
                    return built[1]      # the credentials read before may still be good (a file being rotated)
                raise CredentialsUnavailable(f"credentials: {type(exc).__name__}: {exc}") from exc

    def renew(self, used: dict[str, str]) -> bool:
        """After a 401: the credentials read anew; True when they differ from `used` (a resend may succeed)."""
        with self._lock:
            if self.reload is not None:
                try:
                    self.reload()
                except Exception:  # noqa: BLE001 - a broken source raises anything there; the 401 stands
                    return False
            return self._build() != used

    def _build(self) -> dict[str, str]:
        _, _, built, _, _ = self._client.param_serialize(
            method="GET", resource_path="", header_params={}, auth_settings=["BearerToken"])
        # Values stripped: the kubernetes loaders keep a token file's trailing newline, which no header may carry.
        headers = {k: str(v).strip() for k, v in built.items()
                   if k.lower() not in ("accept", "content-type", "user-agent")}
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            headers["authorization"] = "Bearer " + auth[7:].strip()    # as client-go writes it (in-cluster: "bearer")
        headers["User-Agent"] = USER_AGENT
        self._built = (time.monotonic(), headers)
        return headers


_credentials: weakref.WeakKeyDictionary[Any, Credentials] = weakref.WeakKeyDictionary()
_credentials_lock = threading.Lock()


def credentials_of(api_client: Any) -> Credentials:
    """The one Credentials of `api_client`."""
    with _credentials_lock:
        creds = _credentials.get(api_client)
        if creds is None:
            creds = _credentials[api_client] = Credentials(api_client)
        return creds


class Stream:
    """A streamed answer (a watch), read as it arrives: ``lines()`` (each bounded by ``MAX_LINE``) or, iterated,
    its JSON documents. ``close()`` ends it; ``shutdown()``, from another thread, ends a read blocked in this one.
    A broken or over-long stream raises ApiUnavailable."""

    def __init__(self, resp: urllib3.BaseHTTPResponse, what: str) -> None:
        self._resp, self._what = resp, what
        self.status = resp.status

    def lines(self) -> Iterator[bytes]:
        buf = b""
        try:
            for chunk in self._resp.stream(_READ_SIZE):
                if not buf and chunk.endswith(b"\n") and chunk.count(b"\n") == 1:
                    yield chunk          # the API server sends each watch event as one chunk
                    continue
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if len(buf) > MAX_LINE or any(len(line) > MAX_LINE for line in lines):
                    raise ApiUnavailable(f"{self._what}: a streamed line longer than {MAX_LINE} bytes")
                yield from lines
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiUnavailable(f"{self._what}: {_describe(exc)}") from exc
        if buf.strip():
            yield buf

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter_json_lines(self)

    def shutdown(self) -> None:
        try:
            self._resp.shutdown()
        except (OSError, ValueError):
            pass                         # closed already

    def close(self) -> None:
        self._resp.close()
        self._resp.release_conn()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KubeApi:
    """A few JSON verbs on top of an ApiClient's connection pool and credentials."""

    def __init__(self, api_client: Any, timeout: float = 30.0) -> None:
        self.api_client = api_client
        self.timeout = timeout
        self._pool: Pool | None = None          # the ApiClient's, resolved at the first request
        self._creds: Credentials | None = None

    @property
    def host(self) -> str:
        return str(self.api_client.configuration.host)

    def request(self, method: str, path: str, query: dict[str, Any] | None = None, body: Any = None,
                content_type: str = "application/json", timeout: float | None = None,
                stream: bool = False, accept: str = "application/json", as_text: bool = False) -> Any:
        """One request; returns the decoded JSON document (or a Stream, which the caller closes, when
        stream=True; the body as text, when as_text=True: a pod's /metrics through the API server's proxy). A bytes
        body (e.g. an EncodedObject) is sent as it is: it is JSON already. A 401 after which the credentials read
        anew differ (a rotated token) sends the request once more."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        target = path
        if query:
            target += "?" + urllib.parse.urlencode({k: _query_value(v) for k, v in query.items() if v is not None})
        read_timeout = timeout if timeout is not None else self.timeout
        limits = urllib3.Timeout(connect=min(10.0, timeout or self.timeout), read=read_timeout)
        what = f"{method} {self.host}{path}"
        if self._pool is None or self._creds is None:
            self._pool, self._creds = bounded_pool(self.api_client), credentials_of(self.api_client)
        pool, creds = self._pool, self._creds
        for attempt in (1, 2):
            common = creds.headers()
            headers = {**common, "Accept": accept}
            if body is not None:
                headers["Content-Type"] = content_type
            try:
                resp = pool.urlopen(method, self.host, target, body=data, headers=headers, preload_content=False,
                                    timeout=limits, retries=False)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise ApiUnavailable(f"{what}: {_describe(exc)}") from exc
            if resp.status == 401 and attempt == 1:
                text = _text(resp, what)
                if creds.renew(common):
                    continue
                raise ApiError(method, path, 401, text)
            break
        if stream:
            if not 200 <= resp.status < 300:
                raise ApiError(method, path, resp.status, _text(resp, what))
            return Stream(resp, what)
        text = _text(resp, what)
        if not 200 <= resp.status < 300:
            raise ApiError(method, path, resp.status, text)
        if as_text:
            return text
        return json.loads(text) if text else {}

    def get(self, path: str, **query: Any) -> dict[str, Any]:
        return self.request("GET", path, query=query)

    def create(self, collection: str, obj: dict[str, Any] | EncodedObject) -> dict[str, Any]:
        return self.request("POST", collection, body=obj)

    def replace(self, collection: str, obj: dict[str, Any] | EncodedObject) -> dict[str, Any]:
        name = obj.name if isinstance(obj, EncodedObject) else obj["metadata"]["name"]
        return self.request("PUT", f"{collection}/{name}", body=obj)

    def delete(self, collection: str, name: str, uid: str | None = None,
               resource_version: str | None = None) -> dict[str, Any]:
        """Deletes with optional uid/resourceVersion preconditions (a 409 means someone changed it)."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        if preconditions:
            body["preconditions"] = preconditions
        return self.request("DELETE", f"{collection}/{name}", body=body)

    def list(self, collection: str, field_selector: str | None = None,
             label_selector: str | None = None) -> dict[str, Any]:
        """A complete list (follows `continue` tokens); returns {"items": [...], "resourceVersion": ...}."""
        return self._list(collection, field_selector, label_selector, 500, "application/json")

    def list_metadata(self, collection: str, field_selector: str | None = None,
                      label_selector: str | None = None) -> dict[str, Any]:
        """Like `list`, but each item is only apiVersion, kind and metadata (PartialObjectMetadata)."""
        return self._list(collection, field_selector, label_selector, 1000, METADATA_LIST)

    def iter_list(self, collection: str, field_selector: str | None = None,
                  page_size: int = 100, label_selector: str | None = None) -> Iterator[dict[str, Any]]:
        """The items of a list, fetched a page at a time: only one page of objects is held at once."""
        for page in self._pages(collection, field_selector, label_selector, page_size, "application/json"):
            yield from page.get("items") or []

    def _list(self, collection: str, field_selector: str | None, label_selector: str | None, limit: int,
              accept: str) -> dict[str, Any]:
        items: list[dict[str, Any]] = []
        page: dict[str, Any] = {}
        for page in self._pages(collection, field_selector, label_selector, limit, accept):
            items.extend(page.get("items") or [])
        return {"items": items, "resourceVersion": page.get("metadata", {}).get("resourceVersion", "")}

    def _pages(self, collection: str, field_selector: str | None, label_selector: str | None, limit: int,
               accept: str) -> Iterator[dict[str, Any]]:
        """The pages of a list, following `continue` tokens; the last page carries the list's resourceVersion."""
        cont: str | None = None
        while True:
            page = self.request("GET", collection, accept=accept, query={
                "fieldSelector": field_selector, "labelSelector": label_selector, "limit": limit, "continue": cont})
            yield page
            cont = page.get("metadata", {}).get("continue")
            if not cont:
                return

    def server_version(self) -> tuple[int, int]:
        """(major, minor) of the API server; minor strings like "37+" are read as 37."""
        doc = self.get("/version")
        try:
            return int(_digits(doc["major"])), int(_digits(doc["minor"]))
        except (KeyError, ValueError) as exc:
            raise ApiError("GET", "/version", 200, json.dumps({"message": f"unreadable version {doc}"})) from exc


def namespaced_collection(kind: str, namespace: str) -> str:
    """The collection path of ``kind`` (a key of NAMESPACED) in ``namespace``."""
    prefix, plural = NAMESPACED[kind]
    return f"{prefix}/namespaces/{namespace}/{plural}"


def iter_json_lines(resp: Stream) -> Iterator[dict[str, Any]]:
    """The JSON documents of a streamed watch answer, one per line."""
    for line in resp.lines():
        if line.strip():
            yield json.loads(line)


def _read_bounded(resp: urllib3.BaseHTTPResponse, what: str) -> bytes:
    """The whole body of an answer, refused (ApiUnavailable) once it is larger than MAX_BODY."""
    length = resp.headers.get("content-length")
    try:
        if length is not None and length.isdigit():
            if int(length) > MAX_BODY:
                resp.close()
                raise ApiUnavailable(f"{what}: an answer of {length} bytes, larger than the limit of {MAX_BODY} bytes")
            if "content-encoding" not in resp.headers:
                return resp.read()       # all of it in one read: its length is known and within the bound
        parts, total = [], 0
        for chunk in resp.stream(_READ_SIZE):
            total += len(chunk)
            if total > MAX_BODY:
                resp.close()
                raise ApiUnavailable(f"{what}: an answer larger than the limit of {MAX_BODY} bytes")
            parts.append(chunk)
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise ApiUnavailable(f"{what}: {_describe(exc)}") from exc
    return b"".join(parts)


def _text(resp: urllib3.BaseHTTPResponse, what: str) -> str:
    """The body of an answer as text; its connection goes back to the pool (or, when broken, is closed)."""
    try:
        return _read_bounded(resp, what).decode(errors="replace")
    finally:
        resp.release_conn()


def _describe(exc: BaseException) -> str:
    """urllib3's error and what caused it (urllib3 wraps the socket's or TLS's error, which names the reason)."""
    text = f"{type(exc).__name__}: {exc}"
    reason = getattr(exc, "reason", None)
    if isinstance(reason, BaseException) and str(reason) not in text:
        text += f" ({type(reason).__name__}: {reason})"
    return text


def _digits(text: str) -> str:
    m = re.match(r"\d+", str(text))
    if not m:
        raise ValueError(text)
    return m.group(0)


def _query_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
