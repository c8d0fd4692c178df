"""The watched directory: one entry per deferred volume, for runtime handlers.

    <volumes-dir>/<hex sha256(target path)>/mountInfo.json   (KEP-2857 layout)
    <kata-dir>/<base64url(target path)>/mountInfo.json       (optional Kata mirror)
    <kata-dir>/<base64url(target path)>/<sandbox-id>         (empty; Kata's claim marker)
    <volumes-dir>/<digest>/runtime-cli                       (written by a KEP-style runtime)

Directories are 0700 and files 0600. Files are written atomically
(temporary file, fsync, rename, fsync of the directory), so a reader never
sees a partial file, even if the proxy is killed mid-write. Every path below
the roots is opened relative to a directory file descriptor with O_NOFOLLOW:
a symlink planted inside these directories is never followed, and a file is
read through crust.common.saferead (no blocking open of a FIFO, regular files
only, bounded). Whatever another root process left in an entry (a
directory, a FIFO, a symlink, garbage) is damage: the proxy writes the entry
again from its own record, and removing an entry removes whatever is in it
(never following a link, never crossing into another mounted file system).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from crust.common import csi_input, saferead
from crust.common.atomicfile import fsync_async, temporary_name, write_atomic_in
from crust.common.errors import InvalidArgument, space_in
from crust.common.formats import NewerFormat
from crust.common.private import make_dirs
from crust.contract.mountinfo import MountInfo, digest, is_digest, kata_name

log = logging.getLogger(__name__)

MOUNT_INFO = "mountInfo.json"
RUNTIME_CLI = "runtime-cli"
NAME_MAX = 255


def check_sandbox_id(value: str, field: str = "sandbox_id") -> str:
    """A sandbox id names a file in an entry's directory (Kata's claim
    marker): a plain file name that can never be an entry's own file."""
    csi_input.required(value, field)
    if "/" in value or value in (".", "..") or "\x00" in value or len(value.encode()) > NAME_MAX \
            or value.startswith(".") or value == MOUNT_INFO:
        raise InvalidArgument(f"{field} {value!r} must be a plain file name (no '/', no leading '.', <= 255 bytes)")
    return value


class MirrorError(Exception):
    """The Kata mirror could not be written; the canonical entry still was."""


