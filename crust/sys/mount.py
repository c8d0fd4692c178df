"""Mounts: read /proc/self/mountinfo, mount, bind, remount read-only, unmount.

Whether something is mounted is always answered from mountinfo (the kernel's
truth), so every operation can be retried and converges.

Paths a CO gave us are never handed to these calls as strings: the callers
(crust.common.copath) open them without following symlinks and pass the open
descriptors, and the calls below mount onto exactly those descriptors
(/proc/self/fd/N, the new mount API), so nothing can swap a path between the
check and the mount.

Cost: the whole table is read only where nothing cheaper answers (start-up
reconciliation, a mount that must be found wherever it went). A question
about one place is answered for that place alone: statx() gives the mount
id of an open descriptor, and statmount() (Linux 6.8) gives that mount's
entry; a node with thousands of mounts pays the same as one with ten.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass

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
    ids = _statx_mount_ids(fd)
    if ids is not None:
        return ids[0]
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.ENOTSUP, "no mnt_id in fdinfo")


def entry_of(fd: int, table: str = MOUNTINFO) -> MountEntry | None:
    """The entry of the mount an open descriptor lies on: from statmount()
    for this one mount where the kernel has it, else from the table."""
    return entry_if_not_on(fd, None, table)


def entry_if_not_on(fd: int, parent_fd: int | None, table: str = MOUNTINFO) -> MountEntry | None:
    """entry_of(fd), or None when fd lies on the same mount as parent_fd
    (nothing is mounted on fd's place): the descriptor's ids asked once."""
    ids = _statx_mount_ids(fd)
    mine = ids[0] if ids is not None else mount_id(fd)
    if parent_fd is not None and mine == mount_id(parent_fd):
        return None
    if ids is not None and ids[1] is not None and table == MOUNTINFO:
        entry = _statmount(ids[1])
        if entry is not None:
            return entry
    return by_id(mine, table)


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
    """Every mount (including bind mounts) of the filesystem on this device.
    A whole-table read: callers ask it only when a cheaper test
    (crust.sys.blockdev.claimed) says the device may be mounted."""
    return [e for e in mounts(containing=f" {major}:{minor} ") if (e.major, e.minor) == (major, minor)]


def of_devices(devices: dict[str, tuple[int, int]]) -> list[MountEntry]:
    """Every mount of the file systems on these devices and every bind of
    their device nodes (raw block publishes), in one read of the table.
    devices maps a device path to its major:minor."""
    majmins = set(devices.values())
    roots = {"/" + os.path.basename(d) for d in devices}
    return [e for e in mounts() if (e.major, e.minor) in majmins or e.source in devices
            or e.mount_point in devices or (e.fs_type == "devtmpfs" and e.root in roots)]


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
_AT_RECURSIVE = 0x8000
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


# -- one mount, asked by its id ---------------------------------------------------------------
#
# statx(STATX_MNT_ID_UNIQUE) names the mount a descriptor lies on with the
# 64-bit id that statmount() takes; statmount() returns that mount's device,
# flags, root, mount point, type and source. Both answer for one mount, so
# their cost does not depend on how many mounts the namespace holds. Kernels
# without them (before 6.8) fall back to reading the table.

_STATX_MNT_ID = 0x1000
_STATX_MNT_ID_UNIQUE = 0x4000
_STATX_SIZE = 256
_STATX_MNT_ID_OFFSET = 144
_SYS_STATMOUNT = 457
_STATMOUNT_SB_BASIC = 0x1
_STATMOUNT_MNT_BASIC = 0x2
_STATMOUNT_MNT_ROOT = 0x8
_STATMOUNT_MNT_POINT = 0x10
_STATMOUNT_FS_TYPE = 0x20
_STATMOUNT_MNT_OPTS = 0x80
_STATMOUNT_SB_SOURCE = 0x200
_STATMOUNT_WANT = (_STATMOUNT_SB_BASIC | _STATMOUNT_MNT_BASIC | _STATMOUNT_MNT_ROOT | _STATMOUNT_MNT_POINT
                   | _STATMOUNT_FS_TYPE | _STATMOUNT_MNT_OPTS | _STATMOUNT_SB_SOURCE)
_STATMOUNT_STRINGS = 512  # where the strings begin: the fixed part of struct statmount
# Per-mount attributes (MOUNT_ATTR_*) as mountinfo's fifth field shows them,
# in its order; the atime mode is a 3-bit field where 0 means relatime.
_MOUNT_ATTR_OPTIONS = ((0x2, "nosuid"), (0x4, "nodev"), (0x8, "noexec"), (0x10, "noatime"),
                       (0x80, "nodiratime"))
_MOUNT_ATTR_ATIME = 0x70
_MOUNT_ATTR_NOSYMFOLLOW = 0x200000
# Super block flags mountinfo shows before the file system's own options.
_SB_RDONLY = 0x1
_SB_OPTIONS = ((0x10, "sync"), (0x80, "dirsync"), (0x40, "mand"), (1 << 25, "lazytime"))
_statx_works: bool | None = None
_statmount_works = True
_STATMOUNT_BUFFER = _STATMOUNT_STRINGS + 3 * 4096  # three paths of PATH_MAX


def _statx_mount_ids(fd: int) -> tuple[int, int | None] | None:
    """(mountinfo id, unique id or None) of the mount fd lies on; None when
    this kernel's statx cannot tell."""
    global _statx_works
    if _statx_works is False:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if _libc.statx(fd, b"", _AT_EMPTY_PATH, _STATX_MNT_ID, buf) != 0:
        _statx_works = False
        return None
    mask = int.from_bytes(buf.raw[0:4], "little")
    if not mask & _STATX_MNT_ID:
        _statx_works = False
        return None
    old = int.from_bytes(buf.raw[_STATX_MNT_ID_OFFSET:_STATX_MNT_ID_OFFSET + 8], "little")
    unique = None
    if _statmount_works and _libc.statx(fd, b"", _AT_EMPTY_PATH, _STATX_MNT_ID_UNIQUE, buf) == 0 \
            and int.from_bytes(buf.raw[0:4], "little") & _STATX_MNT_ID_UNIQUE:
        unique = int.from_bytes(buf.raw[_STATX_MNT_ID_OFFSET:_STATX_MNT_ID_OFFSET + 8], "little")
    _statx_works = True
    return old, unique


def _statmount(unique_id: int) -> MountEntry | None:
    """The entry of one mount from statmount(); None when the kernel cannot
    give all of it (the caller then reads the table)."""
    global _statmount_works
    # struct mnt_id_req, first version: size, spare, mnt_id, param
    request = (24).to_bytes(4, "little") + bytes(4) + unique_id.to_bytes(8, "little") \
        + _STATMOUNT_WANT.to_bytes(8, "little")
    buf = ctypes.create_string_buffer(_STATMOUNT_BUFFER)  # per call: callers may be threads
    if _libc.syscall(_SYS_STATMOUNT, request, buf, len(buf), 0) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
            _statmount_works = False
        return None  # gone meanwhile (ENOENT), or strings too long (EOVERFLOW): read the table
    raw = buf.raw

    def u32(at: int) -> int:
        return int.from_bytes(raw[at:at + 4], "little")

    def u64(at: int) -> int:
        return int.from_bytes(raw[at:at + 8], "little")

    got = u64(8)
    # The options' bit stays clear when a file system has none to show.
    if got | _STATMOUNT_MNT_OPTS != _STATMOUNT_WANT:
        _statmount_works = False  # an older kernel, without the source string
        return None

    def string(at: int) -> str:
        start = _STATMOUNT_STRINGS + u32(at)
        return raw[start:raw.index(b"\0", start)].decode(errors="surrogateescape")

    attr, sb_flags = u64(64), u32(32)
    options = ["ro" if attr & 0x1 else "rw"] + [name for bit, name in _MOUNT_ATTR_OPTIONS if attr & bit]
    if attr & _MOUNT_ATTR_ATIME == 0:
        options.append("relatime")
    if attr & _MOUNT_ATTR_NOSYMFOLLOW:
        options.append("nosymfollow")
    super_options = ["ro" if sb_flags & _SB_RDONLY else "rw"] + [name for bit, name in _SB_OPTIONS if sb_flags & bit]
    fs_options = string(4) if got & _STATMOUNT_MNT_OPTS else ""
    if fs_options:
        super_options += fs_options.split(",")
    # Paths and source come as they are (mountinfo escapes them); the file
    # system's options come escaped by the file system, as in mountinfo.
    return MountEntry(
        mount_id=u32(56), major=u32(16), minor=u32(20), root=string(104), mount_point=string(108),
        options=tuple(options), fs_type=string(36), source=string(124), super_options=tuple(super_options))


def fd_path(fd: int) -> str:
    """The path through which the kernel reaches an open descriptor."""
    return f"/proc/self/fd/{fd}"


def bind_fd(source_fd: int, target_fd: int, *, readonly: bool = False, private: bool = False,
            recursive: bool = False, slave: bool = False) -> None:
    """Bind the tree at source_fd onto target_fd (both O_PATH descriptors),
    read-only from the first instant when asked (the top mount only, as a
    read-only bind's submounts keep their own mode). private: the copy
    leaves the source's peer group before it is attached, so nothing
    mounted or unmounted later at the source (or at the copy) reaches the
    other; slave: the copy receives what is mounted and unmounted at the
    source later, and sends nothing back. recursive: the mounts below the
    source come along (rbind); the propagation is set on all of them."""
    tree = clone_tree(source_fd, readonly=readonly, private=private, recursive=recursive, slave=slave)
    try:
        attach_tree(tree, target_fd)
    finally:
        os.close(tree)  # a tree never moved is dissolved here


def clone_tree(source_fd: int, *, readonly: bool = False, private: bool = False, recursive: bool = False,
               slave: bool = False) -> int:
    """A detached copy of the tree at source_fd, as bind_fd describes it,
    as a descriptor: attach it with attach_tree (in this mount namespace or,
    from a thread inside it, another: crust.sys.mountns), or close it to
    dissolve it. The source must be in the caller's mount namespace."""
    flags = _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_EMPTY_PATH | (_AT_RECURSIVE if recursive else 0)
    tree = _check(_libc.syscall(_SYS_OPEN_TREE, source_fd, b"", flags), "open_tree")
    try:
        propagation = MS_SLAVE if slave else MS_PRIVATE if private else 0
        if propagation:
            attr = _MountAttr(0, 0, propagation, 0)
            _check(_libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH | (_AT_RECURSIVE if recursive else 0),
                                 ctypes.byref(attr), ctypes.sizeof(attr)), "mount_setattr")
        if readonly:
            attr = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0)
            _check(_libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH, ctypes.byref(attr),
                                 ctypes.sizeof(attr)), "mount_setattr")
    except BaseException:
        os.close(tree)
        raise
    return tree


