"""File system steps shared by the driver's and the shim's node services:
format a blank device (and nothing else), make a file system fill its
device, grow a mounted one, and measure one."""

from __future__ import annotations

import logging
import os

from crust.api import csi_pb2
from crust.common.errors import FailedPrecondition, Internal, ResourceExhausted
from crust.sys import blockdev, fs, loop
from crust.sys.run import CommandError

log = logging.getLogger(__name__)

Usage = csi_pb2.VolumeUsage


async def format_if_blank(device: str, fs_type: str, volume_id: str, *, zeroed: bool = False,
                          image: str | None = None) -> bool:
    """mkfs only a device known to be blank; True if formatted. zeroed: the
    caller knows every block reads as zeros (see fs.make), so no signature
    can be on it and blkid is not asked; otherwise blkid must positively
    report it blank. image: the file the device shows (see fs.make); when
    every block of it is reserved (a thick volume), the format keeps them."""
    if zeroed:
        probe = fs.Probe(fs.ProbeState.BLANK)
    else:
        try:
            probe = await fs.probe(device)
        except (OSError, CommandError) as exc:
            # Any doubt about the content means no mkfs: data is never risked.
            raise Internal(f"cannot tell whether volume {volume_id} is blank, refusing to format it: {exc}")
    if probe.state is fs.ProbeState.BLANK:
        log.info("formatting blank volume", extra={"fields": {"fs_type": fs_type, "device": device}})
        await fs.make(device, fs_type, zeroed=zeroed, image=image,
                      keep_blocks=image is not None and fs.fully_allocated(image))
        return True
    if probe.fs_type != fs_type:
        raise FailedPrecondition(
            f"volume {volume_id} holds a {probe.fs_type} file system; volume_capability.mount.fs_type asks for {fs_type}")
    return False


async def fill_device_offline(fs_type: str, device: str) -> None:
    """Before mounting: grow an ext4 file system that is smaller than its
    device (the device was expanded, or a snapshot restored into a larger
    volume). xfs can only grow mounted: see grow_online."""
    if fs_type == "ext4":
        grown_by = blockdev.size_bytes(device) - await fs.block_count_bytes("ext4", device)
        if grown_by > 0:
            check_room_to_grow(device, grown_by)
            await fs.grow_offline("ext4", device)


# What an ext4 grow writes into the new part of its device, at most: the new
# block groups' bitmaps, inode tables and group descriptors, an eighth of the
# growth with the default inode ratio, and a margin for the journal's traffic.
GROWTH_WRITES_FRACTION = 8
GROWTH_MARGIN_BYTES = 4 * 1024 * 1024


def check_room_to_grow(device: str, grown_by: int) -> None:
    """Before a file system grows into a sparse loop image: the backing
    file system must have room for what the grow writes there. Without it
    the writes fail inside the device (I/O errors that leave the file system
    needing a check), not as a refused call; so the call is refused first,
    with nothing written, and succeeds when retried with room. A device that
    is not a loop image crust can see, or a fully allocated image, has its
    blocks already: nothing to check."""
    image = loop.image_of(device)
    if image is None or fs.fully_allocated(image):
        return
    directory = os.path.dirname(image)
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    needed = grown_by // GROWTH_WRITES_FRACTION + GROWTH_MARGIN_BYTES
    if free < needed:
        raise ResourceExhausted(
            f"growing the file system by {grown_by} bytes writes up to {needed} bytes into its image in "
            f"{directory}, which has {free} bytes free; nothing was changed; retry once there is room")


def mount_options(fs_type: str, flags: list[str]) -> list[str]:
    # xfs refuses a second file system with the same UUID, which is exactly
    # what a clone or a restored snapshot is.
    return flags + (["nouuid"] if fs_type == "xfs" and "nouuid" not in flags else [])


async def grow_online(fs_type: str, device: str, mount_point: str | int) -> None:
    """Grow a mounted file system to its device; FAILED_PRECONDITION where
    this host kernel refuses (online ext4 on some kernels). mount_point:
    the mount's path, or a descriptor of it (crust.common.copath)."""
    if fs_type == "xfs":
        await fs.grow_mounted("xfs", device, mount_point)
    elif fs_type == "ext4":
        if await fs.block_count_bytes("ext4", device) < blockdev.size_bytes(device):
            try:
                await fs.grow_mounted("ext4", device, mount_point)
            except CommandError as exc:
                # Seen here: the resize ioctl answers EPERM (the kernel, or a
                # missing CAP_SYS_RESOURCE in a container, refuses it). The
                # file system is untouched; it grows offline at the next stage.
                raise FailedPrecondition(
                    f"online growth of the mounted ext4 file system was refused on this host ({exc.stderr}); "
                    "it grows to the new size at the next NodeStageVolume (unpublish and unstage the volume)")
    else:
        raise FailedPrecondition(f"cannot grow a {fs_type} file system")


def stats(path: str | int, *, went_readonly: bool) -> csi_pb2.NodeGetVolumeStatsResponse:
    """Usage of the file system at a path, or at an open descriptor (how the
    node services measure a CO path, see crust.common.copath)."""
    u = fs.usage(path)
    condition = csi_pb2.VolumeCondition(abnormal=False, message="healthy")
    if went_readonly:
        condition = csi_pb2.VolumeCondition(
            abnormal=True, message="the file system went read-only (errors detected by the kernel)")
    return csi_pb2.NodeGetVolumeStatsResponse(
        usage=[
            Usage(unit=Usage.BYTES, total=u.total_bytes, available=u.available_bytes, used=u.used_bytes),
            Usage(unit=Usage.INODES, total=u.total_inodes, available=u.free_inodes, used=u.used_inodes),
        ],
        volume_condition=condition,
    )
