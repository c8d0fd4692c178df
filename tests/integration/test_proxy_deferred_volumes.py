"""A deferred volume after its publish: restarts, the runtime's answers, unpublish.

Real `crust driver` -> `crust shim` -> `crust proxy` processes with a policy
that defers on a storage class parameter (tests.harness.proxy_csi), and a
runtime handler (tests.harness.handler_server) registered through the proxy's real
registry. The decision on disk survives a proxy restart and adds the
defer_fs_ops flag kubelet leaves out of NodeGetVolumeStats,
NodeExpandVolume and NodeUnpublishVolume; stats and expansion are answered
by the handler whose sandbox claimed the volume; an unpublish waits while a
sandbox holds the volume, then removes everything; a restart after /run
was wiped rebuilds the watched directory for the targets still published
only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import grpc

from crust.api import csi_pb2, registry_pb2
from crust.contract.mountinfo import kata_name
from crust.sys import blockdev as sysblock
from tests.harness.daemons import MIB
from tests.harness.proxy_csi import (  # noqa: F401 - handler: a fixture
    DEFER_PARAM,
    DEFER_POLICY,
    assert_decision,
    assert_no_trace,
    assert_placeholder,
    decision_file,
    digest,
    entry_dir,
    fails,
    fs_mounts,
    handler,
    kata_dir,
    loop_of,
    mode,
    new_volume,
    publish,
    record_file,
    registry,
    shim_requests,
    start_stack,
    target_of,
)

Code = grpc.StatusCode
Usage = csi_pb2.VolumeUsage


# -- the decision on disk, a restart, and the runtime answering ----------------------------------------


def test_decision_survives_a_restart_and_the_runtime_answers_stats_and_expand(root, handler):
    driver, shim, proxy = start_stack(root, DEFER_POLICY)
    a = new_volume(proxy, "pv-a")
    target = target_of(proxy, a, "pod-a")
    publish(proxy, a, target, ctx={DEFER_PARAM: "true"})
    assert_decision(proxy, target, a, f"volume_context {DEFER_PARAM}=true")
    before = decision_file(proxy, target).read_bytes()

    proxy.restart()
    assert decision_file(proxy, target).read_bytes() == before
    assert_placeholder(target)

    handler.register(proxy.runtime_channel())
    claimed = json.loads(handler.claim(proxy.runtime_channel(), target, "sb-restart").mount_info_json)
    assert claimed["target-path"] == str(target) and claimed["volume-id"] == a.id

    # Kubelet (no flag) asks for stats: the numbers are the handler's.
    stats = proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=a.id, volume_path=str(target)), timeout=30)
    by_unit = {u.unit: u for u in stats.usage}
    assert (by_unit[Usage.BYTES].total, by_unit[Usage.BYTES].used, by_unit[Usage.BYTES].available) == \
        (987_654_321, 123_456_789, 987_654_321 - 123_456_789)
    assert (by_unit[Usage.INODES].total, by_unit[Usage.INODES].used) == (40_000, 1_234)
    assert stats.volume_condition.message == "measured inside sb" and not stats.volume_condition.abnormal
    assert ("GetVolumeStats", str(target), "sb-restart") in handler.calls

    # Expansion: the controller grows the volume, kubelet (no flag) asks the
    # node; the device grows on the host, the file system in the sandbox.
    proxy.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
        volume_id=a.id, capacity_range=csi_pb2.CapacityRange(required_bytes=48 * MIB),
        volume_capability=a.cap), timeout=60)
    expanded = proxy.node.NodeExpandVolume(csi_pb2.NodeExpandVolumeRequest(
        volume_id=a.id, volume_path=str(target), capacity_range=csi_pb2.CapacityRange(required_bytes=48 * MIB),
        volume_capability=a.cap), timeout=60)
    assert expanded.capacity_bytes == 48 * MIB
    assert [(r.target_path, r.sandbox_id, r.capacity_range.required_bytes) for r in handler.expand_requests] == \
        [(str(target), "sb-restart", 48 * MIB)]
    assert sysblock.size_bytes(loop_of(driver, a.id)) == 48 * MIB
    assert fs_mounts(loop_of(driver, a.id)) == []
    # The proxy added the flag kubelet left out, from the decision on disk.
    for rpc in ("NodeGetVolumeStats", "NodeExpandVolume"):
        assert [r.get("defer_fs_ops", False) for r in shim_requests(shim, rpc)] == [True], rpc

    # Unpublish without the flag once the sandbox let go: all gone.
    handler.release(proxy.runtime_channel(), target, "sb-restart")
    proxy.unpublish(a.id, target)
    assert_no_trace(proxy, target)
    assert not target.exists()
    assert [r.get("defer_fs_ops", False) for r in shim_requests(shim, "NodeUnpublishVolume")] == [True]


# -- unpublish against a live sandbox ----------------------------------------------------------------------


def test_unpublish_waits_for_the_sandbox_then_removes_everything(root, handler):
    driver, shim, proxy = start_stack(root, DEFER_POLICY)
    a = new_volume(proxy, "pv-a")
    target = target_of(proxy, a, "pod-a")
    publish(proxy, a, target, ctx={DEFER_PARAM: "true"})
    channel = proxy.runtime_channel()
    handler.register(channel)
    handler.claim(channel, target, "sb-holding")
    marker = kata_dir(proxy, target) / "sb-holding"
    assert marker.is_file() and marker.stat().st_size == 0

    fails(proxy.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(volume_id=a.id,
          target_path=str(target)), Code.UNAVAILABLE, "sb-holding", "mountns")
    # The handler was asked about its sandbox before the refusal (only it
    # sees whether the sandbox is over).
    assert ("GetSandbox", "sb-holding", "") in handler.calls
    assert_placeholder(target)
    assert (entry_dir(proxy, target) / "mountInfo.json").is_file()
    assert marker.is_file()
    assert decision_file(proxy, target).is_file() and record_file(proxy, target).is_file()
    assert shim_requests(shim, "NodeUnpublishVolume") == []  # the plugin was not asked

    handler.release(channel, target, "sb-holding")
    assert not marker.exists()
    proxy.unpublish(a.id, target)
    assert_no_trace(proxy, target)
    assert not target.exists()
    assert os.listdir(proxy.volumes_dir) == [] and os.listdir(proxy.kata_dir) == []
    proxy.unpublish(a.id, target)  # idempotent
    channel.close()


# -- restart after /run was wiped ---------------------------------------------------------------------------


def test_restart_rebuilds_the_wiped_volumes_dir_for_published_targets_only(root, handler):
    driver, shim, proxy = start_stack(root, DEFER_POLICY)
    a, b = new_volume(proxy, "pv-a"), new_volume(proxy, "pv-b")
    target_a, target_b = target_of(proxy, a, "pod-a"), target_of(proxy, b, "pod-b")
    publish(proxy, a, target_a, ctx={DEFER_PARAM: "true"})
    publish(proxy, b, target_b, ctx={DEFER_PARAM: "true"})
    handler.register(proxy.runtime_channel())
    handler.claim(proxy.runtime_channel(), target_a, "sb-a")
    entry_a = (entry_dir(proxy, target_a) / "mountInfo.json").read_bytes()
    mirror_a = (kata_dir(proxy, target_a) / "mountInfo.json").read_bytes()

    # Reboot of /run while the proxy is down; kubelet cleaned up pod-b.
    proxy.stop()
    shutil.rmtree(proxy.volumes_dir)
    shutil.rmtree(proxy.kata_dir)
    subprocess.run(["umount", str(target_b)], check=True)  # the placeholder this test's stack mounted
    target_b.rmdir()
    proxy.start()

    assert mode(proxy.volumes_dir) == 0o700
    assert (entry_dir(proxy, target_a) / "mountInfo.json").read_bytes() == entry_a
    assert mode(entry_dir(proxy, target_a)) == 0o700 and mode(entry_dir(proxy, target_a) / "mountInfo.json") == 0o600
    assert (kata_dir(proxy, target_a) / "mountInfo.json").read_bytes() == mirror_a
    assert (kata_dir(proxy, target_a) / "sb-a").is_file()  # the claim's marker comes back too
    assert os.listdir(proxy.volumes_dir) == [digest(target_a)]
    assert os.listdir(proxy.kata_dir) == [kata_name(str(target_a))]
    assert not record_file(proxy, target_b).exists() and not decision_file(proxy, target_b).exists()
    assert record_file(proxy, target_a).exists() and decision_file(proxy, target_a).exists()
    volumes = registry(proxy).ListVolumes(registry_pb2.ListVolumesRequest(), timeout=10).volumes
    assert [(v.target_path, v.claim.sandbox_id) for v in volumes] == [(str(target_a), "sb-a")]
