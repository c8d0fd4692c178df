"""The processes of a microVM pod's containers, as PodRuntime
(specs/handler.proto) asks for them: start, wait, signal, input, output,
terminal size and the container's cgroup numbers. The process half of
crust.kata.pods.Pods (a mixin: the records, locks and VMs are Pods').

A container's own process on a terminal and every process of a VM
without the agent's port go through the shell agent (a script in the
pod's share, output in files read back by offset, exits from the pod's
process watch); any other process, an exec on a terminal too, through the
guest's Python agent (crust.kata.port_process).
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
    Unavailable,
)
from crust.common.recordstore import KEY_RULE, valid_key
from crust.kata import guest_oci, port_process
from crust.kata.agent import AGENT_REACH, AgentError, AgentRefused, GuestGone
from crust.kata.pod_records import (
    VM_GONE_EXIT_CODE,
    ContainerRecord,
    PodRecord,
    ProcessRecord,
    command_line,
    output_name,
)
from crust.kata.port_agent import AGENT_START_WAIT
from crust.kata.sandbox import KataSandbox
from crust.kata.share import PodShare, ShareError

log = logging.getLogger("crust.kata.pods")

Status = handler_pb2.ProcessState.Status
GUEST_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
Stream = handler_pb2.OutputChunk.Stream

READ_CHUNK = 65536            # bytes per readout answer (a serial line carries them: 88 KiB of base64)
POLL = 0.2                    # seconds between looks at a running process
PORT_WAIT_LOOK = 1.0          # seconds a wait for a port process's exit checks it was not deleted meanwhile
PORT_WAIT = 10.0              # the same for a call about a process the agent runs (it reconnects)
# How long a process whose WaitProcess lost the port waits to see its VM end.
VM_END_SEEN = 2.0
STARTED_WAIT = 1.0            # seconds the guest waits for a container's start before it answers


def stats_response(numbers: dict[str, int]) -> handler_pb2.ContainerStatsResponse:
    """The agent's cstats words as ContainerStats (memory.max "max": 0)."""
    response = handler_pb2.ContainerStatsResponse(
        memory_current=numbers.get("memory.current", 0), memory_max=numbers.get("memory.max", 0),
        pids_current=numbers.get("pids.current", 0), pids_max=numbers.get("pids.max", 0),
        timestamp_ns=time.time_ns())
    for key, value in numbers.items():
        group, _, name = key.partition(".")
        if group == "cpu" and name:
            response.cpu[name] = value
        elif group == "memory" and name.startswith("events."):
            response.memory_events[name.removeprefix("events.")] = value
        elif group == "memory" and name not in ("current", "max"):
            response.memory[name] = value
    return response


