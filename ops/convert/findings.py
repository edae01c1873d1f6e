"""The report of a conversion: every input field converted, kept, changed in meaning or not convertible, with the
reason; a summary first, then the lines by severity.

Converters record the fields they handle; ``cover_rest`` then names every leaf of an input document nobody
handled, so nothing is dropped without a line in the report.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["converted", "kept", "changed", "not-convertible"]
# Most severe first: the report lists its lines in this order. "changed": converted, but it means something else
# here (the operator decides whether that is acceptable); "not-convertible": refused, or left out of the output.
SEVERITY: tuple[Status, ...] = ("not-convertible", "changed", "kept", "converted")


@dataclass(frozen=True)
class Finding:
    source: str        # the input document, e.g. "device plugin config time-sliced (dp.yaml)"
    field: str         # dotted path in that document, e.g. "sharing.timeSlicing.resources[0].replicas"
    status: Status
    detail: str        # what it became, or why it could not

    def line(self) -> str:
        return f"{self.status:<15} {self.source}: {self.field or '(document)'}: {self.detail}"


@dataclass
class Findings:
    items: list[Finding] = field(default_factory=list)

    def add(self, source: str, path: str, status: Status, detail: str) -> None:
        self.items.append(Finding(source, path, status, detail))

    def converted(self, source: str, path: str, detail: str) -> None:
        self.add(source, path, "converted", detail)

    def kept(self, source: str, path: str, detail: str) -> None:
        self.add(source, path, "kept", detail)

    def refused(self, source: str, path: str, detail: str) -> None:
        self.add(source, path, "not-convertible", detail)

    def changed(self, source: str, path: str, detail: str) -> None:
        self.add(source, path, "changed", detail)

    def handled(self, source: str) -> set[str]:
        return {f.field for f in self.items if f.source == source}

    def cover_rest(self, source: str, doc: Any, reason: str = "unknown field: not converted") -> None:
        """Report every leaf of ``doc`` that no finding of ``source`` covers (a finding on a path covers the
        whole subtree under it)."""
        done = self.handled(source)
        for path in leaf_paths(doc):
            if not any(path == d or path.startswith(d + ".") or path.startswith(d + "[") for d in done):
                self.refused(source, path, reason)

    def of(self, status: Status) -> list[Finding]:
        return [f for f in self.items if f.status == status]

    def drop(self, keep: Callable[[Finding], bool]) -> None:
        self.items = [f for f in self.items if keep(f)]

    def counts(self) -> str:
        return ", ".join(f"{len(self.of(s))} {'changed meaning' if s == 'changed' else s}" for s in SEVERITY)

    def text(self, summary: list[str] | None = None) -> str:
        """The summary lines first, then every line, most severe first (input order within a severity)."""
        head = [*(summary or []), f"{len(self.items)} fields: {self.counts()}"]
        body = []
        for s in SEVERITY:
            lines = self.of(s)
            if lines:
                body += ["", f"== {s} ({len(lines)})"] + [f.line() for f in lines]
        return "\n".join(head + body)


def leaf_paths(doc: Any, prefix: str = "") -> Iterator[str]:
    """Dotted paths of the scalars (and empty containers) of a YAML document."""
    if isinstance(doc, dict) and doc:
        for k, v in doc.items():
            yield from leaf_paths(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(doc, list) and doc:
        for i, v in enumerate(doc):
            yield from leaf_paths(v, f"{prefix}[{i}]")
    else:
        yield prefix
