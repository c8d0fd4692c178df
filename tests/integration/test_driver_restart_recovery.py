"""What `crust driver` does at start with the state a crash left on disk.

The test writes the state a crash in the middle of an operation leaves, then
starts the driver: interrupted creates are rolled back, interrupted deletes
finished, temporaries and corrupt records put out of the way (a mounted or
published volume is never detached for them), and orphan loop devices of
the pool detached (and nothing else).
"""

from __future__ import annotations

import os
from pathlib import Path

from crust.api import csi_pb2
from crust.driver.backend import loop as backend
from crust.driver.records import GroupSnapshotRecord, Lifecycle, SnapshotRecord, VolumeRecord
from crust.sys import loop as sysloop
from tests.harness.driver_restart_calls import (
    NODE,
    SIZE,
    assert_nothing_left,
    backing,
    detach_if_ours,
    entries,
    list_snapshot_ids,
    list_volume_ids,
    losetup,
    node_records_dir,
    pool,
    put_record,
    read_record,
    records_dir,
    write_synced,
)
from tests.harness.daemons import MIB, DriverProcess, Root, block_cap, loop_autoclear, loops_left_under, mounted_at

# -- what lives under the test's root ---------------------------------------------------


def snapshot_file(d: DriverProcess, snapshot_id: str) -> Path:
    return pool(d) / "snapshots" / f"{snapshot_id}.img"


def make_file(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


# -- crash in the middle of an operation: the state it leaves ------------------------------


def fresh(root: Root) -> DriverProcess:
    """A driver started once (data dir and pool laid out) and stopped again."""
    d = root.driver().start()
    assert d.stop() == 0
    return d


def test_interrupted_create_is_rolled_back(root):
    d = fresh(root)
    vols = records_dir(d, "volumes")
    # Killed while writing the backing file: CREATING record + partial file.
    early = backend.new_id("vol")
    put_record(vols, early, VolumeRecord(volume_id=early, name="pvc-early", node=NODE, capacity_bytes=SIZE,
                                         required_bytes=SIZE, state=Lifecycle.CREATING))
    partial = pool(d) / "volumes" / f".{early}.img.partial"
    partial.write_bytes(b"\xab" * 4096)
    # Killed after the rename, before the READY record: the file looks complete.
    late = backend.new_id("vol")
    put_record(vols, late, VolumeRecord(volume_id=late, name="pvc-late", node=NODE, capacity_bytes=SIZE,
                                        required_bytes=SIZE, state=Lifecycle.CREATING))
    make_file(backing(d, late), SIZE)
    # Killed before the file was begun: a CREATING record alone.
    bare = backend.new_id("vol")
    put_record(vols, bare, VolumeRecord(volume_id=bare, name="pvc-bare", node=NODE, capacity_bytes=SIZE,
                                        state=Lifecycle.CREATING))

    d.start()
    assert entries(vols) == []
    assert entries(pool(d) / "volumes") == []
    assert list_volume_ids(d) == []
    for name, old in (("pvc-early", early), ("pvc-late", late), ("pvc-bare", bare)):
        vol = d.create(name, SIZE)
        assert vol.volume_id != old
        assert backing(d, vol.volume_id).stat().st_size == SIZE
        assert read_record(vols, vol.volume_id)["state"] == "ready"
        assert d.create(name, SIZE).volume_id == vol.volume_id
    assert len(list_volume_ids(d)) == 3
    assert not any(n.endswith(".partial") for n in entries(pool(d) / "volumes"))
    for vid in list_volume_ids(d):
        d.delete(vid)
    assert_nothing_left(d, root)


def test_interrupted_delete_is_finished(root):
    d = root.driver().start()
    vol = d.create("pvc-del", SIZE)
    keep = d.create("pvc-keep", SIZE)
    d.stop()
    vols = records_dir(d, "volumes")
    rec = VolumeRecord.model_validate_json((vols / f"{vol.volume_id}.json").read_bytes())
    rec.state = Lifecycle.DELETING
    put_record(vols, vol.volume_id, rec)
    assert backing(d, vol.volume_id).exists()

    d.start()
    assert not (vols / f"{vol.volume_id}.json").exists()
    assert not backing(d, vol.volume_id).exists()
    assert list_volume_ids(d) == [keep.volume_id]
    assert backing(d, keep.volume_id).stat().st_size == SIZE
    d.delete(vol.volume_id)  # the CO's retry of the delete succeeds
    again = d.create("pvc-del", SIZE)  # and the name is free again
    assert again.volume_id != vol.volume_id
    for vid in (again.volume_id, keep.volume_id):
        d.delete(vid)
    assert_nothing_left(d, root)


def test_interrupted_snapshot_create_and_delete(root):
    d = root.driver().start()
    vol = d.create("pvc-src", SIZE)
    d.stop()
    snaps = records_dir(d, "snapshots")
    creating = backend.new_id("snap")
    put_record(snaps, creating, SnapshotRecord(snapshot_id=creating, name="snap-a", source_volume_id=vol.volume_id,
                                               node=NODE, size_bytes=SIZE, state=Lifecycle.CREATING))
    (pool(d) / "snapshots").mkdir(parents=True, exist_ok=True)
    partial = pool(d) / "snapshots" / f".{creating}.img.partial"
    partial.write_bytes(b"\xcd" * 8192)
    deleting = backend.new_id("snap")
    put_record(snaps, deleting, SnapshotRecord(snapshot_id=deleting, name="snap-b", source_volume_id=vol.volume_id,
                                               node=NODE, size_bytes=SIZE, state=Lifecycle.DELETING))
    make_file(snapshot_file(d, deleting), SIZE)

    d.start()
    assert entries(snaps) == []
    assert entries(pool(d) / "snapshots") == []
    assert list_snapshot_ids(d) == []
    assert list_volume_ids(d) == [vol.volume_id]  # the source is untouched
    snap = d.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(
        source_volume_id=vol.volume_id, name="snap-a"), timeout=30).snapshot
    assert snap.snapshot_id != creating and snap.ready_to_use and snap.size_bytes == SIZE
    assert snapshot_file(d, snap.snapshot_id).stat().st_size == SIZE
    assert read_record(snaps, snap.snapshot_id)["state"] == "ready"
    d.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=deleting), timeout=30)
    d.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id), timeout=30)
    d.delete(vol.volume_id)
    assert_nothing_left(d, root)


