"""A frozen volume of a light sandbox is held by a process of its own.

The handler runs on the same kernel as its sandboxes, so a freeze it held
itself would last past its death (SIGKILL, OOM): nobody would thaw. The
holder (`python -m crust.runtime_handler.freeze_holder FD KEY`) gets a
read-only descriptor of the mount (opened by the handler through the
sandbox's mount namespace or the container's root), freezes it, and keeps
the freezes in a crust.common.freezes.FreezeBook, so they nest and each is
bounded by its timeout. It talks with the handler over its stdin and
stdout, a line each way:
  -> freeze <seconds>        <- ok <depth> 1
  -> thaw                    <- ok <depth> <1: it was frozen, 0: not>
                             <- error <message>
Its stdin closing (the handler died) thaws at once. It exits once the file
system is thawed, whatever thawed it; its log lines go to the handler's
standard error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

from crust.common import logs
from crust.common.freezes import FreezeBook
from crust.sys import freeze as sysfreeze

log = logging.getLogger(__name__)


async def hold(fd: int, key: str, reader: asyncio.StreamReader, write: Callable[[str], None]) -> None:
    done = asyncio.Event()
    book = FreezeBook(log, on_thawed=lambda _key, _reason: done.set())
    opened = [fd]

    def take() -> int:
        if not opened:
            raise sysfreeze.FreezeError("the descriptor of the mount was already used")
        return opened.pop()

    async def serve() -> None:
        while True:
            line = (await reader.readline()).decode(errors="replace").split()
            if not line:
                await book.thaw_all(key, "the handler went away")
                return
            try:
                if line[0] == "freeze" and len(line) == 2:
                    depth = await book.freeze(key, float(line[1]), take)
                    write(f"ok {depth} 1\n")
                elif line == ["thaw"]:
                    depth, was = await book.thaw(key)
                    write(f"ok {depth} {int(was)}\n")
                else:
                    write("error unknown command\n")
            except (sysfreeze.FreezeError, OSError, ValueError) as exc:
                write(f"error {exc}\n")
            if book.depth(key) == 0:
                return

    server = asyncio.ensure_future(serve())
    ended = asyncio.ensure_future(done.wait())
    await asyncio.wait({server, ended}, return_when=asyncio.FIRST_COMPLETED)
    server.cancel()
    ended.cancel()
    await book.close("the holder ends")
    if opened:
        os.close(opened.pop())


def main() -> None:
    logs.setup()
    fd, key = int(sys.argv[1]), sys.argv[2]
    logs.bind(volume=key)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

        def write(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()
        await hold(fd, key, reader, write)

    asyncio.run(run())


@dataclass
class _Holder:
    proc: asyncio.subprocess.Process

    async def ask(self, line: str) -> tuple[int, bool] | None:
        """The holder's answer; None when it is gone (it thawed and ended)."""
        if self.proc.returncode is not None:
            return None
        try:
            self.proc.stdin.write(line.encode())
            await self.proc.stdin.drain()
            answer = (await self.proc.stdout.readline()).decode().strip()
        except (BrokenPipeError, ConnectionResetError):
            return None
        if not answer:
            return None
        if answer.startswith("error "):
            raise sysfreeze.FreezeError(answer[len("error "):])
        _, depth, was = answer.split()
        return int(depth), was == "1"


class Freezer:
    """The handler's side: one holder per frozen volume."""

    def __init__(self) -> None:
        self.holders: dict[str, _Holder] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def freeze(self, key: str, timeout: int, open_fd: Callable[[], int]) -> int:
        """One more freeze; the depth now. sysfreeze.FreezeError: refused."""
        async with self._lock(key):
            holder = self.holders.get(key)
            for _ in range(2):
                if holder is None or holder.proc.returncode is not None:
                    holder = self.holders[key] = await self._start(key, open_fd)
                answer = await holder.ask(f"freeze {timeout}\n")
                if answer is not None:
                    return answer[0]
                await holder.proc.wait()   # it thawed by its timeout meanwhile: a new one
                holder = None
            raise sysfreeze.FreezeError("the freeze holder ended at once")

    async def thaw(self, key: str) -> tuple[int, bool]:
        async with self._lock(key):
            holder = self.holders.get(key)
            answer = await holder.ask("thaw\n") if holder is not None else None
            if answer is None or answer[0] == 0:
                if holder is not None:
                    await self._end(key, holder)
            return answer if answer is not None else (0, False)

    async def release(self, key: str) -> None:
        """Thaw whatever is frozen (the volume goes away)."""
        async with self._lock(key):
            holder = self.holders.get(key)
            if holder is not None:
                await self._end(key, holder)

    async def close(self) -> None:
        for key in list(self.holders):
            await self.release(key)

    async def _start(self, key: str, open_fd: Callable[[], int]) -> _Holder:
        fd = open_fd()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "crust.runtime_handler.freeze_holder", str(fd), key,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,), start_new_session=True)
        finally:
            os.close(fd)
        return _Holder(proc)

    async def _end(self, key: str, holder: _Holder) -> None:
        if self.holders.get(key) is holder:
            del self.holders[key]
        if holder.proc.stdin is not None and not holder.proc.stdin.is_closing():
            holder.proc.stdin.close()
        try:
            await asyncio.wait_for(holder.proc.wait(), 10)
        except asyncio.TimeoutError:
            holder.proc.kill()
            await holder.proc.wait()


if __name__ == "__main__":
    main()
