"""Snapshots of deferred volumes mounted by a microVM's guest, taken
through the shim while the pod writes: the proxy has the microVM handler
freeze each file system in the guest (its agent's FIFREEZE, bounded by the
agent's own timer) around the driver's CreateSnapshot. One VM, an ext4 and
an xfs volume written in lockstep; the restored images are read on the
host without replaying anything (tests.harness.freeze_images)."""

from __future__ import annotations

import grpc

from crust.api import runtime_pb2, runtime_pb2_grpc
from tests.harness.freeze_images import (assert_consistent, assert_crash_consistent, progress, restored_image, snapshot,
                                 writer_script)
from tests.harness.daemons import wait_until
from tests.harness.kata_env import kenv  # noqa: F401 - a fixture


def test_snapshots_of_a_microvms_volumes_are_clean_with_the_freeze(kenv):
    e, x = kenv.volume("pv-me", "ext4"), kenv.volume("pv-mx", "xfs")
    bundle = kenv.bundle("mf", writer_script("/e/records", "/x/records"), [("/e", str(e.target)),
                                                                          ("/x", str(x.target))])
    kenv.run_ok(bundle, "sb-mf")

    def written() -> int:
        return progress(kenv.console("sb-mf"))

    def goes_on(within: float = 60) -> None:
        start = written()
        wait_until(lambda: written() >= start + 64, timeout=within, interval=0.2, what="the pod's writes to go on")

    goes_on(180)
    for v in (e, x):
        taken = snapshot(kenv, f"snap-{v.fs}", v.volume_id)
        goes_on()
        assert assert_consistent(restored_image(kenv, f"from-{v.fs}", taken.snapshot_id, v.fs), v.fs) >= 64
    raw = snapshot(kenv, "raw-ext4", e.volume_id, "never")
    assert_crash_consistent(restored_image(kenv, "raw-from-ext4", raw.snapshot_id, "ext4"), "ext4")
    assert kenv.shim.log_path.read_text().count("volume frozen for a snapshot") == 2

    # A freeze whose thaw never comes: the guest's agent ends it by itself.
    with kenv.proxy.runtime_channel() as channel:
        rt = runtime_pb2_grpc.RuntimeStub(channel)
        frozen = rt.RuntimeFreezeVolume(runtime_pb2.RuntimeFreezeVolumeRequest(
            volume_id=e.volume_id, timeout_seconds=5), timeout=30).frozen
        assert [(f.sandbox_id, f.handler, f.depth) for f in frozen] == [("sb-mf", "kata", 1)]
        goes_on(60)
        kenv.wait_console("sb-mf", "thawed by itself after its freeze timed out", timeout=30)
        late = rt.RuntimeThawVolume(runtime_pb2.RuntimeThawVolumeRequest(volume_id=e.volume_id), timeout=30)
        assert [t.was_frozen for t in late.thawed] == [False]
        try:
            rt.RuntimeFreezeVolume(runtime_pb2.RuntimeFreezeVolumeRequest(volume_id=e.volume_id,
                                                                          timeout_seconds=700), timeout=30)
            raise AssertionError("a freeze of 700 s was taken")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_seconds" in exc.details()
