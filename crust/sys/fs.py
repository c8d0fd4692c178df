"""Filesystems on block devices: probe, create, check and grow.

Formatting is the one operation that can destroy a user's data, so probe()
answers "blank" only when blkid positively reports no signature on a device
that reads without error. Every other outcome means "do not format".
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import os
import struct
from dataclasses import dataclass

from crust.sys import blockdev
from crust.sys.run import CommandError, run

SUPPORTED = ("ext4", "xfs")

# Smallest device each mkfs accepts (xfsprogs refuses filesystems under 300 MiB).
MIN_SIZE = {"ext4": 8 * 1024 * 1024, "xfs": 300 * 1024 * 1024}


class ProbeState(enum.Enum):
    BLANK = "blank"
    FORMATTED = "formatted"


@dataclass(frozen=True)
class Probe:
    state: ProbeState
    fs_type: str = ""  # set when FORMATTED: the signature blkid found (ext4, xfs, ...)


async def probe(device: str) -> Probe:
    """Tell a blank device from a formatted one; raise on any doubt.

    blkid -p does a low-level probe without its cache: exit 0 prints the
    signature, exit 2 with nothing printed means nothing was found. Anything
    else (I/O error, exit 8 for an ambivalent result: two signatures) raises,
    and the caller must not format. The microVM guest keeps the same rule
    before it formats an encrypted volume (crust.guest.luks calls this).
    """
    blockdev.read_head(device)  # OSError here: unreadable, never "blank"
    result = await run(
        ["blkid", "-p", "-o", "export", "--", device], check=False
    )
    if result.returncode == 2 and not result.stdout.strip():
        return Probe(ProbeState.BLANK)
    if result.returncode != 0:
        raise CommandError(result.argv, result.returncode, result.stderr or result.stdout)
    fields = dict(
        line.split("=", 1) for line in result.stdout.splitlines() if "=" in line
    )
    kind = fields.get("TYPE") or fields.get("PTTYPE") or fields.get("USAGE") or "unknown"
    return Probe(ProbeState.FORMATTED, kind)


async def make(device: str, fs_type: str, *, zeroed: bool = False, image: str | None = None,
               keep_blocks: bool = False) -> None:
    """Make a file system. zeroed: the caller knows every block of the
    device reads as zeros (a backing file with no data in it). image: the
    file the device shows from its first byte (a loop device's backing file
    at offset 0), which xfs is made through (see _make_xfs_through).
    keep_blocks: no discard, which on a loop device would punch holes in a
    backing file whose blocks were reserved on purpose (thick volumes)."""
    if fs_type == "ext4":
        # No lazy init: the volume is complete when mkfs returns, so a host
        # crash right after cannot leave half-initialised inode tables. On a
        # device known to read as zeros the tables and the journal are
        # complete already: writing zeros over zeros would only fill a thin
        # backing file (48 MiB per GiB) and the host's page cache.
        extended = "lazy_itable_init=0,lazy_journal_init=0"
        if zeroed and await _mke2fs_knows_prezeroed():
            extended += ",assume_storage_prezeroed=1"
        if keep_blocks:
            extended += ",nodiscard"
        await run(["mkfs.ext4", "-q", "-F", "-E", extended, "--", device])
    elif fs_type == "xfs":
        if image is None or not await _make_xfs_through(image, device):
            await run(["mkfs.xfs", "-q", *(["-K"] if keep_blocks else []), "--", device])
    else:
        raise ValueError(f"unsupported filesystem {fs_type!r}")


async def _make_xfs_through(image: str, device: str) -> bool:
    """mkfs.xfs on the file the device shows; False (nothing done) when the
    device is held by someone, is read-only or does not show the whole file.

    Given a block device, mkfs.xfs refuses a mounted one by stat-ing every
    mount point in /proc/mounts, on every first stage: the more mounts a
    node has, the slower. Given a file it has no device to look for. The
    exclusive open held meanwhile is that same check, and more: nothing can
    mount the device until the file system is complete.
    """
    with contextlib.ExitStack() as held:
        try:
            fd = held.enter_context(blockdev.held_exclusively(device))
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            return False  # held: mkfs.xfs on the device refuses it in its own words
        if blockdev.is_read_only(fd):
            # Its file must not be written behind its back: mkfs.xfs on the
            # device fails as it always did.
            return False
        if os.lseek(fd, 0, os.SEEK_END) != os.stat(image).st_size:
            # Not all of the file (an offset, or a capacity not refreshed
            # yet): format what the device shows.
            return False
        # Before: what was written through the device reaches the file first
        # (not over mkfs's blocks later). After: the device's cached blocks
        # give way to what mkfs wrote.
        blockdev.drop_cached_blocks(fd)
        await run(["mkfs.xfs", "-q", "--", image])
        blockdev.drop_cached_blocks(fd)
        return True


def fully_allocated(path: str) -> bool:
    """Every block of the file reserved; False when it cannot be told."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_size > 0 and st.st_blocks * 512 >= st.st_size


_prezeroed_known: bool | None = None


async def _mke2fs_knows_prezeroed() -> bool:
    """Does this mke2fs take -E assume_storage_prezeroed (e2fsprogs 1.47)?"""
    global _prezeroed_known
    if _prezeroed_known is None:
        result = await run(["mke2fs", "-V"], check=False)
        version = (result.stderr + result.stdout).split()[1:2]
        try:
            major, minor = (int(x) for x in version[0].split(".")[:2])
            _prezeroed_known = (major, minor) >= (1, 47)
        except (IndexError, ValueError):
            _prezeroed_known = False
    return _prezeroed_known


@dataclass(frozen=True)
class Usage:
    total_bytes: int
    available_bytes: int
    used_bytes: int
    total_inodes: int
    free_inodes: int
    used_inodes: int


def usage(path: str | int) -> Usage:
    """statvfs of a path or an open descriptor (O_PATH descriptors work)."""
    st = os.statvfs(path)
    total = st.f_blocks * st.f_frsize
    avail = st.f_bavail * st.f_frsize
    free = st.f_bfree * st.f_frsize
    return Usage(
        total_bytes=total,
        available_bytes=avail,
        used_bytes=total - free,
        total_inodes=st.f_files,
        free_inodes=st.f_ffree,
        used_inodes=st.f_files - st.f_ffree,
    )


# XFS_IOC_FSGEOMETRY_V1 and XFS_IOC_FSGROWFSDATA (xfs_fs.h): the two ioctls
# xfs_growfs makes. struct xfs_fsop_geom_v1 is 112 bytes: blocksize, ...,
# imaxpct (eight u32), then datablocks (u64); struct xfs_growfs_data is
# newblocks (u64), imaxpct (u32).
_XFS_IOC_FSGEOMETRY_V1 = 0x80705864
_XFS_IOC_FSGROWFSDATA = 0x4010586E
_XFS_GEOMETRY = struct.Struct("=8I Q")


def grow_xfs(mounted_fd: int, device: str) -> bool:
    """Grow the xfs file system open at mounted_fd (any descriptor inside
    it, O_PATH too) to fill its device; False when it already does.

    The ioctls themselves rather than xfs_growfs, which would cost a child
    process and a read of the whole mount table to find the mount point
    again."""
    fd = os.open(f"/proc/self/fd/{mounted_fd}", os.O_RDONLY | os.O_CLOEXEC)  # the same file, readable
    try:
        geometry = bytearray(112)
        fcntl.ioctl(fd, _XFS_IOC_FSGEOMETRY_V1, geometry)
        fields = _XFS_GEOMETRY.unpack_from(geometry)
        block_size, imaxpct, data_blocks = fields[0], fields[7], fields[8]
        wanted = blockdev.size_bytes(device) // block_size
        if wanted <= data_blocks:
            return False  # never shrink: xfs cannot, and the device did not grow
        try:
            fcntl.ioctl(fd, _XFS_IOC_FSGROWFSDATA, struct.pack("=QI4x", wanted, imaxpct))
        except OSError as exc:
            raise OSError(exc.errno, f"growing the xfs file system on {device} to {wanted} blocks: "
                                     f"{exc.strerror}") from None
        return True
    finally:
        os.close(fd)


async def grow_mounted(fs_type: str, device: str, mount_point: str | int) -> None:
    """Grow a mounted filesystem to fill its (already grown) device.
    mount_point: a path, or (xfs) an open descriptor inside the mount."""
    if fs_type == "xfs":
        if isinstance(mount_point, int):
            grow_xfs(mount_point, device)
        else:
            await run(["xfs_growfs", "--", mount_point])
    elif fs_type == "ext4":
        await run(["resize2fs", "--", device])
    else:
        raise ValueError(f"cannot grow {fs_type!r}")


async def grow_offline(fs_type: str, device: str) -> None:
    """Grow an unmounted filesystem (ext4 only; xfs can only grow mounted)."""
    if fs_type != "ext4":
        raise ValueError(f"offline grow of {fs_type!r} is not possible")
    # resize2fs insists on a fresh check before an offline resize.
    await run(["e2fsck", "-f", "-p", "--", device], ok_codes=(0, 1))
    await run(["resize2fs", "--", device])


# The ext4 super block: 1024 bytes into the device; the fields read here
# (little-endian) and the feature bit that makes the block count 64-bit.
_EXT4_SUPER = 1024
_EXT4_MAGIC = 0xEF53


async def block_count_bytes(fs_type: str, device: str) -> int:
    """Size of the filesystem on an (unmounted or mounted) ext4 device, from
    its super block as on disk (what dumpe2fs -h reports), read in place."""
    if fs_type != "ext4":
        raise ValueError("superblock size read only for ext4")
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        sb = os.pread(fd, 1024, _EXT4_SUPER)
    finally:
        os.close(fd)
    if len(sb) < 1024 or struct.unpack_from("<H", sb, 0x38)[0] != _EXT4_MAGIC:
        raise ValueError(f"{device} holds no ext4 super block")
    count = struct.unpack_from("<I", sb, 0x04)[0]  # s_blocks_count_lo
    if struct.unpack_from("<I", sb, 0x60)[0] & 0x80:  # s_feature_incompat: 64bit
        count |= struct.unpack_from("<I", sb, 0x150)[0] << 32  # s_blocks_count_hi
    return count * (1024 << struct.unpack_from("<I", sb, 0x18)[0])  # s_log_block_size
