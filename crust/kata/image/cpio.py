"""A newc ("070701") cpio writer for initramfs images.

Written here rather than piping to cpio(1) so that the archive is
byte-for-byte reproducible (fixed inode numbers, owners and times, sorted
entries) and can hold device nodes without creating them on the host: the
image hash then only depends on its inputs.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass

MAGIC = b"070701"
TRAILER = "TRAILER!!!"


@dataclass(frozen=True)
class Entry:
    path: str            # relative to the archive root, no leading "/"
    mode: int            # file type bits included (stat.S_IFREG | 0o755, ...)
    data: bytes = b""    # file contents, or the target of a symlink
    rdev: tuple[int, int] = (0, 0)


def directory(path: str, perm: int = 0o755) -> Entry:
    return Entry(path, stat.S_IFDIR | perm)


def regular(path: str, data: bytes, perm: int = 0o644) -> Entry:
    return Entry(path, stat.S_IFREG | perm, data)


def symlink(path: str, target: str) -> Entry:
    return Entry(path, stat.S_IFLNK | 0o777, target.encode())


def chardev(path: str, major: int, minor: int, perm: int = 0o600) -> Entry:
    return Entry(path, stat.S_IFCHR | perm, rdev=(major, minor))


def _pad(n: int) -> bytes:
    return b"\0" * (-n % 4)


def _header(ino: int, entry: Entry, name: bytes) -> bytes:
    fields = (ino, entry.mode, 0, 0, 2 if stat.S_ISDIR(entry.mode) else 1, 0,
              len(entry.data), 0, 0, entry.rdev[0], entry.rdev[1], len(name) + 1, 0)
    return MAGIC + b"".join(b"%08X" % f for f in fields)


def archive(entries: list[Entry]) -> bytes:
    """The archive, parents before children (the kernel unpacks in order and
    does not create missing parent directories)."""
    seen: dict[str, Entry] = {}
    for e in entries:
        path = e.path.strip("/")
        if path in seen and seen[path] != Entry(path, e.mode, e.data, e.rdev):
            raise ValueError(f"initramfs: two different entries for /{path}")
        seen[path] = Entry(path, e.mode, e.data, e.rdev)
    for path in list(seen):
        parts = path.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent not in seen:
                seen[parent] = directory(parent)
            elif not stat.S_ISDIR(seen[parent].mode):
                raise ValueError(f"initramfs: /{parent} is needed as a directory")
    out = bytearray()
    for ino, path in enumerate(sorted(seen, key=lambda p: p.split("/")), start=1):
        e = seen[path]
        name = path.encode()
        head = _header(ino, e, name) + name + b"\0"
        out += head + _pad(len(head)) + e.data + _pad(len(e.data))
    end = Entry(TRAILER, 0)
    head = _header(0, end, TRAILER.encode()) + TRAILER.encode() + b"\0"
    out += head + _pad(len(head))
    return bytes(out)