class PodProcesses:
    # -- processes ---------------------------------------------------------------------------

    async def start_process(self, container_id: str, exec_id: str, spec: handler_pb2.ProcessSpec | None) -> int:
        pod, c = self._find(container_id)
        # Before the pod's lock: a process of a VM just booted waits for its
        # guest's Python agent to open its port without holding up the
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
                    if (spec.terminal or spec.stdin) and c.oci is None:
                        raise FailedPrecondition(f"container {container_id} runs without an OCI runtime in the "
                                                 f"guest: its execs have no terminal or standard input")
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
            port = sandbox.vm.port
            needs = "process.exec" if exec_id else "process.guest"
            # A process on a terminal too where the agent has crun make one
            # (a container's own process: made so by CreateContainer).
            on_terminal = not p.terminal or (port.has("process.terminal") if exec_id else c.created_on_port)
            if c.oci is not None and on_terminal and not p.name and not p.on_port and \
                    port.client is not None and not port.client.closed and port.has(needs):
                # Recorded with its pid once started. A retry of the call
                # (or of a call whose handler died before the record) asks
                # the agent again, which answers the same pid.
                p.on_port = True
            if not p.on_port:
                await self._start_by_script(sandbox, pod, c, p)
            elif not exec_id:
                return await self._start_on_port(sandbox, pod, c, p)
        if p.on_port:
            # Outside the pod's lock: execs start side by side.
            return await self._start_on_port(sandbox, pod, c, p)
        log.info("process started", extra={"fields": {"sandbox": pod.sandbox_id, "container": container_id,
                                                      "exec": exec_id, "pid": p.pid}})
        return p.pid

    async def _start_by_script(self, sandbox: KataSandbox, pod: PodRecord, c: ContainerRecord,
                               p: ProcessRecord) -> None:
        """A process through the shell agent: a script in the pod's share
        that the guest's sh runs."""
        container_id, exec_id = c.container_id, p.exec_id
        p.name = output_name(pod.sandbox_id, container_id, exec_id)
        await self.records.put(pod.sandbox_id, pod)
        share = self._share(pod.sandbox_id)
        try:
            stdin = await asyncio.to_thread(self._input_share(sandbox, pod).open_input, container_id, p.name) \
                if p.stdin else ""
            script = await asyncio.to_thread(share.write_script, container_id, p.name,
                                             self._script(c, p, stdin))
        except (ShareError, OSError) as exc:
            raise FailedPrecondition(f"process {exec_id or container_id}: its command cannot be written to "
                                     f"the pod's shared directory: {exc}") from None
        try:
            p.pid = await sandbox._agent(sandbox.vm.agent.spawn_file(p.name, script))
        finally:
            # The guest's sh has read it (or never will): the share keeps no commands.
            await asyncio.to_thread(share.remove_script, container_id, p.name)
        await self.records.put(pod.sandbox_id, pod)
        if c.oci is not None and not exec_id:
            await self._until_running(sandbox, c, p)

    async def _start_on_port(self, sandbox: KataSandbox, pod: PodRecord, c: ContainerRecord,
                             p: ProcessRecord) -> int:
        """A process through the guest's Python agent: one call starts it,
        its output and input are the agent's pipes, its exit is pushed (a
        WaitProcess waiting in the guest)."""
        client = await sandbox.vm.port.ready(wait=PORT_WAIT)
        if client is None:
            raise Unavailable(f"process {p.exec_id or c.container_id}: the guest's agent port is not open "
                              f"(the VM restarts it)")
        if p.exec_id:
            process = guest_oci.exec_process(c.oci.spec.get("process") or {}, p.args, p.env, p.cwd, p.uid, p.gid,
                                             p.additional_gids, p.terminal)
            p.pid = await port_process.exec_process(client, c.container_id, p.exec_id, process, p.stdin)
        elif c.created_on_port:
            p.pid = await port_process.start_container(client, c.container_id)
        else:
            await self._run_container_on_port(sandbox, pod, c, p, client)
        await self.records.put(pod.sandbox_id, pod)
        self._watch_exit(pod, c, p, client)
        log.info("process started", extra={"fields": {"sandbox": pod.sandbox_id, "container": c.container_id,
                                                      "exec": p.exec_id, "pid": p.pid, "via": "agent port"}})
        return p.pid

    async def _run_container_on_port(self, sandbox: KataSandbox, pod: PodRecord, c: ContainerRecord,
                                     p: ProcessRecord, client) -> None:
        """The container's own process: its script (the pod's settings, the
        spec, then crun run in the foreground) written in the pod's share and
        run by the guest's sh as a process of the agent; answers once crun
        says the container runs (the script read whole by then: its last
        line exec'd crun)."""
        name = output_name(pod.sandbox_id, c.container_id, "")
        share = self._share(pod.sandbox_id)
        try:
            script = await asyncio.to_thread(share.write_script, c.container_id, name,
                                             guest_oci.run_script(c.container_id, c.oci.spec, c.oci.sysctls,
                                                                  c.oci.hostname, guest_oci.Stdio(name)))
        except (ShareError, OSError) as exc:
            raise FailedPrecondition(f"container {c.container_id}: its command cannot be written to the pod's "
                                     f"shared directory: {exc}") from None
        process = {"args": ["/bin/sh", "-c", f"mkdir -p {guest_oci.GUEST_COMMANDS} && exec /bin/sh {script}"],
                   "env": [f"PATH={GUEST_PATH}"], "cwd": "/"}
        try:
            p.pid = await port_process.exec_process(client, c.container_id, "", process, p.stdin)
            await self._until_running(sandbox, c, p)
        finally:
            await asyncio.to_thread(share.remove_script, c.container_id, name)

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
                if not p.exec_id:
                    sandbox = self._sandbox(pod.sandbox_id)
                    p.oom_killed = sandbox is not None and sandbox.alive() and await self._oom_killed(sandbox, c)
                p.exit_code, p.exited_at_ns = answer.exit_code, answer.exited_at_ns or time.time_ns()
                if not answer.output_complete:
                    log.warning("exec output may be incomplete: a process it left held its streams", extra={
                        "fields": {"sandbox": pod.sandbox_id, "container": c.container_id, "exec": p.exec_id}})
            if self.pods.get(pod.sandbox_id) is pod and c.container_id in pod.containers:
                await self.records.put(pod.sandbox_id, pod)

        self.exits.watch(client, c.container_id, p.exec_id, record, created=c.created_on_port)

    @staticmethod
    async def _until_running(sandbox: KataSandbox, c: ContainerRecord, p: ProcessRecord,
                             timeout: float = 60.0) -> None:
        """StartContainer returns once the container runs, as runc's start
        does: an exec right after it finds the container (crun's state says
        running), unless its process ended meanwhile (GetProcess tells how)."""
        deadline = time.monotonic() + timeout
        agent = sandbox.vm.agent
        legacy = False   # a guest whose agent has no cstarted (before agent 9)
        while time.monotonic() < deadline:
            if not legacy:
                try:
                    # The guest waits (agent 11): no request while crun starts it.
                    started, exited = await sandbox._agent(agent.container_started(c.container_id, p.pid,
                                                                                   wait=STARTED_WAIT))
                    if started or exited:
                        return
                except CrustError as exc:
                    if "unknown command" not in exc.message:
                        raise
                    legacy = True
            if legacy:
                if await sandbox._agent(agent.container_state(c.container_id)) == "running":
                    return
                if await sandbox._agent(agent.wait(p.pid)) is not None:
                    return
            if legacy or agent.version < AGENT_REACH:   # the guest answered at once
                await asyncio.sleep(0.05)
        log.warning("container not running yet after its start", extra={"fields": {
            "container": c.container_id, "seconds": timeout}})

    @staticmethod
    def _script(c: ContainerRecord, p: ProcessRecord, stdin: str = "") -> str:
        """The guest's script for the process; stdin: the guest path of its
        standard input (the live share's file), "" for none."""
        if c.oci is None:
            return command_line(c.root, p)
        size = guest_oci.terminal_size(c.oci.spec.get("process") or {}) if not p.exec_id else (0, 0)
        stdio = guest_oci.Stdio(p.name, input=stdin, terminal=p.terminal, size=size)
        if not p.exec_id:
            return guest_oci.run_script(c.container_id, c.oci.spec, c.oci.sysctls, c.oci.hostname, stdio)
        process = guest_oci.exec_process(c.oci.spec.get("process") or {}, p.args, p.env, p.cwd, p.uid, p.gid,
                                         p.additional_gids)
        return guest_oci.exec_script(c.container_id, process, stdio)

    def _input_share(self, sandbox: KataSandbox, pod: PodRecord) -> PodShare:
        """Where processes' standard input goes: the live share (uncached)."""
        live = self._share(pod.sandbox_id, "live")
        if live.tag not in sandbox.vm.virtiofsds:
            raise FailedPrecondition(f"pod {pod.sandbox_id} started before its VM had a live share: "
                                     f"its processes have no standard input")
        return live

    async def _refresh(self, pod: PodRecord, c: ContainerRecord, p: ProcessRecord) -> None:
        """Learn the exit code of a started process from the guest."""
        if not p.pid or p.exit_code is not None:
            return
        sandbox = self._sandbox(pod.sandbox_id)
        if sandbox is None or not sandbox.alive() or pod.gone:
            await self._mark_gone(pod.sandbox_id, pod.gone or self._death_reason(pod.sandbox_id, sandbox))
            return
        if p.on_port:
            # Its exit comes from the watch's WaitProcess; a handler that
            # restarted starts that watch again here.
            if not self.exits.watching(c.container_id, p.exec_id):
                client = await sandbox.vm.port.ready()
                if client is not None:
                    self._watch_exit(pod, c, p, client)
            return
        try:
            code = await sandbox.vm.agent.wait(p.pid)
        except AgentRefused as exc:
            code, p.reason = VM_GONE_EXIT_CODE, f"ended without an exit code: {exc.message}"
        except AgentError:
            return  # no answer now; the watcher marks a dead VM
        if code is not None and p.exit_code is None:
            if not p.exec_id and c.oci is not None:
                p.oom_killed = await self._oom_killed(sandbox, c)
            p.exit_code, p.exited_at_ns = code, time.time_ns()
            await self.records.put(pod.sandbox_id, pod)

    @staticmethod
    async def _cgroup_stats(sandbox: KataSandbox, container_id: str) -> handler_pb2.ContainerStatsResponse:
        """The cgroup numbers of a container ("": the pod's): from the
        guest's Python agent when it is connected, else the shell agent's
        cstats."""
        port = sandbox.vm.port
        client = port.current()
        if client is not None and port.has("stats.cgroup2"):
            return await port_process.container_stats(client, container_id)
        return stats_response(await sandbox._agent(sandbox.vm.agent.container_stats(container_id or "-")))

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
            # The pod's watch tells when it ended; then state() learns how
            # (one wait in the guest, the OOM count) and records it.
            ended = True
            if state.status == Status.RUNNING and p.on_port:
                # Set when the guest answered the watch's WaitProcess; without
                # a watch (its port reconnecting), state() starts one.
                watched = self.exits.ended(container_id, exec_id)
                try:
                    await asyncio.wait_for(watched.wait() if watched else asyncio.sleep(POLL), PORT_WAIT_LOOK)
                except asyncio.TimeoutError:
                    pass
            elif state.status == Status.RUNNING and p.name:
                try:
                    ended = (await self._watch(pod.sandbox_id).look(p.name, p.pid)).ended
                except AgentError:
                    await asyncio.sleep(POLL)   # state() finds out what became of the VM
            else:
                await asyncio.sleep(POLL)
            if container_id not in pod.containers or self.pods.get(pod.sandbox_id) is not pod:
                raise NotFound(f"container {container_id} was deleted while waiting")
            if ended:
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
            await self._signal_all(sandbox, c, signal)
        elif not p.pid:
            raise FailedPrecondition(f"process {exec_id or container_id} was not started")
        elif p.exit_code is None and p.on_port:
            client = await sandbox.vm.port.ready(wait=PORT_WAIT)
            if client is None:
                raise Unavailable(f"process {exec_id}: the guest's agent port is not open")
            await port_process.signal_process(client, container_id, exec_id, signal, created=c.created_on_port)
            return
        elif p.exit_code is None:
            await sandbox._agent(sandbox.vm.agent.signal(p.pid, signal))
        watch = self.watches.get(pod.sandbox_id)
        if watch is not None:
            watch.poke()   # an exit may follow: seen at the next interval, not after a long one

    async def write_input(self, container_id: str, exec_id: str, offset: int, data: bytes, close: bool) -> int:
        """data at offset of the process's standard input (close: it ends
        there). A resent call writes nothing twice."""
        if offset < 0:
            raise InvalidArgument("offset must not be negative")
        pod, c, p = self._process(container_id, exec_id)
        if not p.stdin:
            raise FailedPrecondition(f"process {exec_id or container_id} was not started with a standard input")
        if p.on_port and p.pid:
            sandbox, _, _ = self._live(pod.sandbox_id)
            client = await sandbox.vm.port.ready(wait=PORT_WAIT)
            if client is None:
                raise Unavailable(f"process {exec_id}: the guest's agent port is not open")
            return await port_process.write_input(client, container_id, exec_id, offset, data, close,
                                                  created=c.created_on_port)
        if not p.name:
            raise FailedPrecondition(f"process {exec_id or container_id} was not started yet")
        live = self._share(pod.sandbox_id, "live")
        try:
            return await asyncio.to_thread(live.append_input, container_id, p.name, offset, data, close)
        except FileNotFoundError:
            raise NotFound(f"process {exec_id or container_id}: its input is gone (deleted)") from None
        except ShareError as exc:
            raise FailedPrecondition(f"standard input of {exec_id or container_id}: {exc}") from None

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
        if p.on_port:
            client = await sandbox.vm.port.ready(wait=PORT_WAIT)
            if client is None:
                raise Unavailable(f"process {exec_id or container_id}: the guest's agent port is not open")
            await port_process.resize_terminal(client, container_id, exec_id, width, height)
            return
        await sandbox._agent(sandbox.vm.agent.terminal_size(p.pid, width, height))

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
        pod, c, p = self._process(container_id, exec_id)
        offsets = {"out": stdout_offset, "err": stderr_offset}
        streams = {"out": Stream.STDOUT, "err": Stream.STDERR}

        def cut(why: str) -> DataLoss:
            return DataLoss(f"the output of {exec_id or container_id} was cut after {offsets['out']} bytes of "
                            f"stdout and {offsets['err']} of stderr: {why}")

        while not p.name and not (p.on_port and p.pid):   # not started yet: its output will come
            if container_id not in pod.containers or p.exit_code is not None:
                return
            await asyncio.sleep(POLL)
        if p.on_port:
            sandbox = self._sandbox(pod.sandbox_id)
            client = await sandbox.vm.port.ready(wait=PORT_WAIT) if sandbox is not None and sandbox.alive() else None
            if client is None:
                raise cut(pod.gone or self._death_reason(pod.sandbox_id, sandbox) if sandbox is None or
                          not sandbox.alive() else "the guest's agent port is not open")
            async for chunk in port_process.read_output(client, container_id, exec_id, stdout_offset,
                                                        stderr_offset, cut, created=c.created_on_port):
                offsets["out" if chunk.stream == Stream.STDOUT else "err"] = chunk.offset + len(chunk.data)
                yield chunk
            return
        # The pod's watch says, once per interval, how far each file is
        # written and whether the process ended; only what grew is read.
        # Its first look comes at once, and after the end one more (what
        # was written meanwhile, by what the process left behind).
        try:
            watch = self._watch(pod.sandbox_id)
        except GuestGone as exc:
            raise cut(str(exc)) from None
        soon, finished = True, False
        while True:
            sandbox = self._sandbox(pod.sandbox_id)
            if sandbox is None or not sandbox.alive():
                raise cut(pod.gone or self._death_reason(pod.sandbox_id, sandbox))
            try:
                look = await watch.look(p.name, p.pid, soon=soon)
            except AgentError:
                if not sandbox.alive():
                    raise cut(self._death_reason(pod.sandbox_id, sandbox)) from None
                await asyncio.sleep(POLL)
                continue
            soon = False
            for key, size in (("out", look.out), ("err", look.err)):
                if size is None and container_id not in pod.containers:
                    raise cut(f"container {container_id} was deleted")
                while size is None or offsets[key] < size:
                    try:
                        data, size = await sandbox.vm.agent.readout(p.name, key, offsets[key], READ_CHUNK)
                    except AgentRefused as exc:
                        if container_id not in pod.containers:
                            raise cut(f"container {container_id} was deleted") from None
                        raise FailedPrecondition(f"output of {exec_id or container_id}: {exc.message}") from None
                    except AgentError:
                        if not sandbox.alive():
                            raise cut(self._death_reason(pod.sandbox_id, sandbox)) from None
                        break
                    if not data:
                        break
                    yield handler_pb2.OutputChunk(stream=streams[key], offset=offsets[key], data=data)
                    offsets[key] += len(data)
            if finished:
                return
            if look.ended:
                await self._refresh(pod, c, p)   # its exit code recorded, as a wait would
                finished, soon = True, True
