"""Run a command with a deadline; keep its exit code and stderr on failure."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Absolute monotonic deadline of the RPC being served, set by the gRPC
# interceptor. A command started for an RPC never outlives the RPC.
rpc_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "rpc_deadline", default=None
)

DEFAULT_TIMEOUT = 120.0


class CommandError(Exception):
    def __init__(self, argv: list[str], returncode: int | None, stderr: str, timed_out: bool = False):
        self.argv = argv
        self.returncode = returncode
        self.stderr = stderr.strip()
        self.timed_out = timed_out
        what = "timed out" if timed_out else f"exited with {returncode}"
        super().__init__(f"{argv[0]} {what}: {self.stderr or '(no stderr)'}")


@dataclass
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


def _timeout(timeout: float | None) -> float:
    limit = timeout if timeout is not None else DEFAULT_TIMEOUT
    deadline = rpc_deadline.get()
    if deadline is not None:
        limit = min(limit, max(0.1, deadline - time.monotonic()))
    return limit


async def run(
    argv: list[str],
    *,
    check: bool = True,
    ok_codes: tuple[int, ...] = (0,),
    timeout: float | None = None,
    input: bytes | None = None,
    pass_fds: tuple[int, ...] = (),
) -> Result:
    """Run argv; raise CommandError unless its exit code is in ok_codes.
    pass_fds: descriptors the command inherits (at the same numbers)."""
    limit = _timeout(timeout)
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "LC_ALL": "C"},
        pass_fds=pass_fds,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(input), limit)
    except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
        proc.kill()
        await proc.wait()
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise CommandError(argv, None, f"no answer within {limit:.1f}s", timed_out=True) from None
    result = Result(argv, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))
    log.debug("ran %s -> %s in %.1f ms", argv, proc.returncode, (time.monotonic() - started) * 1e3)
    if check and proc.returncode not in ok_codes:
        raise CommandError(argv, proc.returncode, result.stderr or result.stdout)
    return result
