"""Integer Quantity strings."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.quantity import format_bytes, format_mib, parse_quantity


@pytest.mark.parametrize("text, value", [("1Gi", 1 << 30), ("512Mi", 512 << 20), ("500M", 500 * 10**6), ("7", 7),
                                         (7, 7), ("2Ti", 2 << 40), ("3k", 3000)])
def test_parse(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("bad", ["1.5Gi", "1GB", "-1", "", "Gi", True, None, -3, "1e3"])
def test_parse_rejects(bad):
    with pytest.raises(ValueError):
        parse_quantity(bad)


def test_format():
    assert format_mib(81920) == "80Gi"
    assert format_mib(4864) == "4864Mi"
    assert format_bytes(0) == "0"
    assert format_bytes(3 << 10) == "3Ki"
    assert format_bytes(1025) == "1025"


@given(st.integers(0, 1 << 62))
def test_format_round_trips(n):
    assert parse_quantity(format_bytes(n)) == n
