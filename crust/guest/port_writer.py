"""The agent's writes to its virtio-serial port.

The guest's virtio console driver takes at most 32 KiB per write(2), each
write its own buffer on the port's queue and its own notice to QEMU.
asyncio's pipe transport writes once per turn of the event loop, so an
answer of 1 MiB took 32 turns, each a wakeup of the agent on the VM's one
vCPU, which the writing container shares. PortWriter writes as much as the
port takes at once and waits for the port only when it takes no more; and
it puts a short piece given with others (a ttrpc frame's header, written
with its payload by writelines) in one write with what follows it, so a
small answer is one buffer on the port's queue, not two.

A piece may be PipedBytes (crust.guest.held_pipe): bytes left in a pipe,
spliced onto the port (the guest's virtio console puts the pipe's pages
on its queue itself: no copy through the agent). Pieces go out in order,
whole: a splice the port took in part goes on before anything after it.

It is the part of asyncio.StreamWriter (and of its transport) that a ttrpc
connection and the port's server use: write, writelines, drain, close,
abort, the bytes not written yet. A write error ends it: what is pending
is dropped, and drain raises ConnectionResetError, as a lost connection
does.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections import deque

from crust.guest.held_pipe import PipedBytes
from crust.guest.streams import drop_head, head
from crust.sys import pipes

# drain() returns once at most this much waits for the port (asyncio's
# default high-water mark).
HIGH_WATER = 64 << 10
# The most the guest's virtio console driver takes in one write(2): a
# piece shorter than this goes out joined with what follows it, up to this.
PORT_WRITE_MAX = 32 << 10


class PortWriter:
    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop, high_water: int = HIGH_WATER):
        """fd: non-blocking, owned from now on (closed by close() once
        everything left, or by abort())."""
        self._fd = fd
        self._loop = loop
        self._high_water = high_water
        self._pending: deque[memoryview | PipedBytes] = deque()
        self._size = 0
        self._watching = False   # waiting for the port to take more
        self._closing = False
        self._error: OSError | None = None
        self._drainers: list[asyncio.Future] = []
        self._closed = loop.create_future()

    # -- what ttrpc and the port's server use ---------------------------------------

    @property
    def transport(self) -> PortWriter:
        return self

    def get_write_buffer_size(self) -> int:
        return self._size

    def is_closing(self) -> bool:
        return self._closing

    def write(self, data: bytes) -> None:
        """data after everything written before it; once closing, dropped
        (as a closing transport drops it)."""
        self.writelines((data,))

    def writelines(self, pieces) -> None:
        """The pieces in order, as one write would take them joined."""
        if self._closing:
            return
        for data in pieces:
            if data:
                self._pending.append(data if isinstance(data, PipedBytes) else memoryview(data))
                self._size += len(data)
        if self._pending and not self._watching:
            self._flush()

    async def drain(self) -> None:
        """Until at most the high-water mark waits (or the writer closed);
        ConnectionResetError once a write failed."""
        while self._size > self._high_water and self._error is None and not self._closed.done():
            waiter = self._loop.create_future()
            self._drainers.append(waiter)
            await waiter
        if self._error is not None:
            raise ConnectionResetError(f"the port: {self._error.strerror or self._error}")

    def close(self) -> None:
        """No more writes; the descriptor is closed once the rest is written."""
        self._closing = True
        if not self._pending:
            self._finish()

    def abort(self) -> None:
        """Closed now; what was not written is dropped."""
        self._closing = True
        for piece in self._pending:
            if isinstance(piece, PipedBytes):
                piece.close()
        self._pending.clear()
        self._size = 0
        self._finish()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    # -- inside ----------------------------------------------------------------------

    def _flush(self) -> None:
        while self._pending:
            first = self._pending[0]
            try:
                if isinstance(first, PipedBytes):
                    written = pipes.splice(first.fd, self._fd, first.left)
                else:
                    # A short piece goes out joined with the bytes that
                    # follow it (a copy of at most PORT_WRITE_MAX).
                    written = os.write(self._fd, head(self._leading_bytes(), PORT_WRITE_MAX))
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if isinstance(first, PipedBytes) and exc.errno in (errno.EINVAL, errno.ENOSYS):
                    # A port that does not splice: the rest of the
                    # answer as bytes, in its place.
                    self._pending[0] = memoryview(first.take())
                    continue
                self._error = exc
                self.abort()
                return
            if written == 0:
                break
            self._size -= written
            if isinstance(first, PipedBytes):
                first.left -= written
                if not first.left:
                    first.close()
                    self._pending.popleft()
            else:
                drop_head(self._pending, written)
        if self._pending and not self._watching:
            self._loop.add_writer(self._fd, self._flush)
            self._watching = True
        elif not self._pending and self._watching:
            self._loop.remove_writer(self._fd)
            self._watching = False
        if self._size <= self._high_water:
            self._wake()
        if self._closing and not self._pending:
            self._finish()

    def _leading_bytes(self) -> list[memoryview]:
        """The pieces of bytes before the first PipedBytes, as many as one
        write may join."""
        leading, size = [], 0
        for piece in self._pending:
            if isinstance(piece, PipedBytes) or size >= PORT_WRITE_MAX:
                break
            leading.append(piece)
            size += len(piece)
        return leading

    def _wake(self) -> None:
        drainers, self._drainers = self._drainers, []
        for waiter in drainers:
            if not waiter.done():
                waiter.set_result(None)

    def _finish(self) -> None:
        if self._closed.done():
            return
        if self._watching:
            self._loop.remove_writer(self._fd)
            self._watching = False
        os.close(self._fd)
        self._closed.set_result(None)
        self._wake()
