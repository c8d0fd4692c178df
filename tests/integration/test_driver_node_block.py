"""Raw block volumes on the Node service of `crust driver`.

Staging attaches a loop device without a file system; a publish bind-mounts
the device node (read-write, or read-only refusing every write); bytes go
to the backing file; NodeGetVolumeStats reports the device's size and
NodeExpandVolume grows every loop device of the volume.
"""

from __future__ import annotations

import os
from pathlib import Path

from crust.sys import blockdev as sysblock
from crust.sys import mount as sysmount
from tests.harness.driver_node_calls import (
    SIZE,
    Code,
    Usage,
    assert_write_refused,
    backing_file,
    controller_expand,
    expand_req,
    fails,
    loop_devices,
    mounts_at,
    only_device,
    publish_req,
    record,
    record_file,
    stats,
    stats_req,
)
from tests.harness.daemons import MIB, block_cap, mount_cap

# -- helpers ---------------------------------------------------------------------


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


# -- stage and publish ---------------------------------------------------------------------


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


# -- NodeGetVolumeStats --------------------------------------------------------------------


def test_volume_stats_of_a_block_volume(driver, root):
    vid = driver.create("stats-raw", SIZE["block"], cap=block_cap()).volume_id
    staging, target = root.path / "staging", root.path / "dev" / "vol"
    driver.stage(vid, staging, block_cap())
    driver.publish(vid, staging, target, block_cap())
    resp = stats(driver, vid, target)
    assert [(u.unit, u.total) for u in resp.usage] == [(Usage.BYTES, SIZE["block"])]
    assert not resp.volume_condition.abnormal
    fails(driver.node.NodeGetVolumeStats, stats_req(vid, staging), Code.NOT_FOUND, "volume_path")


# -- NodeExpandVolume ----------------------------------------------------------------------


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
