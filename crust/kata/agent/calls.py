"""Processes the guest's agent runs (specs/agent.proto), as the pod
runtime uses them: an exec started with one call, its output read as
written (ReadStdout/ReadStderr block in the guest until there is more),
its input written by offset, its exit learned by a WaitProcess that waits
in the guest, never polled.

The agent's status codes become the handler's errors with the agent's
words, so a refusal in the guest reaches CRI with its code.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Awaitable, Callable

from google.protobuf import json_format

from crust.api import agent_pb2, handler_pb2
from crust.common import ttrpc
from crust.common.aio import cancel_all
from crust.common.errors import DataLoss, Unavailable
from crust.kata.agent import checked_numbers
from crust.kata.agent.client import AgentClient, guest_text, handler_error

log = logging.getLogger(__name__)

# The most bytes one read asks for (the agent answers at most its
# limits.max_read_bytes).
READ_BYTES = 1 << 20
# A process writing fast is read in fuller answers: after one of
# READ_BUSY_BYTES or more (more than a prompt or a line) but below
# READ_FULL_BYTES, the next read waits READ_PAUSE first. Each answer costs
# the guest's one vCPU a round of the agent, and asked at once the agent
# answers what a single read of the process's pipe gave it. Small output
# is read at once.
READ_BUSY_BYTES = 16 << 10
READ_FULL_BYTES = 512 << 10
READ_PAUSE = 0.01
# A cgroup's numbers are a few reads in the guest.
STATS_TIMEOUT = 5.0
Stream = handler_pb2.OutputChunk.Stream
# The pod's /dev/shm as a pod tmpfs of the guest (no emptyDir's name, a
# DNS label, has "_").
SHM_TMPFS = "dev_shm"
def _ids(container_id: str, exec_id: str) -> dict[str, str]:
    """The agent's ids of a pod's process: the container's own is
    (container, ""), an exec (container, exec)."""
    return {"container_id": container_id, "exec_id": exec_id}


async def exec_process(client: AgentClient, container_id: str, exec_id: str, process: dict,
                       stdin: bool) -> int:
    """Start an exec in a running container of the guest, or (exec_id "")
    the container's own process from its OCI process object; its pid there."""
    request = agent_pb2.ExecProcessRequest(**_ids(container_id, exec_id), stdin=stdin,
                                           process=json.dumps(process, separators=(",", ":")).encode())
    try:
        return (await client.call("ExecProcess", request)).pid
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, f"{'exec ' + exec_id if exec_id else 'the process'} of container "
                                 f"{container_id}") from None


async def wait_process(client: AgentClient, container_id: str, exec_id: str) -> agent_pb2.WaitProcessResponse:
    """Blocks in the guest until the process exited and its output is whole."""
    return await client.call("WaitProcess", agent_pb2.WaitProcessRequest(**_ids(container_id, exec_id)))


