"""How many descriptors a daemon may hold: RLIMIT_NOFILE's soft limit raised
to its hard limit at start.

A daemon serving connections holds one descriptor per connection, two when
its socket is gated (crust.common.peergate relays each connection to the
gRPC server behind it). The soft limit a process inherits is often 1024 (a
shell's, systemd's default for services), kept low for programs that still
use select(), which cannot watch a descriptor above 1023; the hard limit is
what an operator allows (systemd's default is 524288). crust's daemons wait
with epoll (asyncio, gRPC), so they take what the hard limit allows, and
their children (QEMU, mount, nsenter) inherit it.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_soft_limit() -> tuple[int, int]:
    """Set the soft RLIMIT_NOFILE to the hard one, and log both; (before,
    after). Where that is refused, the limit stays as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit is not a value setrlimit takes for NOFILE
    # (the kernel's nr_open caps it): the most the kernel allows instead.
    target = hard if hard != resource.RLIM_INFINITY else _nr_open()
    after = soft
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            after = target
        except (ValueError, OSError) as exc:
            log.warning("the open files limit stays", extra={"fields": {"soft": soft, "error": str(exc)}})
    log.info("open files limit", extra={"fields": {"soft_was": soft, "soft": after}})
    return soft, after


def soft_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20
