"""Loop devices over backing files (the loop driver's ioctls and /sys/block/loopN).

Attach, detach and capacity changes are ioctls on /dev/loop-control and
/dev/loopN (what losetup does, without a child process and without
losetup's walk over every loop device for --nooverlap). Whether a given
device still serves a given file is one sysfs read (serves()), so a caller
that recorded the device at attach time verifies it in O(1). The walk over
every device (devices_for, attached) is kept for start-up reconciliation
and for callers that have no record to start from.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import struct
from pathlib import Path

from crust.sys import blockdev
from crust.sys.run import run

SYS_BLOCK = Path("/sys/block")


def _backing_file(dev_name: str) -> str | None:
    try:
        text = (SYS_BLOCK / dev_name / "loop" / "backing_file").read_text().strip()
    except (FileNotFoundError, NotADirectoryError, OSError):
        return None
    # The kernel appends " (deleted)" when the file was unlinked underneath.
    return text


def devices_for(backing_file: str | os.PathLike) -> list[str]:
    """Every loop device currently attached to backing_file (normally 0 or 1):
    named by this path in sysfs, or, for a device another mount namespace
    attached (sysfs shows its path, ending in the same file name), reading
    the same file by file system and inode."""
    wanted = os.path.realpath(backing_file)
    found = []
    for entry in SYS_BLOCK.glob("loop*"):
        shown = _backing_file(entry.name)
        if shown == wanted or (shown and os.path.basename(shown) == os.path.basename(wanted)
                               and _reads(f"/dev/{entry.name}", wanted)):
            found.append(f"/dev/{entry.name}")
    return sorted(found)


def attached() -> dict[str, str]:
    """Map of /dev/loopN -> backing file for every attached loop device."""
    result = {}
    for entry in SYS_BLOCK.glob("loop*"):
        backing = _backing_file(entry.name)
        if backing:
            result[f"/dev/{entry.name}"] = backing
    return result


def read_only(device: str) -> bool:
    """Is the loop device read-only (attached with --read-only)?"""
    try:
        return (SYS_BLOCK / os.path.basename(device) / "ro").read_text().strip() == "1"
    except OSError:
        return False


def serves(device: str, backing_file: str | os.PathLike) -> bool:
    """Is `device` (/dev/loopN) attached to backing_file right now? One sysfs
    read when sysfs names the file by this path. sysfs names it as the
    process that attached it reached it (in a container restarted since, a
    path in a mount namespace that is gone): when the path differs, the
    device's file system and inode (LOOP_GET_STATUS64) decide."""
    name = os.path.basename(device)
    if not name.startswith("loop"):
        return False
    shown = _backing_file(name)
    if shown is None:
        return False
    if shown == os.path.realpath(backing_file):
        return True
    return _reads(device, backing_file)


def _reads(device: str, backing_file: str | os.PathLike) -> bool:
    """Does the loop device read this very file (the same file system and
    inode), whatever path sysfs shows for it?"""
    identity = _identity(device)
    try:
        st = os.stat(backing_file)
    except OSError:
        return False
    return identity is not None and identity[:3] == (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)


def _identity(device: str) -> tuple[int, int, int, int, int] | None:
    """(file system major, minor, inode, offset, size limit) of the file a
    loop device reads, from LOOP_GET_STATUS64; None when it is no attached
    loop device."""
    try:
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
        try:
            info = fcntl.ioctl(fd, _LOOP_GET_STATUS64, bytes(_LOOP_INFO64.size))
        finally:
            os.close(fd)
    except OSError:
        return None
    lo_device, lo_inode, _, lo_offset, lo_sizelimit = _LOOP_INFO64.unpack(info)[:5]
    # lo_device is the kernel's encoding of a dev_t (new_encode_dev).
    major, minor = (lo_device & 0xFFF00) >> 8, (lo_device & 0xFF) | ((lo_device >> 12) & 0xFFF00)
    return major, minor, lo_inode, lo_offset, lo_sizelimit



