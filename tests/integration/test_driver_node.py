"""The Node service of `crust driver`, end to end.

Every test talks to a real driver process over its unix socket and checks
what the kernel and the disk say afterwards: loop devices in /sys/block,
mounts in /proc/self/mountinfo, signatures from blkid, bytes in the volume's
backing file, and the node's JSON records. Everything a test creates lives
under the `root` fixture's temporary directory, which cleans it up.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2
from crust.sys import blockdev as sysblock
from crust.sys import fs as sysfs
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from crust.sys.run import CommandError
from tests.harness import GIB, MIB, AccessMode, block_cap, loops_left, mount_cap

Code = grpc.StatusCode
Usage = csi_pb2.VolumeUsage
RPC = csi_pb2.NodeServiceCapability.RPC

# Smallest volumes the controller makes for each file system (xfs needs 300 MiB).
SIZE = {"ext4": 32 * MIB, "xfs": 300 * MIB, "block": 16 * MIB}
OTHER_FS = {"ext4": "xfs", "xfs": "ext4"}


# -- helpers ---------------------------------------------------------------------


def backing_file(driver, volume_id: str) -> Path:
    return driver.data_dir / "pools" / driver.node_id / "volumes" / f"{volume_id}.img"


def record_file(driver, volume_id: str) -> Path:
    return driver.data_dir / "node" / driver.node_id / "volumes" / f"{volume_id}.json"


def record(driver, volume_id: str) -> dict:
    return json.loads(record_file(driver, volume_id).read_text())


def loop_devices(driver, volume_id: str) -> list[str]:
    """Every loop device the kernel has attached to the volume's backing file."""
    return sysloop.devices_for(backing_file(driver, volume_id))


def only_device(driver, volume_id: str) -> str:
    devices = loop_devices(driver, volume_id)
    assert len(devices) == 1, f"expected exactly one loop device for {volume_id}, got {devices}"
    return devices[0]


def majmin(device: str) -> tuple[int, int]:
    st = os.stat(device)
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def mounts_at(path: Path) -> list[sysmount.MountEntry]:
    return [m for m in sysmount.mounts() if m.mount_point == str(path)]


def mounts_under(path: Path) -> list[sysmount.MountEntry]:
    prefix = str(path.resolve()) + "/"
    return [m for m in sysmount.mounts() if (m.mount_point + "/").startswith(prefix)]


def blkid_type(path: str | Path) -> str:
    out = subprocess.run(["blkid", "-p", "-o", "value", "-s", "TYPE", "--", str(path)],
                         capture_output=True, text=True)
    return out.stdout.strip()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fs_total(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def assert_fs_mount_of(path: Path, device: str, fs_type: str) -> sysmount.MountEntry:
    entry = sysmount.at(str(path))
    assert entry is not None, f"nothing mounted at {path}"
    assert (entry.major, entry.minor) == majmin(device), (entry, device)
    assert entry.fs_type == fs_type
    return entry


def assert_block_bind_of(path: Path, driver, volume_id: str) -> str:
    """The target is a bind mount of the node of a loop device over the volume; returns that device."""
    entry = sysmount.at(str(path))
    assert entry is not None, f"nothing mounted at {path}"
    assert entry.fs_type == "devtmpfs"
    device = "/dev" + entry.root
    assert device in loop_devices(driver, volume_id), (entry, loop_devices(driver, volume_id))
    assert sysblock.is_block_device(str(path))
    assert os.stat(path).st_rdev == os.stat(device).st_rdev
    return device


def fails(call, request, code: grpc.StatusCode, *fragments: str) -> str:
    """Make a call that must fail with `code`; the message must contain every fragment."""
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=60)
    err = info.value
    assert err.code() == code, f"expected {code}, got {err.code()}: {err.details()}"
    for fragment in fragments:
        assert fragment in err.details(), f"{fragment!r} not in {err.details()!r}"
    return err.details()


def stage_req(volume_id, staging, cap=None, **kw) -> csi_pb2.NodeStageVolumeRequest:
    return csi_pb2.NodeStageVolumeRequest(volume_id=volume_id, staging_target_path=str(staging),
                                          volume_capability=cap if cap is not None else mount_cap(), **kw)


def publish_req(volume_id, staging, target, cap=None, readonly=False) -> csi_pb2.NodePublishVolumeRequest:
    return csi_pb2.NodePublishVolumeRequest(volume_id=volume_id, staging_target_path=str(staging),
                                            target_path=str(target), readonly=readonly,
                                            volume_capability=cap if cap is not None else mount_cap())


