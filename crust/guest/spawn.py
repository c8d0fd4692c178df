"""Starting a child with pipes, and learning of its exit from a pidfd.

asyncio's subprocess support ties a child's exit to its pipes (its wait()
may return only once every pipe closed, which a descendant left running
holds open) and watches each child from a thread of its own. The agent
needs the exit at once and the pipes on their own terms (the output grace
of specs/agent.proto), so a child here is a plain Popen whose pipes are
read as they are (PipeReader) and whose exit is a pidfd becoming readable.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import subprocess
from dataclasses import dataclass
from typing import BinaryIO

from crust.sys import personality

# The pipes' size: a process that writes fast runs on while the agent is
# between reads (the kernel's 64 KiB would switch between the two every
# 64 KiB on the VM's one CPU). The most an unprivileged pipe may hold.
PIPE_BYTES = 1 << 20


class PipeReader:
    """A child's pipe (or its terminal's master) as the agent reads it:
    read(n) is one read(2) straight into the bytes it returns, once the
    pipe has something. asyncio's StreamReader copies every byte twice on
    the way (into its buffer, out of it), and under emulation a copy of a
    fast writer's output costs the vCPU that writer runs on; here what
    the child writes waits in its pipe until it is read. On a terminal,
    EIO (its last process left) reads as the end."""

    def __init__(self, pipe: BinaryIO, terminal: bool = False):
        self._pipe = pipe   # closed with the reader
        self._fd = pipe.fileno()
        os.set_blocking(self._fd, False)
        self.terminal = terminal
        self._ended = False
        self._waiting: asyncio.Future | None = None

    async def read(self, n: int = -1) -> bytes:
        """Up to n bytes (at least one), b"" at the end; n < 0: everything
        up to the end."""
        if n == 0:
            return b""
        if n < 0:
            parts = []
            while chunk := await self.read(1 << 16):
                parts.append(chunk)
            return b"".join(parts)
        while not self._ended:
            try:
                data = os.read(self._fd, n)
            except BlockingIOError:
                await self._readable()
                continue
            except OSError as exc:
                if not (self.terminal and exc.errno == errno.EIO):
                    raise
                data = b""
            self._ended = not data
            return data
        return b""

    async def _readable(self) -> None:
        loop = asyncio.get_running_loop()
        self._waiting = ready = loop.create_future()
        loop.add_reader(self._fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            self._waiting = None
            if not self._pipe.closed:
                loop.remove_reader(self._fd)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """The pipe closed; a read waiting for it fails with EBADF."""
        if self._pipe.closed:
            return
        if self._waiting is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            if not self._waiting.done():
                self._waiting.set_exception(OSError(errno.EBADF, "the pipe was closed"))
        self._pipe.close()


@dataclass
class Child:
    popen: subprocess.Popen
    stdout: PipeReader
    stderr: PipeReader
    stdin: asyncio.StreamWriter | None
    # What close_pipes closes: the readers, the input's transport.
    pipes: list[PipeReader | asyncio.BaseTransport]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def close_pipes(self) -> None:
        for pipe in self.pipes:
            pipe.close()


async def start(argv: list[str], *, stdin: bool, cwd: str, env: dict[str, str], user: int | None = None,
                group: int | None = None, extra_groups: list[int] | None = None, pass_fds: tuple[int, ...] = (),
                fixed_addresses: bool = False) -> Child:
    """Start argv in a session of its own (it leads its process group).
    The start blocks the loop only for the fork and exec (Python vforks
    when no ids change): far less than handing it to a thread.
    fixed_addresses: argv is loaded without address randomization
    (crust.sys.personality), for a program that resets it before any
    workload of it runs."""
    with personality.fixed_addresses() if fixed_addresses else contextlib.nullcontext():
        popen = subprocess.Popen(  # noqa: ASYNC220
            argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, cwd=cwd, env=env, user=user, group=group, extra_groups=extra_groups,
            start_new_session=True, close_fds=True, pass_fds=pass_fds, pipesize=PIPE_BYTES)
    loop = asyncio.get_running_loop()
    stdout, stderr = PipeReader(popen.stdout), PipeReader(popen.stderr)
    pipes: list[PipeReader | asyncio.BaseTransport] = [stdout, stderr]
    writer = None
    if stdin:
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, popen.stdin)
        writer = asyncio.StreamWriter(transport, protocol, None, loop)
        pipes.append(transport)
    return Child(popen, stdout, stderr, writer, pipes)


async def on_terminal(child: Child, master: int, stdin: bool) -> Child:
    """child (an OCI runtime run with a console socket) with the process's
    terminal as its output and input: the master read for stdout, written
    for stdin; the runtime's own stderr stays stderr (its refusals)."""
    loop = asyncio.get_running_loop()
    stdout = PipeReader(os.fdopen(os.dup(master), "rb", buffering=0), terminal=True)
    pipes: list[PipeReader | asyncio.BaseTransport] = [stdout, *child.pipes]
    writer = None
    if stdin:
        written, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                          os.fdopen(os.dup(master), "wb", buffering=0))
        writer = asyncio.StreamWriter(written, protocol, None, loop)
        pipes.append(written)
    return Child(child.popen, stdout, child.stderr, writer, pipes)


async def exited(popen: subprocess.Popen) -> int:
    """The child's return code (negative: the signal) once it exited; it
    is reaped here."""
    await _until(popen.pid, popen.poll)
    return popen.returncode


async def exited_pid(pid: int) -> int:
    """As exited, of a child the agent has no Popen of (one that another
    child cloned as the agent's)."""
    status: list[int] = []

    def poll() -> int | None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status.append(os.waitstatus_to_exitcode(raw))
        return status[0] if status else None

    await _until(pid, poll)
    return status[0]


async def _until(pid: int, poll) -> None:
    """Until poll() is not None, looked at each time the pid's pidfd
    becomes readable (the process exited)."""
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)
    try:
        readable = loop.create_future()
        loop.add_reader(pidfd, lambda: readable.done() or readable.set_result(None))
        try:
            while poll() is None:
                await readable
                readable = loop.create_future()
        finally:
            loop.remove_reader(pidfd)
    finally:
        os.close(pidfd)
