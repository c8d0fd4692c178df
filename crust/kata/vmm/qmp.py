"""A minimal asyncio QMP client: just what hotplug and resize need.

QMP is JSON lines over a unix socket. Commands carry an "id" so that answers
are matched even when events are interleaved. Events are kept with a
sequence number: a caller takes `mark()` *before* the command whose event it
awaits (device_del -> DEVICE_DELETED), so an event that arrives before the
caller starts waiting is not missed.
"""

from __future__ import annotations

import array
import asyncio
import itertools
import json
import logging
import os
import socket
import time
from typing import Any, Callable

log = logging.getLogger(__name__)


class QmpError(Exception):
    def __init__(self, command: str, error: dict):
        self.command = command
        self.error_class = error.get("class", "")
        self.desc = error.get("desc", str(error))
        super().__init__(f"QMP {command}: {self.error_class}: {self.desc}")


class QmpGone(Exception):
    """The monitor socket closed: QEMU exited."""


class QmpTimeout(QmpGone):
    """QEMU took the connection but said nothing: it hangs (seen when KVM
    misbehaves under nested virtualisation: the socket exists before the
    accelerator is set up, the main loop that would greet never runs)."""


class QmpClient:
    def __init__(self, socket_path: str):
        self.socket_path = socket_path
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future] = {}
        self._events: list[tuple[int, dict]] = []
        self._seq = 0
        self._changed = asyncio.Condition()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None
        self.greeting: dict = {}
        self.closed: str | None = None

    async def connect(self, timeout: float = 10.0) -> None:
        """Connect (retrying while QEMU creates the socket), negotiate capabilities."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(self.socket_path, limit=2**22)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise QmpGone(f"QMP socket {self.socket_path} did not come up") from None
                await asyncio.sleep(0.02)
        try:
            greeting = await asyncio.wait_for(self._reader.readline(), max(deadline - time.monotonic(), 1.0))
        except asyncio.TimeoutError:
            raise QmpTimeout(f"QEMU sent no QMP greeting within {timeout:.0f}s") from None
        try:
            self.greeting = json.loads(greeting)
        except ValueError:
            raise QmpGone(f"QMP greeting unreadable: {greeting[:200]!r}") from None
        self._task = asyncio.create_task(self._read_loop(), name=f"qmp-reader {self.socket_path}")
        await self.execute("qmp_capabilities")

    async def _read_loop(self) -> None:
        try:
            while raw := await self._reader.readline():
                msg = json.loads(raw)
                if "event" in msg:
                    async with self._changed:
                        self._seq += 1
                        self._events.append((self._seq, msg))
                        del self._events[:-256]
                        self._changed.notify_all()
                    log.debug("QMP event %s", msg)
                    continue
                fut = self._pending.pop(str(msg.get("id")), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (ConnectionError, OSError, ValueError) as exc:
            log.debug("QMP reader stopped: %s", exc)
        self._gone("the QMP socket closed (QEMU exited?)")
        # Nothing more can be said on it: the socket goes now, not when this
        # client is collected (a stream keeps a half-closed socket open).
        self._writer.close()
        async with self._changed:
            self._changed.notify_all()   # wake wait_event() callers: nothing more will come

    def _gone(self, reason: str) -> None:
        self.closed = self.closed or reason
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(QmpGone(self.closed))
        self._pending.clear()

    async def execute(self, command: str, arguments: dict | None = None, timeout: float = 30.0) -> Any:
        """Run a command; its "return" value, or QmpError."""
        async def send(line: bytes) -> None:
            self._writer.write(line)
            await self._writer.drain()

        return await self._call(command, arguments, timeout, send)

    async def execute_with_fd(self, command: str, arguments: dict, fd: int, timeout: float = 30.0) -> Any:
        """A command that takes a descriptor with it (getfd, add-fd): the
        line is sent with fd as SCM_RIGHTS on the monitor's socket, which
        keeps it for this connection. Nothing else is written meanwhile:
        the transport's buffer is empty (a line at a time, written at once)
        and this runs between two awaits."""
        async def send(line: bytes) -> None:
            transport = self._writer.transport
            while transport.get_write_buffer_size():
                await self._writer.drain()
                await asyncio.sleep(0)
            # The transport's socket, used directly for the one sendmsg
            # asyncio does not offer, through a duplicate of its descriptor.
            with socket.socket(fileno=os.dup(self._writer.get_extra_info("socket").fileno())) as raw:
                sent = raw.sendmsg([line], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            if sent != len(line):
                raise ConnectionError("a short write on the QMP socket")

        return await self._call(command, arguments, timeout, send)

    async def _call(self, command: str, arguments: dict | None, timeout: float,
                    send: Callable[[bytes], Any]) -> Any:
        if self.closed:
            raise QmpGone(f"{command}: {self.closed}")
        ident = str(next(self._ids))
        fut = asyncio.get_running_loop().create_future()
        self._pending[ident] = fut
        msg = {"execute": command, "id": ident}
        if arguments:
            msg["arguments"] = arguments
        try:
            await send(json.dumps(msg).encode() + b"\n")
            answer = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise QmpTimeout(f"{command}: QEMU did not answer within {timeout:.0f}s") from None
        except (ConnectionError, OSError) as exc:
            self._gone(f"QMP socket error: {exc}")
            raise QmpGone(f"{command}: {self.closed}") from None
        finally:
            self._pending.pop(ident, None)
        if "error" in answer:
            raise QmpError(command, answer["error"])
        return answer.get("return")

    def mark(self) -> int:
        """The current event position, for wait_event(since=...)."""
        return self._seq

    async def wait_event(self, name: str, since: int, match: Callable[[dict], bool] = lambda data: True,
                         timeout: float = 30.0) -> dict:
        """The first event `name` after position `since` whose data matches."""
        async def find() -> dict:
            async with self._changed:
                while True:
                    for seq, ev in self._events:
                        if seq > since and ev["event"] == name and match(ev.get("data", {})):
                            return ev
                    if self.closed:
                        raise QmpGone(f"waiting for {name}: {self.closed}")
                    await self._changed.wait()
        return await asyncio.wait_for(find(), timeout)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._gone("the client was closed")
        async with self._changed:
            self._changed.notify_all()