def stats(driver, volume_id, path) -> csi_pb2.NodeGetVolumeStatsResponse:
    return driver.node.NodeGetVolumeStats(
        csi_pb2.NodeGetVolumeStatsRequest(volume_id=volume_id, volume_path=str(path)), timeout=60)


def stats_req(volume_id, path) -> csi_pb2.NodeGetVolumeStatsRequest:
    return csi_pb2.NodeGetVolumeStatsRequest(volume_id=volume_id, volume_path=str(path))


def expand_req(volume_id, path, required=0, cap=None) -> csi_pb2.NodeExpandVolumeRequest:
    kw = {"capacity_range": csi_pb2.CapacityRange(required_bytes=required)} if required else {}
    return csi_pb2.NodeExpandVolumeRequest(volume_id=volume_id, volume_path=str(path), **kw,
                                           volume_capability=cap if cap is not None else mount_cap())


def controller_expand(driver, volume_id, size) -> None:
    resp = driver.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
        volume_id=volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=size)), timeout=60)
    assert resp.capacity_bytes == size and resp.node_expansion_required
    assert os.path.getsize(backing_file(driver, volume_id)) == size


def unknown_id() -> str:
    return "vol-" + "0" * 24  # well formed, never created


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def assert_write_refused(path: Path, *, block: bool = False) -> None:
    """Writing through a read-only publish fails with EROFS (or EPERM/EACCES from a read-only device)."""
    allowed = {errno.EROFS, errno.EPERM, errno.EACCES} if block else {errno.EROFS}
    fd = -1
    try:
        if block:
            fd = os.open(path, os.O_RDWR)
            os.pwrite(fd, b"W" * 4096, 0)
            os.fsync(fd)
        else:
            write_synced(path / "must-not-exist", b"x")
    except OSError as exc:
        assert exc.errno in allowed, f"unexpected error {exc!r}"
    else:
        raise AssertionError(f"a write through the read-only publish at {path} succeeded")
    finally:
        if fd >= 0:
            os.close(fd)


# -- NodeStageVolume -----------------------------------------------------------------


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_stage_mount_attaches_formats_and_mounts(driver, root, fs_type):
    vid = driver.create(f"stage-{fs_type}", SIZE[fs_type], cap=mount_cap(fs_type)).volume_id
    staging = root.path / "staging"
    driver.stage(vid, staging, mount_cap(fs_type))

    device = only_device(driver, vid)
    assert sysloop._backing_file(os.path.basename(device)) == str(backing_file(driver, vid).resolve())
    assert sysblock.size_bytes(device) == SIZE[fs_type]
    assert blkid_type(device) == fs_type
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
    digest = sha256(backing)

    # The volume holds ext4; asking for xfs must neither format nor leave anything behind.
    details = fails(driver.node.NodeStageVolume, stage_req(vid, staging, mount_cap("xfs")),
                    Code.FAILED_PRECONDITION, "ext4", "volume_capability.mount.fs_type")
    assert "xfs" in details
    assert sha256(backing) == digest
    assert blkid_type(backing) == "ext4"
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
    assert blkid_type(backing_file(driver, written)) == ""
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
        for device in devices:
            sysloop.detach_sync(device)


def test_the_image_of_a_loop_device_is_its_file_only_where_the_path_names_that_file(root):
    """mkfs goes through a loop device's backing file only when the path
    sysfs gives names the very file the device reads, here, whole."""
    here, elsewhere = root.path / "here", root.path / "elsewhere"
    for directory in (here, elsewhere):
        directory.mkdir()
        with open(directory / "vol.img", "wb") as f:
            f.truncate(64 * MIB)
    whole = sysloop.attach_sync(here / "vol.img")
    offset = subprocess.run(["losetup", "--find", "--show", "--offset", "4096", str(here / "vol.img")],
                            check=True, capture_output=True, text=True).stdout.strip()
    covered = False
    try:
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
        if covered:
            subprocess.run(["umount", str(here)], check=True)
        for device in (whole, offset):
            sysloop.detach_sync(device)


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
        if aliased:
            subprocess.run(["umount", str(alias)], check=True)
        sysloop.detach_sync(device)


