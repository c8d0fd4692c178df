"""Kata's direct-assigned volumes, answered by the crust microVM handler.

A CSI driver written for Kata Containers does not return a deferred mount:
its NodePublishVolume runs `kata-runtime direct-volume add --volume-path
<target path> --mount-info <json>`, its NodeGetVolumeStats runs `... stats`,
its NodeExpandVolume `... resize --size <bytes>`, its NodeUnpublishVolume
`... remove`. `crust kata direct-volume` takes the same verbs and flags, on
Kata's directory layout:

    <root>/<base64url(volume path), padded>/mountInfo.json   (0600, in a 0700 directory)
    <root>/<base64url(volume path), padded>/<sandbox id>     (empty: the sandbox using it)

so such a driver works unchanged with crust's microVM handler: the handler
finds these entries as it finds the proxy's (a bundle mount whose source is
the volume path), claims one by writing the sandbox-id file (one sandbox per
volume, as Kata has it), and answers stats and resize for it on its socket.

The entry is written the way the proxy writes its own: a temporary file,
fsync, rename, never following a symlink below the root.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crust.common import saferead
from crust.common.errors import FailedPrecondition, InvalidArgument
from crust.common.private import make_dirs
from crust.contract.mountinfo import VOLUME_TYPES, MountInfo, digest
from crust.contract.volumes_dir import check_sandbox_id
from crust.contract.volumes_dir import NAME_MAX, clear_dir, open_dir, remove_planted, write_atomic_at
from crust.runtime_handler.resolve import Resolved, SubpathEscapes, candidates

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path("/run/kata-containers/shared/direct-volumes")
MOUNT_INFO = "mountInfo.json"
MAX_MOUNT_INFO_BYTES = 64 * 1024
PROXY_KEY = "crust-schema-version"  # present in the entries the proxy mirrors here


class KataMountInfo(BaseModel):
    """The keys Kata reads; other keys are kept on disk and ignored, as Kata does."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    volume_type: str = Field(alias="volume-type")
    device: str
    fstype: str
    metadata: dict[str, str] = Field(default_factory=dict)
    options: list[str] = Field(default_factory=list)


def entry_name(volume_path: str) -> str:
    """Kata's name for a volume's directory: URL-safe base64 of the path, padded."""
    return base64.urlsafe_b64encode(volume_path.encode()).decode()


def check_volume_path(volume_path: str) -> str:
    if not volume_path:
        raise InvalidArgument("--volume-path is required")
    if not volume_path.startswith("/") or "\x00" in volume_path:
        raise InvalidArgument(f"--volume-path {volume_path!r} must be an absolute path")
    if len(entry_name(volume_path).encode()) > NAME_MAX:
        raise InvalidArgument(f"--volume-path is too long: its entry name in Kata's layout would exceed "
                              f"{NAME_MAX} bytes")
    return volume_path


def parse_mount_info(text: str, source: str = "--mount-info") -> KataMountInfo:
    """Validate a description (--mount-info, or the file source names);
    every message names source and the key at fault."""
    if len(text.encode()) > MAX_MOUNT_INFO_BYTES:
        raise InvalidArgument(f"{source} is larger than {MAX_MOUNT_INFO_BYTES} bytes")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{source} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{source} must be a JSON object")
    try:
        info = KataMountInfo.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidArgument(f"{source}: {where!r}: {first['msg']}") from None
    if raw.get("encryption"):
        # The layout has no way to carry a key, and a stock Kata would mount
        # the raw LUKS device: such volumes go through the proxy's registry.
        raise FailedPrecondition(f"{source}: 'encryption' {raw['encryption']!r}: an encrypted volume cannot be "
                                 "a Kata direct volume (no key reaches it this way); publish it through crust's "
                                 "proxy to a crust microVM handler")
    if info.volume_type not in VOLUME_TYPES:
        raise InvalidArgument(f"{source}: 'volume-type' {info.volume_type!r}: only a block volume is supported "
                              f"({' or '.join(repr(t) for t in VOLUME_TYPES)})")
    if not info.device.startswith("/"):
        raise InvalidArgument(f"{source}: 'device' {info.device!r} must be an absolute path")
    if not info.fstype:
        raise InvalidArgument(f"{source}: 'fstype' must not be empty")
    return info


