"""A relative path opened below a directory without ever leaving it
(openat2 RESOLVE_BENEATH), for a Kubernetes subPath.

A container of a pod can rewrite a volume it shares with another (an
emptyDir) while the other's subPath is resolved in it: a name checked as a
directory may be a symlink to / a moment later. So a subPath is never
resolved as a string: it is opened below a descriptor of the volume's root
(a link or ".." that would leave the root fails with EXDEV, a /proc/.../fd
magic link is never followed), a missing directory is made by mkdirat on a
descriptor of its parent (kubelet makes a missing subPath with the mode of
the volume's root), and the caller binds the descriptor it got, so what is
bound is exactly what was opened.

strict (a deferred volume's subpath, as crust's handlers take one): the
path must exist and pass no symlink at all; nothing is made.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class SubpathError(Exception):
    """A subpath that cannot be opened below its root; leaves: it leads (or
    tries to lead) out of the root, which a caller refuses as bad input."""

    def __init__(self, message: str, leaves: bool = False):
        super().__init__(message)
        self.message = message
        self.leaves = leaves


def open_beneath(root_fd: int, path: str, flags: int = 0, resolve: int = 0) -> int:
    """openat2(root_fd, path) as O_PATH, never leaving root_fd's directory."""
    how = _OpenHow(flags | os.O_PATH | os.O_CLOEXEC, 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | resolve)
    fd = _libc.syscall(_SYS_OPENAT2, root_fd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def check_subpath(subpath: str) -> list[str]:
    """The subpath's components; SubpathError for an absolute one or one
    with a ".." component (kubelet refuses both)."""
    if subpath.startswith("/"):
        raise SubpathError(f"subpath {subpath}: must be a relative path")
    if "\0" in subpath:
        raise SubpathError(f"subpath {subpath!r}: holds a NUL byte")
    parts = [p for p in subpath.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise SubpathError(f"subpath {subpath}: must not contain '..'", leaves=True)
    return parts


def _why(err: int, strict: bool) -> str:
    if err == errno.EXDEV:
        return "resolves outside its volume"
    if err == errno.ELOOP:
        return "goes through a symlink inside the volume" if strict else "has too many symlinks"
    if err == errno.ENOENT:
        return "does not exist in the volume"
    return f"cannot be opened in its volume: {os.strerror(err)}"


def open_subpath(root: str, subpath: str, strict: bool) -> int:
    """An O_PATH descriptor of subpath below the directory root (opened
    without following a link at root itself), each component opened from
    the root again (a link in the volume may point anywhere inside it, as
    kubelet allows, never out); unless strict, a missing directory made.
    The descriptor is a directory or a regular file; SubpathError else."""
    parts = check_subpath(subpath)
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    resolve = RESOLVE_NO_SYMLINKS if strict else 0
    try:
        mode = stat.S_IMODE(os.fstat(root_fd).st_mode)
        fd = os.dup(root_fd)
        done = "."
        for part in parts:
            done = f"{done}/{part}"
            following = -1
            try:
                try:
                    following = open_beneath(root_fd, done, resolve=resolve)
                except FileNotFoundError:
                    if strict:
                        raise
                    # Made in the directory held, never through a path again.
                    if not stat.S_ISDIR(os.fstat(fd).st_mode):
                        raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)) from None
                    made = True
                    try:
                        os.mkdir(part, mode, dir_fd=fd)   # mkdirat accepts an O_PATH directory
                    except FileExistsError:
                        made = False
                    following = open_beneath(root_fd, done, os.O_DIRECTORY, resolve)
                    if made:
                        # The volume root's mode whatever the umask (the
                        # agent's threads share one).
                        os.chmod(f"/proc/self/fd/{following}", mode)
            except OSError as exc:
                os.close(fd)
                if following >= 0:
                    os.close(following)
                raise SubpathError(f"subpath {subpath}: {_why(exc.errno or 0, strict)}",
                                   leaves=exc.errno in (errno.EXDEV, errno.ELOOP)) from None
            os.close(fd)
            fd = following
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind not in (stat.S_IFDIR, stat.S_IFREG):
            os.close(fd)
            raise SubpathError(f"subpath {subpath}: neither a directory nor a regular file")
        return fd
    finally:
        os.close(root_fd)
