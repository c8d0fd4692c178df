"""Sizes as people write them (crust.common.units)."""

from __future__ import annotations

import pytest

from crust.common import units
from tests.unit.helpers import GIB, MIB


@pytest.mark.parametrize("text, value", [
    ("4096", 4096), ("0", 0), ("512Mi", 512 * MIB), ("10Gi", 10 * GIB), ("1G", 10**9), ("1g", 10**9),
    ("2Ti", 2 * 2**40), ("3k", 3000), ("3Ki", 3072), ("1KiB", 1024), ("1MB", 10**6), (" 7 Mi ", 7 * MIB),
    ("100Gi", 100 * GIB),
])
def test_parse_size(text, value):
    assert units.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "Mi", "1.5Gi", "-1", "1Pi", "1 2", "10 Gix", "ten"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        units.parse_size(text)


def test_format_size():
    assert units.format_size(0) == "0"
    assert units.format_size(1000) == "1000"
    assert units.format_size(1024) == "1Ki"
    assert units.format_size(1536 * MIB) == "1536Mi"
    assert units.format_size(GIB) == "1Gi"
    assert units.format_size(3 * 2**40) == "3Ti"
    assert units.format_size(GIB + 1) == str(GIB + 1)
    for n in (0, 1, 1023, 4096, 64 * MIB, 100 * GIB, 2**40 + 2**20):
        assert units.parse_size(units.format_size(n)) == n
