"""Where a container's sources are in the guest: the pod's shares, its
tmpfs, its volumes, subPaths bound from descriptors, the pod's PID
namespace; and a container's spec with each of them in place.

The host names a source by what it is (specs/agent.proto, Source), never
by a guest path: the agent knows where it mounted each. A subPath is
opened below its source without ever leaving it (crust.sys.beneath) and
what was opened is bound at a place of the agent's own
(RUN_DIR/subpath/<container>/<mount index>), which the OCI runtime then
binds into the container: a container swapping a name for a symlink in a
volume it shares changes nothing of another's bind.

A share's bind is a submount of the share in the guest, mounted on its
first lookup in the mount namespace that looks. The agent looks up the
container's root and every share source (and the host's mounts below it)
in its own namespace before the runtime binds them: the pod's containers
then bind one mount of each (one page cache, one size for appends), and no
container's exit unmounts one (the last unmount of a virtio-fs submount
with a file's release in flight stops the guest's 6.1 kernel at a BUG).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import shutil
import stat
from pathlib import Path

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.guest.errors import AgentError, check_id
from crust.guest.mirrors import INTERVAL, Mirrors
from crust.guest.volumes import Volumes, wait_for
from crust.sys import beneath
from crust.sys import mount as sysmount

log = logging.getLogger("crust.guest")

RUN_DIR = "/run/crust"
# crust's virtio-fs tags and where the guest mounts each (the host's
# crust.kata.vmm.share names the same places).
SHARE_PLACES = {"crust": "share", "crust-live": "live"}
VIRTIOFS_MODULE = "virtiofs"
MEMINFO = "/proc/meminfo"
CATATONIT = "/sbin/catatonit"
POD_PID_WAIT = 5.0            # seconds the pod's PID namespace's init has to appear
POD_PID_LOOK = 0.02
ROOT_RETIRE = 2.0             # seconds between a container's removal and its root's unmount here
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def _bind_mount(mount: dict) -> bool:
    options = mount.get("options") or []
    return mount.get("type") == "bind" or "bind" in options or "rbind" in options


def half_memory(meminfo: str = MEMINFO) -> int:
    """Half the guest's memory in bytes: what tmpfs takes without a size."""
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 // 2
    raise OSError(f"{meminfo}: no MemTotal")


