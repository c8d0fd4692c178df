"""Kubelet's atomic writer (pkg/volume/util/atomic_writer.go), replayed:
how the files of a configMap, secret, projected or downward API volume are
laid out on the node, and how an update replaces them all at once.

The layout in the volume's directory:

    ..2026_11_23_10_04_05.2846021157/   the data, one directory per version
    ..data -> ..2026_11_23_10_04_05.2846021157
    <key>  -> ..data/<key>              what the container sees, per top-level name

A write (the first, or an update):
 1. the payload's paths are checked: relative, no ".." element, not
    starting with "..", a name at most 255 bytes, a path at most 4096;
 2. the current version is read from the ..data link;
 3. the paths of the current version the payload no longer has are noted;
 4. nothing is written when every file already holds the payload's bytes
    and nothing is to go (the visible links are still made, step 10);
 5. a new version directory, ..<UTC time>.<random digits>, mode 0755;
 6. each file written with its mode (chmod after, whatever the umask),
    parents made as needed, owned by the file's user when it names one;
 7. the caller's permission step (fsGroup ownership) on the new version;
 8. a link ..data_tmp -> the new version;
 9. ..data_tmp renamed over ..data: the one atomic step; a reader sees the
    old version or the new one, never a mix;
10. a link <name> -> ..data/<name> for each top-level name still missing;
11. the top-level links of paths gone from the payload removed;
12. the old version directory removed.

Readers that hold a file open keep the old bytes; a path read again goes
through ..data to the new version.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = "..data"
NEW_DATA_DIR = "..data_tmp"
MAX_NAME = 255
MAX_PATH = 4096
VERSION_DIR_MODE = 0o755


class PayloadError(ValueError):
    """A payload path the writer refuses (kubelet's wording)."""


@dataclass(frozen=True)
class FileProjection:
    """One file of the payload: its bytes, its mode, and the user that owns
    it when one is named (a service-account token for the pod's user)."""

    data: bytes
    mode: int
    fs_user: int | None = None


def check_path(path: str) -> None:
    if not path:
        raise PayloadError(f"invalid path: must not be empty: {path!r}")
    if path.startswith("/"):
        raise PayloadError(f"invalid path: must be relative path: {path}")
    if len(path) > MAX_PATH:
        raise PayloadError(f"invalid path: must be less than or equal to {MAX_PATH} characters")
    items = path.split("/")
    for item in items:
        if item == "..":
            raise PayloadError(f"invalid path: must not contain '..': {path}")
        if len(item.encode()) > MAX_NAME:
            raise PayloadError(f"invalid path: filenames must be less than or equal to {MAX_NAME} characters")
    if items[0].startswith("..") and len(items[0]) > 2:
        raise PayloadError(f"invalid path: must not start with '..': {path}")


def clean_payload(payload: dict[str, FileProjection]) -> dict[str, FileProjection]:
    """The payload checked, its paths in their clean form (filepath.Clean)."""
    clean = {}
    for path, projection in payload.items():
        check_path(path)
        clean[os.path.normpath(path)] = projection
    return clean


def _parents_and_self(path: str) -> list[str]:
    """"a/b/c" -> ["a/b/c", "a/b", "a"]: the payload's paths and every
    directory above them (never removed while they hold a new file)."""
    found = []
    while path:
        found.append(path)
        path = os.path.dirname(path)
    return found


class AtomicWriter:
    """Writes payloads into one existing directory, the volume's."""

    def __init__(self, target: Path):
        if not target.exists():
            raise FileNotFoundError(f"atomic writer target {target} does not exist")
        self.target = target

    def current_version(self) -> str:
        """The version directory ..data names ("" before the first write)."""
        try:
            return os.readlink(self.target / DATA_DIR)
        except FileNotFoundError:
            return ""

    def write(self, payload: dict[str, FileProjection],
              set_perms: Callable[[str], None] | None = None) -> bool:
        """Project the payload; returns whether a new version was written."""
        clean = clean_payload(payload)
        old = self.current_version()
        to_remove: set[str] = set()
        should_write = True
        if old:
            to_remove = self._paths_to_remove(clean, self.target / old)
            if not self._differs(clean, self.target / old) and not to_remove:
                # Up to date; the visible links are still checked below, and
                # the current version must not be removed.
                should_write, old = False, ""
        if should_write:
            version = self._new_version_dir()
            try:
                self._write_files(clean, self.target / version)
                if set_perms is not None:
                    set_perms(version)
                os.symlink(version, self.target / NEW_DATA_DIR)
            except BaseException:
                shutil.rmtree(self.target / version, ignore_errors=True)
                raise
            try:
                os.rename(self.target / NEW_DATA_DIR, self.target / DATA_DIR)
            except BaseException:
                (self.target / NEW_DATA_DIR).unlink(missing_ok=True)
                shutil.rmtree(self.target / version, ignore_errors=True)
                raise
        self._make_visible(clean)
        self._remove_visible(to_remove)
        if old:
            shutil.rmtree(self.target / old)
        return should_write

    @staticmethod
    def _differs(payload: dict[str, FileProjection], version: Path) -> bool:
        for path, projection in payload.items():
            try:
                if (version / path).read_bytes() != projection.data:
                    return True
            except FileNotFoundError:
                return True
        return False

    @staticmethod
    def _paths_to_remove(payload: dict[str, FileProjection], version: Path) -> set[str]:
        current = set()
        for dirpath, dirnames, filenames in os.walk(version):
            relative = os.path.relpath(dirpath, version)
            for name in dirnames + filenames:
                current.add(name if relative == "." else f"{relative}/{name}")
        wanted = {p for path in payload for p in _parents_and_self(path)}
        return current - wanted

    def _new_version_dir(self) -> str:
        """os.MkdirTemp(target, "..<UTC time>."): the time, then random digits."""
        prefix = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime())
        for _ in range(100):
            name = prefix + str(secrets.randbits(32))
            try:
                os.mkdir(self.target / name, 0o700)
            except FileExistsError:
                continue
            os.chmod(self.target / name, VERSION_DIR_MODE)
            return name
        raise FileExistsError(f"no free version directory name in {self.target}")

    @staticmethod
    def _write_files(payload: dict[str, FileProjection], version: Path) -> None:
        for path, projection in payload.items():
            full = version / path
            full.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                         projection.mode & 0o7777)
            try:
                view = memoryview(projection.data)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, projection.mode & 0o7777)
                if projection.fs_user is not None:
                    os.fchown(fd, projection.fs_user, -1)
            finally:
                os.close(fd)

    def _make_visible(self, payload: dict[str, FileProjection]) -> None:
        for path in payload:
            top = path.split("/", 1)[0]
            if not os.path.lexists(self.target / top):
                os.symlink(f"{DATA_DIR}/{top}", self.target / top)

    def _remove_visible(self, paths: set[str]) -> None:
        # Only the top-level links: deeper paths went with the old version.
        for path in paths:
            if "/" not in path:
                os.remove(self.target / path)
