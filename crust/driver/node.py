"""CSI Node service of the loop driver.

Stage attaches the volume's backing file to a loop device (and, for the
mount access type, formats a blank device and mounts it at the staging
path); publish bind-mounts the staged file system, or the device node for
raw block, to the target. What is attached and mounted is always read back
from the kernel (crust.sys.loop, crust.sys.mount), so every RPC converges
when retried and after a restart; the node's records only keep what the
kernel cannot tell (which staging path and targets belong to which volume,
with which capability).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from crust.api import csi_pb2, csi_pb2_grpc
from crust.common import copath, csi_input, volumefs
from crust.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
)
from crust.common.atomicfile import write_atomic
from crust.common.inflight import InFlight
from crust.common.recordstore import RecordStore
from crust.driver.backend import loop as backend
from crust.driver.config import TOPOLOGY_KEY, DriverConfig
from crust.driver.records import NodePublish, NodeVolumeRecord, PoolRecord
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
        self.records = RecordStore(config.data_dir / "node" / config.node_id / "volumes", NodeVolumeRecord)
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
        write_atomic(self.pool.root / "pool.json", record.model_dump_json(indent=1).encode(), mode=0o644)
        return record

    def reconcile(self) -> None:
        """Bring records and the kernel's state together after a restart.

        - targets a record lists whose mount is gone are dropped (a reboot
          cleared them; kubelet publishes again);
        - loop devices over files of this pool that no record explains and
          nothing mounts are detached (a crash between attach and record).
        """
        known = {}
        for key, rec in self.records.load_all():
            known[rec.volume_id] = rec
            gone = [t for t in rec.published if mount.at(t) is None]
            for target in gone:
                del rec.published[target]
            if gone:
                self.records.put_sync(rec.volume_id, rec)
                log.info("dropped vanished publishes", extra={"fields": {"volume_id": rec.volume_id, "targets": gone}})
        pool_dir = str(self.pool.volumes.resolve()) + "/"
        for device, backing in loop.attached().items():
            if not backing.startswith(pool_dir):
                continue  # not ours: never touch it
            volume_id = Path(backing.split(" (deleted)")[0]).stem
            if volume_id in known:
                continue
            majmin = blockdev.major_minor(device)
            if mount.of_device(*majmin) or mount.of_device_node(device):
                log.warning("unrecorded loop device is mounted; leaving it", extra={"fields": {"device": device}})
                continue
            loop.detach_sync(device)
            log.info("detached orphan loop device", extra={"fields": {"device": device, "volume_id": volume_id}})

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

    @staticmethod
    def _device_of(backing: Path) -> str | None:
        """The writable loop device of the volume (read-only ones serve
        read-only raw block publishes, see NodePublishVolume)."""
        devices = [d for d in loop.devices_for(backing) if not loop.read_only(d)]
        return devices[0] if devices else None

    @staticmethod
    async def _detach_if_unused(device: str) -> None:
        """Detach a loop device this driver attached, unless something mounts it."""
        try:
            if mount.of_device(*blockdev.major_minor(device)) or mount.of_device_node(device):
                return
            await loop.detach(device)
        except (OSError, ValueError, CommandError) as exc:
            log.warning("could not detach", extra={"fields": {"device": device, "error": str(exc)}})

    @staticmethod
    def _read_only_device(entry: mount.MountEntry, backing: Path) -> str | None:
        """The read-only loop device a read-only raw block publish bound at this entry."""
        if entry.fs_type != "devtmpfs":
            return None
        device = "/dev" + entry.root
        return device if device in loop.devices_for(backing) and loop.read_only(device) else None

    async def _attach(self, backing: Path) -> str:
        device = self._device_of(backing)
        if device is None:
            device = await loop.attach(backing)
            log.info("attached", extra={"fields": {"device": device}})
        return device

    @staticmethod
    def _is_our_mount(entry: mount.MountEntry, device: str | None, backing: Path | None = None) -> bool:
        """Is this mount entry the file system or the device node of `device`
        (or, given backing, of any loop device over the volume's file)?"""
        devices = loop.devices_for(backing) if backing is not None else [device] if device else []
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
                attached_here = self._device_of(backing) is None
                device = await self._attach(backing)
                try:
                    if kind == "mount":
                        current = mount.at(staging)
                        if current is not None and not self._is_our_mount(current, device):
                            raise FailedPrecondition(
                                f"staging_target_path {staging} has another file system mounted ({current.source})")
                        if current is None:
                            await volumefs.format_if_blank(device, fs_type, volume_id)
                            await volumefs.fill_device_offline(fs_type, device)
                            await staging_at.mount(device, fs_type, volumefs.mount_options(fs_type, flags))
                            if fs_type == "xfs" and cap.access_mode.mode not in csi_input.READ_ONLY_MODES:
                                await volumefs.grow_online(fs_type, device, staging)
                except Exception:
                    # A failed stage leaves no loop device behind: no NodeUnstageVolume
                    # follows a failed stage, and DeleteVolume would orphan the device.
                    if attached_here:
                        await self._detach_if_unused(device)
                    if made:
                        staging_at.remove_after_failure()
                    raise
            record = NodeVolumeRecord(volume_id=volume_id, staging_path=staging, access_type=kind,
                                      access_mode=cap.access_mode.mode, fs_type=fs_type, mount_flags=flags,
                                      published=rec.published if rec else {})
            await self.records.put(volume_id, record)
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
                live = [t for t in rec.published if mount.at(t) is not None]
                if live:
                    raise FailedPrecondition(f"volume {volume_id} is still published at {', '.join(live)}")
            backing = self.pool.volume_file(volume_id)
            device = self._device_of(backing)
            with copath.reach(staging, "staging_target_path", checked=True) as staging_at:
                staging_at.refuse_symlink()
                current = mount.at(staging)
                if current is not None and (self._is_our_mount(current, device) or rec is not None):
                    staging_at.unmount_all()
            # Whatever was mounted where (also a mount made through a path
            # that has changed since), the volume is unstaged only when no
            # mount of it remains.
            devices = loop.devices_for(backing)  # read-only ones of raw block publishes too
            for dev in devices:
                still = mount.of_device(*blockdev.major_minor(dev)) + mount.of_device_node(dev)
                if still:
                    raise FailedPrecondition(
                        f"volume {volume_id} ({dev}) is still mounted at {still[0].mount_point}")
            for dev in devices:
                await loop.detach(dev)
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
            device = self._device_of(backing)
            if device is None:
                raise FailedPrecondition(f"volume {volume_id} is not attached; call NodeStageVolume again")
            wanted = NodePublish(readonly=readonly, access_type=kind)
            current = target_at.mount_entry()
            if current is not None and self._is_our_mount(current, device, backing):
                known = rec.published.get(target)
                if known is not None and known != wanted:
                    raise AlreadyExists(f"volume {volume_id} is published at {target} with readonly={known.readonly}")
                if known is None:
                    rec.published[target] = wanted  # mounted before a crash; adopt it
                    await self.records.put(volume_id, rec)
                return csi_pb2.NodePublishVolumeResponse()
            if current is not None:
                raise FailedPrecondition(f"target_path {target} has another file system mounted ({current.source})")
            if mode == AccessMode.SINGLE_NODE_SINGLE_WRITER:
                others = [t for t in rec.published if t != target and mount.at(t) is not None]
                if others:
                    raise FailedPrecondition(
                        f"volume {volume_id} has access mode SINGLE_NODE_SINGLE_WRITER and is published at {others[0]}")
            if kind == "mount":
                staged = mount.at(staging)
                if staged is None or not self._is_our_mount(staged, device):
                    # Binding the bare directory would hand the workload the
                    # host's file system instead of the volume.
                    raise FailedPrecondition(
                        f"volume {volume_id} is not mounted at staging_target_path {staging}; "
                        "call NodeStageVolume again")
            target_at.ensure_parents()  # now that nothing refuses the publish
            made = target_at.mkdir() if kind == "mount" else target_at.make_file()
            source: copath.CoPath | str = staging_at
            try:
                if kind == "block":
                    source = device
                    if readonly:
                        # A read-only bind mount does not stop writes through a
                        # device node; a read-only loop device of its own does.
                        source = await loop.attach(backing, read_only=True)
                target_at.bind_from(source, readonly=readonly)
            except Exception:
                if isinstance(source, str) and source != device:
                    await self._detach_if_unused(source)
                if made:
                    target_at.remove_after_failure()
                raise
            rec.published[target] = wanted
            await self.records.put(volume_id, rec)
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
            device = self._device_of(backing)
            current = target_at.mount_entry()
            if current is not None:
                if not (self._is_our_mount(current, device, backing) or (rec and target in rec.published)):
                    raise FailedPrecondition(f"target_path {target} holds a mount that is not volume {volume_id}")
                private = self._read_only_device(current, backing)
                target_at.unmount_all()
                if private is not None:
                    await self._detach_if_unused(private)
            # The spec asks the plugin to remove what it created at target.
            target_at.remove()
            if rec is not None and target in rec.published:
                del rec.published[target]
                await self.records.put(volume_id, rec)
            return csi_pb2.NodeUnpublishVolumeResponse()

    # -- stats / expand -------------------------------------------------------------------

    def _mount_for(self, volume_id: str, path: copath.CoPath, device: str | None) -> mount.MountEntry:
        path.refuse_symlink()
        entry = mount.at(path.path)
        if entry is None or not self._is_our_mount(entry, device, self.pool.volume_file(volume_id)):
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
        device = self._device_of(backing)
        entry = self._mount_for(volume_id, volume_at, device)
        Usage = csi_pb2.VolumeUsage
        condition = csi_pb2.VolumeCondition(abnormal=False, message="healthy")
        if not backing.exists():
            condition = csi_pb2.VolumeCondition(abnormal=True, message="the backing file was removed")
        if entry.fs_type == "devtmpfs":
            size = blockdev.size_bytes("/dev" + entry.root)
            return csi_pb2.NodeGetVolumeStatsResponse(
                usage=[Usage(unit=Usage.BYTES, total=size)], volume_condition=condition)
        rec = self.records.get(volume_id)
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
            device = self._device_of(backing)
            if device is None:
                raise FailedPrecondition(f"volume {volume_id} is not staged on node {self.config.node_id}")
            entry = self._mount_for(volume_id, volume_at, device)
            if self.grow_volume is not None and request.HasField("capacity_range"):
                await self.grow_volume(volume_id, request.capacity_range)
            for dev in loop.devices_for(backing):  # read-only publishes grow too
                await loop.refresh_capacity(dev)
            size = blockdev.size_bytes(device)
            required = request.capacity_range.required_bytes if request.HasField("capacity_range") else 0
            if required > size:
                raise OutOfRange(
                    f"capacity_range.required_bytes is {required} but the device has {size} bytes; "
                    "call ControllerExpandVolume first")
            if entry.fs_type == "devtmpfs":
                return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=size)
            rec = self.records.get(volume_id)
            mount_point = rec.staging_path if rec else path
            await volumefs.grow_online(entry.fs_type, device, mount_point)
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
