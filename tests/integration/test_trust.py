"""Trust boundaries of the proxy's runtime socket (the handler registry and
the Runtime API): the kernel names each caller, and a handler's lease, not
its name, is its identity.

Callers with another uid are real processes: a child that drops to uid
65534 (nobody) after importing what it needs, then calls every method."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc

from crust.api import registry_pb2, registry_pb2_grpc, runtime_pb2
from tests.harness.handler_server import HandlerServer, stats_response
from tests.harness.proxy_runtime_env import REPO, Env, env, failure  # noqa: F401 - env: the stack fixture

Code = grpc.StatusCode
NOBODY = 65534
# A group no account on the machine has (its number is all that matters).
GROUP = 64123

CALLER = r"""
import json, os, sys
import grpc
import grpc._channel  # imported now: the unprivileged caller may not read the interpreter's files
from google.protobuf import json_format, message_factory
from crust.api import registry_pb2, runtime_pb2

uid, gid, groups, sock, requests = sys.argv[1:]
# Everything imported first: then become the unprivileged caller.
os.setgroups(json.loads(groups))
os.setgid(int(gid))
os.setuid(int(uid))
requests = json.loads(requests)
answers = {}
with grpc.insecure_channel("unix://" + sock) as channel:
    for module in (registry_pb2, runtime_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                request_class = message_factory.GetMessageClass(method.input_type)
                response_class = message_factory.GetMessageClass(method.output_type)
                call = channel.unary_unary(f"/{service.full_name}/{method.name}",
                                           request_serializer=request_class.SerializeToString,
                                           response_deserializer=response_class.FromString)
                request = json_format.ParseDict(requests.get(method.name, {}), request_class())
                try:
                    call(request, timeout=10)
                    answers[method.name] = ["OK", ""]
                except grpc.RpcError as exc:
                    answers[method.name] = [exc.code().name, exc.details()]
print(json.dumps(answers))
"""

EVERY_METHOD = sorted(m.name for module in (registry_pb2, runtime_pb2)
                      for s in module.DESCRIPTOR.services_by_name.values() for m in s.methods)


def call_every_method_as(sock: Path, uid: int, gid: int, groups: list[int],
                         requests: dict | None = None) -> dict[str, list[str]]:
    done = subprocess.run([sys.executable, "-c", CALLER, str(uid), str(gid), json.dumps(groups), str(sock),
                           json.dumps(requests or {})], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def held_volume_open_to_all(e: Env, name: str) -> tuple[str, HandlerServer, tuple, Path]:
    """A deferred volume claimed by handler mountns, then the runtime socket
    opened to every uid on purpose (as a pod given the host path might find
    it): the file fence broken, only the kernel's answer decides. Returns
    the target, the holder, the state before and the socket."""
    target = e.target(name)
    e.stage(target)
    holder = e.register("mountns")
    e.claim(target, "mountns", "sb-1")
    sock = e.proxy.runtime_socket
    sock.chmod(0o666)
    sock.parent.chmod(0o711)
    return target, holder, state_of(e), sock


def state_of(e: Env) -> tuple:
    """What a caller could have changed: handlers, claims, volumes, records."""
    records = {}
    for sub in ("handlers", "volumes"):
        d = e.proxy.state_dir / sub
        records.update({f"{sub}/{p.name}": p.read_bytes() for p in sorted(d.iterdir())} if d.exists() else {})
    handlers = {n: (h.endpoint, list(h.filesystems)) for n, h in e.handlers_listed().items()}
    volumes = {t: (v.device, v.state, v.claim.sandbox_id) for t, v in e.volumes().items()}
    return handlers, volumes, records


# -- who may call: the kernel's word ------------------------------------------------------------


def test_sockets_and_their_directory_have_the_modes_stated(env):
    e = env()
    sock = e.proxy.runtime_socket
    assert stat.S_ISSOCK(os.lstat(sock).st_mode) and mode(sock) == 0o600
    assert mode(sock.parent) == 0o700
    inner = sock.parent / f".{sock.name}.inner"
    assert stat.S_ISSOCK(os.lstat(inner).st_mode) and mode(inner) == 0o600, "gRPC's own socket is root's only"
    e.stop()
    assert not sock.exists() and not inner.exists(), "a stop removes both sockets"

    e.proxy.extra += ["--runtime-socket-group", str(GROUP)]
    e.start()
    assert mode(sock) == 0o660 and os.lstat(sock).st_gid == GROUP
    assert mode(sock.parent) == 0o750 and os.lstat(sock.parent).st_gid == GROUP
    assert mode(inner) == 0o600 and os.lstat(inner).st_uid == 0


def test_a_group_writable_socket_directory_is_refused_at_start(root, tmp_path):
    sockets = tmp_path / "run"
    sockets.mkdir(mode=0o770)
    sockets.chmod(0o770)
    done = subprocess.run(
        [sys.executable, "-m", "crust", "proxy", "--csi-endpoint", f"unix://{tmp_path}/csi.sock",
         "--plugin-endpoint", f"unix://{tmp_path}/plugin.sock", "--runtime-endpoint", f"unix://{sockets}/p.sock",
         "--volumes-dir", str(tmp_path / "v"), "--state-dir", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode != 0
    assert str(sockets) in done.stderr and "770" in done.stderr, done.stderr
    assert not (sockets / "p.sock").exists()


def test_a_caller_whose_uid_is_not_allowed_is_refused_on_every_method(env):
    """The file fence broken on purpose: the kernel's answer still decides."""
    e = env()
    target, h, before, sock = held_volume_open_to_all(e, "kept")

    hostile = {
        "RegisterHandler": {"name": "mountns", "endpoint": f"unix://{e.path}/evil.sock", "filesystems": ["ext4"]},
        "ClaimVolume": {"target_path": target, "handler": "mountns", "sandbox_id": "evil"},
        "ReleaseVolume": {"target_path": target, "handler": "mountns", "sandbox_id": "sb-1"},
        "UnregisterHandler": {"name": "mountns"},
        "RuntimeStageVolume": {"volume_target_path": target, "volume_type": "BLOCK",
                               "volume_backing_path": "/dev/evil", "fs_type": "ext4"},
        "RuntimeUnstageVolume": {"volume_target_path": target},
        "RuntimeExpandVolume": {"volume_target_path": target},
    }
    answers = call_every_method_as(sock, NOBODY, NOBODY, [], hostile)
    assert sorted(answers) == EVERY_METHOD
    for method, (code, details) in answers.items():
        assert code == "PERMISSION_DENIED", (method, code, details)
        assert f"uid {NOBODY}" in details and "allowed uids: 0" in details, (method, details)
    assert state_of(e) == before, "a denied caller changed nothing"
    h.heartbeat(e.channel)  # and the holder goes on

    sock.parent.chmod(0o700)


def test_the_socket_group_opens_the_file_but_only_the_effective_gid_may_call(env):
    e = env("--runtime-socket-group", str(GROUP))
    # The temporary root holds the socket; let the group's callers traverse it.
    sock = e.proxy.runtime_socket
    assert mode(sock.parent) == 0o750

    # In the group only as a supplementary group: can connect, may not call.
    answers = call_every_method_as(sock, NOBODY, NOBODY, [GROUP])
    assert {code for code, _ in answers.values()} == {"PERMISSION_DENIED"}, answers
    assert all(f"uid {NOBODY} (gid {NOBODY}" in details for _, details in answers.values())

    # The group as the effective gid: served (each method answers for itself).
    answers = call_every_method_as(sock, NOBODY, GROUP, [])
    assert answers["ListHandlers"] == ["OK", ""] and answers["ListVolumes"] == ["OK", ""]
    assert not any(code == "PERMISSION_DENIED" for code, _ in answers.values()), answers
    # Who registered is what the kernel said, not what the caller wrote.
    e.registry.RegisterHandler(registry_pb2.RegisterHandlerRequest(
        name="by-root", endpoint=f"unix://{e.path}/r.sock", filesystems=["ext4"]), timeout=10)
    listed = e.handlers_listed()["by-root"]
    assert listed.registered_by_uid == 0 and listed.registered_by_pid > 0


def test_a_connection_that_did_not_come_through_the_gate_is_refused(env):
    e = env()
    inner = e.proxy.runtime_socket.parent / f".{e.proxy.runtime_socket.name}.inner"
    with grpc.insecure_channel(f"unix://{inner}") as channel:
        exc = failure(registry_pb2_grpc.RegistryStub(channel).ListHandlers, registry_pb2.ListHandlersRequest(),
                      timeout=10)
    assert exc.code() == Code.PERMISSION_DENIED and "not identified" in exc.details()


# -- the lease is the identity ------------------------------------------------------------------


def test_a_live_name_is_not_taken_and_a_gone_one_is(env):
    e = env("--lease-seconds", "2")
    holder = e.register("mountns")
    record = (e.proxy.state_dir / "handlers" / "mountns.json").read_bytes()
    impostor = HandlerServer(socket=e.path / "impostor.sock", name="mountns", filesystems=["xfs"])
    exc = failure(impostor.register, e.channel)
    assert exc.code() == Code.ALREADY_EXISTS and "mountns" in exc.details() and "lease" in exc.details()
    assert holder.lease_id not in exc.details()
    listed = e.handlers_listed()["mountns"]
    assert (listed.endpoint, list(listed.filesystems)) == (holder.endpoint, ["ext4", "xfs"]), "nothing changed"
    assert (e.proxy.state_dir / "handlers" / "mountns.json").read_bytes() == record
    holder.heartbeat(e.channel)

    # The holder stops renewing: once its lease expires the name is free.
    time.sleep(2.5)
    impostor.register(e.channel)
    assert impostor.lease_id != holder.lease_id
    assert e.handlers_listed()["mountns"].endpoint == impostor.endpoint
    exc = failure(holder.heartbeat, e.channel)
    assert exc.code() == Code.PERMISSION_DENIED, "the old lease is nobody's now"
    # The lease never shows in a log line.
    logs = "".join(p.read_text(errors="replace") for p in e.path.glob("*.log"))
    assert holder.lease_id not in logs and impostor.lease_id not in logs


def test_claims_are_bound_to_the_lease_they_were_made_under(env):
    e = env()
    target, other = e.target("bound"), e.target("other")
    e.stage(target)
    e.stage(other)
    kata = e.register("kata", serve=True, default_stats=None)
    mountns = e.register("mountns")
    e.claim(target, "kata", "sb-1")
    before = state_of(e)

    for lease in ("", mountns.lease_id, "f" * 64):
        exc = failure(e.claim, other, "kata", "sb-x", lease=lease)
        assert exc.code() == Code.PERMISSION_DENIED and "lease" in exc.details(), exc.details()
        exc = failure(e.release, target, "kata", "sb-1", lease=lease)
        assert exc.code() == Code.PERMISSION_DENIED
        exc = failure(e.registry.Heartbeat, registry_pb2.HeartbeatRequest(name="kata", lease_id=lease), timeout=10)
        assert exc.code() == Code.PERMISSION_DENIED
        exc = failure(e.registry.UnregisterHandler,
                      registry_pb2.UnregisterHandlerRequest(name="kata", lease_id=lease), timeout=10)
        assert exc.code() == Code.PERMISSION_DENIED
    # Another handler's own lease, under its own name: not a claim it holds.
    exc = failure(e.release, target, "mountns", "sb-1")
    assert exc.code() == Code.FAILED_PRECONDITION and "kata" in exc.details()
    assert state_of(e) == before

    # The holder's lease works.
    e.release(target, "kata", "sb-1")
    assert e.volumes()[target].state == "unclaimed"
    e.claim(target, "kata", "sb-1")
    kata.lease_id, kept = "", kata.lease_id
    exc = failure(e.claim, target, "kata", "sb-1", lease="")
    assert exc.code() == Code.PERMISSION_DENIED
    kata.lease_id = kept


def test_stats_of_a_claim_go_only_to_the_lease_that_made_it(env):
    """A handler that lost its name (its lease expired, another took it) is
    not the one asked about the volumes the first one mounted."""
    e = env("--lease-seconds", "2")
    target = e.target("routed")
    e.stage(target)
    sandbox = e.sleeper()
    first = e.register("kata")
    e.claim(target, "kata", "sb-1", pid=sandbox.pid)
    time.sleep(2.5)
    second = HandlerServer(socket=e.path / "second.sock", name="kata", filesystems=["ext4"],
                           default_stats=stats_response(1 << 30, 1))
    e.handlers.append(second)
    second.start()
    second.register(e.channel)
    assert second.lease_id != first.lease_id
    exc = failure(e.stats, target)
    assert exc.code() == Code.UNAVAILABLE and "earlier lease" in exc.details(), exc.details()
    assert second.calls == [], "the new holder of the name was not asked"
    # Its sandbox still runs: the claim holds against the new holder too.
    exc = failure(e.claim, target, "kata", "sb-2")
    assert exc.code() == Code.FAILED_PRECONDITION and "sb-1" in exc.details()
    exc = failure(e.claim, target, "kata", "sb-1")
    assert exc.code() == Code.PERMISSION_DENIED and "another lease" in exc.details()


# -- hostile input from a caller that is not allowed ---------------------------------------------

RAW_CALLER = r"""
import json, os, sys
import grpc
import grpc._channel  # imported now: the unprivileged caller may not read the interpreter's files
import grpc._channel  # imported now: the unprivileged caller may not read the interpreter's files

uid, gid, sock, calls = sys.argv[1], sys.argv[2], sys.argv[3], sys.stdin.read()
os.setgroups([])
os.setgid(int(gid))
os.setuid(int(uid))
answers = []
with grpc.insecure_channel("unix://" + sock) as channel:
    for path, payload in json.loads(calls):
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        try:
            call(bytes.fromhex(payload), timeout=10)
            answers.append(["OK", ""])
        except grpc.RpcError as exc:
            answers.append([exc.code().name, exc.details()])
print(json.dumps(answers))
"""


def test_hostile_requests_of_a_denied_caller_change_nothing(env, tmp_path):
    """Property: whatever a caller the kernel names as not allowed sends
    (hostile values in every field, the holder's real lease, names and
    sandboxes included, or bytes that do not decode), every method answers
    PERMISSION_DENIED and the registry, the claims and the records stay as
    they were."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.harness import hostile_requests as hostile

    e = env()
    target, holder, before, sock = held_volume_open_to_all(e, "prop")
    place = hostile.Place(root=e.path.resolve(), outside=tmp_path / "outside")
    place.real_paths = [target]
    place.real_ids = {"name": ["mountns"], "sandbox": ["sb-1"], "lease": [holder.lease_id],
                      "volume": [], "snapshot": [], "group_snapshot": []}
    methods = [(f"/{s.full_name}/{m.name}", m.input_type) for module in (registry_pb2, runtime_pb2)
               for s in module.DESCRIPTOR.services_by_name.values() for m in s.methods]
    one_call = st.one_of(*[
        st.tuples(st.just(path), hostile.message(desc, place).map(lambda m: m.SerializeToString().hex()))
        for path, desc in methods]) | st.tuples(st.sampled_from([p for p, _ in methods]),
                                                st.binary(max_size=64).map(bytes.hex))

    @settings(max_examples=8, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(st.lists(one_call, min_size=20, max_size=40))
    def denied(calls):
        done = subprocess.run([sys.executable, "-c", RAW_CALLER, str(NOBODY), str(NOBODY), str(sock)],
                              input=json.dumps(calls), capture_output=True, text=True, timeout=120, cwd=REPO)
        assert done.returncode == 0, done.stderr
        answers = json.loads(done.stdout)
        assert len(answers) == len(calls)
        for (path, _), (code, details) in zip(calls, answers):
            assert code == "PERMISSION_DENIED" and f"uid {NOBODY}" in details, (path, code, details)
        assert state_of(e) == before

    try:
        denied()
    finally:
        sock.parent.chmod(0o700)
    holder.heartbeat(e.channel)


# -- descriptors: a flood of connections ------------------------------------------------------------

# The first bytes of HTTP/2's client preface: a connection that began and stopped.
HALF_PREFACE = b"PRI * HTTP/2.0\r\n"


def open_files_limit(pid: int) -> tuple[int, int]:
    """(soft, hard) RLIMIT_NOFILE of a process, from /proc/PID/limits."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open files limit for pid {pid}")


