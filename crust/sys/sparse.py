"""Where a file holds data: its extents past the holes (SEEK_DATA and
SEEK_HOLE), so a copy of a mostly empty file reads and writes only what
was written to it, and leaves the rest a hole."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each run of data of the open file fd below size, in
    order. A file system that cannot tell holes answers one run: all of it."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return   # only a hole from here to the end
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end
        offset = end
