"""The guest's OCI runtime (crun) as the agent drives it: a container's
state, and an exec of a process into a running container.

An exec runs `crun exec --process FILE --pid-file FILE CONTAINER` as the
agent's child, in the foreground: crun passes its standard streams to the
process (the agent's pipes) and exits with the process's status, so the
agent learns the exit from its own child; the process's pid, for signals,
is the pid file crun writes once it started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from crust.common import ttrpc
from crust.guest.errors import AgentError

log = logging.getLogger("crust.guest")

ENTER_PROGRAM = "/usr/lib/crust/enter"
# The personality every guest spec names unless the host's names another:
# crun applies it before the process's exec, which gives the process the
# address randomization crun itself was started without.
DEFAULT_PERSONALITY = {"domain": "LINUX"}

GUEST_RUNTIME = "/sbin/crun"
GUEST_RUNTIME_ROOT = "/run/crust/crun"
GUEST_EXEC_DIR = "/run/crust/agent/exec"
# How long an exec's process may take to start (crun's own start included,
# slow under emulation).
PID_FILE_WAIT = 30.0
# How often the pid file is looked for: often in its first second, when
# crun writes it under emulation, then less often.
PID_LOOK_FIRST, PID_LOOK_FIRST_FOR, PID_LOOK_LATER = 0.005, 1.0, 0.05
UNIX_PATH_MAX = 107   # sun_path's 108 bytes, the last one the terminating NUL
_CONSOLES = itertools.count(1)


@dataclass(frozen=True)
class OciRuntime:
    binary: str = GUEST_RUNTIME
    root: str = GUEST_RUNTIME_ROOT
    exec_dir: str = GUEST_EXEC_DIR
    # The program an exec enters the container with, crun's exec apart
    # (crust.guest.enter).
    enter_program: str = ENTER_PROGRAM

    @property
    def present(self) -> bool:
        return os.access(self.binary, os.X_OK)

    def command(self, *args: str) -> list[str]:
        return [self.binary, "--root", self.root, *args]

    def runs(self, container_id: str) -> bool:
        """Whether the container's process runs, read from crun's own state
        (its status file: the pid and that process's start time; a
        container still only created keeps its exec.fifo), without a crun
        of its own: under emulation each costs tens of milliseconds. False
        also when the files say nothing certain (status() tells then)."""
        directory = Path(self.root) / container_id
        try:
            state = json.loads((directory / "status").read_bytes())
            pid, started = int(state["pid"]), int(state["process-start-time"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return start_time(pid) == started and not (directory / "exec.fifo").exists()

    async def status(self, container_id: str) -> str | None:
        """crun's status of the container ("running", "stopped", ...), None
        for a container crun does not know."""
        proc = await asyncio.create_subprocess_exec(
            *self.command("state", container_id), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await proc.communicate()
        if proc.returncode != 0:
            log.info("crun state %s: exit %s: %s", container_id, proc.returncode,
                     err.decode(errors="replace").strip()[-500:])
            return None
        try:
            return json.loads(out).get("status")
        except ValueError:
            return None

    def exec_files(self, container_id: str, exec_id: str) -> tuple[Path, Path]:
        """The process file and the pid file of an exec (made private)."""
        directory = Path(self.exec_dir) / container_id
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return directory / f"{exec_id}.json", directory / f"{exec_id}.pid"

    def console_socket(self) -> Path:
        """A fresh path for a console socket, short whatever the ids: a
        unix socket's path holds at most 107 bytes, an exec's directory
        and two 64-character ids do not fit."""
        directory = Path(self.exec_dir) / ".tty"   # no container id starts with "."
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = directory / str(next(_CONSOLES))
        if len(os.fsencode(path)) > UNIX_PATH_MAX:
            raise OSError(errno.ENAMETOOLONG, f"the console socket's path {path} is longer than a unix socket takes")
        return path

    def write_process(self, path: Path, process: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(process)

    def forget(self, container_id: str, exec_id: str) -> None:
        for path in self.exec_files(container_id, exec_id):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def start_time(pid: int) -> int | None:
    """A process's start time (field 22 of /proc/PID/stat, the 20th after
    its name), what tells it from a later process of the same pid; None
    when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


async def wait_pid_file(path: Path, runtime_exited: asyncio.Future, timeout: float = PID_FILE_WAIT) -> int:
    """The pid crun wrote, once it did; 0 when crun exited first (the
    process never started)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + timeout
    while True:
        try:
            text = path.read_text().strip()
            if text:
                return int(text)
        except (FileNotFoundError, ValueError):
            pass
        if runtime_exited.done():
            return 0
        if loop.time() > deadline:
            raise AgentError(ttrpc.DEADLINE_EXCEEDED, f"exec_id: the process did not start within {timeout:g} s")
        # Looks close together while crun usually writes it (a look costs
        # the guest's one CPU a fraction of a millisecond), then further apart.
        await asyncio.wait([runtime_exited], timeout=PID_LOOK_FIRST if loop.time() - started < PID_LOOK_FIRST_FOR
                           else PID_LOOK_LATER)
