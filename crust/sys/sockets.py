"""The listen backlog of crust's own sockets: the system's, not a constant.

The backlog bounds the connections the kernel queues for a server that has
not accepted them yet; a unix socket's connect() beyond it fails at once
(EAGAIN) for a non-blocking client. The kernel caps any backlog at
net.core.somaxconn (4096 since Linux 5.4), so asking for that value is
asking for all an operator allows. Python's socket.SOMAXCONN is the value of
the C headers Python was built with (often 128), and asyncio listens with
100 unless told otherwise, even on a socket that already listens: each
server hands listen_backlog() to both.

And whether a unix socket is served: a killed server leaves its socket
file behind, which a new one (or a clean-up) removes only when nobody
accepts on it.
"""

from __future__ import annotations

import os
import socket

SOMAXCONN_FILE = "/proc/sys/net/core/somaxconn"


def listen_backlog() -> int:
    """net.core.somaxconn as the kernel has it now (socket.SOMAXCONN when
    it cannot be read)."""
    try:
        with open(SOMAXCONN_FILE) as f:
            value = int(f.read().strip())
    except (OSError, ValueError):
        return socket.SOMAXCONN
    return value if value > 0 else socket.SOMAXCONN


def socket_alive(path: str) -> bool:
    """Whether a server accepts on the unix socket at path."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def remove_if_dead(path: str) -> bool:
    """Remove the unix socket at path when nobody accepts on it (what a
    killed server leaves); whether it was removed."""
    if not os.path.exists(path) or socket_alive(path):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