class Places:
    def __init__(self, volumes: Volumes, run_dir: str = RUN_DIR, pod_init: str = CATATONIT, meminfo: str = MEMINFO):
        self.volumes = volumes
        self.pod_init = pod_init
        self.run = Path(run_dir)
        self.meminfo = meminfo
        self.pod_init_holder: asyncio.subprocess.Process | None = None   # unshare, the init's parent
        self.mirrors = Mirrors(self.run)
        self.mirror_users: dict[str, set[str]] = {}   # container id -> the mirrors it binds
        self.roots: dict[str, str] = {}   # container id -> its root, reached in the agent's namespace
        self.retiring: dict[str, asyncio.TimerHandle] = {}   # removed containers' roots, unmounted soon
        self._pod_pid_lock = asyncio.Lock()
        self._share_lock = asyncio.Lock()

    # ----------------------------------------------------------- shares

    def share_point(self, field: str, tag: str) -> Path:
        name = SHARE_PLACES.get(tag)
        if name is None:
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field}: {tag!r} is not one of crust's shares "
                                                    f"({', '.join(SHARE_PLACES)})")
        return self.run / name

    async def mount_share(self, tag: str, call) -> str:
        """The share of that tag mounted (nodev: the host's device nodes
        never act in the guest), once its device's driver registered the
        tag: a device hot-plugged a moment ago is waited for on the
        kernel's events until its probe ended (the bind event)."""
        point = self.share_point("tag", tag)
        async with self._share_lock:   # two calls for one tag mount it once
            return await self._mount_share(tag, point, call)

    async def _mount_share(self, tag: str, point: Path, call) -> str:
        entry = sysmount.at(str(point))
        if entry is not None:
            if entry.fs_type == "virtiofs" and entry.source == tag:
                return str(point)
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"tag: {point} is a mount of {entry.source} "
                                                       f"({entry.fs_type}) already")
        self.volumes.load_modules(VIRTIOFS_MODULE, "tag")
        point.mkdir(parents=True, exist_ok=True)
        refusal: list[str] = []

        def mounted() -> bool | None:
            try:
                sysmount.mount_path(tag, str(point), "virtiofs", ["nodev"])
            except OSError as exc:
                refusal[:] = [str(exc)]
                return None   # an unknown tag (EINVAL) until the driver registered it
            return True

        if await self.volumes.disks.events.wait_until(mounted, wait_for(call)) is None:
            raise AgentError(ttrpc.DEADLINE_EXCEEDED, f"tag: the share {tag} could not be mounted in time: "
                                                     f"{refusal[0] if refusal else 'no device'}")
        log.info("share %s mounted at %s", tag, point)
        return str(point)

    def _share_path(self, field: str, share: agent_pb2.SharePath) -> Path:
        point = self.share_point(f"{field}.tag", share.tag)
        if sysmount.at(str(point)) is None:
            raise AgentError(ttrpc.NOT_FOUND, f"{field}.tag: the share {share.tag} is not mounted (MountShare)")
        parts = self._relative(f"{field}.path", share.path)
        if not parts:
            return point
        root = os.open(point, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # The share's layout is the host's: a link on the way is refused.
            os.close(beneath.open_beneath(root, "/".join(parts), resolve=beneath.RESOLVE_NO_SYMLINKS))
        except OSError as exc:
            code = ttrpc.NOT_FOUND if exc.errno == errno.ENOENT else ttrpc.INVALID_ARGUMENT
            raise AgentError(code, f"{field}.path: {share.path} in the share {share.tag}: "
                                   f"{os.strerror(exc.errno or 0)}") from None
        finally:
            os.close(root)
        return point.joinpath(*parts)

    @staticmethod
    def _relative(field: str, path: str) -> list[str]:
        try:
            return beneath.check_subpath(path)
        except beneath.SubpathError as exc:
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field}: {exc.message}") from None

    # ------------------------------------------------------------- tmpfs

    def pod_tmpfs_point(self, name: str) -> Path:
        return self.run / "podtmpfs" / name

    def mount_pod_tmpfs(self, name: str, size_bytes: int) -> tuple[str, int]:
        """The pod's tmpfs of that name, at most size_bytes and half the
        guest's memory (a tmpfs promising more than the guest has ends in
        the OOM killer, not ENOSPC); resized when it exists."""
        check_id("name", name)
        half = half_memory(self.meminfo)
        size = min(size_bytes, half) if size_bytes else half
        point = self.pod_tmpfs_point(name)
        options = ["nosuid", "nodev", f"size={size}"]
        if sysmount.at(str(point)) is not None:
            try:
                sysmount.remount(str(point), options)
            except OSError as exc:
                raise AgentError(ttrpc.FAILED_PRECONDITION, f"size_bytes: the tmpfs {name} cannot take "
                                                           f"{size} bytes: {exc}") from None
            return str(point), size
        point.mkdir(parents=True, exist_ok=True)
        try:
            # As kubelet makes an emptyDir: writable for any user of the pod.
            sysmount.mount_path(f"crust-{name}", str(point), "tmpfs", [*options, "mode=0777"])
        except OSError as exc:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"name: the tmpfs {name} was not mounted: {exc}") from None
        return str(point), size

    # ----------------------------------------------------------- sources

    def source_root(self, field: str, source: agent_pb2.Source) -> Path:
        """Where the source is in the guest, before its subpath."""
        kind = source.WhichOneof("kind")
        if kind == "volume_id":
            return Path(self.volumes.mount_point(f"{field}.volume_id", source.volume_id))
        if kind == "share":
            return self._share_path(f"{field}.share", source.share)
        if kind == "pod_tmpfs":
            check_id(f"{field}.pod_tmpfs", source.pod_tmpfs)
            point = self.pod_tmpfs_point(source.pod_tmpfs)
            if sysmount.at(str(point)) is None:
                raise AgentError(ttrpc.NOT_FOUND, f"{field}.pod_tmpfs: no tmpfs {source.pod_tmpfs} "
                                                  f"(MountPodTmpfs)")
            return point
        if kind == "mirror":
            # Started by StartMirror.
            check_id(f"{field}.mirror", source.mirror)
            point = self.mirrors.point(source.mirror)
            if not point.is_dir() or point.is_symlink():
                raise AgentError(ttrpc.NOT_FOUND, f"{field}.mirror: no mirror {source.mirror}")
            return point
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field}: no source named")

    def resolve(self, field: str, source: agent_pb2.Source, container_id: str, index: int) -> str:
        """The guest path the runtime binds for the source: its root, or
        its subpath bound from a descriptor at the container's place."""
        root = self.source_root(field, source)
        if not source.subpath:
            return str(root)
        try:
            fd = beneath.open_subpath(str(root), source.subpath, source.strict)
        except beneath.SubpathError as exc:
            code = ttrpc.INVALID_ARGUMENT if exc.leaves or not source.strict else ttrpc.FAILED_PRECONDITION
            raise AgentError(code, f"{field}.subpath: {exc.message}") from None
        try:
            target = self.run / "subpath" / container_id / str(index)
            target.parent.mkdir(parents=True, exist_ok=True)
            while sysmount.unmount_all(str(target)):   # a CreateContainer tried again binds afresh
                pass
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                target.mkdir(mode=0o700, exist_ok=True)
            else:
                target.touch(mode=0o600)
            place = os.open(target, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                sysmount.bind_fd(fd, place)
            finally:
                os.close(place)
        except OSError as exc:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"{field}.subpath: {source.subpath} not bound: "
                                                       f"{exc}") from None
        finally:
            os.close(fd)
        return str(target)

    async def remove(self, container_id: str) -> None:
        """What drop drops; the container's root, reached in the agent's
        namespace, unmounted ROOT_RETIRE seconds later: its processes are
        gone, but the guest kernel releases their virtio-fs files
        asynchronously, and the last unmount of a submount with a release
        in flight stops Debian 12's 6.1 kernel at a BUG (busy inodes after
        unmount)."""
        await asyncio.to_thread(self.drop, container_id)
        root = self.roots.pop(container_id, None)
        if root is not None:
            loop = asyncio.get_running_loop()
            self.retiring[root] = loop.call_later(
                ROOT_RETIRE, lambda: self.retiring.pop(root, None) and loop.create_task(
                    asyncio.to_thread(self._unmount_quietly, root)))

    @staticmethod
    def _unmount_quietly(path: str) -> None:
        try:
            sysmount.unmount_all(path)
        except OSError as exc:
            log.warning("a removed container's root stays mounted at %s: %s", path, exc)

    def drop(self, container_id: str) -> None:
        """The container's subpath binds unmounted and their places removed
        (never recursively: a place still mounted would be emptied through
        its mount)."""
        self.mirror_users.pop(container_id, None)
        directory = self.run / "subpath" / container_id
        if not directory.is_dir():
            return
        for entry in directory.iterdir():
            sysmount.unmount_all(str(entry))
            if entry.is_dir() and not entry.is_symlink():
                entry.rmdir()
            else:
                entry.unlink()
        directory.rmdir()

    @staticmethod
    def reach(paths: list[str]) -> None:
        """Each path looked up in the agent's mount namespace, through it
        (a lookup of the path itself leaves its automount alone)."""
        for path in paths:
            try:
                os.stat(os.path.join(path, ".") if os.path.isdir(path) else path)
            except OSError as exc:
                raise AgentError(ttrpc.FAILED_PRECONDITION, f"binds: {path} cannot be reached: "
                                                           f"{exc.strerror}") from None

    # --------------------------------------------------- pod PID namespace

    async def pod_pid_namespace(self) -> int:
        """The pid of the pod's PID namespace's init (catatonit -P, which
        reaps what it inherits), started on first use."""
        async with self._pod_pid_lock:
            record = self.run / "podpid"
            with contextlib.suppress(OSError, ValueError):
                pid = int(record.read_text())
                if os.readlink(f"/proc/{pid}/exe") == os.path.realpath(self.pod_init):
                    return pid
            self.pod_init_holder = await asyncio.create_subprocess_exec(
                shutil.which("unshare", path=SYSTEM_PATH) or "unshare", "--pid", "--fork", "--", self.pod_init, "-P", stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            holder = self.pod_init_holder.pid
            loop = asyncio.get_running_loop()
            deadline = loop.time() + POD_PID_WAIT
            while loop.time() < deadline:
                with contextlib.suppress(OSError, ValueError):
                    children = Path(f"/proc/{holder}/task/{holder}/children").read_text().split()
                    if children:
                        record.parent.mkdir(parents=True, exist_ok=True)
                        record.write_text(f"{children[0]}\n")
                        return int(children[0])
                await asyncio.sleep(POD_PID_LOOK)
            raise AgentError(ttrpc.DEADLINE_EXCEEDED, "pod_pid_namespace: the pod's PID namespace did not start")

    async def start_mirror(self, request: agent_pb2.StartMirrorRequest) -> str:
        source = self._share_path("source", request.source)
        return await self.mirrors.start(request.name, source, request.interval_ms / 1000 or INTERVAL)

    async def stop_mirror(self, name: str) -> None:
        users = sorted(c for c, names in self.mirror_users.items() if name in names)
        if users:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"name: the mirror {name} is bound by container "
                                                       f"{users[0]}, not removed")
        await self.mirrors.stop(name)

    async def close(self) -> None:
        """The mirrors stopped, the pod's PID namespace ended (its init
        killed takes every process in it along)."""
        await self.mirrors.close()
        for timer in self.retiring.values():
            timer.cancel()
        holder, self.pod_init_holder = self.pod_init_holder, None
        if holder is None:
            return
        with contextlib.suppress(OSError, ValueError):
            for child in Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split():
                os.kill(int(child), 9)
        with contextlib.suppress(ProcessLookupError):
            holder.kill()
        await holder.wait()

    # --------------------------------------------------- a container's spec

    async def place(self, request: agent_pb2.CreateContainerRequest, call) -> bytes:
        """The request's spec with the root, each bind's source and the pod's
        PID namespace in place, its storages mounted first; a failure drops
        the subpath binds made for it."""
        try:
            spec = json.loads(request.oci_spec)
        except (ValueError, UnicodeDecodeError) as exc:
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"oci_spec: not JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise AgentError(ttrpc.INVALID_ARGUMENT, "oci_spec: not a JSON object")
        for i, storage in enumerate(request.storages):
            try:
                await self.volumes.mount(storage, call)
            except AgentError as exc:
                raise AgentError(exc.code, f"storages[{i}]: {exc.message}") from None
        mounts = spec.get("mounts") or []
        seen: set[int] = set()
        for i, bind in enumerate(request.binds):
            if bind.mount_index >= len(mounts) or not _bind_mount(mounts[bind.mount_index]):
                raise AgentError(ttrpc.INVALID_ARGUMENT, f"binds[{i}].mount_index: {bind.mount_index} is not a "
                                                        f"bind mount of the spec")
            if bind.mount_index in seen:
                raise AgentError(ttrpc.INVALID_ARGUMENT, f"binds[{i}].mount_index: {bind.mount_index} is bound "
                                                        f"twice")
            seen.add(bind.mount_index)
        reach: list[str] = []
        try:
            if request.HasField("rootfs"):
                root = await asyncio.to_thread(self.resolve, "rootfs", request.rootfs, request.container_id,
                                               len(mounts))
                spec.setdefault("root", {})["path"] = root
                reach.append(root)
                if not request.rootfs.subpath:
                    self.roots[request.container_id] = root
                    retiring = self.retiring.pop(root, None)
                    if retiring is not None:   # a create tried again: its root stays reached
                        retiring.cancel()
            for i, bind in enumerate(request.binds):
                field = f"binds[{i}].source"
                source = await asyncio.to_thread(self.resolve, field, bind.source, request.container_id,
                                                 bind.mount_index)
                m = mounts[bind.mount_index]
                m["source"] = source
                m["options"] = [o for o in m.get("options") or [] if o not in ("ro", "rw")] + \
                    ["ro" if bind.readonly else "rw"]
                if bind.source.WhichOneof("kind") == "mirror":
                    self.mirror_users.setdefault(request.container_id, set()).add(bind.source.mirror)
                if bind.source.WhichOneof("kind") == "share" and not bind.source.subpath:
                    reach += [source, *(os.path.join(source, *self._relative(f"{field}.share.submounts", below))
                                        for below in bind.source.share.submounts)]
            await asyncio.to_thread(self.reach, reach)
            if request.pod_pid_namespace:
                pid = await self.pod_pid_namespace()
                linux = spec.setdefault("linux", {})
                namespaces = [n for n in linux.get("namespaces") or [] if n.get("type") != "pid"]
                linux["namespaces"] = [*namespaces, {"type": "pid", "path": f"/proc/{pid}/ns/pid"}]
        except BaseException:
            with contextlib.suppress(OSError):
                self.drop(request.container_id)   # the root's unmount is the caller's (remove)
            raise
        return json.dumps(spec, separators=(",", ":")).encode()
