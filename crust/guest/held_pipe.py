"""A process's output pipe as the agent's holding buffer: the bytes the
host has not acknowledged stay in the pipe itself (sized to the stream's
limit), so a process that writes faster than the host reads waits on its
own write, and the agent never copies them. An answer's bytes are tee'd
from the pipe into a pipe of their own (PipedBytes, page references, no
copy) that the port's writer splices onto the virtio port; acknowledging
an offset drops the bytes below it (spliced to /dev/null); a resend of
the same offset tees the same bytes again.

A pipe readable does not say new bytes came (the held ones keep it
readable), so the agent watches it only while a reader waits on an empty
pipe; its end (every writer gone) comes from an epoll set that asks the
pipe for nothing but a hang-up, which the kernel reports whatever the
pipe holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select

from crust.sys import pipes

# One answer's pipe: what a read answers at most (crust.guest.service's
# MAX_READ_BYTES). Its 256 pages make one buffer of 256 entries on the
# port's queue, within the 1024 QEMU takes in one.
ANSWER_PIPE_BYTES = 1 << 20
# An answer shorter than this is read out of its pipe and written with
# its frame (one write to the port): a splice and its extra buffer cost
# more than the copy of a few pages.
SPLICE_MIN_BYTES = 16 << 10


class PipedBytes:
    """count bytes waiting in a pipe of their own for the port's writer:
    spliced from fd (the read end), closed once all left or dropped."""

    def __init__(self, fd: int, count: int):
        self.fd: int | None = fd
        self.count = count
        self.left = count

    def __len__(self) -> int:
        return self.count

    def take(self) -> bytes:
        """The bytes themselves (read out of the pipe), for a writer that
        cannot splice; the pipe closed."""
        parts = []
        while self.left and self.fd is not None:
            part = os.read(self.fd, self.left)
            if not part:
                break
            parts.append(part)
            self.left -= len(part)
        self.close()
        return b"".join(parts)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        # An answer never written (its connection went) still frees its pipe.
        self.close()


class HeldPipe:
    def __init__(self, fd: int, capacity: int):
        """fd: a pipe's read end, owned from now on; its capacity raised
        toward capacity (as far as the agent may)."""
        self.fd = fd
        os.set_blocking(fd, False)
        self.capacity = pipes.set_size(fd, capacity)
        self.hung_up = False
        self._loop = asyncio.get_running_loop()
        self._watched = None   # what the pipe's readability wakes

    def queued(self) -> int:
        return pipes.queued(self.fd)

    def discard(self, count: int) -> None:
        dropped = pipes.discard(self.fd, count)
        if dropped != count:
            raise RuntimeError(f"the pipe dropped {dropped} of the {count} bytes it held")

    def answer(self, count: int, piped: bool) -> PipedBytes | bytes:
        """Up to count bytes from the pipe's head, which keeps them: in a
        pipe of their own (piped, and enough to be worth a splice), else
        as bytes. Fewer when the pipe's pages are partly filled (the
        answer's pipe takes 256 of them)."""
        read_end, write_end = pipes.make(ANSWER_PIPE_BYTES)
        try:
            got = pipes.tee(self.fd, write_end, count)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        answer = PipedBytes(read_end, got)
        return answer if piped and got >= SPLICE_MIN_BYTES else answer.take()

    def peek(self) -> bytes:
        """Everything held, kept (tee'd into a pipe as large as this one)."""
        read_end, write_end = pipes.make(self.capacity)
        try:
            count = self.queued()
            if count:
                pipes.tee(self.fd, write_end, count)
            os.close(write_end)
            write_end = -1
            parts = []
            while part := os.read(read_end, 1 << 20):
                parts.append(part)
            return b"".join(parts)
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)

    def take_all(self) -> bytes:
        """What the pipe holds now, read out of it."""
        parts, count = [], self.queued()
        while count > 0:
            try:
                part = os.read(self.fd, count)
            except BlockingIOError:
                break
            if not part:
                break
            parts.append(part)
            count -= len(part)
        return b"".join(parts)

    def wake_on_bytes(self, wake) -> None:
        """wake() once the pipe is readable (a byte, or its end); the pipe
        is watched only until then."""
        if self._watched is None and self.fd >= 0:
            self._watched = wake
            self._loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        wake, self._watched = self._watched, None
        self._loop.remove_reader(self.fd)
        if wake is not None:
            wake()

    async def until_hung_up(self) -> None:
        """Returns once every writer of the pipe closed it."""
        changes = select.epoll()
        try:
            changes.register(self.fd, 0)   # a hang-up is reported to every registration
            while not self.hung_up:
                ready = self._loop.create_future()
                self._loop.add_reader(changes.fileno(), lambda: ready.done() or ready.set_result(None))
                try:
                    await ready
                finally:
                    self._loop.remove_reader(changes.fileno())
                self.hung_up = any(events & select.EPOLLHUP for _fd, events in changes.poll(0))
        finally:
            changes.close()

    def close(self) -> None:
        if self.fd >= 0:
            if self._watched is not None:
                self._loop.remove_reader(self.fd)
                self._watched = None
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
