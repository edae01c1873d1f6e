"""Plain-JSON access to the Kubernetes API.

Everything here sends and receives wire-format dicts (typed client models drop fields they do not know and
validate bodies before writing). Requests go through kube.httpclient; where the server is and the credentials
come from a kube.kubeconfig.ClusterAccess.
"""
from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterator
from typing import Any

from kube.httpclient import StreamResponse, TransportError
from kube.kubeconfig import ClusterAccess, cluster_access

RESOURCE_V1 = "/apis/resource.k8s.io/v1"
SLICES = f"{RESOURCE_V1}/resourceslices"
DEVICE_CLASSES = f"{RESOURCE_V1}/deviceclasses"
NODES = "/api/v1/nodes"
# Accept header that makes the API server answer a LIST (or a WATCH) with metadata only (PartialObjectMetadata):
# a thousandth of the bytes of full ResourceSlices, for readers that need names, versions and annotations.
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
METADATA_OBJECT = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
USER_AGENT = "gpu-dra"


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


class KubeApi:
    """A few JSON verbs on top of a ClusterAccess (or a kubernetes ApiClient, read as one): its transport (one
    kept-alive connection per thread) and credentials."""

    def __init__(self, api_client: Any, timeout: float = 30.0) -> None:
        self.api_client = api_client
        self.timeout = timeout
        self._access: ClusterAccess | None = None

    @property
    def access(self) -> ClusterAccess:
        """Resolved at the first request: a KubeApi can be built before it has anything to reach."""
        if self._access is None:
            self._access = cluster_access(self.api_client)
        return self._access

    @property
    def host(self) -> str:
        return self.access.server

    def request(self, method: str, path: str, query: dict[str, Any] | None = None, body: Any = None,
                content_type: str = "application/json", timeout: float | None = None,
                stream: bool = False, accept: str = "application/json") -> Any:
        """One request; returns the decoded JSON document (or a StreamResponse, which the caller closes, when
        stream=True). A bytes body (e.g. an EncodedObject) is sent as it is: it is JSON already. A 401 after which
        the credentials read anew differ (a rotated token) sends the request once more."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        target = path
        if query:
            target += "?" + urllib.parse.urlencode({k: _query_value(v) for k, v in query.items() if v is not None})
        read_timeout = timeout if timeout is not None else self.timeout
        connect_timeout = min(10.0, timeout or self.timeout)
        transport, credentials = self.access.transport, self.access.credentials
        for attempt in (1, 2):
            headers = {**credentials.headers(), "Accept": accept, "User-Agent": USER_AGENT}
            if body is not None:
                headers["Content-Type"] = content_type
            try:
                if stream:
                    resp: Any = transport.open_stream(method, target, headers, data, connect_timeout, read_timeout)
                else:
                    resp = transport.request(method, target, headers, data, connect_timeout, read_timeout)
            except TransportError as exc:
                raise ApiUnavailable(f"{method} {self.host}{path}: {exc}") from exc
            if resp.status == 401 and attempt == 1 and credentials.refresh():
                if stream:
                    resp.close()
                continue
            break
        if stream:
            if not 200 <= resp.status < 300:
                try:
                    text = resp.read().decode(errors="replace")
                except TransportError as exc:
                    raise ApiUnavailable(f"{method} {self.host}{path}: {exc}") from exc
                finally:
                    resp.close()
                raise ApiError(method, path, resp.status, text)
            return resp
        text = resp.body.decode(errors="replace")
        if not 200 <= resp.status < 300:
            raise ApiError(method, path, resp.status, text)
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


def iter_json_lines(resp: StreamResponse) -> Iterator[dict[str, Any]]:
    """The JSON documents of a streamed watch response, one per line."""
    buf = b""
    for chunk in resp.iter_chunks():
        if not buf and chunk.endswith(b"\n") and chunk.count(b"\n") == 1:
            yield json.loads(chunk)          # the API server sends each watch event as one chunk
            continue
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)


def _digits(text: str) -> str:
    m = re.match(r"\d+", str(text))
    if not m:
        raise ValueError(text)
    return m.group(0)


def _query_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