async def read_output(client: AgentClient, container_id: str, exec_id: str, stdout_offset: int,
                      stderr_offset: int, cut: Callable[[str], DataLoss]) -> AsyncIterator[handler_pb2.OutputChunk]:
    """Both streams from their offsets, as the guest has them, until both
    ended. A stream the guest no longer has (the process removed, the VM
    gone) ends the iteration with cut(why)."""
    chunks: asyncio.Queue = asyncio.Queue(maxsize=4)
    offsets = {Stream.STDOUT: stdout_offset, Stream.STDERR: stderr_offset}

    async def pump(stream: int, method: str) -> None:
        while True:
            request = agent_pb2.ReadStreamRequest(**_ids(container_id, exec_id),
                                                  offset=offsets[stream], max_bytes=READ_BYTES)
            answer = await client.call(method, request)
            if answer.data:
                await chunks.put(handler_pb2.OutputChunk(stream=stream, offset=answer.offset, data=answer.data))
                offsets[stream] = answer.offset + len(answer.data)
            if answer.eof:
                return
            if READ_BUSY_BYTES <= len(answer.data) < READ_FULL_BYTES:
                await asyncio.sleep(READ_PAUSE)

    pumps = [asyncio.ensure_future(pump(Stream.STDOUT, "ReadStdout")),
             asyncio.ensure_future(pump(Stream.STDERR, "ReadStderr"))]
    ended = asyncio.ensure_future(asyncio.wait(pumps))
    try:
        while True:
            getter = asyncio.ensure_future(chunks.get())
            await asyncio.wait([getter, ended], return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
                continue
            getter.cancel()
            while not chunks.empty():
                yield chunks.get_nowait()
            for task in pumps:
                exc = task.exception()
                if isinstance(exc, ttrpc.TtrpcError):
                    if exc.code in (ttrpc.NOT_FOUND, ttrpc.UNAVAILABLE, ttrpc.DATA_LOSS):
                        raise cut(guest_text(exc.message)) from None
                    raise handler_error(exc, f"output of {exec_id or container_id}") from None
                if exc is not None:
                    raise exc
            return
    finally:
        for task in pumps:
            task.cancel()
        ended.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def write_input(client: AgentClient, container_id: str, exec_id: str, offset: int, data: bytes,
                      close: bool) -> int:
    """data at offset of the process's input (resent bytes are not written
    twice); close: it ends there. The input's length after it."""
    what = f"standard input of {exec_id or container_id}"
    try:
        length = offset
        if data or not close:
            answer = await client.call("WriteStdin", agent_pb2.WriteStreamRequest(
                **_ids(container_id, exec_id), offset=offset, data=data))
            length = answer.length
        if close:
            await client.call("CloseStdin", agent_pb2.CloseStdinRequest(**_ids(container_id, exec_id)))
        return length
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, what) from None


async def signal_process(client: AgentClient, container_id: str, exec_id: str, signal: int) -> int:
    try:
        answer = await client.call("SignalProcess", agent_pb2.SignalProcessRequest(
            **_ids(container_id, exec_id), signal=signal))
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, f"signal to {exec_id or container_id}") from None
    return answer.signalled


async def signal_all(client: AgentClient, container_id: str, signal: int) -> int:
    """Every process in the container's cgroup in the guest (and its own
    process while it waits for its start); how many."""
    try:
        answer = await client.call("SignalProcess", agent_pb2.SignalProcessRequest(
            container_id=container_id, signal=signal, all=True))
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, f"signal to container {container_id}") from None
    return answer.signalled


async def resize_terminal(client: AgentClient, container_id: str, exec_id: str, width: int, height: int) -> None:
    """The size of the terminal an exec runs on; an exec that ended
    meanwhile (its terminal gone with it) is no error."""
    try:
        await client.call("TtyWinResize", agent_pb2.TtyWinResizeRequest(
            **_ids(container_id, exec_id), columns=width, rows=height))
    except ttrpc.TtrpcError as exc:
        if exc.code == ttrpc.FAILED_PRECONDITION:
            return
        raise handler_error(exc, f"the terminal of {exec_id or container_id}") from None


async def remove_process(client: AgentClient, container_id: str, exec_id: str) -> int:
    """Forget an exited process in the guest; its unread bytes."""
    try:
        answer = await client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(**_ids(container_id, exec_id)))
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, f"removal of process {exec_id or container_id}") from None
    return answer.unread_bytes


async def list_processes(client: AgentClient, timeout: float) -> list[agent_pb2.ProcessInfo]:
    """Every process the guest's agent knows (not removed), as it says."""
    try:
        return list((await client.call("ListProcesses", agent_pb2.ListProcessesRequest(), timeout=timeout)).processes)
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, "the guest's list of processes") from None