def test_stage_and_publish_raw_block(driver, root):
    size = SIZE["block"]
    vid = driver.create("raw", size, cap=block_cap()).volume_id
    staging = root.path / "staging"
    rw_target = root.path / "pods" / "a" / "dev" / "vol"
    ro_target = root.path / "pods" / "b" / "dev" / "vol"
    driver.stage(vid, staging, block_cap())
    device = only_device(driver, vid)
    assert sysblock.size_bytes(device) == size
    rec = record(driver, vid)
    assert (rec["access_type"], rec["fs_type"], rec["staging_path"]) == ("block", "", str(staging))
    assert not mounts_at(staging)

    driver.publish(vid, staging, rw_target, block_cap())
    assert assert_block_bind_of(rw_target, driver, vid) == device
    driver.publish(vid, staging, rw_target, block_cap())  # idempotent
    assert len(mounts_at(rw_target)) == 1

    # Bytes written to the published device node land in the backing file.
    marker = b"crust-raw-block!" * 256  # 4 KiB
    offset = 3 * MIB
    fd = os.open(rw_target, os.O_RDWR)
    try:
        assert os.pwrite(fd, marker, offset) == len(marker)
        os.fsync(fd)
    finally:
        os.close(fd)
    with open(backing_file(driver, vid), "rb") as f:
        f.seek(offset)
        assert f.read(len(marker)) == marker

    # A read-only publish reads the data but refuses every write.
    driver.publish(vid, staging, ro_target, block_cap(), readonly=True)
    assert_block_bind_of(ro_target, driver, vid)
    fd = os.open(ro_target, os.O_RDONLY)
    try:
        assert os.pread(fd, len(marker), offset) == marker
    finally:
        os.close(fd)
    head = backing_file(driver, vid).read_bytes()[:4096]
    assert_write_refused(ro_target, block=True)
    assert backing_file(driver, vid).read_bytes()[:4096] == head
    driver.publish(vid, staging, ro_target, block_cap(), readonly=True)  # idempotent
    fails(driver.node.NodePublishVolume, publish_req(vid, staging, ro_target, block_cap()),
          Code.ALREADY_EXISTS, "readonly")
    assert set(record(driver, vid)["published"]) == {str(rw_target), str(ro_target)}

    # Mount capability on a block-staged volume.
    fails(driver.node.NodePublishVolume, publish_req(vid, staging, root.path / "t3", mount_cap()),
          Code.INVALID_ARGUMENT, "volume_capability")

    for target in (rw_target, ro_target):
        driver.unpublish(vid, target)
        assert not mounts_at(target) and not os.path.lexists(target)
    assert loop_devices(driver, vid) == [device], "the read-only publish left a loop device behind"
    driver.unstage(vid, staging)
    assert not loop_devices(driver, vid)
    assert not record_file(driver, vid).exists()


# -- NodePublishVolume ---------------------------------------------------------------


def test_publish_bind_mounts_and_read_only_views(driver, root):
    vid = driver.create("pub", SIZE["ext4"]).volume_id
    staging = root.path / "staging"
    rw, ro = root.path / "pods" / "a" / "mount", root.path / "pods" / "b" / "mount"
    driver.stage(vid, staging)
    device = only_device(driver, vid)

    driver.publish(vid, staging, rw)
    entry = assert_fs_mount_of(rw, device, "ext4")
    assert entry.root == "/" and not entry.readonly
    write_synced(rw / "hello.txt", b"hello from the pod")
    assert (staging / "hello.txt").read_bytes() == b"hello from the pod"
    driver.publish(vid, staging, rw)  # idempotent
    assert [m.mount_id for m in mounts_at(rw)] == [entry.mount_id]

    driver.publish(vid, staging, ro, readonly=True)
    ro_entry = assert_fs_mount_of(ro, device, "ext4")
    assert ro_entry.readonly
    assert (ro / "hello.txt").read_bytes() == b"hello from the pod"
    assert_write_refused(ro)
    assert not sysmount.at(str(rw)).readonly, "the read-only view must not make the other one read-only"

    fails(driver.node.NodePublishVolume, publish_req(vid, staging, rw, readonly=True),
          Code.ALREADY_EXISTS, str(rw))
    fails(driver.node.NodePublishVolume, publish_req(vid, staging, ro, readonly=False),
          Code.ALREADY_EXISTS, str(ro))
    assert record(driver, vid)["published"] == {
        str(rw): {"readonly": False, "access_type": "mount", "device": ""},
        str(ro): {"readonly": True, "access_type": "mount", "device": ""},
    }
    assert record(driver, vid)["device"] == device  # the hint the node RPCs check with one sysfs read


