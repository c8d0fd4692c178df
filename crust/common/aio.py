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


async def cancel_all(tasks) -> None:
    """Cancel the tasks and wait until each has ended (their exceptions,
    cancellation included, are theirs: none is raised here)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


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


class KeyedLocks:
    """One asyncio lock per key (a pod, a record), which exists only while
    somebody holds it or waits for it: a daemon that serves ids for months
    keeps no lock of every id it ever served, and no lock is dropped while
    somebody waits for it (a later caller would take a second lock of the
    same key).

        async with locks[key]:
            ...
    """

    def __init__(self):
        self._entries: dict[str, list] = {}   # key -> [its lock, how many hold or wait for it]

    def __getitem__(self, key: str) -> _KeyHold:
        return _KeyHold(self, key)

    def __len__(self) -> int:
        return len(self._entries)


class _KeyHold:
    def __init__(self, locks: KeyedLocks, key: str):
        self.locks, self.key = locks, key

    async def __aenter__(self) -> None:
        entry = self.locks._entries.setdefault(self.key, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            await entry[0].acquire()
        except BaseException:
            self._leave(entry)
            raise

    async def __aexit__(self, *exc) -> None:
        entry = self.locks._entries[self.key]
        entry[0].release()
        self._leave(entry)

    def _leave(self, entry: list) -> None:
        entry[1] -= 1
        if entry[1] == 0:
            del self.locks._entries[self.key]
