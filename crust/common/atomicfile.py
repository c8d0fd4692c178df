"""Crash-safe file replacement.

A reader (another process, or this one after SIGKILL and restart) sees either
the old content or the new content, never a partial file: write a temporary
file in the same directory, fsync it, rename it over the target, fsync the
directory so the rename itself is durable.

The daemons write on their event loop through the async forms, with
aiofiles: the blocking steps (open, write, fsync, rename, the directory's
fsync) run in aiofiles' worker threads, all in one trip, and the loop
serves other calls meanwhile: the loop is held for a small part of such a
write, against the whole write (fsyncs included) when done on the loop
(bench/csi/file_io.py). Small reads stay synchronous: a small read on the
loop costs less than a trip through aiofiles' threads.

A record rewritten often (crust.common.recordstore) may keep its previous
inode for the next write (reuse=True): the new content goes into the spare
inode, is fsynced, then swapped with the record in one renameat2
RENAME_EXCHANGE; the old inode takes the spare's name. The record is old or
new at every instant exactly as with a rename, and the directory is
fsynced after as before, but no inode is created. Creating one is costly
on ext4 without a journal, where the allocator skips every recently freed
inode of the group (bench/csi/call_cpu.py).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Callable

import aiofiles
import aiofiles.os

from crust.common.errors import space_in
from crust.sys import rename

fsync_async = aiofiles.os.wrap(os.fsync)


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _opener(mode: int) -> Callable[[str, int], int]:
    """Open a temporary with exactly `mode`, whatever the process's umask."""
    def opener(path: str, flags: int) -> int:
        fd = os.open(path, flags, mode)
        os.fchmod(fd, mode)
        return fd
    return opener


def write_atomic(path: str | os.PathLike, data: bytes, mode: int = 0o600, reuse: bool = False) -> None:
    """Replace path with data durably; reuse: with the spare inode the
    previous write left (see above), and leave the replaced one as the spare."""
    path = Path(path)
    _write_in(path.parent, path.name, data, _opener(mode), reuse)


def temporary_name(name: str) -> str:
    """The name of a temporary beside name (clean_temporaries finds it)."""
    return f".{name}.{secrets.token_hex(6)}.tmp"


def spare_name(name: str) -> str:
    """The name of name's spare inode (a temporary: clean_temporaries finds it)."""
    return f".{name}.spare.tmp"


async def write_atomic_async(path: str | os.PathLike, data: bytes, mode: int = 0o600, reuse: bool = False) -> None:
    """write_atomic, with the loop free while the file system works."""
    path = Path(path)
    await _write_in_thread(path.parent, path.name, data, _opener(mode), reuse)


async def write_atomic_in(directory: str | os.PathLike | int, name: str, data: bytes,
                          opener: Callable[[str, int], int]) -> None:
    """Write name in directory (a path, or a descriptor opener and the
    rename use) through a temporary; opener(path, flags) opens the temporary
    (a caller adds O_NOFOLLOW and dir_fd there).

    The whole sequence is one trip to aiofiles' worker threads: a trip per
    step (open, write, fsync, close, rename, the directory's fsync) costs a
    thread hand-off each, which on a busy node costs more than the step."""
    await _write_in_thread(directory, name, data, opener)


def _write_in(directory: str | os.PathLike | int, name: str, data: bytes,
              opener: Callable[[str, int], int], reuse: bool = False) -> None:
    # A full file system (or a spent quota) is the caller's to answer with
    # RESOURCE_EXHAUSTED naming the directory; the temporary is gone then.
    with space_in(directory):
        _write_through_temporary(directory, name, data, opener, reuse)


def _claim_spare(directory: str | os.PathLike | int, name: str, tmp_path: str,
                 opener: Callable[[str, int], int]) -> int | None:
    """name's spare inode, renamed to tmp_path (so that one writer only
    has it) and opened for writing over (a descriptor); None when there is
    none or it is not a plain file of its own (a symlink, a FIFO, a hard
    link: then it is removed; a directory is left at tmp_path, a temporary)."""
    at = {"src_dir_fd": directory, "dst_dir_fd": directory} if isinstance(directory, int) else {}
    spare = spare_name(name) if isinstance(directory, int) else os.path.join(directory, spare_name(name))
    try:
        os.rename(spare, tmp_path, **at)
    except FileNotFoundError:
        return None
    try:
        # Not truncated before it is known to be a plain file of its own.
        fd = opener(tmp_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        fd = None
    if fd is not None:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
            return fd  # written over, then cut at the new length: no block freed and allocated again
        os.close(fd)
    try:
        _unlink(directory, tmp_path)
    except OSError:
        pass  # a directory: a temporary, for clean_temporaries and a human
    return None


def _unlink(directory: str | os.PathLike | int, path: str) -> None:
    try:
        os.unlink(path, **({"dir_fd": directory} if isinstance(directory, int) else {}))
    except FileNotFoundError:
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_through_temporary(directory: str | os.PathLike | int, name: str, data: bytes,
                             opener: Callable[[str, int], int], reuse: bool = False) -> None:
    # Plain descriptors, not Python file objects: a buffered file adds
    # eight system calls (an isatty and a close-on-exec ioctl, six tells)
    # to each write.
    tmp = temporary_name(name)
    at = {"src_dir_fd": directory, "dst_dir_fd": directory} if isinstance(directory, int) else {}
    tmp_path = tmp if isinstance(directory, int) else os.path.join(directory, tmp)
    final = name if isinstance(directory, int) else os.path.join(directory, name)
    exchanged = False
    try:
        fd = _claim_spare(directory, name, tmp_path, opener) if reuse else None
        if fd is None and reuse:
            # What the spare's name held may still be at tmp_path (a directory).
            tmp = temporary_name(name)
            tmp_path = tmp if isinstance(directory, int) else os.path.join(directory, tmp)
        reused = fd is not None
        if not reused:
            fd = opener(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
        try:
            _write_all(fd, data)
            if reused:
                os.ftruncate(fd, len(data))  # the spare may be longer than data
            os.fsync(fd)
        finally:
            os.close(fd)
        if reuse:
            try:
                rename.exchange(tmp_path, final, directory if isinstance(directory, int) else None)
                exchanged = True
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
        if not exchanged:
            os.rename(tmp_path, final, **at)
    except BaseException:
        _unlink(directory, tmp_path)
        raise
    if exchanged:
        # The replaced record's inode, kept for the next write (a crash
        # here leaves a temporary, removed at the next start).
        spare = spare_name(name) if isinstance(directory, int) else os.path.join(directory, spare_name(name))
        os.rename(tmp_path, spare, **at)
    if isinstance(directory, int):
        os.fsync(directory)
    else:
        fsync_dir(directory)


_write_in_thread = aiofiles.os.wrap(_write_in)


async def remove_durably_async(path: str | os.PathLike, spare: bool = False) -> bool:
    """remove_durably, in one trip to aiofiles' worker threads."""
    return await _remove_in_thread(path, spare)


def remove_durably(path: str | os.PathLike, spare: bool = False) -> bool:
    """Remove a file and make the removal durable. Missing is fine
    (idempotent). spare: also its spare inode (write_atomic's reuse)."""
    path = Path(path)
    if spare:
        try:
            _unlink(path.parent, str(path.parent / spare_name(path.name)))
        except IsADirectoryError:
            pass  # not a spare of ours: left for a human
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


_remove_in_thread = aiofiles.os.wrap(remove_durably)


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