def test_publish_reader_only_mode_is_read_only(driver, root):
    cap = mount_cap("ext4", mode=AccessMode.SINGLE_NODE_READER_ONLY)
    vid = driver.create("reader", SIZE["ext4"], cap=cap).volume_id
    staging, target = root.path / "staging", root.path / "target"
    driver.stage(vid, staging, cap)
    driver.publish(vid, staging, target, cap, readonly=False)
    entry = assert_fs_mount_of(target, only_device(driver, vid), "ext4")
    assert entry.readonly
    assert_write_refused(target)
    assert record(driver, vid)["published"][str(target)]["readonly"] is True


def test_publish_requires_a_live_stage(driver, root):
    vid = driver.create("unstaged", SIZE["ext4"]).volume_id
    staging, target = root.path / "staging", root.path / "target"
    fails(driver.node.NodePublishVolume, publish_req(vid, staging, target), Code.FAILED_PRECONDITION,
          "NodeStageVolume")
    assert not os.path.lexists(target) and not mounts_at(target)

    driver.stage(vid, staging)
    fails(driver.node.NodePublishVolume, publish_req(vid, root.path / "elsewhere", target),
          Code.FAILED_PRECONDITION, "not staged")
    assert not mounts_at(target)

    # The staged file system vanished behind the driver's back (this test's own
    # mount): publishing must not bind the bare staging directory instead.
    subprocess.run(["umount", str(staging)], check=True)
    fails(driver.node.NodePublishVolume, publish_req(vid, staging, target), Code.FAILED_PRECONDITION,
          "NodeStageVolume")
    assert not mounts_at(target)
    # A repeated NodeStageVolume repairs it.
    driver.stage(vid, staging)
    driver.publish(vid, staging, target)
    assert_fs_mount_of(target, only_device(driver, vid), "ext4")


def test_single_writer_refuses_a_second_target(driver, root):
    cap = mount_cap("ext4", mode=AccessMode.SINGLE_NODE_SINGLE_WRITER)
    vid = driver.create("single", SIZE["ext4"], cap=cap).volume_id
    staging, t1, t2 = root.path / "staging", root.path / "t1", root.path / "t2"
    driver.stage(vid, staging, cap)
    driver.publish(vid, staging, t1, cap)
    fails(driver.node.NodePublishVolume, publish_req(vid, staging, t2, cap), Code.FAILED_PRECONDITION,
          "SINGLE_NODE_SINGLE_WRITER", str(t1))
    assert not mounts_at(t2)
    assert list(record(driver, vid)["published"]) == [str(t1)]
    # Once the first target is gone the second one may publish.
    driver.unpublish(vid, t1)
    driver.publish(vid, staging, t2, cap)
    assert mounts_at(t2)


def test_multi_writer_targets_share_the_file_system(driver, root):
    cap = mount_cap("ext4", mode=AccessMode.SINGLE_NODE_MULTI_WRITER)
    vid = driver.create("multi", SIZE["ext4"], cap=cap).volume_id
    staging, t1, t2 = root.path / "staging", root.path / "t1", root.path / "t2"
    driver.stage(vid, staging, cap)
    driver.publish(vid, staging, t1, cap)
    driver.publish(vid, staging, t2, cap)
    write_synced(t1 / "shared", b"written through t1")
    assert (t2 / "shared").read_bytes() == b"written through t1"
    write_synced(t2 / "other", b"written through t2")
    assert (t1 / "other").read_bytes() == b"written through t2"
    assert not sysmount.at(str(t1)).readonly and not sysmount.at(str(t2)).readonly


# -- NodeUnpublishVolume / NodeUnstageVolume ---------------------------------------------


def test_unpublish_and_unstage(driver, root):
    vid = driver.create("teardown", SIZE["ext4"]).volume_id
    staging, target = root.path / "staging", root.path / "pods" / "a" / "mount"
    driver.stage(vid, staging)
    driver.publish(vid, staging, target)
    device = only_device(driver, vid)

    fails(driver.node.NodeUnstageVolume, csi_pb2.NodeUnstageVolumeRequest(
        volume_id=vid, staging_target_path=str(staging)), Code.FAILED_PRECONDITION, str(target))
    assert_fs_mount_of(staging, device, "ext4")
    assert only_device(driver, vid) == device

    driver.unpublish(vid, target)
    assert not mounts_at(target) and not os.path.lexists(target)
    assert target.parent.is_dir()  # only what the driver made at target is removed
    assert record(driver, vid)["published"] == {}
    driver.unpublish(vid, target)  # idempotent

    for bad in (unknown_id(), "not-a-volume-id"):
        fails(driver.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=bad, target_path=str(target)), Code.NOT_FOUND, bad)
        fails(driver.node.NodeUnstageVolume, csi_pb2.NodeUnstageVolumeRequest(
            volume_id=bad, staging_target_path=str(staging)), Code.NOT_FOUND, bad)

    driver.unstage(vid, staging)
    assert not mounts_at(staging)
    assert loops_left(lambda b: b.startswith(str(backing_file(driver, vid).resolve()))) == {}
    assert not record_file(driver, vid).exists()
    driver.unstage(vid, staging)  # idempotent
    assert not loop_devices(driver, vid)


