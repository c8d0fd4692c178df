"""Who answers `crust proxy`'s volume stats and expansion: the claiming handler, a runtime CLI, or nobody yet.

A real driver -> shim -> proxy stack (tests.harness.proxy_runtime_env), handlers
that serve (tests.harness.handler_server) and runtime CLIs that are small shell
scripts. A claimed volume is answered by its handler, whose errors come
back unchanged, and a dead handler is UNAVAILABLE quickly and answered at
once when it is back, even after a long outage; an unclaimed volume is
answered by its runtime-cli (argv, JSON, failures and a hang checked), or
is "starting" within the grace period and FAILED_PRECONDITION after it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc

from crust.api import csi_pb2
from tests.harness.handler_server import stats_response
from tests.harness.proxy_runtime_env import GIB, env, failure  # noqa: F401 - env: the stack fixture

Code = grpc.StatusCode
Usage = csi_pb2.VolumeUsage


# -- routing: handler and runtime-cli ------------------------------------------------------


def test_stats_and_expansion_are_answered_by_the_claiming_handler(env):
    e = env()
    target, unknown = e.target("routed"), e.target("unknown")
    e.stage(target)
    e.stage(unknown)
    h = e.register("kata", serve=True, stats={target: stats_response(10 * GIB, 3 * GIB, inodes=5000,
                                                                     inodes_used=17, message="inside sb-1")})
    e.claim(target, "kata", "sb-1")
    e.claim(unknown, "kata", "sb-2")

    rsp = e.stats(target)
    assert [(u.unit, u.total, u.used, u.available) for u in rsp.usage] == [
        (Usage.BYTES, 10 * GIB, 3 * GIB, 7 * GIB), (Usage.INODES, 5000, 17, 4983)]
    assert rsp.volume_condition.abnormal is False and rsp.volume_condition.message == "inside sb-1"
    assert ("GetVolumeStats", target, "sb-1") in h.calls

    assert e.expand(target, 5 * GIB, 6 * GIB) == 5 * GIB
    (req,) = h.expand_requests
    assert (req.target_path, req.sandbox_id) == (target, "sb-1")
    assert (req.capacity_range.required_bytes, req.capacity_range.limit_bytes) == (5 * GIB, 6 * GIB)

    # The handler's own error comes back unchanged.
    exc = failure(e.stats, unknown)
    assert exc.code() == Code.NOT_FOUND and "no sandbox of kata mounts" in exc.details()

    h.stop()
    for call in (lambda: e.stats(target), lambda: e.expand(target, 6 * GIB)):
        started = time.monotonic()
        exc = failure(call)
        assert time.monotonic() - started < 12
        assert exc.code() == Code.UNAVAILABLE and "kata" in exc.details(), exc.details()


def test_a_restarted_handler_is_answered_at_once_after_a_long_outage(env):
    """The proxy's channel to a dead handler backs off between connection
    attempts; the restarted handler must not wait out that backoff."""
    e = env()
    target = e.target("outage")
    e.stage(target)
    h = e.register("kata", serve=True, default_stats=stats_response(GIB, 1))
    e.claim(target, "kata", "sb-1")
    assert e.stats(target).usage[0].total == GIB

    h.stop()
    outage = time.monotonic() + 8  # gRPC's stock backoff would be ~5 s by now
    while time.monotonic() < outage:
        assert failure(e.stats, target).code() == Code.UNAVAILABLE
        time.sleep(0.2)
    h.start()
    h.register(e.channel, keep_lease=True)  # the restarted handler, with its lease
    assert e.stats(target).usage[0].total == GIB  # the first call, no retry
    # Back without a new lease (the same handler's server came back): within a second.
    h.stop()
    assert failure(e.stats, target).code() == Code.UNAVAILABLE
    h.start()
    deadline = time.monotonic() + 3
    while True:
        try:
            assert e.stats(target).usage[0].total == GIB
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the proxy did not reconnect within 3 s"
            time.sleep(0.1)


def test_runtime_cli_answers_for_an_unclaimed_volume(env):
    e = env()
    target = e.target("cli")
    e.stage(target)
    argv_file = e.path / "cli-argv"
    cli = e.script("rt-cli", f"""\