def test_interrupted_group_snapshot_is_removed_with_all_its_members(root):
    d = root.driver().start()
    a = d.create("pvc-ga", SIZE)
    b = d.create("pvc-gb", SIZE)
    d.stop()
    group_id = backend.new_id("grp")
    snaps = records_dir(d, "snapshots")
    (pool(d) / "snapshots").mkdir(parents=True, exist_ok=True)
    members = []
    for vol in (a, b):
        sid = backend.new_id("snap")
        put_record(snaps, sid, SnapshotRecord(snapshot_id=sid, name=f"grp-1-{vol.volume_id}",
                                              source_volume_id=vol.volume_id, node=NODE, size_bytes=SIZE,
                                              group_snapshot_id=group_id, state=Lifecycle.READY))
        make_file(snapshot_file(d, sid), SIZE)
        members.append(sid)
    # Killed after the second member was READY but before the group record
    # listed it: the group names only the first.
    put_record(records_dir(d, "groups"), group_id, GroupSnapshotRecord(
        group_snapshot_id=group_id, name="grp-1", source_volume_ids=[a.volume_id, b.volume_id],
        snapshot_ids=members[:1], state=Lifecycle.CREATING))

    d.start()
    assert entries(records_dir(d, "groups")) == []
    assert entries(snaps) == []
    assert entries(pool(d) / "snapshots") == []
    assert list_snapshot_ids(d) == []
    # The CO retries the group by name and gets a complete one.
    group = d.group.CreateVolumeGroupSnapshot(csi_pb2.CreateVolumeGroupSnapshotRequest(
        name="grp-1", source_volume_ids=[a.volume_id, b.volume_id]), timeout=30).group_snapshot
    assert group.group_snapshot_id != group_id and len(group.snapshots) == 2
    assert sorted(list_snapshot_ids(d)) == sorted(s.snapshot_id for s in group.snapshots)
    d.group.DeleteVolumeGroupSnapshot(csi_pb2.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=group.group_snapshot_id), timeout=30)
    d.delete(a.volume_id)
    d.delete(b.volume_id)
    assert_nothing_left(d, root)


