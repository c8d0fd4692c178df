"""Paging of list calls (crust.driver.paging): every id once, whatever the
page size, and a token that outlives the id it names.
"""

from __future__ import annotations

import grpc
import pytest

from crust.common.errors import (
    Aborted,
    InvalidArgument,
)
from crust.driver.paging import TOKEN_PREFIX, paged
from tests.unit.helpers import raises_exactly

IDS = [f"vol-{i:03d}" for i in range(10)]


@pytest.mark.parametrize("max_entries", [1, 3, 4, 9, 10, 11])
def test_page_walk_covers_every_id_once(max_entries):
    seen, token, calls = [], "", 0
    while True:
        page, token = paged(IDS, token, max_entries)
        assert 0 < len(page) <= max_entries
        seen += page
        calls += 1
        if not token:
            break
        assert calls < 50
    assert seen == IDS
    assert calls == -(-len(IDS) // max_entries)


def test_page_zero_means_all():
    assert paged(IDS, "", 0) == (IDS, "")
    assert paged([], "", 0) == ([], "")
    assert paged([], "", 5) == ([], "")


def test_page_token_of_deleted_id_still_works():
    page, token = paged(IDS, "", 3)
    assert page == IDS[:3] and token
    remaining = [i for i in IDS if i != page[-1]]  # the last returned item is deleted
    remaining.append("vol-999")  # and one is created meanwhile
    seen, token2 = [], token
    while token2:
        chunk, token2 = paged(remaining, token2, 3)
        seen += chunk
    assert seen == IDS[3:] + ["vol-999"]


def test_page_invalid_token_is_aborted():
    for bad in ("garbage", "vol-003", "AFTER:vol-003"):
        err = raises_exactly(Aborted, paged, IDS, bad, 3)
        assert "starting_token" in err.message
    assert Aborted.code is grpc.StatusCode.ABORTED
    # A well-formed token past the end is an empty last page, not an error.
    assert paged(IDS, TOKEN_PREFIX + "zzz", 3) == ([], "")


def test_page_negative_max_entries_is_invalid():
    raises_exactly(InvalidArgument, paged, IDS, "", -1)
