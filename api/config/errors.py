"""ConfigError: one exception for every problem found in a user's opaque configuration.

Each problem names the field path inside the parameters (e.g. `sharing.mps.activeThreadPercentage`)
so a claim author can find it; the apiVersion and kind are part of the message. Everything in a message may come
from the user (map keys, values, kinds), so it is rendered through `printable`: one line, whatever the input.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """Invalid opaque configuration. `problems` holds (field path, reason) pairs; str() joins them."""

    def __init__(self, problems: Iterable[tuple[str, str]], *, api_version: str | None = None,
                 kind: str | None = None) -> None:
        self.problems: tuple[tuple[str, str], ...] = tuple(problems)
        self.api_version = api_version
        self.kind = kind
        super().__init__(self._render())

    def _render(self) -> str:
        parts = [f"{path}: {reason}" if path else reason for path, reason in self.problems]
        body = "; ".join(parts) or "invalid configuration"
        subject = " ".join(p for p in (self.api_version, self.kind) if p)
        return printable(f"{subject}: {body}" if subject else body)

    def with_prefix(self, prefix: str) -> ConfigError:
        """The same problems with paths under `prefix`, e.g. `spec.devices.config[0].opaque.parameters`."""
        def join(path: str) -> str:
            if not path:
                return prefix
            return f"{prefix}{path}" if path.startswith("[") else f"{prefix}.{path}"
        return ConfigError(((join(p), r) for p, r in self.problems), api_version=self.api_version, kind=self.kind)


def printable(text: str) -> str:
    """`text` with every character that is not printable (newlines, other control characters, bidi overrides, line
    separators) written as its Python escape (\\n, \\x1b, \\u202e): user-supplied keys and values in a message or
    a log line cannot start a new line or disguise the text around them."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def describe(value: Any) -> str:
    """A value as a user wrote it in YAML/JSON, for messages ("got 'abc'", "got true", "got a list")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return type(value).__name__


def format_path(loc: Sequence[str | int]) -> str:
    """pydantic's error location as a field path (`sharing.mps.limits[0]`); keys are the user's, made printable."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            key = printable(str(part))
            out += f".{key}" if out else key
    return out


_TYPE_WORDS = {
    "int_type": "an integer",
    "string_type": "a string",
    "bool_type": "a boolean",
    "dict_type": "an object",
    "list_type": "a list",
    "model_type": "an object",
}


def problems_from_validation_error(exc: ValidationError, model: type[BaseModel]) -> list[tuple[str, str]]:
    """Turn pydantic's errors into (path, reason) pairs with short, user-facing reasons."""
    problems: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        loc = list(err["loc"])
        ctx = err.get("ctx") or {}
        kind = err["type"]
        value = err.get("input")
        if "field" in ctx:  # our model-level checks point at the field they are about
            loc.append(ctx["field"])
        if loc and loc[-1] == "[key]":  # a bad map key: report the key itself
            loc.pop()
        if kind == "missing":
            reason = "required"
        elif kind == "extra_forbidden":
            known = known_fields(model, loc[:-1])
            reason = "unknown field" + (f" (known fields: {', '.join(known)})" if known else "")
        elif kind == "literal_error":
            reason = f"must be one of {ctx.get('expected', '?')}, got {describe(value)}"
        elif kind in _TYPE_WORDS:
            reason = f"must be {_TYPE_WORDS[kind]}, got {describe(value)}"
        else:
            reason = err["msg"]
        problems.append((format_path(loc), reason))
    return problems


def known_fields(model: type[BaseModel], loc: Sequence[str | int]) -> list[str]:
    """Field names (as users spell them) accepted at `loc` inside `model`; [] when `loc` is not an object."""
    current: Any = model
    for part in loc:
        current = _strip(current)
        if _is_model(current):
            fields = _fields_by_alias(current)
            if part not in fields:
                return []
            current = fields[part].annotation
        elif get_origin(current) is dict:
            current = get_args(current)[1]
        else:
            return []
    current = _strip(current)
    return list(_fields_by_alias(current)) if _is_model(current) else []


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _fields_by_alias(model: type[BaseModel]) -> dict[str, Any]:
    return {(info.alias or name): info for name, info in model.model_fields.items()}


def _strip(annotation: Any) -> Any:
    """`X | None` and `Annotated[X, ...]` -> X."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
            continue
        if origin in (Union, UnionType):
            args = [a for a in get_args(annotation) if a is not type(None)]
            if len(args) == 1:
                annotation = args[0]
                continue
        return annotation
