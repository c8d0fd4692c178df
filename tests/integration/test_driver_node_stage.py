"""NodeStageVolume of `crust driver`, end to end: attach, format, mount.

A stage attaches one loop device, formats a volume only when it holds no
file system (thin where the file is empty, in full where it holds old bytes,
thick volumes kept allocated), mounts it, and refuses a second staging path
or another capability; concurrent stages are aborted or converge. mkfs.xfs
goes through the loop device's backing file, which is the device's only
where the path sysfs gives names the very file it reads.

Checked in the kernel and on disk: loop devices in /sys/block, mounts in
/proc/self/mountinfo, signatures from blkid, the node's JSON records.
Everything a test creates lives under the `root` fixture's temporary
directory, which cleans it up.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2
from crust.sys import blockdev as sysblock
from crust.sys import fs as sysfs
from crust.sys import loop as sysloop
from crust.sys.run import CommandError
from tests.harness.driver_node_calls import (
    SIZE,
    Code,
    assert_fs_mount_of,
    backing_file,
    fails,
    loop_devices,
    mounts_at,
    only_device,
    record,
    record_file,
    write_synced,
)
from tests.harness.daemons import MIB, AccessMode, blkid, block_cap, mount_cap, sha256_of
from tests.harness.loops import release_each

OTHER_FS = {"ext4": "xfs", "xfs": "ext4"}


# -- helpers ---------------------------------------------------------------------



def stage_req(volume_id, staging, cap=None, **kw) -> csi_pb2.NodeStageVolumeRequest:
    return csi_pb2.NodeStageVolumeRequest(volume_id=volume_id, staging_target_path=str(staging),
                                          volume_capability=cap if cap is not None else mount_cap(), **kw)


# -- NodeStageVolume -----------------------------------------------------------------------


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_stage_mount_attaches_formats_and_mounts(driver, root, fs_type):
    vid = driver.create(f"stage-{fs_type}", SIZE[fs_type], cap=mount_cap(fs_type)).volume_id
    staging = root.path / "staging"
    driver.stage(vid, staging, mount_cap(fs_type))

    device = only_device(driver, vid)
    assert sysloop._backing_file(os.path.basename(device)) == str(backing_file(driver, vid).resolve())
    assert sysblock.size_bytes(device) == SIZE[fs_type]
    assert blkid(device) == fs_type
    first = assert_fs_mount_of(staging, device, fs_type)
    rec = record(driver, vid)
    assert (rec["volume_id"], rec["staging_path"], rec["access_type"], rec["fs_type"]) == \
        (vid, str(staging), "mount", fs_type)
    assert rec["access_mode"] == AccessMode.SINGLE_NODE_WRITER and rec["published"] == {}

    # An identical repeat changes nothing: same device, same single mount.
    driver.stage(vid, staging, mount_cap(fs_type))
    assert only_device(driver, vid) == device
    assert [m.mount_id for m in mounts_at(staging)] == [first.mount_id]

    # Another staging path while staged here.
    other = root.path / "staging-2"
    fails(driver.node.NodeStageVolume, stage_req(vid, other, mount_cap(fs_type)),
          Code.FAILED_PRECONDITION, str(staging))
    assert not mounts_at(other)

    # Same staging path, different capability.
    for cap in (block_cap(), mount_cap(OTHER_FS[fs_type]), mount_cap(fs_type, flags=["noatime"])):
        fails(driver.node.NodeStageVolume, stage_req(vid, staging, cap), Code.ALREADY_EXISTS, "volume_capability")
    assert [m.mount_id for m in mounts_at(staging)] == [first.mount_id]
    assert only_device(driver, vid) == device
    assert record(driver, vid) == rec


def test_stage_never_reformats_an_existing_file_system(driver, root):
    vid = driver.create("keep", SIZE["ext4"], cap=mount_cap("ext4")).volume_id
    staging, target = root.path / "staging", root.path / "pods" / "a" / "mount"
    payload = os.urandom(64 * 1024)
    driver.stage(vid, staging, mount_cap("ext4"))
    driver.publish(vid, staging, target, mount_cap("ext4"))
    write_synced(target / "data.bin", payload)
    driver.unpublish(vid, target)
    driver.unstage(vid, staging)
    assert not loop_devices(driver, vid)
    backing = backing_file(driver, vid)
    digest = sha256_of(backing)

    # The volume holds ext4; asking for xfs must neither format nor leave anything behind.
    details = fails(driver.node.NodeStageVolume, stage_req(vid, staging, mount_cap("xfs")),
                    Code.FAILED_PRECONDITION, "ext4", "volume_capability.mount.fs_type")
    assert "xfs" in details
    assert sha256_of(backing) == digest
    assert blkid(backing) == "ext4"
    assert not mounts_at(staging)
    assert not record_file(driver, vid).exists()
    assert not loop_devices(driver, vid), "a failed NodeStageVolume left its loop device attached"

    # Staged again with the right type: the data written before is still there.
    driver.stage(vid, staging, mount_cap("ext4"))
    driver.publish(vid, staging, target, mount_cap("ext4"))
    assert (target / "data.bin").read_bytes() == payload


def fsck_clean(backing: Path) -> None:
    result = subprocess.run(["e2fsck", "-f", "-n", str(backing)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stage_formats_a_fresh_volume_thin_and_a_written_one_in_full(driver, root):
    """A volume whose backing file holds no data reads as zeros: mkfs leaves
    its inode tables and journal to those zeros and the file stays thin. A
    volume with data in it but no signature is formatted in full: its old
    bytes must not survive in the new file system's metadata."""
    size = 256 * MIB
    fresh = driver.create("thin", size, cap=mount_cap("ext4")).volume_id
    written = driver.create("dirty", size, cap=mount_cap("ext4")).volume_id
    with open(backing_file(driver, written), "r+b") as f:  # junk where inode tables go, no signature
        for offset in range(0, size, 8 * MIB):
            f.seek(offset + 4096 * 3)
            f.write(b"\xa5" * 65536)
        os.fsync(f.fileno())
    assert blkid(backing_file(driver, written)) == ""
    thin_before = backing_file(driver, fresh).stat().st_blocks * 512
    for vid in (fresh, written):
        staging = root.path / f"staging-{vid}"
        driver.stage(vid, staging, mount_cap("ext4"))
        write_synced(staging / "f", b"payload")
        driver.unstage(vid, staging)
        fsck_clean(backing_file(driver, vid))
    thin_after = backing_file(driver, fresh).stat().st_blocks * 512
    full_after = backing_file(driver, written).stat().st_blocks * 512
    # ext4's tables and journal for 256 MiB are about 16 MiB of zeros.
    assert thin_after - thin_before < 4 * MIB, thin_after
    assert full_after > 12 * MIB, full_after


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_stage_keeps_a_thick_volume_fully_allocated(driver, root, fs_type):
    """mkfs discards by default, which on a loop device punches holes in the
    backing file: the blocks a thick volume reserved must stay reserved
    after its first stage formats it."""
    vid = driver.create(f"thick-{fs_type}", SIZE[fs_type], cap=mount_cap(fs_type),
                        parameters={"provisioning": "thick"}).volume_id
    path = backing_file(driver, vid)
    assert path.stat().st_blocks * 512 >= SIZE[fs_type]
    staging = root.path / "staging"
    driver.stage(vid, staging, mount_cap(fs_type))
    assert blkid(only_device(driver, vid)) == fs_type
    assert path.stat().st_blocks * 512 >= SIZE[fs_type], "the format gave the thick volume's blocks back"
    driver.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(volume_id=vid, staging_target_path=str(staging)),
                                  timeout=60)


