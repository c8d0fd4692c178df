"""Work done inside another process's mount namespace, from a thread.

A pod's shared directory holds binds (container roots, volumes) that only
the pod's file server (virtiofsd) needs to see. Made in the host's mount
namespace they would pin what they bind there: a host directory holding a
copy of a submount could not be removed while the pod runs (rmdir answers
EBUSY for a mount point of the caller's own namespace only; the kernel
detaches the copies other namespaces hold). So the binds are made in the
file server's own namespace, and go with it.

setns(CLONE_NEWNS) is refused to a thread that shares its file system
attributes (root, working directory) with others, which every thread of a
process does; unshare(CLONE_FS) first gives the thread its own. The thread
then enters the namespace, does the work and ends: it is never handed back
to a pool, so no other work runs with its root. The process's descriptors
stay shared, so a tree cloned by another thread in the host's namespace
(mount.clone_tree) can be attached in there (move_mount takes a detached
tree into the caller's namespace).

Inside, the namespace's root is the thread's root and /proc may not be
mounted at all (virtiofsd pivots into the directory it serves): paths are
resolved from directory descriptors and the working directory, never
through /proc/self.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import TypeVar

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_FS = 0x00000200
_CLONE_NEWNS = 0x00020000

T = TypeVar("T")


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def run_inside(ns_fd: int, work: Callable[[], T]) -> T:
    """work() on a thread of its own inside the mount namespace open at
    ns_fd (an fd of /proc/PID/ns/mnt); its result, or its exception."""
    result: dict = {}

    def body() -> None:
        try:
            _check(_libc.unshare(_CLONE_FS), "unshare(CLONE_FS)")
            _check(_libc.setns(ns_fd, _CLONE_NEWNS), "setns into the mount namespace")
            os.chdir("/")
            result["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=body, name="mountns", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def same_namespace(pid: int, other_pid: int | None = None) -> bool:
    """Whether pid is in the mount namespace of other_pid (this process by
    default)."""
    try:
        theirs = os.stat(f"/proc/{pid}/ns/mnt")
        ours = os.stat(f"/proc/{other_pid or os.getpid()}/ns/mnt")
    except OSError:
        return False
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)