def attach_tree(tree_fd: int, target_fd: int) -> None:
    """Move a detached tree (clone_tree) onto target_fd, which must be in
    the calling thread's mount namespace."""
    _check(_libc.syscall(_SYS_MOVE_MOUNT, tree_fd, b"", target_fd, b"",
                         _MOVE_MOUNT_F_EMPTY_PATH | _MOVE_MOUNT_T_EMPTY_PATH), "move_mount")


# mount(8)'s generic options as mount(2) flags: (flag, set it?). Everything
# else is the file system's own and goes to it as data; the few options only
# mount(8) and fstab understand are dropped, as mount(8) drops them.
_MS_FLAGS = {
    "ro": (0x1, True), "rw": (0x1, False),
    "nosuid": (0x2, True), "suid": (0x2, False),
    "nodev": (0x4, True), "dev": (0x4, False),
    "noexec": (0x8, True), "exec": (0x8, False),
    "sync": (0x10, True), "async": (0x10, False),
    "mand": (0x40, True), "nomand": (0x40, False),
    "dirsync": (0x80, True),
    "nosymfollow": (0x100, True), "symfollow": (0x100, False),
    "noatime": (0x400, True), "atime": (0x400, False),
    "nodiratime": (0x800, True), "diratime": (0x800, False),
    "silent": (0x8000, True), "loud": (0x8000, False),
    "relatime": (1 << 21, True), "norelatime": (1 << 21, False),
    "strictatime": (1 << 24, True), "nostrictatime": (1 << 24, False),
    "lazytime": (1 << 25, True), "nolazytime": (1 << 25, False),
}
_USERSPACE_ONLY = {"defaults", "auto", "noauto", "user", "nouser", "users", "owner", "group", "nofail",
                   "_netdev", "comment"}


