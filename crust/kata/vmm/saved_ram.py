"""A saved VM's guest RAM, kept apart from its state: what a restored VM
holds is the pages its template's guest wrote, not all of its RAM.

A VM that is saved or restored (crust.kata.supply.template) maps its guest RAM
from a memfd crust makes, handed to QEMU as `memory-backend-file` on
/proc/self/fd/N, shared (virtiofsd maps it too, as vhost-user-fs needs).
QEMU saves with its `x-ignore-shared` capability, which leaves shared RAM
out of the state; crust writes the memfd's pages that hold anything to a
sparse file beside the state, and each VM restored from it gets a new
memfd holding those pages and nothing else: the rest of its RAM is
allocated when its guest writes it.

Loaded from QEMU's own state instead, every page of the guest's RAM was
resident in every restored VM: for each page the state calls zero, QEMU
7.2 reads the page to see whether it must clear it, and a read of shared
memory allocates it.

Whoever writes a memfd's page first is charged for it: the handler here,
for what a restore copies, as for QEMU's own memory (QEMU runs in the
handler's cgroup).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from crust.common.private import open_new
from crust.sys.sparse import data_extents

RAM_SUFFIX = ".ram"
MIB = 1024 * 1024
# Pages compared to zeros one by one before they are written out.
PAGE = 4096
CHUNK = 1024 * 1024   # read and written at a time
_ZEROS = bytes(PAGE)


class RamFileError(Exception):
    """A saved guest's RAM that cannot be loaded (missing, of another size)."""


def ram_path(state: Path) -> Path:
    """The RAM file saved beside a VM's state file."""
    return state.with_name(state.name + RAM_SUFFIX)


def new_ram(name: str, size: int, saved: Path | None = None) -> int:
    """A memfd of size bytes for a VM's guest RAM (close-on-exec: passed
    to QEMU by number), holding the data of saved if given."""
    fd = os.memfd_create(f"crust-ram-{name}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        if saved is not None:
            _load(fd, size, saved)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _load(fd: int, size: int, saved: Path) -> None:
    try:
        src = os.open(saved, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise RamFileError(f"its saved RAM {saved}: {exc.strerror}") from None
    try:
        found = os.fstat(src).st_size
        if found != size:
            raise RamFileError(f"its saved RAM {saved} is {found} bytes, the VM's RAM {size}")
        with mmap.mmap(fd, size) as ram:
            view = memoryview(ram)
            try:
                for start, end in data_extents(src, size):
                    position = start
                    while position < end:
                        read = os.preadv(src, [view[position:min(end, position + CHUNK)]], position)
                        if read == 0:
                            raise RamFileError(f"its saved RAM {saved} ended at {position} of {size} bytes")
                        position += read
            finally:
                view.release()
    finally:
        os.close(src)


def save_ram(source: str, dest: Path, size: int) -> int:
    """The data of the RAM file source (QEMU's, through /proc) written to
    dest, a new file of size bytes: blocks of zeros stay holes. Returns the
    bytes of data written."""
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = open_new(dest)
        try:
            written = 0
            for start, end in data_extents(src, size):
                position = start
                while position < end:
                    chunk = os.pread(src, min(end - position, CHUNK), position)
                    if not chunk:
                        raise OSError(f"{source} ended at {position} of {size} bytes")
                    written += _write_pages(dst, chunk, position)
                    position += len(chunk)
            os.ftruncate(dst, size)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return written


def _write_pages(dst: int, chunk: bytes, offset: int) -> int:
    """The pages of chunk that are not all zeros written at offset in dst,
    a run of them at a time. Returns the bytes written."""
    written = 0
    run = None   # where the run of pages to write began in chunk
    for at in range(0, len(chunk) + PAGE, PAGE):
        zeros = at >= len(chunk) or chunk[at:at + PAGE] == _ZEROS[:len(chunk[at:at + PAGE])]
        if not zeros and run is None:
            run = at
        elif zeros and run is not None:
            end = min(at, len(chunk))
            os.pwrite(dst, chunk[run:end], offset + run)
            written += end - run
            run = None
    return written
