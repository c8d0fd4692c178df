"""A stop always ends, whatever the guest does.

runc kills a container that does not stop; a VM runtime can always end
its VMM. The host asks the guest's agent to signal, remove and power off,
and gives each of those answers a deadline: a stop's calls to the agent
are made inside `bounded()`, whose deadline every call honours
(crust.kata.agent.client.stop_deadline), and a call of a stop left
unanswered kills the VM's QEMU (crust.kata.vmm.qemu.Vm.kill_unresponsive): its
pod's processes are then reported exited with VM_KILLED_EXIT_CODE (137, as
runc reports a SIGKILL) and the reason, and the pod's resources are released
as after any stop.

The bounds (docs/microvm.md states them):

- a signal (CRI's StopContainer, an exec's kill) is answered within
  SIGNAL_ANSWER, and a process sent SIGKILL is reported exited within
  KILLED_EXIT of the answer; else the VM is killed;
- a container's delete kills its processes within POD_STOP (the signal
  answered, every exit reported), and a pod's stop (DeletePod: the
  containers' processes killed and removed, the volumes unmounted, the
  power-off) makes all its calls to the guest within POD_STOP; a power-off
  answered is
  followed by QEMU's exit within POWER_OFF_EXIT (crust.kata.vmm.qemu), and a
  QEMU killed is reaped within QEMU_KILL.

So StopContainer ends within its grace period plus SIGNAL_ANSWER +
KILLED_EXIT + QEMU_KILL, and StopPodSandbox within STOP_POD_BOUND.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Awaitable, Callable, Iterator

from crust.common.aio import cancel_all
from crust.kata.agent.client import stop_deadline

log = logging.getLogger(__name__)

SIGNAL_ANSWER = 10.0      # seconds the agent has to answer a signal
KILLED_EXIT = 10.0        # seconds after a SIGKILL's answer for the process's exit
POD_STOP = 60.0           # seconds for all the guest's answers of a pod's stop
POWER_OFF_PORT_WAIT = 5.0  # seconds a power-off waits for an agent's port to open again
POWER_OFF_EXIT = 10.0     # seconds from a power-off's answer to QEMU's exit
QEMU_QUIT = 5.0           # seconds QMP quit is waited for, and again QEMU's exit after it
QEMU_KILL = 10.0          # seconds for a SIGKILLed QEMU to be reaped
# The longest a pod's stop takes when its guest answers nothing in time.
STOP_POD_BOUND = POD_STOP + POWER_OFF_PORT_WAIT + POWER_OFF_EXIT + 2 * QEMU_QUIT + QEMU_KILL
# A process of a VM the host killed (its agent silent): SIGKILL's status.
VM_KILLED_EXIT_CODE = 137


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[float]:
    """Every call to a guest's agent in this context (this task and the
    tasks it starts) ends within seconds from now, or by an enclosing
    stop's deadline if that is earlier; a call left unanswered kills the VM.
    Yields the deadline (time.monotonic)."""
    now = time.monotonic()
    outer = stop_deadline.get()
    deadline = now + seconds if outer is None else min(outer, now + seconds)
    token = stop_deadline.set(deadline)
    try:
        yield deadline
    finally:
        stop_deadline.reset(token)


def in_stop() -> bool:
    return stop_deadline.get() is not None


def remaining(wait: float) -> float:
    """wait, or what is left of the stop being served if that is less."""
    deadline = stop_deadline.get()
    return wait if deadline is None else max(0.0, min(wait, deadline - time.monotonic()))


class KillDeadlines:
    """One watch per process sent SIGKILL: exited within KILLED_EXIT of the
    agent's answer, or on_missing() (which kills the VM)."""

    def __init__(self, bound: float = KILLED_EXIT, look: float = 0.2):
        self.bound = bound
        self.look = look
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}

    def expect(self, key: tuple[str, str], exited: Callable[[], Awaitable[bool]],
               on_missing: Callable[[], Awaitable[None]]) -> None:
        if key in self._tasks and not self._tasks[key].done():
            return

        async def run() -> None:
            deadline = time.monotonic() + self.bound
            try:
                while time.monotonic() < deadline:
                    if await exited():
                        return
                    await asyncio.sleep(self.look)
                if not await exited():
                    await on_missing()
            except Exception:  # a watch must not die silently
                log.exception("the watch of a killed process failed", extra={"fields": {
                    "container": key[0], "exec": key[1]}})
            finally:
                if self._tasks.get(key) is task:
                    del self._tasks[key]

        task = asyncio.ensure_future(run())
        self._tasks[key] = task

    def pending(self) -> int:
        return sum(1 for t in self._tasks.values() if not t.done())

    async def close(self) -> None:
        await cancel_all(self._tasks.values())
        self._tasks.clear()
