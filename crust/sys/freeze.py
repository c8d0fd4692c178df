"""FIFREEZE and FITHAW: stop and resume writes to a mounted file system.

Both act on the file system of an open descriptor (any file or directory
on it, opened read-only). The kernel does not count freezes: a second
FIFREEZE of a frozen file system is EBUSY, which is why callers count
their own (crust.common.freezes).
"""

from __future__ import annotations

import errno
import fcntl
import os

# _IOWR('X', 119, int) and _IOWR('X', 120, int) from linux/fs.h.
FIFREEZE = 0xC0045877
FITHAW = 0xC0045878

# Largest bound of a freeze anyone may ask for, and the default one.
MAX_TIMEOUT_SECONDS = 600
DEFAULT_TIMEOUT_SECONDS = 30


class FreezeError(Exception):
    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.errno = code


def freeze(fd: int) -> None:
    try:
        fcntl.ioctl(fd, FIFREEZE, 0)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise FreezeError("the file system is already frozen by someone else", exc.errno) from None
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL):
            raise FreezeError("this file system cannot be frozen", exc.errno) from None
        raise FreezeError(f"FIFREEZE failed: {os.strerror(exc.errno or 0)}", exc.errno or 0) from None


def thaw(fd: int) -> bool:
    """False when the file system was not frozen."""
    try:
        fcntl.ioctl(fd, FITHAW, 0)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise FreezeError(f"FITHAW failed: {os.strerror(exc.errno or 0)}", exc.errno or 0) from None
    return True


def open_mount(path: str, dir_fd: int | None = None) -> int:
    """A read-only descriptor of a mount point, for freeze and thaw."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)


def timeout_of(value: int, field: str) -> int:
    """The bound asked for, checked: 0 is the default. ValueError names the field."""
    if value == 0:
        return DEFAULT_TIMEOUT_SECONDS
    if not 1 <= value <= MAX_TIMEOUT_SECONDS:
        raise ValueError(f"{field} must be 1..{MAX_TIMEOUT_SECONDS} seconds (0: {DEFAULT_TIMEOUT_SECONDS}), "
                         f"not {value}")
    return value