def test_stray_temporary_records_are_removed(root):
    d = root.driver().start()
    vol = d.create("pvc-tmp", SIZE)
    d.stage(vol.volume_id, root.path / "staging")
    d.kill()
    vols = records_dir(d, "volumes")
    strays = [
        vols / f".{vol.volume_id}.json.k3j4h2ab.tmp",  # half-written replacement of a live record
        vols / f".{backend.new_id('vol')}.json.zz81x0qq.tmp",  # first write of a record never finished
        node_records_dir(d) / f".{vol.volume_id}.json.a1b2c3d4.tmp",
    ]
    for stray in strays:
        stray.write_bytes(b'{"volume_id": "vol-')
    for kind in ("snapshots", "groups"):
        stray = records_dir(d, kind) / f".{backend.new_id('snap')}.json.q9w8e7r6.tmp"
        stray.parent.mkdir(parents=True, exist_ok=True)
        stray.write_bytes(b"")
        strays.append(stray)

    d.start()
    for stray in strays:
        assert not stray.exists(), stray
    assert entries(vols) == [f"{vol.volume_id}.json"]
    assert entries(node_records_dir(d)) == [f"{vol.volume_id}.json"]
    assert list_volume_ids(d) == [vol.volume_id]
    got = d.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id), timeout=10)
    assert not got.status.volume_condition.abnormal
    d.stage(vol.volume_id, root.path / "staging")  # the node record still serves
    assert len(sysloop.devices_for(backing(d, vol.volume_id))) == 1
    d.unstage(vol.volume_id, root.path / "staging")
    d.delete(vol.volume_id)
    assert_nothing_left(d, root)


def test_corrupt_controller_record_is_kept_aside(root):
    d = root.driver().start()
    bad = d.create("pvc-bad", SIZE)
    good = d.create("pvc-good", SIZE)
    d.kill()
    vols = records_dir(d, "volumes")
    (vols / f"{bad.volume_id}.json").write_bytes(b'{"volume_id": "' + bad.volume_id.encode() + b'", "na')

    d.start()
    assert entries(vols) == sorted([f"{bad.volume_id}.corrupt", f"{good.volume_id}.json"])
    assert list_volume_ids(d) == [good.volume_id]
    # The data of the unreadable record is kept for a human, never deleted.
    assert backing(d, bad.volume_id).stat().st_size == SIZE
    assert (vols / f"{bad.volume_id}.corrupt").read_bytes().endswith(b'"na')
    # A second restart leaves the corrupt copy alone.
    d.restart()
    assert (vols / f"{bad.volume_id}.corrupt").exists()
    d.delete(good.volume_id)
    assert list_volume_ids(d) == []


def test_corrupt_node_record_never_detaches_a_mounted_volume(root):
    d = root.driver().start()
    vol = d.create("pvc-node", SIZE)
    staging, target = root.path / "staging", root.path / "target"
    d.stage(vol.volume_id, staging)
    d.publish(vol.volume_id, staging, target)
    write_synced(target / "data", b"still here")
    device = sysloop.devices_for(backing(d, vol.volume_id))[0]
    d.kill()
    rec = node_records_dir(d) / f"{vol.volume_id}.json"
    rec.write_bytes(b"\x00\x00garbage")

    d.start()
    assert entries(node_records_dir(d)) == [f"{vol.volume_id}.corrupt"]
    # The device is mounted, so the unexplained attach is left alone (not
    # even a deferred detach).
    assert sysloop.devices_for(backing(d, vol.volume_id)) == [device]
    assert not loop_autoclear(device)
    assert (target / "data").read_bytes() == b"still here"
    # The CO's retries adopt what is there and the life finishes.
    d.stage(vol.volume_id, staging)
    d.publish(vol.volume_id, staging, target)
    assert sysloop.devices_for(backing(d, vol.volume_id)) == [device]
    assert (target / "data").read_bytes() == b"still here"
    d.unpublish(vol.volume_id, target)
    d.unstage(vol.volume_id, staging)
    (node_records_dir(d) / f"{vol.volume_id}.corrupt").unlink()
    d.delete(vol.volume_id)
    assert_nothing_left(d, root)


