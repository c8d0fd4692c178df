"""`crust shim` end to end, deferred volumes: a deferred publish mounts
nothing on the host and a sandbox (a private mount namespace) can use the
volume; the mount description the shim leaves for the runtime; the safety
rules that refuse a second holder and name it; stats and expansion of a
deferred volume, which go to the Runtime API server (the stand-in for the
crust proxy). The set-up is tests/harness/shim.py.
"""

from __future__ import annotations

import os
import stat

import pytest

from crust.api import csi_pb2
from crust.sys import blockdev as sysblock
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness.daemons import MIB, blkid, block_cap, mount_cap
from tests.harness.runtime_server import usage_response
from tests.harness.shim import (Code, assert_device_node_bind, assert_placeholder, deferred_cap, expand_req,
                                fails, fs_mounts, majmin, mounts_at, publish_req, regular_files, sandbox, stats_req)
from tests.harness.shim import env  # noqa: F401 - a fixture


# -- deferred publish: nothing on the host, the sandbox mounts --------------------------------


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_deferred_publish_mounts_nothing_on_the_host_and_a_sandbox_can_use_it(env, fs_type):
    vid = env.create(f"defer-{fs_type}", fs_type)
    env.stage(vid, fs_type)
    device = env.only_loop(vid)
    # Staged as raw block at the backend, into the shim's private dir; nothing mounted.
    assert_device_node_bind(env.private(vid) / "device", device)
    assert fs_mounts(device) == []
    assert sysmount.at(str(env.staging(vid))) is None
    assert blkid(device) == fs_type

    target = env.target("a")
    resp = env.publish(vid, target, fs_type, defer=True)
    dm = resp.deferred_mount
    assert resp.HasField("deferred_mount")
    assert (dm.device, dm.fs_type, dm.volume_type) == (device, fs_type, "block")
    assert (dm.device_major, dm.device_minor) == majmin(device)

    # No mount of the volume's file system anywhere on the host: only the
    # device node at the shim's private path and the placeholder on the target.
    assert sysmount.of_device(dm.device_major, dm.device_minor) == []
    assert_placeholder(target)
    node_binds = [m.mount_point for m in sysmount.of_device_node(device)]
    assert node_binds == [str(env.private(vid) / "device")], node_binds

    # The sandbox mounts the device from the description and writes.
    sandbox(dm.device, dm.fs_type, env.path / "sandbox", 'echo data > "$M/f"')
    assert sysmount.of_device(dm.device_major, dm.device_minor) == []
    assert_placeholder(target)
    assert env.runtime.calls == []

    env.unpublish(vid, target)
    assert mounts_at(target) == [] and not target.exists()
    assert env.record(vid)["published"] == {}

    # Back on the host without deferral: the sandbox's write is there.
    host = env.target("b")
    resp = env.publish(vid, host, fs_type, defer=False)
    assert not resp.HasField("deferred_mount")
    assert (host / "f").read_text() == "data\n"
    entry = sysmount.at(str(host))
    assert (entry.major, entry.minor, entry.fs_type) == (dm.device_major, dm.device_minor, fs_type)

    env.unpublish(vid, host, defer=False)
    env.unstage(vid)
    env.assert_released(vid)
    assert not host.exists()


