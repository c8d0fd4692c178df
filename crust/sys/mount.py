"""Mounts: read /proc/self/mountinfo, mount, bind, remount read-only, unmount.

Whether something is mounted is always answered from mountinfo (the kernel's
truth), so every operation can be retried and converges.
"""

from __future__ import annotations

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
    for line in text.splitlines():
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
    with open(table) as f:
        text = f.read()
    if containing is not None:
        text = "\n".join(line for line in text.splitlines() if containing in line)
    return parse_mountinfo(text)


def at(path: str, table: str = MOUNTINFO) -> MountEntry | None:
    """The top-most mount at exactly this path, if any."""
    path = os.path.normpath(path)
    found = None
    for entry in mounts(table, containing=f" {_escape(path)} "):
        if entry.mount_point == path:
            found = entry  # later lines are mounted on top of earlier ones
    return found


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


async def mount(source: str, target: str, fs_type: str, options: list[str] | None = None) -> None:
    argv = ["mount", "-t", fs_type]
    if options:
        argv += ["-o", ",".join(options)]
    await run(argv + ["--", source, target])


async def bind(source: str, target: str, *, readonly: bool = False) -> None:
    await run(["mount", "--bind", "--", source, target])
    if readonly:
        # A bind mount ignores "ro" on creation; the remount makes this view
        # read-only without touching the other views of the filesystem.
        await run(["mount", "-o", "remount,bind,ro", "--", target])


async def unmount(target: str) -> None:
    await run(["umount", "--", target])


async def unmount_all(target: str) -> int:
    """Unmount every mount stacked at target; returns how many were removed."""
    count = 0
    while at(target) is not None:
        await unmount(target)
        count += 1
    return count
