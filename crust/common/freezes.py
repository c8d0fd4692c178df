"""Nested, bounded freezes of mounted file systems, kept where they apply.

The file system is frozen at a key's first freeze and thawed at its last
thaw; each freeze moves the key's deadline to at least its own bound, and
at the deadline the book thaws the file system by itself, whatever depth
is left, and logs that it did: a freeze never outlives a caller that died
or a thaw that was lost. Used by the guest's agent (a microVM's volumes)
and by the light handler's freeze holder (crust.runtime_handler.freeze_holder).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from crust.sys import freeze as sysfreeze


@dataclass
class _Entry:
    fd: int
    depth: int = 0
    deadline: float = 0.0
    since: float = field(default_factory=time.monotonic)
    timer: asyncio.Task | None = None


class FreezeBook:
    def __init__(self, log: logging.Logger, on_thawed: Callable[[str, str], None] | None = None):
        self.log = log
        # Called with (key, reason) once a key's file system thawed.
        self.on_thawed = on_thawed
        self._entries: dict[str, _Entry] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def depth(self, key: str) -> int:
        entry = self._entries.get(key)
        return entry.depth if entry is not None else 0

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def freeze(self, key: str, timeout: float, open_fd: Callable[[], int]) -> int:
        """One more freeze of key (open_fd: a read-only descriptor on its file
        system, kept while frozen); the depth now. sysfreeze.FreezeError
        when the file system cannot be frozen (nothing is left frozen)."""
        loop = asyncio.get_running_loop()
        async with self._lock(key):
            entry = self._entries.get(key)
            if entry is None:
                fd = open_fd()
                try:
                    await asyncio.to_thread(sysfreeze.freeze, fd)
                except BaseException:
                    os.close(fd)
                    raise
                entry = self._entries[key] = _Entry(fd)
                self.log.info("%s: file system frozen", key, extra={"fields": {"volume": key, "timeout_seconds": timeout}})
            entry.depth += 1
            deadline = loop.time() + timeout
            if deadline > entry.deadline:
                entry.deadline = deadline
                if entry.timer is not None:
                    entry.timer.cancel()
                entry.timer = loop.create_task(self._expire(key, entry))
            return entry.depth

    async def thaw(self, key: str) -> tuple[int, bool]:
        """One freeze of key undone: (the depth left, whether it was frozen)."""
        async with self._lock(key):
            entry = self._entries.get(key)
            if entry is None:
                return 0, False
            entry.depth -= 1
            if entry.depth > 0:
                return entry.depth, True
            await self._end(key, entry, "thawed")
            return 0, True

    async def thaw_all(self, key: str, reason: str) -> bool:
        """Every freeze of key undone (its volume goes away); whether one was."""
        async with self._lock(key):
            entry = self._entries.get(key)
            if entry is None:
                return False
            await self._end(key, entry, reason)
            return True

    async def close(self, reason: str = "shutting down") -> None:
        for key in list(self._entries):
            await self.thaw_all(key, reason)

    async def _expire(self, key: str, entry: _Entry) -> None:
        await asyncio.sleep(max(0.0, entry.deadline - asyncio.get_running_loop().time()))
        async with self._lock(key):
            if self._entries.get(key) is not entry:
                return
            entry.timer = None   # this task: not cancelled by _end
            self.log.warning("%s: file system thawed by itself after its freeze timed out (no thaw came)", key,
                             extra={"fields": {"volume": key, "depth": entry.depth}})
            await self._end(key, entry, "timed out")

    async def _end(self, key: str, entry: _Entry, reason: str) -> None:
        del self._entries[key]
        if entry.timer is not None:
            entry.timer.cancel()
        try:
            await asyncio.to_thread(sysfreeze.thaw, entry.fd)
        except sysfreeze.FreezeError as exc:
            self.log.error("%s: thaw failed: %s", key, exc, extra={"fields": {"volume": key, "error": str(exc)}})
        finally:
            os.close(entry.fd)
        frozen = time.monotonic() - entry.since
        self.log.info("%s: file system thawed (%s)", key, reason, extra={"fields": {
            "volume": key, "reason": reason, "frozen_seconds": round(frozen, 3)}})
        if self.on_thawed is not None:
            self.on_thawed(key, reason)
