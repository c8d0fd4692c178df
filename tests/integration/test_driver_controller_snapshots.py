"""Snapshots, group snapshots and the volumes made from them, in the real `crust driver`.

Restores and clones carry the bytes of their source; CreateSnapshot,
GetSnapshot and DeleteSnapshot; the GroupController's group snapshots and
their members. Checked from outside: gRPC codes and messages, the bytes of
the snapshot and volume files in the pool, the controller's JSON records.
"""

from __future__ import annotations

from crust.api import csi_pb2
from tests.harness.driver_controller_calls import (
    MISSING_SNAPSHOT,
    MISSING_VOLUME,
    OFFSET,
    PATTERN,
    StatusCode,
    create,
    create_req,
    failure,
    read_at,
    record,
    record_keys,
    snapshot,
    snapshot_file,
    snapshot_source,
    volume_file,
    volume_source,
    write_pattern,
)
from tests.harness.daemons import MIB

# =============================================================================
# Content sources
# =============================================================================


def test_snapshot_restore_carries_the_bytes_of_the_snapshot_time(driver):
    src = create(driver, "src", required=32 * MIB)
    write_pattern(volume_file(driver, src.volume_id), OFFSET, PATTERN)
    snap = snapshot(driver, src.volume_id, "snap")
    write_pattern(volume_file(driver, src.volume_id), OFFSET, b"X" * len(PATTERN))  # changed after the snapshot
    restored = create(driver, "restored", required=32 * MIB, volume_content_source=snapshot_source(snap.snapshot_id))
    path = volume_file(driver, restored.volume_id)
    assert read_at(path, OFFSET, len(PATTERN)) == PATTERN
    assert restored.content_source.snapshot.snapshot_id == snap.snapshot_id
    assert record(driver, "volumes", restored.volume_id)["content_source"]["snapshot_id"] == snap.snapshot_id


def test_restored_volume_is_at_least_the_snapshot_size(driver):
    src = create(driver, "src", required=64 * MIB)
    snap = snapshot(driver, src.volume_id, "snap")
    assert snap.size_bytes == 64 * MIB
    restored = create(driver, "small-restore", required=16 * MIB,
                      volume_content_source=snapshot_source(snap.snapshot_id))
    assert restored.capacity_bytes == 64 * MIB
    assert volume_file(driver, restored.volume_id).stat().st_size == 64 * MIB


def test_restore_larger_than_snapshot_grows_the_file(driver):
    src = create(driver, "src", required=32 * MIB)
    write_pattern(volume_file(driver, src.volume_id), OFFSET, PATTERN)
    snap = snapshot(driver, src.volume_id, "snap")
    restored = create(driver, "big-restore", required=80 * MIB,
                      volume_content_source=snapshot_source(snap.snapshot_id))
    path = volume_file(driver, restored.volume_id)
    assert restored.capacity_bytes == path.stat().st_size == 80 * MIB
    assert read_at(path, OFFSET, len(PATTERN)) == PATTERN


def test_clone_carries_the_bytes_and_is_independent(driver):
    src = create(driver, "src", required=32 * MIB)
    write_pattern(volume_file(driver, src.volume_id), OFFSET, PATTERN)
    clone = create(driver, "clone", required=32 * MIB, volume_content_source=volume_source(src.volume_id))
    assert clone.volume_id != src.volume_id
    assert clone.content_source.volume.volume_id == src.volume_id
    clone_path = volume_file(driver, clone.volume_id)
    assert read_at(clone_path, OFFSET, len(PATTERN)) == PATTERN
    write_pattern(volume_file(driver, src.volume_id), OFFSET, b"Y" * len(PATTERN))
    assert read_at(clone_path, OFFSET, len(PATTERN)) == PATTERN


def test_create_from_missing_source_is_not_found(driver):
    for source in (snapshot_source(MISSING_SNAPSHOT), volume_source(MISSING_VOLUME)):
        err = failure(driver.controller.CreateVolume, create_req("orphan", required=32 * MIB,
                                                                 volume_content_source=source))
        assert err.code() == StatusCode.NOT_FOUND, source
        assert "volume_content_source" in err.details()
    assert record_keys(driver, "volumes") == set()


# =============================================================================
# Snapshots
# =============================================================================


def test_create_snapshot_copies_the_volume_and_repeat_is_idempotent(driver):
    vol = create(driver, "v", required=32 * MIB)
    write_pattern(volume_file(driver, vol.volume_id), OFFSET, PATTERN)
    first = snapshot(driver, vol.volume_id, "snap")
    second = snapshot(driver, vol.volume_id, "snap")
    assert second.snapshot_id == first.snapshot_id
    assert first.ready_to_use and first.size_bytes == 32 * MIB and first.source_volume_id == vol.volume_id
    path = snapshot_file(driver, first.snapshot_id)
    assert path.stat().st_size == 32 * MIB
    assert read_at(path, OFFSET, len(PATTERN)) == PATTERN
    assert record_keys(driver, "snapshots") == {first.snapshot_id}
    assert record(driver, "snapshots", first.snapshot_id)["state"] == "ready"