# -- NodeGetVolumeStats ------------------------------------------------------------------


def test_volume_stats_of_a_mounted_volume(driver, root):
    vid = driver.create("stats", SIZE["ext4"]).volume_id
    staging, target, ro = root.path / "staging", root.path / "target", root.path / "ro-target"
    driver.stage(vid, staging)
    driver.publish(vid, staging, target)

    def usage(path):
        resp = stats(driver, vid, path)
        units = {u.unit: u for u in resp.usage}
        assert set(units) == {Usage.BYTES, Usage.INODES}
        return units[Usage.BYTES], units[Usage.INODES], resp.volume_condition

    b, i, cond = usage(target)
    st = os.statvfs(target)
    assert b.total == st.f_blocks * st.f_frsize
    assert abs(b.available - st.f_bavail * st.f_frsize) <= MIB
    assert abs(b.used - (st.f_blocks - st.f_bfree) * st.f_frsize) <= MIB
    assert 0 < b.total <= SIZE["ext4"] and b.used + b.available <= b.total
    assert i.total == st.f_files and abs(i.available - st.f_ffree) <= 4
    assert i.used == i.total - i.available
    assert not cond.abnormal

    write_synced(target / "four-mib", os.urandom(4 * MIB))
    b2, i2, _ = usage(target)
    assert b2.used - b.used >= 4 * MIB
    assert b.available - b2.available >= 4 * MIB
    assert i2.used >= i.used + 1
    assert b2.total == b.total

    # A read-only publish of a healthy file system is normal.
    driver.publish(vid, staging, ro, readonly=True)
    assert not usage(ro)[2].abnormal

    for missing in ("some/path", str(root.path / "not-mounted"), str(root.path)):
        (root.path / "not-mounted").mkdir(exist_ok=True)
        fails(driver.node.NodeGetVolumeStats, stats_req(vid, missing), Code.NOT_FOUND, "volume_path")
    fails(driver.node.NodeGetVolumeStats, stats_req(unknown_id(), target), Code.NOT_FOUND, unknown_id())
    fails(driver.node.NodeGetVolumeStats, stats_req(vid, ""), Code.INVALID_ARGUMENT, "volume_path")

    # The file system goes read-only behind the driver's back (on this test's own mount).
    subprocess.run(["mount", "-o", "remount,ro", str(staging)], check=True)
    cond = usage(target)[2]
    assert cond.abnormal and "read-only" in cond.message


def test_volume_stats_of_a_block_volume(driver, root):
    vid = driver.create("stats-raw", SIZE["block"], cap=block_cap()).volume_id
    staging, target = root.path / "staging", root.path / "dev" / "vol"
    driver.stage(vid, staging, block_cap())
    driver.publish(vid, staging, target, block_cap())
    resp = stats(driver, vid, target)
    assert [(u.unit, u.total) for u in resp.usage] == [(Usage.BYTES, SIZE["block"])]
    assert not resp.volume_condition.abnormal
    fails(driver.node.NodeGetVolumeStats, stats_req(vid, staging), Code.NOT_FOUND, "volume_path")


# -- NodeExpandVolume --------------------------------------------------------------------


