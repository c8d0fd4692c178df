"""A pod's fsGroup applied to a volume's files, the way kubelet applies it.

Kubelet (pkg/volume, SetVolumeOwnership) gives every file and directory of
the volume the pod's group: group ownership changed without touching the
owner, read and write added for owner and group (read only, for a
read-only volume), and on directories the execute bits and set-group-ID,
so files made later inherit the group. Symlinks get the group themselves
and are never followed. The OnRootMismatch policy skips the walk when the
root already has the group and those bits.

Crust applies it where kubelet no longer can: on the host for a volume the
shim mounts (kubelet delegated fsGroup through volume_mount_group) and
inside a sandbox for a deferred volume. The walk runs on descriptors: a
file swapped for a symlink while it runs is never followed out of the
volume (a path-based chmod would follow it to any file of the host).
"""

from __future__ import annotations

import os
import stat

RW = 0o660
RO = 0o440
EXEC = 0o110
ALWAYS = "Always"
ON_ROOT_MISMATCH = "OnRootMismatch"


def _wanted(mode: int, readonly: bool) -> int:
    bits = RO if readonly else RW
    if stat.S_ISDIR(mode):
        bits |= EXEC | stat.S_ISGID
    return bits


def root_matches(st: os.stat_result, gid: int, readonly: bool = False) -> bool:
    """OnRootMismatch: is the root already as the walk would leave it?"""
    wanted = _wanted(st.st_mode, readonly)
    return st.st_gid == gid and (stat.S_IMODE(st.st_mode) & wanted) == wanted


def _fix(fd: int, st: os.stat_result, gid: int, readonly: bool) -> None:
    """Group and mode of what the O_PATH descriptor fd holds (not a symlink)."""
    proc = f"/proc/self/fd/{fd}"
    if st.st_gid != gid:
        os.chown(proc, -1, gid)
    mode = stat.S_IMODE(st.st_mode)
    wanted = mode | _wanted(st.st_mode, readonly)
    if wanted != mode:
        os.chmod(proc, wanted)


def apply_fs_group(root_fd: int, gid: int, policy: str = ALWAYS, readonly: bool = False) -> bool:
    """Give the tree under the directory root_fd (any descriptor, O_PATH
    will do) the group gid. Returns whether it walked (False: OnRootMismatch
    found the root already right)."""
    root = os.fstat(root_fd)
    if policy == ON_ROOT_MISMATCH and root_matches(root, gid, readonly):
        return False
    _fix(root_fd, root, gid, readonly)
    for _, dirnames, filenames, dir_fd in os.fwalk(".", dir_fd=root_fd, follow_symlinks=False):
        for name in dirnames + filenames:
            try:
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except FileNotFoundError:
                continue  # removed by the workload meanwhile
            try:
                st = os.fstat(fd)
                if stat.S_ISLNK(st.st_mode):
                    os.chown(name, -1, gid, dir_fd=dir_fd, follow_symlinks=False)
                else:
                    _fix(fd, st, gid, readonly)
            finally:
                os.close(fd)
    return True
