"""Facts about block devices: size, major:minor, readability."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct
from collections.abc import Iterator

from crust.sys.run import run


def size_bytes(device: str) -> int:
    """Size of a block device in bytes, read without any tool."""
    fd = os.open(device, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def size_of(major: int, minor: int) -> int:
    """Size in bytes of the block device major:minor, from one sysfs read
    (in 512-byte sectors whatever the device's block size)."""
    with open(f"/sys/dev/block/{major}:{minor}/size") as f:
        return int(f.read()) * 512


def claimed(device: str) -> bool:
    """Is the block device held exclusively: a file system on it is mounted
    (in any mount namespace), or a tool such as mkfs holds it? One open with
    O_EXCL, released at once. False is certain (nothing mounts it anywhere);
    True says only that someone holds it."""
    try:
        fd = os.open(device, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            return True
        raise
    os.close(fd)
    return False


@contextlib.contextmanager
def held_exclusively(device: str) -> Iterator[int]:
    """The device open with O_EXCL for the block (its descriptor): nothing
    mounts it or holds it exclusively meanwhile. OSError EBUSY when someone
    holds it already."""
    fd = os.open(device, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


# BLKFLSBUF (linux/fs.h): write the device's dirty buffers back and drop its
# cached blocks, so the next read comes from what the device serves.
BLKFLSBUF = 0x1261


def drop_cached_blocks(fd: int) -> None:
    fcntl.ioctl(fd, BLKFLSBUF, 0)


# BLKROGET (linux/fs.h): is the device read-only? (Opening it for writing
# succeeds regardless on current kernels; only the writes fail.)
BLKROGET = 0x125E


def is_read_only(fd: int) -> bool:
    return struct.unpack("i", fcntl.ioctl(fd, BLKROGET, struct.pack("i", 0)))[0] != 0


def major_minor(device: str) -> tuple[int, int]:
    st = os.stat(device)
    if not stat.S_ISBLK(st.st_mode):
        raise ValueError(f"{device} is not a block device")
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def device_path(major: int, minor: int) -> str:
    """The /dev path of a block device, from sysfs (works without udev)."""
    try:
        with open(f"/sys/dev/block/{major}:{minor}/uevent") as f:
            for line in f:
                if line.startswith("DEVNAME="):
                    return "/dev/" + line.strip().split("=", 1)[1]
    except FileNotFoundError:
        pass
    raise FileNotFoundError(f"no block device {major}:{minor}")


def resolve(path: str) -> tuple[str, int, int]:
    """(device path, major, minor) of a block device node or a bind mount of one."""
    st = os.stat(path)
    if not stat.S_ISBLK(st.st_mode):
        raise ValueError(f"{path} is not a block device")
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    return device_path(major, minor), major, minor


def is_block_device(path: str) -> bool:
    try:
        return stat.S_ISBLK(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


def read_head(device: str, length: int = 64 * 1024) -> bytes:
    """Read the start of the device; raises OSError on an I/O error.

    Used before formatting: a device that cannot be read is never treated as
    blank.
    """
    fd = os.open(device, os.O_RDONLY)
    try:
        return os.pread(fd, length, 0)
    finally:
        os.close(fd)


async def flush(device: str) -> None:
    await run(["blockdev", "--flushbufs", device])
