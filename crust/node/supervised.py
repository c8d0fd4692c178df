"""What a child of `crust node` does first: die with its supervisor.

The supervisor passes its pid in the environment. The child asks the kernel
for SIGTERM when its parent dies (PR_SET_PDEATHSIG), then checks that the
parent is still the supervisor: had it died before the request, nothing
would ever deliver the signal, so the child stops at once instead.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
# Set in a child's environment to the supervisor's pid.
SUPERVISOR_ENV = "CRUST_SUPERVISOR_PID"


def die_with_supervisor() -> None:
    expected = os.environ.pop(SUPERVISOR_ENV, "")
    if not expected.isdigit():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # not fatal: the supervisor still stops its children on SIGTERM
    if os.getppid() != int(expected):
        os.kill(os.getpid(), signal.SIGTERM)
