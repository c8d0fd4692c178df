"""The Sandbox interface a runtime implements, and the light one crust ships:
a private mount namespace.

A handler drives any sandbox through the same steps: start, attach a
device, mount it at a sandbox-private mount point, apply fsGroup, give each
container its view (bind, optionally a subpath), run the process, measure,
grow, unmount, detach, stop. A microVM runtime implements the same methods
with virtio-blk and a guest agent (examples/kata).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from crust.api import csi_pb2
from crust.common import copath
from crust.common.atomicfile import write_atomic
from crust.common.errors import FailedPrecondition, InvalidArgument
from crust.common.private import make_dirs, open_new
from crust.runtime_handler.freeze_holder import Freezer
from crust.sys import freeze as sysfreeze
from crust.sys import mount as sysmount
from crust.sys import netns, ownership, proc
from crust.sys.run import CommandError, run

Usage = csi_pb2.VolumeUsage


@dataclass
class VolumeStats:
    usage: list[csi_pb2.VolumeUsage]
    condition: csi_pb2.VolumeCondition


class Sandbox(abc.ABC):
    """One pod sandbox. Mount points are paths in the sandbox's own view."""

    id: str

    @property
    @abc.abstractmethod
    def pid(self) -> int:
        """A process that lives exactly as long as the sandbox."""

    @property
    def identity(self) -> proc.ProcessId | None:
        """That process named for good (pid and start time), recorded with
        the sandbox: after a restart the handler adopts and signals only
        this very process, never whatever reuses its pid."""
        return proc.identify(self.pid)

    def recognise(self, process: proc.ProcessId) -> bool:
        """Whether that process, named in the sandbox's record, is the
        sandbox's own by what the kernel says of it now (not only by its
        pid and start time, which a record can copy from any process)."""
        return proc.alive(process)

    @abc.abstractmethod
    async def start(self) -> None: ...

    async def adopt(self, devices: list[str], process_pid: int) -> None:
        """After a handler restart, take over a sandbox that survived it (its
        attached devices and its process); nothing to do by default."""

    @abc.abstractmethod
    async def attach(self, device: str) -> str:
        """Make the host device reachable inside; returns its path inside."""

    @abc.abstractmethod
    async def mount(self, device: str, fs_type: str, options: list[str], readonly: bool, mount_point: str,
                    fs_group: tuple[int, str] | None = None) -> None:
        """Mount the file system at mount_point; with fs_group (gid, and
        Kubernetes' change policy: Always or OnRootMismatch), give the tree
        that group as kubelet does."""

    async def open_encrypted(self, device: str, scheme: str, fs_type: str, passphrase: bytearray,
                             name: str, *, integrity: str = "", size_bytes: int = 0) -> str:
        """Open an encrypted volume inside the sandbox (formatting a blank
        one, authenticated when integrity names a mode); returns what
        mount() takes for it. Only a sandbox with its own kernel (a VM
        guest) can: the host's kernel must never see the key. size_bytes:
        the device's, for how long a first format may take."""
        raise FailedPrecondition(f"{type(self).__name__} does not open encrypted volumes ({scheme})")

    async def close_encrypted(self, name: str) -> None:
        """Close what open_encrypted opened (after unmount; idempotent)."""

    @abc.abstractmethod
    async def bind(self, source: str, destination: str, readonly: bool) -> None:
        """Give a container a view of a path (a mount point or a subpath of one)."""

    @abc.abstractmethod
    async def check_subpath(self, mount_point: str, subpath: str) -> None:
        """Refuse a subpath that leaves the volume ('..', a symlink on the way)."""

    async def bind_volume(self, mount_point: str, subpath: str, destination: str, readonly: bool) -> None:
        """Give a container its view of a mounted volume, or of a subpath of
        it. The subpath lives in the volume, which the workload writes: a
        sandbox whose host could be reached through a link planted there
        must bind what it checked, not check and then bind a path string
        (the mount-namespace sandbox overrides this to do exactly that)."""
        if subpath:
            await self.check_subpath(mount_point, subpath)
        await self.bind(mount_point + (f"/{subpath}" if subpath else ""), destination, readonly)

    @abc.abstractmethod
    async def stats(self, mount_point: str, readonly: bool, device: str = "") -> VolumeStats:
        """The volume's usage and condition; device: the host's block
        device it was attached from (a VM's guest is checked against it)."""

    @abc.abstractmethod
    async def grow(self, fs_type: str, device: str, mount_point: str, encrypted: str = "") -> None:
        """The mounted file system grown to its grown device; encrypted:
        the name of the opened encrypted volume it is mounted from, whose
        mapping grows first."""

    async def freeze(self, mount_point: str, timeout: int) -> int:
        """Freeze the volume's file system where the sandbox mounted it, for
        at most timeout seconds (the sandbox thaws it by itself then);
        freezes nest. The depth now."""
        raise FailedPrecondition(f"sandbox {self.id} cannot freeze a file system")

    async def thaw(self, mount_point: str) -> tuple[int, bool]:
        """Undo one freeze: (the depth left, whether it was still frozen)."""
        return 0, False

    @abc.abstractmethod
    async def unmount(self, mount_point: str) -> None: ...

    @abc.abstractmethod
    async def detach(self, device: str) -> None: ...

    @abc.abstractmethod
    async def run_process(self, args: list[str], env: list[str], cwd: str, log_path: Path) -> int:
        """Start the container process; returns its pid."""

    @abc.abstractmethod
    def process_exit_code(self) -> int | None: ...

    @abc.abstractmethod
    async def stop_process(self) -> None:
        """Stop the container process (before volumes are unmounted)."""

    @abc.abstractmethod
    def alive(self) -> bool: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...


