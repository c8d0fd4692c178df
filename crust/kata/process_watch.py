"""One look per interval at the processes of a pod that somebody waits on.

containerd's shim keeps, for every process of a microVM pod, a ReadOutput
stream (its stdout and stderr) and a GetProcess call that waits for its
exit. Each asked the guest on its own, every interval: two readouts and a
wait per process, and a wait per waiter, each a round of the guest agent
(a shell, under software emulation tens of milliseconds of the guest's one
CPU). A pod whose container slept kept a third of a host core busy answering
them, taken from the pod's own containers and from the pods beside it.

A ProcessWatch asks once per interval for all of them (the agent's `poll`:
every process's state and output sizes in one request) and hands each
caller the look of that round; a caller then reads output only when a size
grew. While nothing changes the interval doubles, up to `longest` (a
sleeping container costs a request a second or so); any change, and a
signal sent to one of the pod's processes (poke, which keeps it short for
a while: an exit often takes a moment after its signal), bring it back. A guest whose agent predates `poll` (a VM booted by an older handler)
is asked the old way, the same answers from readouts of no bytes and waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from crust.kata.agent import (
    AgentClient,
    AgentError,
    AgentRefused,
    GuestGone,
    ProcessLook,
)

log = logging.getLogger("crust.kata.process_watch")


class ProcessWatch:
    """The looks of one pod's guest. agent() gives its VM's agent now, or
    raises GuestGone: a look then raises what the caller would have got."""

    def __init__(self, agent: Callable[[], AgentClient], interval: float, longest: float | None = None):
        self._agent = agent
        self.shortest = interval
        self.longest = max(interval, longest if longest is not None else 4 * interval)
        self.interval = interval
        self._short_until = 0.0   # monotonic time until which the interval stays the shortest
        self._wanted: dict[str, tuple[int, int]] = {}   # name -> (spawn pid, callers asking)
        self._round = 0
        self._looks: dict[str, ProcessLook] = {}
        self._error: AgentError | None = None
        self._done = asyncio.Condition()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.legacy = False   # the guest has no `poll`

    async def look(self, name: str, pid: int, *, soon: bool = False) -> ProcessLook:
        """The process as the next round sees it: that round starts at once
        when soon (a caller's first look), else after the interval."""
        count = self._wanted.get(name, (pid, 0))[1]
        self._wanted[name] = (pid, count + 1)
        try:
            if self._task is None or self._task.done():
                self._task = asyncio.ensure_future(self._run())
            if soon:
                self._wake.set()
            async with self._done:
                while True:
                    after = self._round
                    await self._done.wait_for(lambda after=after: self._round > after)
                    if self._error is not None:
                        raise self._error
                    if name in self._looks:
                        return self._looks[name]
                    # Asked while that round was on its way: the next has it.
        finally:
            pid, count = self._wanted[name]
            if count <= 1:
                self._wanted.pop(name, None)
            else:
                self._wanted[name] = (pid, count - 1)

    def poke(self, hold: float = 3.0) -> None:
        """Something will change soon (a signal was sent): look again now,
        and every shortest interval for hold seconds."""
        self.interval = self.shortest
        self._short_until = time.monotonic() + hold
        self._wake.set()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        try:
            await self._rounds()
        finally:
            if self._wanted:   # closed: nobody is left waiting for a round that never comes
                async with self._done:
                    self._looks, self._error = {}, GuestGone("the pod's process watch was closed")
                    self._round += 1
                    self._done.notify_all()

    async def _rounds(self) -> None:
        while self._wanted:
            self._wake.clear()   # a caller's wish for a round now, from here on, brings the next one
            asked = {name: pid for name, (pid, _) in self._wanted.items()}
            looks, error = {}, None
            try:
                looks = await self._poll(list(asked.items()))
            except AgentError as exc:
                error = exc
            except Exception as exc:  # noqa: BLE001 - given to the callers, who would otherwise wait forever
                error = AgentError(f"looking at the pod's processes failed: {exc!r}")
            changed = error is not None or any(self._looks.get(name) != look for name, look in looks.items())
            if changed or time.monotonic() < self._short_until:
                self.interval = self.shortest
            else:
                self.interval = min(self.interval * 2, self.longest)
            async with self._done:
                self._looks, self._error = looks, error
                self._round += 1
                self._done.notify_all()
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
            except TimeoutError:
                pass

    async def _poll(self, processes: list[tuple[str, int]]) -> dict[str, ProcessLook]:
        agent = self._agent()
        if not self.legacy:
            try:
                return await agent.poll(processes)
            except AgentRefused as exc:
                if "unknown command" not in exc.message:
                    raise
                self.legacy = True
                log.info("the guest's agent has no poll: its processes are looked at one request at a time")
        looks = {}
        for name, pid in processes:
            sizes = []
            for stream in ("out", "err"):
                try:
                    sizes.append((await agent.readout(name, stream, 0, 0))[1])
                except AgentRefused:
                    sizes.append(None)
            try:
                code = await agent.wait(pid)
                state = "run" if code is None else str(code)
            except AgentRefused:
                state = "gone"
            looks[name] = ProcessLook(out=sizes[0], err=sizes[1], state=state)
        return looks