class DamagedEntry(FailedPrecondition):
    """An entry is there for the volume, and is no description crust can
    mount: a sandbox that asks for the volume is refused, naming the entry
    and what is wrong with it, instead of starting without its volume."""


class DirectVolumes:
    """Kata's direct-volume directory: add, remove, read, and the sandbox marker."""

    def __init__(self, root: Path = DEFAULT_ROOT):
        self.root = root

    def _root_fd(self, create: bool = False) -> int:
        """The root, opened; created (0700) only by a writer: readers of a
        missing root raise FileNotFoundError, which they treat as "no entry"."""
        if create:
            make_dirs(self.root)
        return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)

    @contextmanager
    def _entry(self, volume_path: str) -> Iterator[int | None]:
        """The volume's directory, opened without following a symlink; None
        when there is none (no root, no entry, or a symlink planted there)."""
        try:
            root_fd = self._root_fd()
        except FileNotFoundError:
            yield None
            return
        try:
            try:
                fd = os.open(entry_name(volume_path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
            except (FileNotFoundError, NotADirectoryError):
                fd = None
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                fd = None
            try:
                yield fd
            finally:
                if fd is not None:
                    os.close(fd)
        finally:
            os.close(root_fd)

    def _read_file(self, volume_path: str) -> bytes | None:
        """The entry's mountInfo.json; None when there is none, or when what
        is there is no small regular file (crust.common.saferead)."""
        with self._entry(volume_path) as fd:
            if fd is None:
                return None
            try:
                return saferead.read_bounded(MOUNT_INFO, MAX_MOUNT_INFO_BYTES, dir_fd=fd)
            except FileNotFoundError:
                return None
            except saferead.Refused as exc:
                log.warning("ignoring a direct volume's mountInfo.json", extra={"fields": {
                    "volume_path": volume_path, "error": exc.reason}})
                return None

    # -- the verbs ---------------------------------------------------------------------

    def add(self, volume_path: str, mount_info: str) -> bool:
        """Write the entry; True if it changed. The same description again is
        a no-op (kubelet retries); a different one is refused while a
        sandbox uses the volume."""
        check_volume_path(volume_path)
        parse_mount_info(mount_info)
        data = mount_info.encode()
        current = self._read_file(volume_path)
        if current == data:
            return False
        holder = self.sandbox_of(volume_path)
        if current is not None and holder is not None:
            raise FailedPrecondition(f"{volume_path} is in use by sandbox {holder}; its description cannot change "
                                     "until the sandbox stops")
        root_fd = self._root_fd(create=True)
        try:
            with open_dir(root_fd, entry_name(volume_path), create=True) as fd:
                write_atomic_at(fd, MOUNT_INFO, data)
            os.fsync(root_fd)
        finally:
            os.close(root_fd)
        return True

    def remove(self, volume_path: str) -> bool:
        """Remove the entry and its marker; True if there was one."""
        check_volume_path(volume_path)
        try:
            root_fd = self._root_fd()
        except FileNotFoundError:
            return False
        try:
            return clear_dir(root_fd, entry_name(volume_path))
        finally:
            os.close(root_fd)

    def read(self, volume_path: str) -> MountInfo | None:
        """The entry as the handler mounts it (None if absent or unreadable)."""
        try:
            return self.described(volume_path)
        except DamagedEntry as exc:
            log.warning("ignoring a direct volume's entry", extra={"fields": {"error": exc.message}})
            return None

    def described(self, volume_path: str) -> MountInfo | None:
        """The entry as the handler mounts it; None when there is no entry
        (nor its mountInfo.json yet), or when it is the proxy's mirror of
        its own entry; DamagedEntry when what is there is no description:
        the entry or its mountInfo.json a symlink, a FIFO or another kind of
        file, larger than a description may be, not JSON, or not Kata's keys."""
        where = self.root / entry_name(volume_path)

        def damaged(what: str) -> DamagedEntry:
            return DamagedEntry(f"the Kata direct-volume entry of {volume_path}, {what}: it is no description "
                                "of a volume, and the volume is not given to a sandbox without one (remove the "
                                "entry, or write it again with `direct-volume add`)")

        try:
            root_fd = self._root_fd()
        except FileNotFoundError:
            return None
        try:
            try:
                st = os.stat(where.name, dir_fd=root_fd, follow_symlinks=False)
            except FileNotFoundError:
                return None
            if stat.S_ISLNK(st.st_mode):
                raise damaged(f"{where}, is a symbolic link, not a directory (never followed)")
            if not stat.S_ISDIR(st.st_mode):
                raise damaged(f"{where}, is {saferead.kind_of(st.st_mode)}, not a directory")
            try:
                data = self._read_entry_file(root_fd, where.name)
            except FileNotFoundError:
                return None  # gone, or being written (the directory comes first)
            except saferead.Refused as exc:
                raise damaged(f"{where / MOUNT_INFO} {exc.reason}") from None
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise damaged(f"{where}, was replaced by something that is not a directory") from None
        finally:
            os.close(root_fd)
        try:
            info = parse_mount_info(data.decode(errors="replace"), str(where / MOUNT_INFO))
        except (InvalidArgument, FailedPrecondition) as exc:
            raise damaged(exc.message) from None
        if PROXY_KEY in json.loads(data):
            # The proxy's mirror of one of its own entries: claimed through
            # the registry, never as a direct volume (even while the proxy
            # removes the canonical entry first).
            return None
        return MountInfo(volume_type=info.volume_type, device=info.device, fstype=info.fstype,
                         metadata=info.metadata, options=info.options, target_path=volume_path)

    @staticmethod
    def _read_entry_file(root_fd: int, name: str) -> bytes:
        with open_dir(root_fd, name, create=False) as fd:
            return saferead.read_bounded(MOUNT_INFO, MAX_MOUNT_INFO_BYTES, dir_fd=fd)

    def resolve(self, source: str) -> Resolved | None:
        """A bundle mount source (or a parent, below a CSI volume) that is a
        direct volume; DamagedEntry for one whose entry is damaged."""
        if not source.startswith("/"):
            return None
        if ".." in source.split("/"):
            raise SubpathEscapes(f"mount source {source!r} contains '..'")
        for probe in candidates(source):
            if len(entry_name(probe).encode()) > NAME_MAX:
                continue
            info = self.described(probe)
            if info is not None:
                subpath = os.path.relpath(os.path.normpath(source), probe)
                return Resolved(info, digest(probe), "" if subpath == "." else subpath)
        return None

    # -- the sandbox marker --------------------------------------------------------------

    def sandbox_of(self, volume_path: str) -> str | None:
        with self._entry(volume_path) as fd:
            if fd is None:
                return None
            names = sorted(n for n in os.listdir(fd) if n != MOUNT_INFO and not n.startswith("."))
        return names[0] if names else None

    def claim(self, volume_path: str, sandbox_id: str) -> None:
        """Record the sandbox using the volume; refused if another one does."""
        check_sandbox_id(sandbox_id)
        holder = self.sandbox_of(volume_path)
        if holder is not None and holder != sandbox_id:
            raise FailedPrecondition(f"{volume_path} is already used by sandbox {holder}")
        with self._entry(volume_path) as fd:
            if fd is None:
                raise FailedPrecondition(f"{volume_path} is no longer a direct volume (removed)")
            try:
                st = os.stat(sandbox_id, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    remove_planted(fd, sandbox_id)  # a FIFO would block the open below, a link lead elsewhere
            except FileNotFoundError:
                pass
            os.close(os.open(sandbox_id, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600, dir_fd=fd))
            os.fsync(fd)

    def release(self, volume_path: str, sandbox_id: str) -> None:
        with self._entry(volume_path) as fd:
            if fd is None:
                return
            try:
                remove_planted(fd, sandbox_id)
            except FileNotFoundError:
                return
            os.fsync(fd)
