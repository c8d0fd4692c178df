"""A process of the pod as the shim keeps it for containerd (created,
running, stopped; its exit; its stdio fifos), the containers that hold
them, and the copies between containerd's fifos and the handler: the
output stream into the stdout and stderr fifos, the stdin fifo into the
process's input.

The output is copied from the handler's stream (PodRuntime.ReadOutput, a
ttrpc stream: crust.containerd_shim.handler_client),
resumed at the bytes already written when the handler restarts; a fifo is
closed only once containerd read what it holds. The input is read from
the fifo without blocking (before containerd opens its end the fifo is
neither readable nor hung up) and written to the handler at its offset.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from crust.api import containerd_task_types_pb2 as task_types
from crust.api import handler_pb2
from crust.common import ttrpc
from crust.common.ttrpc import TtrpcError
from crust.containerd_shim.stdio import FifoWriter, open_fifo

log = logging.getLogger(__name__)

# A WriteInput carries at most what the handler takes in one bytes field
# (crust.common.limits.MAX_STRING, not imported: limits imports grpc's
# status codes through crust.common.errors, which the shim does without).
INPUT_CHUNK = 4096
# How long the output's copy retries a handler that does not answer
# (restarting) before the output counts as cut.
OUTPUT_HANDLER_GONE_SECONDS = 60.0
# How long a finished process's fifos stay open for a containerd that is away.
FIFO_HOLD_SECONDS = 600.0
# Exited execs containerd never deletes (its caller died between the exit
# and the Delete) are forgotten as the handler forgets them
# (crust.kata.pod.processes): this long after the exit, or once more than
# this many exited execs of their container wait (the oldest first).
EXITED_EXEC_SECONDS = 600.0
EXITED_EXECS_KEPT = 64

CREATED, RUNNING, STOPPED = task_types.CREATED, task_types.RUNNING, task_types.STOPPED


@dataclass
class Process:
    container_id: str
    exec_id: str
    stdin: str = ""
    stdout: str = ""
    stderr: str = ""
    terminal: bool = False
    spec: handler_pb2.ProcessSpec | None = None
    status: int = CREATED
    guest_pid: int = 0
    exit_status: int = 0
    exited_at_ns: int = 0
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when containerd deleted the process: its fifos need no reader any more.
    deleted: asyncio.Event = field(default_factory=asyncio.Event)
    # Set by CloseIO: the input ends once what containerd wrote is copied.
    input_closed: asyncio.Event = field(default_factory=asyncio.Event)
    watcher: asyncio.Task | None = None
    feeder: asyncio.Task | None = None
    # Set when the process exited by itself but its output did not reach
    # the fifos whole: why (an exec's Wait fails with it).
    output_cut: str = ""
    # The copy of its output, once the process has exited and it is drained.
    draining: asyncio.Future | None = None
    drain_killed: bool = False
    # Forgets an exited exec containerd does not delete (Container.bound_exited).
    expiry: asyncio.TimerHandle | None = None

    @property
    def id(self) -> str:
        """The id events name the process by: the exec's, or the container's."""
        return self.exec_id or self.container_id

    def stop(self, exit_status: int, exited_at_ns: int | None = None) -> bool:
        if self.status == STOPPED:
            return False
        self.status = STOPPED
        self.exit_status = exit_status
        self.exited_at_ns = exited_at_ns or time.time_ns()
        self.exited.set()
        return True


@dataclass
class Container:
    id: str
    bundle: str
    sandbox: bool
    init: Process
    rootfs_mounted: bool = False
    execs: dict[str, Process] = field(default_factory=dict)

    def bound_exited(self, process: Process) -> None:
        """An exec that exited: forgotten unless deleted in time (see
        EXITED_EXEC_SECONDS and EXITED_EXECS_KEPT)."""
        process.expiry = asyncio.get_running_loop().call_later(EXITED_EXEC_SECONDS, self._forget, process)
        exited = [p for p in self.execs.values() if p.status == STOPPED]
        if len(exited) > EXITED_EXECS_KEPT:
            exited.sort(key=lambda p: p.exited_at_ns)
            for old in exited[:len(exited) - EXITED_EXECS_KEPT]:
                self._forget(old)

    def forget(self, process: Process) -> None:
        """An exec gone (deleted, or never deleted in time)."""
        if process.expiry is not None:
            process.expiry.cancel()
        if self.execs.get(process.exec_id) is process:
            del self.execs[process.exec_id]
        process.deleted.set()

    def _forget(self, process: Process) -> None:
        if self.execs.get(process.exec_id) is process and process.status == STOPPED:
            self.forget(process)
            log.info("an exited exec nobody deleted is forgotten", extra={"fields": {
                "container": self.id, "exec": process.exec_id}})

    def process(self, exec_id: str) -> Process:
        if not exec_id:
            return self.init
        try:
            return self.execs[exec_id]
        except KeyError:
            raise TtrpcError(ttrpc.NOT_FOUND, f"container {self.id} has no exec {exec_id}") from None


async def copy_output(read: Callable[[handler_pb2.ReadOutputRequest], AsyncIterator[handler_pb2.OutputChunk]],
                      process: Process) -> str:
    """The process's output from the handler into containerd's fifos
    until the handler's stream ends: "" when it ended whole, else why
    not (the handler said DataLoss or refused, or stayed away)."""
    writers: dict[int, FifoWriter | None] = {
        handler_pb2.OutputChunk.STDOUT: open_fifo(process.stdout),
        handler_pb2.OutputChunk.STDERR: open_fifo(process.stderr),
    }
    offsets = {handler_pb2.OutputChunk.STDOUT: 0, handler_pb2.OutputChunk.STDERR: 0}
    away_since = None
    try:
        while True:
            try:
                stream = read(handler_pb2.ReadOutputRequest(
                    container_id=process.container_id, exec_id=process.exec_id,
                    stdout_offset=offsets[handler_pb2.OutputChunk.STDOUT],
                    stderr_offset=offsets[handler_pb2.OutputChunk.STDERR]))
                async for chunk in stream:
                    away_since = None
                    if chunk.stream not in offsets:
                        continue
                    # A resumed stream may repeat what was written already.
                    skip = offsets[chunk.stream] - chunk.offset
                    data = chunk.data[skip:] if skip > 0 else chunk.data
                    if not data:
                        continue
                    offsets[chunk.stream] += len(data)
                    writer = writers[chunk.stream]
                    if writer is not None:
                        await writer.write(data)
                return ""  # the process exited and everything was sent
            except TtrpcError as exc:
                if exc.code != ttrpc.UNAVAILABLE or process.status == STOPPED:
                    return exc.message or f"code {exc.code}"
                # The handler restarts: resume at our offsets.
                away_since = away_since or time.monotonic()
                if time.monotonic() - away_since > OUTPUT_HANDLER_GONE_SECONDS:
                    return (f"the output was cut after {offsets[handler_pb2.OutputChunk.STDOUT]} bytes of "
                            f"stdout and {offsets[handler_pb2.OutputChunk.STDERR]} of stderr: the handler "
                            f"did not answer for {OUTPUT_HANDLER_GONE_SECONDS:.0f} s ({exc.message})")
                await asyncio.sleep(0.5)
    finally:
        # Closing ends containerd's copy; what the pipe holds must be read first.
        for writer in writers.values():
            if writer is not None:
                asyncio.ensure_future(writer.close_once_read(process.deleted, FIFO_HOLD_SECONDS))


async def copy_input(process: Process, write: Callable[[Process, int, bytes, bool], Awaitable[int]]) -> None:
    """containerd's stdin fifo -> the process's input in the guest, until
    every writer closed it (or CloseIO, once what it holds is copied):
    then the process reads end of file. Non-blocking: before containerd
    opens its end the fifo is neither readable nor hung up."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.open(process.stdin, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        log.error("stdin not opened", extra={"fields": {"container": process.container_id,
                                                        "exec": process.exec_id, "error": str(exc)}})
        return
    readable = asyncio.Event()
    loop.add_reader(fd, readable.set)
    offset, ended, closed = 0, False, False
    try:
        while not ended:
            closing = asyncio.ensure_future(process.input_closed.wait())
            ready = asyncio.ensure_future(readable.wait())
            await asyncio.wait({closing, ready}, return_when=asyncio.FIRST_COMPLETED)
            closing.cancel()
            ready.cancel()
            readable.clear()
            while True:
                try:
                    data = os.read(fd, INPUT_CHUNK)
                except BlockingIOError:
                    ended = process.input_closed.is_set()   # CloseIO: nothing more is coming
                    break
                if not data:
                    ended = True   # every writer is gone
                    break
                offset = await write(process, offset, data, False)
        await write(process, offset, b"", True)
        closed = True
    except TtrpcError as exc:
        log.warning("stdin not copied", extra={"fields": {"container": process.container_id,
                                                          "exec": process.exec_id, "error": exc.message}})
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    if not closed and process.status != STOPPED:
        # The copy failed: the process reads the end of its input rather
        # than waiting for bytes that will never come.
        try:
            await write(process, offset, b"", True)
        except TtrpcError:
            pass
