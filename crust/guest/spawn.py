"""Starting a child with pipes, and learning of its exit from a pidfd.

asyncio's subprocess support ties a child's exit to its pipes (its wait()
may return only once every pipe closed, which a descendant left running
holds open) and watches each child from a thread of its own. The agent
needs the exit at once and the pipes on their own terms (the output grace
of specs/agent.proto), so a child here is a plain Popen whose pipes are
asyncio pipe transports and whose exit is a pidfd becoming readable.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import subprocess
from dataclasses import dataclass

from crust.sys import personality

# The pipes' size: a process that writes fast runs on while the agent is
# between reads (the kernel's 64 KiB would switch between the two every
# 64 KiB on the VM's one CPU). The most an unprivileged pipe may hold.
PIPE_BYTES = 1 << 20


@dataclass
class Child:
    popen: subprocess.Popen
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader
    stdin: asyncio.StreamWriter | None
    transports: list[asyncio.BaseTransport]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def close_pipes(self) -> None:
        for transport in self.transports:
            transport.close()


class _TerminalProtocol(asyncio.StreamReaderProtocol):
    """A terminal's master read: EIO (its last process left) is its end of
    output. As an error it would make the reader raise before handing out
    what it had buffered, the process's last output."""

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, OSError) and exc.errno == errno.EIO:
            exc = None
        super().connection_lost(exc)


async def _reader(loop: asyncio.AbstractEventLoop, pipe, limit: int,
                  protocol: type[asyncio.StreamReaderProtocol] = asyncio.StreamReaderProtocol,
                  ) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    reader = asyncio.StreamReader(limit=limit)
    transport, _ = await loop.connect_read_pipe(lambda: protocol(reader), pipe)
    return reader, transport


async def start(argv: list[str], *, stdin: bool, cwd: str, env: dict[str, str], user: int | None = None,
                group: int | None = None, extra_groups: list[int] | None = None, limit: int = 1 << 16,
                pass_fds: tuple[int, ...] = (), fixed_addresses: bool = False) -> Child:
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
    stdout, out_transport = await _reader(loop, popen.stdout, limit)
    stderr, err_transport = await _reader(loop, popen.stderr, limit)
    transports = [out_transport, err_transport]
    writer = None
    if stdin:
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, popen.stdin)
        writer = asyncio.StreamWriter(transport, protocol, None, loop)
        transports.append(transport)
    return Child(popen, stdout, stderr, writer, transports)


async def on_terminal(child: Child, master: int, limit: int, stdin: bool) -> Child:
    """child (an OCI runtime run with a console socket) with the process's
    terminal as its output and input: the master read for stdout, written
    for stdin; the runtime's own stderr stays stderr (its refusals)."""
    loop = asyncio.get_running_loop()
    stdout, transport = await _reader(loop, os.fdopen(os.dup(master), "rb", buffering=0), limit, _TerminalProtocol)
    transports = [transport, *child.transports]
    writer = None
    if stdin:
        written, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                          os.fdopen(os.dup(master), "wb", buffering=0))
        writer = asyncio.StreamWriter(written, protocol, None, loop)
        transports.append(written)
    return Child(child.popen, stdout, child.stderr, writer, transports)


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
