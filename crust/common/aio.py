"""asyncio helpers the daemons share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def first_done(owned: asyncio.Future, other: asyncio.Future) -> set[asyncio.Future]:
    """Wait until owned or other completes; returns the completed ones.

    owned is the caller's own work: if the caller is cancelled meanwhile (a
    daemon stopping), owned is cancelled and awaited too, instead of failing
    later with nobody to retrieve its exception. other is shared and left alone.
    """
    try:
        done, _ = await asyncio.wait({owned, other}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        owned.cancel()
        await asyncio.gather(owned, return_exceptions=True)
        raise
    return done


async def in_thread(fn: Callable[..., T], *args, then: Callable[[], None] = lambda: None) -> T:
    """fn(*args) in a worker thread, then then() on the loop once it succeeded.

    A worker thread cannot be stopped. When the caller is cancelled meanwhile
    (a CO that gave up on its call), the thread's end is still awaited and
    then() still runs before the cancellation goes on: the in-memory state
    then matches what reached the disk, and the caller's cleanup or the CO's
    retry never races file system steps that are still under way.
    """
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        result = await asyncio.shield(work)
    except asyncio.CancelledError:
        while not work.done():
            try:
                await asyncio.wait({work})
            except asyncio.CancelledError:
                pass  # the first cancellation is raised below
        if work.exception() is None:
            then()
        raise
    then()
    return result
