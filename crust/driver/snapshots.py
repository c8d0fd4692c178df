"""The controller's snapshot calls: a snapshot is a copy of a volume's
backing file in its node's pool, made all or nothing (recorded CREATING
first, READY once whole, removed with its record on any failure), and
crash-consistent for an attached volume."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from crust.api import csi_pb2
from crust.common import csi_input
from crust.common.errors import AlreadyExists, FailedPrecondition, NotFound, ResourceExhausted
from crust.driver.backend import loop as backend
from crust.driver.paging import paged
from crust.driver.records import Lifecycle, SnapshotRecord, VolumeRecord


def timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


class SnapshotCalls:
    """A mixin of the controller service: its catalog, inflight and
    _volume."""

    def snapshot_message(self, s: SnapshotRecord) -> csi_pb2.Snapshot:
        return csi_pb2.Snapshot(
            snapshot_id=s.snapshot_id,
            source_volume_id=s.source_volume_id,
            size_bytes=s.size_bytes,
            creation_time=timestamp(s.created_at),
            ready_to_use=True,
            group_snapshot_id=s.group_snapshot_id,
        )

    async def CreateSnapshot(self, request: csi_pb2.CreateSnapshotRequest, context):
        source_id = csi_input.name(request.source_volume_id, "source_volume_id")
        name = csi_input.name(request.name)
        with self.inflight.hold(f"snapshot-name:{name}"):
            existing = self.catalog.snapshot_by_name(name)
            if existing is not None:
                if existing.source_volume_id != source_id:
                    raise AlreadyExists(f"snapshot {name!r} exists for volume {existing.source_volume_id}")
                return csi_pb2.CreateSnapshotResponse(snapshot=self.snapshot_message(existing))
            volume = self._volume(source_id, "source_volume_id")
            snap = await self.snapshot_volume(volume, name, dict(request.parameters))
            return csi_pb2.CreateSnapshotResponse(snapshot=self.snapshot_message(snap))

    async def snapshot_volume(self, volume: VolumeRecord, name: str, parameters: dict[str, str],
                              group_snapshot_id: str = "") -> SnapshotRecord:
        """Copy a volume's backing file into a new snapshot, all or nothing."""
        pool = self.catalog.pools().get(volume.node)
        if pool and self.catalog.available(pool) < volume.capacity_bytes:
            raise ResourceExhausted(f"node {volume.node} has no room for a {volume.capacity_bytes}-byte snapshot")
        snap = SnapshotRecord(snapshot_id=backend.new_id("snap"), name=name, source_volume_id=volume.volume_id,
                              node=volume.node, size_bytes=volume.capacity_bytes, parameters=parameters,
                              group_snapshot_id=group_snapshot_id, state=Lifecycle.CREATING)
        path = self.catalog.snapshot_file(snap)
        await self.catalog.snapshot_store.put(snap.snapshot_id, snap)
        try:
            self.catalog.pool(volume.node).ensure()
            # A snapshot of an attached volume is crash-consistent: it holds
            # what had reached the backing file when the copy ran.
            await backend.copy_into(self.catalog.volume_file(volume), path, volume.capacity_bytes)
            snap.state = Lifecycle.READY
            await self.catalog.save_snapshot(snap)
        except BaseException:
            backend.remove(path)
            backend.remove(self.catalog.pool(volume.node).temp_file(path))
            await self.catalog.snapshot_store.delete(snap.snapshot_id)
            raise
        return snap

    async def delete_snapshot_files(self, snap: SnapshotRecord) -> None:
        snap.state = Lifecycle.DELETING
        await self.catalog.snapshot_store.put(snap.snapshot_id, snap)
        backend.remove(self.catalog.snapshot_file(snap))
        await self.catalog.forget_snapshot(snap)

    async def DeleteSnapshot(self, request: csi_pb2.DeleteSnapshotRequest, context):
        snapshot_id = csi_input.name(request.snapshot_id, "snapshot_id")
        with self.inflight.hold(snapshot_id):
            snap = self.catalog.snapshots.get(snapshot_id)
            if snap is None:
                return csi_pb2.DeleteSnapshotResponse()
            if snap.group_snapshot_id in self.catalog.groups:
                raise FailedPrecondition(f"snapshot {snapshot_id} belongs to group snapshot "
                                         f"{snap.group_snapshot_id}; delete the group instead")
            await self.delete_snapshot_files(snap)
            return csi_pb2.DeleteSnapshotResponse()

    async def ListSnapshots(self, request: csi_pb2.ListSnapshotsRequest, context):
        snaps = self.catalog.snapshots
        if request.snapshot_id:
            ids = [request.snapshot_id] if request.snapshot_id in snaps else []
        else:
            ids = sorted(snaps)
        if request.source_volume_id:
            ids = [i for i in ids if snaps[i].source_volume_id == request.source_volume_id]
        page, token = paged(ids, request.starting_token, request.max_entries)
        return csi_pb2.ListSnapshotsResponse(
            entries=[csi_pb2.ListSnapshotsResponse.Entry(snapshot=self.snapshot_message(snaps[i])) for i in page],
            next_token=token,
        )

    async def GetSnapshot(self, request: csi_pb2.GetSnapshotRequest, context):
        snapshot_id = csi_input.name(request.snapshot_id, "snapshot_id")
        snap = self.catalog.snapshots.get(snapshot_id)
        if snap is None:
            raise NotFound(f"snapshot {snapshot_id!r} does not exist")
        return csi_pb2.GetSnapshotResponse(snapshot=self.snapshot_message(snap))