def reads_as_zeros(device: str) -> bool:
    """Does every block of this loop device read as zeros? True when its
    backing file holds no data at all (only holes, or blocks reserved and
    never written), which one lseek(SEEK_DATA) tells, after the device's own
    cache is written back to that file (BLKFLSBUF) so nothing written
    through the device is missed. False for any other device, a device
    that starts at an offset into its file, a backing file this process
    cannot reach, and any doubt."""
    name = os.path.basename(device)
    try:
        if not name.startswith("loop") or int((SYS_BLOCK / name / "loop" / "offset").read_text()) != 0:
            return False
        backing = _backing_file(name)
        if not backing or backing.endswith(" (deleted)"):
            return False
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
        try:
            blockdev.drop_cached_blocks(fd)
        finally:
            os.close(fd)
        fd = os.open(backing, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except (OSError, ValueError):
        return False
    try:
        os.lseek(fd, 0, os.SEEK_DATA)
        return False  # some data (maybe zeros, but nobody reads it to know)
    except OSError as exc:
        return exc.errno == errno.ENXIO  # no data from the start to the end
    finally:
        os.close(fd)


# ioctl numbers and flags of the loop driver (linux/loop.h).
_LOOP_CLR_FD = 0x4C01
_LOOP_SET_CAPACITY = 0x4C07
_LOOP_CONFIGURE = 0x4C0A
_LOOP_CTL_GET_FREE = 0x4C82
_LO_FLAGS_READ_ONLY = 1
_LO_FLAGS_DIRECT_IO = 16
_LOOP_MAJOR = 7
_NAME_SIZE = 64
# struct loop_config: fd, block_size, struct loop_info64 (lo_device, lo_inode,
# lo_rdevice, lo_offset, lo_sizelimit, lo_number, lo_encrypt_type,
# lo_encrypt_key_size, lo_flags, lo_file_name[64], lo_crypt_name[64],
# lo_encrypt_key[32], lo_init[2]), __reserved[8].
_LOOP_CONFIG = struct.Struct("=II QQQQQ IIII 64s 64s 32s 2Q 8Q")
_LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64 = struct.Struct("=QQQQQ IIII 64s 64s 32s 2Q")


def image_of(device: str) -> str | None:
    """The file this loop device shows whole, from its first byte, by the
    path this process reaches it at: its backing file, when that path names
    the very file the device reads (the same file system and inode, from
    LOOP_GET_STATUS64) and the device has no offset and no size limit. None
    for anything else: not a loop device, a path that names another file
    here (another mount namespace attached it), a partial view, any doubt."""
    name = os.path.basename(device)
    backing = _backing_file(name) if name.startswith("loop") else None
    if not backing or backing.endswith(" (deleted)"):
        return None
    identity = _identity(device)
    try:
        st = os.stat(backing)
    except OSError:
        return None
    if identity != (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino, 0, 0):
        return None
    return backing


def _device_node(number: int) -> str:
    """/dev/loopN, made when /dev does not get it by itself (a /dev that is
    not devtmpfs, as in some containers)."""
    path = f"/dev/loop{number}"
    try:
        os.mknod(path, 0o660 | stat.S_IFBLK, os.makedev(_LOOP_MAJOR, number))
    except FileExistsError:
        pass
    return path


def attach_sync(backing_file: str | os.PathLike, *, direct_io: bool = False, read_only: bool = False) -> str:
    """Attach backing_file to a free loop device and return its path.

    A free device is asked of /dev/loop-control; another process may take
    it first (EBUSY), then the next free one is asked for."""
    path = os.path.realpath(backing_file)
    flags = (_LO_FLAGS_READ_ONLY if read_only else 0) | (_LO_FLAGS_DIRECT_IO if direct_io else 0)
    backing = os.open(path, (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC)
    try:
        control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(64):
                number = fcntl.ioctl(control, _LOOP_CTL_GET_FREE)
                device = _device_node(number)
                fd = os.open(device, (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC)
                try:
                    config = _LOOP_CONFIG.pack(backing, 0, 0, 0, 0, 0, 0, 0, 0, 0, flags,
                                               path.encode()[:_NAME_SIZE - 1], b"", b"", 0, 0, *([0] * 8))
                    fcntl.ioctl(fd, _LOOP_CONFIGURE, config)
                    return device
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise OSError(exc.errno, f"attach {path} to {device}: {exc.strerror}") from None
                finally:
                    os.close(fd)
            raise OSError(errno.EBUSY, f"attach {path}: every free loop device was taken by others meanwhile")
        finally:
            os.close(control)
    finally:
        os.close(backing)  # the loop device holds its own reference


async def attach(backing_file: str | os.PathLike, *, direct_io: bool = False, read_only: bool = False) -> str:
    """attach_sync for the daemons (a few syscalls: done in place).

    read_only attaches a read-only device, also beside a writable one of
    the same file (read-only raw block publishes)."""
    return attach_sync(backing_file, direct_io=direct_io, read_only=read_only)


def _device_ioctl(device: str, request: int, what: str) -> None:
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, request, 0)
    except OSError as exc:
        raise OSError(exc.errno, f"{what} {device}: {exc.strerror}") from None
    finally:
        os.close(fd)


async def refresh_capacity(device: str) -> None:
    """Make the loop device pick up the new size of its grown backing file."""
    _device_ioctl(device, _LOOP_SET_CAPACITY, "set capacity of")


def detach_sync(device: str) -> None:
    """Detach a loop device. A device still open elsewhere (mounted, or held
    by a process) is detached by the kernel when its last user lets go."""
    try:
        _device_ioctl(device, _LOOP_CLR_FD, "detach")
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # not attached (any more): nothing to do
            raise


async def detach(device: str) -> None:
    detach_sync(device)


async def list_json() -> list[dict]:
    result = await run(["losetup", "--json", "--list"])
    if not result.stdout.strip():
        return []
    return json.loads(result.stdout).get("loopdevices", [])
