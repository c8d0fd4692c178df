"""The controller's catalog: volume and snapshot records plus the node pools.

Records live on disk (crust.common.recordstore); this class keeps the
in-memory indexes (by id and by name) that every RPC needs, and on start it
reconciles records with the backing files they describe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

from crust.common.aio import in_thread
from crust.common.formats import NewerFormat
from crust.common.recordstore import RecordStore
from crust.common.saferead import Refused, read_model
from crust.driver.backend import loop as backend
from crust.driver.records import (
    GroupSnapshotRecord,
    Lifecycle,
    PoolRecord,
    SnapshotRecord,
    VolumeRecord,
)

log = logging.getLogger(__name__)


class Catalog:
    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.volume_store = RecordStore(data_dir / "controller" / "volumes", VolumeRecord, _volume_belongs)
        self.snapshot_store = RecordStore(data_dir / "controller" / "snapshots", SnapshotRecord, _snapshot_belongs)
        self.group_store = RecordStore(data_dir / "controller" / "groups", GroupSnapshotRecord, _group_belongs)
        self.groups: dict[str, GroupSnapshotRecord] = {}
        self.group_names: dict[str, str] = {}
        self.volumes: dict[str, VolumeRecord] = {}
        self.snapshots: dict[str, SnapshotRecord] = {}
        self.volume_names: dict[str, str] = {}
        self.snapshot_names: dict[str, str] = {}
        # Per-node sums, kept as records are indexed and forgotten, so that
        # placing a volume and checking an attach limit cost the same with a
        # thousand volumes as with ten. What each record last added is kept
        # to take it out again when the record changes.
        self._promised: dict[str, int] = {}  # node -> bytes of its volumes and snapshots
        self._attached: dict[str, set[str]] = {}  # node -> volumes published to it
        self._volume_marks: dict[str, tuple[str, int, tuple[str, ...]]] = {}
        self._snapshot_marks: dict[str, tuple[str, int]] = {}

    # -- pools (the node registry of the loop backend) ----------------------

    def pool(self, node_id: str) -> backend.Pool:
        return backend.Pool(self.data_dir, node_id)

    def pools(self) -> dict[str, PoolRecord]:
        found = {}
        for path in sorted((self.data_dir / "pools").glob("*/pool.json")):
            try:
                record = read_model(PoolRecord, path)
                if record.node_id != path.parent.name or not backend.valid_node(record.node_id):
                    # Backing files would be made in the pool the record
                    # names, wherever that leads.
                    raise Refused(str(path), f"names node {record.node_id!r}, not its directory's")
            except NewerFormat as exc:
                # A node running a newer crust: its pool is not placed on
                # by a controller that would misread it.
                log.error("pool record of a newer format not used: %s", exc)
                continue
            except (OSError, ValueError) as exc:
                log.error("unreadable pool record %s, ignored: %s", path, exc)
                continue
            found[record.node_id] = record
        return found

    def provisioned(self, node_id: str) -> int:
        """Bytes promised on a pool: volumes plus snapshots."""
        return self._promised.get(node_id, 0)

    def attached_count(self, node_id: str) -> int:
        """How many volumes are published to a node."""
        return len(self._attached.get(node_id, ()))

    def available(self, pool: PoolRecord) -> int:
        return max(0, pool.capacity_bytes - self.provisioned(pool.node_id))

    # -- load and reconcile ---------------------------------------------------

    def load(self) -> None:
        for key, volume in self.volume_store.load_all():
            if volume.state is not Lifecycle.READY:
                self._finish_volume(volume)
                continue
            self._index_volume(volume)
        for key, snap in self.snapshot_store.load_all():
            if snap.state is not Lifecycle.READY:
                self._finish_snapshot(snap)
                continue
            self._index_snapshot(snap)
        for key, group in self.group_store.load_all():
            if group.state is not Lifecycle.READY:
                # Members of an unfinished group are removed with it; the CO
                # retries the whole group by name. A member made just before
                # the crash may not be listed in the group record yet, but it
                # names its group.
                members = set(group.snapshot_ids) | {
                    sid for sid, snap in self.snapshots.items() if snap.group_snapshot_id == group.group_snapshot_id}
                for sid in sorted(members):
                    snap = self.snapshots.pop(sid, None)
                    if snap is not None:
                        self.snapshot_names.pop(snap.name, None)
                        self._unmark_snapshot(sid)
                        self._finish_snapshot(snap)
                self.group_store.delete_sync(group.group_snapshot_id)
                continue
            self.groups[group.group_snapshot_id] = group
            self.group_names[group.name] = group.group_snapshot_id
        for node_id in self.pools():
            removed = self.pool(node_id).clean_partials()
            if removed:
                log.info("removed %d partial backing files from pool %s", removed, node_id)
        log.info("catalog loaded", extra={"fields": {"volumes": len(self.volumes), "snapshots": len(self.snapshots)}})

    def _finish_volume(self, volume: VolumeRecord) -> None:
        # A create that did not reach READY is rolled back: the CO retries
        # CreateVolume with the same name and gets a complete volume. A
        # delete that did not finish is finished.
        self._remove_volume(volume)
        log.info("finished interrupted %s of volume %s", volume.state.value, volume.volume_id)

    def _remove_volume(self, volume: VolumeRecord) -> None:
        """The backing file (complete or partial) and the record, durably."""
        path = self.volume_file(volume)
        backend.remove(path)
        backend.remove(self.pool(volume.node).temp_file(path))
        self.volume_store.delete_sync(volume.volume_id)

    def _finish_snapshot(self, snap: SnapshotRecord) -> None:
        path = self.pool(snap.node).snapshot_file(snap.snapshot_id)
        backend.remove(path)
        backend.remove(self.pool(snap.node).temp_file(path))
        self.snapshot_store.delete_sync(snap.snapshot_id)
        log.info("finished interrupted %s of snapshot %s", snap.state.value, snap.snapshot_id)

    # -- indexes --------------------------------------------------------------

    def _index_volume(self, volume: VolumeRecord) -> None:
        self.volumes[volume.volume_id] = volume
        self.volume_names[volume.name] = volume.volume_id
        self._unmark_volume(volume.volume_id)
        mark = (volume.node, volume.capacity_bytes, tuple(volume.published))
        self._volume_marks[volume.volume_id] = mark
        self._promised[volume.node] = self._promised.get(volume.node, 0) + volume.capacity_bytes
        for node in mark[2]:
            self._attached.setdefault(node, set()).add(volume.volume_id)

    def _unmark_volume(self, volume_id: str) -> None:
        mark = self._volume_marks.pop(volume_id, None)
        if mark is not None:
            self._promised[mark[0]] -= mark[1]
            for node in mark[2]:
                self._attached[node].discard(volume_id)

    def _index_snapshot(self, snap: SnapshotRecord) -> None:
        self.snapshots[snap.snapshot_id] = snap
        self.snapshot_names[snap.name] = snap.snapshot_id
        self._unmark_snapshot(snap.snapshot_id)
        self._snapshot_marks[snap.snapshot_id] = (snap.node, snap.size_bytes)
        self._promised[snap.node] = self._promised.get(snap.node, 0) + snap.size_bytes

    def _unmark_snapshot(self, snapshot_id: str) -> None:
        mark = self._snapshot_marks.pop(snapshot_id, None)
        if mark is not None:
            self._promised[mark[0]] -= mark[1]

    async def save_volume(self, volume: VolumeRecord) -> None:
        await self.volume_store.put(volume.volume_id, volume)
        self._index_volume(volume)

    async def create_volume(self, volume: VolumeRecord, make_backing: Callable[[Path], None]) -> None:
        """Make a CREATING volume READY: its record and make_backing(path) of
        its backing file, in one worker trip, then the volume indexed."""
        await in_thread(self._create_volume_files, volume, make_backing, then=partial(self._index_volume, volume))

    def _create_volume_files(self, volume: VolumeRecord, make_backing: Callable[[Path], None]) -> None:
        # (worker thread) The CREATING record reaches the disk before the
        # backing file and the READY record after it, so a restart rolls back
        # whatever a crash interrupts; a failure is rolled back here the same way.
        self.volume_store.put_sync(volume.volume_id, volume)
        try:
            make_backing(self.volume_file(volume))
            volume.state = Lifecycle.READY  # not indexed yet: no other call sees it
            self.volume_store.put_sync(volume.volume_id, volume)
        except BaseException:
            self._remove_volume(volume)
            raise

    async def delete_volume(self, volume: VolumeRecord, check: Callable[[], None]) -> None:
        """check() (it raises to refuse), then the volume's files and record
        removed, in one worker trip; then the volume forgotten."""
        await in_thread(self._delete_volume_files, volume, check, then=partial(self._drop_volume, volume))

    def _delete_volume_files(self, volume: VolumeRecord, check: Callable[[], None]) -> None:
        # (worker thread) The DELETING record goes first, so a restart
        # finishes a delete that a crash interrupts.
        check()
        # The calls that write this record wait on the volume's in-flight key;
        # the indexed one stays READY unless the delete goes through.
        self.volume_store.put_sync(volume.volume_id, volume.model_copy(update={"state": Lifecycle.DELETING}))
        backend.remove(self.volume_file(volume))
        self.volume_store.delete_sync(volume.volume_id)

    def _drop_volume(self, volume: VolumeRecord) -> None:
        self.volumes.pop(volume.volume_id, None)
        self._unmark_volume(volume.volume_id)
        if self.volume_names.get(volume.name) == volume.volume_id:
            del self.volume_names[volume.name]

    async def save_snapshot(self, snap: SnapshotRecord) -> None:
        await self.snapshot_store.put(snap.snapshot_id, snap)
        self._index_snapshot(snap)

    async def forget_snapshot(self, snap: SnapshotRecord) -> None:
        await self.snapshot_store.delete(snap.snapshot_id)
        self.snapshots.pop(snap.snapshot_id, None)
        self._unmark_snapshot(snap.snapshot_id)
        if self.snapshot_names.get(snap.name) == snap.snapshot_id:
            del self.snapshot_names[snap.name]

    async def save_group(self, group: GroupSnapshotRecord) -> None:
        await self.group_store.put(group.group_snapshot_id, group)
        self.groups[group.group_snapshot_id] = group
        self.group_names[group.name] = group.group_snapshot_id

    async def forget_group(self, group: GroupSnapshotRecord) -> None:
        await self.group_store.delete(group.group_snapshot_id)
        self.groups.pop(group.group_snapshot_id, None)
        if self.group_names.get(group.name) == group.group_snapshot_id:
            del self.group_names[group.name]

    def volume_by_name(self, name: str) -> VolumeRecord | None:
        vid = self.volume_names.get(name)
        return self.volumes.get(vid) if vid else None

    def snapshot_by_name(self, name: str) -> SnapshotRecord | None:
        sid = self.snapshot_names.get(name)
        return self.snapshots.get(sid) if sid else None

    def volume_file(self, volume: VolumeRecord) -> Path:
        return self.pool(volume.node).volume_file(volume.volume_id)

    def snapshot_file(self, snap: SnapshotRecord) -> Path:
        return self.pool(snap.node).snapshot_file(snap.snapshot_id)


# -- what a record must be to be loaded (crust.common.recordstore) -----------------


def _ids(key: str, own_id: str, node: str | None) -> str:
    if own_id != key:
        return f"it describes {own_id!r}, not {key!r}, the name of its file"
    if not backend.valid_id(own_id):
        return f"{own_id!r} is not an id this driver makes"
    if node is not None and not backend.valid_node(node):
        return f"its pool {node!r} is not a node id (a directory under pools/)"
    return ""


def _volume_belongs(key: str, volume: VolumeRecord) -> str:
    return _ids(key, volume.volume_id, volume.node)


def _snapshot_belongs(key: str, snap: SnapshotRecord) -> str:
    return _ids(key, snap.snapshot_id, snap.node)


def _group_belongs(key: str, group: GroupSnapshotRecord) -> str:
    bad = [sid for sid in group.snapshot_ids if not backend.valid_id(sid)]
    if bad:
        return f"it names snapshot {bad[0]!r}, not an id this driver makes"
    return _ids(key, group.group_snapshot_id, None)