def test_deferred_mount_description(env):
    secrets = {"password": "s3cr3t-stage-value-8c1f", "token": "s3cr3t-publish-value-77d2"}
    context = {"team": "blue", "storage.example/zone": "z1"}
    flags = ["noatime", "bind", "context=system_u:object_r:foo_t:s0"]

    vid = env.create("desc", "ext4", size=48 * MIB)
    env.stage(vid, "ext4", flags=flags, secrets={"password": secrets["password"]}, volume_context=context)
    device = env.only_loop(vid)

    # Read-write publish with host-only flags: only noatime survives.
    target = env.target("rw")
    resp = env.publish(vid, target, cap=deferred_cap("ext4", flags=flags, group="2000", policy="OnRootMismatch"),
                       defer=True, secrets={"token": secrets["token"]}, volume_context=context)
    dm = resp.deferred_mount
    st = os.stat(dm.device)
    assert stat.S_ISBLK(st.st_mode)
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (dm.device_major, dm.device_minor)
    assert sysloop._backing_file(os.path.basename(dm.device)) == str(env.backing(vid).resolve())
    assert dm.device == device
    assert dm.volume_type == "block" and dm.fs_type == "ext4" and dm.volume_id == vid
    assert dm.capacity_bytes == sysblock.size_bytes(device) == 48 * MIB
    assert list(dm.mount_options) == ["noatime"]
    assert dm.readonly is False
    assert (dm.volume_supplemental_group, dm.volume_supplemental_group_change_policy) == ("2000", "OnRootMismatch")
    assert dict(dm.volume_context) == context

    raw = resp.SerializeToString()
    for value in secrets.values():
        assert value.encode() not in raw
    env.unpublish(vid, target)

    # readonly=True makes a read-only description.
    target_ro = env.target("ro")
    dm = env.publish(vid, target_ro, cap=deferred_cap("ext4", flags=flags, group="3000", policy="Always"),
                     defer=True, readonly=True).deferred_mount
    assert dm.readonly is True and list(dm.mount_options) == ["noatime"]
    assert (dm.volume_supplemental_group, dm.volume_supplemental_group_change_policy) == ("3000", "Always")
    assert env.record(vid)["published"][str(target_ro)]["readonly"] is True
    env.unpublish(vid, target_ro)
    env.unstage(vid)

    # An "ro" mount flag makes a read-only description too (and is not an option).
    vid2 = env.create("desc-ro-flag", "ext4")
    env.stage(vid2, "ext4", flags=["ro", "nodev"])
    dm = env.publish(vid2, env.target("flag"), flags=["ro", "nodev"], defer=True).deferred_mount
    assert dm.readonly is True and list(dm.mount_options) == ["nodev"]
    assert dm.volume_supplemental_group == "" and dm.volume_supplemental_group_change_policy == ""

    # No secret value anywhere in the shim's state dir (records) or its log.
    files = list(regular_files(env.shim.state_dir))
    assert any(f.suffix == ".json" for f in files), files
    for path in files + [env.shim.log_path]:
        data = path.read_bytes()
        for value in secrets.values():
            assert value.encode() not in data, f"secret found in {path}"


# -- safety rules ------------------------------------------------------------------------------


def test_safety_rules_name_the_holder(env):
    vid = env.create("safety", "ext4")
    env.stage(vid)
    device = env.only_loop(vid)
    staging = env.staging(vid)

    # 1. Host-mounted: no deferral.
    host = env.target("host")
    env.publish(vid, host, defer=False)
    deferred = env.target("deferred")
    details = fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, deferred, mount_cap("ext4"), defer=True),
                    Code.FAILED_PRECONDITION, "mounted on the host")
    assert str(staging) in details or str(host) in details, details
    assert mounts_at(deferred) == []

    # The last host unpublish releases the host mount: deferral becomes possible.
    env.unpublish(vid, host, defer=False)
    assert fs_mounts(device) == []
    env.publish(vid, deferred, defer=True)
    assert_placeholder(deferred)

    # 2. Deferred: no host publish.
    host2 = env.target("host2")
    fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, host2, mount_cap("ext4"), defer=False),
          Code.FAILED_PRECONDITION, str(deferred))
    assert fs_mounts(device) == [] and mounts_at(host2) == []

    # 3. Single writer: no second sandbox.
    second = env.target("second")
    fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, second, mount_cap("ext4"), defer=True),
          Code.FAILED_PRECONDITION, str(deferred))
    assert mounts_at(second) == []
    assert list(env.record(vid)["published"]) == [str(deferred)]
    env.unpublish(vid, deferred)

    # Read-only sandboxes may share it; a writer may not join them.
    readers = [env.target("r1"), env.target("r2")]
    for t in readers:
        assert env.publish(vid, t, defer=True, readonly=True).deferred_mount.readonly
        assert_placeholder(t)
    writer = env.target("writer")
    details = fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, writer, mount_cap("ext4"), defer=True),
                    Code.FAILED_PRECONDITION)
    assert any(str(t) in details for t in readers), details
    assert mounts_at(writer) == []
    for t in readers:
        env.unpublish(vid, t)

    # Group fields only with deferral; no deferral of a raw block volume.
    fails(env.shim.node.NodePublishVolume,
          publish_req(vid, staging, host2, deferred_cap(group="1000"), defer=False),
          Code.INVALID_ARGUMENT, "volume_supplemental_group", "defer_fs_ops")
    fails(env.shim.node.NodePublishVolume,
          publish_req(vid, staging, host2, deferred_cap(policy="Always"), defer=False),
          Code.INVALID_ARGUMENT, "volume_supplemental_group_change_policy")
    fails(env.shim.node.NodePublishVolume,
          publish_req(vid, staging, host2, block_cap(), defer=True),
          Code.INVALID_ARGUMENT, "defer_fs_ops")
    assert mounts_at(host2) == [] and fs_mounts(device) == []

    env.unstage(vid)
    env.assert_released(vid)


