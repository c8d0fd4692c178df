"""Deferred volumes of containers that runc runs (crust's OCI runtime).

The light handler's own sandboxes are mount namespaces it makes itself.
Under a CRI runtime, containerd (or CRI-O) makes the containers with runc;
crust's OCI runtime (crust.oci_runtime) sits where runc is called and asks
this part of the handler, over the handler's socket:

1. PrepareContainer, before `runc create`: every bind mount whose source is
   a deferred volume's target path is resolved through the watched
   directory, claimed through the registry under the handler's lease (the
   claim's sandbox is the pod, so two containers of one pod share it and a
   second pod is refused), its device checked, and described back: the
   runtime replaces the bind by a mount of the device at the same
   destination, which runc makes inside the container's mount namespace
   (the host's mount table never has it). A deferred target without a
   readable entry fails here, so the empty placeholder is never bound.
2. ContainerCreated, after `runc create`: the container's init process is
   recorded (pid and start time); the pod's fsGroup is applied on the
   mounted file system, reached through /proc/PID/root, before the
   workload starts. The claims' process (what keeps them should the
   handler's lease lapse) is the pod's own sandbox process when the spec
   joins its namespaces by /proc/PID/ns paths, as containerd's CRI plugin
   writes them: it is known before `runc create` and outlives every
   container of the pod, so the claim names it once, in PrepareBundle.
   Otherwise the init becomes the claims' process here.

3. Stats and expansion, while the container runs: the file system is
   reached the same way, measured with statvfs and grown with the file
   system's ioctl (crust.sys.growfs).
4. ReleaseContainer, after `runc delete`: the claims go, unless another
   container of the pod still uses the volume. A container that is over
   lets go of them without waiting for a delete, and one whose preparing
   runtime died, after a grace (crust.runtime_handler.container_ends).

Between 1 and 2, while runc builds the container, the handler reads each
claimed device's file system into a super block mounted nowhere (a
detached mount, crust.sys.mount.open_filesystem: in no mount table), so
that runc's mount of the device shares it instead of reading it on the
pod's start path; the handler lets go of
it once the container is created (the container's mount holds the file
system then), or before its claims go.

Records (one per container) survive a handler restart; the claims are
re-asserted after each registration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from pathlib import Path

from crust.api import csi_pb2, handler_pb2
from crust.common import copath
from crust.common.errors import CrustError, FailedPrecondition, InvalidArgument, NotFound
from crust.common.recordstore import KEY_RULE, RecordStore, valid_key
from crust.contract.mountinfo import FS_GROUP, FS_GROUP_CHANGE_POLICY, MountInfo, digest
from crust.contract.volumes_dir import check_sandbox_id
from crust.oci_runtime import bundle as runtime_bundle
from crust.oci_runtime.client import RuntimeFailure
from crust.runtime_handler.container_ends import REAP_GRACE, ContainerEnds, mount_namespace
from crust.runtime_handler.container_records import CREATED, PREPARED, ContainerMount, ContainerRecord
from crust.runtime_handler.freeze_holder import Freezer
from crust.runtime_handler.handler import BIND_OPTIONS, check_device, claimed_description, refuse_encrypted
from crust.runtime_handler.resolve import (CSI_DIR, Resolved, SubpathEscapes, candidates, refuse_link_to_deferred,
                                           resolve)
from crust.runtime_handler.sandbox import VolumeStats, Usage, volume_condition
from crust.sys import blockdev, growfs, ownership, proc
from crust.sys import freeze as sysfreeze
from crust.sys import mount as sysmount

log = logging.getLogger(__name__)

# The shim's fail-closed placeholder at a deferred target (crust.csi_shim.node).
PLACEHOLDER_SOURCE = "crust-deferred"
# The largest config.json PrepareBundle reads (the bound of crust-runc's own
# reading, frontend.c's MAX_SPEC).
MAX_SPEC_BYTES = 64 << 20
SHARED_PROPAGATION = {"shared", "rshared"}
# How a CRI runtime has a pod's container join the pod's sandbox: by the
# sandbox process's namespaces (containerd's CRI plugin writes these paths).
POD_NAMESPACE_PATH = re.compile(r"/proc/([1-9][0-9]{0,9})/ns/(?:ipc|uts|net|pid)")
# Propagation flags of the bind that mean nothing for a mounted device.
DROPPED_OPTIONS = BIND_OPTIONS | {"private", "rprivate", "slave", "rslave", "unbindable", "runbindable"}


def is_placeholder(target: str) -> bool:
    entry = sysmount.at(target)
    return entry is not None and entry.fs_type == "tmpfs" and entry.source == PLACEHOLDER_SOURCE


def volume_target(source: str) -> str | None:
    """The .../kubernetes.io~csi/<pv>/mount directory a source lies in."""
    found = candidates(source)
    parts = found[-1].split("/")
    return found[-1] if len(parts) >= 3 and parts[-3] == CSI_DIR and parts[-1] == "mount" else None


def pod_process(spec: dict) -> int:
    """The pid of the pod's sandbox process, when the spec has the container
    join its namespaces through /proc/PID/ns paths that all name one
    process (not the node's init); 0 otherwise (CRI-O's pinned namespaces,
    a pod on the host's namespaces, no pod at all)."""
    linux = spec.get("linux")
    namespaces = linux.get("namespaces") if isinstance(linux, dict) else None
    pids = set()
    for namespace in namespaces if isinstance(namespaces, list) else []:
        path = namespace.get("path") if isinstance(namespace, dict) else None
        found = POD_NAMESPACE_PATH.fullmatch(path) if isinstance(path, str) else None
        if found:
            pids.add(int(found.group(1)))
    return pids.pop() if len(pids) == 1 and 1 not in pids else 0


def read_file_systems_ahead(mounts: list[ContainerMount]) -> list[int]:
    """Each device's file system read into a super block mounted nowhere
    (its detached mounts' descriptors), with the options runc mounts it
    with, so that runc's mount shares it; one that cannot be read is left
    to runc's mount, which then fails or succeeds on its own."""
    descriptors: list[int] = []
    try:
        for device, fs_type, options in sorted({(m.device, m.fs_type, tuple(m.options)) for m in mounts}):
            try:
                descriptors.append(sysmount.open_filesystem(device, fs_type, list(options)))
            except OSError as exc:
                log.info("file system not read ahead of runc", extra={"fields": {"device": device,
                                                                                 "error": str(exc)}})
    except BaseException:
        close_all(descriptors)
        raise
    return descriptors


def close_all(descriptors: list[int]) -> None:
    for descriptor in descriptors:
        os.close(descriptor)


def device_options(info: MountInfo, readonly: bool) -> list[str]:
    options = [o for o in info.options if o not in DROPPED_OPTIONS and o not in ("ro", "rw")]
    if info.fstype == "xfs" and "nouuid" not in options:
        options.append("nouuid")  # a clone carries its source's UUID
    return (["ro"] if readonly else ["rw"]) + options


class ContainerVolumes:
    def __init__(self, handler, state_dir: Path, reap_grace: float = REAP_GRACE):
        self.handler = handler
        self.records = RecordStore(state_dir / "containers", ContainerRecord, lambda key, record: "" if (
            record.container_id == key) else f"it describes container {record.container_id!r}, not {key!r}")
        self.containers: dict[str, ContainerRecord] = dict(self.records.load_all())
        self.lock = asyncio.Lock()
        # By container: its devices' file systems being read (a task whose
        # result is the detached mounts' descriptors), then being let go of.
        self.reading_ahead: dict[str, asyncio.Future] = {}
        self.letting_go: dict[str, asyncio.Future] = {}
        # What ends the claims no runtime released (crust.runtime_handler.container_ends).
        self.ends = ContainerEnds(self.containers, handler.registration, self.release, self._holder_pid, reap_grace)
        self.reaper: asyncio.Task | None = None
        # Freezes of volumes, by target path (held through the container's root).
        self.freezer = Freezer()

    def start(self) -> None:
        self.reaper = asyncio.create_task(self.ends.reap_forever())

    async def reclaim(self) -> None:
        """After each (re-)registration: the claims of the recorded containers."""
        await self.ends.reclaim()

    async def release_exited(self, sandbox_id: str = "") -> list[str]:
        """The claims of the containers (of one pod, or all) that ran and are
        over, released as their delete would."""
        return await self.ends.release_exited(sandbox_id)

    def stop(self) -> None:
        if self.reaper is not None:
            self.reaper.cancel()

    def _let_go_of_read_ahead(self, container_id: str) -> None:
        """Close the container's detached mounts once they are made (in the
        background; `letting_go` has it until done)."""
        reading = self.reading_ahead.pop(container_id, None)
        if reading is None:
            return

        async def let_go() -> None:
            try:
                descriptors = await reading
            except Exception as exc:  # noqa: BLE001 (it closed what it opened; runc mounts on its own)
                log.warning("reading file systems ahead of runc failed", extra={"fields": {
                    "container": container_id, "error": repr(exc)}})
                return
            await asyncio.to_thread(close_all, descriptors)

        task = asyncio.ensure_future(let_go())
        self.letting_go[container_id] = task
        task.add_done_callback(lambda done: self.letting_go.pop(container_id, None)
                               if self.letting_go.get(container_id) is done else None)

    # -- 1. before runc create ---------------------------------------------------------------

    async def prepare(self, container_id: str, sandbox_id: str, bundle: str, mounts, runtime_pid: int,
                      pod_pid: int = 0) -> list[ContainerMount]:
        if not valid_key(container_id):
            raise InvalidArgument(f"container_id {container_id!r} must be {KEY_RULE}")
        check_sandbox_id(sandbox_id)
        async with self.lock:
            existing = self.containers.get(container_id)
            if existing is not None:
                if existing.sandbox_id != sandbox_id:
                    raise FailedPrecondition(f"container {container_id} was prepared for sandbox "
                                             f"{existing.sandbox_id}, not {sandbox_id}")
                return existing.mounts
            plan: list[tuple[object, MountInfo]] = []
            for mount in mounts:
                if not (mount.type == "bind" or BIND_OPTIONS & set(mount.options)) or not mount.source.startswith("/"):
                    continue
                refuse_link_to_deferred(mount.source, self.handler.index)
                resolved = await self._resolve(mount.source)
                if resolved is None:
                    continue
                if resolved.subpath:
                    raise FailedPrecondition(
                        f"{mount.source} is a subpath of the deferred volume {resolved.info.target_path}: runc "
                        "mounts a device whole, so a subpath of a deferred volume cannot be given to a container")
                if SHARED_PROPAGATION & set(mount.options):
                    raise FailedPrecondition(
                        f"the mount of {resolved.info.target_path} at {mount.destination} asks for shared "
                        "(Bidirectional) propagation: its file system would show up on the host")
                if resolved.info.encryption:
                    raise refuse_encrypted(resolved.info, f"crust's OCI runtime (container {container_id})")
                plan.append((mount, resolved.info))
            if not plan:
                return []
            await self.handler.registration.wait_registered(f"container {container_id}")
            runtime = proc.identify(runtime_pid) if runtime_pid > 0 else None
            pod = proc.identify(pod_pid) if pod_pid > 0 else None
            record = ContainerRecord(container_id=container_id, sandbox_id=sandbox_id, bundle=bundle,
                                     runtime_pid=runtime.pid if runtime else 0,
                                     runtime_pid_start=runtime.start if runtime else 0,
                                     pod_pid=pod.pid if pod else 0, pod_pid_start=pod.start if pod else 0)
            claimed: list[str] = []
            described: dict[str, MountInfo] = {}  # by target: the claim's description
            try:
                for mount, info in plan:
                    if info.fstype not in self.handler.registration.filesystems:
                        raise FailedPrecondition(f"handler {self.handler.name} cannot mount {info.fstype}")
                    if info.target_path not in claimed:
                        # Claim first: a second pod is refused before anything touches the device.
                        holder = record.pod_pid if pod else self._holder_pid(info.target_path, sandbox_id)
                        answer = await self.handler.registration.claim(info.target_path, sandbox_id, holder)
                        claimed.append(info.target_path)
                        described[info.target_path] = claimed_description(info, answer)
                    info = described[info.target_path]
                    if info.encryption:
                        raise refuse_encrypted(info, f"crust's OCI runtime (container {container_id})")
                    if info.fstype not in self.handler.registration.filesystems:
                        raise FailedPrecondition(f"handler {self.handler.name} cannot mount {info.fstype}")
                    check_device(info)
                    readonly = info.readonly or "ro" in mount.options
                    record.mounts.append(ContainerMount(
                        destination=mount.destination, target_path=info.target_path, device=info.device,
                        fs_type=info.fstype, options=device_options(info, readonly), readonly=readonly,
                        device_major=info.device_major, device_minor=info.device_minor,
                        fs_group=info.metadata.get(FS_GROUP, ""),
                        fs_group_change_policy=info.metadata.get(FS_GROUP_CHANGE_POLICY, "")))
                await self.records.put(container_id, record)
                self.containers[container_id] = record
            except BaseException:
                for target in claimed:
                    await self._release_target(target, sandbox_id, container_id, "")
                raise
            log.info("container volumes claimed", extra={"fields": {
                "container": container_id, "sandbox": sandbox_id, "volumes": record.targets()}})
            return record.mounts

    async def prepare_bundle(self, container_id: str, bundle: str, runtime_pid: int, state_dir: str,
                             log_flags: dict[str, str]) -> list[ContainerMount]:
        """PrepareBundle: `prepare` with the OCI runtime's own part of
        `create` done here (crust.oci_runtime.bundle.write_bundle), for
        crust-runc, which reads no JSON: the bundle's spec read, its binds
        prepared, and the bundle and the runtime's marker written. No
        mounts: nothing deferred, nothing written."""
        for name, value in (("bundle", bundle), ("state_dir", state_dir)):
            if not os.path.isabs(value):
                raise InvalidArgument(f"{name} {value!r} must be an absolute path")
        if not os.path.isdir(bundle):
            raise NotFound(f"bundle {bundle} is not a directory the handler sees (does it run in another mount "
                           "namespace than the runtime?)")
        for name in (runtime_bundle.ORIGINAL_CONFIG, "config.json"):
            with contextlib.suppress(OSError):
                size = os.stat(os.path.join(bundle, name)).st_size
                if size > MAX_SPEC_BYTES:
                    # A daemon reads it: a hostile spec must not swell it.
                    raise InvalidArgument(f"bundle: {os.path.join(bundle, name)} holds {size} bytes, more than "
                                          f"the {MAX_SPEC_BYTES} the handler reads")
        try:
            spec = await asyncio.to_thread(runtime_bundle.load_spec, bundle)
        except RuntimeFailure as exc:
            raise InvalidArgument(f"bundle: {exc}") from None
        if not runtime_bundle.deferred_candidates(spec):
            return []
        sandbox_id = runtime_bundle.sandbox_of(spec, container_id)
        mounts = [handler_pb2.ContainerMount(destination=m.get("destination") or "", type=m.get("type") or "",
                                             source=m.get("source") or "", options=m.get("options") or [])
                  for m in spec.get("mounts") or []]
        deferred = await self.prepare(container_id, sandbox_id, bundle, mounts, runtime_pid, pod_process(spec))
        if not deferred:
            return []
        record = self.containers.get(container_id)
        if record is not None and record.state == PREPARED and container_id not in self.reading_ahead \
                and container_id not in self.letting_go:
            # Not for a retried PrepareBundle of a created container: its own
            # mount holds the file systems already.
            self.reading_ahead[container_id] = asyncio.ensure_future(
                asyncio.to_thread(read_file_systems_ahead, deferred))
        try:
            await asyncio.to_thread(runtime_bundle.write_bundle, bundle, state_dir, container_id, sandbox_id, spec,
                                    deferred, log_flags)
        except OSError as exc:
            # Nothing half-done stays: the claims go, and the marker (a
            # rewritten config.json without claims is never run: create fails).
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.unlink(os.path.join(state_dir, container_id))
            await self.release(container_id)
            raise FailedPrecondition(f"bundle {bundle}: cannot write the runtime's files: {exc}") from None
        return deferred

    async def _resolve(self, source: str) -> Resolved | None:
        """The deferred volume a bind source is (None: not a deferred
        volume); FailedPrecondition for a deferred target whose entry is
        missing or unreadable, so its placeholder is never bound."""
        try:
            resolved = resolve(source, self.handler.index)
        except SubpathEscapes as exc:
            raise InvalidArgument(str(exc)) from None
        if resolved is not None or CSI_DIR not in source.split("/"):
            return resolved
        target = volume_target(source)
        if target is None:
            return None
        name = digest(target)
        entry_dir = os.path.lexists(self.handler.index.root / name)
        if not entry_dir and not is_placeholder(target):
            return None  # a volume mounted on the host: not deferred
        # Published just now: give the entry a moment to be indexed.
        resolved, _ = await self.handler.wait_resolve(source)
        if resolved is not None:
            return resolved
        problem = self.handler.index.problem(name)
        if problem:
            raise FailedPrecondition(f"the deferred-mount entry of {target} is unreadable ({problem}); "
                                     "refusing to give the container the empty placeholder")
        raise FailedPrecondition(f"{target} is a deferred volume (the shim's placeholder is mounted there) but "
                                 f"{self.handler.index.root} has no entry for it; refusing to give the container "
                                 "the empty placeholder")

    def _holder_pid(self, target_path: str, sandbox_id: str, excluding: str = "") -> int:
        """The process the pod's claim on target_path names: the pod's
        sandbox process while it runs, when a container of the pod that uses
        target_path named it; else the init of such a live container other
        than `excluding`; 0 if none."""
        init = 0
        for record in self.containers.values():
            if record.sandbox_id != sandbox_id or target_path not in record.targets():
                continue
            if proc.alive(record.pod()):
                return record.pod_pid
            if not init and record.container_id != excluding and proc.alive(record.init()):
                init = record.pid
        return init

    # -- 2. after runc create ---------------------------------------------------------------------

    async def created(self, container_id: str, pid: int) -> None:
        async with self.lock:
            record = self.containers.get(container_id)
            if record is None:
                raise NotFound(f"container {container_id} was not prepared by this handler")
            init = proc.identify(pid)
            if pid <= 0 or init is None:
                raise InvalidArgument(f"pid {pid} of container {container_id} is not a running process")
            record.pid, record.pid_start = init.pid, init.start
            record.mount_namespace = mount_namespace(pid)
            record.state = CREATED
            for target in record.targets():
                if self._holder_pid(target, record.sandbox_id, excluding=container_id) == 0:
                    await self.handler.registration.claim(target, record.sandbox_id, pid)
            for mount in record.mounts:
                if mount.fs_group and not mount.readonly:
                    await asyncio.to_thread(self._apply_fs_group, record, mount)
            await self.records.put(container_id, record)
            # The container's own mount holds its file systems now.
            self._let_go_of_read_ahead(container_id)
        log.info("container created", extra={"fields": {"container": container_id, "pid": pid}})

    def _apply_fs_group(self, record: ContainerRecord, mount: ContainerMount) -> None:
        with self._reach(record, mount) as (_, fd):
            ownership.apply_fs_group(fd, int(mount.fs_group), mount.fs_group_change_policy or ownership.ALWAYS)

    @contextlib.contextmanager
    def _reach(self, record: ContainerRecord, mount: ContainerMount):
        """The container's mount of the volume, as (CoPath, O_PATH fd),
        reached from the container's root without following a link; refused
        unless the container's init still runs and it is the volume there."""
        init = record.init()
        if not proc.alive(init):
            raise FailedPrecondition(f"container {record.container_id} is not running")
        root_fd = os.open(f"/proc/{init.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if not proc.alive(init):  # the root opened is that process's, not a reused pid's
                raise FailedPrecondition(f"container {record.container_id} is not running")
            with copath.reach(mount.destination, "destination", root_fd=root_fd) as at, at.opened() as fd:
                st = os.fstat(fd)
                if mount.device_major and (os.major(st.st_dev), os.minor(st.st_dev)) != (mount.device_major,
                                                                                         mount.device_minor):
                    raise FailedPrecondition(f"{mount.destination} in container {record.container_id} is not "
                                             f"the volume {mount.target_path}")
                yield at, fd
        finally:
            os.close(root_fd)

    # -- 3. while it runs -------------------------------------------------------------------------

    def find(self, target_path: str, sandbox_id: str) -> tuple[ContainerRecord, ContainerMount]:
        """A running container of the sandbox with target_path mounted."""
        for record in self.containers.values():
            if record.sandbox_id != sandbox_id or record.state != CREATED or not proc.alive(record.init()):
                continue
            for mount in record.mounts:
                if mount.target_path == target_path:
                    return record, mount
        raise NotFound(f"no running container of sandbox {sandbox_id} holds {target_path}")

    def alive(self, sandbox_id: str) -> bool:
        return any(r.sandbox_id == sandbox_id and (proc.alive(r.init()) or proc.alive(r.runtime()))
                   for r in self.containers.values())

    async def stats(self, record: ContainerRecord, mount: ContainerMount) -> VolumeStats:
        def measure() -> VolumeStats:
            try:
                with self._reach(record, mount) as (at, fd):
                    st = os.statvfs(fd)
                    total, free, avail = st.f_blocks * st.f_frsize, st.f_bfree * st.f_frsize, st.f_bavail * st.f_frsize
                    usage = [Usage(unit=Usage.BYTES, total=total, available=avail, used=total - free),
                             Usage(unit=Usage.INODES, total=st.f_files, available=st.f_ffree,
                                   used=st.f_files - st.f_ffree)]
                    return VolumeStats(usage, volume_condition(at.parent_fd, fd, st, mount.readonly))
            except FailedPrecondition as exc:
                return VolumeStats([], csi_pb2.VolumeCondition(abnormal=True, message=exc.message))
        return await asyncio.to_thread(measure)

    async def expand(self, record: ContainerRecord, mount: ContainerMount) -> int:
        def grow() -> None:
            with self._reach(record, mount) as (_, path_fd):
                fd = os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    growfs.grow(fd, mount.fs_type, blockdev.size_bytes(mount.device))
                finally:
                    os.close(fd)
        try:
            await asyncio.to_thread(grow)
        except growfs.GrowError as exc:
            raise FailedPrecondition(f"growing the {mount.fs_type} file system of {mount.target_path} in "
                                     f"container {record.container_id}: {exc}") from None
        return blockdev.size_bytes(mount.device)

    async def freeze(self, record: ContainerRecord, mount: ContainerMount, timeout: int) -> int:
        def opened() -> int:
            with self._reach(record, mount) as (_, path_fd):
                return sysfreeze.open_mount(sysmount.fd_path(path_fd))
        try:
            return await self.freezer.freeze(mount.target_path, timeout, opened)
        except sysfreeze.FreezeError as exc:
            raise FailedPrecondition(f"freezing {mount.target_path} in container {record.container_id}: "
                                     f"{exc}") from None

    # -- 4. after runc delete ---------------------------------------------------------------------

    async def release(self, container_id: str, abnormal_reason: str = "") -> None:
        async with self.lock:
            # The handler's own hold on the file systems goes before the
            # claims: a volume released is mounted nowhere by this handler.
            self._let_go_of_read_ahead(container_id)
            letting_go = self.letting_go.get(container_id)
            if letting_go is not None:
                await asyncio.shield(letting_go)
            record = self.containers.get(container_id)
            if record is None:
                return
            errors = []
            for target in record.targets():
                try:
                    await self._release_target(target, record.sandbox_id, container_id, abnormal_reason)
                except CrustError as exc:
                    errors.append(exc.message)
            if errors:
                raise FailedPrecondition(f"container {container_id}: {'; '.join(errors)}")
            await self.records.delete(container_id)
            self.containers.pop(container_id, None)
            self.ends.forget(container_id)
        log.info("container volumes released", extra={"fields": {
            "container": container_id, "sandbox": record.sandbox_id, "volumes": record.targets(),
            "abnormal": abnormal_reason}})

    async def _release_target(self, target: str, sandbox_id: str, container_id: str, abnormal_reason: str) -> None:
        """Release the pod's claim on target unless another container of the
        pod uses it (then that container's init becomes its process)."""
        others = [r for r in self.containers.values() if r.container_id != container_id
                  and r.sandbox_id == sandbox_id and target in r.targets()]
        if others:
            pid = self._holder_pid(target, sandbox_id, excluding=container_id)
            if pid:
                await self.handler.registration.claim(target, sandbox_id, pid)
            return
        await self.freezer.release(target)
        await self.handler.registration.release(target, sandbox_id, abnormal_reason)

    def info(self, record: ContainerRecord) -> handler_pb2.ContainerInfo:
        return handler_pb2.ContainerInfo(
            container_id=record.container_id, sandbox_id=record.sandbox_id, state=record.state, pid=record.pid,
            alive=proc.alive(record.init()), mounts=[self.describe(m) for m in record.mounts])

    @staticmethod
    def describe(mount: ContainerMount) -> handler_pb2.DeferredContainerMount:
        return handler_pb2.DeferredContainerMount(
            destination=mount.destination, target_path=mount.target_path, device=mount.device,
            fs_type=mount.fs_type, options=mount.options, readonly=mount.readonly)