# -- mkfs through the loop device's backing file -------------------------------------------


async def test_xfs_is_made_through_the_backing_file_and_read_fresh_through_the_device(root):
    """mkfs.xfs scans the whole mount table when it is given a block device,
    so the driver has it format the loop device's backing file instead,
    holding the device exclusively meanwhile. Blocks the device had cached
    (a probe read them) are dropped: a read through the device sees the new
    file system. A device someone holds, or a read-only one, is not
    formatted through its file."""
    images = [root.path / "xfs-a.img", root.path / "xfs-b.img", root.path / "xfs-c.img"]
    devices = []
    try:
        for image in images:
            image.touch()
            os.truncate(image, 320 * MIB)
            devices.append(sysloop.attach_sync(image, read_only=image is images[2]))
        free, held, read_only = devices
        # A reader that keeps the device open (as udev's probe may) keeps its
        # cached blocks: a last close would drop them anyway.
        reader = os.open(free, os.O_RDONLY)
        try:
            assert os.pread(reader, 4096, 0) == bytes(4096)  # cached by the device now
            await sysfs.make(free, "xfs", image=str(images[0]))
            assert os.pread(reader, 4, 0) == b"XFSB"
        finally:
            os.close(reader)
        assert (await sysfs.probe(free)).fs_type == "xfs"

        holder = os.open(held, os.O_RDONLY | os.O_EXCL)  # as a mount would
        try:
            with pytest.raises(CommandError):
                await sysfs.make(held, "xfs", image=str(images[1]))  # mkfs.xfs on the device refuses it
        finally:
            os.close(holder)
        # Nor is a read-only device (its file is writable, its volume is not).
        with pytest.raises(CommandError):
            await sysfs.make(read_only, "xfs", image=str(images[2]))
        for untouched in images[1:]:
            fd = os.open(untouched, os.O_RDONLY)
            try:
                assert os.pread(fd, 4096, 0) == bytes(4096)
            finally:
                os.close(fd)
    finally:
        release_each(zip(devices, images))


