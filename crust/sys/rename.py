"""renameat2(2)'s RENAME_EXCHANGE: swap two names in one step.

Python's os module has rename and replace only. Exchanging a freshly
written temporary with a record keeps the record's previous inode under the
temporary's name, for the next write to fill (crust.common.atomicfile):
creating a file costs far more than rewriting one on ext4 without a journal.
"""

from __future__ import annotations

import ctypes
import errno
import os

_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)
if _renameat2 is not None:
    _renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    _renameat2.restype = ctypes.c_int

AT_FDCWD = -100
RENAME_EXCHANGE = 2


def exchange(a: str | os.PathLike, b: str | os.PathLike, dir_fd: int | None = None) -> None:
    """Swap names a and b atomically (both must exist; relative to dir_fd if
    given). OSError as the kernel says: ENOENT when one is missing, EINVAL or
    ENOSYS where the file system or libc cannot exchange."""
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not in this libc")
    at = AT_FDCWD if dir_fd is None else dir_fd
    if _renameat2(at, os.fsencode(a), at, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))
