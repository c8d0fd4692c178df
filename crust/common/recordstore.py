"""A directory of pydantic records, one JSON file per record.

Each record is written atomically (crust.common.atomicfile), so a SIGKILL at
any point leaves every record either old or new. One file per record keeps a
write O(1) whatever the number of volumes, and a reload is one directory scan.
The async writes go through aiofiles (crust.common.atomicfile), so an
fsync never stalls the daemon's event loop; reads are synchronous (a small
record reads in microseconds). The _sync forms also serve a caller that runs
several steps of one call (records and the files they describe) in a single
worker trip.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Generic, Iterator, TypeVar

from pydantic import BaseModel, ValidationError

from crust.common.atomicfile import (clean_temporaries, remove_durably, remove_durably_async, write_atomic,
                                    write_atomic_async)
from crust.common.private import make_dirs

log = logging.getLogger(__name__)

Record = TypeVar("Record", bound=BaseModel)

_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
KEY_RULE = "letters, digits, '.', '_' and '-' (at most 201), starting with a letter or digit"


def valid_key(key: str) -> bool:
    """Whether a record can be stored under key (see KEY_RULE)."""
    return _SAFE_KEY.fullmatch(key) is not None  # fullmatch: '$' alone lets a trailing newline in


class RecordStore(Generic[Record]):
    def __init__(self, directory: str | os.PathLike, model: type[Record]):
        self.directory = Path(directory)
        self.model = model
        make_dirs(self.directory)
        clean_temporaries(self.directory)

    def _path(self, key: str) -> Path:
        # Keys are ids we generated ourselves; refuse anything that could
        # step outside the directory.
        if not valid_key(key):
            raise ValueError(f"unsafe record key {key!r}")
        return self.directory / f"{key}.json"

    def load_all(self) -> Iterator[tuple[str, Record]]:
        for path in sorted(self.directory.glob("*.json")):
            try:
                yield path.stem, self.model.model_validate_json(path.read_bytes())
            except (ValidationError, ValueError, OSError) as exc:
                # A record we cannot read is kept aside for a human, never
                # silently dropped or overwritten.
                log.error("unreadable record %s kept aside: %s", path, exc)
                path.rename(path.with_suffix(".corrupt"))

    def get(self, key: str) -> Record | None:
        """The record under key; None when there is none, also for a key that
        could never have been stored (a CO may ask about any id)."""
        if not valid_key(key):
            return None
        try:
            return self.model.model_validate_json(self._path(key).read_bytes())
        except FileNotFoundError:
            return None

    def put_sync(self, key: str, record: Record) -> None:
        write_atomic(self._path(key), record.model_dump_json(indent=1).encode())

    def delete_sync(self, key: str) -> None:
        if not valid_key(key):
            return  # never stored, so nothing to remove
        remove_durably(self._path(key))

    async def put(self, key: str, record: Record) -> None:
        await write_atomic_async(self._path(key), record.model_dump_json(indent=1).encode())

    async def delete(self, key: str) -> None:
        if valid_key(key):
            await remove_durably_async(self._path(key))
