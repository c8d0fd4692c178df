"""A recorded pid that now names another process (the kernel reused it).

The reuse is real: after the recorded process is gone, the test writes
/proc/sys/kernel/ns_last_pid so that the next process it starts gets exactly
that pid (retrying when another process on the machine takes it first). No
crust daemon may adopt that process, keep a claim alive because of it, or
signal it:

- the mount-namespace handler, restarted after a sandbox's holder died and
  its pid went to an unrelated `sleep infinity` (the very command a holder
  runs): the sandbox is cleaned up as dead, its claim released, the decoy
  left running;
- the proxy: a claim whose sandbox process died and whose pid went to
  another process holds no longer than the handler's lease;
- the microVM sandbox: a recorded QEMU whose pid went to a process with the
  VM's name on its command line is neither taken for the VM nor killed;
- records written before start times were kept name the process under their
  pid only if it started before the record (crust.sys.proc.recorded).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from crust.kata.vmm.qemu import VmConfig
from crust.kata.sandbox.vm_sandbox import KataSandbox
from crust.sys import proc
from tests.harness.handler_env import Env, view
from tests.harness.daemons import pid_alive, wait_until
from tests.harness.proxy_runtime_env import Env as RuntimeEnv

Code = grpc.StatusCode


def spawn_with_pid(pid: int, argv: list[str]) -> subprocess.Popen:
    """Start argv so that it gets exactly this (free) pid: a real pid reuse.
    (Start times count 10 ms ticks; a pid the kernel reuses by itself has
    gone through every other pid first, but this one comes back at once:
    a tick later at least, as it would in the wild.)"""
    time.sleep(0.05)
    for _ in range(200):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        if child.pid == pid:
            return child
        child.kill()
        child.wait()
        time.sleep(0.01)
    raise AssertionError(f"could not get pid {pid} back from the kernel")


def wait_gone(pid: int) -> None:
    """Until no process (not even a zombie) holds pid, so it can be reused."""
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), timeout=10, what=f"pid {pid} to be free")


@pytest.fixture
def decoys():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture
def env(root):
    made: list[RuntimeEnv] = []

    def make(*proxy_extra: str) -> RuntimeEnv:
        made.append(RuntimeEnv(root, list(proxy_extra)))
        return made[-1]

    try:
        yield make
    finally:
        for e in made:
            e.close()


@pytest.fixture
def short_lease_env(root):
    env = Env(root, proxy_extra=["--lease-seconds", "3"])
    try:
        yield env
    finally:
        env.delete_sandboxes()


def test_a_sandbox_whose_holder_pid_was_reused_is_not_adopted_and_the_new_process_not_signalled(
        short_lease_env, decoys):
    env = short_lease_env
    v = env.volume("pv-reuse")
    a = env.run_ok(env.bundle("reuse", "echo x > /data/x && exec sleep 600", [("/data", str(v.target))]),
                   "sb-reuse")
    wait_until((view(a, a["volumes"][0]["mount_point"]) / "x").exists, what="the sandbox process's file")
    record = json.loads((env.handler.state_dir / "sandboxes" / "sb-reuse.json").read_text())
    assert record["pid"] == a["pid"]

    env.kill_handler_until_expired()
    os.kill(a["pid"], signal.SIGKILL)
    wait_gone(a["pid"])
    # The holder's pid now runs what a holder runs, in no sandbox at all.
    decoy = spawn_with_pid(a["pid"], ["sleep", "infinity"])
    decoys.append(decoy)

    env.restart_handler()
    wait_until(lambda: env.claims() == [], what="the dead sandbox's claim to be released")
    assert env.sandboxes() == {}
    assert decoy.poll() is None, "the handler signalled a process that took its sandbox's pid"
    assert not pid_alive(a["process_pid"]) and env.mounting(v) == []
    env.unpublish(v)
    assert decoy.poll() is None


def test_a_claim_whose_sandbox_pid_was_reused_does_not_hold(env, decoys):
    e = env("--lease-seconds", "2")
    target = e.target("claimed")
    e.stage(target)
    sandbox = e.sleeper()
    handler = e.register("h")
    e.claim(target, "h", "sb-1", pid=sandbox.pid)
    # While the lease is fresh and while the sandbox's process lives, the claim holds.
    assert e.volumes()[target].state == "claimed"
    sandbox.kill()
    sandbox.wait()
    wait_gone(sandbox.pid)
    decoy = spawn_with_pid(sandbox.pid, ["sleep", "60"])
    decoys.append(decoy)
    # The handler stops heartbeating: only the pid could keep the claim.
    wait_until(lambda: e.handlers_listed()["h"].lease_expired, timeout=10, what="the lease to expire")
    assert e.volumes()[target].state == "holder-gone"
    e.unstage(target)
    assert target not in e.volumes()
    assert decoy.poll() is None
    del handler


def test_a_recorded_qemu_whose_pid_was_reused_is_neither_the_vm_nor_killed(tmp_path, decoys):
    name = "sb-vm"
    # What the recorded QEMU looked like: its pid, its start, the VM's name in its argv.
    argv = ["python3", "-c", "import time; time.sleep(60)", "-name", f"crust-{name}"]
    first = subprocess.Popen(argv, start_new_session=True)
    wait_until(lambda: f"crust-{name}".encode() in Path(f"/proc/{first.pid}/cmdline").read_bytes(),
               what="the first process's command line")
    recorded = proc.identify(first.pid)
    first.kill()
    first.wait()
    wait_gone(first.pid)
    # Its pid now runs another process, with the same name in its argv.
    decoy = spawn_with_pid(first.pid, argv)
    decoys.append(decoy)
    wait_until(lambda: f"crust-{name}".encode() in Path(f"/proc/{decoy.pid}/cmdline").read_bytes(),
               what="the decoy's command line")

    sandbox = KataSandbox(name, tmp_path / "vm", VmConfig(kernel=Path("/nonexistent"), initrd=Path("/nonexistent")),
                          recorded)
    assert not sandbox.alive()
    asyncio.run(sandbox.stop())
    assert decoy.poll() is None, "the sandbox killed a process that took its QEMU's pid"


def test_a_record_without_a_start_time_names_only_a_process_started_before_it(decoys):
    sleeper = subprocess.Popen(["sleep", "60"])
    decoys.append(sleeper)
    wait_until(lambda: proc.identify(sleeper.pid) is not None, what="the sleeper")
    time.sleep(1.5)  # boot time is known to the second
    written = time.time()
    assert proc.recorded(sleeper.pid, 0, written) == proc.identify(sleeper.pid)
    # A process that started after the record was written is not the one recorded.
    assert proc.recorded(sleeper.pid, 0, written - 5) is None
    assert proc.recorded(sleeper.pid, 1, written) == proc.ProcessId(sleeper.pid, 1)
    assert not proc.alive(proc.ProcessId(sleeper.pid, 1))
    assert not proc.signal_process(proc.ProcessId(sleeper.pid, 1), signal.SIGKILL)
    assert sleeper.poll() is None
    assert proc.signal_process(proc.identify(sleeper.pid), signal.SIGKILL)
    sleeper.wait()


@pytest.fixture
def handler_env(root):
    env = Env(root)
    try:
        yield env
    finally:
        env.delete_sandboxes()


def test_a_record_naming_a_process_the_handler_never_started_is_neither_adopted_nor_signalled(handler_env, decoys):
    """Records planted in the mount-namespace handler's directory naming a
    `sleep infinity` it never started (the very command a holder runs):
    one without a start time, one with that process's own start time. After
    a restart neither is a live sandbox, the record without a start time is
    set aside with a line naming it, and DeleteSandbox of either signals
    nothing."""
    env = handler_env
    decoy = subprocess.Popen(["sleep", "infinity"], start_new_session=True)
    decoys.append(decoy)
    wait_until(lambda: proc.identify(decoy.pid) is not None, what="the decoy")
    time.sleep(1.5)  # started well before the records are written
    bundle = env.bundle("planted", "exec sleep 600", [])
    records = env.handler.state_dir / "sandboxes"
    env.handler.stop()
    planted = {"sandbox_id": "", "bundle": str(bundle), "pid": decoy.pid, "process_pid": 0, "volumes": {},
               "created_at": time.time()}
    (records / "sb-no-start.json").write_text(json.dumps({**planted, "sandbox_id": "sb-no-start"}))
    (records / "sb-its-start.json").write_text(json.dumps({**planted, "sandbox_id": "sb-its-start",
                                                           "pid_start": proc.identify(decoy.pid).start}))
    env.handler.start()
    wait_until(lambda: env.handler.sandbox("list").returncode == 0, what="the handler's socket")
    running = {k for k, v in env.sandboxes().items() if v.get("state") == "RUNNING"}
    assert running == set(), f"adopted a process the handler never started: {running}"
    for sandbox_id in ("sb-no-start", "sb-its-start"):
        assert env.handler.sandbox("delete", sandbox_id).returncode == 0
    time.sleep(1.5)  # the reaper's turn
    assert decoy.poll() is None, "the handler signalled a process it never started"
    assert not (records / "sb-no-start.json").exists() and (records / "sb-no-start.corrupt").exists()
    log = env.handler.log_path.read_text()
    assert "sb-no-start.json" in log and "start time" in log, log[-2000:]


def test_a_live_sandbox_recorded_without_a_start_time_is_recognised_by_its_namespaces(handler_env):
    """A record of a release that kept no start time, its holder alive: the
    holder is recognised by its own mount and network namespaces, adopted,
    and its start time written to the record; DeleteSandbox then ends it."""
    env = handler_env
    v = env.volume("pv-old-record")
    a = env.run_ok(env.bundle("old", "echo x > /data/x && exec sleep 600", [("/data", str(v.target))]), "sb-old")
    wait_until((view(a, a["volumes"][0]["mount_point"]) / "x").exists, what="the sandbox process's file")
    path = env.handler.state_dir / "sandboxes" / "sb-old.json"
    env.handler.stop()
    record = json.loads(path.read_text())
    start = record.pop("pid_start")
    path.write_text(json.dumps(record))
    env.handler.start()
    wait_until(lambda: env.handler.sandbox("list").returncode == 0, what="the handler's socket")
    assert env.sandboxes()["sb-old"]["state"] == "RUNNING"
    assert json.loads(path.read_text())["pid_start"] == start
    env.delete("sb-old")
    assert not pid_alive(a["pid"]) and not pid_alive(a["process_pid"]) and env.mounting(v) == []
    env.unpublish(v)


def test_a_process_end_is_seen_by_its_pidfd_and_a_reused_pid_ends_at_once():
    """proc.ended waits for this very process (no child of the caller
    needed) until it ends, and returns at once for one gone or whose pid
    names another process (a wait that hung would time out here)."""
    async def main() -> bool:
        sleeper = subprocess.Popen(["sleep", "600"])  # noqa: ASYNC220 - a moment, before the wait
        try:
            identity = proc.identify(sleeper.pid)
            waiting = asyncio.ensure_future(proc.ended(identity))
            await asyncio.sleep(0.3)
            ran_on = not waiting.done()
            sleeper.kill()
            await asyncio.wait_for(waiting, 30)
            sleeper.wait()
            await asyncio.wait_for(proc.ended(identity), 30)   # gone, reaped
            await asyncio.wait_for(proc.ended(proc.ProcessId(os.getpid(), identity.start)), 30)   # another start
            return ran_on
        finally:
            if sleeper.poll() is None:
                sleeper.kill()
                sleeper.wait()

    assert asyncio.run(main())
