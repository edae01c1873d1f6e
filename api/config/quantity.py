"""Kubernetes quantities as pydantic field types (bytes as int), with errors that say what was wrong.

Parsing itself is `api.quantity.parse_quantity` (integer quantities: plain ints, Ki..Ei, k..E), so a
limit written in a claim means the same number of bytes everywhere in the driver.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import PlainSerializer, PlainValidator
from pydantic_core import PydanticCustomError

from api.config.errors import describe
from api.quantity import MIB, format_bytes, parse_quantity


def quantity_bytes(value: Any) -> int:
    """A quantity from user input ("4Gi", "512Mi", "2G", 1073741824) as an int; PydanticCustomError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise PydanticCustomError("quantity_type", "must be a quantity such as '4Gi' or '512Mi', got {got}",
                                  {"got": describe(value)})
    try:
        return parse_quantity(value)
    except ValueError as exc:
        raise PydanticCustomError("quantity", "{reason}", {"reason": str(exc)}) from None


def _at_least_1mi(value: Any) -> int:
    n = quantity_bytes(value)
    if n < MIB:
        raise PydanticCustomError("quantity_min", "must be at least 1Mi, got {got}", {"got": describe(value)})
    return n


# A byte quantity; serialised back in its shortest exact binary form ("4Gi").
Quantity = Annotated[int, PlainValidator(quantity_bytes), PlainSerializer(format_bytes, return_type=str)]
# A memory limit: MPS takes limits in MiB, so anything under 1Mi cannot be expressed.
MemoryLimit = Annotated[int, PlainValidator(_at_least_1mi), PlainSerializer(format_bytes, return_type=str)]
