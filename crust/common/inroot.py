"""Mount points made inside a container's root file system, as runc makes them.

An image is the user's: its directories may hold links anywhere (`/data ->
/run/crust`), dangling ones included. A mount's destination is resolved as
if the root were `/`: a link is followed from the root (an absolute one)
or from where it lies (a relative one), `..` stops at the root, and what is
missing is made there (directories, the last one a file when the mount's
source is one). Nothing is ever reached outside the root: each step is a
directory descriptor opened relative to the one before, never a path
string through the host's own tree.

crun makes mount points too, but not through a dangling link (the image's
`/data -> /run/crust` without a `/run/crust`); made here first, crun finds
them and mounts on them.
"""

from __future__ import annotations

import errno
import os
import stat

MAX_LINKS = 40   # the kernel's own limit of links followed in one lookup
DIRECTORY_MODE = 0o755
FILE_MODE = 0o644


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def make_mount_point(root: str, destination: str, kind: str) -> None:
    """Make destination inside root (a directory on the host) for a mount
    whose source is a directory (kind "dir"), a file ("file") or not known
    here ("parents": only the directories above it). OSError when a part
    of the way is no directory, or too many links are on it."""
    if kind not in ("dir", "file", "parents"):
        raise ValueError(f"kind {kind!r}: dir, file or parents")
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    held: list[int] = []   # the directories walked down (for ".."), the current one last
    try:
        held.append(os.dup(root_fd))
        todo = _parts(destination)
        if not todo:
            return   # the root itself
        links = 0
        while todo:
            part = todo.pop(0)
            if part == "..":
                if len(held) > 1:
                    os.close(held.pop())
                continue
            here = held[-1]
            last = not todo
            try:
                st = os.stat(part, dir_fd=here, follow_symlinks=False)
            except FileNotFoundError:
                if last and kind == "parents":
                    return
                if last and kind == "file":
                    os.close(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                     FILE_MODE, dir_fd=here))
                    return
                try:
                    os.mkdir(part, DIRECTORY_MODE, dir_fd=here)
                except FileExistsError:
                    pass   # made meanwhile: looked at again below
                st = os.stat(part, dir_fd=here, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, f"{destination}: more than {MAX_LINKS} links on the way")
                target = os.readlink(part, dir_fd=here)
                if target.startswith("/"):
                    while len(held) > 1:
                        os.close(held.pop())
                todo = _parts(target) + todo
                continue
            if last:
                return   # there already (crun refuses a source of another kind)
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(errno.ENOTDIR, f"{destination}: {part} is no directory in the container's root")
            held.append(os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here))
    finally:
        for fd in held:
            os.close(fd)
        os.close(root_fd)