def mount_flags(options: list[str]) -> tuple[int, str]:
    """(mount(2) flags, data string) of mount(8)-style options."""
    flags, data = 0, []
    for option in options:
        if option in _MS_FLAGS:
            bit, on = _MS_FLAGS[option]
            flags = flags | bit if on else flags & ~bit
        elif option in _USERSPACE_ONLY or option.startswith(("x-", "comment=")):
            continue
        elif option:
            data.append(option)
    return flags, ",".join(data)


# The new mount API's file system context: fsopen, fsconfig, fsmount.
_SYS_FSOPEN = 430
_SYS_FSCONFIG = 431
_SYS_FSMOUNT = 432
_FSOPEN_CLOEXEC = 0x1
_FSCONFIG_SET_FLAG = 0
_FSCONFIG_SET_STRING = 1
_FSCONFIG_CMD_CREATE = 6
_FSMOUNT_CLOEXEC = 0x1
def open_filesystem(source: str, fs_type: str, options: list[str]) -> int:
    """The file system on `source` read into a super block and mounted
    nowhere: a detached mount (fsopen, fsconfig, fsmount), as a descriptor.
    A mount(2) of the same device while it is open shares its super block
    (the kernel reads nothing again); closing the descriptor unmounts it,
    the file system too once no other mount holds it. `options` as mount(8)
    takes them, split as mount(2) gets them (mount_flags): the super block's
    flags and the file system's own options go to fsconfig, the per-mount
    flags are left to that other mount."""
    flags, data = mount_flags(options)
    context = _check(_libc.syscall(_SYS_FSOPEN, fs_type.encode(), _FSOPEN_CLOEXEC), "fsopen")
    try:
        def configure(command: int, key: bytes | None, value: bytes | None) -> None:
            what = f"fsconfig {key.decode()}" if key else "fsconfig create"
            _check(_libc.syscall(_SYS_FSCONFIG, context, command, key, value, 0), f"{what} ({fs_type} on {source})")

        configure(_FSCONFIG_SET_STRING, b"source", source.encode())
        for bit, name in ((_SB_RDONLY, "ro"), *_SB_OPTIONS):
            if flags & bit:
                configure(_FSCONFIG_SET_FLAG, name.encode(), None)
        for option in filter(None, data.split(",")):
            key, equals, value = option.partition("=")
            if equals:
                configure(_FSCONFIG_SET_STRING, key.encode(), value.encode())
            else:
                configure(_FSCONFIG_SET_FLAG, key.encode(), None)
        configure(_FSCONFIG_CMD_CREATE, None, None)
        return _check(_libc.syscall(_SYS_FSMOUNT, context, _FSMOUNT_CLOEXEC, 0), f"fsmount ({fs_type} on {source})")
    finally:
        os.close(context)


