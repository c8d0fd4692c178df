"""NodePublishVolume, NodeUnpublishVolume and NodeUnstageVolume of `crust driver` for file systems.

Bind mounts of the staged file system, read-only views, the reader-only and
single-writer access modes, publishing only over a live stage, and the
teardown: an unstage refused while published, idempotent repeats, nothing
left once done. Checked in /proc/self/mountinfo, through the mounts
themselves and in the node's JSON records.
"""

from __future__ import annotations

import os
import subprocess

from crust.api import csi_pb2
from crust.sys import mount as sysmount
from tests.harness.driver_node_calls import (
    SIZE,
    Code,
    assert_fs_mount_of,
    assert_write_refused,
    backing_file,
    fails,
    loop_devices,
    mounts_at,
    only_device,
    publish_req,
    record,
    record_file,
    unknown_id,
    write_synced,
)
from tests.harness.daemons import AccessMode, loops_left, mount_cap

# -- NodePublishVolume ---------------------------------------------------------------------


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


# -- NodeUnpublishVolume / NodeUnstageVolume -----------------------------------------------


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
