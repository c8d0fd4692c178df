"""A pod's volumes in the guest: a disk's (or an opened encrypted volume's)
file system mounted, measured, grown and unmounted by the guest's kernel
alone, each named by the host's volume_id.

The agent keeps what it mounted in memory; the kernel's mount table stays
the truth: a mount found where a volume was asked, of the same device, is
taken as made (a retry, or an agent restarted), a volume whose mount is
gone is mounted again. Stats count blocks as crust does everywhere (used is
total - free; root-reserved blocks are left out of `available` only).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
from dataclasses import dataclass

from crust.api import agent_pb2
from crust.common import agent_capabilities as caps
from crust.common import ttrpc
from crust.common.freezes import FreezeBook
from crust.guest.disks import Disks, check_disk
from crust.guest.errors import AgentError, check_id
from crust.sys import blockdev, growfs, modules, ownership
from crust.sys import freeze as sysfreeze
from crust.sys import mount as sysmount

log = logging.getLogger(__name__)

MODULES_DIR = "/etc/crust/modules.d"
BLOCK_FS_TYPES = ("ext2", "ext3", "ext4", "xfs", "btrfs", "vfat")
ENCRYPTED_NAME = re.compile(r"crypt-[a-z0-9-]{1,64}")
OPTION = re.compile(r"[A-Za-z0-9_.=:/+@-]{1,256}")
# Where a volume never goes: the guest's kernel interfaces.
RESERVED = ("/proc", "/sys", "/dev")
# How long a disk is waited for when the call gives no deadline; with one,
# the wait ends this much before it, to answer in words of our own.
DISK_WAIT = 60.0
DEADLINE_MARGIN = 0.5


@dataclass(frozen=True)
class Volume:
    volume_id: str
    mount_point: str
    source: str        # what was mounted: /dev/vda, /dev/mapper/crypt-...
    fs_type: str
    readonly: bool
    options: tuple[str, ...]


def available_filesystems(modules_dir: str = MODULES_DIR) -> list[str]:
    """The block file systems this guest mounts: built in, or with modules listed in the image."""
    try:
        with open("/proc/filesystems") as f:
            known = {line.split()[-1] for line in f if line.strip()}
    except OSError:
        known = set()
    return [t for t in BLOCK_FS_TYPES if t in known or os.path.isfile(f"{modules_dir}/{t}")]


def wait_for(call) -> float:
    """How long a call waits for a disk: to just before its deadline."""
    timeout = getattr(call, "timeout", None)
    return DISK_WAIT if timeout is None else max(timeout - DEADLINE_MARGIN, 0.0)


def check_guest_path(field: str, path: str, reserved: tuple[str, ...] = RESERVED) -> str:
    """An absolute, normal path other than / and outside reserved, or
    INVALID_ARGUMENT naming the field."""
    if not path.startswith("/") or os.path.normpath(path) != path or path == "/" or "\0" in path:
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field}: {path!r} is not an absolute, normal path other than /")
    if any(path == top or path.startswith(top + "/") for top in reserved):
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field}: {path} is below {', '.join(reserved)}")
    return path


def _device_name(major: int, minor: int) -> str:
    """The kernel's name of a block device (vda, sdb, dm-0)."""
    return os.path.basename(os.path.realpath(f"/sys/dev/block/{major}:{minor}"))


def _device_bytes(entry: sysmount.MountEntry) -> int:
    try:
        return blockdev.size_of(entry.major, entry.minor)
    except (OSError, ValueError):
        return 0


