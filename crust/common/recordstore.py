"""A directory of pydantic records, one JSON file per record.

Each record is written atomically (crust.common.atomicfile), so a SIGKILL at
any point leaves every record either old or new. A rewrite fills the inode
the previous write replaced (kept as `.KEY.json.spare.tmp`) instead of
creating one, and a delete removes that spare too. One file per record keeps a
write O(1) whatever the number of volumes, and a reload is one directory scan.
The async writes go through aiofiles (crust.common.atomicfile), so an
fsync never stalls the daemon's event loop; reads are synchronous (a small
record reads in microseconds). The _sync forms also serve a caller that runs
several steps of one call (records and the files they describe) in a single
worker trip.

Every record names its format version (crust.common.formats): a store
opened over a directory that holds a record of a newer format refuses at
once (NewerFormat), before its daemon has acted on any record, and
load_all reads every record before it yields the first.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Callable, Generic, Iterator, TypeVar

from pydantic import BaseModel

from crust.common.aio import KeyedLocks
from crust.common.atomicfile import (clean_temporaries, remove_durably, remove_durably_async, write_atomic,
                                    write_atomic_async)
from crust.common.formats import check_newest, encode
from crust.common.private import make_dirs
from crust.common.saferead import Refused, read_model

log = logging.getLogger(__name__)

Record = TypeVar("Record", bound=BaseModel)

_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
KEY_RULE = "letters, digits, '.', '_' and '-' (at most 201), starting with a letter or digit"


def valid_key(key: str) -> bool:
    """Whether a record can be stored under key (see KEY_RULE)."""
    return _SAFE_KEY.fullmatch(key) is not None  # fullmatch: '$' alone lets a trailing newline in


class RecordStore(Generic[Record]):
    """belongs(key, record) says why a record that parsed is not one this
    store may hold ("" when it is): its id is not its file's name, a path in
    it leaves the directories it must live in. Such a record, and one that
    does not parse or is no regular file (a FIFO, a directory, a symlink:
    crust.common.saferead), is set aside: logged, renamed *.corrupt for a
    human (or, when that fails, left and ignored), never followed; then
    on_damaged(key) tells the owner that what it named is unknown now."""

    def __init__(self, directory: str | os.PathLike, model: type[Record],
                 belongs: Callable[[str, Record], str] | None = None,
                 on_damaged: Callable[[str], None] | None = None):
        if model.model_config.get("extra") == "forbid":
            raise TypeError(f"{model.__name__}: a record model must let unknown keys pass (its format "
                            "version is one, and an older crust reads a newer key as absent)")
        self.directory = Path(directory)
        self.model = model
        self.belongs = belongs
        self.on_damaged = on_damaged
        # One write of a key at a time, in the order asked: a record encoded
        # later is never overwritten by one encoded before it.
        self._writing = KeyedLocks()
        make_dirs(self.directory)
        clean_temporaries(self.directory)
        for path in self.directory.glob("*.json"):
            try:
                check_newest(path, model)
            except OSError:
                pass  # gone, or unreadable: load_all says so

    def _path(self, key: str) -> Path:
        # Keys are ids we generated ourselves; refuse anything that could
        # step outside the directory.
        if not valid_key(key):
            raise ValueError(f"unsafe record key {key!r}")
        return self.directory / f"{key}.json"

    def load_all(self) -> Iterator[tuple[str, Record]]:
        """Every record, by key. All are read before the first is yielded:
        one of a newer format (NewerFormat) stops the caller before it has
        acted on any."""
        loaded = []
        for path in sorted(self.directory.glob("*.json")):
            if not valid_key(path.stem):
                self._set_aside(path.stem, path, "its name is not a record key")
                continue
            record = self._read(path.stem)
            if record is not None:
                loaded.append((path.stem, record))
        yield from loaded

    def get(self, key: str) -> Record | None:
        """The record under key; None when there is none, also for a key that
        could never have been stored (a CO may ask about any id), and for a
        record set aside as damaged."""
        if not valid_key(key):
            return None
        return self._read(key)

    def _read(self, key: str) -> Record | None:
        path = self._path(key)
        try:
            record = read_model(self.model, path)  # any format version it reads (crust.common.formats)
        except FileNotFoundError:
            return None
        except (Refused, OSError) as exc:
            self._set_aside(key, path, str(exc))
            return None
        why = self.belongs(key, record) if self.belongs is not None else ""
        if why:
            self._set_aside(key, path, why)
            return None
        return record

    def set_aside(self, key: str, why: str) -> None:
        """Set a record aside as one that does not belong (see above), for
        a reason its owner found after reading it."""
        self._set_aside(key, self._path(key), why)

    def _set_aside(self, key: str, path: Path, why: str) -> None:
        # Kept for a human, never silently dropped or overwritten: a name no
        # earlier record set aside holds (a directory cannot be renamed over
        # one, and would be left in the record's place).
        aside = path.with_suffix(".corrupt")
        for n in range(1, 1000):
            if not os.path.lexists(aside):
                break
            aside = path.with_suffix(f".{n}.corrupt")
        try:
            os.rename(path, aside)
            where = f"kept aside as {aside.name}"
        except OSError as exc:
            where = f"left in place and ignored ({exc.strerror})"
        log.error("unreadable record %s %s: %s", path, where, why)
        if self.on_damaged is not None:
            self.on_damaged(key)

    def put_sync(self, key: str, record: Record) -> None:
        write_atomic(self._path(key), encode(record), reuse=True)

    def delete_sync(self, key: str) -> None:
        if not valid_key(key):
            return  # never stored, so nothing to remove
        remove_durably(self._path(key), spare=True)

    async def put(self, key: str, record: Record) -> None:
        async with self._writing[key]:
            await write_atomic_async(self._path(key), encode(record), reuse=True)

    async def delete(self, key: str) -> None:
        if valid_key(key):
            async with self._writing[key]:
                await remove_durably_async(self._path(key), spare=True)