async def configure_guest(client: AgentClient, sysctls: dict[str, str], hostname: str) -> None:
    """The pod's sysctls and hostname in the guest (ConfigureGuest)."""
    request = agent_pb2.ConfigureGuestRequest(hostname=hostname, sysctls=[
        agent_pb2.Sysctl(key=k, value=v) for k, v in sorted(sysctls.items())])
    try:
        await client.call("ConfigureGuest", request)
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, "the pod's sysctls and hostname") from None


async def create_container(client: AgentClient, container_id: str, spec: dict, stdin: bool,
                           sources: dict | None = None) -> int:
    """The container made by the guest's crun from its spec, held before
    its process's exec; the pid of its process. sources: what the agent
    places (crust.kata.pod.mount_plan.placement); without, the spec's
    sources are guest paths already."""
    request = agent_pb2.CreateContainerRequest()
    if sources:
        json_format.ParseDict(sources, request)
    request.container_id, request.stdin = container_id, stdin
    request.oci_spec = json.dumps(spec, separators=(",", ":")).encode()
    try:
        return (await client.call("CreateContainer", request)).pid
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, f"container {container_id}") from None


async def configure_interface(client: AgentClient, mac: str, mtu: int, addresses: list[str],
                              routes: list[tuple[str, str]]) -> None:
    """The pod's network on the VM's NIC with that MAC address: addresses as
    "ip/prefix", routes as (destination or "default", gateway or "")."""
    request = agent_pb2.ConfigureInterfaceRequest(
        mac=mac, mtu=mtu,
        addresses=[agent_pb2.IPAddress(address=a.split("/")[0], prefix_length=int(a.split("/")[1]))
                   for a in addresses],
        routes=[agent_pb2.Route(destination="" if d == "default" else d, gateway=g) for d, g in routes])
    try:
        await client.call("ConfigureInterface", request)
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, "the pod's network interface") from None


async def mount_share(client: AgentClient, tag: str) -> str:
    """The pod's share of that virtio-fs tag mounted in the guest; where."""
    try:
        return (await client.call("MountShare", agent_pb2.MountShareRequest(tag=tag))).mount_point
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, f"the pod's shared directory {tag}") from None


async def mount_pod_tmpfs(client: AgentClient | None, name: str, size: str) -> None:
    """The pod's tmpfs of that name in the guest (MountPodTmpfs), size as
    the host's tmpfs says it (bytes, or with k, m, g; "" for the guest's
    bound)."""
    if client is None:
        raise Unavailable(f"the pod's tmpfs {name}: the guest's agent is not connected")
    try:
        await client.call("MountPodTmpfs", agent_pb2.MountPodTmpfsRequest(name=name, size_bytes=tmpfs_bytes(size)))
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, f"the pod's tmpfs {name}") from None


async def start_mirror(client: AgentClient | None, name: str, tag: str, path: str) -> None:
    """The guest's copy of the atomic-writer volume at path in the share of
    that tag, kept in step (StartMirror)."""
    if client is None:
        raise Unavailable(f"the mirror {name}: the guest's agent is not connected")
    request = agent_pb2.StartMirrorRequest(name=name, source=agent_pb2.SharePath(tag=tag, path=path))
    try:
        await client.call("StartMirror", request)
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, f"the mirror {name}") from None


def tmpfs_bytes(size: str) -> int:
    """A tmpfs size= option in bytes (0 for none)."""
    if not size:
        return 0
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(size[-1].lower(), 1)
    return int(size[:-1] if scale > 1 else size) * scale


async def start_container(client: AgentClient, container_id: str) -> int:
    """The container's process let run; answers once it was executed."""
    try:
        return (await client.call("StartContainer", agent_pb2.StartContainerRequest(container_id=container_id))).pid
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, f"the start of container {container_id}") from None


async def remove_container(client: AgentClient, container_id: str) -> int:
    """Every process of the container killed, crun's state and its cgroup
    gone, its processes forgotten in the guest; their unread bytes."""
    try:
        return (await client.call("RemoveContainer",
                                  agent_pb2.RemoveContainerRequest(container_id=container_id))).unread_bytes
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, f"the removal of container {container_id}") from None