printf '%s\\n' "$0" "$@" > {argv_file}
case "$2" in
  stats) echo '{{"usage": [{{"unit": "BYTES", "total": "5000", "used": "1200", "available": "3800"}},
                          {{"unit": "INODES", "total": "64", "used": "3", "available": "61"}}],
                "volumeCondition": {{"abnormal": true, "message": "cli says so"}}}}' ;;
  resize) printf '{{"capacity_bytes": %s}}\\n' "$4" ;;
esac
""")
    (e.entry(target) / "runtime-cli").write_text(f"{cli}\n")

    rsp = e.stats(target)
    assert argv_file.read_text().splitlines() == [str(cli), "crust", "stats", target]
    assert [(u.unit, u.total, u.used, u.available) for u in rsp.usage] == [
        (Usage.BYTES, 5000, 1200, 3800), (Usage.INODES, 64, 3, 61)]
    assert rsp.volume_condition.abnormal is True and rsp.volume_condition.message == "cli says so"

    assert e.expand(target, 2 * GIB, 3 * GIB) == 2 * GIB
    assert argv_file.read_text().splitlines() == [str(cli), "crust", "resize", target, str(2 * GIB), str(3 * GIB)]

    garbage = e.script("garbage-cli", "echo 'this is not { json'\n")
    (e.entry(target) / "runtime-cli").write_text(str(garbage))
    exc = failure(e.stats, target)
    assert exc.code() == Code.INTERNAL and "JSON" in exc.details() and str(garbage) in exc.details()
    exc = failure(e.expand, target, GIB)
    assert exc.code() == Code.INTERNAL

    failing = e.script("failing-cli", "echo 'sandbox is gone' >&2\nexit 3\n")
    (e.entry(target) / "runtime-cli").write_text(str(failing))
    exc = failure(e.stats, target)
    assert exc.code() == Code.UNAVAILABLE and "sandbox is gone" in exc.details()

    # Not an absolute path: not a CLI.
    (e.entry(target) / "runtime-cli").write_text("rt-cli")
    rsp = e.stats(target)
    assert rsp.volume_condition.abnormal is False and "starting" in rsp.volume_condition.message

    # Once a handler claims the volume, the handler answers, not the CLI.
    (e.entry(target) / "runtime-cli").write_text(str(cli))
    argv_file.unlink()
    e.register("kata", serve=True, default_stats=stats_response(100, 1))
    e.claim(target, "kata", "sb-1")
    assert e.stats(target).usage[0].total == 100
    assert not argv_file.exists()


def test_a_runtime_cli_that_hangs_is_unavailable_after_its_timeout(env):
    e = env()
    target = e.target("slow")
    e.stage(target)
    pid_file = e.path / "slow-cli.pid"
    slow = e.script("slow-cli", f"echo $$ > {pid_file}\nexec sleep 30\n")
    (e.entry(target) / "runtime-cli").write_text(str(slow))
    started = time.monotonic()
    try:
        exc = failure(e.stats, target, timeout=30)
        took = time.monotonic() - started
        assert exc.code() == Code.UNAVAILABLE and "did not answer" in exc.details(), exc.details()
        assert 5 < took < 15, took
        pid = int(pid_file.read_text())
        assert not Path(f"/proc/{pid}").exists(), "the proxy left the CLI running"
    finally:
        if pid_file.exists() and Path(f"/proc/{pid_file.read_text().strip()}").exists():
            cmdline = Path(f"/proc/{pid_file.read_text().strip()}/cmdline").read_bytes()
            if b"sleep" in cmdline:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_an_unclaimed_volume_without_cli_is_starting_within_the_grace_period(env):
    e = env()
    target = e.target("starting")
    e.stage(target)
    rsp = e.stats(target)
    assert list(rsp.usage) == []
    assert rsp.volume_condition.abnormal is False and "still starting" in rsp.volume_condition.message
    exc = failure(e.expand, target, GIB)
    assert exc.code() == Code.UNAVAILABLE and "not mounted by a sandbox yet" in exc.details()
    exc = failure(e.stats, e.target("never-staged"))
    assert exc.code() == Code.NOT_FOUND


def test_an_unclaimed_volume_after_the_grace_period_is_failed_precondition(env):
    e = env("--claim-grace-seconds", "0")
    target = e.target("late")
    e.stage(target)
    time.sleep(0.05)
    exc = failure(e.stats, target)
    assert exc.code() == Code.FAILED_PRECONDITION and "no sandbox has claimed" in exc.details()
    exc = failure(e.expand, target, GIB)
    assert exc.code() == Code.FAILED_PRECONDITION and target in exc.details()