def test_expand_xfs_online(driver, root):
    cap = mount_cap("xfs")
    vid = driver.create("grow-xfs", SIZE["xfs"], cap=cap).volume_id
    staging, target = root.path / "staging", root.path / "target"
    driver.stage(vid, staging, cap)
    driver.publish(vid, staging, target, cap)
    write_synced(target / "before", b"still here")
    before = fs_total(target)
    bigger = SIZE["xfs"] + 100 * MIB

    fails(driver.node.NodeExpandVolume, expand_req(vid, target, bigger, cap), Code.OUT_OF_RANGE,
          "capacity_range.required_bytes", "ControllerExpandVolume")
    controller_expand(driver, vid, bigger)
    resp = driver.node.NodeExpandVolume(expand_req(vid, target, bigger, cap), timeout=60)
    assert resp.capacity_bytes == bigger
    assert sysblock.size_bytes(only_device(driver, vid)) == bigger
    assert fs_total(target) - before >= 90 * MIB
    assert fs_total(staging) == fs_total(target)
    assert (target / "before").read_bytes() == b"still here"
    # Repeating is harmless.
    assert driver.node.NodeExpandVolume(expand_req(vid, target, bigger, cap), timeout=60).capacity_bytes == bigger

    fails(driver.node.NodeExpandVolume, expand_req(vid, target, 4 * GIB, cap), Code.OUT_OF_RANGE,
          "capacity_range.required_bytes")
    fails(driver.node.NodeExpandVolume, expand_req(unknown_id(), target, bigger, cap), Code.NOT_FOUND,
          unknown_id())
    fails(driver.node.NodeExpandVolume, expand_req(vid, "", bigger, cap), Code.INVALID_ARGUMENT, "volume_path")
    fails(driver.node.NodeExpandVolume, expand_req(vid, "some/path", bigger, cap), Code.NOT_FOUND, "volume_path")


def test_expand_block_volume(driver, root):
    vid = driver.create("grow-raw", SIZE["block"], cap=block_cap()).volume_id
    staging, rw, ro = root.path / "staging", root.path / "rw" / "dev", root.path / "ro" / "dev"
    driver.stage(vid, staging, block_cap())
    driver.publish(vid, staging, rw, block_cap())
    driver.publish(vid, staging, ro, block_cap(), readonly=True)
    bigger = 2 * SIZE["block"]
    controller_expand(driver, vid, bigger)
    resp = driver.node.NodeExpandVolume(expand_req(vid, rw, bigger, block_cap()), timeout=60)
    assert resp.capacity_bytes == bigger
    for device in loop_devices(driver, vid):
        assert sysblock.size_bytes(device) == bigger, device
    assert sysblock.size_bytes(str(rw)) == bigger and sysblock.size_bytes(str(ro)) == bigger
    assert [u.total for u in stats(driver, vid, rw).usage] == [bigger]


