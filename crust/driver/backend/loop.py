"""The loop backend: each volume is a sparse file in a per-node pool.

Controller side (files only, never devices): create, clone, snapshot, grow,
preallocate and delete backing files. Node side: find the backing file of a
volume in this node's pool; attaching it to a loop device is the node
servicer's job (crust.sys.loop).

A pool is the directory pools/<node-id>/ under the data dir. On one machine
controller and node share it; on several machines each node's pool must be
reachable by the controller at the same path (a shared or exported
directory). That is how a volume the controller created on a node comes to
exist there: the controller writes the backing file into that node's pool,
and the node attaches it when it is staged.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import secrets
import time
from pathlib import Path

from crust.common.aio import in_thread
from crust.common.atomicfile import fsync_dir
from crust.common.errors import space_in
from crust.common.private import make_dirs, open_new
from crust.sys.sparse import data_extents

ID_PATTERN = re.compile(r"^[a-z]{1,4}-[0-9a-f]{24}$")
# A node id names its pool directory (the same rule as --node-id).
NODE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")

MIB = 1024 * 1024


def new_id(prefix: str) -> str:
    """Ids sort by creation time, so pagination by id sees new volumes last."""
    return f"{prefix}-{time.time_ns() // 1000:016x}{secrets.token_hex(4)}"


def valid_id(value: str) -> bool:
    return bool(ID_PATTERN.fullmatch(value))


def valid_node(value: str) -> bool:
    """A node id that names a directory under pools/ (never '..' or a path)."""
    return bool(NODE_PATTERN.fullmatch(value))


class Pool:
    """Backing files of one node."""

    def __init__(self, data_dir: Path, node_id: str):
        if not valid_node(node_id):
            # A pool is a directory under pools/: a node id from a record
            # that lies must never lead elsewhere.
            raise ValueError(f"malformed node id {node_id!r}")
        self.root = data_dir / "pools" / node_id
        self.node_id = node_id
        self.volumes = self.root / "volumes"
        self.snapshots = self.root / "snapshots"

    def ensure(self) -> None:
        for d in (self.root, self.volumes, self.snapshots):
            make_dirs(d)

    def volume_file(self, volume_id: str) -> Path:
        if not valid_id(volume_id):
            raise ValueError(f"malformed volume id {volume_id!r}")
        return self.volumes / f"{volume_id}.img"

    def snapshot_file(self, snapshot_id: str) -> Path:
        if not valid_id(snapshot_id):
            raise ValueError(f"malformed snapshot id {snapshot_id!r}")
        return self.snapshots / f"{snapshot_id}.img"

    def temp_file(self, final: Path) -> Path:
        return final.with_name(f".{final.name}.partial")

    def clean_partials(self) -> int:
        removed = 0
        for d in (self.volumes, self.snapshots):
            for partial in d.glob(".*.partial"):
                partial.unlink(missing_ok=True)
                removed += 1
        return removed


def _create_sparse(path: Path, size: int) -> None:
    fd = open_new(path)  # 0600: the volume's bytes are for the loop device only
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def make_blank(final: Path, size: int, *, preallocate: bool = False) -> None:
    """Make a new backing file of `size` bytes, all at once or not at all.

    Blocking (run it in a worker thread): every step, down to the rename and
    the directory's fsync, belongs off the event loop."""
    tmp = _fresh_partial(final)
    try:
        with space_in(final.parent):
            _create_sparse(tmp, size)
            _install(tmp, final, size, preallocate)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def make_copy(source: Path, final: Path, size: int, *, preallocate: bool = False) -> None:
    """Make `final` a copy of `source` (holes preserved), then grow it to
    size; blocking, like make_blank."""
    tmp = _fresh_partial(final)
    try:
        with space_in(final.parent):
            _copy_data(source, tmp)
            _grow_and_sync(tmp, size)
            _install(tmp, final, size, preallocate)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a copy cut short by a full disk is no use to anyone
        raise


async def copy_into(source: Path, final: Path, size: int, *, preallocate: bool = False) -> None:
    """make_copy in one trip to a worker thread."""
    await in_thread(lambda: make_copy(source, final, size, preallocate=preallocate))


def _fresh_partial(final: Path) -> Path:
    """The temporary of final, with any left over by a killed writer removed."""
    tmp = final.with_name(f".{final.name}.partial")
    tmp.unlink(missing_ok=True)
    return tmp


def _install(tmp: Path, final: Path, size: int, preallocate: bool) -> None:
    """Reserve the blocks if asked, then put the complete file in place durably."""
    if preallocate:
        allocate(tmp, size)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def _copy_data(source: Path, dest: Path) -> None:
    """Copy source into a new file dest, its data only: holes stay holes
    (SEEK_DATA/SEEK_HOLE), so a mostly empty 10 GiB volume copies in
    milliseconds, and copy_file_range lets the file system share extents
    where it can (reflinks on xfs, btrfs). No child process (cp) per copy."""
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(src).st_size
        dst = open_new(dest)
        try:
            os.ftruncate(dst, size)
            for start, end in data_extents(src, size):
                _copy_range(src, dst, start, end)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _copy_range(src: int, dst: int, start: int, end: int) -> None:
    position = start
    while position < end:
        try:
            copied = os.copy_file_range(src, dst, end - position, position, position)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            copied = 0
        if copied == 0:  # a file system that cannot: copy through memory
            chunk = os.pread(src, min(end - position, 8 * 1024 * 1024), position)
            if not chunk:
                raise OSError(errno.EIO, "the source ended before its size")
            copied = os.pwrite(dst, chunk, position)
        position += copied


def _grow_and_sync(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        if os.fstat(f.fileno()).st_size < size:
            f.truncate(size)
        os.fsync(f.fileno())


async def grow(path: Path, size: int, *, preallocate: bool = False) -> None:
    """Grow a backing file in place (never shrinks)."""
    with space_in(path.parent):
        await asyncio.to_thread(_grow_and_sync, path, size)
        if preallocate:
            await asyncio.to_thread(allocate, path, size)


def allocate(path: Path, size: int) -> None:
    """Reserve every block of the file (thick provisioning); data is kept."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def allocated_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        return
    fsync_dir(path.parent)
