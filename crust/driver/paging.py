"""Paging of the driver's list calls (ListVolumes, ListSnapshots) by token."""

from __future__ import annotations

from crust.common.errors import Aborted, InvalidArgument

TOKEN_PREFIX = "after:"


def paged(ids: list[str], starting_token: str, max_entries: int, field: str = "starting_token"):
    """Token-based paging over sorted ids: the token names the last id
    returned, so deleting that item or adding new ones never breaks a walk."""
    if max_entries < 0:
        raise InvalidArgument("max_entries must not be negative")
    start = 0
    if starting_token:
        if not starting_token.startswith(TOKEN_PREFIX):
            raise Aborted(f"{field} {starting_token!r} was not issued by this driver")
        after = starting_token[len(TOKEN_PREFIX):]
        start = next((i for i, v in enumerate(ids) if v > after), len(ids))
    end = len(ids) if max_entries == 0 else min(len(ids), start + max_entries)
    page = ids[start:end]
    token = f"{TOKEN_PREFIX}{page[-1]}" if end < len(ids) and page else ""
    return page, token
