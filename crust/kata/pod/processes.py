"""The processes of a microVM pod's containers, as PodRuntime
(specs/handler.proto) asks for them: start, wait, signal, input, output,
terminal size and the container's cgroup numbers. The pods, their records,
locks and VMs are the PodRegistry's (crust.kata.pod.registry).

Every process is the guest's agent's (crust.kata.agent.calls): one call
starts it, its output and input are the agent's pipes or terminal, its
exit is pushed to the host (a WaitProcess that waits in the guest).

An exec lives in the handler's memory (never in the pod's record) from
its start until containerd deletes it (DeleteProcess), which removes it
in the guest too. One that exited and is never deleted is forgotten
EXITED_EXEC_SECONDS after its exit, or earlier once more than
EXITED_EXECS_KEPT exited execs of its container wait (the oldest first):
containerd's CRI deletes every exec it ran once it read its exit, so
only a caller that died in between leaves one. A restarted handler
takes the execs of a running VM from the guest's agent (adopt_execs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from signal import SIGKILL
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
from crust.kata.agent import calls
from crust.kata.pod import container_spec
from crust.kata.agent import stop_bound
from crust.kata.pod.records import (
    VM_GONE_EXIT_CODE,
    ContainerRecord,
    PodRecord,
    ProcessRecord,
)
from crust.kata.vmm.agent_port import AGENT_START_WAIT
from crust.kata.pod.registry import PodRegistry
from crust.kata.sandbox.vm_sandbox import KataSandbox

log = logging.getLogger("crust.kata.pod.pods")

Status = handler_pb2.ProcessState.Status
Stream = handler_pb2.OutputChunk.Stream

POLL = 0.2                    # seconds between looks at a process not started yet
PORT_WAIT_LOOK = 1.0          # seconds a wait for an exit checks it was not deleted meanwhile
PORT_WAIT = 10.0              # how long a call about a process waits for the agent's port (it reconnects)
# How long a process whose WaitProcess lost the port waits to see its VM end.
VM_END_SEEN = 2.0
# Exited execs nobody deleted: each forgotten this long after its exit,
# and no container keeps more than this many of them.
EXITED_EXEC_SECONDS = 600.0
EXITED_EXECS_KEPT = 64
# The most processes a restarted handler takes from a guest's list (the
# guest is not trusted), and how long it waits for the list.
ADOPTED_PROCESSES_MAX = 4096
LIST_TIMEOUT = 10.0
# How long a call naming an exec waits for a restarted handler to take
# back the guest's execs (it serves while it does).
ADOPTION_WAIT = 60.0


class Processes:
    def __init__(self, registry: PodRegistry):
        self.registry = registry
        self.exits = calls.ExitWatches()   # the port processes' WaitProcess calls
        self._forgets: set[asyncio.Task] = set()   # exited execs nobody deleted, being forgotten
        self._expiries: dict[tuple[str, str], asyncio.TimerHandle] = {}   # (container, exec) -> its forgetting
        self.execs_taken_back = asyncio.Event()   # set once the guests were asked for their execs
        self.kills = stop_bound.KillDeadlines()   # processes sent SIGKILL, exited in time or the VM killed

    def all_taken_back(self) -> None:
        """A restarted handler asked every running guest for its execs
        (adopt_execs): the calls naming an exec go on."""
        self.execs_taken_back.set()

    async def close(self) -> None:
        await self.exits.close()
        for task in list(self._forgets):
            task.cancel()
        await self.kills.close()

    def forget_container(self, container_id: str) -> None:
        """A removed container's exit watches and due forgettings."""
        self.exits.forget(container_id)
        self._forget_expiries(container_id)

    # -- processes ---------------------------------------------------------------------------

    async def start_process(self, container_id: str, exec_id: str, spec: handler_pb2.ProcessSpec | None) -> int:
        await self._execs_taken_back(exec_id)
        pod, c = self.registry.find(container_id)
        # Before the pod's lock: a process of a VM just booted waits for its
        # guest's agent to open its port without holding up the
        # pod's other calls.
        sandbox = self.registry.sandbox(pod.sandbox_id)
        if sandbox is not None and sandbox.alive():
            await sandbox.vm.port.ready(wait=AGENT_START_WAIT)
        async with self.registry.locks[pod.sandbox_id]:
            sandbox, _, pod = self.registry.live(pod.sandbox_id)
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
        try:
            return await self._start_on_port(sandbox, pod, c, p)
        except BaseException:
            # Refused (the agent keeps nothing of it either): the shim's
            # Delete of it then finds nothing, as for any exec not started.
            if c.processes.get(exec_id) is p and not p.pid:
                del c.processes[exec_id]
            raise

    async def _start_on_port(self, sandbox: KataSandbox, pod: PodRecord, c: ContainerRecord,
                             p: ProcessRecord) -> int:
        """A process through the guest's agent: one call starts it,
        its output and input are the agent's pipes, its exit is pushed (a
        WaitProcess waiting in the guest)."""
        client = await sandbox.port()
        if p.exec_id:
            process = container_spec.exec_process(c.oci.spec.get("process") or {}, p.args, p.env, p.cwd, p.uid, p.gid,
                                             p.additional_gids, p.terminal)
            p.pid = await calls.exec_process(client, c.container_id, p.exec_id, process, p.stdin)
        else:
            p.pid = await calls.start_container(client, c.container_id)
        if p.exec_id:
            p.args, p.env = [], []   # they served its start only (a retry answers the pid)
        else:
            await self.registry.save(pod)
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
                sandbox = self.registry.sandbox(pod.sandbox_id)
                deadline = time.monotonic() + VM_END_SEEN
                while sandbox is not None and sandbox.alive() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                if sandbox is None or not sandbox.alive():
                    await self.registry.mark_gone(pod.sandbox_id, pod.gone or self.registry.death_reason(pod.sandbox_id, sandbox))
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
                    sandbox = self.registry.sandbox(pod.sandbox_id)
                    p.oom_killed = sandbox is not None and sandbox.alive() and await self._oom_killed(sandbox, c)
                p.exit_code, p.exited_at_ns = answer.exit_code, exited_at
                if not answer.output_complete:
                    log.warning("exec output may be incomplete: a process it left held its streams", extra={
                        "fields": {"sandbox": pod.sandbox_id, "container": c.container_id, "exec": p.exec_id}})
            if p.exec_id:
                self._bound_exited(pod, c, p)
            elif self.registry.pods.get(pod.sandbox_id) is pod and c.container_id in pod.containers:
                await self.registry.save(pod)

        self.exits.watch(client, c.container_id, p.exec_id, record)

    # -- the end of an exec ----------------------------------------------------------------

    async def delete_process(self, container_id: str, exec_id: str) -> handler_pb2.ProcessState:
        """containerd's Delete of an exec: forgotten here and in the guest."""
        if not exec_id:
            raise InvalidArgument("exec_id: empty (a container's own process goes with DeleteContainer)")
        await self._execs_taken_back(exec_id)
        pod, c, p = self.registry.process(container_id, exec_id)
        state = await self.state(pod, c, p)
        if state.status == Status.RUNNING:
            raise FailedPrecondition(f"exec {exec_id} of container {container_id} is running; kill it first")
        await self._forget_exec(pod, c, p)
        log.info("exec deleted", extra={"fields": {"sandbox": pod.sandbox_id, "container": container_id,
                                                   "exec": exec_id}})
        return state

    async def _execs_taken_back(self, exec_id: str) -> None:
        """A call naming an exec waits until a restarted handler took back
        the guest's execs (Pods.start), or ADOPTION_WAIT."""
        if exec_id and not self.execs_taken_back.is_set():
            try:
                await asyncio.wait_for(self.execs_taken_back.wait(), ADOPTION_WAIT)
            except asyncio.TimeoutError:
                pass

    async def _forget_exec(self, pod: PodRecord, c: ContainerRecord, p: ProcessRecord) -> None:
        """The exec gone from the handler's memory, then from the agent's
        table. A guest that cannot be told keeps it until the container's
        removal (or the VM's end)."""
        if c.processes.get(p.exec_id) is not p:
            return   # forgotten already (a bound and a Delete at once)
        del c.processes[p.exec_id]
        self.exits.forget_one(c.container_id, p.exec_id)
        expiry = self._expiries.pop((c.container_id, p.exec_id), None)
        if expiry is not None:
            expiry.cancel()
        sandbox = self.registry.sandbox(pod.sandbox_id)
        if not (p.on_port and p.pid) or sandbox is None or not sandbox.alive() or pod.gone:
            return
        client = await sandbox.vm.port.ready()
        try:
            if client is None:
                raise Unavailable("the guest's agent port is not open")
            await calls.remove_process(client, c.container_id, p.exec_id)
        except CrustError as exc:
            log.warning("exec not forgotten in the guest", extra={"fields": {
                "sandbox": pod.sandbox_id, "container": c.container_id, "exec": p.exec_id, "error": exc.message}})

    def _bound_exited(self, pod: PodRecord, c: ContainerRecord, p: ProcessRecord) -> None:
        """An exited exec forgotten EXITED_EXEC_SECONDS from now unless
        deleted first; the oldest exited execs of its container beyond
        EXITED_EXECS_KEPT forgotten now."""
        loop = asyncio.get_running_loop()

        def expire() -> None:
            self._expiries.pop((c.container_id, p.exec_id), None)
            if pod.containers.get(c.container_id) is c and c.processes.get(p.exec_id) is p:
                log.info("an exited exec nobody deleted is forgotten", extra={"fields": {
                    "sandbox": pod.sandbox_id, "container": c.container_id, "exec": p.exec_id}})
                self._forgetting(pod, c, [p])

        earlier = self._expiries.pop((c.container_id, p.exec_id), None)
        if earlier is not None:
            earlier.cancel()
        self._expiries[(c.container_id, p.exec_id)] = loop.call_later(EXITED_EXEC_SECONDS, expire)
        exited = [q for q in c.processes.values() if q.exec_id and q.exit_code is not None]
        if len(exited) > EXITED_EXECS_KEPT:
            exited.sort(key=lambda q: q.exited_at_ns)
            self._forgetting(pod, c, exited[:len(exited) - EXITED_EXECS_KEPT])

    def _forget_expiries(self, container_id: str) -> None:
        """The forgettings due of a container's execs (it is removed)."""
        for key in [k for k in self._expiries if k[0] == container_id]:
            self._expiries.pop(key).cancel()

    def _forgetting(self, pod: PodRecord, c: ContainerRecord, execs: list[ProcessRecord]) -> None:
        async def run() -> None:
            for q in execs:
                await self._forget_exec(pod, c, q)
        task = asyncio.ensure_future(run())
        self._forgets.add(task)
        task.add_done_callback(self._forgets.discard)

    async def adopt_execs(self, pod: PodRecord, sandbox: KataSandbox) -> int:
        """The execs the guest's agent knows (not removed) of the pod's
        containers, taken back by a restarted handler: what containerd
        still asks of them (their exit, their output, their Delete) is
        answered again. Checked: only containers the record names, ids the
        handler could have given, a bounded list. How many were taken."""
        client = await sandbox.vm.port.ready(wait=PORT_WAIT)
        if client is None:
            return 0
        infos = await calls.list_processes(client, LIST_TIMEOUT)
        taken = 0
        for info in infos[:ADOPTED_PROCESSES_MAX]:
            c = pod.containers.get(info.container_id)
            if c is None or not info.exec_id or not valid_key(info.exec_id) or info.exec_id in c.processes \
                    or info.pid <= 0:
                continue
            p = ProcessRecord(exec_id=info.exec_id, pid=info.pid, terminal=info.terminal, stdin=info.stdin,
                              on_port=True)
            c.processes[info.exec_id] = p
            if info.HasField("exit"):
                p.exit_code, p.exited_at_ns = info.exit.exit_code, time.time_ns()
                self._bound_exited(pod, c, p)
            taken += 1
        return taken

    async def _refresh(self, pod: PodRecord, c: ContainerRecord, p: ProcessRecord) -> None:
        """Learn the exit code of a started process from the guest."""
        if not p.pid or p.exit_code is not None:
            return
        sandbox = self.registry.sandbox(pod.sandbox_id)
        if sandbox is None or not sandbox.alive() or pod.gone:
            await self.registry.mark_gone(pod.sandbox_id, pod.gone or self.registry.death_reason(pod.sandbox_id, sandbox))
            return
        # Its exit comes from the watch's WaitProcess; a handler that
        # restarted starts that watch again here.
        if p.on_port and not self.exits.watching(c.container_id, p.exec_id):
            client = await sandbox.vm.port.ready()
            if client is not None:
                self._watch_exit(pod, c, p, client)

    @staticmethod
    async def _cgroup_stats(sandbox: KataSandbox, container_id: str) -> handler_pb2.ContainerStatsResponse:
        """The cgroup numbers of a container ("": the pod's), checked
        against the VM's memory."""
        try:
            return await calls.container_stats(await sandbox.port(), container_id,
                                                      sandbox.vm.memory_mib << 20, sandbox.counters)
        except DataLoss as exc:
            raise DataLoss(f"pod {sandbox.id}: {exc.message}") from None

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
        await self._execs_taken_back(exec_id)
        pod, c, p = self.registry.process(container_id, exec_id)
        state = await self.state(pod, c, p)
        while wait and state.status != Status.STOPPED:
            # Set when the guest answered the watch's WaitProcess; without a
            # watch (its port reconnecting), state() starts one.
            watched = self.exits.ended(container_id, exec_id) if state.status == Status.RUNNING else None
            try:
                await asyncio.wait_for(watched.wait() if watched else asyncio.sleep(POLL), PORT_WAIT_LOOK)
            except asyncio.TimeoutError:
                pass
            if container_id not in pod.containers or self.registry.pods.get(pod.sandbox_id) is not pod:
                raise NotFound(f"container {container_id} was deleted while waiting")
            if c.processes.get(exec_id) is not p:
                raise NotFound(f"exec {exec_id} of container {container_id} was deleted while waiting")
            state = await self.state(pod, c, p)
        return state

    async def signal_process(self, container_id: str, exec_id: str, signal: int, all_processes: bool) -> None:
        await self._execs_taken_back(exec_id)
        pod, c, p = self.registry.process(container_id, exec_id)
        if not 0 < signal < 65:
            raise InvalidArgument(f"signal {signal}: 1 to 64")
        sandbox = self.registry.sandbox(pod.sandbox_id)
        await self._refresh(pod, c, p)
        if sandbox is None or not sandbox.alive() or pod.gone:
            return   # nothing runs any more: a signal has nothing to reach
        if not all_processes and not p.pid:
            raise FailedPrecondition(f"process {exec_id or container_id} was not started")
        if not all_processes and p.exit_code is not None:
            return
        # A stop's signal (CRI's StopContainer, an exec's kill): answered in
        # time, or the VM is killed (crust.kata.agent.stop_bound).
        try:
            with stop_bound.bounded(stop_bound.SIGNAL_ANSWER):
                if all_processes:
                    await calls.signal_all(await sandbox.port(), container_id, signal)
                else:
                    await calls.signal_process(await sandbox.port(), container_id, exec_id, signal)
        except CrustError:
            if not await sandbox.lost():
                raise
            await self.registry.mark_gone(pod.sandbox_id, self.registry.death_reason(pod.sandbox_id, sandbox))
            return
        if signal == SIGKILL and p.pid:
            self._expect_exit(pod, c, p, sandbox)

    def _expect_exit(self, pod: PodRecord, c: ContainerRecord, p: ProcessRecord, sandbox: KataSandbox) -> None:
        """A process sent SIGKILL exits within stop_bound.KILLED_EXIT, or
        the guest is not trusted to end it: its VM is killed."""
        async def exited() -> bool:
            if p.exit_code is None and not pod.gone:
                await self._refresh(pod, c, p)
            return p.exit_code is not None or pod.gone != "" or not sandbox.alive()

        async def missing() -> None:
            await sandbox.vm.kill_unresponsive(f"its guest reported no exit of {p.exec_id or c.container_id} "
                                               f"within {self.kills.bound:g} s of SIGKILL")
            await self.registry.mark_gone(pod.sandbox_id, self.registry.death_reason(pod.sandbox_id, sandbox))

        self.kills.expect((c.container_id, p.exec_id), exited, missing)

    async def stop_all(self, sandbox: KataSandbox, pod: PodRecord, c: ContainerRecord,
                       timeout: float = stop_bound.KILLED_EXIT) -> None:
        """SIGKILL every process of the container (its cgroup in the guest),
        then wait for their exits, which the guest pushes. Also when its own
        processes all exited: what they left running in the background (in
        a shared PID namespace nothing ends it with them) would keep the
        container's mounts busy (RemoveContainer waits for the cgroup to
        empty)."""
        if not c.created_on_port:
            return
        try:
            await calls.signal_all(await sandbox.port(), c.container_id, 9)
        except CrustError:
            if not await sandbox.lost():
                raise
            await self.registry.mark_gone(pod.sandbox_id, self.registry.death_reason(pod.sandbox_id, sandbox))
            return   # killed meanwhile: its agent was silent
        deadline = time.monotonic() + timeout
        for p in c.processes.values():
            while p.pid and p.exit_code is None and time.monotonic() < deadline:
                await self._refresh(pod, c, p)
                ended = self.exits.ended(c.container_id, p.exec_id)
                if p.exit_code is not None:
                    break
                if ended is not None:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(ended.wait(), max(0.0, deadline - time.monotonic()))
                else:
                    await asyncio.sleep(POLL)   # its watch starts again once the port is back
        missing = [p.exec_id or c.container_id for p in c.processes.values() if p.pid and p.exit_code is None]
        if missing and sandbox.alive() and stop_bound.in_stop():
            # SIGKILL was answered, and no exit came: the guest is not
            # trusted to end them, the host ends its VM.
            await sandbox.vm.kill_unresponsive(f"its guest reported no exit of {', '.join(missing[:5])} within "
                                               f"{timeout:g} s of SIGKILL")
            await self.registry.mark_gone(pod.sandbox_id, self.registry.death_reason(pod.sandbox_id, sandbox))

    async def forget_on_port(self, sandbox: KataSandbox, c: ContainerRecord) -> None:
        """The container's execs in the agent's table (their exits and
        unread output): the guest keeps them until told."""
        execs = [p for p in c.processes.values() if p.on_port and p.pid and p.exec_id]
        client = await sandbox.vm.port.ready() if execs else None
        for p in execs if client is not None else ():
            try:
                await calls.remove_process(client, c.container_id, p.exec_id)
            except CrustError as exc:
                log.warning("exec not forgotten in the guest", extra={"fields": {
                    "container": c.container_id, "exec": p.exec_id, "error": exc.message}})

    async def write_input(self, container_id: str, exec_id: str, offset: int, data: bytes, close: bool) -> int:
        """data at offset of the process's standard input (close: it ends
        there). A resent call writes nothing twice."""
        await self._execs_taken_back(exec_id)
        if offset < 0:
            raise InvalidArgument("offset must not be negative")
        pod, _, p = self.registry.process(container_id, exec_id)
        if not p.stdin:
            raise FailedPrecondition(f"process {exec_id or container_id} was not started with a standard input")
        if not p.pid:
            raise FailedPrecondition(f"process {exec_id or container_id} was not started yet")
        sandbox, _, _ = self.registry.live(pod.sandbox_id)
        return await calls.write_input(await sandbox.port(), container_id,
                                              exec_id, offset, data, close)

    async def resize_terminal(self, container_id: str, exec_id: str, width: int, height: int) -> None:
        await self._execs_taken_back(exec_id)
        if not (0 < width < 65536 and 0 < height < 65536):
            raise InvalidArgument(f"width {width} and height {height}: 1 to 65535")
        pod, c, p = self.registry.process(container_id, exec_id)
        if not p.terminal:
            raise FailedPrecondition(f"process {exec_id or container_id} has no terminal")
        if not p.pid:
            raise FailedPrecondition(f"process {exec_id or container_id} was not started yet")
        await self._refresh(pod, c, p)
        if p.exit_code is not None:
            return   # its terminal went with it
        sandbox, _, _ = self.registry.live(pod.sandbox_id)
        await calls.resize_terminal(await sandbox.port(), container_id,
                                           exec_id, width, height)

    async def container_stats(self, container_id: str) -> handler_pb2.ContainerStatsResponse:
        """The container's cgroup numbers in the guest; a pod's sandbox id:
        those of all its containers (their common parent)."""
        if container_id in self.registry.pods:
            sandbox, _, _ = self.registry.live(container_id)
            which = ""
        else:
            pod, c = self.registry.find(container_id)
            sandbox, _, _ = self.registry.live(pod.sandbox_id)
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
        await self._execs_taken_back(exec_id)
        if stdout_offset < 0 or stderr_offset < 0:
            raise InvalidArgument("stdout_offset and stderr_offset must not be negative")
        pod, _, p = self.registry.process(container_id, exec_id)
        offsets = {"out": stdout_offset, "err": stderr_offset}

        def cut(why: str) -> DataLoss:
            return DataLoss(f"the output of {exec_id or container_id} was cut after {offsets['out']} bytes of "
                            f"stdout and {offsets['err']} of stderr: {why}")

        while not p.pid:   # not started yet: its output will come
            if container_id not in pod.containers or p.exit_code is not None:
                return
            await asyncio.sleep(POLL)
        sandbox = self.registry.sandbox(pod.sandbox_id)
        client = await sandbox.vm.port.ready(wait=PORT_WAIT) if sandbox is not None and sandbox.alive() else None
        if client is None:
            raise cut(pod.gone or self.registry.death_reason(pod.sandbox_id, sandbox) if sandbox is None or
                      not sandbox.alive() else "the guest's agent port is not open")
        async for chunk in calls.read_output(client, container_id, exec_id, stdout_offset,
                                                    stderr_offset, cut):
            offsets["out" if chunk.stream == Stream.STDOUT else "err"] = chunk.offset + len(chunk.data)
            yield chunk
