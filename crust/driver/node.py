"""CSI Node service of the loop driver.

Stage attaches the volume's backing file to a loop device (and, for the
mount access type, formats a blank device and mounts it at the staging
path); publish bind-mounts the staged file system, or the device node for
raw block, to the target. What is attached and mounted is always read back
from the kernel (crust.sys.loop, crust.sys.mount), so every RPC converges
when retried and after a restart; the node's records keep what the kernel
cannot tell (which staging path and targets belong to which volume, with
which capability) and which loop device was attached, as a hint.

Every RPC costs the same whatever the number of volumes on the node: the
recorded device is checked with one sysfs read, a mount is looked up for
its one place (crust.common.copath), and a device's file system is known
unmounted when an exclusive open of the device succeeds. The whole mount
table is read only where nothing cheaper can answer (a raw block device's
binds claim nothing; a device someone holds may be mounted anywhere), and
the list of every loop device only once, at start.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from crust.api import csi_pb2, csi_pb2_grpc
from crust.common import copath, csi_input, volumefs
from crust.common.atomicfile import write_atomic
from crust.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
)
from crust.common.inflight import InFlight
from crust.common.formats import encode
from crust.common.recordstore import RecordStore
from crust.driver.backend import loop as backend
from crust.driver.config import TOPOLOGY_KEY, DriverConfig
from crust.driver.records import (
    NodePublish,
    NodeVolumeRecord,
    PoolRecord,
    node_records_dir,
)
from crust.sys import blockdev, fs, loop, mount
from crust.sys.run import CommandError

log = logging.getLogger(__name__)

RPC = csi_pb2.NodeServiceCapability.RPC
CAPABILITIES = [
    RPC.STAGE_UNSTAGE_VOLUME,
    RPC.GET_VOLUME_STATS,
    RPC.EXPAND_VOLUME,
    RPC.VOLUME_CONDITION,
    RPC.SINGLE_NODE_MULTI_WRITER,
]
ALPHA_CAPABILITIES = [RPC.GET_ID]
AccessMode = csi_pb2.VolumeCapability.AccessMode


class NodeService(csi_pb2_grpc.NodeServicer):
    def __init__(self, config: DriverConfig):
        self.config = config
        self.pool = backend.Pool(config.data_dir, config.node_id)
        self.records = RecordStore(node_records_dir(config.data_dir, config.node_id), NodeVolumeRecord,
                                   _node_record_belongs, on_damaged=self._record_damaged)
        # Loop devices over a volume's file that its record does not name,
        # found by the one walk over /sys/block at start (a record written
        # before devices were recorded, an unreadable record, a read-only
        # device whose detach failed): the RPCs take them into account.
        self.unrecorded: dict[str, list[str]] = {}
        self.inflight = InFlight()
        self.supported_modes = set(csi_input.SINGLE_NODE_MODES)
        # Distributed provisioning: the controller's growth of a volume,
        # called by NodeExpandVolume (no ControllerExpandVolume comes).
        self.grow_volume = None

    # -- start-up -------------------------------------------------------------------

    def register_pool(self) -> PoolRecord:
        """Offer this node's pool to the controller (the loop backend's node registry)."""
        self.pool.ensure()
        record = PoolRecord(
            node_id=self.config.node_id,
            capacity_bytes=self.config.effective_capacity(),
            max_volumes_per_node=self.config.max_volumes_per_node,
            topology={TOPOLOGY_KEY: self.config.node_id},
        )
        write_atomic(self.pool.root / "pool.json", encode(record), mode=0o644)
        return record

    def reconcile(self) -> None:
        """Bring records and the kernel's state together after a restart.

        - targets a record lists whose mount is gone are dropped (a reboot
          cleared them; kubelet publishes again);
        - loop devices over files of this pool that no record explains and
          nothing mounts are detached (a crash between attach and record).
        """
        known = {}
        table = mount.mounts()  # read once: this runs before anything is served
        mounted = {e.mount_point for e in table}
        for key, rec in self.records.load_all():
            known[rec.volume_id] = rec
            gone = [t for t in rec.published if t not in mounted]
            for target in gone:
                del rec.published[target]
            if gone:
                self.records.put_sync(rec.volume_id, rec)
                log.info("dropped vanished publishes", extra={"fields": {"volume_id": rec.volume_id, "targets": gone}})
        pool_dir = str(self.pool.volumes.resolve()) + "/"
        self.unrecorded = {}
        for device, backing in loop.attached().items():
            if not backing.startswith(pool_dir):
                continue  # not ours: never touch it
            volume_id = Path(backing.split(" (deleted)")[0]).stem
            rec = known.get(volume_id)
            if rec is not None:
                if device not in rec.devices():
                    self.unrecorded.setdefault(volume_id, []).append(device)
                continue
            majmin = blockdev.major_minor(device)
            node_name = "/" + os.path.basename(device)
            if any((e.major, e.minor) == majmin or (e.fs_type == "devtmpfs" and e.root == node_name) for e in table):
                log.warning("unrecorded loop device is mounted; leaving it", extra={"fields": {"device": device}})
                self.unrecorded.setdefault(volume_id, []).append(device)
                continue
            loop.detach_sync(device)
            log.info("detached orphan loop device", extra={"fields": {"device": device, "volume_id": volume_id}})

    def _record_damaged(self, volume_id: str) -> None:
        """A volume's record was found damaged and set aside: the loop
        devices it named are found again by their backing file (one walk
        over the loop devices, only in this case), so that stats, unpublish
        and unstage still know the volume's devices and mounts."""
        if not backend.valid_id(volume_id):
            return
        backing = str(self.pool.volume_file(volume_id).resolve())
        found = self.unrecorded.setdefault(volume_id, [])
        for device, file in loop.attached().items():
            if file.split(" (deleted)")[0] == backing and device not in found:
                found.append(device)
        log.warning("a damaged record's loop devices found again", extra={"fields": {
            "volume_id": volume_id, "devices": found}})

    # -- helpers --------------------------------------------------------------------

    def _backing_file(self, volume_id: str) -> Path:
        if not backend.valid_id(volume_id):
            raise NotFound(f"volume {volume_id!r} does not exist on node {self.config.node_id}")
        path = self.pool.volume_file(volume_id)
        if not path.exists():
            raise NotFound(f"volume {volume_id!r} does not exist on node {self.config.node_id}")
        return path

    def _volume_exists(self, volume_id: str) -> bool:
        return backend.valid_id(volume_id) and (
            self.pool.volume_file(volume_id).exists() or self.records.get(volume_id) is not None)

    def _devices(self, volume_id: str, backing: Path, rec: NodeVolumeRecord | None) -> list[str]:
        """Every loop device over the volume's file that this node attached:
        the recorded ones and those found at start, each checked against
        the kernel with one sysfs read."""
        candidates = (rec.devices() if rec else []) + self.unrecorded.get(volume_id, [])
        return [d for d in dict.fromkeys(candidates) if loop.serves(d, backing)]

    @staticmethod
    def _writable(devices: list[str]) -> str | None:
        """The writable one of the volume's loop devices (read-only ones serve
        read-only raw block publishes, see NodePublishVolume)."""
        return next((d for d in devices if not loop.read_only(d)), None)

    @staticmethod
    def _mounted_anywhere(devices: list[str], *, block: bool) -> mount.MountEntry | None:
        """A mount of these devices' file systems or of their nodes, if any.

        A file system that is not mounted anywhere leaves its device free
        for an exclusive open: that answers in O(1). The table is read only
        when someone holds a device (the answer is then where) or for raw
        block, whose binds of a device node hold nothing. A device held only
        by another mount namespace (a sandbox that copied the mount) shows
        no entry here and, as before, does not keep the volume staged."""
        if not devices:
            return None
        if not block and not any(blockdev.claimed(d) for d in devices):
            return None
        found = mount.of_devices({d: blockdev.major_minor(d) for d in devices})
        return found[0] if found else None

    async def _detach_if_unused(self, device: str, *, block: bool) -> bool:
        """Detach a loop device this driver attached, unless something mounts
        it; True when detached."""
        try:
            if self._mounted_anywhere([device], block=block) is not None:
                return False
            await loop.detach(device)
            return True
        except (OSError, ValueError, CommandError) as exc:
            log.warning("could not detach", extra={"fields": {"device": device, "error": str(exc)}})
            return False

    @staticmethod
    def _read_only_device(entry: mount.MountEntry, backing: Path) -> str | None:
        """The read-only loop device a read-only raw block publish bound at this entry."""
        if entry.fs_type != "devtmpfs":
            return None
        device = "/dev" + entry.root
        return device if loop.serves(device, backing) and loop.read_only(device) else None

    @staticmethod
    def _is_our_mount(entry: mount.MountEntry, devices: list[str]) -> bool:
        """Is this mount entry the file system or the device node of one of
        the volume's loop devices?"""
        for dev in devices:
            try:
                majmin = blockdev.major_minor(dev)
            except (FileNotFoundError, ValueError):
                continue
            if (entry.major, entry.minor) == majmin:
                return True
            # A bind mount of the device node itself (raw block publish) shows the
            # devtmpfs it lives on, with the node's name as root.
            if entry.fs_type == "devtmpfs" and entry.root == "/" + os.path.basename(dev):
                return True
        return False

    def _validate_capability(self, request, field: str = "volume_capability") -> str:
        if not request.HasField("volume_capability"):
            raise InvalidArgument(f"{field} is required")
        return csi_input.capability(request.volume_capability, field, self.supported_modes, fs.SUPPORTED)

    # -- stage / unstage ----------------------------------------------------------------

    async def NodeStageVolume(self, request: csi_pb2.NodeStageVolumeRequest, context):
        volume_id = csi_input.name(request.volume_id, "volume_id")
        staging = csi_input.path(request.staging_target_path, "staging_target_path")
        kind = self._validate_capability(request)
        cap = request.volume_capability
        fs_type = (cap.mount.fs_type or request.volume_context.get("fsType") or self.config.default_fs_type) \
            if kind == "mount" else ""
        flags = list(cap.mount.mount_flags) if kind == "mount" else []
        if kind == "mount" and fs_type not in fs.SUPPORTED:
            # Only reachable through volume_context (the capability's own
            # fs_type is checked above).
            raise InvalidArgument(f"volume_context.fsType {fs_type!r} is not supported; use one of "
                                  f"{', '.join(fs.SUPPORTED)}")
        with self.inflight.hold(volume_id):
            backing = self._backing_file(volume_id)
            rec = self.records.get(volume_id)
            if rec is not None:
                if rec.staging_path != staging:
                    raise FailedPrecondition(f"volume {volume_id} is already staged at {rec.staging_path}")
                if rec.access_type != kind or (kind == "mount" and (rec.fs_type, rec.mount_flags) != (fs_type, flags)):
                    raise AlreadyExists(f"volume {volume_id} is staged at {staging} with a different volume_capability")
            with copath.reach(staging, "staging_target_path", create_parents=kind == "mount",
                              checked=True) as staging_at:
                made = False
                if kind == "mount":
                    made = staging_at.mkdir()
                else:
                    staging_at.refuse_symlink()  # unused for block, but never accepted through a link
                device = self._writable(self._devices(volume_id, backing, rec))
                attached_here = device is None
                if device is None:
                    device = await loop.attach(backing)
                    log.info("attached", extra={"fields": {"device": device}})
                mounted_here = False
                try:
                    if kind == "mount":
                        current = staging_at.mount_entry()
                        if current is not None and not self._is_our_mount(current, [device]):
                            raise FailedPrecondition(
                                f"staging_target_path {staging} has another file system mounted ({current.source})")
                        if current is None:
                            await volumefs.format_if_blank(device, fs_type, volume_id,
                                                           zeroed=loop.reads_as_zeros(device),
                                                           image=loop.image_of(device))
                            await volumefs.fill_device_offline(fs_type, device)
                            await staging_at.mount(device, fs_type, volumefs.mount_options(fs_type, flags))
                            mounted_here = True
                            if fs_type == "xfs" and cap.access_mode.mode not in csi_input.READ_ONLY_MODES:
                                with staging_at.opened() as staging_fd:
                                    await volumefs.grow_online(fs_type, device, staging_fd)
                    record = NodeVolumeRecord(volume_id=volume_id, staging_path=staging, access_type=kind,
                                              access_mode=cap.access_mode.mode, fs_type=fs_type, mount_flags=flags,
                                              published=rec.published if rec else {}, device=device)
                    if record != rec:  # a repeated stage of the same device has nothing new to record
                        # Before anything is answered: a stage that cannot be
                        # recorded (a full disk) is undone below, so a retry
                        # finds nothing of it.
                        await self.records.put(volume_id, record)
                except Exception:
                    # A failed stage leaves no mount and no loop device behind:
                    # no NodeUnstageVolume follows a failed stage, a retry
                    # would find the staging path taken, and DeleteVolume would
                    # orphan the device.
                    if mounted_here:
                        staging_at.unmount_all()
                    if attached_here:
                        await self._detach_if_unused(device, block=kind == "block")
                    if made:
                        staging_at.remove_after_failure()
                    raise
            if device in self.unrecorded.get(volume_id, []):
                self.unrecorded[volume_id].remove(device)  # recorded now
            log.info("staged", extra={"fields": {"device": device, "fs_type": fs_type}})
            return csi_pb2.NodeStageVolumeResponse()

    async def NodeUnstageVolume(self, request: csi_pb2.NodeUnstageVolumeRequest, context):
        volume_id = csi_input.name(request.volume_id, "volume_id")
        staging = csi_input.path(request.staging_target_path, "staging_target_path")
        with self.inflight.hold(volume_id):
            rec = self.records.get(volume_id)
            if rec is None and not self._volume_exists(volume_id):
                raise NotFound(f"volume {volume_id!r} does not exist on node {self.config.node_id}")
            if rec is not None:
                live = [t for t in rec.published if copath.mounted_at(t, "target_path") is not None]
                if live:
                    raise FailedPrecondition(f"volume {volume_id} is still published at {', '.join(live)}")
            backing = self.pool.volume_file(volume_id)
            devices = self._devices(volume_id, backing, rec)  # read-only ones of raw block publishes too
            with copath.reach(staging, "staging_target_path", checked=True) as staging_at:
                staging_at.refuse_symlink()
                current = staging_at.mount_entry()
                if current is not None and (self._is_our_mount(current, devices) or rec is not None):
                    staging_at.unmount_all()
            # Whatever was mounted where (also a mount made through a path
            # that has changed since), the volume is unstaged only when no
            # mount of it remains.
            raw = rec is None or rec.access_type == "block" or any(loop.read_only(d) for d in devices)
            still = self._mounted_anywhere(devices, block=raw)
            if still is not None:
                raise FailedPrecondition(f"volume {volume_id} is still mounted at {still.mount_point}")
            for dev in devices:
                await loop.detach(dev)
            self.unrecorded.pop(volume_id, None)
            await self.records.delete(volume_id)
            return csi_pb2.NodeUnstageVolumeResponse()

    # -- publish / unpublish --------------------------------------------------------------

    async def NodePublishVolume(self, request: csi_pb2.NodePublishVolumeRequest, context):
        volume_id = csi_input.name(request.volume_id, "volume_id")
        target = csi_input.path(request.target_path, "target_path")
        kind = self._validate_capability(request)
        staging = csi_input.path(request.staging_target_path, "staging_target_path")
        if request.defer_fs_ops:
            raise FailedPrecondition(
                "defer_fs_ops: this driver mounts on the host and cannot defer; run it behind `crust shim`")
        mode = request.volume_capability.access_mode.mode
        readonly = request.readonly or mode in csi_input.READ_ONLY_MODES
        with self.inflight.hold(volume_id), \
                copath.reach(target, "target_path", checked=True) as target_at, \
                copath.reach(staging, "staging_target_path", checked=True) as staging_at:
            target_at.refuse_symlink()
            staging_at.refuse_symlink()
            backing = self._backing_file(volume_id)
            rec = self.records.get(volume_id)
            if rec is None or rec.staging_path != staging:
                raise FailedPrecondition(f"volume {volume_id} is not staged at {staging}; call NodeStageVolume first")
            if rec.access_type != kind:
                raise InvalidArgument(f"volume_capability: the volume was staged as {rec.access_type}, not {kind}")
            devices = self._devices(volume_id, backing, rec)
            device = self._writable(devices)
            if device is None:
                raise FailedPrecondition(f"volume {volume_id} is not attached; call NodeStageVolume again")
            wanted = NodePublish(readonly=readonly, access_type=kind)
            current = target_at.mount_entry()
            if current is not None and self._is_our_mount(current, devices):
                known = rec.published.get(target)
                if known is not None and not known.same_request(wanted):
                    raise AlreadyExists(f"volume {volume_id} is published at {target} with readonly={known.readonly}")
                if known is None:
                    # Mounted before a crash; adopt it.
                    wanted.device = self._read_only_device(current, backing) or ""
                    rec.published[target] = wanted
                    await self.records.put(volume_id, rec)
                return csi_pb2.NodePublishVolumeResponse()
            if current is not None:
                raise FailedPrecondition(f"target_path {target} has another file system mounted ({current.source})")
            if mode == AccessMode.SINGLE_NODE_SINGLE_WRITER:
                others = [t for t in rec.published
                          if t != target and copath.mounted_at(t, "target_path") is not None]
                if others:
                    raise FailedPrecondition(
                        f"volume {volume_id} has access mode SINGLE_NODE_SINGLE_WRITER and is published at {others[0]}")
            if kind == "mount":
                staged = staging_at.mount_entry()
                if staged is None or not self._is_our_mount(staged, [device]):
                    # Binding the bare directory would hand the workload the
                    # host's file system instead of the volume.
                    raise FailedPrecondition(
                        f"volume {volume_id} is not mounted at staging_target_path {staging}; "
                        "call NodeStageVolume again")
            target_at.ensure_parents()  # now that nothing refuses the publish
            made = target_at.mkdir() if kind == "mount" else target_at.make_file()
            source: copath.CoPath | str = staging_at
            bound = False
            try:
                if kind == "block":
                    source = device
                    if readonly:
                        # A read-only bind mount does not stop writes through a
                        # device node; a read-only loop device of its own does.
                        source = await loop.attach(backing, read_only=True)
                        wanted.device = source
                target_at.bind_from(source, readonly=readonly)
                bound = True
                # Recorded before it is answered; a publish that cannot be
                # recorded (a full disk) is undone below.
                await self.records.put(volume_id, rec.model_copy(
                    update={"published": {**rec.published, target: wanted}}))
            except Exception:
                if bound:
                    target_at.unmount_all()
                if isinstance(source, str) and source != device:
                    await self._detach_if_unused(source, block=True)
                if made:
                    target_at.remove_after_failure()
                raise
            return csi_pb2.NodePublishVolumeResponse()

    async def NodeUnpublishVolume(self, request: csi_pb2.NodeUnpublishVolumeRequest, context):
        volume_id = csi_input.name(request.volume_id, "volume_id")
        target = csi_input.path(request.target_path, "target_path")
        with self.inflight.hold(volume_id), copath.reach(target, "target_path", checked=True) as target_at:
            # A target reached through a link is refused, never "OK": the
            # mount it may lead to stays until the CO names its real path.
            target_at.refuse_symlink()
            rec = self.records.get(volume_id)
            if rec is None and not self._volume_exists(volume_id):
                raise NotFound(f"volume {volume_id!r} does not exist on node {self.config.node_id}")
            backing = self.pool.volume_file(volume_id)
            current = target_at.mount_entry()
            if current is not None:
                if not (self._is_our_mount(current, self._devices(volume_id, backing, rec))
                        or (rec and target in rec.published)):
                    raise FailedPrecondition(f"target_path {target} holds a mount that is not volume {volume_id}")
                private = self._read_only_device(current, backing)
                target_at.unmount_all()
                if private is not None and not await self._detach_if_unused(private, block=True):
                    # Still bound elsewhere: NodeUnstageVolume detaches it later.
                    self.unrecorded.setdefault(volume_id, []).append(private)
            # The spec asks the plugin to remove what it created at target.
            target_at.remove()
            if rec is not None and target in rec.published:
                del rec.published[target]
                await self.records.put(volume_id, rec)
            return csi_pb2.NodeUnpublishVolumeResponse()

    # -- stats / expand -------------------------------------------------------------------

    def _mount_for(self, volume_id: str, path: copath.CoPath, devices: list[str]) -> mount.MountEntry:
        entry = path.mount_entry()
        if entry is None or not self._is_our_mount(entry, devices):
            raise NotFound(f"volume {volume_id} is not mounted at volume_path {path.path!r}")
        return entry

    async def NodeGetVolumeStats(self, request: csi_pb2.NodeGetVolumeStatsRequest, context):
        volume_id = csi_input.name(request.volume_id, "volume_id")
        path = csi_input.lookup_path(request.volume_path, "volume_path")
        if not self._volume_exists(volume_id):
            raise NotFound(f"volume {volume_id!r} does not exist on node {self.config.node_id}")
        with copath.reach(path, "volume_path", checked=True) as volume_at:
            return self._stats(volume_id, volume_at)

    def _stats(self, volume_id: str, volume_at: copath.CoPath) -> csi_pb2.NodeGetVolumeStatsResponse:
        path = volume_at.path
        backing = self.pool.volume_file(volume_id)
        rec = self.records.get(volume_id)
        entry = self._mount_for(volume_id, volume_at, self._devices(volume_id, backing, rec))
        Usage = csi_pb2.VolumeUsage
        condition = csi_pb2.VolumeCondition(abnormal=False, message="healthy")
        if not backing.exists():
            condition = csi_pb2.VolumeCondition(abnormal=True, message="the backing file was removed")
        if entry.fs_type == "devtmpfs":
            size = blockdev.size_bytes("/dev" + entry.root)
            return csi_pb2.NodeGetVolumeStatsResponse(
                usage=[Usage(unit=Usage.BYTES, total=size)], volume_condition=condition)
        wanted_ro = rec is not None and rec.published.get(path, NodePublish()).readonly
        with volume_at.opened() as fd:
            response = volumefs.stats(fd, went_readonly="ro" in entry.super_options and not wanted_ro)
        if condition.abnormal:
            response.volume_condition.CopyFrom(condition)
        return response

    async def NodeExpandVolume(self, request: csi_pb2.NodeExpandVolumeRequest, context):
        volume_id = csi_input.name(request.volume_id, "volume_id")
        if not self._volume_exists(volume_id):
            raise NotFound(f"volume {volume_id!r} does not exist on node {self.config.node_id}")
        path = csi_input.lookup_path(request.volume_path, "volume_path")
        if request.defer_fs_ops:
            raise FailedPrecondition("defer_fs_ops: this driver cannot defer; run it behind `crust shim`")
        with self.inflight.hold(volume_id), copath.reach(path, "volume_path", checked=True) as volume_at:
            backing = self.pool.volume_file(volume_id)
            rec = self.records.get(volume_id)
            devices = self._devices(volume_id, backing, rec)
            device = self._writable(devices)
            if device is None:
                raise FailedPrecondition(f"volume {volume_id} is not staged on node {self.config.node_id}")
            entry = self._mount_for(volume_id, volume_at, devices)
            if self.grow_volume is not None and request.HasField("capacity_range"):
                await self.grow_volume(volume_id, request.capacity_range)
            for dev in devices:  # read-only publishes grow too
                await loop.refresh_capacity(dev)
            size = blockdev.size_bytes(device)
            required = request.capacity_range.required_bytes if request.HasField("capacity_range") else 0
            if required > size:
                raise OutOfRange(
                    f"capacity_range.required_bytes is {required} but the device has {size} bytes; "
                    "call ControllerExpandVolume first")
            if entry.fs_type == "devtmpfs":
                return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=size)
            if rec is None:
                with volume_at.opened() as fd:
                    await volumefs.grow_online(entry.fs_type, device, fd)
                return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=size)
            # Through the staging mount, which is writable whatever the
            # target's bind says (xfs grows only through a writable mount).
            with copath.reach(rec.staging_path, "staging_target_path", checked=True) as staging_at, \
                    staging_at.opened() as fd:
                await volumefs.grow_online(entry.fs_type, device, fd)
            return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=size)

    # -- info ---------------------------------------------------------------------------------

    async def NodeGetCapabilities(self, request, context):
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[
            csi_pb2.NodeServiceCapability(rpc=csi_pb2.NodeServiceCapability.RPC(type=c))
            for c in CAPABILITIES + (ALPHA_CAPABILITIES if self.config.advertise_alpha else [])
        ])

    async def NodeGetInfo(self, request, context):
        return csi_pb2.NodeGetInfoResponse(
            node_id=self.config.node_id,
            max_volumes_per_node=self.config.max_volumes_per_node,
            accessible_topology=csi_pb2.Topology(segments={TOPOLOGY_KEY: self.config.node_id}),
        )

    async def NodeGetID(self, request, context):
        return csi_pb2.NodeGetIDResponse(node_id=self.config.node_id)


def _node_record_belongs(key: str, record: NodeVolumeRecord) -> str:
    if record.volume_id != key:
        return f"it describes {record.volume_id!r}, not {key!r}, the name of its file"
    if not backend.valid_id(key):
        return f"{key!r} is not an id this driver makes"
    return ""
