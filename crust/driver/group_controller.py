"""CSI GroupController service: snapshots of several volumes taken together.

A group snapshot is a set of ordinary snapshots (one per source volume)
under one id. The copies are taken back to back without freezing the
volumes, so each member is crash-consistent on its own; a workload that needs
the group to be consistent as a whole quiesces its writes first.
"""

from __future__ import annotations

from crust.api import csi_pb2, csi_pb2_grpc
from crust.common import csi_input
from crust.common.errors import AlreadyExists, InvalidArgument, NotFound
from crust.driver.backend import loop as backend
from crust.driver.controller import ControllerService
from crust.driver.snapshots import timestamp
from crust.driver.records import GroupSnapshotRecord, Lifecycle

RPC = csi_pb2.GroupControllerServiceCapability.RPC


class GroupControllerService(csi_pb2_grpc.GroupControllerServicer):
    def __init__(self, controller: ControllerService):
        self.controller = controller
        self.catalog = controller.catalog
        self.inflight = controller.inflight

    def _message(self, group: GroupSnapshotRecord) -> csi_pb2.VolumeGroupSnapshot:
        return csi_pb2.VolumeGroupSnapshot(
            group_snapshot_id=group.group_snapshot_id,
            snapshots=[self.controller.snapshot_message(self.catalog.snapshots[s])
                       for s in group.snapshot_ids if s in self.catalog.snapshots],
            creation_time=timestamp(group.created_at),
            ready_to_use=True,
        )

    def _check_members(self, group: GroupSnapshotRecord, snapshot_ids: list[str]) -> None:
        if snapshot_ids and sorted(snapshot_ids) != sorted(group.snapshot_ids):
            raise InvalidArgument(
                f"snapshot_ids do not match the members of group snapshot {group.group_snapshot_id}")

    async def GroupControllerGetCapabilities(self, request, context):
        return csi_pb2.GroupControllerGetCapabilitiesResponse(capabilities=[
            csi_pb2.GroupControllerServiceCapability(
                rpc=csi_pb2.GroupControllerServiceCapability.RPC(type=RPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT))
        ])

    async def CreateVolumeGroupSnapshot(self, request: csi_pb2.CreateVolumeGroupSnapshotRequest, context):
        name = csi_input.name(request.name)
        sources = list(request.source_volume_ids)
        if not sources:
            raise InvalidArgument("source_volume_ids is required (at least one)")
        if len(set(sources)) != len(sources):
            raise InvalidArgument("source_volume_ids lists a volume twice")
        with self.inflight.hold(f"group-name:{name}"):
            existing = self.catalog.groups.get(self.catalog.group_names.get(name, ""))
            if existing is not None:
                if sorted(existing.source_volume_ids) != sorted(sources):
                    raise AlreadyExists(f"group snapshot {name!r} exists with other source_volume_ids")
                return csi_pb2.CreateVolumeGroupSnapshotResponse(group_snapshot=self._message(existing))
            volumes = []
            for i, vid in enumerate(sources):
                volume = self.catalog.volumes.get(vid)
                if volume is None:
                    raise NotFound(f"source_volume_ids[{i}]: volume {vid!r} does not exist")
                volumes.append(volume)
            group = GroupSnapshotRecord(group_snapshot_id=backend.new_id("grp"), name=name,
                                        source_volume_ids=sources, parameters=dict(request.parameters))
            # The CREATING group record lists members as they are made, so a
            # crash leaves nothing that a restart cannot find and remove.
            await self.catalog.group_store.put(group.group_snapshot_id, group)
            try:
                for volume in volumes:
                    with self.inflight.hold(volume.volume_id):
                        snap = await self.controller.snapshot_volume(
                            volume, f"{name}-{volume.volume_id}", dict(request.parameters), group.group_snapshot_id)
                    group.snapshot_ids.append(snap.snapshot_id)
                    await self.catalog.group_store.put(group.group_snapshot_id, group)
                group.state = Lifecycle.READY
                await self.catalog.save_group(group)
            except BaseException:
                for sid in group.snapshot_ids:
                    snap = self.catalog.snapshots.get(sid)
                    if snap is not None:
                        await self.controller.delete_snapshot_files(snap)
                await self.catalog.group_store.delete(group.group_snapshot_id)
                raise
            return csi_pb2.CreateVolumeGroupSnapshotResponse(group_snapshot=self._message(group))

    async def DeleteVolumeGroupSnapshot(self, request: csi_pb2.DeleteVolumeGroupSnapshotRequest, context):
        group_id = csi_input.name(request.group_snapshot_id, "group_snapshot_id")
        with self.inflight.hold(group_id):
            group = self.catalog.groups.get(group_id)
            if group is None:
                return csi_pb2.DeleteVolumeGroupSnapshotResponse()
            self._check_members(group, list(request.snapshot_ids))
            group.state = Lifecycle.DELETING
            await self.catalog.group_store.put(group_id, group)
            for sid in group.snapshot_ids:
                snap = self.catalog.snapshots.get(sid)
                if snap is not None:
                    await self.controller.delete_snapshot_files(snap)
            await self.catalog.forget_group(group)
            return csi_pb2.DeleteVolumeGroupSnapshotResponse()

    async def GetVolumeGroupSnapshot(self, request: csi_pb2.GetVolumeGroupSnapshotRequest, context):
        group_id = csi_input.name(request.group_snapshot_id, "group_snapshot_id")
        group = self.catalog.groups.get(group_id)
        if group is None:
            raise NotFound(f"group snapshot {group_id!r} does not exist")
        self._check_members(group, list(request.snapshot_ids))
        return csi_pb2.GetVolumeGroupSnapshotResponse(group_snapshot=self._message(group))
