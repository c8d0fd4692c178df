"""Copies in guest memory of the volumes kubelet's atomic writer updates
(configMap, secret, projected, downward API), kept in step with the share
they are bound in (StartMirror, StopMirror).

The writer publishes each version as a directory `..<timestamp>` and then
renames the link `..data` to point at it; the names a container reads are
links through `..data`. A read in the guest through virtio-fs takes a round
trip per name, long enough for the writer to remove the version the read
started in. So the agent keeps a copy: each new version copied whole, then
the copy's own `..data` renamed over, then the names linked and the old
version removed, in the writer's order; a reader in the guest walks a
tmpfs and never finds a version half gone. Secrets stay in memory.

A version is never changed once published, only removed, and only once
`..data` names a newer one: a copy counts only if `..data` still names its
version after it (nothing of it was removed meanwhile); else the next look
copies the newer one. The share gives the guest no notice of the host's
changes, so the agent looks every interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from crust.common import ttrpc
from crust.guest.errors import AgentError, check_id

log = logging.getLogger("crust.guest")

DATA = "..data"
DATA_TMP = "..data_tmp"
INTERVAL = 0.25          # seconds between looks, unless the host names another
FIRST_COPY_TRIES = 10
FIRST_COPY_PAUSE = 0.1


class VersionGone(Exception):
    """The version being copied was replaced meanwhile."""


def _version(source: Path) -> str:
    current = os.readlink(source / DATA)
    if not current.startswith("..") or "/" in current or current in (DATA, DATA_TMP):
        raise VersionGone(f"{source}/{DATA} names {current!r}, no version of the writer's")
    return current


def _copy_tree(source: Path, target: Path) -> None:
    """source copied to target (which must not exist) with modes, owners and
    links as they are (cp -a)."""
    st = os.lstat(source)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(source), target)
    elif stat.S_ISDIR(st.st_mode):
        os.mkdir(target, 0o700)
        for entry in os.scandir(source):
            _copy_tree(Path(entry.path), target / entry.name)
        os.chmod(target, stat.S_IMODE(st.st_mode))
    elif stat.S_ISREG(st.st_mode):
        shutil.copyfile(source, target, follow_symlinks=False)
        os.chmod(target, stat.S_IMODE(st.st_mode))
    else:
        return   # the writer makes only files, directories and links
    os.lchown(target, st.st_uid, st.st_gid)


def _link(target: Path, points_to: str) -> None:
    """target made a link to points_to, replaced in one rename."""
    staging = target.with_name(f"{target.name}.crust-new")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(staging)
    os.symlink(points_to, staging)
    os.rename(staging, target)


def sync(source: Path, copy: Path, staging: Path) -> None:
    """One pass: copy in step with source (the writer's order)."""
    current = _version(source)
    try:
        previous = os.readlink(copy / DATA)
    except OSError:
        previous = None
    if previous != current:
        here = copy / current
        if not here.is_dir() or here.is_symlink():
            shutil.rmtree(staging, ignore_errors=True)
            try:
                _copy_tree(source / current, staging)
            except FileNotFoundError:
                shutil.rmtree(staging, ignore_errors=True)
                raise VersionGone(f"{source}/{current} went while it was copied") from None
            if _version(source) != current:
                shutil.rmtree(staging, ignore_errors=True)
                raise VersionGone(f"{source}/{current} was replaced while it was copied")
            os.rename(staging, here)
        _link(copy / DATA, current)
    # The user's names only: the writer's own (..data, its versions) are
    # the copy's, handled above.
    names = {e.name: e for e in os.scandir(source) if not e.name.startswith("..")}
    for name, entry in names.items():
        if entry.is_symlink():   # the names the writer links into ..data
            wanted = os.readlink(entry.path)
            try:
                same = os.readlink(copy / name) == wanted
            except OSError:
                same = False
            if not same:
                _link(copy / name, wanted)
        elif entry.is_dir():     # a mount point made for a volume below this one: its place, empty
            (copy / name).mkdir(exist_ok=True)
        elif entry.is_file() and not (copy / name).exists():
            (copy / name).touch()
    for entry in os.scandir(copy):
        if entry.is_symlink() and entry.name not in names and not entry.name.startswith("..") and \
                not entry.name.endswith(".crust-new"):
            os.unlink(entry.path)
    # The version just replaced stays until the next pass: a reader that
    # resolved ..data to it a moment ago still opens its file.
    for entry in os.scandir(copy):
        if entry.name.startswith("..") and entry.name not in (DATA, current, previous) and \
                entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


@dataclass
class Mirror:
    name: str
    source: Path
    copy: Path
    task: asyncio.Task | None = None
    # The pass running in a thread: a stop waits for it (a cancelled wait
    # does not stop the thread), so the copy is removed after its last write.
    running: asyncio.Future | None = None


class Mirrors:
    def __init__(self, run_dir: Path):
        self.directory = run_dir / "mirror"
        self.mirrors: dict[str, Mirror] = {}
        self._lock = asyncio.Lock()

    def point(self, name: str) -> Path:
        return self.directory / name

    async def start(self, name: str, source: Path, interval: float) -> str:
        check_id("name", name)
        async with self._lock:
            known = self.mirrors.get(name)
            if known is not None:
                if known.source != source:
                    raise AgentError(ttrpc.ALREADY_EXISTS, f"name: the mirror {name} copies {known.source}")
                return str(known.copy)
            copy = self.point(name)
            if not (source / DATA).is_symlink():
                raise AgentError(ttrpc.INVALID_ARGUMENT, f"source: {source} is not laid out by kubelet's atomic "
                                                        f"writer (no {DATA})")
            mirror = Mirror(name, source, copy)
            await asyncio.to_thread(self._first_copy, mirror)
            mirror.task = asyncio.ensure_future(self._keep(mirror, interval))
            self.mirrors[name] = mirror
            log.info("mirror %s of %s started", name, source)
            return str(copy)

    def _first_copy(self, mirror: Mirror) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        st = os.stat(mirror.source)
        mirror.copy.mkdir(exist_ok=True)
        os.chown(mirror.copy, st.st_uid, st.st_gid)
        os.chmod(mirror.copy, stat.S_IMODE(st.st_mode))
        for attempt in range(FIRST_COPY_TRIES):
            try:
                sync(mirror.source, mirror.copy, self._staging(mirror))
                return
            except (VersionGone, OSError) as exc:
                # A version removed while it was copied: the next one.
                if attempt == FIRST_COPY_TRIES - 1:
                    shutil.rmtree(mirror.copy, ignore_errors=True)
                    raise AgentError(ttrpc.FAILED_PRECONDITION, f"source: {mirror.source} cannot be copied: "
                                                               f"{exc}") from None
                time.sleep(FIRST_COPY_PAUSE)

    def _staging(self, mirror: Mirror) -> Path:
        return self.directory / f".{mirror.name}.new"

    async def _keep(self, mirror: Mirror, interval: float) -> None:
        failing = False
        while True:
            await asyncio.sleep(interval)
            mirror.running = asyncio.ensure_future(asyncio.to_thread(sync, mirror.source, mirror.copy,
                                                                     self._staging(mirror)))
            try:
                await asyncio.shield(mirror.running)
                failing = False
            except (VersionGone, OSError) as exc:
                if not failing:
                    log.warning("mirror %s: %s (tried again every %.2f s)", mirror.name, exc, interval)
                failing = True

    async def stop(self, name: str) -> None:
        check_id("name", name)
        async with self._lock:
            mirror = self.mirrors.pop(name, None)
            if mirror is None:
                return
            if mirror.task is not None:
                mirror.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await mirror.task
            if mirror.running is not None:
                await asyncio.wait([mirror.running])
            await asyncio.to_thread(shutil.rmtree, mirror.copy, True)
            await asyncio.to_thread(shutil.rmtree, self._staging(mirror), True)

    async def close(self) -> None:
        for mirror in self.mirrors.values():
            if mirror.task is not None:
                mirror.task.cancel()
            if mirror.running is not None:
                await asyncio.wait([mirror.running])
