"""Snapshots of deferred volumes taken through the shim while a pod of the
light handler writes to them: the shim has the proxy freeze each volume in
the pod's mount namespace (FIFREEZE, by the handler's freeze holder) around
the driver's CreateSnapshot, and thaws it whatever the driver answered.

The proof is on disk: a volume restored from the snapshot is read on the
host without replaying anything (tests.harness.freeze_images). With the freeze the
file system is clean and the pod's record file ends on a record boundary;
with `crust.dev/freeze: never` the same snapshot is crash-consistent (ext4
needs recovery, xfs's log holds inode records to replay)."""

from __future__ import annotations

import signal
import socket
import time

import grpc
import pytest

from crust.api import csi_pb2, runtime_pb2, runtime_pb2_grpc
from tests.harness.freeze_images import (FREEZE, assert_consistent, assert_crash_consistent, records_written,
                                 restored_image, snapshot, writer_script)
from tests.harness.handler_env import SIZE, Vol, env, make_env, rootfs_of, view  # noqa: F401 - fixtures
from tests.harness.daemons import scrape_metrics, wait_until


def start_writer(env, sandbox_id: str, *volumes) -> list:
    """A pod writing numbered records to each volume in lockstep; the host
    paths of its record files."""
    mounts = [(f"/v{i}", str(v.target)) for i, v in enumerate(volumes)]
    bundle = env.bundle(sandbox_id, writer_script(*(f"/v{i}/records" for i in range(len(volumes)))), mounts)
    info = env.run_ok(bundle, sandbox_id)
    files = [view(info, rootfs_of(bundle) + f"/v{i}/records") for i in range(len(volumes))]
    wait_until(lambda: all(records_written(f) > 50 for f in files), timeout=30, what="the pod's first records")
    return files


def writes_go_on(files, within: float = 15) -> None:
    before = [records_written(f) for f in files]
    wait_until(lambda: all(records_written(f) > b + 20 for f, b in zip(files, before)), timeout=within,
               what="the pod's writes to go on")


def writes_stopped(files, for_seconds: float = 1.5) -> bool:
    before = [records_written(f) for f in files]
    time.sleep(for_seconds)
    return [records_written(f) for f in files] == before


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_a_snapshot_of_a_written_volume_is_clean_with_the_freeze_and_crash_consistent_without(env, fs):
    v = env.volume(f"pv-{fs}", fs)
    files = start_writer(env, f"sb-{fs}", v)

    frozen = snapshot(env, f"snap-{fs}", v.volume_id)   # best-effort: the default
    assert frozen.ready_to_use and frozen.source_volume_id == v.volume_id
    writes_go_on(files)
    count = assert_consistent(restored_image(env, f"from-{fs}", frozen.snapshot_id, fs), fs)
    assert count > 50

    raw = snapshot(env, f"raw-{fs}", v.volume_id, "never")
    assert_crash_consistent(restored_image(env, f"raw-from-{fs}", raw.snapshot_id, fs), fs)
    writes_go_on(files)
    shim_log = env.shim.log_path.read_text()
    assert shim_log.count("volume frozen for a snapshot") == 1 and "volumes thawed after a snapshot" in shim_log


def test_the_storage_class_says_never_unless_the_snapshot_class_says_otherwise(env):
    made = env.proxy.create("pv-sc", SIZE["ext4"], env.cap("ext4"), parameters={FREEZE: "never"})
    assert made.volume_context[FREEZE] == "never"
    v = Vol(made.volume_id, "pv-sc", "ext4", env.proxy.staging("pv-sc"), env.proxy.target("pod-pv-sc", "pv-sc"))
    # As kubelet does: the volume's context at stage and publish.
    env.proxy.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
        volume_id=v.volume_id, staging_target_path=str(v.staging), volume_capability=env.cap("ext4"),
        volume_context=made.volume_context), timeout=60)
    env.proxy.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
        volume_id=v.volume_id, staging_target_path=str(v.staging), target_path=str(v.target),
        volume_capability=env.cap("ext4"), volume_context=made.volume_context, defer_fs_ops=True), timeout=60)
    start_writer(env, "sb-sc", v)
    unfrozen = snapshot(env, "sc-default", v.volume_id)
    assert_crash_consistent(restored_image(env, "sc-from-default", unfrozen.snapshot_id, "ext4"), "ext4")
    frozen = snapshot(env, "sc-best-effort", v.volume_id, "best-effort")
    assert_consistent(restored_image(env, "sc-from-best-effort", frozen.snapshot_id, "ext4"), "ext4")
    with pytest.raises(grpc.RpcError) as caught:
        env.proxy.create("pv-sc-bad", SIZE["ext4"], env.cap("ext4"), parameters={FREEZE: "always"})
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and FREEZE in caught.value.details()


def test_a_group_snapshot_freezes_every_member_and_thaws_them_all(env):
    a, b = env.volume("pv-ga", "ext4"), env.volume("pv-gb", "ext4")
    files = start_writer(env, "sb-group", a, b)
    group = env.shim.group.CreateVolumeGroupSnapshot(csi_pb2.CreateVolumeGroupSnapshotRequest(
        name="group-1", source_volume_ids=[a.volume_id, b.volume_id]), timeout=120).group_snapshot
    writes_go_on(files)
    by_source = {s.source_volume_id: s for s in group.snapshots}
    last = [assert_consistent(restored_image(env, f"g-{i}", by_source[v.volume_id].snapshot_id, "ext4"), "ext4")
            for i, v in enumerate((a, b))]
    # The writer goes a, b, a, b: a frozen cut of both is a moment of it,
    # where a holds the record b is about to get, or both hold the same.
    assert last[0] in (last[1], last[1] + 1), last


