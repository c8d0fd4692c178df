"""The calling thread's execution domain (personality(2)), for programs
started at fixed addresses.

Under emulation (QEMU's tcg) the code a process runs is translated once
per virtual address: a program loaded where the last one was reuses the
translations, one loaded elsewhere (address space layout randomization,
a new place at each exec) pays for them again. Started with
ADDR_NO_RANDOMIZE, the guest's OCI runtime and its libraries load where
they did before. The setting is the thread's and its children inherit it;
a caller hands it only to programs that reset it before they execute a
workload (crun applies the spec's personality, which clears the flag).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

ADDR_NO_RANDOMIZE = 0x0040000
_QUERY = 0xFFFFFFFF
_libc = ctypes.CDLL(None, use_errno=True)
_libc.personality.argtypes = [ctypes.c_ulong]
_libc.personality.restype = ctypes.c_int


def current() -> int:
    value = _libc.personality(_QUERY)
    if value < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), "personality")
    return value


def _set(value: int) -> None:
    if _libc.personality(value) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), "personality")


@contextlib.contextmanager
def fixed_addresses() -> Iterator[None]:
    """ADDR_NO_RANDOMIZE for what this thread starts meanwhile (a
    synchronous fork and exec), restored after."""
    before = current()
    _set(before | ADDR_NO_RANDOMIZE)
    try:
        yield
    finally:
        _set(before)
