"""A source bound at a path of the guest itself (BindGuestPath), for a
process the agent runs outside any container (a sandbox's own process):
the source named as CreateContainer names one (a volume the agent
mounted, a share, the pod's tmpfs, a mirror), its subPath opened below it
by descriptors, and what was opened bound, never a path string joined.
"""

from __future__ import annotations

import os
import stat

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.guest.errors import AgentError
from crust.guest.places import RUN_DIR, Places
from crust.guest.volumes import check_guest_path
from crust.sys import beneath
from crust.sys import mount as sysmount

# Where a bind for a guest process never goes: the agent's own places and
# the kernel's interfaces.
RESERVED = ("/proc", "/sys", "/dev", RUN_DIR)


def _same(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def bind(places: Places, request: agent_pb2.BindGuestPathRequest) -> None:
    target = check_guest_path("target", request.target, RESERVED)
    root = places.source_root("source", request.source)
    try:
        if request.source.subpath:
            fd = beneath.open_subpath(str(root), request.source.subpath, request.source.strict)
        else:
            fd = os.open(root, os.O_PATH | os.O_CLOEXEC)
    except beneath.SubpathError as exc:
        code = ttrpc.INVALID_ARGUMENT if exc.leaves or not request.source.strict else ttrpc.FAILED_PRECONDITION
        raise AgentError(code, f"source.subpath: {exc.message}") from None
    except OSError as exc:
        raise AgentError(ttrpc.FAILED_PRECONDITION, f"source: {root}: {exc.strerror}") from None
    try:
        entry = sysmount.at(target)
        if entry is not None:
            if _same(fd, target):
                return   # bound already: a retry
            raise AgentError(ttrpc.ALREADY_EXISTS, f"target: {target} is already a mount of {entry.source}")
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.makedirs(target, exist_ok=True)
            elif not os.path.exists(target):
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
            place = os.open(target, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                sysmount.bind_fd(fd, place, readonly=request.readonly)
            finally:
                os.close(place)
        except OSError as exc:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"target: {target}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def unbind(target: str) -> None:
    """Every mount stacked at target, the last first (a busy one detached);
    nothing there is OK."""
    check_guest_path("target", target, RESERVED)
    try:
        sysmount.unmount_all(target)
    except OSError as exc:
        raise AgentError(ttrpc.FAILED_PRECONDITION, f"target: {target}: {exc.strerror or exc}") from None