def test_bad_freeze_parameter_is_refused_naming_it(env):
    v = env.volume("pv-bad", "ext4")
    with pytest.raises(grpc.RpcError) as caught:
        snapshot(env, "snap-bad", v.volume_id, "sometimes")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f'parameters["{FREEZE}"]' in caught.value.details()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def freezes_counted(port: int) -> dict[str, float]:
    samples = scrape_metrics(port)
    counted = {dict(labels)["outcome"]: value for (name, labels), value in samples.items()
               if name == "crust_shim_snapshot_freezes_total"}
    counted["frozen_snapshots"] = samples[("crust_shim_snapshot_frozen_seconds_count", ())]
    return counted


def test_the_thaw_comes_when_the_driver_fails_or_hangs_past_the_deadline(make_env):
    port = free_port()
    env = make_env(shim_extra=["--metrics-port", str(port)])
    v, other = env.volume("pv-fail", "ext4"), env.volume("pv-other", "ext4")
    files = start_writer(env, "sb-fail", v)
    snapshot(env, "taken", other.volume_id, "never")
    # The name is taken by another volume's snapshot: the driver refuses.
    with pytest.raises(grpc.RpcError) as caught:
        snapshot(env, "taken", v.volume_id)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    writes_go_on(files)

    env.driver.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            snapshot(env, "hangs", v.volume_id, timeout=5)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        writes_go_on(files)
    finally:
        env.driver.proc.send_signal(signal.SIGCONT)
    # The cancelled call's thaw is logged once its answer came (the pod
    # may write on a little before). Two freezes done (frozen and thawed)
    # and timed: the CO sees them.
    wait_until(lambda: env.shim.log_path.read_text().count("volumes thawed after a snapshot") == 2, timeout=20,
               what="the shim to log both thaws")
    assert freezes_counted(port) == {"done": 2.0, "failed": 0.0, "timed_out": 0.0, "frozen_snapshots": 2.0}


def test_freezes_nest_and_a_lost_thaw_ends_by_the_sandbox_timeout(env):
    v = env.volume("pv-nest", "ext4")
    files = start_writer(env, "sb-nest", v)
    with env.proxy.runtime_channel() as channel:
        rt = runtime_pb2_grpc.RuntimeStub(channel)
        first = rt.RuntimeFreezeVolume(runtime_pb2.RuntimeFreezeVolumeRequest(volume_id=v.volume_id,
                                                                              timeout_seconds=60), timeout=30)
        assert [(f.volume_target_path, f.sandbox_id, f.depth) for f in first.frozen] == [
            (str(v.target), "sb-nest", 1)]
        assert rt.RuntimeFreezeVolume(runtime_pb2.RuntimeFreezeVolumeRequest(
            volume_id=v.volume_id), timeout=30).frozen[0].depth == 2
        assert writes_stopped(files)
        one = rt.RuntimeThawVolume(runtime_pb2.RuntimeThawVolumeRequest(volume_id=v.volume_id), timeout=30)
        assert [(t.depth, t.was_frozen) for t in one.thawed] == [(1, True)]
        assert writes_stopped(files, 1.0)
        rt.RuntimeThawVolume(runtime_pb2.RuntimeThawVolumeRequest(volume_id=v.volume_id), timeout=30)
        writes_go_on(files)

        with pytest.raises(grpc.RpcError) as caught:
            rt.RuntimeFreezeVolume(runtime_pb2.RuntimeFreezeVolumeRequest(volume_id=v.volume_id,
                                                                          timeout_seconds=601), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_seconds" in \
            caught.value.details()
        assert rt.RuntimeFreezeVolume(runtime_pb2.RuntimeFreezeVolumeRequest(
            volume_id="no-such-volume"), timeout=30).frozen == []

        # No thaw is sent: the holder ends the freeze by itself and says so.
        rt.RuntimeFreezeVolume(runtime_pb2.RuntimeFreezeVolumeRequest(volume_id=v.volume_id,
                                                                      timeout_seconds=3), timeout=30)
        assert writes_stopped(files, 1.0)
        writes_go_on(files, within=20)
        late = rt.RuntimeThawVolume(runtime_pb2.RuntimeThawVolumeRequest(volume_id=v.volume_id), timeout=30)
        assert [t.was_frozen for t in late.thawed] == [False]
    assert "file system thawed by itself after its freeze timed out" in env.handler.log_path.read_text()


def test_a_volume_frozen_when_its_handler_is_killed_thaws(env):
    v = env.volume("pv-kill", "xfs")
    files = start_writer(env, "sb-kill", v)
    with env.proxy.runtime_channel() as channel:
        runtime_pb2_grpc.RuntimeStub(channel).RuntimeFreezeVolume(runtime_pb2.RuntimeFreezeVolumeRequest(
            volume_id=v.volume_id, timeout_seconds=600), timeout=30)
    assert writes_stopped(files)
    env.handler.kill()
    writes_go_on(files, within=10)
    assert "the handler went away" in env.handler.log_path.read_text()

    # With its handler gone the volume cannot be frozen: `required` refuses
    # the snapshot, the default takes it crash-consistent and says so.
    with pytest.raises(grpc.RpcError) as caught:
        snapshot(env, "must-freeze", v.volume_id, "required")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert v.volume_id in caught.value.details() and "required" in caught.value.details()
    assert snapshot(env, "may-freeze", v.volume_id).ready_to_use
    assert "could not freeze the volume; the snapshot is crash-consistent" in env.shim.log_path.read_text()