# How long a stop waits for a holder an earlier handler started to end
# after its SIGKILL (one in uninterruptible sleep takes longer).
HOLDER_END_WAIT = 10.0
# Host directories a light container sees read-only (its "image").
IMAGE_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "usr", "etc")


class MountNamespaceSandbox(Sandbox):
    """A private mount namespace and its own network namespace (loopback
    only, crust.sys.netns), held open by a `sleep` process.

    Volumes are mounted inside the namespace only: the host's mount table
    never shows them. The container's root is the bundle's rootfs with the
    host's system directories bound read-only (a light image), plus its
    mounts; the process runs chrooted there.
    """

    def __init__(self, sandbox_id: str, workdir: Path, rootfs: Path | None = None,
                 holder: proc.ProcessId | None = None):
        self.id = sandbox_id
        self.workdir = workdir
        self.rootfs = rootfs
        self._holder: subprocess.Popen | None = None
        # The holder an earlier handler process started (from the record).
        self._recorded_holder = holder
        self._process: subprocess.Popen | None = None
        self.netns = netns.name_for(workdir)
        self.freezer = Freezer()

    @property
    def pid(self) -> int:
        if self._holder is not None:
            return self._holder.pid
        return self._recorded_holder.pid if self._recorded_holder is not None else 0

    @property
    def identity(self) -> proc.ProcessId | None:
        if self._holder is not None:
            return proc.identify(self._holder.pid)  # our child, not reaped: its pid is its own
        return self._recorded_holder

    def recognise(self, process: proc.ProcessId) -> bool:
        """The holder lives in the sandbox's named network namespace and in
        a mount namespace of its own: a `sleep infinity` elsewhere, with the
        same command line, is not it."""
        return (proc.alive(process) and netns.is_in(self.netns, process.pid)
                and _mount_namespace(process.pid) not in (None, _mount_namespace(os.getpid())))

    def root_view(self, path: str) -> str:
        """A sandbox path as reachable from the host, through the namespace."""
        return f"/proc/{self.pid}/root{path}"

    async def ns(self, *argv: str, **kw):
        return await run(["nsenter", f"--target={self.pid}", "--mount", "--", *argv], **kw)

    async def start(self) -> None:
        make_dirs(self.workdir)
        self._holder = subprocess.Popen(
            ["unshare", "--mount", "--net", "--propagation", "slave", "--", "sleep", "infinity"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        mine = os.readlink("/proc/self/ns/mnt")
        for _ in range(200):
            try:
                if os.readlink(f"/proc/{self.pid}/ns/mnt") != mine:
                    break
            except FileNotFoundError:
                pass
            await asyncio.sleep(0.005)
        else:
            raise FailedPrecondition(f"sandbox {self.id}: the mount namespace did not come up")
        # Named (and its loopback up) once the holder is in it: nothing forks here.
        await asyncio.to_thread(netns.attach, self.netns, self.pid)
        if self.rootfs is not None:
            await self._prepare_rootfs()

    async def _prepare_rootfs(self) -> None:
        root = self.rootfs
        # Mount points in the runtime's bundle, seen by the container: 0755.
        make_dirs(root, 0o755)
        for name in IMAGE_DIRS:
            host = Path("/") / name
            if host.is_symlink():
                # usr-merged hosts: /bin -> usr/bin; keep the link in the image.
                link = root / name
                if not link.exists() and not link.is_symlink():
                    link.symlink_to(os.readlink(host))
                continue
            if host.is_dir():
                make_dirs(root / name, 0o755)
                await self.ns("mount", "--bind", str(host), str(root / name))
                await self.ns("mount", "-o", "remount,bind,ro", str(root / name))
        for name, fstype in (("dev", None), ("tmp", "tmpfs"), ("proc", None)):
            make_dirs(root / name, 0o755)
            if fstype:
                await self.ns("mount", "-t", fstype, "-o", "mode=1777", fstype, str(root / name))
            else:
                await self.ns("mount", "--rbind", f"/{name}", str(root / name))

    async def attach(self, device: str) -> str:
        # Same kernel, private mount table: the host device node is usable as is.
        return device

    async def mount(self, device, fs_type, options, readonly, mount_point, fs_group=None) -> None:
        make_dirs(mount_point)  # empty on the host
        opts = list(options) + (["ro"] if readonly else [])
        if fs_type == "xfs" and "nouuid" not in opts:
            opts.append("nouuid")
        argv = ["mount", "-t", fs_type] + (["-o", ",".join(opts)] if opts else []) + ["--", device, mount_point]
        await self.ns(*argv)
        if fs_group is not None:
            await asyncio.to_thread(apply_fs_group, self.root_view(mount_point), *fs_group)

    async def bind(self, source: str, destination: str, readonly: bool) -> None:
        # The source comes from the runtime's own bundle: it is trusted as
        # written (links included). The destination is reached inside the
        # container's root without following a link (an image may carry any).
        with self._namespace_root() as ns_root:
            try:
                # Relative to the namespace's root: an absolute path would
                # ignore dir_fd and name the handler's own (host) view.
                source_fd = os.open(source.lstrip("/") or ".", os.O_PATH | os.O_CLOEXEC, dir_fd=ns_root)
            except OSError as exc:
                raise FailedPrecondition(f"sandbox {self.id}: bind source {source!r}: {exc.strerror}") from None
            try:
                await self._bind_fd(ns_root, source_fd, destination, readonly)
            finally:
                os.close(source_fd)

    async def bind_volume(self, mount_point: str, subpath: str, destination: str, readonly: bool) -> None:
        if subpath and (subpath.startswith("/") or ".." in subpath.split("/")):
            raise InvalidArgument(f"subpath {subpath!r} escapes the volume")
        path = os.path.join(mount_point, subpath) if subpath else mount_point
        with self._namespace_root() as ns_root:
            # Walked from inside the namespace (where the volume is mounted)
            # without following a link, and bound through the descriptor
            # the walk ended on: no swap between the check and the bind.
            try:
                with copath.reach(path, "subpath", root_fd=ns_root) as source:
                    if source.lstat() is None:
                        raise InvalidArgument(f"subpath {subpath!r} does not exist in the volume")
                    with source.opened() as source_fd:
                        await self._bind_fd(ns_root, source_fd, destination, readonly)
            except InvalidArgument as exc:
                if exc.message.startswith("subpath") and "symlink" in exc.message:
                    raise InvalidArgument(f"subpath {subpath!r} goes through a symlink inside the volume") from None
                raise

    @contextlib.contextmanager
    def _namespace_root(self):
        """The sandbox's "/" as a descriptor the handler can walk from."""
        fd = os.open(f"/proc/{self.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    async def _bind_fd(self, ns_root: int, source_fd: int, destination: str, readonly: bool) -> None:
        root = str(self.rootfs) if self.rootfs is not None else ""
        rootfs_fd = os.open(root.lstrip("/"), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=ns_root) \
            if root.strip("/") else os.dup(ns_root)
        try:
            with copath.reach(destination, "destination", create_parents=True, root_fd=rootfs_fd) as target:
                if stat.S_ISDIR(os.fstat(source_fd).st_mode):
                    target.mkdir(0o755)
                else:
                    target.make_file(0o644)
                with target.opened() as target_fd:
                    await self.ns("mount", "--no-canonicalize", "--bind", "--", sysmount.fd_path(source_fd),
                                  sysmount.fd_path(target_fd), pass_fds=(source_fd, target_fd))
                if readonly:
                    await self._remount_readonly(target, source_fd)
        finally:
            os.close(rootfs_fd)

    async def _remount_readonly(self, target: copath.CoPath, source_fd: int) -> None:
        """Make the bind just made read-only. Its root is reopened through
        the pinned parent; it must be the source we bound (same device and
        inode), or the bind is undone."""
        with target.opened() as top:
            top_st, src_st = os.fstat(top), os.fstat(source_fd)
            if (top_st.st_dev, top_st.st_ino) != (src_st.st_dev, src_st.st_ino):
                await self.ns("umount", "--no-canonicalize", "--", sysmount.fd_path(top), pass_fds=(top,), check=False)
                raise FailedPrecondition(f"sandbox {self.id}: {target.path} changed while it was bound; undone")
            await self.ns("mount", "--no-canonicalize", "-o", "remount,bind,ro", "--", sysmount.fd_path(top),
                          pass_fds=(top,))

    async def check_subpath(self, mount_point: str, subpath: str) -> None:
        await asyncio.to_thread(safe_subpath, self.root_view(mount_point), subpath)

    async def stats(self, mount_point: str, readonly: bool, device: str = "") -> VolumeStats:
        # Reached from the namespace's root without following a link, and
        # measured on the descriptor the walk ended on.
        with self._namespace_root() as ns_root, \
                copath.reach(mount_point, "mount_point", root_fd=ns_root) as at, at.opened() as fd:
            st = os.statvfs(fd)
            total, free, avail = st.f_blocks * st.f_frsize, st.f_bfree * st.f_frsize, st.f_bavail * st.f_frsize
            usage = [Usage(unit=Usage.BYTES, total=total, available=avail, used=total - free),
                     Usage(unit=Usage.INODES, total=st.f_files, available=st.f_ffree, used=st.f_files - st.f_ffree)]
            return VolumeStats(usage, volume_condition(at.parent_fd, fd, st, readonly))

    async def grow(self, fs_type: str, device: str, mount_point: str, encrypted: str = "") -> None:
        try:
            if fs_type == "xfs":
                await self.ns("xfs_growfs", mount_point)
            elif fs_type == "ext4":
                await self.ns("resize2fs", device)
            else:
                raise FailedPrecondition(f"cannot grow {fs_type}")
        except CommandError as exc:
            raise FailedPrecondition(
                f"growing the mounted {fs_type} file system in sandbox {self.id} was refused on this host "
                f"({exc.stderr}); a microVM sandbox grows it in its own kernel") from None

    async def freeze(self, mount_point: str, timeout: int) -> int:
        def opened() -> int:
            with self._namespace_root() as ns_root, \
                    copath.reach(mount_point, "mount_point", root_fd=ns_root) as at, at.opened() as path_fd:
                return sysfreeze.open_mount(sysmount.fd_path(path_fd))
        try:
            return await self.freezer.freeze(mount_point, timeout, opened)
        except sysfreeze.FreezeError as exc:
            raise FailedPrecondition(f"sandbox {self.id}: freezing {mount_point}: {exc}") from None

    async def thaw(self, mount_point: str) -> tuple[int, bool]:
        return await self.freezer.thaw(mount_point)

    async def unmount(self, mount_point: str) -> None:
        await self.freezer.release(mount_point)
        if self.alive():
            await self.ns("umount", "--", mount_point, check=False)

    async def detach(self, device: str) -> None:
        return None  # nothing was attached: the namespace used the host node

    async def run_process(self, args, env, cwd, log_path: Path) -> int:
        if self.rootfs is None:
            raise InvalidArgument("the bundle has no root: the mount-namespace sandbox needs one")
        log = os.fdopen(open_new(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab")
        self._process = subprocess.Popen(
            ["nsenter", f"--target={self.pid}", "--mount", "--net", "--", "chroot", str(self.rootfs),
             "/usr/bin/env", "-i", "-C", cwd, *env, *args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        # Our child, not reaped yet: its pid cannot have been reused.
        started = proc.start_time(self._process.pid)
        write_atomic(self.workdir / "process", f"{self._process.pid} {started}".encode())
        return self._process.pid

    def process_exit_code(self) -> int | None:
        return self._process.poll() if self._process is not None else None

    def alive(self) -> bool:
        if self._holder is not None:
            return self._holder.poll() is None
        return proc.alive(self._recorded_holder)

    async def stop_process(self) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            await asyncio.to_thread(self._process.wait)
        # After a handler restart the process is no child of ours (and any
        # process may have left its group): every process in the sandbox's
        # mount namespace goes, or it would keep the volume mounted after the
        # claim is released. The holder stays until stop().
        await asyncio.to_thread(self._kill_members)

    def _namespace(self) -> str | None:
        """The sandbox's mount namespace, from a process known to be in it:
        the holder, or (the holder died) the container process recorded at
        its start (pid and start time, so a reused pid is never taken)."""
        candidates = [self.pid] if self.alive() else []
        try:
            pid, started = (self.workdir / "process").read_text().split()
            if proc.alive(proc.ProcessId(int(pid), int(started))):
                candidates.append(int(pid))
        except (OSError, ValueError):
            pass
        for pid in candidates:
            try:
                ns = os.readlink(f"/proc/{pid}/ns/mnt")
            except OSError:
                continue
            if ns != os.readlink("/proc/self/ns/mnt"):
                return ns
        return None

    def _members(self, ns: str | None) -> list[int]:
        """The processes in mount namespace ns but the holder."""
        if ns is None:
            return []
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == self.pid:
                continue
            try:
                if os.readlink(f"/proc/{entry.name}/ns/mnt") == ns:
                    found.append(int(entry.name))
            except OSError:
                continue  # gone, a zombie, or a kernel thread
        return found

    def _kill_members(self) -> None:
        for _ in range(100):
            ns = self._namespace()
            members = self._members(ns)
            if not members:
                return
            for pid in members:
                # Checked again once its pidfd is open: a member that exited
                # since the scan and whose pid went to another process
                # outside the sandbox is not signalled.
                proc.signal_if(pid, lambda pid=pid: _mount_namespace(pid) == ns)
            time.sleep(0.02)
        raise FailedPrecondition(f"sandbox {self.id}: processes {members} would not die")

    async def stop(self) -> None:
        await self.freezer.close()
        await self.stop_process()
        if self._holder is not None:
            self._holder.kill()
            self._holder.wait()
        else:
            # Only the very holder recorded: its pid may name another process
            # by now. It is no child of ours: its end is awaited on its pidfd,
            # so a sandbox deleted leaves no holder (nor its namespaces) behind.
            proc.signal_process(self._recorded_holder, signal.SIGKILL)
            try:
                await asyncio.wait_for(proc.ended(self._recorded_holder), HOLDER_END_WAIT)
            except TimeoutError:
                raise FailedPrecondition(f"sandbox {self.id}: its holder {self._recorded_holder.pid} did not end "
                                         f"within {HOLDER_END_WAIT:g} s of SIGKILL") from None
        (self.workdir / "process").unlink(missing_ok=True)
        await asyncio.to_thread(netns.remove, self.netns)


def safe_subpath(root_view: str, subpath: str) -> None:
    """Refuse a subpath that leaves the volume: '..' or a symlink on the way
    (checked inside the mounted volume, where the symlinks live)."""
    if not subpath:
        return
    parts = subpath.split("/")
    if subpath.startswith("/") or ".." in parts:
        raise InvalidArgument(f"subpath {subpath!r} escapes the volume")
    fd = os.open(root_view, os.O_PATH | os.O_DIRECTORY)
    try:
        for part in parts:
            try:
                nxt = os.open(part, os.O_PATH | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                raise InvalidArgument(f"subpath {subpath!r} does not exist in the volume") from None
            if stat.S_ISLNK(os.fstat(nxt).st_mode):
                os.close(nxt)
                raise InvalidArgument(f"subpath {subpath!r} goes through a symlink inside the volume")
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)


def volume_condition(parent_fd: int, fd: int, st: os.statvfs_result, readonly: bool) -> csi_pb2.VolumeCondition:
    """The condition of the volume whose mount point is fd (reached from
    parent_fd), asked of the kernel at a cost that does not depend on how
    many mounts there are: a sandbox made with `unshare --mount` inherits
    every host mount, so its mountinfo grows with the node's volumes, and
    reading it on every stats call made stats O(volumes)."""
    if sysmount.mount_id(fd) == sysmount.mount_id(parent_fd):
        # The same mount as the directory holding it: nothing is mounted
        # there (someone unmounted it, or it never was).
        return csi_pb2.VolumeCondition(abnormal=True, message="the volume is not mounted in the sandbox")
    # ST_RDONLY is also set for a read-only super block, which is how the
    # kernel reacts to errors (errors=remount-ro).
    if st.f_flag & os.ST_RDONLY and not readonly:
        return csi_pb2.VolumeCondition(abnormal=True, message="the file system went read-only in the sandbox")
    errors = ext4_errors(os.fstat(fd).st_dev)
    if errors:
        return csi_pb2.VolumeCondition(abnormal=True, message=f"ext4 reports {errors} errors")
    return csi_pb2.VolumeCondition(abnormal=False, message="mounted and healthy in the sandbox")


def ext4_errors(dev: int) -> int:
    """The error count ext4 keeps for the file system on this block device
    (0 for any other file system, or one without a block device)."""
    try:
        name = os.path.basename(os.readlink(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
        with open(f"/sys/fs/ext4/{name}/errors_count") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _mount_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def apply_fs_group(root: str, gid: int, policy: str) -> bool:
    """Kubernetes fsGroup semantics on the volume mounted at root (a path
    through the sandbox's namespace), walked on descriptors; see
    crust.sys.ownership. Returns whether it walked."""
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return ownership.apply_fs_group(fd, gid, policy)
    finally:
        os.close(fd)
