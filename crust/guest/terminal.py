"""An exec on a terminal: the enter program (crust.guest.enter) or the OCI
runtime makes the pseudo-terminal inside the container (its devpts) and
hands its master to the agent over a unix socket (a socket pair, or the
runtime's --console-socket: one connection, the master as SCM_RIGHTS);
the process's output is read from the master (one stream: on a terminal,
stderr is stdout), its input written to it, its size set on it
(TtyWinResize). A read of the master fails with EIO once
the last process holding the terminal is gone: its end of output.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import os
import socket
import struct
import termios
from pathlib import Path

from crust.common import ttrpc
from crust.guest.errors import AgentError

MASTER_WAIT = 30.0   # seconds the runtime has to hand over the terminal
_FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize)   # one descriptor's room


def listen(path: Path) -> socket.socket:
    """The console socket the runtime connects to."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        listener.bind(str(path))
        listener.listen(1)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    return listener


async def receive_master(listener: socket.socket, runtime_exited: asyncio.Future,
                         timeout: float | None = MASTER_WAIT) -> int:
    """The terminal's master the runtime sends; FAILED_PRECONDITION when
    the runtime exited first or sent none."""
    loop = asyncio.get_running_loop()
    accept = asyncio.ensure_future(loop.sock_accept(listener))
    done, _ = await asyncio.wait([accept, runtime_exited], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if accept not in done:
        accept.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await accept
        raise AgentError(ttrpc.FAILED_PRECONDITION, "process.terminal: the OCI runtime gave no terminal")
    connection, _ = accept.result()
    with connection:
        _, ancillary, _, _ = await loop.run_in_executor(None, lambda: _recvmsg(connection, _FD_SPACE))
    master = _master(ancillary)
    if master is None:
        raise AgentError(ttrpc.FAILED_PRECONDITION, "process.terminal: the OCI runtime sent no terminal")
    return master


def take_master(connection: socket.socket) -> int | None:
    """The master a program sent on connection before it exited (so
    without waiting), non-blocking; None when it sent none."""
    connection.setblocking(False)
    try:
        _, ancillary, _, _ = connection.recvmsg(1, _FD_SPACE)
    except BlockingIOError:
        return None
    return _master(ancillary)


def _master(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The first descriptor a message carried, non-blocking (any other
    closed); None when it carried none."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    for extra in fds[1:]:
        os.close(extra)
    if not fds:
        return None
    os.set_blocking(fds[0], False)
    return fds[0]


def _recvmsg(connection: socket.socket, space: int):
    connection.setblocking(True)
    connection.settimeout(MASTER_WAIT)
    return connection.recvmsg(4096, space)


def resize(master: int, width: int, height: int) -> None:
    """The terminal's size in characters (the process gets SIGWINCH)."""
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, 0, 0))


def check_size(width: int, height: int) -> None:
    for field, value in (("columns", width), ("rows", height)):
        if not 1 <= value <= 0xFFFF:
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field}: {value} is not 1..65535")
