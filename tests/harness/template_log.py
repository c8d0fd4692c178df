"""The microVM handler's template VM (--vm-template) as the handler's log
tells it, for the tests and benchmarks that want the template before their
pods: a making of it ends with "VM template ready" (saved now, or kept from
before) or with its error; a restore that failed discards it and a making
begins again.
"""

from __future__ import annotations

import time

from crust.kata.supply.pool import NICE_BOOT_TIMEOUT
from tests.harness.handler_log import entries

MADE = "VM template ready"
NOT_MADE = "the VM template was not made; trying again later"
DISCARDED = "VM template discarded; making it again"
# Past every bound a making has of its own (its boot's NICE_BOOT_TIMEOUT,
# its later steps' each far shorter): only a making that hangs reaches it.
MAKING_BOUND = 2 * NICE_BOOT_TIMEOUT


def template_events(handler) -> list[dict]:
    """The handler's log entries that end or restart a making of its template, oldest first."""
    return entries(handler, MADE, NOT_MADE, DISCARDED)


def wait_for_template(handler, since: int = 0, timeout: float = MAKING_BOUND) -> dict:
    """Until the handler has its template: its "VM template ready" entry,
    among the events past the first `since` (template_events) the last.
    Waits as long as the making takes (minutes at nice 10 on a busy
    machine); a making that failed fails the caller at once with its error
    and its guest's console, as does a handler that exited."""
    deadline = time.monotonic() + timeout
    while True:
        events = template_events(handler)[since:]
        if events and events[-1]["msg"] == MADE:
            return events[-1]
        if events and events[-1]["msg"] == NOT_MADE:
            raise AssertionError(f"the handler's template VM was not made: {events[-1].get('error')}\n"
                                 f"its console: {events[-1].get('console', '-')}")
        if handler.proc is not None and handler.proc.poll() is not None:
            raise AssertionError(f"the handler exited ({handler.proc.returncode}) before its template VM was "
                                 f"made: {handler.log_path.read_text(errors='replace')[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no making of the handler's template VM ended within {timeout:.0f} s")
        time.sleep(0.2)
