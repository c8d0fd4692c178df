"""The chain bench/csi/handler_bench.py's part 2 measures: crust driver ->
crust shim -> crust proxy with the mount-namespace handler (`crust
handler`) registered, a deferred volume published through the proxy and
sandboxes run over it; taken down in order.

- MountnsChain: the deferred volume used by a sandbox (run with `crust
  sandbox`) and a volume published on the host through the same proxy;
  rounds of calls along it that survive the sandbox being killed under
  them;
- close_root(): Root.close() with the sandbox-process kill limited to this
  run's sandboxes (kill_own_sandbox_processes()), so that sandboxes of
  tests running alongside are never killed (bench/csi/scale_deferred.py too);
- mount_table_costs(): the mount tables the handler and the shim parse per
  stats call, and what one parse costs.

The microVM handler's chain is in harness_kata_chain.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import grpc

from bench.lib.benchlib import (
    median_ms,
    rotated,
    timed,
)
from bench.lib.stack import ProxyVolume, attempt, start_stack, write_bundle
from crust.api import handler_pb2, handler_pb2_grpc
from crust.runtime_handler.sandbox import MountNamespaceSandbox
from crust.sys import mount as sysmount
from crust.sys import proc
from tests.harness import daemons as harness
from tests.harness.daemons import MIB, Root, mount_cap

# -- the mount-namespace handler -------------------------------------------------------------------

SANDBOX_ID = "bench-handler-sb"
MAX_SANDBOX_RESTARTS = 10  # sandboxes killed under us before giving up


class MountnsChain:
    """driver -> shim -> proxy + mount-namespace handler, the deferred volume
    and its sandbox, the host volume; and how far each got."""

    def __init__(self, root: Root):
        self.root = root
        self.stack = None  # (driver, shim, proxy, handler) once all are up
        self.deferred: ProxyVolume | None = None
        self.host: ProxyVolume | None = None
        self.bundle = root.path / "bundle"
        self.sandbox_running = False
        self.restarts: list[str] = []  # why the sandbox had to be run again

    def up(self, fs: str):
        """Start the stack, publish both volumes and run the sandbox over the
        deferred one; returns the deferred publish's DeferredMount."""
        self.stack = start_stack(self.root)
        proxy = self.stack[2]
        cap = mount_cap(fs)
        size = 320 * MIB if fs == "xfs" else 64 * MIB

        # The deferred volume, used by a sandbox.
        self.deferred = ProxyVolume.create(proxy, "bench-deferred", "bench-pod-d", size, cap)
        self.deferred.stage()
        deferred_mount = self.deferred.publish_deferred()
        write_bundle(self.bundle, self.deferred.target, 600)
        self.start_sandbox()

        # The host-published volume, through the same proxy.
        self.host = ProxyVolume.create(proxy, "bench-host", "bench-pod-h", size, cap)
        self.host.stage()
        self.host.publish_on_host()
        if sysmount.at(str(self.host.target)) is None:
            raise RuntimeError("the host volume is not mounted at its target")
        return deferred_mount

    def _crust_sandbox(self, *args: str) -> str | None:
        """`crust sandbox ARGS` against the handler; its error output if it failed."""
        out = self.stack[3].sandbox(*args)
        return out.stderr.strip() if out.returncode != 0 else None

    def start_sandbox(self) -> None:
        error = self._crust_sandbox("run", "--bundle", str(self.bundle), "--id", SANDBOX_ID)
        if error is not None:
            raise RuntimeError(f"crust sandbox run failed: {error}")
        self.sandbox_running = True

    def restart_sandbox(self) -> None:
        """Delete the (dead) sandbox, which releases its claim, and run it again."""
        error = self._crust_sandbox("delete", SANDBOX_ID)
        if error is not None:
            raise RuntimeError(f"crust sandbox delete failed: {error}")
        self.sandbox_running = False
        self.start_sandbox()

    def rounds(self, paths: dict[str, Callable[[], object]], count: int, samples: dict[str, list[float]] | None,
               handler_stub: handler_pb2_grpc.HandlerStub) -> None:
        """count rounds of a call on every path, the order rotating every
        round, timed into samples (None: not timed); a round in which the
        sandbox turned out dead is redone after running it again."""
        names = list(paths)
        r = 0
        while r < count:
            taken = {}
            try:
                for name in rotated(names, r):
                    taken[name] = timed(paths[name])
            except grpc.RpcError as exc:
                state = handler_stub.GetSandbox(handler_pb2.GetSandboxRequest(sandbox_id=SANDBOX_ID),
                                                timeout=10).state
                if state == handler_pb2.GetSandboxResponse.RUNNING or len(self.restarts) >= MAX_SANDBOX_RESTARTS:
                    raise
                # The sandbox died under us (on a shared machine, another
                # test's cleanup may kill sandbox holders whose mount table
                # mentions its root): run it again and redo this round.
                self.restarts.append(f"{'warm-up' if samples is None else 'timed'} round {r}: {exc.code().name}, "
                                     f"sandbox {handler_pb2.GetSandboxResponse.State.Name(state)}")
                print(f"    the sandbox died ({self.restarts[-1]}); running it again", flush=True)
                self.restart_sandbox()
                continue
            if samples is not None:
                for name, ms in taken.items():
                    samples[name].append(ms)
            r += 1

    def tear_down(self) -> list[str]:
        """Undo up() in order; returns the errors (the forced cleanup of Root.close() follows)."""
        problems: list[str] = []
        if self.stack is None or not (self.sandbox_running or self.deferred or self.host):
            return problems
        if not all(p.proc is not None and p.proc.poll() is None for p in self.stack):
            return ["a daemon is not running; forced cleanup only"]

        def delete_sandbox() -> None:
            error = self._crust_sandbox("delete", SANDBOX_ID)
            if error is not None:
                raise RuntimeError(error)

        if self.sandbox_running and attempt(problems, "sandbox delete", delete_sandbox):
            self.sandbox_running = False
        if self.deferred is not None and self.deferred.take_down(problems, "deferred "):
            self.deferred = None
        if self.host is not None and self.host.take_down(problems, "host "):
            self.host = None
        return problems


