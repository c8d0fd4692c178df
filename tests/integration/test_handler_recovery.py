"""`crust handler` when things change behind its back: mounts, restarts, dying sandboxes.

Real driver -> shim -> proxy processes and a real handler
(tests.harness.handler_env). The volume condition follows the kernel when a mount
is remounted or unmounted inside the sandbox by someone else; a running
sandbox survives its handler's death and restart, keeps its claim and its
stats, and the restarted handler indexes what was published while it was
down; a handler killed and started at once takes its name and its claims
back with its lease; a sandbox that died while the handler was down is
released when the handler comes back. What is asserted is what the kernel
and the proxy say: /proc/<pid>/mountinfo, processes alive or gone, gRPC
codes, the proxy's claims and handler leases.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess

import grpc
import pytest

from crust.api import csi_pb2
from tests.harness.handler_env import entries_of, env, make_env, rootfs_of, short_lease, view  # noqa: F401 - fixtures
from tests.harness.daemons import pid_alive, wait_until

Code = grpc.StatusCode
Usage = csi_pb2.VolumeUsage


# -- the kernel, not the handler's memory --------------------------------------------------------


def test_stats_follow_the_kernel_when_the_mount_changes_behind_the_handler(env):
    """The condition is asked of the kernel on every call: a volume remounted
    read-only, or unmounted, inside the sandbox by someone else shows at once
    through the proxy, and so does its recovery."""
    v = env.volume("pv-cond")
    a = env.run_ok(env.bundle("cond", "exec sleep 600", [("/data", str(v.target))]), "sb-cond")
    mount_point = a["volumes"][0]["mount_point"]
    inside = ["nsenter", f"--target={a['pid']}", "--mount", "--"]

    def condition() -> csi_pb2.VolumeCondition:
        return env.proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
            volume_id=v.volume_id, volume_path=str(v.target)), timeout=30).volume_condition

    assert not condition().abnormal
    subprocess.run(inside + ["mount", "-o", "remount,ro", mount_point], check=True)
    c = condition()
    assert c.abnormal and "read-only" in c.message
    subprocess.run(inside + ["mount", "-o", "remount,rw", mount_point], check=True)
    assert not condition().abnormal
    subprocess.run(inside + ["umount", mount_point], check=True)
    c = condition()
    assert c.abnormal and "not mounted" in c.message
    env.delete("sb-cond")
    assert env.mounting(v) == []
    env.unpublish(v)


# -- handler restarts ------------------------------------------------------------------------------


def test_a_sandbox_survives_a_handler_restart(short_lease):
    env = short_lease
    v = env.volume("pv-keep")
    bundle = env.bundle("keep", "echo before > /data/a.txt && exec sleep 600", [("/data", str(v.target))])
    a = env.run_ok(bundle, "sb-keep")
    mount_point = a["volumes"][0]["mount_point"]
    wait_until((view(a, mount_point) / "a.txt").exists, what="the sandbox process's file")

    env.kill_handler_until_expired()
    down = env.volume("pv-down")  # published while the handler is down
    # The sandbox runs on without its handler, and its claim holds (its
    # holder lives) although the handler's lease expired.
    assert pid_alive(a["pid"]) and pid_alive(a["process_pid"])
    assert len(entries_of(a["pid"], v.majmin)) == 2
    assert env.claim_set() == {(str(v.target), "mountns", "sb-keep")}
    with pytest.raises(grpc.RpcError) as exc:
        env.unpublish(v)
    assert exc.value.code() == Code.UNAVAILABLE

    env.restart_handler()
    h = env.handlers()["mountns"]
    assert not h.lease_expired and h.lease_age_seconds < 3
    listed = env.sandboxes()
    assert list(listed) == ["sb-keep"] and listed["sb-keep"]["pid"] == a["pid"]
    assert listed["sb-keep"]["state"] == "RUNNING"
    (claim,) = env.claims()
    assert (claim.target_path, claim.sandbox_id, claim.sandbox_pid) == (str(v.target), "sb-keep", a["pid"])

    # Stats through the proxy are still measured inside the sandbox.
    stats = env.proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=v.volume_id, volume_path=str(v.target)), timeout=30)
    assert not stats.volume_condition.abnormal and "sandbox" in stats.volume_condition.message
    by_unit = {u.unit: u for u in stats.usage}
    sv = os.statvfs(view(a, mount_point))
    assert by_unit[Usage.BYTES].total == sv.f_blocks * sv.f_frsize
    assert by_unit[Usage.INODES].total == sv.f_files

    # The restarted handler indexes the volumes published while it was down
    # and after it came back: a new sandbox mounts both.
    w = env.volume("pv-new")
    n = env.run_ok(env.bundle("new", "echo after > /w/b.txt && echo down > /d/c.txt && exec sleep 600",
                              [("/w", str(w.target)), ("/d", str(down.target))]), "sb-new")
    assert sorted(x["target_path"] for x in n["volumes"]) == sorted([str(w.target), str(down.target)])
    wait_until((view(n, rootfs_of(env.path / "bundles" / "new")) / "d" / "c.txt").exists,
               what="the new sandbox's file")
    for x in (w, down):
        assert len(entries_of(n["pid"], x.majmin)) == 2 and entries_of("self", x.majmin) == []
    assert env.claim_set() == {(str(v.target), "mountns", "sb-keep"), (str(w.target), "mountns", "sb-new"),
                               (str(down.target), "mountns", "sb-new")}
    env.delete("sb-new")
    assert env.mounting(w) == [] and env.mounting(down) == []

    # Deleting the survivor after the restart stops its process, unmounts and releases.
    env.delete("sb-keep")
    assert env.claims() == [] and env.sandboxes() == {}
    assert not pid_alive(a["pid"])
    wait_until(lambda: not pid_alive(a["process_pid"]), timeout=5, what="the container process to die")
    assert env.mounting(v) == []
    for x in (v, w, down):
        env.unpublish(x)
    env.publish_on_host(v)
    assert (v.target / "a.txt").read_text() == "before\n"
    env.unpublish(v)


def test_a_handler_killed_and_started_at_once_comes_back_under_its_lease(env):
    """The lease is the handler's identity: kept in its state directory
    (0600), it lets the restarted handler take its name and its sandbox's
    claim back at once, while its old lease is still alive (without it the
    proxy refuses the name until the lease expires)."""
    v = env.volume("pv-again")
    a = env.run_ok(env.bundle("again", "exec sleep 600", [("/data", str(v.target))]), "sb-again")
    lease_file = env.handler.state_dir / "lease"
    assert stat.S_IMODE(os.lstat(lease_file).st_mode) == 0o600
    lease = lease_file.read_text()
    record = env.proxy.state_dir / "handlers" / "mountns.json"
    assert lease not in record.read_text(), "the proxy keeps a hash, not the lease"

    env.handler.kill()
    assert not env.handlers()["mountns"].lease_expired
    env.handler.start()
    wait_until(lambda: env.handler.sandbox("list").returncode == 0, what="the handler's socket")
    wait_until(lambda: env.handlers()["mountns"].lease_age_seconds < 2, timeout=10, what="a renewed lease")
    assert lease_file.read_text() == lease
    log = env.handler.log_path.read_text()
    assert "our name is held by another live handler" not in log and lease not in log
    (claim,) = env.claims()
    assert (claim.target_path, claim.sandbox_id, claim.sandbox_pid) == (str(v.target), "sb-again", a["pid"])
    stats = env.proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=v.volume_id, volume_path=str(v.target)), timeout=30)
    assert not stats.volume_condition.abnormal
    env.delete("sb-again")
    assert env.claims() == []
    env.unpublish(v)


def test_a_sandbox_that_died_while_the_handler_was_down_is_released(short_lease):
    env = short_lease
    v = env.volume("pv-dead")
    a = env.run_ok(env.bundle("dead", "echo x > /data/x && exec sleep 600", [("/data", str(v.target))]), "sb-dead")
    wait_until((view(a, a["volumes"][0]["mount_point"]) / "x").exists, what="the sandbox process's file")

    env.kill_handler_until_expired()
    os.kill(a["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(a["pid"]), what="the holder to die")
    # The container process still pins the file system in its namespace.
    assert env.mounting(v) == [a["process_pid"]]
    assert env.claim_set() == {(str(v.target), "mountns", "sb-dead")}, "the claim stays until released"

    env.restart_handler()
    wait_until(lambda: env.claims() == [], what="the dead sandbox's claim to be released")
    assert env.sandboxes() == {}
    assert not pid_alive(a["process_pid"]) and env.mounting(v) == []
    # The volume is free again: a new sandbox takes it, then kubelet unpublishes.
    b = env.run_ok(env.bundle("after", "cat /data/x", [("/data", str(v.target))]), "sb-after")
    env.wait_exited("sb-after")
    assert env.process_log("sb-after") == "x\n"
    assert env.claim_set() == {(str(v.target), "mountns", "sb-after")}
    env.delete("sb-after")
    assert not pid_alive(b["pid"])
    env.unpublish(v)
