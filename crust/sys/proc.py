"""Processes named by more than their number.

A pid names a process only while that process lives: once it is reaped the
kernel hands the number to the next process it starts. A pid written in a
record (a sandbox's holder, a QEMU, a claim's sandbox) is therefore kept
with the process's start time (clock ticks since boot, field 22 of
/proc/PID/stat), and the pair names one process for the whole uptime of the
machine.

Before crust signals or adopts a recorded process it opens a pidfd for the
pid (os.pidfd_open, Linux 5.3), checks the start time through /proc
*after* that, and sends the signal through the pidfd: a pidfd keeps naming
the process it was opened for, so the process checked is the process
signalled, even if the pid were reused in between. The same pidfd tells
when the process ends (it becomes readable), with no polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcessId:
    """One process: its pid and when it started (ticks since boot)."""

    pid: int
    start: int

    def __str__(self) -> str:
        return f"pid {self.pid} (started at tick {self.start})"


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first);
    None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The name is in parentheses and may itself hold ') ': split at the last.
    return text.rsplit(b")", 1)[1].decode().split()


def start_time(pid: int) -> int | None:
    """When the process with this pid started, or None when there is none."""
    if pid <= 0:
        return None
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user and system, all its threads) the process with
    this pid has used, or None when there is none."""
    fields = _stat_fields(pid) if pid > 0 else None
    try:
        return (int(fields[11]) + int(fields[12])) / _TICKS if fields else None
    except (IndexError, ValueError):
        return None


def identify(pid: int) -> ProcessId | None:
    """The process running under pid now (None if there is none). Take it
    while the process is known to be the one meant: a child not reaped yet,
    or a peer on a connected socket."""
    start = start_time(pid)
    return ProcessId(pid, start) if start is not None else None


def alive(process: ProcessId | None) -> bool:
    """Whether this very process still runs (a zombie does not)."""
    if process is None or process.pid <= 0:
        return False
    fields = _stat_fields(process.pid)
    try:
        return bool(fields) and fields[0] not in ("Z", "X") and int(fields[19]) == process.start
    except (IndexError, ValueError):
        return False


def boot_time() -> float:
    """When the machine booted (seconds since the epoch)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    return time.time() - time.monotonic()


def started_at(process: ProcessId) -> float:
    """The wall-clock time the process started."""
    return boot_time() + process.start / _TICKS


def recorded(pid: int, start: int, written_at: float) -> ProcessId | None:
    """The process a record names. With its start time: exactly that one.
    A record written before start times were kept names the process now
    under pid only if that process started before the record was written:
    the pid was the recorded process's then, and no two processes hold a
    pid at once, so one started later is a reused pid. (Boot time is known
    to the second: one second of slack.) None: nothing to trust."""
    if pid <= 0:
        return None
    if start:
        return ProcessId(pid, start)
    current = identify(pid)
    if current is None:
        return None
    return current if started_at(current) <= written_at + 1.0 else None


@contextlib.contextmanager
def _pidfd(pid: int) -> Iterator[int | None]:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


async def ended(process: ProcessId | None) -> None:
    """Return once this very process has ended: at once when it is gone
    already or its pid names another process, else when its pidfd becomes
    readable (the process need not be a child of this one)."""
    if process is None or process.pid <= 0:
        return
    with _pidfd(process.pid) as fd:
        if fd is None or not alive(process):
            return
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(fd)


def signal_process(process: ProcessId | None, sig: int = signal.SIGKILL) -> bool:
    """Send sig to this very process; False (nothing sent) when it is gone
    or its pid now names another process."""
    if process is None or process.pid <= 0:
        return False
    return signal_if(process.pid, lambda: alive(process), sig)


def signal_if(pid: int, still: Callable[[], bool], sig: int = signal.SIGKILL) -> bool:
    """Send sig to the process under pid if still() holds for it, checked
    after its pidfd is open, so the process checked is the one signalled.
    still() reads /proc/PID (start time, namespace, command line)."""
    if pid <= 0:
        return False
    with _pidfd(pid) as fd:
        if fd is None or not still():
            return False
        try:
            signal.pidfd_send_signal(fd, sig)
        except ProcessLookupError:
            return False
        return True
