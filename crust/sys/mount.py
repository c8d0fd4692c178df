"""Mounts: read /proc/self/mountinfo, mount, bind, remount read-only, unmount.

Whether something is mounted is always answered from mountinfo (the kernel's
truth), so every operation can be retried and converges.

Paths a CO gave us are never handed to these calls as strings: the callers
(crust.common.copath) open them without following symlinks and pass the open
descriptors, and the calls below mount onto exactly those descriptors
(/proc/self/fd/N, the new mount API), so nothing can swap a path between the
check and the mount.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass

from crust.sys.run import run

MOUNTINFO = "/proc/self/mountinfo"


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    if "\\" not in field:
        return field  # the common case, and the hot path on nodes with many mounts
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


@dataclass(frozen=True)
class MountEntry:
    mount_id: int
    major: int
    minor: int
    root: str
    mount_point: str
    options: tuple[str, ...]
    fs_type: str
    source: str
    super_options: tuple[str, ...]

    @property
    def readonly(self) -> bool:
        return "ro" in self.options


def parse_mountinfo(text: str) -> list[MountEntry]:
    entries = []
    # Lines end at "\n" only: the kernel escapes "\n" in paths but not the
    # other characters str.splitlines() breaks on (\x1c-\x1e, \x85,
    # \u2028, \u2029), which a path may hold.
    for line in text.split("\n"):
        left, _, right = line.partition(" - ")
        fields = left.split(" ")
        rest = right.split(" ")
        if len(fields) < 6 or len(rest) < 3:
            continue
        major, minor = fields[2].split(":")
        entries.append(
            MountEntry(
                mount_id=int(fields[0]),
                major=int(major),
                minor=int(minor),
                root=_unescape(fields[3]),
                mount_point=_unescape(fields[4]),
                options=tuple(fields[5].split(",")),
                fs_type=rest[0],
                source=_unescape(rest[1]),
                super_options=tuple(rest[2].split(",")),
            )
        )
    return entries


def _escape(path: str) -> str:
    return path.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011").replace("\n", "\\012")


def mounts(table: str = MOUNTINFO, containing: str | None = None) -> list[MountEntry]:
    """Entries of a mount table; with `containing`, only lines that contain
    that text are parsed (a cheap filter: a node may have thousands of mounts)."""
    with open(table, errors="surrogateescape", newline="\n") as f:  # a path need not be UTF-8, nor free of \r
        text = f.read()
    if containing is not None:
        text = "\n".join(line for line in text.split("\n") if containing in line)
    return parse_mountinfo(text)


def at(path: str, table: str = MOUNTINFO) -> MountEntry | None:
    """The top-most mount at exactly this path, if any."""
    path = os.path.normpath(path)
    found = None
    for entry in mounts(table, containing=f" {_escape(path)} "):
        if entry.mount_point == path:
            found = entry  # later lines are mounted on top of earlier ones
    return found


def mount_id(fd: int) -> int:
    """The id of the mount an open descriptor lies on (mountinfo's first field)."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.ENOTSUP, "no mnt_id in fdinfo")


def by_id(mount_id_: int, table: str = MOUNTINFO) -> MountEntry | None:
    """The mount with this id, if it still exists."""
    prefix = f"{mount_id_} "
    with open(table, errors="surrogateescape", newline="\n") as f:
        for line in f:
            if line.startswith(prefix):
                entries = parse_mountinfo(line)
                return entries[0] if entries else None
    return None


def of_device(major: int, minor: int) -> list[MountEntry]:
    """Every mount (including bind mounts) of the filesystem on this device."""
    return [e for e in mounts(containing=f" {major}:{minor} ") if (e.major, e.minor) == (major, minor)]


def of_device_node(device_path: str) -> list[MountEntry]:
    """Bind mounts of a block device node itself (raw block publish).

    mountinfo shows such a bind as the devtmpfs holding the node, with the
    node's name as root (source is "devtmpfs", not the device path).
    """
    name = "/" + os.path.basename(device_path)
    return [e for e in mounts() if e.source == device_path or e.mount_point == device_path
            or (e.fs_type == "devtmpfs" and e.root == name)]


# -- mounts onto open descriptors ------------------------------------------------------------
#
# The new mount API (Linux 5.12+ for mount_setattr) makes a read-only bind in
# one step onto a descriptor: clone the source tree detached, make it
# read-only, move it onto the target. The classic bind-then-remount needs the
# target's path twice, and a path can change between the two calls.

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442
_OPEN_TREE_CLONE = 1
_AT_EMPTY_PATH = 0x1000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOVE_MOUNT_T_EMPTY_PATH = 0x40
_MOUNT_ATTR_RDONLY = 0x1
_UMOUNT_NOFOLLOW = 0x8


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def fd_path(fd: int) -> str:
    """The path through which the kernel reaches an open descriptor."""
    return f"/proc/self/fd/{fd}"


def bind_fd(source_fd: int, target_fd: int, *, readonly: bool = False) -> None:
    """Bind the tree at source_fd onto target_fd (both O_PATH descriptors),
    read-only from the first instant when asked."""
    tree = _check(_libc.syscall(_SYS_OPEN_TREE, source_fd, b"", _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_EMPTY_PATH),
                  "open_tree")
    try:
        if readonly:
            attr = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0)
            _check(_libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH, ctypes.byref(attr),
                                 ctypes.sizeof(attr)), "mount_setattr")
        _check(_libc.syscall(_SYS_MOVE_MOUNT, tree, b"", target_fd, b"",
                             _MOVE_MOUNT_F_EMPTY_PATH | _MOVE_MOUNT_T_EMPTY_PATH), "move_mount")
    finally:
        os.close(tree)  # a tree never moved is dissolved here


async def mount_fd(source: str, target_fd: int, fs_type: str, options: list[str] | None = None) -> None:
    """Mount a file system (device or pseudo source) onto an open descriptor.

    mount(8) does the option parsing; --no-canonicalize keeps it from turning
    /proc/self/fd/N back into a path string."""
    argv = ["mount", "--no-canonicalize", "-t", fs_type]
    if options:
        argv += ["-o", ",".join(options)]
    await run(argv + ["--", source, fd_path(target_fd)], pass_fds=(target_fd,))


def unmount_beneath(parent_fd: int, name: str) -> bool:
    """Unmount the top mount at `name` in the directory open at parent_fd;
    False when nothing is mounted there. The parent is pinned by its
    descriptor and a symlink at `name` is never followed, so the unmount
    happens exactly where the caller looked. EBUSY raises OSError."""
    path = f"{fd_path(parent_fd)}/{name}".encode()
    if _libc.umount2(path, _UMOUNT_NOFOLLOW) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOENT):
        return False  # not a mount point (or nothing there)
    raise OSError(err, f"umount {name}: {os.strerror(err)}")