def test_expand_ext4_grows_offline_when_online_grow_is_refused(driver, root):
    cap = mount_cap("ext4")
    vid = driver.create("grow-ext4", SIZE["ext4"], cap=cap).volume_id
    staging, target = root.path / "staging", root.path / "target"
    driver.stage(vid, staging, cap)
    driver.publish(vid, staging, target, cap)
    payload = os.urandom(256 * 1024)
    write_synced(target / "payload", payload)
    before = fs_total(target)
    bigger = 2 * SIZE["ext4"]
    controller_expand(driver, vid, bigger)
    device = only_device(driver, vid)

    try:
        resp = driver.node.NodeExpandVolume(expand_req(vid, target, bigger, cap), timeout=60)
    except grpc.RpcError as exc:
        # This host's kernel refuses online ext4 grow: the driver says so and
        # promises the grow at the next stage; nothing is harmed meanwhile.
        assert exc.code() == Code.FAILED_PRECONDITION, exc.details()
        assert "online growth" in exc.details() and "refused" in exc.details() and "NodeStageVolume" in exc.details(), exc.details()
        assert_fs_mount_of(target, device, "ext4")
        assert (target / "payload").read_bytes() == payload
        write_synced(target / "after", b"still writable")
        assert fs_total(target) == before
        driver.unpublish(vid, target)
        driver.unstage(vid, staging)
        check = subprocess.run(["e2fsck", "-f", "-n", str(backing_file(driver, vid))], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        driver.stage(vid, staging, cap)
        driver.publish(vid, staging, target, cap)
        assert (target / "after").read_bytes() == b"still writable"
    else:
        assert resp.capacity_bytes == bigger
    assert (target / "payload").read_bytes() == payload
    assert sysblock.size_bytes(only_device(driver, vid)) == bigger
    assert fs_total(target) - before >= SIZE["ext4"] * 9 // 10
    dump = subprocess.run(["dumpe2fs", "-h", str(only_device(driver, vid))], capture_output=True, text=True,
                          check=True).stdout
    fields = dict(line.split(":", 1) for line in dump.splitlines() if ":" in line)
    assert int(fields["Block count"]) * int(fields["Block size"]) == bigger


# -- bad requests --------------------------------------------------------------------------


def _stage_case(**overrides):
    def build(vid, base: Path):
        kw = {"volume_id": vid, "staging_target_path": str(base / "staging"), "volume_capability": mount_cap()}
        kw.update({k: (v(base) if callable(v) else v) for k, v in overrides.items()})
        return csi_pb2.NodeStageVolumeRequest(**kw)
    return build


LONG = "/" + "/".join(["d" * 99] * 50)  # 5000 characters

STAGE_CASES = {
    "relative": (_stage_case(staging_target_path="rel/staging"), "staging_target_path"),
    "dotdot": (_stage_case(staging_target_path=lambda b: f"{b}/x/../staging"), "staging_target_path"),
    "nul": (_stage_case(staging_target_path=lambda b: f"{b}/stag\x00ing"), "staging_target_path"),
    "huge": (_stage_case(staging_target_path=lambda b: str(b) + LONG), "staging_target_path"),
    "no-capability": (lambda vid, b: csi_pb2.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=str(b / "staging")), "volume_capability"),
    "no-access-type": (_stage_case(volume_capability=csi_pb2.VolumeCapability(
        access_mode=AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))), "volume_capability.access_type"),
    "no-access-mode": (_stage_case(volume_capability=csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume())), "volume_capability.access_mode"),
    "flag-smuggling": (_stage_case(volume_capability=mount_cap("ext4", flags=["noatime,dev,suid"])),
                       "volume_capability.mount.mount_flags[0]"),
    "flag-newline": (_stage_case(volume_capability=mount_cap("ext4", flags=["ro\nexec"])),
                     "volume_capability.mount.mount_flags[0]"),
    "unknown-fs": (_stage_case(volume_capability=mount_cap("btrfs")), "volume_capability.mount.fs_type"),
    "unknown-fs-in-context": (_stage_case(volume_context={"fsType": "btrfs"}), "fsType"),
    "multi-node": (_stage_case(volume_capability=mount_cap("ext4", mode=AccessMode.MULTI_NODE_MULTI_WRITER)),
                   "volume_capability.access_mode"),
    "multi-node-block": (_stage_case(volume_capability=block_cap(AccessMode.MULTI_NODE_READER_ONLY)),
                         "volume_capability.access_mode"),
    "no-volume-id": (_stage_case(volume_id=""), "volume_id"),
}


@pytest.mark.parametrize("case", list(STAGE_CASES))
def test_stage_rejects_bad_input_and_leaves_nothing(driver, root, case):
    build, field = STAGE_CASES[case]
    vid = driver.create(f"bad-{case}", SIZE["ext4"]).volume_id
    fails(driver.node.NodeStageVolume, build(vid, root.path), Code.INVALID_ARGUMENT, field)
    assert not record_file(driver, vid).exists()
    assert not list(record_file(driver, vid).parent.iterdir())
    assert not loop_devices(driver, vid)
    assert not mounts_under(root.path)
    assert not (root.path / "staging").exists() and not (root.path / "x").exists()


def _publish_case(**overrides):
    def build(vid, base: Path):
        kw = {"volume_id": vid, "staging_target_path": str(base / "staging"),
              "target_path": str(base / "target"), "volume_capability": mount_cap()}
        kw.update({k: (v(base) if callable(v) else v) for k, v in overrides.items()})
        return csi_pb2.NodePublishVolumeRequest(**kw)
    return build


PUBLISH_CASES = {
    "relative-target": (_publish_case(target_path="pods/target"), "target_path"),
    "dotdot-target": (_publish_case(target_path=lambda b: f"{b}/x/../target"), "target_path"),
    "nul-target": (_publish_case(target_path=lambda b: f"{b}/tar\x00get"), "target_path"),
    "huge-target": (_publish_case(target_path=lambda b: str(b) + LONG), "target_path"),
    "relative-staging": (_publish_case(staging_target_path="staging"), "staging_target_path"),
    "no-capability": (lambda vid, b: csi_pb2.NodePublishVolumeRequest(
        volume_id=vid, staging_target_path=str(b / "staging"), target_path=str(b / "target")),
        "volume_capability"),
    "no-access-type": (_publish_case(volume_capability=csi_pb2.VolumeCapability(
        access_mode=AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))), "volume_capability.access_type"),
    "flag-smuggling": (_publish_case(volume_capability=mount_cap("ext4", flags=["bind,rw"])),
                       "volume_capability.mount.mount_flags[0]"),
    "unknown-fs": (_publish_case(volume_capability=mount_cap("zfs")), "volume_capability.mount.fs_type"),
    "multi-node": (_publish_case(volume_capability=mount_cap(mode=AccessMode.MULTI_NODE_SINGLE_WRITER)),
                   "volume_capability.access_mode"),
}


