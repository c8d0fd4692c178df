"""CSI endpoints: unix:///abs/path (the form kubelet and the sidecars use)."""

from __future__ import annotations

import os
import socket
import stat
import struct
from pathlib import Path

from crust.common.private import make_dirs


def socket_path(endpoint: str) -> str:
    """unix:///run/x.sock, unix:/run/x.sock or /run/x.sock -> /run/x.sock."""
    if endpoint.startswith("unix://"):
        path = endpoint[len("unix://") :]
    elif endpoint.startswith("unix:"):
        path = endpoint[len("unix:") :]
    elif endpoint.startswith("/"):
        path = endpoint
    else:
        raise ValueError(f"endpoint {endpoint!r}: only unix:///absolute/path endpoints are supported")
    if not path.startswith("/"):
        raise ValueError(f"endpoint {endpoint!r}: the socket path must be absolute")
    return os.path.normpath(path)


def grpc_target(endpoint: str) -> str:
    return "unix://" + socket_path(endpoint)


def clear_stale_socket(path: str) -> None:
    """Remove a socket file left by a dead server; refuse to steal a live one."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise RuntimeError(f"{path}: another server is listening there")


def accepts_connections(path: str | os.PathLike, timeout: float = 1.0) -> bool:
    """Does a server accept connections on the unix socket at path now?"""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(timeout)
        probe.connect(os.fspath(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def listener_pid(path: str | os.PathLike, timeout: float = 1.0) -> int | None:
    """The process listening on the unix socket at path (the one that called
    listen(), as the kernel recorded it: SO_PEERCRED), or None when nothing
    accepts there. Whoever accepts is not proof enough of who serves: a
    stale or foreign server may hold the path."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(timeout)
        probe.connect(os.fspath(path))
        pid, _uid, _gid = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                             struct.calcsize("3i")))
        return pid
    except OSError:
        return None
    finally:
        probe.close()


def prepare_socket_dir(path: str) -> None:
    """Create the socket's directory (0700) when it does not exist yet.

    An existing directory is left as its owner made it (kubelet's plugin
    directory, for one).
    """
    parent = Path(path).parent
    if not parent.exists():
        make_dirs(parent)
