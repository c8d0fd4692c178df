"""The runtime handler: what a runtime needs to mount deferred volumes in its
sandboxes, independent of how the sandbox isolates (crust.runtime_handler.sandbox).

Running a sandbox from an OCI bundle:
1. resolve every mount source to a deferred volume (and subpath) through the
   index of the watched directory;
2. claim each volume through the registry (refused if another live sandbox
   holds it), before touching it;
3. check the device is the one described (block device, same major:minor,
   at least the described size): device names are reused;
4. attach and mount each volume once, apply fsGroup, then give each
   container destination its view (whole volume or subpath);
5. start the process. Deleting the sandbox undoes it all and releases.

A handler may also take volumes from a second, registry-less source (the
microVM handler reads Kata's direct-volume layout): such a volume is claimed
and released through that source instead of the proxy's registry. Step 1,
the lookup the runtimes share, is crust.runtime_handler.volume_lookup.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import stat
import time
from pathlib import Path
from typing import Awaitable, Callable, Protocol

from pydantic import BaseModel, Field

from crust.api import handler_pb2
from crust.common.errors import CrustError, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from crust.common.inflight import InFlight
from crust.common.recordstore import KEY_RULE, RecordStore, valid_key
from crust.contract import device as device_identity
from crust.contract import encryption
from crust.contract.mountinfo import FS_GROUP, FS_GROUP_CHANGE_POLICY, MountInfo, digest
from crust.contract.volumes_dir import check_sandbox_id
from crust.runtime_handler.index import VolumeIndex
from crust.runtime_handler.oci import BundleError, load_bundle, load_requested_bundle
from crust.runtime_handler.registration import Registration
from crust.runtime_handler.resolve import refuse_link_to_deferred
from crust.runtime_handler.sandbox import Sandbox
from crust.runtime_handler.volume_lookup import VolumeLookup
from crust.sys import blockdev, proc

log = logging.getLogger(__name__)

State = handler_pb2.GetSandboxResponse.State
BIND_OPTIONS = {"bind", "rbind"}


# A sandbox's work directory holds its VM's unix sockets, whose paths fit in
# 107 bytes; CRI's sandbox ids have 64 characters. A longer id gets a name
# derived from it, short enough for the sockets below the default state
# directories.
WORKDIR_NAME_MAX = 32


def workdir_name(sandbox_id: str) -> str:
    if len(sandbox_id) <= WORKDIR_NAME_MAX:
        return sandbox_id
    return "h-" + hashlib.sha256(sandbox_id.encode()).hexdigest()[:WORKDIR_NAME_MAX - 2]


class VolumeView(BaseModel):
    destination: str
    subpath: str = ""
    readonly: bool = False


class ContainerBook(Protocol):
    """The volumes of containers runc runs (crust.runtime_handler.containers),
    as the handler asks of them: whether any is held, and their claims
    taken back after a new registration."""

    containers: dict

    async def reclaim(self) -> None: ...


class DirectSource(Protocol):
    """Volumes described outside the proxy (Kata's direct-volume layout)."""

    def resolve(self, source: str): ...
    def claim(self, volume_path: str, sandbox_id: str) -> None: ...
    def release(self, volume_path: str, sandbox_id: str) -> None: ...


class MountedVolume(BaseModel):
    target_path: str
    device: str
    fs_type: str
    mount_point: str
    readonly: bool = False
    views: list[VolumeView] = Field(default_factory=list)
    direct: bool = False  # from the DirectSource, not the proxy's registry
    # The sandbox's name of the opened encrypted volume ("" for a plain one).
    encrypted_name: str = ""
    # False from its recording until it is mounted and its views bound: a
    # mount that failed and could not be undone is never bound as if mounted.
    ready: bool = True


class SandboxRecord(BaseModel):
    sandbox_id: str
    bundle: str
    pid: int = 0
    # When that process started (ticks since boot, crust.sys.proc): with
    # the pid, the holder for good. 0 in records written before it was kept.
    pid_start: int = 0
    process_pid: int = 0
    volumes: dict[str, MountedVolume] = Field(default_factory=dict)  # by digest
    created_at: float = Field(default_factory=time.time)


def claimed_description(entry: MountInfo, answer: str) -> MountInfo:
    """What is mounted: the description the proxy answered the claim with
    (its record of what the plugin returned), which must be the volume of
    the entry found in the watched directory; never the entry alone (a file
    in a shared directory can be rewritten)."""
    try:
        claimed = MountInfo.model_validate_json(answer)
    except ValueError as exc:
        raise FailedPrecondition(f"the proxy's answer to the claim of {entry.target_path} is no "
                                 f"description: {str(exc)[:200]}") from None
    return device_identity.agree(entry, claimed)


def refuse_encrypted(info: MountInfo, who: str) -> FailedPrecondition:
    integrity = f", integrity {info.integrity}" if info.integrity else ""
    return FailedPrecondition(
        f"{info.target_path} is an encrypted volume ({info.encryption}{integrity}): {who} does not open such "
        "volumes; it is opened only inside a microVM guest (crust kata), never by the host or a mount namespace")


def check_device(info: MountInfo) -> None:
    """The described device, and no other, before anything touches it."""
    try:
        st = os.stat(info.device)
    except FileNotFoundError:
        raise FailedPrecondition(f"device {info.device} of {info.target_path} does not exist") from None
    if not stat.S_ISBLK(st.st_mode):
        raise FailedPrecondition(f"{info.device} is not a block device")
    found = (os.major(st.st_rdev), os.minor(st.st_rdev))
    if info.device_major and found != (info.device_major, info.device_minor):
        raise device_identity.refuse(f"{info.device} is {found[0]}:{found[1]}, the volume was "
                                     f"{info.device_major}:{info.device_minor}: the name was reused",
                                     target_path=info.target_path, device=info.device)
    size = blockdev.size_bytes(info.device)
    if size < info.capacity_bytes:
        raise FailedPrecondition(f"{info.device} has {size} bytes, the volume has {info.capacity_bytes}")


class RuntimeHandler(VolumeLookup):
    def __init__(self, *, name: str, volumes_dir: Path, state_dir: Path, registration: Registration,
                 make_sandbox: Callable[[str, Path, Path | None, proc.ProcessId | None], Sandbox],
                 direct_source: DirectSource | None = None,
                 before_teardown: Callable[[str], Awaitable[None]] | None = None,
                 make_containers: Callable[[RuntimeHandler], ContainerBook] | None = None,
                 on_watcher: Callable[[bool], Awaitable[None]] | None = None):
        self.name = name
        self.direct_source = direct_source
        self.index = VolumeIndex(volumes_dir)
        self.state_dir = state_dir
        self.records = RecordStore(state_dir / "sandboxes", SandboxRecord, self._belongs)
        self.registration = registration
        self.make_sandbox = make_sandbox
        self.sandboxes: dict[str, tuple[Sandbox, SandboxRecord]] = {}
        # Stopped sandboxes whose claims are still to be released, with the
        # reason to release them with.
        self._releasing: dict[str, str] = {}
        # The reaper's teardowns under way: a caller's delete of that
        # sandbox waits for it instead of being told ABORTED by the
        # handler's own housekeeping.
        self._reaping: dict[str, asyncio.Task] = {}
        self.inflight = InFlight()
        registration.on_register = self.reclaim
        # Told when the directory watcher stops working and when it works
        # again (the daemon turns it into its health).
        self.on_watcher = on_watcher
        # Told a sandbox's id before the sandbox is stopped and its volumes
        # released (the microVM handler's pods unmount their containers first).
        self._before_teardown = before_teardown
        # Volumes of containers runc runs (crust.runtime_handler.containers),
        # when this handler serves crust's OCI runtime.
        self.containers = make_containers(self) if make_containers is not None else None

    def set_before_teardown(self, hook: Callable[[str], Awaitable[None]] | None) -> None:
        """The hook told a sandbox's id before its teardown (stopping it and
        releasing its volumes), for a part made after the handler."""
        self._before_teardown = hook

    # -- sandboxes made elsewhere (the microVM handler's pods) ---------------------------

    def entry(self, sandbox_id: str) -> tuple[Sandbox, SandboxRecord] | None:
        """The sandbox of that id and its record, None when the handler has none."""
        return self.sandboxes.get(sandbox_id)

    async def adopt(self, sandbox: Sandbox, record: SandboxRecord) -> None:
        """A running sandbox another part made becomes the handler's: its
        record written, then reaped, reclaimed, torn down and adopted after
        a restart like those RunSandbox makes. Kept also when its record
        cannot be written: the caller then forgets it."""
        self.sandboxes[record.sandbox_id] = (sandbox, record)
        await self.records.put(record.sandbox_id, record)

    async def forget(self, sandbox_id: str) -> None:
        """An adopted sandbox dropped without a teardown (its maker stops
        it): neither kept nor recorded."""
        self.sandboxes.pop(sandbox_id, None)
        await self.records.delete(sandbox_id)

    async def save(self, record: SandboxRecord) -> None:
        """A sandbox's record written again after its volumes changed."""
        await self.records.put(record.sandbox_id, record)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self.index.start()
        await self.recover()
        self.registration.start()
        self.reaper = asyncio.create_task(self._reap_forever())
        self.watch_keeper = asyncio.create_task(self._keep_watching())

    async def _keep_watching(self, interval: float = 1.0) -> None:
        """A watcher that stopped working is rebuilt (and the directory
        rescanned); on_watcher(False) meanwhile, so health says it."""
        while True:
            await asyncio.sleep(interval)
            why = self.index.watching()
            if not why:
                continue
            log.error("the watcher of the volumes directory is lost; rebuilding it", extra={"fields": {
                "error": why[:500]}})
            await self._report_watcher(False)
            while not await asyncio.to_thread(self.index.rebuild):
                await asyncio.sleep(interval)
            await self._report_watcher(True)

    async def _report_watcher(self, working: bool) -> None:
        if self.on_watcher is not None:
            await self.on_watcher(working)

    async def _reap_forever(self, interval: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.reap_once()

    async def reap_once(self) -> None:
        """A sandbox that died on its own (a crashed VM, a killed holder)
        gives its volumes back, marked abnormal, instead of holding them."""
        for sandbox_id, (sandbox, record) in list(self.sandboxes.items()):
            if sandbox.alive() or self.inflight.busy(sandbox_id):
                continue
            reason = self._releasing.get(sandbox_id)
            if reason is None:
                log.warning("sandbox died", extra={"fields": {"sandbox": sandbox_id}})
                reason = f"sandbox {sandbox_id} died unexpectedly (its VM or holder process exited)"
            task = self._reaping[sandbox_id] = asyncio.create_task(self._reap(sandbox, record, reason))
            await asyncio.shield(task)

    async def _reap(self, sandbox: Sandbox, record: SandboxRecord, reason: str) -> None:
        try:
            with self.inflight.hold(record.sandbox_id):
                # Also a stopped sandbox whose claims could not be released
                # yet (the proxy's disk was full): again.
                await self._teardown(sandbox, record, reason)
        except CrustError as exc:
            log.warning("cleanup of a dead sandbox failed", extra={"fields": {"sandbox": record.sandbox_id,
                                                                              "error": exc.message}})
        finally:
            self._reaping.pop(record.sandbox_id, None)

    async def reaped(self, sandbox_id: str) -> None:
        """Wait for the reaper's teardown of this sandbox, if one runs."""
        task = self._reaping.get(sandbox_id)
        if task is not None:
            await asyncio.shield(task)

    async def stop(self) -> None:
        for task in (getattr(self, "reaper", None), getattr(self, "watch_keeper", None)):
            if task is not None:
                task.cancel()
        # Sandboxes still running keep their claims, and so the lease they
        # were made under: the name is given up only when none is left.
        held = self.sandboxes or (self.containers is not None and self.containers.containers)
        await self.registration.stop(unregister=not held)
        self.index.stop()

    async def recover(self) -> None:
        """After a restart: keep sandboxes whose holder process lives, clean
        up (and release) the others."""
        for key, record in self.records.load_all():
            holder = await self._recorded_holder(key, record)
            if holder is False:
                continue  # set aside: nothing it names is touched
            sandbox = self.make_sandbox(record.sandbox_id, self.workdir(record.sandbox_id),
                                        self._rootfs(record), holder)
            if sandbox.alive():
                self.sandboxes[record.sandbox_id] = (sandbox, record)
                log.info("sandbox survived the restart", extra={"fields": {"sandbox": record.sandbox_id}})
                try:
                    await sandbox.adopt([v.device for v in record.volumes.values()], record.process_pid)
                except CrustError as exc:
                    # Kept: its claims hold while it runs; stats say what is wrong.
                    log.error("could not take over a surviving sandbox", extra={"fields": {
                        "sandbox": record.sandbox_id, "error": exc.message}})
            else:
                log.info("sandbox died while the handler was down", extra={"fields": {"sandbox": record.sandbox_id}})
                self.sandboxes[record.sandbox_id] = (sandbox, record)
                self._pending_release = getattr(self, "_pending_release", []) + [record.sandbox_id]

    async def _recorded_holder(self, key: str, record: SandboxRecord) -> proc.ProcessId | None | bool:
        """The recorded holder, when the process under its pid is the
        sandbox's: its start time the recorded one, and the sandbox
        recognising it (crust.runtime_handler.sandbox: its namespaces).
        Any other process is neither adopted nor ever signalled (None: the
        sandbox is dead). A record without a start time names its process
        only if the sandbox recognises the one under its pid, whose start
        time is then recorded; otherwise the record is set aside (False)."""
        probe = self.make_sandbox(record.sandbox_id, self.workdir(record.sandbox_id), None, None)
        if record.pid_start:
            holder = proc.ProcessId(record.pid, record.pid_start)
            if proc.alive(holder) and not probe.recognise(holder):
                log.warning("the process under the sandbox's recorded pid is not its holder (not in its "
                            "namespaces): never signalled", extra={"fields": {
                                "sandbox": record.sandbox_id, "pid": record.pid}})
                return None
            return holder
        current = proc.identify(record.pid) if record.pid > 0 else None
        if current is not None and probe.recognise(current):
            record.pid_start = current.start
            await self.records.put(key, record)
            log.info("a sandbox recorded without its holder's start time: recognised, its start time recorded",
                     extra={"fields": {"sandbox": record.sandbox_id, "pid": record.pid}})
            return current
        self.records.set_aside(key, f"it names pid {record.pid} without a start time, and the process under "
                                    "that pid is not the sandbox's holder; no process of it is ever signalled")
        return False

    async def reclaim(self) -> None:
        """Called after every (re-)registration: re-assert the claims of live
        sandboxes (idempotent for the same sandbox) and release dead ones."""
        for sandbox_id in list(getattr(self, "_pending_release", [])):
            try:
                await self.delete_sandbox(sandbox_id)
            except CrustError as exc:
                log.warning("could not clean a dead sandbox", extra={"fields": {"sandbox": sandbox_id,
                                                                                "error": exc.message}})
            self._pending_release.remove(sandbox_id)
        for sandbox, record in list(self.sandboxes.values()):
            for volume in record.volumes.values():
                try:
                    await self._claim(volume.target_path, volume.direct, record.sandbox_id, sandbox.pid)
                except CrustError as exc:
                    log.error("lost a claim", extra={"fields": {"sandbox": record.sandbox_id,
                                                                "target_path": volume.target_path,
                                                                "error": exc.message}})
        if self.containers is not None:
            await self.containers.reclaim()

    def _belongs(self, key: str, record: SandboxRecord) -> str:
        """A sandbox's record is stored under its id, and its volumes are
        mounted in its own run directory, each under its target's digest."""
        if record.sandbox_id != key:
            return f"it describes sandbox {record.sandbox_id!r}, not {key!r}"
        for name, volume in record.volumes.items():
            expected = str(self.workdir(key) / "volumes" / name)
            if digest(volume.target_path) != name or volume.mount_point != expected:
                return f"its volume {volume.target_path!r} is not mounted at {expected}"
        return ""

    def workdir(self, sandbox_id: str) -> Path:
        named = self.state_dir / "run" / sandbox_id
        if len(sandbox_id) > WORKDIR_NAME_MAX and named.is_dir():
            # Made by a release that named every work directory by its id
            # (a mount-namespace sandbox still running across the upgrade).
            return named
        return self.state_dir / "run" / workdir_name(sandbox_id)

    @staticmethod
    def _rootfs(record: SandboxRecord) -> Path | None:
        try:
            spec = load_bundle(Path(record.bundle))
        except BundleError:
            return None
        return (Path(record.bundle) / spec.root.path) if spec.root else None

    # -- sandboxes ---------------------------------------------------------------------

    async def run_sandbox(self, bundle: str, sandbox_id: str) -> SandboxRecord:
        sandbox_id = check_sandbox_id(sandbox_id)
        if not valid_key(sandbox_id):
            # The sandbox's record is stored under its id.
            raise InvalidArgument(f"sandbox_id {sandbox_id!r} must be {KEY_RULE}")
        spec = load_requested_bundle(bundle)
        with self.inflight.hold(sandbox_id):
            if sandbox_id in self.sandboxes:
                return self.sandboxes[sandbox_id][1]
            await self.registration.wait_registered(f"sandbox {sandbox_id}")
            # Resolve every mount before touching anything.
            plan: dict[str, tuple[MountInfo, list[VolumeView], bool]] = {}
            others = []
            for m in spec.mounts:
                if m.type == "bind" or BIND_OPTIONS & set(m.options):
                    refuse_link_to_deferred(m.source, self.index)
                resolved, direct = await self.find_volume(m.source)
                if resolved is None:
                    others.append(m)
                    continue
                view = VolumeView(destination=m.destination, subpath=resolved.subpath,
                                  readonly="ro" in m.options)
                plan.setdefault(resolved.digest, (resolved.info, [], direct))[1].append(view)
            rootfs = (Path(bundle) / spec.root.path) if spec.root else None
            sandbox = self.make_sandbox(sandbox_id, self.workdir(sandbox_id), rootfs, None)
            record = SandboxRecord(sandbox_id=sandbox_id, bundle=bundle)
            await sandbox.start()
            record.pid = sandbox.pid
            identity = sandbox.identity
            record.pid_start = identity.start if identity is not None else 0
            self.sandboxes[sandbox_id] = (sandbox, record)
            try:
                for key, (info, views, direct) in plan.items():
                    await self.mount_volume(sandbox, record, key, info, views, direct)
                for m in others:
                    if m.type == "bind" or BIND_OPTIONS & set(m.options):
                        await sandbox.bind(m.source, m.destination, readonly="ro" in m.options)
                record.process_pid = await sandbox.run_process(
                    spec.process.args, spec.process.env, spec.process.cwd, self.workdir(sandbox_id) / "process.log")
                await self.records.put(sandbox_id, record)
            except BaseException:
                await self._teardown(sandbox, record)
                raise
            log.info("sandbox running", extra={"fields": {"sandbox": sandbox_id, "volumes": len(record.volumes)}})
            return record

    async def _claim(self, target_path: str, direct: bool, sandbox_id: str, pid: int) -> str:
        """Claim the volume; the proxy's description of it (its record) for
        a volume of the registry, "" for a direct one."""
        answer, passphrase = await self._claim_keyed(target_path, direct, sandbox_id, pid)
        encryption.wipe(passphrase)
        return answer

    async def _claim_keyed(self, target_path: str, direct: bool, sandbox_id: str,
                           pid: int) -> tuple[str, bytearray | None]:
        if direct:
            if self.direct_source is None:
                raise FailedPrecondition(f"{target_path} was a direct volume; this handler reads none")
            await asyncio.to_thread(self.direct_source.claim, target_path, sandbox_id)
            return "", None
        return await self.registration.claim_keyed(target_path, sandbox_id, pid)

    async def release_volume(self, volume: MountedVolume, sandbox_id: str, abnormal_reason: str) -> None:
        """The volume's claim given back (the proxy's, or the direct source's)."""
        if volume.direct:
            if self.direct_source is not None:
                await asyncio.to_thread(self.direct_source.release, volume.target_path, sandbox_id)
        else:
            await self.registration.release(volume.target_path, sandbox_id, abnormal_reason)

    async def mount_volume(self, sandbox: Sandbox, record: SandboxRecord, key: str, info: MountInfo,
                           views: list[VolumeView], direct: bool = False) -> None:
        """The volume claimed for the sandbox, then mounted in it at the
        record's volumes/<key> and bound at each view; recorded first, so a
        teardown knows what to undo."""
        if info.fstype not in self.registration.filesystems:
            raise FailedPrecondition(f"handler {self.name} cannot mount {info.fstype}")
        self._refuse_encrypted(info)
        # Claim first: a second sandbox is refused before it touches the device.
        answer, passphrase = await self._claim_keyed(info.target_path, direct, record.sandbox_id, sandbox.pid)
        try:
            await self._attach_volume(sandbox, record, key, info, views, direct, answer, passphrase)
        finally:
            encryption.wipe(passphrase)

    async def _attach_volume(self, sandbox: Sandbox, record: SandboxRecord, key: str, info: MountInfo,
                             views: list[VolumeView], direct: bool, answer: str,
                             passphrase: bytearray | None) -> None:
        mounted = MountedVolume(target_path=info.target_path, device=info.device, fs_type=info.fstype,
                                mount_point=str(self.workdir(record.sandbox_id) / "volumes" / key),
                                readonly=info.readonly, views=views, direct=direct, ready=False)
        record.volumes[key] = mounted  # recorded before mounting: teardown knows what to undo
        if not direct:
            info = claimed_description(info, answer)
            mounted.device, mounted.fs_type, mounted.readonly = info.device, info.fstype, info.readonly
            if info.fstype not in self.registration.filesystems:
                raise FailedPrecondition(f"handler {self.name} cannot mount {info.fstype}")
            self._refuse_encrypted(info)
        check_device(info)
        inside = await sandbox.attach(info.device)
        if info.encryption:
            if passphrase is None:
                raise Unavailable(f"{info.target_path} is an encrypted volume and its claim brought no passphrase "
                                  f"(sandbox {record.sandbox_id} claimed it before); delete the sandbox and run it "
                                  "again")
            mounted.encrypted_name = "crypt-" + key[:32]
            inside = await sandbox.open_encrypted(inside, info.encryption, info.fstype, passphrase,
                                                  mounted.encrypted_name, integrity=info.integrity,
                                                  size_bytes=info.capacity_bytes)
        group = info.metadata.get(FS_GROUP)
        fs_group = (int(group), info.metadata.get(FS_GROUP_CHANGE_POLICY, "Always")) \
            if group and not info.readonly else None
        await sandbox.mount(inside, info.fstype, info.options, info.readonly, mounted.mount_point, fs_group)
        for view in views:
            await sandbox.bind_volume(mounted.mount_point, view.subpath, view.destination,
                                      readonly=view.readonly or info.readonly)
        mounted.ready = True

    def _refuse_encrypted(self, info: MountInfo) -> None:
        """An encrypted volume is opened only inside a VM guest, by a handler
        that registered the feature (and so gets the key with its claim)."""
        needed = encryption.required_features(info.encryption, info.integrity)
        if any(f not in self.registration.features for f in needed):
            raise refuse_encrypted(info, f"handler {self.name}")

    async def _teardown(self, sandbox: Sandbox, record: SandboxRecord, abnormal_reason: str = "") -> None:
        """Stop the sandbox, unmount and release its volumes. Every step may
        be run again: a sandbox whose claims could not all be released (the
        proxy refused, its disk full) stays, stopped, with its record, so the
        next DeleteSandbox, the reaper or a restarted handler releases them."""
        errors: list[CrustError] = []
        if self._before_teardown is not None:
            await self._before_teardown(record.sandbox_id)
        await sandbox.stop_process()
        for volume in record.volumes.values():
            try:
                await sandbox.unmount(volume.mount_point)
                if volume.encrypted_name:
                    await sandbox.close_encrypted(volume.encrypted_name)
                await sandbox.detach(volume.device)
            except CrustError as exc:
                errors.append(exc)
        await sandbox.stop()
        unreleased = False
        for volume in record.volumes.values():
            try:
                await self.release_volume(volume, record.sandbox_id, abnormal_reason)
            except CrustError as exc:
                errors.append(exc)
                unreleased = True
        if unreleased:
            self._releasing[record.sandbox_id] = abnormal_reason
        else:
            self._releasing.pop(record.sandbox_id, None)
            self.sandboxes.pop(record.sandbox_id, None)
            await self.records.delete(record.sandbox_id)
        if errors:
            error = CrustError(f"sandbox {record.sandbox_id} cleaned up with errors: "
                               f"{'; '.join(e.message for e in errors)}"
                               + ("; its claims are released when retried" if unreleased else ""))
            # One cause, one code (a full disk stays RESOURCE_EXHAUSTED, which a caller retries).
            codes = {e.code for e in errors}
            error.code = codes.pop() if len(codes) == 1 else FailedPrecondition.code
            raise error

    async def delete_sandbox(self, sandbox_id: str) -> None:
        await self.reaped(sandbox_id)
        with self.inflight.hold(sandbox_id):
            entry = self.sandboxes.get(sandbox_id)
            if entry is None:
                return
            await self._teardown(*entry)

    def find(self, target_path: str, sandbox_id: str) -> tuple[Sandbox, MountedVolume]:
        entry = self.sandboxes.get(sandbox_id)
        volume = entry[1].volumes.get(digest(target_path)) if entry else None
        if entry is None or volume is None:
            raise NotFound(f"sandbox {sandbox_id} does not hold {target_path}")
        return entry[0], volume

    def info(self, sandbox: Sandbox, record: SandboxRecord) -> handler_pb2.SandboxInfo:
        code = sandbox.process_exit_code()
        return handler_pb2.SandboxInfo(
            sandbox_id=record.sandbox_id, state=State.RUNNING if sandbox.alive() else State.STOPPED,
            pid=record.pid, process_pid=record.process_pid, exited=code is not None,
            exit_code=code or 0, bundle=record.bundle,
            volumes=[handler_pb2.SandboxVolume(
                target_path=v.target_path, device=v.device, fs_type=v.fs_type, mount_point=v.mount_point,
                destinations=[w.destination for w in v.views], subpaths=[w.subpath for w in v.views])
                for v in record.volumes.values()])

