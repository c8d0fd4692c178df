"""A VM's serial console on the host, bounded: what a guest writes there
cannot fill the host's disk.

QEMU serves the guest's console (ttyS0) on a unix socket of the VM
(`-chardev socket,server=on`); the handler reads it and writes
`console.log` in the VM's work directory, at most FILE_BYTES, then moves
it to `console.log.1` (replacing the one before) and starts anew. So the
two files hold at most 2 x FILE_BYTES, and always the newest FILE_BYTES
written (or all of it, when less was), without a gap. A chunk of
FILE_BYTES or more keeps its last FILE_BYTES alone.

A guest that writes faster than the handler reads is held back: QEMU's
UART waits for the socket. While no handler reads (a handler restarting),
QEMU drops what the guest writes; the next handler reads on (adopt).
Reading costs the handler one read and one write per 64 KiB.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Callable

from crust.common.private import open_new

log = logging.getLogger(__name__)

# Each of console.log and console.log.1 (docs/microvm.md states the bound).
FILE_BYTES = 1 << 20
READ_BYTES = 64 << 10
# How long QEMU may take to make the socket (it does before its QMP greeting).
CONNECT_TIMEOUT = 10.0
# What a log line or an error quotes of the console: its last bytes.
TAIL_BYTES = 4 << 10


def previous(path: Path) -> Path:
    return path.with_name(path.name + ".1")


class RotatingFile:
    """A file of at most limit bytes, moved to <name>.1 when the next
    write would take it over; the newest limit bytes are always kept."""

    def __init__(self, path: Callable[[], Path], limit: int = FILE_BYTES):
        self._path = path     # the file's path now (a pooled VM's directory is renamed)
        self.limit = limit
        self._fd: int | None = None
        self.size = 0
        self.rotations = 0

    def _open(self) -> None:
        path = self._path()
        self._fd = open_new(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW)
        self.size = os.fstat(self._fd).st_size

    def write(self, data: bytes) -> None:
        if self._fd is None:
            self._open()
        if len(data) >= self.limit:
            # It alone fills the file: what came before it is older than
            # the newest limit bytes, and would leave a gap.
            data = data[-self.limit:]
            self.close()
            path = self._path()
            previous(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            self.rotations += 1
            self._open()
        elif self.size + len(data) > self.limit:
            self.close()
            path = self._path()
            os.replace(path, previous(path))
            self.rotations += 1
            self._open()
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            self.size += written
            view = view[written:]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ConsoleLog:
    """One VM's console: QEMU's socket read into a RotatingFile."""

    def __init__(self, socket: Path, path: Callable[[], Path], limit: int = FILE_BYTES):
        self.socket = socket
        self.file = RotatingFile(path, limit)
        self._task: asyncio.Task | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self, timeout: float = CONNECT_TIMEOUT) -> bool:
        """Read the console from now on; False (logged) when QEMU's socket
        does not answer: the VM runs, its console unread."""
        if self._task is not None and not self._task.done():
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(str(self.socket))
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if loop.time() > deadline:
                    log.warning("the VM's console is not read: %s", exc)
                    return False
                await asyncio.sleep(0.02)
        self._task = asyncio.create_task(self._copy(reader), name=f"console {self.socket}")
        return True

    async def _copy(self, reader: asyncio.StreamReader) -> None:
        try:
            while data := await reader.read(READ_BYTES):
                self.file.write(data)
        except ConnectionError:
            pass
        except OSError as exc:   # a full disk: the console goes unread, the VM runs on
            log.error("the VM's console could not be written: %s", exc)
        finally:
            self.file.close()

    async def close(self) -> None:
        """Stop reading (what QEMU wrote before is in the file)."""
        task, self._task = self._task, None
        if task is not None:
            if not task.done():
                # Whatever QEMU sent before it exited is read first.
                try:
                    await asyncio.wait_for(asyncio.shield(task), 0.2)
                except asyncio.TimeoutError:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.file.close()


def tail(path: Path, lines: int, limit: int = TAIL_BYTES) -> str:
    """The console's last lines, from at most its last `limit` bytes (the
    guest writes what it likes: a line may be endless)."""
    data = b""
    for part in (path, previous(path)):
        try:
            with open(part, "rb") as handle:
                handle.seek(0, os.SEEK_END)
                size = handle.tell()
                handle.seek(max(0, size - (limit - len(data))))
                data = handle.read() + data
        except OSError:
            continue
        if len(data) >= limit or part == previous(path):
            break
    text = data.decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])