# -- stats and expansion ---------------------------------------------------------------------


def test_stats_and_expansion_of_a_deferred_volume_go_to_the_runtime(env):
    vid = env.create("stats", "ext4")
    env.stage(vid)
    device = env.only_loop(vid)
    target = env.target("a")
    first = env.publish(vid, target, defer=True).deferred_mount
    answer = usage_response(total=30 * MIB, used=7 * MIB)
    env.runtime.stats[str(target)] = answer

    resp = env.shim.node.NodeGetVolumeStats(stats_req(vid, target, True), timeout=30)
    assert list(resp.usage) == list(answer.usage)
    assert resp.volume_condition == answer.volume_condition
    assert env.runtime.calls == [("stats", str(target))]

    # A downgraded CO (no flag) asking about a deferred target: the record wins.
    resp = env.shim.node.NodeGetVolumeStats(stats_req(vid, target, False), timeout=30)
    assert list(resp.usage) == list(answer.usage)
    assert env.runtime.calls == [("stats", str(target))] * 2

    # The runtime's own errors come back unchanged.
    del env.runtime.stats[str(target)]
    fails(env.shim.node.NodeGetVolumeStats, stats_req(vid, target, True), Code.NOT_FOUND, "no sandbox holds")
    # A path the volume is not published at is not asked about.
    fails(env.shim.node.NodeGetVolumeStats, stats_req(vid, env.target("nowhere"), True),
          Code.NOT_FOUND, "volume_path")
    assert len(env.runtime.calls) == 3

    # Expansion: the backend grows the device, the runtime the file system.
    env.controller_expand(vid, 64 * MIB)
    resp = env.shim.node.NodeExpandVolume(expand_req(vid, target, 64 * MIB, True), timeout=60)
    assert resp.capacity_bytes == 64 * MIB
    assert sysblock.size_bytes(device) == 64 * MIB
    assert env.runtime.calls[-1] == ("expand", str(target))
    assert env.runtime.expanded_to == {str(target): 64 * MIB}
    assert fs_mounts(device) == []
    # A repeated publish describes the grown device.
    again = env.publish(vid, target, defer=True).deferred_mount
    assert again.capacity_bytes == 64 * MIB
    assert (again.device, again.device_major, again.device_minor) == \
        (first.device, first.device_major, first.device_minor)

    # The proxy is down: UNAVAILABLE with a message, and nothing falls back to a host mount.
    env.runtime.stop()
    env.runtime.stats[str(target)] = answer
    proxy = str(env.runtime.socket)
    fails(env.shim.node.NodeGetVolumeStats, stats_req(vid, target, True), Code.UNAVAILABLE, "proxy", proxy,
          "unreachable")
    env.controller_expand(vid, 80 * MIB)
    fails(env.shim.node.NodeExpandVolume, expand_req(vid, target, 80 * MIB, True), Code.UNAVAILABLE, proxy,
          "unreachable")
    assert fs_mounts(device) == []
    assert sysmount.at(str(env.staging(vid))) is None
    assert_placeholder(target)

    # A downgraded CO cleans up without the flag.
    env.shim.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path=str(target)),
                                      timeout=60)
    assert mounts_at(target) == [] and not target.exists()
    assert sysmount.at(str(env.private(vid) / "device")) is not None  # still staged
    env.unstage(vid)
    env.assert_released(vid)
