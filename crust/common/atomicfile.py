"""Crash-safe file replacement.

A reader (another process, or this one after SIGKILL and restart) sees either
the old content or the new content, never a partial file: write a temporary
file in the same directory, fsync it, rename it over the target, fsync the
directory so the rename itself is durable.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
