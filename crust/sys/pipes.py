"""Pipes as the kernel moves their pages: their size, what they hold,
tee(2) and splice(2), and dropping bytes without reading them.

A pipe's bytes live in pages the kernel hands from one pipe to another
(tee takes a reference, splice moves it) and, through a device that
splices (the guest's virtio console), onto a device's queue. None of it
passes through the process that asks: under emulation a copy through a
process costs the vCPU that the writing process runs on.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import termios

# <linux/fcntl.h>
F_SETPIPE_SZ = 1031
F_GETPIPE_SZ = 1032
# <linux/splice.h>
SPLICE_F_MOVE = 1
SPLICE_F_NONBLOCK = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.tee.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint)
_libc.tee.restype = ctypes.c_ssize_t
_null: int | None = None


def size(fd: int) -> int:
    return fcntl.fcntl(fd, F_GETPIPE_SZ)


def set_size(fd: int, wanted: int) -> int:
    """The pipe's capacity set to wanted (the kernel rounds up to a power
    of two of pages), or as near below it as this process may (beyond
    /proc/sys/fs/pipe-max-size only with CAP_SYS_RESOURCE); its capacity."""
    current = size(fd)
    while wanted > current:
        try:
            return fcntl.fcntl(fd, F_SETPIPE_SZ, wanted)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOMEM, errno.EBUSY):
                raise
            wanted //= 2
    return current


def queued(fd: int) -> int:
    """The bytes a pipe holds (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def tee(source: int, target: int, count: int) -> int:
    """Up to count bytes at the head of source duplicated at the end of
    target (page references, no copy; source keeps them); never waits:
    BlockingIOError when source is empty or target full."""
    done = _libc.tee(source, target, count, SPLICE_F_NONBLOCK)
    if done < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return done


def splice(source: int, target: int, count: int) -> int:
    """Up to count bytes moved from the pipe source to target (a pipe, a
    socket, a device that splices); never waits on the pipe's side (a
    target opened non-blocking does not wait either)."""
    return os.splice(source, target, count, flags=SPLICE_F_MOVE | SPLICE_F_NONBLOCK)


def discard(fd: int, count: int) -> int:
    """Up to count bytes dropped from the head of the pipe fd (spliced to
    /dev/null: nothing copied); never waits. The bytes dropped."""
    global _null
    if _null is None:
        _null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    dropped = 0
    while dropped < count:
        try:
            moved = os.splice(fd, _null, count - dropped, flags=SPLICE_F_NONBLOCK)
        except BlockingIOError:
            break
        if moved == 0:
            break
        dropped += moved
    return dropped


def make(capacity: int) -> tuple[int, int]:
    """A non-blocking, close-on-exec pipe (read end, write end) of about
    capacity bytes (see set_size)."""
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        set_size(write_end, capacity)
    except OSError:
        os.close(read_end)
        os.close(write_end)
        raise
    return read_end, write_end
