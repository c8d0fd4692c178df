"""The hooks the guest's agent adds to a container's spec
(crust.guest.containers), run by a real shell: crun writes a hook's state
into its stdin after starting it, and fails the hook when the write finds
the pipe closed, so a hook must not end before it read its state."""

from __future__ import annotations

import os
import subprocess
import time

from crust.guest.containers import _STARTED_HOOK

STATE = b'{"ociVersion":"1.0.2","id":"app","status":"running","pid":153,"bundle":"/run/b"}'


def test_the_started_hook_reads_its_state_to_the_end_before_it_ends(tmp_path):
    """Started and left alone, the hook has not ended; a state written
    late (as crun's write can come when the guest is slow) goes in whole,
    and only the end of its input ends the hook, which then tells the
    agent."""
    told = tmp_path / "started"
    hook = subprocess.Popen(["/bin/sh", "-c", _STARTED_HOOK, "gate", str(told)], stdin=subprocess.PIPE,
                            env={"PATH": "/usr/bin:/bin"})
    try:
        time.sleep(0.3)
        assert hook.poll() is None, "the hook ended before its state was written"
        written = os.write(hook.stdin.fileno(), STATE)   # a closed pipe would raise BrokenPipeError
        hook.stdin.close()
        assert written == len(STATE)
        assert hook.wait(timeout=10) == 0
        assert told.read_text() == "started\n"
    finally:
        if hook.poll() is None:
            hook.kill()
            hook.wait()
