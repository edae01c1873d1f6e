"""In-memory API servers that answer ResourceSlice calls as older kube-apiservers do, for the publisher's tests."""
from __future__ import annotations

from typing import Any

from bench.memapi import InMemorySliceApi, _status


class OldSliceApi(InMemorySliceApi):
    """Answers a spec.pool.name selector as 1.34 does: 400 BadRequest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rejected = 0

    def list(self, collection: str, field_selector: str | None = None,
             label_selector: str | None = None) -> dict[str, Any]:
        if "spec.pool.name" in (field_selector or ""):
            self.rejected += 1
            raise _status("GET", collection, 400, "BadRequest",
                          "field label not supported for resource.k8s.io/v1, Kind=ResourceSlice: spec.pool.name")
        return super().list(collection, field_selector, label_selector)