@pytest.mark.parametrize("case", list(PUBLISH_CASES))
def test_publish_rejects_bad_input_and_leaves_nothing(driver, root, case):
    build, field = PUBLISH_CASES[case]
    vid = driver.create(f"badpub-{case}", 16 * MIB).volume_id
    staging = root.path / "staging"
    driver.stage(vid, staging)
    rec = record(driver, vid)
    fails(driver.node.NodePublishVolume, build(vid, root.path), Code.INVALID_ARGUMENT, field)
    assert record(driver, vid) == rec
    assert [m.mount_point for m in mounts_under(root.path)] == [str(staging)]
    assert not (root.path / "target").exists() and not (root.path / "x").exists()
    assert sorted(p.name for p in root.path.iterdir() if p.is_dir()) == ["data", "staging"]


def test_unpublish_unstage_stats_expand_reject_bad_paths(driver, root):
    vid = driver.create("badpaths", 16 * MIB).volume_id
    cases = [
        (driver.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path="t"),
         "target_path"),
        (driver.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=vid, target_path=f"{root.path}/a/../t"), "target_path"),
        (driver.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=vid, target_path=str(root.path) + LONG), "target_path"),
        (driver.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(target_path=str(root.path / "t")),
         "volume_id"),
        (driver.node.NodeUnstageVolume, csi_pb2.NodeUnstageVolumeRequest(
            volume_id=vid, staging_target_path="staging"), "staging_target_path"),
        (driver.node.NodeUnstageVolume, csi_pb2.NodeUnstageVolumeRequest(
            volume_id=vid, staging_target_path=f"{root.path}/st\x00aging"), "staging_target_path"),
        (driver.node.NodeGetVolumeStats, csi_pb2.NodeGetVolumeStatsRequest(volume_path=str(root.path)),
         "volume_id"),
        (driver.node.NodeExpandVolume, csi_pb2.NodeExpandVolumeRequest(volume_path=str(root.path)), "volume_id"),
    ]
    for call, request, field in cases:
        fails(call, request, Code.INVALID_ARGUMENT, field)
    assert not mounts_under(root.path) and not loop_devices(driver, vid)


# -- info ------------------------------------------------------------------------------------


def test_node_info_capabilities_and_id(root):
    plain = root.driver(extra=["--max-volumes-per-node", "7"]).start()
    info = plain.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10)
    assert info.node_id == "node-a"
    assert info.max_volumes_per_node == 7
    assert dict(info.accessible_topology.segments) == {"topology.loop.csi.crust.dev/node": "node-a"}
    caps = {c.rpc.type for c in plain.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10)
            .capabilities}
    assert caps == {RPC.STAGE_UNSTAGE_VOLUME, RPC.GET_VOLUME_STATS, RPC.EXPAND_VOLUME, RPC.VOLUME_CONDITION,
                    RPC.SINGLE_NODE_MULTI_WRITER}
    # The alpha RPC is served even when its capability is not advertised.
    assert plain.node.NodeGetID(csi_pb2.NodeGetIDRequest(), timeout=10).node_id == "node-a"

    alpha = root.driver(node_id="node-b", endpoint_name="alpha.sock", extra=["--advertise-alpha"]).start()
    caps = {c.rpc.type for c in alpha.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10)
            .capabilities}
    assert RPC.GET_ID in caps and RPC.STAGE_UNSTAGE_VOLUME in caps
    assert alpha.node.NodeGetID(csi_pb2.NodeGetIDRequest(), timeout=10).node_id == "node-b"
    info = alpha.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10)
    assert info.node_id == "node-b" and info.max_volumes_per_node == 64
    assert dict(info.accessible_topology.segments) == {"topology.loop.csi.crust.dev/node": "node-b"}


# -- concurrency -----------------------------------------------------------------------------


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
    assert blkid_type(only_device(driver, vid)) == fs_type
    assert path.stat().st_blocks * 512 >= SIZE[fs_type], "the format gave the thick volume's blocks back"
    driver.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(volume_id=vid, staging_target_path=str(staging)),
                                  timeout=60)
