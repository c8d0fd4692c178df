"""The microVM handler's pool of VMs booted ahead (--vm-pool) as the
handler's log tells it, for the tests that want a pooled VM before their
pods: each boot ends with "pooled VM ready" or with the pool's error (it
tries again later, from nothing)."""

from __future__ import annotations

import os

from crust.kata.supply.pool import NICE_BOOT_TIMEOUT
from tests.harness.daemons import wait_until
from tests.harness.handler_log import entries

READY = "pooled VM ready"
FAILED = "a pooled VM did not boot; trying again later"
# Past the bound a pooled VM's boot has of its own (NICE_BOOT_TIMEOUT: at
# nice 10 beside busy VMs it gets what they leave, and takes minutes) and
# its warm-up's: only a pool that hangs reaches it.
POOL_BOUND = 2 * NICE_BOOT_TIMEOUT


def wait_for_pool(handler, predicate, what: str):
    """Until predicate() holds, as long as the pool's boots take; a boot
    the pool gave up on meanwhile fails the caller at once with the pool's
    error, and a timeout says what the handler logged of its pool, and the
    load."""
    failures = len(entries(handler, FAILED))

    def held():
        failed = entries(handler, FAILED)[failures:]
        if failed:
            raise AssertionError(f"the pool's VM did not boot: {failed[0].get('error')}")
        return predicate()

    try:
        return wait_until(held, timeout=POOL_BOUND, interval=0.2, what=what)
    except AssertionError as exc:
        lines = [line for line in handler.log_path.read_text(errors="replace").splitlines() if "pool" in line]
        raise AssertionError(f"{exc} (load {os.getloadavg()}); the handler's pool lines:\n"
                             + "\n".join(lines[-20:])) from None
