"""Kubelet's volume manager for the volumes a pod brings along (emptyDir,
configMap, secret, projected, downwardAPI, hostPath), replayed from
kubelet's public source (pkg/volume/emptydir, configmap, secret, projected,
downwardapi, hostpath, util/atomic_writer.go, util/subpath, and the
subPath part of makeMounts in pkg/kubelet/kubelet_pods.go). CSI volumes are
crust.kubelet.csi's; the files an atomic-writer volume holds are
crust.kubelet.payloads'.

What it lays out below kubelet's root directory, for pod <uid>:

    pods/<uid>/                                     0750 (makePodDataDirs)
      volumes/kubernetes.io~empty-dir/<name>/        0777; medium Memory: a tmpfs
      volumes/kubernetes.io~configmap/<name>/        a directory on the node's disk
      volumes/kubernetes.io~secret/<name>/           a tmpfs
      volumes/kubernetes.io~projected/<name>/        a tmpfs
      volumes/kubernetes.io~downward-api/<name>/     a tmpfs
      plugins/kubernetes.io~empty-dir/<name>/ready   set once an emptyDir is set up
      plugins/kubernetes.io~empty-dir/wrapped_<name>/ready
                                                    the emptyDir under a configMap,
                                                    secret, projected or downwardAPI volume
      volume-subpaths/<volume>/<container>/<index>   a bind of one subPath (0750 dirs,
                                                    an empty 0640 file for a file)

- emptyDir: the directory made 0777 (chmod whatever the umask); medium
  Memory mounts a tmpfs there with size= the smallest of the node's
  allocatable memory (capacity less the 100 Mi hard eviction threshold),
  the pod's memory limit (none here: pods are BestEffort) and the volume's
  sizeLimit, and noswap where the kernel takes it (6.4 and later, else
  probed once); then the pod's fsGroup (group, g+rw, setgid on
  directories); then the ready file. Set up again: nothing (ready file,
  and for Memory the tmpfs, in place).
- configMap, secret, projected, downwardAPI: an emptyDir (medium Memory
  but for configMap) under the name wrapped_<name>, the mount points of
  volumes nested under this one's mount paths made (0755), then the
  payload through the atomic writer (crust.kubelet.atomic_writer), the
  fsGroup applied read-only (g+r) to the new version before ..data is
  switched; a failed write tears the volume down. Files get the item's
  mode, else the volume's defaultMode (0644). A projected service-account
  token is 0600 when the pod has an fsGroup or a single runAsUser, owned by
  that user. These volumes are written again at every set up (kubelet
  remounts them on each pod sync): that is how updates reach the pod.
- hostPath: the path checked (no "..") and its type: DirectoryOrCreate
  makes it (0755), FileOrCreate an empty file (0644, no parents), the
  others only check. Nothing is made below kubelet's root, nothing removed.
- subPath (makeMounts): absolute or ".." refused; a missing subPath is made
  as directories with the volume directory's mode, one level at a time
  without following links; then the path (symlinks resolved once, e.g. a
  configMap key) must lie inside the volume, is opened component by
  component without following links, and bound (a plain bind, not
  recursive) onto pods/<uid>/volume-subpaths/<volume>/<container>/<index>,
  which the container's mount then names. A bind already there of the
  same file is reused. The bind holds the file it was made from: a
  configMap update does not reach a subPath mount (as with kubelet).
- tear down: each volume's subPath binds unmounted and their directories
  removed; an emptyDir's ready directory removed, its tmpfs unmounted, its
  directory removed without crossing into another file system (something
  mounted inside is an error, never deleted through). clean_pod_dir
  removes the pod's directory once no volume directory and no subPath
  directory is left, as kubelet's housekeeping does.
"""

from __future__ import annotations

import errno
import os
import platform
import shutil
import stat
import tempfile
from pathlib import Path

from crust.kubelet import payloads
from crust.kubelet.atomic_writer import AtomicWriter, PayloadError
from crust.kubelet.payloads import VolumeError
from crust.kubelet.pod import (
    ConfigMap,
    Container,
    DownwardAPI,
    EmptyDir,
    HostPath,
    PersistentVolume,
    Pod,
    Projected,
    Secret,
    ServiceAccountToken,
    VolumeMount,
    VolumeSource,
)
from crust.sys import mount as sysmount
from crust.sys import ownership

