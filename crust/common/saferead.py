"""Reading a small file that someone else may have damaged or planted.

The directories crust shares (the watched directory, the Kata mirror) and
the daemons' record directories hold files another root process can replace
under us: with a symlink (to a file crust must not read), a FIFO (an open
for reading blocks until a writer comes, which stops an event loop), a
directory, a device, or a file of megabytes. Every such read goes through
read_bounded: opened without following a link and without blocking
(O_NOFOLLOW | O_NONBLOCK), checked to be a regular file with fstat on the
open descriptor (no race with a rename), and read only up to a bound.

Anything that is not a small regular file is a Refused (a ValueError, so a
caller that already treats unparsable bytes as damage treats this the same
way) whose message says what was found. A missing file stays
FileNotFoundError: "not there" and "there but damaged" call for different
answers. read_model parses the bytes into a pydantic model, or refuses; a
file of a newer format than the model's is no damage, and raises
crust.common.formats.NewerFormat instead.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from crust.common.formats import decode

Model = TypeVar("Model", bound=BaseModel)

# Bigger than any description or record crust writes (a few KiB), small
# enough that reading one on an event loop is no pause.
DEFAULT_LIMIT = 1 << 20

_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symlink"}


class Refused(ValueError):
    """A file that is not a small regular file, or does not parse."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def kind_of(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def read_bounded(path: str | os.PathLike, limit: int = DEFAULT_LIMIT, *, dir_fd: int | None = None) -> bytes:
    """The bytes of a regular file of at most limit bytes at path (relative
    to dir_fd when given). The last component is never followed; the
    caller opens the directories on the way without following links when
    they can be planted too (dir_fd)."""
    name = os.fspath(path)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(name, "is a symlink; it is not followed") from None
        if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):  # a socket, a device without a driver
            raise Refused(name, "is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(name, f"is {kind_of(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise Refused(name, f"has {st.st_size} bytes, more than the {limit} a file of this kind may have")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:  # grew while being read
            raise Refused(name, f"has more than {limit} bytes, the most a file of this kind may have")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_model(model: type[Model], path: str | os.PathLike, limit: int = DEFAULT_LIMIT, *,
               dir_fd: int | None = None) -> Model:
    """read_bounded, parsed into model (any format version it reads:
    crust.common.formats); Refused naming the first problem when the bytes
    are not one (not JSON, cut short, wrong types, empty)."""
    data = read_bounded(path, limit, dir_fd=dir_fd)
    try:
        return decode(model, data, path)
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())) or "the file"
        what = "is empty" if not data.strip() else f"is not a {model.__name__}: {where}: {first.get('msg', exc)}"
        raise Refused(os.fspath(path), what) from None
    except ValueError as exc:  # a format_version that is no version
        raise Refused(os.fspath(path), str(exc)) from None
