"""`crust shim` end to end, volumes used on the host: staging formats only a
blank volume, host publishes share one staging mount, an xfs volume published
on the host expands online, raw block volumes pass through as device nodes, a
thick volume stays fully allocated when staged, and overlapping stages of
several volumes. The set-up is tests/harness/shim.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
import uuid

import grpc

from crust.api import csi_pb2
from crust.sys import mount as sysmount
from tests.harness.daemons import MIB, blkid, block_cap, mount_cap, sha256_of
from tests.harness.shim import (PLACEHOLDER, SIZE, Code, Usage, assert_device_node_bind, assert_placeholder,
                                expand_req, fails, fs_mounts, fs_total, mounts_at, mounts_under, publish_req,
                                stage_req, stats_req)
from tests.harness.shim import env  # noqa: F401 - a fixture


# -- formatting ------------------------------------------------------------------------------


def test_stage_formats_only_a_blank_volume(env):
    blank = env.create("blank", "xfs")
    assert blkid(env.backing(blank)) == ""
    env.stage(blank, "xfs")
    assert blkid(env.backing(blank)) == "xfs"
    # An existing file system: never reformatted, whatever the volume holds.
    vid = env.create("full", "ext4")
    backing = env.backing(vid)
    fs_uuid = str(uuid.uuid4())
    subprocess.run(["mkfs.ext4", "-q", "-F", "-U", fs_uuid, "--", str(backing)], check=True)
    payload = env.path / "payload.bin"
    payload.write_bytes(os.urandom(100_000))
    subprocess.run(["debugfs", "-w", "-R", f"write {payload} data.bin", str(backing)], check=True,
                   capture_output=True)

    env.stage(vid, "ext4")
    assert blkid(backing, "UUID") == fs_uuid
    host = env.target("host")
    env.publish(vid, host, defer=False)
    assert (host / "data.bin").read_bytes() == payload.read_bytes()
    (host / "more.txt").write_text("written through the shim")
    env.unpublish(vid, host, defer=False)
    env.unstage(vid)
    env.assert_released(vid)
    assert blkid(backing, "UUID") == fs_uuid
    digest = sha256_of(backing)

    # Asking for another file system type: refused, nothing written, nothing left behind.
    fails(env.shim.node.NodeStageVolume, stage_req(vid, env.staging(vid), mount_cap("xfs")),
          Code.FAILED_PRECONDITION, "ext4", "fs_type")
    assert sha256_of(backing) == digest
    assert not env.record_file(vid).exists()
    assert not env.loops(vid), "a failed NodeStageVolume left the backend's loop device attached"
    assert not mounts_under(env.private(vid)) and not env.private(vid).exists()

    # Re-staged as ext4: same file system, the data survived.
    env.stage(vid, "ext4")
    assert blkid(backing, "UUID") == fs_uuid
    env.publish(vid, host, defer=False)
    assert (host / "data.bin").read_bytes() == payload.read_bytes()
    assert (host / "more.txt").read_text() == "written through the shim"
    env.unpublish(vid, host, defer=False)
    env.unstage(vid)
    env.unstage(blank)
    env.assert_released(vid)
    env.assert_released(blank)


# -- host publishes: stats and expansion ----------------------------------------------------


def test_host_publishes_share_one_staging_mount(env):
    vid = env.create("host", "ext4")
    env.stage(vid)
    device = env.only_loop(vid)
    staging = env.staging(vid)
    assert fs_mounts(device) == []

    t1, t2 = env.target("one"), env.target("two")
    for t in (t1, t2):
        resp = env.publish(vid, t, defer=False)
        assert not resp.HasField("deferred_mount")
    entries = fs_mounts(device)
    assert sorted(m.mount_point for m in entries) == sorted([str(staging), str(t1), str(t2)])
    staged = [m for m in entries if m.mount_point == str(staging)]
    assert len(staged) == 1 and staged[0].fs_type == "ext4"
    (t1 / "shared").write_text("one file system")
    assert (t2 / "shared").read_text() == "one file system"
    assert {(m.mount_point, m.fs_type) for m in sysmount.mounts()
            if m.source == PLACEHOLDER and m.mount_point.startswith(str(env.path) + "/")} == set()

    # Stats of a host publish are read on the host, never asked of the runtime.
    resp = env.shim.node.NodeGetVolumeStats(stats_req(vid, t1, False), timeout=30)
    by_unit = {u.unit: u for u in resp.usage}
    assert by_unit[Usage.BYTES].total == fs_total(t1) and by_unit[Usage.BYTES].used > 0
    assert resp.volume_condition.abnormal is False
    assert env.runtime.calls == []

    env.unpublish(vid, t1, defer=False)
    assert sorted(m.mount_point for m in fs_mounts(device)) == sorted([str(staging), str(t2)])
    env.unpublish(vid, t2, defer=False)
    assert fs_mounts(device) == []
    assert sysmount.at(str(staging)) is None

    # The host no longer holds it: it can go to a sandbox now.
    t3 = env.target("three")
    env.publish(vid, t3, defer=True)
    assert_placeholder(t3)
    env.unpublish(vid, t3)
    env.unstage(vid)
    env.assert_released(vid)


def test_host_publish_xfs_expands_online(env):
    vid = env.create("grow", "xfs")
    env.stage(vid, "xfs")
    target = env.target("a")
    env.publish(vid, target, "xfs", defer=False)
    (target / "keep").write_text("kept")
    before = fs_total(target)

    env.controller_expand(vid, 400 * MIB)
    resp = env.shim.node.NodeExpandVolume(expand_req(vid, target, 400 * MIB, False, "xfs"), timeout=60)
    assert resp.capacity_bytes == 400 * MIB
    after = fs_total(target)
    assert after > before + 64 * MIB, (before, after)
    assert (target / "keep").read_text() == "kept"
    assert env.runtime.calls == []

    env.unpublish(vid, target, defer=False)
    env.unstage(vid)
    env.assert_released(vid)


# -- raw block ---------------------------------------------------------------------------------


def test_raw_block_volumes_pass_through(env):
    vid = env.create("raw", cap=block_cap(), size=SIZE["block"])
    staging = env.path / "kubelet" / "staging" / "raw"
    target = env.path / "kubelet" / "volumeDevices" / "raw" / "dev"
    env.shim.node.NodeStageVolume(stage_req(vid, staging, block_cap()), timeout=60)
    env.shim.node.NodePublishVolume(publish_req(vid, staging, target, block_cap(), defer=False), timeout=60)

    device = env.only_loop(vid)
    assert_device_node_bind(target, device)
    assert stat.S_ISBLK(os.stat(target).st_mode)
    # The shim kept nothing of its own for it.
    assert not env.record_file(vid).exists() and not env.private(vid).exists()
    assert not mounts_under(env.shim.state_dir)

    payload = os.urandom(8192)
    fd = os.open(target, os.O_RDWR)
    try:
        os.pwrite(fd, payload, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    with open(env.backing(vid), "rb") as f:
        assert f.read(len(payload)) == payload

    env.shim.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path=str(target)),
                                      timeout=60)
    env.shim.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
        volume_id=vid, staging_target_path=str(staging)), timeout=60)
    assert mounts_at(target) == [] and not env.loops(vid)


# -- concurrency ----------------------------------------------------------------------------------


def test_stage_keeps_a_thick_volume_fully_allocated(env):
    """The shim formats what the backend staged as a raw block device; a
    discard would punch holes in a thick volume's reserved blocks."""
    vid = env.shim.create("thick", SIZE["ext4"], cap=mount_cap("ext4"),
                          parameters={"provisioning": "thick"}).volume_id
    backing = env.backing(vid)
    assert backing.stat().st_blocks * 512 >= SIZE["ext4"]
    env.stage(vid, "ext4")
    assert blkid(backing) == "ext4"
    assert backing.stat().st_blocks * 512 >= SIZE["ext4"], "the format gave the thick volume's blocks back"
    env.unstage(vid)
    env.assert_released(vid)


