"""Per-key in-flight guard.

The CSI spec lets a plugin answer ABORTED when an operation is already pending
for the same volume; the CO retries later. That keeps different volumes fully
independent (no global lock) and makes concurrent retries of one request safe.
All servicers run on one asyncio event loop, so a plain set is enough.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from crust.common.errors import Aborted


class InFlight:
    def __init__(self) -> None:
        self._keys: set[str] = set()

    @contextmanager
    def hold(self, *keys: str) -> Iterator[None]:
        """Hold every key for the duration of the block, or raise ABORTED."""
        busy = [k for k in keys if k in self._keys]
        if busy:
            raise Aborted(f"an operation is already pending for {busy[0]}; retry later")
        self._keys.update(keys)
        try:
            yield
        finally:
            self._keys.difference_update(keys)

    def busy(self, key: str) -> bool:
        return key in self._keys