def test_create_snapshot_same_name_other_source_is_already_exists(driver):
    a = create(driver, "a", required=16 * MIB)
    b = create(driver, "b", required=16 * MIB)
    snapshot(driver, a.volume_id, "snap")
    err = failure(driver.controller.CreateSnapshot,
                  csi_pb2.CreateSnapshotRequest(source_volume_id=b.volume_id, name="snap"))
    assert err.code() == StatusCode.ALREADY_EXISTS
    assert len(record_keys(driver, "snapshots")) == 1


def test_create_snapshot_of_unknown_volume_is_not_found(driver):
    err = failure(driver.controller.CreateSnapshot,
                  csi_pb2.CreateSnapshotRequest(source_volume_id=MISSING_VOLUME, name="snap"))
    assert err.code() == StatusCode.NOT_FOUND
    assert "source_volume_id" in err.details() or MISSING_VOLUME in err.details()
    assert record_keys(driver, "snapshots") == set()


def test_get_snapshot_returns_it_and_not_found_for_unknown(driver):
    vol = create(driver, "v", required=16 * MIB)
    snap = snapshot(driver, vol.volume_id, "snap")
    got = driver.controller.GetSnapshot(csi_pb2.GetSnapshotRequest(snapshot_id=snap.snapshot_id), timeout=30)
    assert got.snapshot.snapshot_id == snap.snapshot_id
    assert got.snapshot.source_volume_id == vol.volume_id
    assert got.snapshot.creation_time == snap.creation_time
    err = failure(driver.controller.GetSnapshot, csi_pb2.GetSnapshotRequest(snapshot_id=MISSING_SNAPSHOT))
    assert err.code() == StatusCode.NOT_FOUND


def test_delete_snapshot_removes_file_and_record_and_is_idempotent(driver):
    vol = create(driver, "v", required=16 * MIB)
    snap = snapshot(driver, vol.volume_id, "snap")
    path = snapshot_file(driver, snap.snapshot_id)
    assert path.exists()
    for _ in range(2):
        driver.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id), timeout=30)
        assert not path.exists()
        assert record(driver, "snapshots", snap.snapshot_id) is None
    assert volume_file(driver, vol.volume_id).exists()  # the source is untouched


def test_snapshot_outlives_its_source_volume(driver):
    vol = create(driver, "v", required=16 * MIB)
    write_pattern(volume_file(driver, vol.volume_id), OFFSET, PATTERN)
    snap = snapshot(driver, vol.volume_id, "snap")
    driver.delete(vol.volume_id)
    restored = create(driver, "r", required=16 * MIB, volume_content_source=snapshot_source(snap.snapshot_id))
    assert read_at(volume_file(driver, restored.volume_id), OFFSET, len(PATTERN)) == PATTERN


# =============================================================================
# Group snapshots
# =============================================================================


def group_of_two(d):
    """Two volumes with distinct patterns and a group snapshot of both."""
    vols = [create(d, f"g{i}", required=16 * MIB) for i in range(2)]
    for i, v in enumerate(vols):
        write_pattern(volume_file(d, v.volume_id), OFFSET, PATTERN + bytes([i]))
    group = d.group.CreateVolumeGroupSnapshot(csi_pb2.CreateVolumeGroupSnapshotRequest(
        name="group", source_volume_ids=[v.volume_id for v in vols]), timeout=60).group_snapshot
    return vols, group


def test_group_snapshot_takes_one_member_per_volume(driver):
    vols, group = group_of_two(driver)
    assert group.ready_to_use and len(group.snapshots) == 2
    by_source = {s.source_volume_id: s for s in group.snapshots}
    assert set(by_source) == {v.volume_id for v in vols}
    for i, v in enumerate(vols):
        member = by_source[v.volume_id]
        assert member.group_snapshot_id == group.group_snapshot_id
        path = snapshot_file(driver, member.snapshot_id)
        assert read_at(path, OFFSET, len(PATTERN) + 1) == PATTERN + bytes([i])
    rec = record(driver, "groups", group.group_snapshot_id)
    assert rec["state"] == "ready" and sorted(rec["snapshot_ids"]) == sorted(s.snapshot_id for s in group.snapshots)


