"""asyncio helpers the daemons share."""

from __future__ import annotations

import asyncio


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
