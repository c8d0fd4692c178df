"""Crash-safe file replacement.

A reader (another process, or this one after SIGKILL and restart) sees either
the old content or the new content, never a partial file: write a temporary
file in the same directory, fsync it, rename it over the target, fsync the
directory so the rename itself is durable.

The daemons write on their event loop through the async forms, with
aiofiles: every blocking step (open, write, fsync, rename, the directory's
fsync) runs in aiofiles' worker threads and the loop serves other calls
meanwhile. Measured here (bench/file_io.py, docs/benchmarks.md): the loop
is held at most about 0.2 ms during such a write, against the whole write
(fsyncs included) when done on the loop. Small reads stay synchronous: a
1 KiB read takes about 10 us on the loop and about 350 us through aiofiles.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path
from typing import Callable

import aiofiles
import aiofiles.os

fsync_async = aiofiles.os.wrap(os.fsync)
_rename = aiofiles.os.wrap(os.rename)


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes, mode: int = 0o600) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def temporary_name(name: str) -> str:
    """The name of a temporary beside name (clean_temporaries finds it)."""
    return f".{name}.{secrets.token_hex(6)}.tmp"


async def write_atomic_async(path: str | os.PathLike, data: bytes, mode: int = 0o600) -> None:
    """write_atomic, with the loop free while the file system works."""
    path = Path(path)
    await write_atomic_in(path.parent, path.name, data, lambda p, flags: os.open(p, flags, mode))


async def write_atomic_in(directory: str | os.PathLike | int, name: str, data: bytes,
                          opener: Callable[[str, int], int]) -> None:
    """Write name in directory (a path, or a descriptor opener and the
    rename use) through a temporary; opener(path, flags) opens the temporary
    (a caller adds O_NOFOLLOW and dir_fd there)."""
    tmp = temporary_name(name)
    at = {"src_dir_fd": directory, "dst_dir_fd": directory} if isinstance(directory, int) else {}
    tmp_path = tmp if isinstance(directory, int) else os.path.join(directory, tmp)
    final = name if isinstance(directory, int) else os.path.join(directory, name)
    try:
        async with aiofiles.open(tmp_path, "xb", opener=opener) as f:
            await f.write(data)
            await f.flush()
            await fsync_async(f.fileno())
        await _rename(tmp_path, final, **at)
    except BaseException:
        try:
            os.unlink(tmp_path, **({"dir_fd": directory} if isinstance(directory, int) else {}))
        except FileNotFoundError:
            pass
        raise
    await _fsync_directory(directory)


async def _fsync_directory(directory: str | os.PathLike | int) -> None:
    if isinstance(directory, int):
        await fsync_async(directory)
        return
    fd = await aiofiles.os.wrap(os.open)(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        await fsync_async(fd)
    finally:
        os.close(fd)


async def remove_durably_async(path: str | os.PathLike) -> bool:
    path = Path(path)
    try:
        await aiofiles.os.remove(path)
    except FileNotFoundError:
        return False
    await _fsync_directory(path.parent)
    return True


def remove_durably(path: str | os.PathLike) -> bool:
    """Remove a file and make the removal durable. Missing is fine (idempotent)."""
    path = Path(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


def clean_temporaries(directory: str | os.PathLike) -> int:
    """Remove temporaries a killed writer left behind; returns how many."""
    removed = 0
    for entry in Path(directory).glob(".*.tmp"):
        try:
            entry.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed
