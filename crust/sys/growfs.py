"""Grow a mounted file system through a descriptor of its root.

xfs_growfs and resize2fs find the file system by a path in the caller's
mount table. A container's volume is mounted only in the container's mount
namespace, whose root is the container's image (no xfs_growfs there), so
the handler grows it the way those tools do in the end: one ioctl on a
descriptor of the mounted file system, reached through /proc/PID/root from
the host. The new size is the block device's size, in file system blocks.

- xfs: XFS_IOC_FSGEOMETRY_V1 for the block size and imaxpct, then
  XFS_IOC_FSGROWFSDATA with the new data block count (xfs_growfs -d).
- ext4: EXT4_IOC_RESIZE_FS with the new block count (resize2fs's on-line
  path). The kernel does it only for a caller with CAP_SYS_RESOURCE
  (EPERM otherwise, which is what resize2fs meets on hosts whose root lacks
  that capability).
"""

from __future__ import annotations

import fcntl
import os
import struct

from crust.sys import caps

# _IOR('X', 100, struct xfs_fsop_geom_v1): 112 bytes.
XFS_IOC_FSGEOMETRY_V1 = 0x80705864
# _IOW('X', 110, struct xfs_growfs_data): newblocks (u64), imaxpct (u32), padded to 16.
XFS_IOC_FSGROWFSDATA = 0x4010586E
# _IOW('f', 16, __u64)
EXT4_IOC_RESIZE_FS = 0x40086610
XFS_GEOMETRY_V1 = struct.Struct("=8I3QQ16s7I4x")


class GrowError(Exception):
    pass


def xfs_geometry(fd: int) -> tuple[int, int, int]:
    """(block size, data blocks, imaxpct) of the xfs file system of fd."""
    buffer = bytearray(XFS_GEOMETRY_V1.size)
    fcntl.ioctl(fd, XFS_IOC_FSGEOMETRY_V1, buffer)
    fields = XFS_GEOMETRY_V1.unpack(bytes(buffer))
    blocksize, imaxpct, datablocks = fields[0], fields[7], fields[8]
    return blocksize, datablocks, imaxpct


def grow_xfs(fd: int, device_bytes: int) -> int:
    """Grow the data section to fill device_bytes; returns the new block count."""
    blocksize, datablocks, imaxpct = xfs_geometry(fd)
    wanted = device_bytes // blocksize
    if wanted <= datablocks:
        return datablocks
    try:
        fcntl.ioctl(fd, XFS_IOC_FSGROWFSDATA, struct.pack("=QI4x", wanted, imaxpct))
    except OSError as exc:
        raise GrowError(f"XFS_IOC_FSGROWFSDATA to {wanted} blocks: {exc.strerror}") from None
    return xfs_geometry(fd)[1]


def grow_ext4(fd: int, device_bytes: int) -> int:
    """Ask the kernel to grow a mounted ext4 to fill device_bytes; returns
    the block count the file system reports afterwards."""
    st = os.fstatvfs(fd)
    wanted = device_bytes // st.f_frsize
    if wanted <= st.f_blocks:
        return st.f_blocks
    try:
        fcntl.ioctl(fd, EXT4_IOC_RESIZE_FS, struct.pack("=Q", wanted))
    except OSError as exc:
        why = "" if caps.effective(caps.CAP_SYS_RESOURCE) else \
            " (the kernel resizes a mounted ext4 only for a process with CAP_SYS_RESOURCE, which this one lacks)"
        raise GrowError(f"EXT4_IOC_RESIZE_FS to {wanted} blocks: {exc.strerror}{why}") from None
    return os.fstatvfs(fd).f_blocks


def grow(fd: int, fs_type: str, device_bytes: int) -> int:
    if fs_type == "xfs":
        return grow_xfs(fd, device_bytes)
    if fs_type == "ext4":
        return grow_ext4(fd, device_bytes)
    raise GrowError(f"cannot grow a mounted {fs_type}")
