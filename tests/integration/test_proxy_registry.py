"""`crust proxy`'s handler registry: leases and claims.

A real driver -> shim -> proxy stack (tests.harness.proxy_runtime_env) with
handlers registered over the runtime socket (tests.harness.handler_server). Leases:
registration, heartbeats, expiry, refusals, and a lease that outlives a
proxy restart (only its hash is kept) so nobody else takes the name.
Claims: one sandbox per volume, the Kata sandbox marker, refused claims,
restaging and unstaging while claimed, claims surviving concurrent
restaging and a restart, and a claim whose holder is gone taken over. What
is asserted is gRPC codes and messages, the registry's listings and the
files on disk.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time

import grpc

from crust.api import registry_pb2, runtime_pb2_grpc
from tests.harness.handler_server import HandlerServer
from tests.harness.proxy_runtime_env import b64, env, failure  # noqa: F401 - env: the stack fixture

Code = grpc.StatusCode


# -- registry: leases -----------------------------------------------------------------------


def test_register_heartbeat_and_lease_expiry(env):
    e = env("--lease-seconds", "2")
    rsp = e.registry.RegisterHandler(registry_pb2.RegisterHandlerRequest(
        name="mountns", endpoint=f"unix://{e.path}/mountns.sock", filesystems=["ext4"], features=["stats"]),
        timeout=10)
    assert rsp.lease_id and rsp.lease_seconds == 2
    beat = registry_pb2.HeartbeatRequest(name="mountns", lease_id=rsp.lease_id)

    for _ in range(6):  # 3 s of heartbeats: longer than the lease
        assert e.registry.Heartbeat(beat, timeout=10).lease_seconds == 2
        time.sleep(0.5)
    h = e.handlers_listed()["mountns"]
    assert not h.lease_expired and h.lease_age_seconds < 1.5
    assert list(h.filesystems) == ["ext4"] and h.endpoint == f"unix://{e.path}/mountns.sock"

    wrong = failure(e.registry.Heartbeat, registry_pb2.HeartbeatRequest(name="mountns", lease_id="nope"), timeout=10)
    assert wrong.code() == Code.PERMISSION_DENIED and "lease" in wrong.details()
    unknown = failure(e.registry.Heartbeat, registry_pb2.HeartbeatRequest(name="other", lease_id=rsp.lease_id),
                      timeout=10)
    assert unknown.code() == Code.NOT_FOUND and "register again" in unknown.details()

    time.sleep(2.6)
    h = e.handlers_listed()["mountns"]
    assert h.lease_expired and h.lease_age_seconds > 2
    text = e.status()
    assert text.returncode == 0 and "lease expired" in text.stdout, text.stdout + text.stderr

    e.registry.Heartbeat(beat, timeout=10)
    assert not e.handlers_listed()["mountns"].lease_expired

    for request, field in (
            (registry_pb2.RegisterHandlerRequest(name="a/b", endpoint=f"unix://{e.path}/x.sock"), "name"),
            (registry_pb2.RegisterHandlerRequest(name="", endpoint=f"unix://{e.path}/x.sock"), "name"),
            (registry_pb2.RegisterHandlerRequest(name="x", endpoint="x.sock"), "endpoint"),
            (registry_pb2.RegisterHandlerRequest(name="x"), "endpoint")):
        exc = failure(e.registry.RegisterHandler, request, timeout=10)
        assert exc.code() == Code.INVALID_ARGUMENT and field in exc.details(), exc.details()


def test_a_restart_keeps_leases_and_claims(env):
    """The lease is the handler's identity and outlives the proxy: after a
    restart the holder goes on with it, and nobody else takes the name."""
    e = env()
    target, other = e.target("keep"), e.target("other")
    e.stage(target)
    e.stage(other)
    h = e.register("kata")
    e.claim(target, "kata", "sb-1", pid=0)
    (before,) = e.claims()
    records = sorted(os.listdir(e.proxy.state_dir / "handlers"))
    assert records == ["kata.json"]
    assert h.lease_id not in (e.proxy.state_dir / "handlers" / "kata.json").read_text(), "only a hash is kept"

    e.restart()
    h.heartbeat(e.channel)
    assert list(e.handlers_listed()) == ["kata"]
    (after,) = e.claims()
    assert after == before and after.target_path == target and after.sandbox_id == "sb-1"
    assert e.volumes()[target].state == "claimed"
    assert sorted(os.listdir(e.mirror(target))) == ["mountInfo.json", "sb-1"]

    # Someone else asking for the name while its holder lives is refused.
    impostor = HandlerServer(socket=e.path / "impostor.sock", name="kata", filesystems=["ext4"])
    exc = failure(impostor.register, e.channel)
    assert exc.code() == Code.ALREADY_EXISTS and "kata" in exc.details()
    assert e.handlers_listed()["kata"].endpoint == h.endpoint

    old_lease = h.lease_id
    rsp = h.register(e.channel, keep_lease=True)
    assert rsp.lease_id == old_lease
    e.claim(target, "kata", "sb-1")  # the same sandbox again: fine
    exc = failure(e.claim, target, "kata", "sb-2")
    assert exc.code() == Code.FAILED_PRECONDITION and "sb-1" in exc.details()


# -- claims ---------------------------------------------------------------------------------


def test_claims_are_single_sandbox_and_marked_for_kata(env):
    e = env()
    target = e.target("claim")
    e.stage(target, fs_type="ext4")

    exc = failure(e.claim, target, "ghost", "sb-1")
    assert exc.code() == Code.NOT_FOUND and "ghost" in exc.details() and "register" in exc.details()
    e.register("xfs-only", filesystems=["xfs"])
    exc = failure(e.claim, target, "xfs-only", "sb-1")
    assert exc.code() == Code.FAILED_PRECONDITION and "ext4" in exc.details()
    exc = failure(e.claim, e.target("never-staged"), "xfs-only", "sb-1")
    assert exc.code() == Code.NOT_FOUND
    assert os.listdir(e.mirror(target)) == ["mountInfo.json"]

    e.register("kata")
    rsp = e.claim(target, "kata", "sb-1", pid=os.getpid())
    assert json.loads(rsp.mount_info_json) == e.info(target)
    marker = e.mirror(target) / "sb-1"
    assert sorted(os.listdir(e.mirror(target))) == ["mountInfo.json", "sb-1"]
    assert stat.S_ISREG(os.lstat(marker).st_mode) and marker.stat().st_size == 0
    assert os.listdir(e.entry(target)) == ["mountInfo.json"], "the marker belongs to the Kata layout only"
    e.claim(target, "kata", "sb-1", pid=os.getpid())  # idempotent
    assert sorted(os.listdir(e.mirror(target))) == ["mountInfo.json", "sb-1"]

    exc = failure(e.claim, target, "kata", "sb-2")
    assert exc.code() == Code.FAILED_PRECONDITION and "sb-1" in exc.details() and "kata" in exc.details()
    e.register("mountns")
    exc = failure(e.claim, target, "mountns", "sb-9")
    assert exc.code() == Code.FAILED_PRECONDITION and "sb-1" in exc.details()

    for sandbox in ("a/b", "..", ".", ".hidden", "", "mountInfo.json", "x" * 256, "nul\x00"):
        exc = failure(e.claim, target, "kata", sandbox)
        assert exc.code() == Code.INVALID_ARGUMENT and "sandbox_id" in exc.details(), (sandbox, exc.details())
    exc = failure(e.claim, target, "kata", "sb-1", pid=-1)
    assert exc.code() == Code.INVALID_ARGUMENT and "sandbox_pid" in exc.details()
    assert sorted(os.listdir(e.mirror(target))) == ["mountInfo.json", "sb-1"]
    assert sorted(os.listdir(e.proxy.kata_dir)) == [b64(target)]

    (claim,) = e.claims()
    assert (claim.target_path, claim.handler, claim.sandbox_id, claim.sandbox_pid) == \
        (target, "kata", "sb-1", os.getpid())
    assert e.volumes()[target].state == "claimed"

    # Restaging (kubelet retries) keeps the claim and the marker; a different
    # device while a live sandbox holds the volume is refused.
    e.stage(target, fs_type="ext4")
    assert sorted(os.listdir(e.mirror(target))) == ["mountInfo.json", "sb-1"]
    assert len(e.claims()) == 1
    exc = failure(e.stage, target, device="/dev/crust-other")
    assert exc.code() == Code.FAILED_PRECONDITION and "sb-1" in exc.details()
    assert e.info(target)["device"] == "/dev/crust-test0"
    exc = failure(e.unstage, target)
    assert exc.code() == Code.UNAVAILABLE and "sb-1" in exc.details()
    assert (e.entry(target) / "mountInfo.json").exists()

    exc = failure(e.release, target, "kata", "sb-2")
    assert exc.code() == Code.FAILED_PRECONDITION and "sb-1" in exc.details()
    e.release(target, "kata", "sb-1")
    assert os.listdir(e.mirror(target)) == ["mountInfo.json"]
    assert e.claims() == [] and e.volumes()[target].state == "unclaimed"
    e.release(target, "kata", "sb-1")  # idempotent
    e.release(e.target("never-staged"), "kata", "sb-1")

    e.claim(target, "mountns", "sb-2")
    assert sorted(os.listdir(e.mirror(target))) == ["mountInfo.json", "sb-2"]
    (claim,) = e.claims()
    assert (claim.handler, claim.sandbox_id) == ("mountns", "sb-2")


def test_concurrent_restaging_never_drops_a_claim(env):
    """kubelet may publish a target again while a handler claims it: the
    claim must survive, or a second sandbox could mount the same file system."""
    e = env()
    target = e.target("race")
    e.stage(target)
    e.register("kata")
    e.register("intruder")
    stop = threading.Event()
    errors: list[str] = []

    def restage():
        with e.proxy.runtime_channel() as ch:
            stub = runtime_pb2_grpc.RuntimeStub(ch)
            while not stop.is_set():
                try:
                    stub.RuntimeStageVolume(e.request(target), timeout=10)
                except grpc.RpcError as exc:
                    errors.append(f"{exc.code().name} {exc.details()}")
                    return

    threads = [threading.Thread(target=restage) for _ in range(3)]
    for t in threads:
        t.start()
    lost = []
    try:
        for i in range(40):
            sandbox = f"sb-{i}"
            e.claim(target, "kata", sandbox)
            time.sleep(0.01)
            claims = e.claims()
            if [(c.handler, c.sandbox_id) for c in claims] != [("kata", sandbox)]:
                lost.append((sandbox, [(c.handler, c.sandbox_id) for c in claims]))
            try:
                e.claim(target, "intruder", f"intruder-{i}")
                lost.append((sandbox, "a second sandbox could claim"))
                e.release(target, "intruder", f"intruder-{i}")
            except grpc.RpcError as exc:
                assert exc.code() == Code.FAILED_PRECONDITION
            e.release(target, "kata", sandbox)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert not lost, lost[:5]
    # The records agree with memory: after a restart the last state is the same.
    e.claim(target, "kata", "final")
    e.restart()
    assert [(c.handler, c.sandbox_id) for c in e.claims()] == [("kata", "final")]


def test_a_gone_holder_can_be_taken_over_and_unstaged(env):
    e = env("--lease-seconds", "2")
    taken, freed = e.target("taken"), e.target("freed")
    e.stage(taken)
    e.stage(freed)
    sandbox = e.sleeper()
    e.register("old")
    e.claim(taken, "old", "sb-old", pid=sandbox.pid)
    e.claim(freed, "old", "sb-old2", pid=sandbox.pid)
    new = e.register("new")

    # The old handler stops heartbeating; its sandbox process still runs.
    deadline = time.monotonic() + 2.6
    while time.monotonic() < deadline:
        new.heartbeat(e.channel)
        time.sleep(0.3)
    assert e.handlers_listed()["old"].lease_expired
    new.heartbeat(e.channel)
    exc = failure(e.claim, taken, "new", "sb-new")
    assert exc.code() == Code.FAILED_PRECONDITION and "sb-old" in exc.details()
    assert e.volumes()[taken].state == "claimed"
    exc = failure(e.unstage, freed)
    assert exc.code() == Code.UNAVAILABLE and "sb-old2" in exc.details()
    assert sorted(os.listdir(e.mirror(taken))) == ["mountInfo.json", "sb-old"]

    sandbox.kill()
    sandbox.wait()  # reaped: a zombie would still answer kill(pid, 0)
    assert e.volumes()[taken].state == "holder-gone"
    new.heartbeat(e.channel)
    e.claim(taken, "new", "sb-new", pid=0)
    assert sorted(os.listdir(e.mirror(taken))) == ["mountInfo.json", "sb-new"]
    assert {(c.target_path, c.handler, c.sandbox_id) for c in e.claims()} == \
        {(taken, "new", "sb-new"), (freed, "old", "sb-old2")}
    assert e.volumes()[taken].state == "claimed"

    e.unstage(freed)
    assert not os.path.lexists(e.entry(freed)) and not os.path.lexists(e.mirror(freed))
    assert freed not in e.volumes()
