"""A process's stdout and stderr, copied to the fifos containerd gave.

containerd (CRI's container log, ExecSync's output) made the fifos and reads
them. The shim opens each for reading and writing: that open never blocks,
whether containerd has its end open or not (it has not while containerd
restarts), and the pipe keeps what was written until a reader comes back.
Writes are non-blocking and wait for room through the event loop, so a
reader that stops reading holds up only its own process's copy, never the
shim.

Closing is what tells containerd the output ended, and closing the last
open end of a pipe throws away what it still holds: a process that ended
while containerd was away would lose its last words. So a finished copy is
closed only once a reader has the fifo open (containerd, back, reattached
its log to it), or the task was deleted, or after a bound.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os

log = logging.getLogger(__name__)


class FifoWriter:
    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.fd is None:
                return
            try:
                written = os.write(self.fd, view)
                view = view[written:]
                continue
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    return
                raise
            await self._writable()

    async def _writable(self) -> None:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.add_writer(self.fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            if self.fd is not None:
                loop.remove_writer(self.fd)

    def has_reader(self) -> bool:
        """Whether someone else has the fifo open for reading: a write-only,
        non-blocking open fails with ENXIO when no reader is there (so this
        holds only once our own read-write descriptor is gone)."""
        try:
            os.close(os.open(f"/proc/self/fd/{self.fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
            return True
        except OSError as exc:
            return exc.errno != errno.ENXIO

    async def close_once_read(self, give_up: asyncio.Event, bound: float, interval: float = 0.25) -> None:
        """Close once a reader has the fifo open, give_up is set, or bound
        seconds passed. Meanwhile only a write-only descriptor is held: it
        keeps what the pipe holds (a pipe's buffer lives while any end is
        open) without counting as a reader."""
        if self.fd is None:
            return
        try:
            # Our read-write descriptor is a reader, so this open succeeds.
            write_only = os.open(f"/proc/self/fd/{self.fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            self.close()
            return
        os.close(self.fd)
        self.fd = write_only
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound
        while not self.has_reader() and not give_up.is_set() and loop.time() < deadline:
            try:
                await asyncio.wait_for(give_up.wait(), interval)
            except asyncio.TimeoutError:
                pass
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def open_fifo(path: str) -> FifoWriter | None:
    """The writer for a fifo path containerd gave ("" = none wanted)."""
    if not path:
        return None
    try:
        return FifoWriter(path.removeprefix("fifo://") if path.startswith("fifo://") else path)
    except OSError as exc:
        log.warning("cannot open a stdio fifo", extra={"fields": {"path": path, "error": str(exc)}})
        return None
