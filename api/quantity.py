"""Kubernetes Quantity strings.

`parse_quantity` is for amounts users give us (bytes, counts): only the integer subset is accepted, a plain
integer or an integer with a binary (Ki..Ei) or decimal (k..E) suffix. Fractions ("1.5Gi") and exponents
are rejected, because every amount we publish or accept is a whole number of bytes or units and rounding
would make counters disagree. `quantity_value` reads any Quantity the API server may hand back ("500m",
"1e3", "1.5Gi") exactly, for comparisons.
"""
from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY_RE = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")

MIB = 1 << 20
GIB = 1 << 30


def parse_quantity(text: str | int) -> int:
    """"1Gi" -> 1073741824, "500M" -> 500000000, 7 -> 7. Raises ValueError with the offending text."""
    if isinstance(text, bool):
        raise ValueError(f"not a quantity: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"quantity must not be negative: {text}")
        return text
    if not isinstance(text, str):
        raise ValueError(f"not a quantity: {text!r}")
    m = _QUANTITY_RE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not an integer quantity like '4Gi' or '512Mi': {text!r}")
    number, suffix = int(m.group(1)), m.group(2) or ""
    return number * (_BINARY[suffix] if suffix in _BINARY else _DECIMAL[suffix])


def format_bytes(n: int) -> str:
    """Bytes as the shortest exact binary-suffixed Quantity: 85899345920 -> "80Gi", 5100273664 -> "4864Mi"."""
    if n < 0:
        raise ValueError(f"negative byte count: {n}")
    if n == 0:
        return "0"
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = _BINARY[suffix]
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def format_mib(mib: int) -> str:
    """MiB as a Quantity: 81920 -> "80Gi", 4864 -> "4864Mi"."""
    return format_bytes(mib * MIB)


_ANY_QUANTITY_RE = re.compile(
    r"^([+-]?[0-9]*\.?[0-9]*)(?:(Ki|Mi|Gi|Ti|Pi|Ei|m|n|u|k|M|G|T|P|E)|[eE]([+-]?[0-9]+))?$")
_DECIMAL_EXPONENT = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def quantity_value(text: str | int) -> Fraction:
    """The exact value of any Kubernetes Quantity ("1.5Gi", "500m", "1e3", 7). Raises ValueError."""
    if isinstance(text, bool):
        raise ValueError(f"not a quantity: {text!r}")
    if isinstance(text, int):
        return Fraction(text)
    return _quantity_value(str(text).strip())


@lru_cache(maxsize=4096)  # slices repeat the same few quantities thousands of times
def _quantity_value(s: str) -> Fraction:
    m = _ANY_QUANTITY_RE.fullmatch(s)
    if not s or not m or m.group(1) in ("", "+", "-", "."):
        raise ValueError(f"not a quantity: {s!r}")
    number = Fraction(m.group(1))
    suffix, exponent = m.group(2), m.group(3)
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if exponent is not None:
        return number * Fraction(10) ** int(exponent)
    return number * Fraction(10) ** _DECIMAL_EXPONENT[suffix or ""]