def private_dirs(root: Path) -> tuple[str, ...]:
    """Where only our sandboxes' mount namespaces have mount points: the
    handler's state directory (volume mount points) and the bundle (the
    rootfs binds). The host never mounts there, and sandboxes use private
    propagation, so no other namespace lists mounts below them."""
    base = root.resolve()
    return (f"{base}/mountns-state/", f"{base}/bundle/")


def kill_own_sandbox_processes(root: Path) -> list[int]:
    """Kill the processes of OUR sandboxes only (holders and container
    processes left behind when the handler could not delete them).

    tests/harness/daemons.py kill_sandbox_holders() kills every `sleep infinity`
    whose mount table mentions the test root; on a machine where other
    people run tests, a sandbox of theirs created while our stack had host
    mounts copied those mounts and would be killed too. Root.close() is
    therefore run with this narrower function in its place."""
    prefixes = private_dirs(root)
    mine = os.readlink("/proc/self/ns/mnt")
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (1, os.getpid()):
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/ns/mnt") == mine:
                continue
            mounts = sysmount.parse_mountinfo((entry / "mountinfo").read_text())
            if any(m.mount_point.startswith(prefixes) for m in mounts):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
        except (OSError, ValueError):
            continue  # gone, a zombie or a kernel thread
    return killed


def close_root(root: Root) -> None:
    """Root.close() (stops every daemon in reverse order, kills leftover
    sandbox processes, unmounts and detaches what is below the root,
    removes it), with the sandbox-process kill limited to our own."""
    original = harness.kill_sandbox_holders
    harness.kill_sandbox_holders = kill_own_sandbox_processes
    try:
        root.close()
    finally:
        harness.kill_sandbox_holders = original


def mount_table_costs(handler_channel) -> dict:
    """How many mounts the host and the sandbox's namespace have, and what
    one crust.sys.mount.parse_mountinfo() of each costs in this process
    (median of 20): the handler parses the sandbox's table on every
    GetVolumeStats, the shim the host's for a host volume."""
    def cost(path: str) -> tuple[int, float]:
        try:
            text = Path(path).read_text()
        except OSError:
            return 0, float("nan")
        return len(text.splitlines()), median_ms(lambda: sysmount.parse_mountinfo(text), 20)

    sandboxes = handler_pb2_grpc.SandboxControlStub(handler_channel).ListSandboxes(
        handler_pb2.ListSandboxesRequest(), timeout=10).sandboxes
    info = next((sb for sb in sandboxes if sb.sandbox_id == SANDBOX_ID), None)
    host_n, host_ms = cost("/proc/self/mountinfo")
    sb_n, sb_ms = cost(f"/proc/{info.pid}/mountinfo") if info else (0, float("nan"))
    out = {"host_mounts": host_n, "host_parse_ms": host_ms, "sandbox_mounts": sb_n, "sandbox_parse_ms": sb_ms,
           "sandbox_stats_ms": float("nan")}
    if info and info.volumes:
        # The handler's own MountNamespaceSandbox.stats() (statvfs through
        # /proc/<holder>/root, then the volume condition from the sandbox's
        # mount table), run here against the live sandbox: reads only.
        sandbox = MountNamespaceSandbox(SANDBOX_ID, Path("/nonexistent"), None, proc.identify(info.pid))
        mount_point = info.volumes[0].mount_point
        loop = asyncio.new_event_loop()
        try:
            out["sandbox_stats_ms"] = median_ms(lambda: loop.run_until_complete(sandbox.stats(mount_point, False)),
                                                20)
        finally:
            loop.close()
    return out