@contextlib.contextmanager
def soft_open_files(limit: int):
    """This process's soft RLIMIT_NOFILE (inherited by what it starts) for a while."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def connections(sock: Path, count: int, first_bytes: bytes = b""):
    """count connections to sock, each having sent first_bytes, held open."""
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.append(c)
            c.connect(str(sock))
            if first_bytes:
                c.sendall(first_bytes)
        yield held
    finally:
        for c in held:
            c.close()


def closed_by_peer(c: socket.socket, timeout: float = 5) -> bool:
    c.settimeout(timeout)
    try:
        return c.recv(1) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_and_half_prefaces_leave_the_proxy_its_descriptors(env):
    """A proxy started under a soft limit of 1024 open files: 500 idle
    connections and 200 that stopped in the middle of HTTP/2's preface at
    its runtime socket. Its soft limit was raised to the hard one at start,
    no accept failed, and a caller is served meanwhile."""
    with soft_open_files(1024):
        e = env()
    soft, hard = open_files_limit(e.proxy.proc.pid)
    assert soft == hard, f"the proxy's open files limit stayed {soft} (hard {hard})"
    sock = e.proxy.runtime_socket
    with connections(sock, 500), connections(sock, 200, HALF_PREFACE):
        time.sleep(1)  # relayed, or refused, by now
        e.registry.ListHandlers(registry_pb2.ListHandlersRequest(), timeout=10)
        # Another caller, on a connection of its own, is served too.
        with e.proxy.runtime_channel() as channel:
            registry_pb2_grpc.RegistryStub(channel).ListHandlers(registry_pb2.ListHandlersRequest(), timeout=10)
    log = e.proxy.log_path.read_text(errors="replace")
    assert "Too many open files" not in log, log[-3000:]


def test_connections_of_one_uid_are_bounded_and_another_uid_is_served(env):
    """Root holds its bound of connections and tries 20 more: those are
    closed at once, with one warning line; a caller of another uid is
    served meanwhile, and root again once its connections close."""
    from crust.common.peergate import per_uid_bound

    e = env("--runtime-socket-group", str(GROUP))
    sock = e.proxy.runtime_socket
    bound = per_uid_bound(open_files_limit(e.proxy.proc.pid)[0])
    with connections(sock, bound - 1):  # the env's own channel is the bound's last
        e.registry.ListHandlers(registry_pb2.ListHandlersRequest(), timeout=10)
        with connections(sock, 20) as over:
            assert all(closed_by_peer(c) for c in over), "connections over the bound were relayed"
            answers = call_every_method_as(sock, NOBODY, GROUP, [])
            assert answers["ListHandlers"] == ["OK", ""], answers
    wait_until_served = time.monotonic() + 10
    while True:
        with e.proxy.runtime_channel() as channel:
            try:
                registry_pb2_grpc.RegistryStub(channel).ListHandlers(registry_pb2.ListHandlersRequest(), timeout=5)
                break
            except grpc.RpcError:
                assert time.monotonic() < wait_until_served, "root is not served after its connections closed"
                time.sleep(0.2)
    log = e.proxy.log_path.read_text(errors="replace")
    assert log.count("connections of one uid at their bound") == 1, log[-3000:]


def test_accept_failures_back_off_with_one_line(env):
    """The proxy out of descriptors (its soft limit lowered under it to the
    lowest free one): five connects wait in the backlog while every accept
    fails. The gate logs one line, not one per attempt, spends little CPU,
    and relays them once a descriptor is free again."""
    e = env()
    pid = e.proxy.proc.pid
    e.registry.ListHandlers(registry_pb2.ListHandlersRequest(), timeout=10)  # the test's own channel is up
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    open_fds = {int(n) for n in os.listdir(f"/proc/{pid}/fd")}
    lowest_free = next(n for n in range(len(open_fds) + 1) if n not in open_fds)
    before = e.proxy.log_path.read_text(errors="replace").count("Too many open files")
    cpu = lambda: sum(int(f) for f in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13])
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free, limits[1]))
    try:
        with connections(e.proxy.runtime_socket, 5) as waiting:
            started = cpu()
            time.sleep(3)
            spent = (cpu() - started) / os.sysconf("SC_CLK_TCK")
            failures = e.proxy.log_path.read_text(errors="replace").count("Too many open files") - before
            resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
            with e.proxy.runtime_channel() as channel:
                registry_pb2_grpc.RegistryStub(channel).ListHandlers(registry_pb2.ListHandlersRequest(), timeout=10)
            assert not any(closed_by_peer(c, 0.2) for c in waiting), "a waiting connection was dropped"
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
    print(f"\naccept failing for 3 s: {failures} log lines naming EMFILE, {spent:.2f} s of the proxy's CPU")
    assert failures == 1, e.proxy.log_path.read_text(errors="replace")[-3000:]
    assert spent < 0.5
    assert "accepting again" in e.proxy.log_path.read_text(errors="replace")