def test_the_image_of_a_loop_device_is_its_file_only_where_the_path_names_that_file(root):
    """mkfs goes through a loop device's backing file only when the path
    sysfs gives names the very file the device reads, here, whole."""
    here, elsewhere = root.path / "here", root.path / "elsewhere"
    for directory in (here, elsewhere):
        directory.mkdir()
        with open(directory / "vol.img", "wb") as f:
            f.truncate(64 * MIB)
    devices = [sysloop.attach_sync(here / "vol.img")]
    covered = False
    try:
        devices.append(subprocess.run(["losetup", "--find", "--show", "--offset", "4096", str(here / "vol.img")],
                                      check=True, capture_output=True, text=True).stdout.strip())
        whole, offset = devices
        assert sysloop.image_of(whole) == str(here / "vol.img")
        assert sysloop.image_of(offset) is None  # not from its first byte
        assert sysloop.image_of("/dev/null") is None
        # The same path naming another file (as another mount namespace's
        # path may): the device's file system and inode tell them apart.
        subprocess.run(["mount", "--bind", str(elsewhere), str(here)], check=True)
        covered = True
        assert sysloop._backing_file(os.path.basename(whole)) == str(here / "vol.img")
        assert sysloop.image_of(whole) is None
    finally:
        try:
            if covered:
                subprocess.run(["umount", str(here)], check=True)
        finally:
            release_each((device, here / "vol.img") for device in devices)


def test_a_device_attached_through_another_path_still_serves_its_file(root):
    """sysfs names a backing file as the attaching process reached it: from a
    container restarted since, a path that no longer leads there. The
    device is still known as the file's by file system and inode, and only
    as that file's."""
    real, alias, other = root.path / "real", root.path / "alias", root.path / "other"
    for directory in (real, alias, other):
        directory.mkdir()
    for directory in (real, other):
        with open(directory / "vol.img", "wb") as f:
            f.truncate(16 * MIB)
    subprocess.run(["mount", "--bind", str(real), str(alias)], check=True)
    aliased = True
    device = sysloop.attach_sync(alias / "vol.img")
    try:
        # The device holds the file: the mount goes lazily, as a dead
        # container's mount namespace goes.
        subprocess.run(["umount", "--lazy", str(alias)], check=True)
        aliased = False
        assert sysloop._backing_file(os.path.basename(device)) not in (str(real / "vol.img"), None)
        assert sysloop.serves(device, real / "vol.img")
        assert sysloop.devices_for(real / "vol.img") == [device]
        assert not sysloop.serves(device, other / "vol.img")
        assert sysloop.devices_for(other / "vol.img") == []
    finally:
        try:
            if aliased:
                subprocess.run(["umount", str(alias)], check=True)
        finally:
            release_each([(device, real / "vol.img")])


# -- concurrency ---------------------------------------------------------------------------


def test_concurrent_stage_is_aborted_or_converges(driver, root):
    cap = mount_cap("xfs")
    vid = driver.create("race", SIZE["xfs"], cap=cap).volume_id
    staging = root.path / "staging"
    futures = [driver.node.NodeStageVolume.future(stage_req(vid, staging, cap), timeout=60) for _ in range(4)]
    outcomes = []
    for future in futures:
        try:
            future.result()
            outcomes.append(Code.OK)
        except grpc.RpcError as exc:
            outcomes.append(exc.code())
            assert exc.code() == Code.ABORTED, exc.details()
            assert vid in exc.details()
    assert Code.OK in outcomes, outcomes
    driver.stage(vid, staging, cap)  # what a CO's retry of the aborted calls does
    device = only_device(driver, vid)
    assert len(mounts_at(staging)) == 1
    assert_fs_mount_of(staging, device, "xfs")
    assert record(driver, vid)["staging_path"] == str(staging)