def test_corrupt_node_record_never_detaches_a_published_raw_block_volume(root):
    d = root.driver().start()
    vol = d.create("pvc-raw", SIZE, cap=block_cap())
    staging, target = root.path / "staging", root.path / "dev-target"
    d.stage(vol.volume_id, staging, cap=block_cap())
    d.publish(vol.volume_id, staging, target, cap=block_cap())
    device = sysloop.devices_for(backing(d, vol.volume_id))[0]
    with open(target, "r+b") as f:
        f.write(b"raw block payload")
        os.fsync(f.fileno())
    d.kill()
    (node_records_dir(d) / f"{vol.volume_id}.json").write_bytes(b"{")

    d.start()
    # The device node is bind-mounted at the target: a workload uses it.
    assert sysloop.devices_for(backing(d, vol.volume_id)) == [device]
    assert not loop_autoclear(device)
    assert mounted_at(target) is not None
    with open(target, "rb") as f:
        assert f.read(17) == b"raw block payload"
    d.stage(vol.volume_id, staging, cap=block_cap())
    d.publish(vol.volume_id, staging, target, cap=block_cap())
    d.unpublish(vol.volume_id, target)
    d.unstage(vol.volume_id, staging)
    (node_records_dir(d) / f"{vol.volume_id}.corrupt").unlink()
    d.delete(vol.volume_id)
    assert_nothing_left(d, root)


def test_orphan_loop_devices_of_the_pool_are_detached_and_nothing_else(root):
    d = root.driver().start()
    vol = d.create("pvc-orphan", SIZE)
    d.stop()
    pool_file = backing(d, vol.volume_id)
    # Files that look close to the pool but are not this node's volumes.
    others = [
        root.path / "outside.img",
        d.data_dir / "pools" / "node-b" / "volumes" / f"{backend.new_id('vol')}.img",  # another node's pool
        pool(d) / "volumes-old" / f"{backend.new_id('vol')}.img",  # a sibling sharing the prefix
        pool(d) / "snapshots" / f"{backend.new_id('snap')}.img",  # this pool, but a snapshot
    ]
    for path in others:
        make_file(path, 16 * MIB)
    attached: list[tuple[str, Path]] = []
    try:
        # Killed between attach and the node record: an orphan attach.
        orphan = losetup(pool_file)
        attached.append((orphan, pool_file))
        second = losetup(pool_file)  # even twice
        attached.append((second, pool_file))
        keep = {}
        for path in others:
            device = losetup(path)
            keep[device] = path
            attached.append((device, path))

        d.start()
        assert sysloop.devices_for(pool_file) == []
        for device, path in keep.items():
            assert sysloop.attached().get(device) == os.path.realpath(path), path
        # The volume is fine to stage now, with exactly one device.
        d.stage(vol.volume_id, root.path / "staging")
        assert len(sysloop.devices_for(pool_file)) == 1
        d.unstage(vol.volume_id, root.path / "staging")
        assert sysloop.devices_for(pool_file) == []
        for device, path in keep.items():
            assert sysloop.attached().get(device) == os.path.realpath(path), path
    finally:
        for device, path in attached:
            detach_if_ours(device, path)
    d.delete(vol.volume_id)
    for path in others:
        path.unlink()
    assert loops_left_under(root.path) == {}