def test_group_snapshot_repeat_is_idempotent_and_other_sources_already_exists(driver):
    vols, group = group_of_two(driver)
    again = driver.group.CreateVolumeGroupSnapshot(csi_pb2.CreateVolumeGroupSnapshotRequest(
        name="group", source_volume_ids=[v.volume_id for v in reversed(vols)]), timeout=60).group_snapshot
    assert again.group_snapshot_id == group.group_snapshot_id
    assert len(record_keys(driver, "snapshots")) == 2
    err = failure(driver.group.CreateVolumeGroupSnapshot, csi_pb2.CreateVolumeGroupSnapshotRequest(
        name="group", source_volume_ids=[vols[0].volume_id]))
    assert err.code() == StatusCode.ALREADY_EXISTS


def test_group_snapshot_of_unknown_volume_is_not_found_and_leaves_nothing(driver):
    vol = create(driver, "v", required=16 * MIB)
    err = failure(driver.group.CreateVolumeGroupSnapshot, csi_pb2.CreateVolumeGroupSnapshotRequest(
        name="group", source_volume_ids=[vol.volume_id, MISSING_VOLUME]))
    assert err.code() == StatusCode.NOT_FOUND
    assert "source_volume_ids[1]" in err.details()
    assert record_keys(driver, "groups") == set() and record_keys(driver, "snapshots") == set()


def test_group_members_are_listed_with_their_group_id(driver):
    _, group = group_of_two(driver)
    listed = driver.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(), timeout=30)
    assert sorted(e.snapshot.snapshot_id for e in listed.entries) == sorted(s.snapshot_id for s in group.snapshots)
    assert {e.snapshot.group_snapshot_id for e in listed.entries} == {group.group_snapshot_id}


def test_delete_snapshot_of_a_group_member_is_failed_precondition(driver):
    _, group = group_of_two(driver)
    member = group.snapshots[0].snapshot_id
    err = failure(driver.controller.DeleteSnapshot, csi_pb2.DeleteSnapshotRequest(snapshot_id=member))
    assert err.code() == StatusCode.FAILED_PRECONDITION
    assert group.group_snapshot_id in err.details()
    assert snapshot_file(driver, member).exists()


def test_get_group_snapshot_and_member_mismatch(driver):
    _, group = group_of_two(driver)
    members = [s.snapshot_id for s in group.snapshots]
    got = driver.group.GetVolumeGroupSnapshot(csi_pb2.GetVolumeGroupSnapshotRequest(
        group_snapshot_id=group.group_snapshot_id, snapshot_ids=list(reversed(members))), timeout=30)
    assert sorted(s.snapshot_id for s in got.group_snapshot.snapshots) == sorted(members)
    err = failure(driver.group.GetVolumeGroupSnapshot, csi_pb2.GetVolumeGroupSnapshotRequest(
        group_snapshot_id=group.group_snapshot_id, snapshot_ids=members[:1]))
    assert err.code() == StatusCode.INVALID_ARGUMENT
    assert "snapshot_ids" in err.details()
    err = failure(driver.group.GetVolumeGroupSnapshot, csi_pb2.GetVolumeGroupSnapshotRequest(
        group_snapshot_id="grp-" + "0" * 24))
    assert err.code() == StatusCode.NOT_FOUND


def test_delete_group_snapshot_removes_members_and_is_idempotent(driver):
    _, group = group_of_two(driver)
    members = [s.snapshot_id for s in group.snapshots]
    err = failure(driver.group.DeleteVolumeGroupSnapshot, csi_pb2.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=group.group_snapshot_id, snapshot_ids=members + [MISSING_SNAPSHOT]))
    assert err.code() == StatusCode.INVALID_ARGUMENT and "snapshot_ids" in err.details()
    assert all(snapshot_file(driver, s).exists() for s in members)
    for _ in range(2):
        driver.group.DeleteVolumeGroupSnapshot(csi_pb2.DeleteVolumeGroupSnapshotRequest(
            group_snapshot_id=group.group_snapshot_id, snapshot_ids=members), timeout=30)
    assert not any(snapshot_file(driver, s).exists() for s in members)
    assert record_keys(driver, "groups") == set() and record_keys(driver, "snapshots") == set()
    err = failure(driver.group.GetVolumeGroupSnapshot, csi_pb2.GetVolumeGroupSnapshotRequest(
        group_snapshot_id=group.group_snapshot_id))
    assert err.code() == StatusCode.NOT_FOUND


def test_group_controller_capabilities(driver):
    resp = driver.group.GroupControllerGetCapabilities(csi_pb2.GroupControllerGetCapabilitiesRequest(), timeout=30)
    assert [c.rpc.type for c in resp.capabilities] == [
        csi_pb2.GroupControllerServiceCapability.RPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT]
