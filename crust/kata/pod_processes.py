"""The processes of a microVM pod's containers, as PodRuntime
(specs/handler.proto) asks for them: start, wait, signal, input, output,
terminal size and the container's cgroup numbers. The process half of
crust.kata.pods.Pods (a mixin: the records, locks and VMs are Pods').

Every process is the guest's agent's (crust.kata.port_process): one call
starts it, its output and input are the agent's pipes or terminal, its
exit is pushed to the host (a WaitProcess that waits in the guest).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from crust.api import handler_pb2
from crust.common.errors import (
    CrustError,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from crust.common.recordstore import KEY_RULE, valid_key
from crust.kata import guest_oci, port_process
from crust.kata.pod_records import (
    VM_GONE_EXIT_CODE,
    ContainerRecord,
    PodRecord,
    ProcessRecord,
)
from crust.kata.port_agent import AGENT_START_WAIT
from crust.kata.sandbox import KataSandbox

log = logging.getLogger("crust.kata.pods")

Status = handler_pb2.ProcessState.Status
Stream = handler_pb2.OutputChunk.Stream

POLL = 0.2                    # seconds between looks at a process not started yet
PORT_WAIT_LOOK = 1.0          # seconds a wait for an exit checks it was not deleted meanwhile
PORT_WAIT = 10.0              # how long a call about a process waits for the agent's port (it reconnects)
# How long a process whose WaitProcess lost the port waits to see its VM end.
VM_END_SEEN = 2.0


class PodProcesses:
    # -- processes ---------------------------------------------------------------------------

    async def start_process(self, container_id: str, exec_id: str, spec: handler_pb2.ProcessSpec | None) -> int:
        pod, c = self._find(container_id)
        # Before the pod's lock: a process of a VM just booted waits for its
        # guest's agent to open its port without holding up the
        # pod's other calls.
        sandbox = self._sandbox(pod.sandbox_id)
        if sandbox is not None and sandbox.alive():
            await sandbox.vm.port.ready(wait=AGENT_START_WAIT)
        async with self.locks[pod.sandbox_id]:
            sandbox, _, pod = self._live(pod.sandbox_id)
            if container_id not in pod.containers:
                raise NotFound(f"container_id {container_id!r}: no such container")
            p = c.processes.get(exec_id)
            if exec_id:
                if not valid_key(exec_id):
                    raise InvalidArgument(f"exec_id {exec_id!r} must be {KEY_RULE}")
                if spec is None or not spec.args:
                    raise InvalidArgument("process.args: an exec needs its command")
                if p is None:
                    p = ProcessRecord(exec_id=exec_id, args=list(spec.args), env=list(spec.env),
                                      cwd=spec.cwd or c.processes[""].cwd, uid=spec.uid, gid=spec.gid,
                                      additional_gids=list(spec.additional_gids) or None,
                                      terminal=spec.terminal, stdin=spec.stdin)
                    c.processes[exec_id] = p
            if p.pid:
                return p.pid   # started already (a retried call)
            if c.processes[""].pid == 0 and exec_id:
                raise FailedPrecondition(f"container {container_id} was not started: no exec in it yet")
            for word in p.args:
                if "\0" in word:
                    raise InvalidArgument("process.args: a NUL byte")
            if not c.created_on_port:
                raise FailedPrecondition(f"container {container_id} was not made by the guest's agent (a pod an "
                                         f"earlier crust started): delete the pod and run it again")
            # Recorded with its pid once started. A retry of the call (or of
            # a call whose handler died before the record) asks the agent
            # again, which answers the same pid.
            p.on_port = True
            if not exec_id:
                return await self._start_on_port(sandbox, pod, c, p)
        # Outside the pod's lock: execs start side by side.
        return await self._start_on_port(sandbox, pod, c, p)

    async def _start_on_port(self, sandbox: KataSandbox, pod: PodRecord, c: ContainerRecord,
                             p: ProcessRecord) -> int:
        """A process through the guest's agent: one call starts it,
        its output and input are the agent's pipes, its exit is pushed (a
        WaitProcess waiting in the guest)."""
        client = await sandbox.port()
        if p.exec_id:
            process = guest_oci.exec_process(c.oci.spec.get("process") or {}, p.args, p.env, p.cwd, p.uid, p.gid,
                                             p.additional_gids, p.terminal)
            p.pid = await port_process.exec_process(client, c.container_id, p.exec_id, process, p.stdin)
        else:
            p.pid = await port_process.start_container(client, c.container_id)
        await self.records.put(pod.sandbox_id, pod)
        self._watch_exit(pod, c, p, client)
        log.info("process started", extra={"fields": {"sandbox": pod.sandbox_id, "container": c.container_id,
                                                      "exec": p.exec_id, "pid": p.pid}})
        return p.pid

    def _watch_exit(self, pod: PodRecord, c: ContainerRecord, p: ProcessRecord, client) -> None:
        async def record(answer, why: str) -> None:
            if p.exit_code is not None:
                return
            if answer is None:
                # The port closes as QEMU exits: the VM's end, once seen,
                # stops every process of the pod with its reason.
                sandbox = self._sandbox(pod.sandbox_id)
                deadline = time.monotonic() + VM_END_SEEN
                while sandbox is not None and sandbox.alive() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                if sandbox is None or not sandbox.alive():
                    await self._mark_gone(pod.sandbox_id, pod.gone or self._death_reason(pod.sandbox_id, sandbox))
                    return
                p.exit_code, p.reason = VM_GONE_EXIT_CODE, f"ended without an exit code: {why}"
                p.exited_at_ns = time.time_ns()
            else:
                # The host's time of the answer, not the guest's of the exit:
                # a booted guest's clock comes from its RTC (whole seconds),
                # and CRI compares this with the host's times (the next
                # container's creation after an init container's exit).
                exited_at = time.time_ns()
                if not p.exec_id:
                    sandbox = self._sandbox(pod.sandbox_id)
                    p.oom_killed = sandbox is not None and sandbox.alive() and await self._oom_killed(sandbox, c)
                p.exit_code, p.exited_at_ns = answer.exit_code, exited_at
                if not answer.output_complete:
                    log.warning("exec output may be incomplete: a process it left held its streams", extra={
                        "fields": {"sandbox": pod.sandbox_id, "container": c.container_id, "exec": p.exec_id}})
            if self.pods.get(pod.sandbox_id) is pod and c.container_id in pod.containers:
                await self.records.put(pod.sandbox_id, pod)

        self.exits.watch(client, c.container_id, p.exec_id, record)

    async def _refresh(self, pod: PodRecord, c: ContainerRecord, p: ProcessRecord) -> None:
        """Learn the exit code of a started process from the guest."""
        if not p.pid or p.exit_code is not None:
            return
        sandbox = self._sandbox(pod.sandbox_id)
        if sandbox is None or not sandbox.alive() or pod.gone:
            await self._mark_gone(pod.sandbox_id, pod.gone or self._death_reason(pod.sandbox_id, sandbox))
            return
        # Its exit comes from the watch's WaitProcess; a handler that
        # restarted starts that watch again here.
        if p.on_port and not self.exits.watching(c.container_id, p.exec_id):
            client = await sandbox.vm.port.ready()
            if client is not None:
                self._watch_exit(pod, c, p, client)

    @staticmethod
    async def _cgroup_stats(sandbox: KataSandbox, container_id: str) -> handler_pb2.ContainerStatsResponse:
        """The cgroup numbers of a container ("": the pod's)."""
        return await port_process.container_stats(await sandbox.port(), container_id)

    async def _oom_killed(self, sandbox: KataSandbox, c: ContainerRecord) -> bool:
        """Whether the OOM killer killed a process of the container: the
        memory.events of its cgroup's parent, which outlives crun's cgroup
        until the container is deleted (guest_oci). Unknown (no answer)
        counts as no."""
        try:
            stats = await self._cgroup_stats(sandbox, c.container_id)
        except CrustError as exc:
            log.warning("no OOM count for a stopped container", extra={"fields": {
                "container": c.container_id, "error": exc.message}})
            return False
        return stats.memory_events.get("oom_kill", 0) > 0

    async def state(self, pod: PodRecord, c: ContainerRecord, p: ProcessRecord) -> handler_pb2.ProcessState:
        await self._refresh(pod, c, p)
        if not p.pid:
            return handler_pb2.ProcessState(status=Status.CREATED)
        if p.exit_code is None:
            return handler_pb2.ProcessState(status=Status.RUNNING, pid=p.pid)
        return handler_pb2.ProcessState(status=Status.STOPPED, pid=p.pid, exit_code=p.exit_code,
                                        exited_at_ns=p.exited_at_ns, reason=p.reason, oom_killed=p.oom_killed)

    async def get_process(self, container_id: str, exec_id: str, wait: bool) -> handler_pb2.ProcessState:
        pod, c, p = self._process(container_id, exec_id)
        state = await self.state(pod, c, p)
        while wait and state.status != Status.STOPPED:
            # Set when the guest answered the watch's WaitProcess; without a
            # watch (its port reconnecting), state() starts one.
            watched = self.exits.ended(container_id, exec_id) if state.status == Status.RUNNING else None
            try:
                await asyncio.wait_for(watched.wait() if watched else asyncio.sleep(POLL), PORT_WAIT_LOOK)
            except asyncio.TimeoutError:
                pass
            if container_id not in pod.containers or self.pods.get(pod.sandbox_id) is not pod:
                raise NotFound(f"container {container_id} was deleted while waiting")
            state = await self.state(pod, c, p)
        return state

    async def signal_process(self, container_id: str, exec_id: str, signal: int, all_processes: bool) -> None:
        pod, c, p = self._process(container_id, exec_id)
        if not 0 < signal < 65:
            raise InvalidArgument(f"signal {signal}: 1 to 64")
        sandbox = self._sandbox(pod.sandbox_id)
        await self._refresh(pod, c, p)
        if sandbox is None or not sandbox.alive() or pod.gone:
            return   # nothing runs any more: a signal has nothing to reach
        if all_processes:
            await port_process.signal_all(await sandbox.port(), container_id, signal)
        elif not p.pid:
            raise FailedPrecondition(f"process {exec_id or container_id} was not started")
        elif p.exit_code is None:
            await port_process.signal_process(await sandbox.port(), container_id,
                                              exec_id, signal)

    async def write_input(self, container_id: str, exec_id: str, offset: int, data: bytes, close: bool) -> int:
        """data at offset of the process's standard input (close: it ends
        there). A resent call writes nothing twice."""
        if offset < 0:
            raise InvalidArgument("offset must not be negative")
        pod, _, p = self._process(container_id, exec_id)
        if not p.stdin:
            raise FailedPrecondition(f"process {exec_id or container_id} was not started with a standard input")
        if not p.pid:
            raise FailedPrecondition(f"process {exec_id or container_id} was not started yet")
        sandbox, _, _ = self._live(pod.sandbox_id)
        return await port_process.write_input(await sandbox.port(), container_id,
                                              exec_id, offset, data, close)

    async def resize_terminal(self, container_id: str, exec_id: str, width: int, height: int) -> None:
        if not (0 < width < 65536 and 0 < height < 65536):
            raise InvalidArgument(f"width {width} and height {height}: 1 to 65535")
        pod, c, p = self._process(container_id, exec_id)
        if not p.terminal:
            raise FailedPrecondition(f"process {exec_id or container_id} has no terminal")
        if not p.pid:
            raise FailedPrecondition(f"process {exec_id or container_id} was not started yet")
        await self._refresh(pod, c, p)
        if p.exit_code is not None:
            return   # its terminal went with it
        sandbox, _, _ = self._live(pod.sandbox_id)
        await port_process.resize_terminal(await sandbox.port(), container_id,
                                           exec_id, width, height)

    async def container_stats(self, container_id: str) -> handler_pb2.ContainerStatsResponse:
        """The container's cgroup numbers in the guest; a pod's sandbox id:
        those of all its containers (their common parent)."""
        if container_id in self.pods:
            sandbox, _, _ = self._live(container_id)
            which = ""
        else:
            pod, c = self._find(container_id)
            sandbox, _, _ = self._live(pod.sandbox_id)
            if c.oci is None:
                raise FailedPrecondition(f"container {container_id} runs without a cgroup of its own in the guest")
            which = container_id
        return await self._cgroup_stats(sandbox, which)

    async def read_output(self, container_id: str, exec_id: str, stdout_offset: int,
                          stderr_offset: int) -> AsyncIterator[handler_pb2.OutputChunk]:
        """Chunks from the offsets as the guest's files grow; ends once the
        process stopped and everything was sent. Output that can no longer
        be read (the VM or the container gone meanwhile) ends the stream
        with DataLoss naming where it was cut, never as if it were whole."""
        if stdout_offset < 0 or stderr_offset < 0:
            raise InvalidArgument("stdout_offset and stderr_offset must not be negative")
        pod, _, p = self._process(container_id, exec_id)
        offsets = {"out": stdout_offset, "err": stderr_offset}

        def cut(why: str) -> DataLoss:
            return DataLoss(f"the output of {exec_id or container_id} was cut after {offsets['out']} bytes of "
                            f"stdout and {offsets['err']} of stderr: {why}")

        while not p.pid:   # not started yet: its output will come
            if container_id not in pod.containers or p.exit_code is not None:
                return
            await asyncio.sleep(POLL)
        sandbox = self._sandbox(pod.sandbox_id)
        client = await sandbox.vm.port.ready(wait=PORT_WAIT) if sandbox is not None and sandbox.alive() else None
        if client is None:
            raise cut(pod.gone or self._death_reason(pod.sandbox_id, sandbox) if sandbox is None or
                      not sandbox.alive() else "the guest's agent port is not open")
        async for chunk in port_process.read_output(client, container_id, exec_id, stdout_offset,
                                                    stderr_offset, cut):
            offsets["out" if chunk.stream == Stream.STDOUT else "err"] = chunk.offset + len(chunk.data)
            yield chunk
