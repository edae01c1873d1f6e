"""The user's YAML files (fleet files, node policy files, example claims), read in one place.

Every way such a file can be unusable becomes one error line that names the file and, where known, the place
in it: unreadable, not UTF-8, not YAML, or nested deeper than any of these files needs. Nesting is bounded
while the YAML is composed, so a hostile file cannot exhaust Python's stack (PyYAML composes recursively) and
what is loaded can be walked recursively afterwards (validation, copies) without hitting the limit either.
Callers pass their own error type, so a fleet file fails with FleetError, an example with ExampleError.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from yaml.reader import ReaderError

MAX_DEPTH = 64          # fleet files and claims need about ten levels

ErrorType = Callable[[str], Exception]


class YamlFileError(ValueError):
    """A user file that cannot be read as YAML; the message is one line naming the file."""


class _TooDeep(Exception):
    def __init__(self, mark: yaml.Mark | None) -> None:
        super().__init__()
        self.mark = mark


class _DepthLimitedLoader(yaml.SafeLoader):
    """SafeLoader that refuses documents nested deeper than MAX_DEPTH collections."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooDeep(self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _at(mark: yaml.Mark | None) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line: where, then what."""
    if isinstance(exc, yaml.MarkedYAMLError):
        what = ", ".join(p for p in (exc.context, exc.problem) if p) or "unreadable"
        return _at(exc.problem_mark or exc.context_mark) + what
    if isinstance(exc, ReaderError):
        char = f" (#x{exc.character:04x})" if isinstance(exc.character, int) else ""
        return f"character {exc.position}: {exc.reason}{char}"
    return " ".join(str(exc).split())


def parse_yaml(text: str, source: str, *, documents: bool = False, error: ErrorType = YamlFileError) -> Any:
    """The YAML document in ``text`` (a list of every non-empty document with ``documents``); ``source`` names
    the file in errors, raised as ``error(message)``."""
    try:
        if documents:
            return [d for d in yaml.load_all(text, Loader=_DepthLimitedLoader) if d is not None]
        return yaml.load(text, Loader=_DepthLimitedLoader)  # noqa: S506 - a SafeLoader
    except _TooDeep as exc:
        raise error(f"{source}: {_at(exc.mark)}nested deeper than {MAX_DEPTH} levels") from None
    except RecursionError:      # a limit this loader does not know of (a caller already deep in the stack)
        raise error(f"{source}: nested too deeply to read") from None
    except yaml.YAMLError as exc:
        raise error(f"{source}: not valid YAML: {_yaml_problem(exc)}") from None


def read_text(path: str | Path, *, source: str | None = None, error: ErrorType = YamlFileError) -> str:
    """The file's text, decoded as UTF-8; an unreadable or undecodable file raises ``error`` naming it."""
    source = source if source is not None else str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise error(f"{source}: cannot read: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(f"{source}: not UTF-8: line {line}, byte {exc.start}: "
                    f"{exc.reason} (0x{data[exc.start]:02x})") from None


def load_yaml_file(path: str | Path, *, source: str | None = None, documents: bool = False,
                   error: ErrorType = YamlFileError) -> Any:
    """``read_text`` then ``parse_yaml``: the one way to load a user's YAML file."""
    source = source if source is not None else str(path)
    return parse_yaml(read_text(path, source=source, error=error), source, documents=documents, error=error)