def test_overlapping_stages(env):
    """Stages of one volume that overlap: each is OK or ABORTED, the backend
    publishes once. Calls are spread over the probe/mkfs window (xfs: the
    longest mkfs); without the shim's per-volume guard two mkfs race on one
    device and one fails with INTERNAL in about half of the rounds."""
    staged = []
    for r in range(6):
        vid = env.create(f"race-{r}", "xfs")
        staged.append(vid)
        req = stage_req(vid, env.staging(vid), mount_cap("xfs"))
        calls = []
        for _ in range(20):
            calls.append(env.shim.node.NodeStageVolume.future(req, timeout=60))
            time.sleep(0.005)
        outcomes = []
        for call in calls:
            try:
                call.result()
                outcomes.append((Code.OK, ""))
            except grpc.RpcError as exc:
                outcomes.append((exc.code(), exc.details()))
        codes = {code for code, _ in outcomes}
        assert codes <= {Code.OK, Code.ABORTED} and Code.OK in codes, outcomes
        # One backend publish: one loop device, one device node bind, one publish in the driver's record.
        device = env.only_loop(vid)
        assert [m.mount_point for m in sysmount.of_device_node(device)] == [str(env.private(vid) / "device")]
        assert list(env.driver_record(vid)["published"]) == [str(env.private(vid) / "device")]
        assert blkid(device) == "xfs"
        assert fs_mounts(device) == []

    # Different volumes never wait for each other.
    others = [env.create(f"par-{i}", "ext4") for i in range(2)]
    calls = [env.shim.node.NodeStageVolume.future(stage_req(v, env.staging(v), mount_cap("ext4")), timeout=60)
             for v in others]
    for call in calls:
        call.result()
    for v in others:
        assert blkid(env.only_loop(v)) == "ext4" and env.record_file(v).exists()
    for v in [*staged, *others]:
        env.unstage(v)
        env.assert_released(v)