class ExitWatches:
    """One WaitProcess per running port process, each recording the exit
    (on_exit) when the guest answers: the exit is pushed, and a caller that
    waits for it waits on an event, not on the guest."""

    def __init__(self):
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}
        self._ended: dict[tuple[str, str], asyncio.Event] = {}

    def ended(self, container_id: str, exec_id: str) -> asyncio.Event | None:
        """The event a running watch sets once it recorded the exit; None
        when no watch runs (none started, or it ended: the exit is in the
        record)."""
        return self._ended.get((container_id, exec_id)) if self.watching(container_id, exec_id) else None

    def watching(self, container_id: str, exec_id: str) -> bool:
        task = self._tasks.get((container_id, exec_id))
        return task is not None and not task.done()

    def watch(self, client: AgentClient, container_id: str, exec_id: str,
              on_exit: Callable[[agent_pb2.WaitProcessResponse | None, str], Awaitable[None]]) -> None:
        """on_exit(answer, "") once it exited; on_exit(None, why) when the
        guest cannot tell any more (its agent forgot it, the VM is gone)."""
        key = (container_id, exec_id)
        if self.watching(*key):
            return
        event = self._ended[key] = asyncio.Event()

        async def run() -> None:
            try:
                try:
                    answer = await wait_process(client, container_id, exec_id)
                except ttrpc.TtrpcError as exc:
                    await on_exit(None, guest_text(exc.message))
                else:
                    await on_exit(answer, "")
            except Exception:  # a watch must not die silently
                log.exception("recording the exit of exec %s of container %s failed", exec_id, container_id)
            finally:
                # Its waiters hold the event; a later caller finds the exit recorded.
                event.set()
                if self._ended.get(key) is event:
                    del self._ended[key]
                self._tasks.pop(key, None)

        self._tasks[key] = asyncio.ensure_future(run())

    def forget_one(self, container_id: str, exec_id: str) -> None:
        """The watch of one process (an exec deleted)."""
        task = self._tasks.pop((container_id, exec_id), None)
        if task is not None:
            task.cancel()
        self._ended.pop((container_id, exec_id), None)

    def forget(self, container_id: str) -> None:
        """The watches of a container (deleted)."""
        for key in [k for k in self._tasks if k[0] == container_id]:
            self._tasks.pop(key).cancel()
            self._ended.pop(key, None)

    async def close(self) -> None:
        await cancel_all(self._tasks.values())
        self._tasks.clear()


async def container_stats(client: AgentClient, container_id: str, vm_memory_bytes: int,
                          floors: checked_numbers.CounterFloors) -> handler_pb2.ContainerStatsResponse:
    """The container's cgroup numbers in the guest ("": the pod's, above
    all its containers), as the handler answers them; DataLoss when they
    cannot be in a VM of vm_memory_bytes, or a counter went below its floor
    (crust.kata.agent.checked_numbers)."""
    try:
        answer = await client.call("StatsContainer", agent_pb2.StatsContainerRequest(container_id=container_id),
                                   timeout=STATS_TIMEOUT)
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, f"the cgroup of {'container ' + container_id if container_id else 'the pod'}") \
            from None
    why = checked_numbers.container_stats(answer, vm_memory_bytes) or floors.check(container_id, answer)
    if why:
        raise DataLoss(f"the cgroup of {'container ' + container_id if container_id else 'the pod'}: the guest "
                       f"reported numbers that cannot be: {why}")
    return handler_pb2.ContainerStatsResponse(
        cpu=dict(answer.cpu_stat), memory=dict(answer.memory_stat), memory_events=dict(answer.memory_events),
        memory_current=answer.memory_current, memory_max=answer.memory_max, pids_current=answer.pids_current,
        pids_max=answer.pids_max, timestamp_ns=answer.timestamp_ns)