async def mount_fd(source: str, target_fd: int, fs_type: str, options: list[str] | None = None) -> None:
    """Mount a file system (device or pseudo source) onto an open descriptor.

    One mount(2) onto /proc/self/fd/N: the kernel reaches the descriptor's
    file, never a path string. (mount(8) would cost a child process and a
    read of the whole mount table per call.)"""
    flags, data = mount_flags(options or [])
    result = _libc.mount(source.encode(), fd_path(target_fd).encode(), fs_type.encode(), ctypes.c_ulong(flags),
                         data.encode() or None)
    if result != 0:
        err = ctypes.get_errno()
        detail = f" with options {','.join(options)}" if options else ""
        raise OSError(err, f"mount {source} ({fs_type}){detail}: {os.strerror(err)}")


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


_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_REMOUNT = 0x20
_MS_RDONLY = 0x1
_MNT_DETACH = 0x2
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20


def unmount_at(path: str) -> bool:
    """unmount_beneath of path's last component in its parent, the parent
    opened first: the unmount happens where the caller named, a symlink
    there never followed. False when nothing is mounted there."""
    parent, name = os.path.split(path)
    fd = os.open(parent or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return unmount_beneath(fd, name)
    finally:
        os.close(fd)


def set_propagation(target: str, kind: int) -> None:
    """mount --make-private / --make-shared of the one mount at target."""
    if _libc.mount(None, target.encode(), None, ctypes.c_ulong(kind), None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"propagation of {target}: {os.strerror(err)}")


def remount_bind_readonly(target: str) -> None:
    """Make the one mount at target read-only (its file system and its
    other mounts keep their mode)."""
    if _libc.mount(None, target.encode(), None, ctypes.c_ulong(_MS_REMOUNT | _MS_BIND | _MS_RDONLY), None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"read-only remount of {target}: {os.strerror(err)}")


def detach_beneath(parent_fd: int, name: str) -> bool:
    """As unmount_beneath, lazily: a mount still in use (a file server
    holding its files) is cut from the tree now and freed when let go."""
    path = f"{fd_path(parent_fd)}/{name}".encode()
    if _libc.umount2(path, _UMOUNT_NOFOLLOW | _MNT_DETACH) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOENT):
        return False
    raise OSError(err, f"umount {name}: {os.strerror(err)}")


