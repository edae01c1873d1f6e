"""JSON from a client, read with a bound on nesting: json.loads recurses once per level and raises RecursionError
near a thousand, so a document nested deeper cannot be read at all, and its sender would get no answer.

`loads_bounded` reads every container nested deeper than the bound as null instead: the rest of the document (an
AdmissionReview's uid, say) stays readable, and whoever checks the part that was cut sees a value where a deep one
was.
"""
from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def loads_bounded(body: bytes | str, max_depth: int) -> Any:
    """json.loads of UTF-8 `body` with every object or list nested more than `max_depth` levels read as null.
    Raises ValueError (json.JSONDecodeError, UnicodeDecodeError) for a body that is no JSON."""
    text = body.decode("utf-8") if isinstance(body, bytes) else body
    if text.count("[") + text.count("{") <= max_depth:  # the common case: too few brackets to be too deep
        return json.loads(text)
    structure = _STRING.sub(_blank, text)  # same length, no brackets inside strings
    steps = [_DEPTH_STEP[ord(c)] for c in _BRACKET.findall(structure)]
    if max(accumulate(steps), default=0) <= max_depth:
        return json.loads(text)
    pieces: list[str] = []
    depth, kept_from, cut_at = 0, 0, -1
    for match in _BRACKET.finditer(structure):
        if match[0] in "[{":
            depth += 1
            if depth == max_depth + 1:
                cut_at = match.start()
        else:
            depth -= 1
            if depth == max_depth and cut_at >= 0:
                pieces += (text[kept_from:cut_at], "null")
                kept_from, cut_at = match.end(), -1
    # An unclosed container (a truncated document) stays cut to its end: json.loads then says where it broke.
    pieces.append(text[kept_from:cut_at] if cut_at >= 0 else text[kept_from:])
    return json.loads("".join(pieces))


def _blank(match: re.Match[str]) -> str:
    return '"' + " " * (len(match[0]) - 2) + '"'
