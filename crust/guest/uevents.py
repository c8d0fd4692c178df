"""The kernel's device events (uevents), for waiting on a hot-plugged disk
shared directory or NIC without looking at /sys again and again.

One netlink socket (NETLINK_KOBJECT_UEVENT, the kernel's group 1) is
opened when the agent starts, so no event between a look and the wait
after it is missed: a waiter notes the count of events, looks, and
waits only if no event came since. A full socket (ENOBUFS: events were
dropped) counts as an event, so a waiter looks again instead of missing
one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

NETLINK_KOBJECT_UEVENT = 15
KERNEL_GROUP = 1
RECEIVE_BUFFER = 1 << 20
WATCHED = {"block", "virtio", "net"}

Found = TypeVar("Found")


def parse(message: bytes) -> dict[str, str]:
    """A kernel uevent: "ACTION@DEVPATH" then KEY=VALUE fields, each ended
    by a NUL. The first line's parts are in ACTION and DEVPATH too."""
    fields: dict[str, str] = {}
    for part in message.split(b"\0"):
        key, equals, value = part.partition(b"=")
        if equals:
            fields[key.decode(errors="replace")] = value.decode(errors="replace")
    return fields


class DeviceEvents:
    """Counts the kernel's block, net and virtio bus events (a virtio
    device's bind: its driver's probe ended, a virtio-fs tag is registered)
    and wakes those waiting on them."""

    def __init__(self):
        self.count = 0
        self._sock: socket.socket | None = None
        self._waiters: list[asyncio.Future] = []

    def open(self) -> None:
        if self._sock is not None:
            return
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                             NETLINK_KOBJECT_UEVENT)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
            sock.bind((0, KERNEL_GROUP))
        except OSError:
            sock.close()
            raise
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for waiter in self._waiters:
            if not waiter.done():
                waiter.cancel()

    def _readable(self) -> None:
        changed = False
        while True:
            try:
                message = self._sock.recv(65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    log.warning("reading the kernel's device events failed: %s", exc)
                    break
                changed = True   # events were dropped: any of them may be the awaited one
                continue
            if parse(message).get("SUBSYSTEM") in WATCHED:
                changed = True
        if changed:
            self.count += 1
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def wait_until(self, look: Callable[[], Found | None], timeout: float) -> Found | None:
        """look()'s first answer that is not None, looked at now and after
        each watched event; None when timeout passed without one."""
        if self._sock is None:
            self.open()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            seen = self.count
            found = look()
            if found is not None:
                return found
            if seen != self.count:
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait([waiter], timeout=remaining)
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