def detach_in_cwd(name: str) -> bool:
    """As detach_beneath, for `name` in the calling thread's working
    directory (a thread inside another mount namespace, where /proc may
    not be mounted: crust.sys.mountns)."""
    if "/" in name:
        raise ValueError(f"{name!r} is not a name in a directory")
    if _libc.umount2(name.encode(), _UMOUNT_NOFOLLOW | _MNT_DETACH) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOENT):
        return False
    raise OSError(err, f"umount {name}: {os.strerror(err)}")


def mount_path(source: str, target: str, fs_type: str, options: list[str] | None = None) -> None:
    """mount(2) as containerd's Mount describes it: a type, a source and
    mount(8)-style options, where `bind`/`rbind` make a (recursive) bind and a
    read-only bind is remounted read-only, as mount(8) does."""
    options = list(options or [])
    bind = fs_type == "bind" or "bind" in options or "rbind" in options
    flags, data = mount_flags([o for o in options if o not in ("bind", "rbind")])
    if bind:
        flags |= _MS_BIND | (_MS_REC if "rbind" in options else 0)
        fs_type, data = "", ""
    if _libc.mount(source.encode(), target.encode(), fs_type.encode(), ctypes.c_ulong(flags),
                   data.encode() or None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} ({fs_type or 'bind'}) at {target}: {os.strerror(err)}")
    if bind and flags & 0x1:
        if _libc.mount(b"", target.encode(), b"", ctypes.c_ulong(flags | _MS_REMOUNT), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"remount {target} read-only: {os.strerror(err)}")


def remount(target: str, options: list[str]) -> None:
    """Remount the file system at target with mount(8)-style options (a
    tmpfs's new size): what the options leave out goes back to its default."""
    flags, data = mount_flags(options)
    if _libc.mount(b"", target.encode(), b"", ctypes.c_ulong(flags | _MS_REMOUNT), data.encode() or None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"remount {target}: {os.strerror(err)}")


def unmount_all(target: str) -> int:
    """Unmount every mount stacked at target (a busy one lazily); how many."""
    count = 0
    while True:
        if _libc.umount2(target.encode(), _UMOUNT_NOFOLLOW) == 0:
            count += 1
            continue
        err = ctypes.get_errno()
        if err == errno.EBUSY and _libc.umount2(target.encode(), _MNT_DETACH | _UMOUNT_NOFOLLOW) == 0:
            count += 1
            continue
        if err in (errno.EINVAL, errno.ENOENT):
            return count
        raise OSError(err, f"umount {target}: {os.strerror(err)}")
