"""NodeGetVolumeStats and NodeExpandVolume of `crust driver` on mounted file systems.

Stats match statvfs of the mount and follow writes; a file system gone
read-only is reported abnormal. xfs grows online; ext4 grows online or, where
the kernel refuses, at the next stage, its data kept.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import grpc

from crust.sys import blockdev as sysblock
from tests.harness.driver_node_calls import (
    SIZE,
    Code,
    Usage,
    assert_fs_mount_of,
    backing_file,
    controller_expand,
    expand_req,
    fails,
    only_device,
    stats,
    stats_req,
    unknown_id,
    write_synced,
)
from tests.harness.daemons import GIB, MIB, mount_cap

# -- helpers ---------------------------------------------------------------------


def fs_total(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


# -- NodeGetVolumeStats --------------------------------------------------------------------


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


# -- NodeExpandVolume ----------------------------------------------------------------------


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