EMPTY_DIR = "kubernetes.io~empty-dir"
CONFIG_MAP = "kubernetes.io~configmap"
SECRET = "kubernetes.io~secret"
PROJECTED = "kubernetes.io~projected"
DOWNWARD_API = "kubernetes.io~downward-api"
SUBPATHS = "volume-subpaths"
READY = "ready"
WRAPPED = "wrapped_"
POD_DIR_MODE = 0o750
EMPTY_DIR_MODE = 0o777
NESTED_MOUNT_POINT_MODE = 0o755
SUBPATH_DIR_MODE = 0o750
SUBPATH_FILE_MODE = 0o640
HOST_PATH_DIR_MODE = 0o755
HOST_PATH_FILE_MODE = 0o644
# The default hard eviction threshold (memory.available<100Mi) is the
# only reservation of a default kubelet: allocatable = capacity - 100 Mi.
HARD_EVICTION_MEMORY = 100 * 1024**2
NOSWAP_KERNEL = (6, 4)
HOST_PATH_TYPES = ("", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice",
                   "BlockDevice")
PLUGIN_DIRS = {EmptyDir: EMPTY_DIR, ConfigMap: CONFIG_MAP, Secret: SECRET, Projected: PROJECTED,
               DownwardAPI: DOWNWARD_API}
# The medium of the emptyDir under each atomic-writer volume: only a
# configMap stays on the node's disk.
WRAPPED_MEDIUM = {ConfigMap: "", Secret: "Memory", Projected: "Memory", DownwardAPI: "Memory"}