def _fs_errors(name: str) -> int:
    try:
        with open(f"/sys/fs/ext4/{name}/errors_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def _readonly(entry: sysmount.MountEntry) -> bool:
    """The mount or its file system read-only (a remount of the super
    block, as the kernel makes after an error, shows in its options only)."""
    return entry.readonly or "ro" in entry.super_options


def _same_device(entry: sysmount.MountEntry, source: str) -> bool:
    try:
        st = os.stat(source)
    except OSError:
        return False
    return stat.S_ISBLK(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (entry.major, entry.minor)


def _unmount(volume: Volume) -> None:
    """The volume's mount, not lazily: a busy file system stays and says so."""
    try:
        sysmount.unmount_at(volume.mount_point)
    except OSError as exc:
        raise AgentError(ttrpc.FAILED_PRECONDITION, f"volume_id {volume.volume_id}: {exc.strerror}") from None


class Volumes:
    def __init__(self, disks: Disks, modules_dir: str = MODULES_DIR):
        self.disks = disks
        self.modules_dir = modules_dir
        self.mounted: dict[str, Volume] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # Bounded here, in the guest: a freeze whose thaw never comes (the
        # host's handler died, the call was lost) ends by its own timeout.
        self.freezes = FreezeBook(log)

    @property
    def capabilities(self) -> list[str]:
        return [caps.DISK_VIRTIO_BLK, caps.DISK_VIRTIO_SCSI, caps.VOLUME_GROW, caps.VOLUME_FREEZE,
                *(caps.fs(t) for t in available_filesystems(self.modules_dir))]

    def _lock(self, volume_id: str) -> asyncio.Lock:
        return self._locks.setdefault(volume_id, asyncio.Lock())

    def _known(self, volume_id: str) -> tuple[Volume, sysmount.MountEntry]:
        check_id("volume_id", volume_id)
        volume = self.mounted.get(volume_id)
        entry = sysmount.at(volume.mount_point) if volume is not None else None
        if volume is None or entry is None:
            raise AgentError(ttrpc.NOT_FOUND, f"volume_id {volume_id!r}: not mounted by this agent")
        return volume, entry

    def mount_point(self, field: str, volume_id: str) -> str:
        """Where a volume this agent mounted is."""
        check_id(field, volume_id)
        volume = self.mounted.get(volume_id)
        if volume is None or sysmount.at(volume.mount_point) is None:
            raise AgentError(ttrpc.NOT_FOUND, f"{field}: {volume_id!r} is not mounted by this agent (MountVolume)")
        return volume.mount_point

    def load_modules(self, fs_type: str, field: str = "storage.fs_type") -> None:
        if fs_type in available_filesystems(""):
            return
        try:
            with open(f"{self.modules_dir}/{fs_type}") as f:
                paths = [line.strip() for line in f if line.strip()]
        except OSError:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"{field}: this guest has no {fs_type}") from None
        for path in paths:
            name = os.path.basename(path).removesuffix(".ko")
            if not modules.loaded(name):
                try:
                    modules.load(path)
                except OSError as exc:
                    raise AgentError(ttrpc.FAILED_PRECONDITION, f"{field}: loading {path}: {exc}") from None

    async def _source(self, storage: agent_pb2.Storage, call) -> str:
        if storage.WhichOneof("device") == "encrypted":
            if not ENCRYPTED_NAME.fullmatch(storage.encrypted):
                raise AgentError(ttrpc.INVALID_ARGUMENT, f"storage.encrypted: {storage.encrypted!r} is not crypt- "
                                                        "then [a-z0-9-]")
            source = f"/dev/mapper/{storage.encrypted}"
            if not os.path.exists(source):
                raise AgentError(ttrpc.NOT_FOUND, f"storage.encrypted: no opened encrypted volume "
                                                 f"{storage.encrypted}")
            return source
        if storage.WhichOneof("device") != "disk":
            raise AgentError(ttrpc.INVALID_ARGUMENT, "storage.device: neither a disk nor an encrypted volume")
        check_disk("storage.disk", storage.disk)
        name = await self.disks.wait_present("storage.disk", storage.disk, wait_for(call))
        return f"{self.disks.dev}/{name}"

    def _check(self, storage: agent_pb2.Storage) -> tuple[str, ...]:
        check_id("storage.volume_id", storage.volume_id)
        check_guest_path("storage.mount_point", storage.mount_point)
        if storage.fs_type not in BLOCK_FS_TYPES:
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"storage.fs_type: {storage.fs_type!r} is not one of "
                                                    f"{', '.join(BLOCK_FS_TYPES)}")
        for i, option in enumerate(storage.options):
            if not OPTION.fullmatch(option) or option in ("ro", "rw"):
                raise AgentError(ttrpc.INVALID_ARGUMENT, f"storage.options[{i}]: {option!r} (no ro or rw, no "
                                                        "commas, [A-Za-z0-9_.=:/+@-])")
        return tuple(storage.options)

    async def mount(self, storage: agent_pb2.Storage, call) -> agent_pb2.MountVolumeResponse:
        options = self._check(storage)
        async with self._lock(storage.volume_id):
            source = await self._source(storage, call)
            wanted = Volume(storage.volume_id, storage.mount_point, source, storage.fs_type, storage.readonly,
                            options)
            known = self.mounted.get(storage.volume_id)
            if known is not None and known != wanted:
                raise AgentError(ttrpc.ALREADY_EXISTS, f"storage.volume_id: {storage.volume_id} is mounted with other "
                                                      f"parameters ({known.source} at {known.mount_point})")
            entry = sysmount.at(storage.mount_point)
            if entry is not None and not _same_device(entry, source):
                raise AgentError(ttrpc.ALREADY_EXISTS, f"storage.mount_point: {storage.mount_point} is already a "
                                                      f"mount of {entry.source}")
            if entry is None:
                await asyncio.to_thread(self._mount, wanted)
                entry = sysmount.at(storage.mount_point)
            self.mounted[storage.volume_id] = wanted
            walked = False
            if storage.HasField("fs_group") and not storage.readonly:
                walked = await asyncio.to_thread(self._fs_group, wanted, storage.fs_group)
            log.info("volume %s: %s (%s) mounted at %s", storage.volume_id, source, storage.fs_type,
                     storage.mount_point)
            return agent_pb2.MountVolumeResponse(device=_device_name(entry.major, entry.minor),
                                                 mount_point=storage.mount_point, fs_group_walked=walked)

    def _mount(self, volume: Volume) -> None:
        self.load_modules(volume.fs_type)
        os.makedirs(volume.mount_point, exist_ok=True)
        options = [*volume.options, "ro" if volume.readonly else "rw"]
        try:
            sysmount.mount_path(volume.source, volume.mount_point, volume.fs_type, options)
        except OSError as exc:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"storage: {exc.strerror or exc}") from None
        entry = sysmount.at(volume.mount_point)
        if entry is not None and _readonly(entry) and not volume.readonly:
            sysmount.unmount_all(volume.mount_point)
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"storage: {volume.source} could only be mounted read-only")

    @staticmethod
    def _fs_group(volume: Volume, group: agent_pb2.FsGroup) -> bool:
        policy = ownership.ON_ROOT_MISMATCH if group.policy == agent_pb2.FsGroup.ON_ROOT_MISMATCH else \
            ownership.ALWAYS
        fd = os.open(volume.mount_point, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            return ownership.apply_fs_group(fd, group.gid, policy)
        except OSError as exc:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"storage.fs_group: {exc}") from None
        finally:
            os.close(fd)

    def stats(self, volume_id: str) -> agent_pb2.VolumeStatsResponse:
        volume, entry = self._known(volume_id)
        st = os.statvfs(volume.mount_point)
        name = _device_name(entry.major, entry.minor)
        total, free = st.f_frsize * st.f_blocks, st.f_frsize * st.f_bfree
        errors = _fs_errors(name) if entry.fs_type == "ext4" else 0
        condition = agent_pb2.VolumeCondition(abnormal=False, message="mounted and healthy in the guest")
        readonly = _readonly(entry)
        if readonly and not volume.readonly:
            condition = agent_pb2.VolumeCondition(abnormal=True, message="the file system went read-only in the guest")
        elif errors:
            condition = agent_pb2.VolumeCondition(abnormal=True, message=f"the guest's ext4 reports {errors} errors")
        return agent_pb2.VolumeStatsResponse(
            total_bytes=total, free_bytes=free, available_bytes=st.f_frsize * st.f_bavail, used_bytes=total - free,
            inodes_total=st.f_files, inodes_free=st.f_ffree, inodes_used=st.f_files - st.f_ffree,
            readonly=readonly, fs_errors=errors, condition=condition, fs_type=entry.fs_type, device=name,
            device_bytes=_device_bytes(entry))

    async def grow(self, volume_id: str) -> agent_pb2.GrowVolumeResponse:
        async with self._lock(volume_id):
            volume, entry = self._known(volume_id)
            name = _device_name(entry.major, entry.minor)
            return await asyncio.to_thread(self._grow, volume, entry, name)

    @staticmethod
    def _grow(volume: Volume, entry: sysmount.MountEntry, name: str) -> agent_pb2.GrowVolumeResponse:
        rescan = f"/sys/block/{name}/device/rescan"
        if os.path.exists(rescan):
            # A SCSI disk's new capacity is read when asked; QEMU's notice
            # of it is handled in the background and must not be raced.
            with open(rescan, "w") as f:
                f.write("1")
        device_bytes = _device_bytes(entry)
        fd = os.open(volume.mount_point, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            growfs.grow(fd, volume.fs_type, device_bytes)
            st = os.fstatvfs(fd)
        except growfs.GrowError as exc:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"volume_id {volume.volume_id}: {exc}") from None
        finally:
            os.close(fd)
        return agent_pb2.GrowVolumeResponse(total_bytes=st.f_frsize * st.f_blocks, device_bytes=device_bytes)

    async def freeze(self, volume_id: str, timeout_seconds: int) -> agent_pb2.FreezeVolumeResponse:
        try:
            timeout = sysfreeze.timeout_of(timeout_seconds, "timeout_seconds")
        except ValueError as exc:
            raise AgentError(ttrpc.INVALID_ARGUMENT, str(exc)) from None
        async with self._lock(volume_id):
            volume, _ = self._known(volume_id)
            try:
                depth = await self.freezes.freeze(volume_id, timeout, lambda: sysfreeze.open_mount(volume.mount_point))
            except sysfreeze.FreezeError as exc:
                raise AgentError(ttrpc.FAILED_PRECONDITION, f"volume_id {volume_id}: {exc}") from None
            except OSError as exc:
                raise AgentError(ttrpc.FAILED_PRECONDITION, f"volume_id {volume_id}: {exc.strerror}") from None
        return agent_pb2.FreezeVolumeResponse(depth=depth)

    async def thaw(self, volume_id: str) -> agent_pb2.ThawVolumeResponse:
        check_id("volume_id", volume_id)
        depth, was_frozen = await self.freezes.thaw(volume_id)
        return agent_pb2.ThawVolumeResponse(depth=depth, was_frozen=was_frozen)

    async def unmount(self, volume_id: str) -> agent_pb2.UnmountVolumeResponse:
        check_id("volume_id", volume_id)
        async with self._lock(volume_id):
            volume = self.mounted.get(volume_id)
            if volume is None:
                return agent_pb2.UnmountVolumeResponse(unmounted=False, known=False)
            # A frozen file system would hang its unmount's sync.
            await self.freezes.thaw_all(volume_id, "unmounted")
            entry = sysmount.at(volume.mount_point)
            if entry is not None:
                await asyncio.to_thread(_unmount, volume)
            del self.mounted[volume_id]
            log.info("volume %s: unmounted from %s", volume_id, volume.mount_point)
            return agent_pb2.UnmountVolumeResponse(unmounted=entry is not None, known=True)
