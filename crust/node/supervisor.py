"""`crust node`: the whole node side from one config file, supervised.

Children, started in this order (each waits for the one before it to serve
its socket) and stopped in the reverse order:

1. `crust driver` (node or all mode) on <runDir>/driver.sock;
2. `crust shim` in front of it on <runDir>/shim.sock;
3. `crust proxy` on the CSI socket kubelet dials, registering with kubelet;
4. optionally a runtime handler (mount namespaces or microVMs).

A child that dies is logged with its exit status and started again after a
backoff (doubling while it keeps dying young); the others go on, since each
daemon reconnects to its neighbours by itself. SIGTERM or SIGINT stops the
children gracefully, last first. Each child asks the kernel for SIGTERM
should the supervisor die without stopping it (PR_SET_PDEATHSIG), so a
restarted supervisor never finds its old children holding the sockets.

The supervisor's view (pids, restarts, last exit of each child) is written
to <runDir>/node/status.json for `crust status --config`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from crust.common.atomicfile import write_atomic
from crust.common.formats import encode
from crust.common.endpoint import listener_pid
from crust.common.private import make_dirs
from crust.driver.config import DRIVER_NAME
from crust.node.config import NodeConfig, Runtime
from crust.node.supervised import SUPERVISOR_ENV
from crust.proxy.kubelet_registration import registration_socket

log = logging.getLogger(__name__)

YOUNG_SECONDS = 60.0


class ChildStatus(BaseModel):
    name: str
    socket: str
    pid: int = 0
    running: bool = False
    starts: int = 0
    restarts: int = 0
    last_exit: str = ""
    last_exit_at: float = 0.0


class NodeStatus(BaseModel):
    """<runDir>/node/status.json, rewritten atomically on every change."""

    node_id: str
    supervisor_pid: int
    started_at: float
    children: list[ChildStatus]


def child_argvs(config: NodeConfig, policy_file: Path) -> list[tuple[str, list[str], Path]]:
    """(name, argv after `crust`, socket) of each child, in start order."""
    logging_args = ["--log-level", config.log_level, "--log-format", config.log_format]

    def metrics(port: int) -> list[str]:
        return ["--metrics-port", str(port), "--metrics-address", config.metrics_address] if port else []

    d = config.driver
    children = [
        ("driver", ["driver", "--endpoint", f"unix://{config.driver_socket}", "--node-id", config.node_id,
                    "--data-dir", str(d.data_dir or config.state_dir / "driver"), "--mode", d.mode,
                    "--capacity", str(d.capacity), "--max-volumes-per-node", str(d.max_volumes_per_node),
                    "--default-fs-type", d.default_fs_type, *(["--distributed"] if d.distributed else []),
                    *metrics(d.metrics_port), *logging_args], config.driver_socket),
        ("shim", ["shim", "--endpoint", f"unix://{config.shim_socket}",
                  "--backend-endpoint", f"unix://{config.driver_socket}",
                  "--proxy-endpoint", f"unix://{config.runtime_socket}", "--state-dir", str(config.state_dir / "shim"),
                  "--default-fs-type", config.shim.default_fs_type,
                  *([] if config.shim.advertise_deferral else ["--no-advertise-deferral"]),
                  "--freeze-timeout-seconds", str(config.shim.freeze_timeout_seconds),
                  *metrics(config.shim.metrics_port), *logging_args],
         config.shim_socket),
    ]
    p = config.proxy
    proxy = ["proxy", "--csi-endpoint", f"unix://{config.kubelet_csi_socket}",
             "--plugin-endpoint", f"unix://{config.shim_socket}", "--runtime-endpoint", f"unix://{config.runtime_socket}",
             "--volumes-dir", str(config.volumes_dir), "--state-dir", str(config.state_dir / "proxy"),
             "--kubelet-root", str(config.kubelet_root), "--policy", str(policy_file),
             "--lease-seconds", str(p.lease_seconds), "--claim-grace-seconds", str(p.claim_grace_seconds),
             "--sweep-interval", str(p.sweep_interval_seconds), *metrics(p.metrics_port)]
    if p.kata_dir is not None:
        proxy += ["--kata-dir", str(p.kata_dir)]
    if p.runtime_socket_group is not None:
        proxy += ["--runtime-socket-group", str(p.runtime_socket_group)]
    for uid in p.runtime_allowed_uids:
        proxy += ["--runtime-allowed-uid", str(uid)]
    if config.registration_dir is not None:
        proxy += ["--kubelet-registration-dir", str(config.registration_dir)]
        if config.kubelet_registration.path:
            proxy += ["--kubelet-registration-path", config.kubelet_registration.path]
    children.append(("proxy", proxy + logging_args, config.kubelet_csi_socket))
    h = config.handler
    if h.runtime is not Runtime.NONE:
        common = ["--endpoint", f"unix://{config.handler_socket}", "--proxy-endpoint", f"unix://{config.runtime_socket}",
                  "--volumes-dir", str(config.volumes_dir), "--name", config.handler_name]
        if h.runtime is Runtime.MOUNTNS:
            argv = ["handler", *common, "--state-dir", str(config.state_dir / "handler")]
        else:
            argv = ["kata", "handler", *common, "--state-dir", str(config.state_dir / "kata-handler"),
                    "--accel", h.kata.accel, "--memory", str(h.kata.memory_mib),
                    "--max-memory", str(h.kata.max_memory_mib), "--cpus", str(h.kata.cpus),
                    "--tcg-tb-mib", str(h.kata.tcg_tb_mib),
                    "--cache", str(h.kata.cache),
                    "--kata-dir", str(h.kata.kata_dir), "--vm-pool", str(h.kata.vm_pool),
                    "--disk-bus", h.kata.disk_bus, *(["--vm-template"] if h.kata.vm_template else [])]
        children.append(("handler", argv + logging_args, config.handler_socket))
    return children


@dataclass
class Child:
    name: str
    argv: list[str]
    socket: Path
    status: ChildStatus
    proc: asyncio.subprocess.Process | None = None
    # A pidfd of proc, opened while it is our unreaped child: signals go
    # through it, so they reach this child and never a process that got its
    # pid after it was reaped.
    pidfd: int | None = None
    started_at: float = 0.0
    backoff: float = 0.0

    def signal(self, sig: int) -> None:
        if self.pidfd is None:
            return
        try:
            signal.pidfd_send_signal(self.pidfd, sig)
        except ProcessLookupError:
            pass  # it exited meanwhile

    def forget_process(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class Supervisor:
    def __init__(self, config: NodeConfig):
        self.config = config
        self.stopping = asyncio.Event()
        self.started_at = time.time()
        make_dirs(config.supervisor_dir)
        self.policy_file = config.supervisor_dir / "policy.json"
        self.children = [Child(name, argv, sock, ChildStatus(name=name, socket=str(sock)))
                         for name, argv, sock in child_argvs(config, self.policy_file)]
        self._watchers: list[asyncio.Task] = []

    # -- status ----------------------------------------------------------------

    def write_status(self) -> None:
        status = NodeStatus(node_id=self.config.node_id, supervisor_pid=os.getpid(), started_at=self.started_at,
                            children=[c.status for c in self.children])
        write_atomic(self.config.status_file, encode(status), mode=0o644)

    def sockets(self) -> list[tuple[str, str]]:
        c = self.config
        rows = [("kubelet CSI endpoint (proxy)", str(c.kubelet_csi_socket))]
        if c.registration_dir is not None:
            rows.append(("kubelet registration", str(registration_socket(c.registration_dir, DRIVER_NAME))))
        rows += [("driver", str(c.driver_socket)), ("shim", str(c.shim_socket)),
                 ("runtime API + handler registry", str(c.runtime_socket)), ("watched directory", str(c.volumes_dir))]
        if c.handler.runtime is not Runtime.NONE:
            rows.append((f"handler ({c.handler_name})", str(c.handler_socket)))
        rows.append(("status file", str(c.status_file)))
        return rows

    # -- one child ----------------------------------------------------------------

    async def _spawn(self, child: Child) -> None:
        env = dict(os.environ, **{SUPERVISOR_ENV: str(os.getpid())})
        child.forget_process()
        child.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "crust", *child.argv, stdin=asyncio.subprocess.DEVNULL, env=env)
        try:
            child.pidfd = os.pidfd_open(child.proc.pid)
        except ProcessLookupError:
            child.pidfd = None  # already exited and reaped: nothing to signal
        child.started_at = time.monotonic()
        child.status.pid, child.status.running = child.proc.pid, True
        child.status.starts += 1
        self.write_status()
        log.info("child started", extra={"fields": {"child": child.name, "pid": child.proc.pid}})

    async def _wait_ready(self, child: Child) -> bool:
        """Until the child serves its socket (or dies, or the timeout). The
        listener must be the child itself: another server on the same path
        (a leftover, a second daemon configured there) is not the child."""
        deadline = time.monotonic() + self.config.supervisor.ready_timeout_seconds
        while time.monotonic() < deadline and not self.stopping.is_set():
            if child.proc is None or child.proc.returncode is not None:
                return False
            if await asyncio.to_thread(listener_pid, child.socket) == child.proc.pid:
                return True
            await asyncio.sleep(0.05)
        return False

    async def _watch(self, child: Child) -> None:
        """Restart the child whenever it exits, until the supervisor stops."""
        while not self.stopping.is_set():
            assert child.proc is not None
            code = await child.proc.wait()
            if self.stopping.is_set():
                break
            lived = time.monotonic() - child.started_at
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            child.status.running, child.status.last_exit, child.status.last_exit_at = False, how, time.time()
            # Doubles while the child keeps dying young; a child that ran a
            # while starts from the first step again.
            first = self.config.supervisor.restart_backoff_seconds
            child.backoff = first if lived >= YOUNG_SECONDS or not child.backoff else \
                min(child.backoff * 2, self.config.supervisor.restart_backoff_max_seconds)
            log.error("child died; restarting", extra={"fields": {
                "child": child.name, "exit": how, "lived_seconds": round(lived, 2), "backoff_seconds": child.backoff}})
            self.write_status()
            try:
                await asyncio.wait_for(self.stopping.wait(), child.backoff)
                break
            except asyncio.TimeoutError:
                pass
            child.status.restarts += 1
            await self._spawn(child)
            if not await self._wait_ready(child) and child.proc.returncode is None:
                log.warning("restarted child does not serve its socket yet",
                            extra={"fields": {"child": child.name, "socket": str(child.socket)}})

    async def _stop_child(self, child: Child) -> None:
        proc = child.proc
        if proc is None or proc.returncode is not None:
            child.status.running = False
            return
        child.signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(proc.wait(), self.config.supervisor.stop_timeout_seconds)
        except asyncio.TimeoutError:
            log.error("child did not stop in time; killing it", extra={"fields": {"child": child.name}})
            child.signal(signal.SIGKILL)
            code = await proc.wait()
        child.forget_process()
        child.status.running = False
        child.status.last_exit = "stopped" if code == 0 else f"stopped with {code}"
        log.info("child stopped", extra={"fields": {"child": child.name, "code": code}})

    # -- the whole node ---------------------------------------------------------------

    async def start(self) -> bool:
        write_atomic(self.policy_file, json.dumps(
            self.config.proxy.policy.model_dump(by_alias=True, mode="json")).encode(), mode=0o600)
        for child in self.children:
            if self.stopping.is_set():
                return False
            await self._spawn(child)
            if not await self._wait_ready(child):
                why = "exited" if child.proc.returncode is not None else "did not serve its socket in time"
                log.error("child failed to start", extra={"fields": {"child": child.name, "why": why,
                                                                     "socket": str(child.socket)}})
                return False
            self._watchers.append(asyncio.create_task(self._watch(child)))
        return True

    async def stop(self) -> None:
        self.stopping.set()
        for task in self._watchers:
            task.cancel()
        for child in reversed(self.children):
            await self._stop_child(child)
        self.write_status()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        ok = await self.start()
        if ok:
            # One write: a reader of the first line finds the sockets too.
            print("\n".join([f"crust node {self.config.node_id}: every component is serving"]
                            + [f"  {what:<32} {where}" for what, where in self.sockets()]), flush=True)
            log.info("node serving", extra={"fields": {"sockets": dict(self.sockets())}})
            await self.stopping.wait()
        await self.stop()
        log.info("node stopped")
        return 0 if ok else 1


def serve(config: NodeConfig) -> int:
    return asyncio.run(Supervisor(config).run())