@contextmanager
def open_dir(parent_fd: int | None, name: str, create: bool) -> Iterator[int]:
    """Open (and optionally create, 0700) a directory without following a symlink."""
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                # Planted by someone else: remove it (unlink never follows).
                log.warning("replacing a non-directory in the volumes directory", extra={"fields": {"name": name}})
                os.unlink(name, dir_fd=parent_fd)
                os.mkdir(name, 0o700, dir_fd=parent_fd)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _make_room(dir_fd: int) -> None:
    """A directory planted at mountInfo.json's name would fail the rename
    of the new file over it: it goes first (a symlink, FIFO or file is
    simply replaced by the rename)."""
    try:
        st = os.stat(MOUNT_INFO, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        log.warning("removing a directory planted at an entry's mountInfo.json")
        remove_planted(dir_fd, MOUNT_INFO)


def _opener_in(dir_fd: int):
    """Opens a new temporary in dir_fd, never through a symlink."""
    return lambda name, flags: os.open(name, flags | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)


def write_atomic_at(dir_fd: int, name: str, data: bytes) -> None:
    with space_in(dir_fd):  # a full directory: RESOURCE_EXHAUSTED naming it, no temporary left
        _write_atomic_at(dir_fd, name, data)


def _write_atomic_at(dir_fd: int, name: str, data: bytes) -> None:
    tmp = temporary_name(name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    os.fsync(dir_fd)


MAX_CLEAR_DEPTH = 16


def _clear_inside(dir_fd: int, depth: int = 0) -> bool:
    """Remove everything inside the open directory dir_fd: files, links,
    FIFOs, and directories with what they hold (never following a link,
    never into another mounted file system, at most MAX_CLEAR_DEPTH deep).
    What cannot be removed is logged and left; True when nothing is left."""
    clear = True
    parent_dev = os.fstat(dir_fd).st_dev
    for name in os.listdir(dir_fd):
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if st.st_dev == parent_dev and depth < MAX_CLEAR_DEPTH:
                    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                    try:
                        _clear_inside(fd, depth + 1)
                    finally:
                        os.close(fd)
                os.rmdir(name, dir_fd=dir_fd)
            else:
                os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
        except OSError as exc:
            clear = False
            log.warning("could not remove something planted in an entry", extra={"fields": {
                "name": name, "error": exc.strerror or str(exc)}})
    return clear


def remove_planted(dir_fd: int, name: str) -> None:
    """Remove name in dir_fd, whatever it is (a directory with its content)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    with open_dir(dir_fd, name, create=False) as fd:
        _clear_inside(fd)
    os.rmdir(name, dir_fd=dir_fd)


def clear_dir(parent_fd: int, name: str) -> bool:
    """Remove directory `name` and whatever is in it (no symlink followed,
    no other file system entered); a symlink or file in its place is
    removed instead. Anything that cannot be removed (a mount point someone
    made inside) is logged and left. True when something was there."""
    try:
        with open_dir(parent_fd, name, create=False) as fd:
            _clear_inside(fd)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        os.unlink(name, dir_fd=parent_fd)  # a symlink or file where the entry should be
        os.fsync(parent_fd)
        return True
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EBUSY, errno.EEXIST):
            raise
        log.warning("an entry could not be removed entirely", extra={"fields": {
            "name": name, "error": exc.strerror}})
    os.fsync(parent_fd)
    return True


def _read_description(root: Path, name: str) -> bytes | None:
    """name/mountInfo.json below root, if it is a regular file reached
    without following a symlink; None otherwise (missing or damaged)."""
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
        finally:
            os.close(root_fd)
        try:
            return saferead.read_bounded(MOUNT_INFO, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except saferead.Refused:
        return None
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise


class VolumesDir:
    def __init__(self, root: Path, kata_root: Path | None = None):
        self.root = root
        self.kata_root = kata_root
        for d in (root, kata_root):
            if d is not None:
                make_dirs(d)

    @contextmanager
    def _root(self, root: Path) -> Iterator[int]:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            yield fd
        finally:
            os.close(fd)

    async def write(self, info: MountInfo) -> None:
        """Write the canonical entry, then the Kata mirror (MirrorError if
        only it failed). The loop stays free while the file system works
        (crust.common.atomicfile)."""
        data = info.to_json()
        with self._root(self.root) as root_fd, open_dir(root_fd, digest(info.target_path), create=True) as fd:
            _make_room(fd)
            await write_atomic_in(fd, MOUNT_INFO, data, _opener_in(fd))
            await fsync_async(root_fd)
        if self.kata_root is not None:
            name = kata_name(info.target_path)
            if info.encryption:
                # A stock Kata would mount the raw LUKS device (or worse,
                # find it blank): an encrypted volume has no mirror.
                if len(name.encode()) <= NAME_MAX:
                    with self._root(self.kata_root) as root_fd:
                        clear_dir(root_fd, name)
                raise MirrorError(
                    f"{info.target_path} is an encrypted volume ({info.encryption}): not mirrored for Kata, which "
                    "cannot open it; only a crust microVM handler that claims it through the registry gets its key")
            if len(name.encode()) > NAME_MAX:
                raise MirrorError(
                    f"the Kata mirror name of {info.target_path!r} would be {len(name)} bytes, over the "
                    f"{NAME_MAX}-byte file name limit; Kata cannot use this volume, the crust entry is written")
            with self._root(self.kata_root) as root_fd, open_dir(root_fd, name, create=True) as fd:
                _make_room(fd)
                await write_atomic_in(fd, MOUNT_INFO, info.kata_json(), _opener_in(fd))
                await fsync_async(root_fd)

    def read(self, target_path: str) -> MountInfo | None:
        """The entry's description; None when there is none, or when it is
        damaged (not a regular file, not a description) or in a newer format
        than this crust writes: its writer, the proxy, then writes it again
        from its own record."""
        try:
            with self._root(self.root) as root_fd, open_dir(root_fd, digest(target_path), create=False) as fd:
                return saferead.read_model(MountInfo, MOUNT_INFO, dir_fd=fd)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except saferead.Refused as exc:
            log.warning("a damaged entry is written again", extra={"fields": {
                "target_path": target_path, "error": exc.reason}})
            return None
        except NewerFormat as exc:
            log.warning("an entry of a newer format is written again", extra={"fields": {
                "target_path": target_path, "found": exc.found, "known": exc.known}})
            return None
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            return None  # a symlink where the entry's directory should be

    def holds(self, info: MountInfo) -> bool:
        """Whether the entry, and the Kata mirror where there can be one,
        already hold exactly this description (a start that finds them so
        has nothing to write)."""
        places = [(self.root, digest(info.target_path), info.to_json())]
        if self.kata_root is not None and len(kata_name(info.target_path).encode()) <= NAME_MAX \
                and not info.encryption:
            places.append((self.kata_root, kata_name(info.target_path), info.kata_json()))
        return all(_read_description(root, name) == data for root, name, data in places)

    def runtime_cli(self, target_path: str) -> str | None:
        """The CLI a KEP-style runtime recorded for this volume, if any."""
        try:
            with self._root(self.root) as root_fd, open_dir(root_fd, digest(target_path), create=False) as fd:
                data = saferead.read_bounded(RUNTIME_CLI, 4096, dir_fd=fd)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except saferead.Refused as exc:
            log.warning("ignoring a runtime-cli that is not a small regular file", extra={"fields": {
                "target_path": target_path, "error": exc.reason}})
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return None  # the entry's directory is a symlink
            raise
        text = data.decode(errors="replace").strip()
        return text if text.startswith("/") else None

    def remove(self, target_path: str) -> None:
        with self._root(self.root) as root_fd:
            clear_dir(root_fd, digest(target_path))
        if self.kata_root is not None:
            name = kata_name(target_path)
            if len(name.encode()) <= NAME_MAX:
                with self._root(self.kata_root) as root_fd:
                    clear_dir(root_fd, name)

    def mark_sandbox(self, target_path: str, sandbox_id: str | None) -> None:
        """Kata's claim marker: exactly one empty file named by the sandbox id
        (or none when sandbox_id is None). Anything else planted in the
        mirror entry goes; MirrorError when the entry cannot be marked (the
        mirror is Kata's, crust's own entry does not depend on it)."""
        if self.kata_root is None:
            return
        name = kata_name(target_path)
        if len(name.encode()) > NAME_MAX:
            return
        with self._root(self.kata_root) as root_fd:
            try:
                with open_dir(root_fd, name, create=False) as fd:
                    marked = changed = False
                    for entry in os.listdir(fd):
                        if entry == MOUNT_INFO or entry.startswith("."):
                            continue
                        if entry == sandbox_id and stat.S_ISREG(os.stat(entry, dir_fd=fd,
                                                                        follow_symlinks=False).st_mode):
                            marked = True
                            continue
                        remove_planted(fd, entry)  # another sandbox's marker, or something planted
                        changed = True
                    if sandbox_id and not marked:
                        f = os.open(sandbox_id, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK,
                                    0o600, dir_fd=fd)
                        os.close(f)
                        changed = True
                    if changed:
                        # Only then: a start re-marks every claimed volume,
                        # and an fsync each for nothing adds up.
                        os.fsync(fd)
            except FileNotFoundError:
                return
            except OSError as exc:
                raise MirrorError(f"the Kata mirror of {target_path} cannot be marked: {exc.strerror or exc}") \
                    from None

    def clean_temporaries(self, target_path: str) -> int:
        """Remove temporaries a killed writer left in this volume's entry and
        its Kata mirror (at start, before anything writes); returns how many."""
        removed = 0
        roots = [(self.root, digest(target_path))]
        if self.kata_root is not None and len(kata_name(target_path).encode()) <= NAME_MAX:
            roots.append((self.kata_root, kata_name(target_path)))
        for root, name in roots:
            with self._root(root) as root_fd:
                try:
                    with open_dir(root_fd, name, create=False) as fd:
                        for entry in os.listdir(fd):
                            if entry.startswith(".") and entry.endswith(".tmp"):
                                remove_planted(fd, entry)
                                removed += 1
                        if removed:
                            os.fsync(fd)
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                        raise
        return removed

    def digests(self) -> list[str]:
        return sorted(n for n in os.listdir(self.root) if is_digest(n))

    def remove_digest(self, name: str) -> None:
        with self._root(self.root) as root_fd:
            clear_dir(root_fd, name)
