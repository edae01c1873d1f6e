"""An in-memory stand-in for the API server's ResourceSlice and Node endpoints, with the verbs of
``kube.client.KubeApi`` that a reconcile pass uses (list, list_metadata, iter_list, get, create, replace, delete;
Nodes: get and an unselected list).

It keeps what the server's optimistic concurrency needs (uid, resourceVersion, preconditions, 404/409 as
``ApiError``) and field selectors on ``spec.driver``, ``spec.nodeName`` and ``spec.pool.name``. It stores
what it is sent as it is: no defaulting and no quantity normalisation, which the controller's comparison
already tolerates. Objects are kept as JSON text and decoded for every answer, so each call costs the
client what decoding a server's answer would. As the real server does, ``metadata.generation`` starts at 1 and
goes up only when an update changes the spec. No watch: the benchmark drives ``ResourceSliceController.run_once``.
"""
from __future__ import annotations

import itertools
import json
import threading
import uuid as uuidlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kube.client import NODES, SLICES, ApiError

_SELECTABLE = ("spec.driver", "spec.nodeName", "spec.pool.name")


def _decoded(obj: dict[str, Any] | bytes) -> dict[str, Any]:
    """A request body as a dict: the controller sends bodies it encoded itself (kube.client.EncodedObject)."""
    return json.loads(obj) if isinstance(obj, (bytes, str)) else obj


def _status(method: str, path: str, code: int, reason: str, message: str) -> ApiError:
    return ApiError(method, path, code, json.dumps({"kind": "Status", "reason": reason, "message": message}))


@dataclass
class _Stored:
    text: str
    uid: str
    resource_version: str
    generation: int
    fields: dict[str, str]      # selectable field -> value


class InMemorySliceApi:
    """ResourceSlices and Nodes in dicts. ``writes`` counts the create/update/delete calls that succeeded."""

    def __init__(self, node_names: list[str] | tuple[str, ...] = ()) -> None:
        self._lock = threading.Lock()
        self._rv = itertools.count(1)
        self._slices: dict[str, _Stored] = {}
        self._nodes = {n: json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": n, "uid": str(uuidlib.uuid4()), "resourceVersion": str(next(self._rv))}}) for n in node_names}
        self.writes: Counter[str] = Counter()
        self.reads = 0

    @property
    def host(self) -> str:
        return "in-memory"

    @property
    def slice_count(self) -> int:
        with self._lock:
            return len(self._slices)

    @property
    def total_writes(self) -> int:
        with self._lock:
            return sum(self.writes.values())

    # ---- verbs of KubeApi ----------------------------------------------------------------------------

    def list(self, collection: str, field_selector: str | None = None,
             label_selector: str | None = None) -> dict[str, Any]:
        if collection == NODES and not field_selector and not label_selector:
            with self._lock:
                self.reads += 1
                return {"items": [json.loads(t) for t in self._nodes.values()], "resourceVersion": str(next(self._rv))}
        if collection != SLICES:
            raise _status("GET", collection, 400, "BadRequest", "only ResourceSlices, by field and label selector")
        labels = [tuple(t.split("=", 1)) for t in filter(None, (label_selector or "").split(","))]
        if any(len(t) != 2 for t in labels):
            raise _status("GET", collection, 400, "BadRequest", f"only key=value label selectors: {label_selector}")
        terms = []
        for term in filter(None, (field_selector or "").split(",")):
            key, _, value = term.partition("=")
            if key not in _SELECTABLE:
                raise _status("GET", collection, 400, "BadRequest", f"field label not supported: {key}")
            terms.append((key, value))
        with self._lock:
            self.reads += 1
            texts = [s.text for s in self._slices.values() if all(s.fields.get(k) == v for k, v in terms)]
            rv = str(next(self._rv))
        items = [json.loads(t) for t in texts]
        if labels:
            items = [o for o in items if all((o["metadata"].get("labels") or {}).get(k) == v for k, v in labels)]
        return {"items": items, "resourceVersion": rv}

    def list_metadata(self, collection: str, field_selector: str | None = None,
                      label_selector: str | None = None) -> dict[str, Any]:
        """What the server answers to an Accept of PartialObjectMetadataList: metadata only."""
        listed = self.list(collection, field_selector, label_selector)
        return {"items": [{"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": o["metadata"]}
                          for o in listed["items"]], "resourceVersion": listed["resourceVersion"]}

    def iter_list(self, collection: str, field_selector: str | None = None, page_size: int = 100,
                  label_selector: str | None = None) -> Iterator[dict[str, Any]]:
        yield from self.list(collection, field_selector, label_selector)["items"]

    def get(self, path: str, **query: Any) -> dict[str, Any]:
        with self._lock:
            self.reads += 1
            if path.startswith(f"{NODES}/"):
                text = self._nodes.get(path[len(NODES) + 1:])
            elif path.startswith(f"{SLICES}/"):
                stored = self._slices.get(path[len(SLICES) + 1:])
                text = stored.text if stored else None
            else:
                text = None
        if text is None:
            raise _status("GET", path, 404, "NotFound", f"{path} not found")
        return json.loads(text)

    def create(self, collection: str, obj: dict[str, Any] | bytes) -> dict[str, Any]:
        obj = _decoded(obj)
        name = obj["metadata"]["name"]
        with self._lock:
            if name in self._slices:
                raise _status("POST", collection, 409, "AlreadyExists", f"resourceslices {name!r} already exists")
            return self._store(name, obj, str(uuidlib.uuid4()), 1, "create")

    def replace(self, collection: str, obj: dict[str, Any] | bytes) -> dict[str, Any]:
        obj = _decoded(obj)
        name = obj["metadata"]["name"]
        path = f"{collection}/{name}"
        with self._lock:
            current = self._slices.get(name)
            if current is None:
                raise _status("PUT", path, 404, "NotFound", f"resourceslices {name!r} not found")
            if obj["metadata"].get("resourceVersion") != current.resource_version:
                raise _status("PUT", path, 409, "Conflict", "the object has been modified")
            spec_changed = json.loads(current.text).get("spec") != json.loads(json.dumps(obj)).get("spec")
            return self._store(name, obj, current.uid, current.generation + spec_changed, "update")

    def delete(self, collection: str, name: str, uid: str | None = None,
               resource_version: str | None = None) -> dict[str, Any]:
        path = f"{collection}/{name}"
        with self._lock:
            current = self._slices.get(name)
            if current is None:
                raise _status("DELETE", path, 404, "NotFound", f"resourceslices {name!r} not found")
            if (uid and uid != current.uid) or (resource_version and resource_version != current.resource_version):
                raise _status("DELETE", path, 409, "Conflict", "precondition failed")
            del self._slices[name]
            self.writes["delete"] += 1
        return {"kind": "Status", "status": "Success"}

    def request(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        raise _status(method, path, 501, "NotImplemented", "the in-memory API serves no watches; use run_once()")

    # ---- helpers -------------------------------------------------------------------------------------

    def _store(self, name: str, obj: dict[str, Any], uid: str, generation: int, operation: str) -> dict[str, Any]:
        doc = json.loads(json.dumps(obj))     # what the server received
        rv = str(next(self._rv))
        doc["metadata"].update(uid=uid, resourceVersion=rv, generation=generation)
        spec = doc.get("spec") or {}
        fields = {"spec.driver": str(spec.get("driver")), "spec.nodeName": str(spec.get("nodeName")),
                  "spec.pool.name": str((spec.get("pool") or {}).get("name"))}
        text = json.dumps(doc)
        self._slices[name] = _Stored(text, uid, rv, generation, fields)
        self.writes[operation] += 1
        return json.loads(text)
