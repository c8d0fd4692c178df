"""`crust shim` end to end, restarts: a shim killed (SIGKILL) in the middle of
a volume's lifecycle picks it up again when restarted, and a restart drops a
deferred publish whose placeholder vanished. The set-up is
tests/harness/shim.py.
"""

from __future__ import annotations

import subprocess

from tests.harness.shim import assert_device_node_bind, assert_placeholder, fs_mounts, mounts_at
from tests.harness.shim import env  # noqa: F401 - a fixture


# -- restarts -----------------------------------------------------------------------------------


def test_sigkill_mid_lifecycle_then_restart(env):
    vid = env.create("restart", "ext4")
    env.stage(vid)
    device = env.only_loop(vid)

    # Killed right after stage: the record on disk is complete and consistent.
    env.shim.kill()
    rec = env.record(vid)
    assert (rec["volume_id"], rec["staging_path"], rec["fs_type"]) == (vid, str(env.staging(vid)), "ext4")
    assert rec["backend_target"] == str(env.private(vid) / "device") and rec["published"] == {}
    assert not [p for p in env.record_file(vid).parent.iterdir() if p.suffix != ".json"]
    env.shim.start()
    assert_device_node_bind(env.private(vid) / "device", device)
    env.stage(vid)  # a repeat after restart is idempotent
    assert env.only_loop(vid) == device

    # Killed after a deferred publish: publish again is idempotent.
    target = env.target("a")
    first = env.publish(vid, target, defer=True)
    env.shim.kill()
    env.shim.start()
    again = env.publish(vid, target, defer=True)
    assert again.SerializeToString() == first.SerializeToString()
    assert len(mounts_at(target)) == 1
    assert_placeholder(target)
    assert env.record(vid)["published"] == {str(target): {
        "deferred": True, "readonly": False, "supplemental_group": "",
        "supplemental_group_change_policy": "", "mount_group": ""}}
    assert fs_mounts(device) == []

    env.shim.kill()
    env.shim.start()
    env.unpublish(vid, target)
    assert mounts_at(target) == []
    env.unstage(vid)
    env.assert_released(vid)


def test_restart_drops_a_publish_whose_placeholder_vanished(env):
    vid = env.create("vanish", "ext4")
    env.stage(vid)
    target, kept = env.target("gone"), env.target("kept")
    env.publish(vid, target, defer=True, readonly=True)
    env.publish(vid, kept, defer=True, readonly=True)
    env.shim.kill()
    subprocess.run(["umount", "--", str(target)], check=True)  # e.g. a reboot, or a human
    env.shim.start()
    assert list(env.record(vid)["published"]) == [str(kept)]

    # The dropped target no longer blocks a writer once the kept one is gone too.
    env.unpublish(vid, kept)
    writer = env.target("writer")
    env.publish(vid, writer, defer=True)
    env.unpublish(vid, writer)
    env.unpublish(vid, target)  # idempotent: nothing mounted there any more
    env.unstage(vid)
    env.assert_released(vid)