def node_allocatable_memory() -> int:
    """The node's allocatable memory for a default kubelet: MemTotal (what
    cAdvisor reports as capacity) less the hard eviction threshold."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 - HARD_EVICTION_MEMORY
    raise VolumeError("no MemTotal in /proc/meminfo")


def kernel_at_least(wanted: tuple[int, int]) -> bool:
    numbers = []
    for part in platform.release().split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        numbers.append(int(digits))
    return tuple(numbers) >= wanted


def _within(path: str, base: str) -> bool:
    """mount.PathWithinBase: path is base or below it."""
    relative = os.path.relpath(path, base)
    return relative != ".." and not relative.startswith("../")


def _open_beneath(base: str, relative: str) -> int:
    """doSafeOpen: an O_PATH descriptor of base/relative, reached one
    component at a time, none of them a symlink."""
    fd = os.open(base, os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [p for p in relative.split("/") if p and p != "."]:
            child = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = child
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise VolumeError(f"unexpected symlink found {os.path.join(base, relative)}")
        return fd
    except BaseException:
        os.close(fd)
        raise


def remove_all_one_filesystem(path: Path) -> None:
    """Remove path and everything below it, but never through a mount:
    when anything is mounted there or below (another file system, a bind
    of the same one), nothing is removed and the error names the mount
    (kubelet's removeall.RemoveAllOneFilesystem refuses to cross one too)."""
    if not os.path.lexists(path):
        return
    top = os.path.normpath(path)
    mounted = sorted(m.mount_point for m in sysmount.mounts()
                     if m.mount_point == top or m.mount_point.startswith(top + "/"))
    if mounted:
        raise VolumeError(f"cannot delete directory {mounted[0]}: it is a mount point")
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


class VolumeManager:
    """The pod volumes of one kubelet whose root directory is `root`."""

    def __init__(self, root: Path, *, allocatable_memory: int | None = None):
        self.root = root
        self.allocatable_memory = allocatable_memory
        self._noswap: bool | None = None

    # -- paths ----------------------------------------------------------------------------

    def pod_dir(self, pod: Pod) -> Path:
        return self.root / "pods" / pod.uid

    def path(self, pod: Pod, name: str) -> Path:
        """GetPath: where the volume is on the node (a hostPath's own path)."""
        source = self._source(pod, name)
        if isinstance(source, HostPath):
            return Path(source.path)
        return self.pod_dir(pod) / "volumes" / PLUGIN_DIRS[type(source)] / name

    def ready_file(self, pod: Pod, name: str) -> Path:
        """The emptyDir's ready file (for a wrapped emptyDir, wrapped_<name>)."""
        wrapped = not isinstance(self._source(pod, name), EmptyDir)
        return self.pod_dir(pod) / "plugins" / EMPTY_DIR / ((WRAPPED if wrapped else "") + name) / READY

    def subpath_dir(self, pod: Pod, volume: str | None = None) -> Path:
        base = self.pod_dir(pod) / SUBPATHS
        return base / volume if volume else base

    @staticmethod
    def _source(pod: Pod, name: str) -> VolumeSource:
        source = pod.volumes.get(name)
        if source is None:
            raise VolumeError(f'pod {pod.name} has no volume "{name}"')
        if isinstance(source, PersistentVolume):
            raise VolumeError(f'volume "{name}" is a CSI volume: crust.kubelet.csi sets it up')
        return source

    @staticmethod
    def read_only(source: VolumeSource) -> bool:
        """GetAttributes().ReadOnly: the runtime must mount it read-only."""
        return isinstance(source, (ConfigMap, Secret, Projected, DownwardAPI))

    # -- set up -------------------------------------------------------------------------------

    def make_pod_data_dirs(self, pod: Pod) -> None:
        for path in (self.pod_dir(pod), self.pod_dir(pod) / "volumes", self.pod_dir(pod) / "plugins"):
            path.mkdir(mode=POD_DIR_MODE, parents=True, exist_ok=True)

    def set_up(self, pod: Pod) -> None:
        """The volume manager before the pod's containers start (and at each
        later sync): every volume but the CSI ones set up, or set up again."""
        self.make_pod_data_dirs(pod)
        for name, source in pod.volumes.items():
            if not isinstance(source, PersistentVolume):
                self.set_up_volume(pod, name)

    def set_up_volume(self, pod: Pod, name: str) -> None:
        """MountVolume.SetUp of one volume."""
        source = self._source(pod, name)
        try:
            if isinstance(source, EmptyDir):
                self._empty_dir(pod, self.path(pod, name), self.ready_file(pod, name).parent, source.medium,
                                source.size_limit)
            elif isinstance(source, HostPath):
                self._host_path(source)
            else:
                self._atomic_volume(pod, name, source)
        except (OSError, PayloadError, VolumeError) as exc:
            raise VolumeError(f'MountVolume.SetUp failed for volume "{name}" : {exc}') from exc

    def update_config_map(self, pod: Pod, name: str, data: dict[str, str],
                          binary_data: dict[str, bytes] | None = None) -> None:
        """The configMap changed in the API: the volume is written again
        (a new version through the atomic writer)."""
        source = self._source(pod, name)
        if not isinstance(source, ConfigMap):
            raise VolumeError(f'volume "{name}" is not a configMap volume')
        source.data = dict(data)
        if binary_data is not None:
            source.binary_data = dict(binary_data)
        self.set_up_volume(pod, name)

    def update_secret(self, pod: Pod, name: str, data: dict[str, bytes]) -> None:
        source = self._source(pod, name)
        if not isinstance(source, Secret):
            raise VolumeError(f'volume "{name}" is not a secret volume')
        source.data = dict(data)
        self.set_up_volume(pod, name)

    def rotate_token(self, pod: Pod, name: str, token: str) -> None:
        """Kubelet's token manager got a fresh token (it asks at 80% of the
        old one's life): the projected volume is written again."""
        source = self._source(pod, name)
        tokens = [s for s in source.sources if isinstance(s, ServiceAccountToken)] \
            if isinstance(source, Projected) else []
        if not tokens:
            raise VolumeError(f'volume "{name}" has no service-account token')
        for projection in tokens:
            projection.token = token
        self.set_up_volume(pod, name)

    def _empty_dir(self, pod: Pod, directory: Path, meta: Path, medium: str, size_limit: int | None) -> None:
        if (meta / READY).is_file():
            if medium == "Memory" and self._tmpfs_at(directory):
                return
            if medium == "":
                if directory.is_dir():
                    return
                shutil.rmtree(meta, ignore_errors=True)  # the directory went: set it up anew
        if medium not in ("", "Memory"):
            raise VolumeError(f'unknown storage medium "{medium}"')
        directory.mkdir(mode=EMPTY_DIR_MODE, parents=True, exist_ok=True)
        if stat.S_IMODE(os.lstat(directory).st_mode) != EMPTY_DIR_MODE:
            os.chmod(directory, EMPTY_DIR_MODE)
        if medium == "Memory" and not self._tmpfs_at(directory):
            sysmount.mount_path("tmpfs", str(directory), "tmpfs", self._tmpfs_options(size_limit))
        self._apply_fs_group(pod, directory, readonly=False)
        meta.mkdir(mode=0o750, parents=True, exist_ok=True)
        (meta / READY).touch()

    @staticmethod
    def _tmpfs_at(directory: Path) -> bool:
        entry = sysmount.at(str(directory))
        return entry is not None and entry.fs_type == "tmpfs"

    def _tmpfs_options(self, size_limit: int | None) -> list[str]:
        size = self.allocatable_memory if self.allocatable_memory is not None else node_allocatable_memory()
        if size_limit is not None and 0 < size_limit <= size:
            size = size_limit
        options = [f"size={size}"]
        if self._noswap_supported():
            options.append("noswap")
        return options

    def _noswap_supported(self) -> bool:
        """swap.IsTmpfsNoswapOptionSupported: kernel 6.4 or later, else a
        tmpfs mounted with noswap once, in a scratch directory."""
        if self._noswap is None:
            if kernel_at_least(NOSWAP_KERNEL):
                self._noswap = True
            else:
                plugin_dir = self.root / "plugins" / EMPTY_DIR
                plugin_dir.mkdir(parents=True, exist_ok=True)
                probe = tempfile.mkdtemp(prefix="tmpfs-noswap-test-", dir=plugin_dir)
                try:
                    sysmount.mount_path("tmpfs", probe, "tmpfs", ["noswap"])
                    sysmount.unmount_all(probe)
                    self._noswap = True
                except OSError:
                    self._noswap = False
                finally:
                    os.rmdir(probe)
        return self._noswap

    def _apply_fs_group(self, pod: Pod, directory: Path, readonly: bool) -> None:
        """SetVolumeOwnership with the pod's fsGroup (nothing without one)."""
        if pod.fs_group is None:
            return
        fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            ownership.apply_fs_group(fd, pod.fs_group, readonly=readonly)
        finally:
            os.close(fd)

    @staticmethod
    def _host_path(source: HostPath) -> None:
        if ".." in source.path.split("/"):
            raise VolumeError(f"invalid HostPath `{source.path}`: must not contain '..'")
        kind = source.type
        if kind not in HOST_PATH_TYPES:
            raise VolumeError(f"{kind} is an invalid volume type")
        path = source.path
        exists = os.path.exists(path)
        if kind == "DirectoryOrCreate" and not exists:
            os.makedirs(path, HOST_PATH_DIR_MODE, exist_ok=True)
            return
        if kind == "FileOrCreate" and not exists:
            os.close(os.open(path, os.O_CREAT | os.O_RDONLY | os.O_CLOEXEC, HOST_PATH_FILE_MODE))
            return
        mode = os.stat(path).st_mode if exists else 0
        checks = {"DirectoryOrCreate": (stat.S_ISDIR(mode), "a directory"),
                  "Directory": (stat.S_ISDIR(mode), "a directory"),
                  "FileOrCreate": (exists and not stat.S_ISDIR(mode), "a file"),
                  "File": (exists and not stat.S_ISDIR(mode), "a file"),
                  "Socket": (stat.S_ISSOCK(mode), "a socket file"),
                  "CharDevice": (stat.S_ISCHR(mode), "a character device"),
                  "BlockDevice": (stat.S_ISBLK(mode), "a block device")}
        if kind and not checks[kind][0]:
            raise VolumeError(f"hostPath type check failed: {path} is not {checks[kind][1]}")

    # -- configMap, secret, projected, downwardAPI ------------------------------------------------

    def _atomic_volume(self, pod: Pod, name: str, source: ConfigMap | Secret | Projected | DownwardAPI) -> None:
        payload = payloads.payload(pod, source)
        directory = self.path(pod, name)
        self._empty_dir(pod, directory, self.ready_file(pod, name).parent, WRAPPED_MEDIUM[type(source)], None)
        self._make_nested_mount_points(pod, name, directory)
        done = False
        try:
            AtomicWriter(directory).write(
                payload, set_perms=lambda _version: self._apply_fs_group(pod, directory, readonly=True))
            done = True
        finally:
            if not done:
                self._tear_down_volume(pod, name)

    @staticmethod
    def _make_nested_mount_points(pod: Pod, name: str, directory: Path) -> None:
        """MakeNestedMountpoints: where another volume is mounted below this
        read-only one in a container, its mount point is made here (the
        runtime could not make it in a read-only volume)."""
        for container in pod.all_containers():
            every = sorted(os.path.normpath(m.mount_path) for m in container.volume_mounts)
            for own in [os.path.normpath(m.mount_path) for m in container.volume_mounts if m.name == name]:
                if own.startswith("../"):
                    raise VolumeError(f"invalid container mount point {own}")
                nested: list[str] = []
                for point in every:
                    if not point.startswith(own + "/") or any(point.startswith(n) for n in nested):
                        continue
                    nested.append(point + "/")
                    (directory / point[len(own) + 1:]).mkdir(mode=NESTED_MOUNT_POINT_MODE, parents=True,
                                                              exist_ok=True)

    # -- subPath ----------------------------------------------------------------------------------

    def mount_source(self, pod: Pod, container: Container, index: int, volume_mount: VolumeMount) -> Path:
        """makeMounts for one volume mount: the host path the runtime binds
        (with a subPath: its bind under volume-subpaths)."""
        volume_path = self.path(pod, volume_mount.name)
        sub_path = volume_mount.sub_path
        if not sub_path:
            return volume_path
        if sub_path.startswith("/"):
            raise VolumeError(f"error SubPath `{sub_path}` must not be an absolute path")
        if ".." in sub_path.split("/"):
            raise VolumeError(f"unable to provision SubPath `{sub_path}`: must not contain '..'")
        host_path = Path(os.path.normpath(volume_path / sub_path))
        if not host_path.exists():
            try:
                self._safe_make_dir(sub_path, volume_path, stat.S_IMODE(os.stat(volume_path).st_mode))
            except (OSError, VolumeError) as exc:
                raise VolumeError(f'failed to create subPath directory for volumeMount "{volume_mount.name}" '
                                  f'of container "{container.name}"') from exc
        try:
            return self._bind_subpath(pod, container.name, index, volume_mount.name, volume_path, host_path)
        except (OSError, VolumeError) as exc:
            raise VolumeError(f'failed to prepare subPath for volumeMount "{volume_mount.name}" '
                              f'of container "{container.name}"') from exc

    @staticmethod
    def _safe_make_dir(sub_path: str, base: Path, mode: int) -> None:
        """SafeMakeDir: the missing directories of sub_path made inside the
        volume, each opened without following a link before the next, each
        given the volume directory's mode (mkdirat is cut by the umask)."""
        real_base = os.path.realpath(base)
        parts = [p for p in os.path.normpath(sub_path).split("/") if p and p != "."]
        existing = 0
        while existing < len(parts) and os.path.exists(os.path.join(real_base, *parts[:existing + 1])):
            existing += 1
        real_existing = os.path.realpath(os.path.join(real_base, *parts[:existing]))
        if not _within(real_existing, real_base):
            raise VolumeError(f"path {real_existing} is outside of allowed base {real_base}")
        if existing == len(parts):
            if not os.path.isdir(real_existing):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", real_existing)
            return
        fd = _open_beneath(real_base, os.path.relpath(real_existing, real_base))
        try:
            for part in parts[existing:]:
                os.mkdir(part, mode, dir_fd=fd)
                child = os.open(part, os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = child
                os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def _bind_subpath(self, pod: Pod, container: str, index: int, volume: str, volume_path: Path,
                      path: Path) -> Path:
        real_volume = os.path.realpath(volume_path)
        real_path = os.path.realpath(path)
        if not _within(real_path, real_volume):
            raise VolumeError(f"subpath {real_path!r} not within volume path {real_volume!r}")
        target = self.subpath_dir(pod, volume) / container / str(index)
        source_fd = _open_beneath(real_volume, os.path.relpath(real_path, real_volume))
        try:
            if sysmount.at(str(target)) is not None:
                mine, theirs = os.lstat(real_path), os.lstat(target)
                if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino):
                    return target  # bound already (the container started before)
                sysmount.unmount_all(str(target))
            target.parent.mkdir(mode=SUBPATH_DIR_MODE, parents=True, exist_ok=True)
            if stat.S_ISDIR(os.fstat(source_fd).st_mode):
                target.mkdir(mode=SUBPATH_DIR_MODE, exist_ok=True)
            else:
                os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, SUBPATH_FILE_MODE))
            target_fd = os.open(target, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                sysmount.bind_fd(source_fd, target_fd)
            except OSError:
                self._clean_subpath(target)
                raise
            finally:
                os.close(target_fd)
        finally:
            os.close(source_fd)
        return target

    @staticmethod
    def _clean_subpath(target: Path) -> None:
        """CleanupMountPoint: unmount what is bound there, then remove it."""
        if sysmount.at(str(target)) is not None:
            sysmount.unmount_all(str(target))
        if sysmount.at(str(target)) is not None:
            raise VolumeError(f"{target} is still mounted")
        if target.is_dir() and not target.is_symlink():
            target.rmdir()
        else:
            target.unlink(missing_ok=True)

    def clean_subpaths(self, pod: Pod, volume: str) -> None:
        """CleanSubPaths: every subPath bind of the volume, of every container."""
        volume_dir = self.subpath_dir(pod, volume)
        if not volume_dir.is_dir():
            return
        for container_dir in sorted(p for p in volume_dir.iterdir() if p.is_dir() and not p.is_symlink()):
            for entry in sorted(container_dir.iterdir()):
                self._clean_subpath(entry)
            container_dir.rmdir()
        volume_dir.rmdir()
        try:
            self.subpath_dir(pod).rmdir()
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise

    # -- tear down ------------------------------------------------------------------------------

    def tear_down(self, pod: Pod) -> None:
        """The volume manager once the pod's containers are gone: each
        volume's subPath binds, then the volume (CSI volumes excepted)."""
        errors = []
        for name, source in pod.volumes.items():
            if isinstance(source, PersistentVolume):
                continue
            try:
                self.clean_subpaths(pod, name)
                self._tear_down_volume(pod, name)
            except (OSError, VolumeError) as exc:
                errors.append(f'UnmountVolume.TearDown failed for volume "{name}" : {exc}')
        if errors:
            raise VolumeError("; ".join(errors))

    def _tear_down_volume(self, pod: Pod, name: str) -> None:
        """emptyDir's TearDownAt (the atomic-writer volumes tear down through
        their emptyDir too); a hostPath has nothing to undo."""
        if isinstance(self._source(pod, name), HostPath):
            return
        shutil.rmtree(self.ready_file(pod, name).parent, ignore_errors=True)
        directory = self.path(pod, name)
        if not directory.exists():
            return
        if self._tmpfs_at(directory):
            parent = os.open(directory.parent, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                sysmount.unmount_beneath(parent, directory.name)
            finally:
                os.close(parent)
        remove_all_one_filesystem(directory)

    def clean_pod_dir(self, pod: Pod) -> bool:
        """Housekeeping of a deleted pod (cleanupOrphanedPodDirs): empty
        volume directories removed; then, when none is left and no subPath
        directory is, the pod's directory without crossing a mount. False:
        something is still there, the directory stays."""
        pod_dir = self.pod_dir(pod)
        if not pod_dir.is_dir():
            return True
        volumes = pod_dir / "volumes"
        left = []
        for volume in sorted(volumes.glob("*/*")) if volumes.is_dir() else []:
            try:
                volume.rmdir()
            except OSError:
                left.append(volume)
        if left or self.subpath_dir(pod).exists():
            return False
        remove_all_one_filesystem(pod_dir)
        return True

