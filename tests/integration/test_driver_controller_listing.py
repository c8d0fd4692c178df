"""ListVolumes and ListSnapshots of the real `crust driver`: paging and filters.

A walk by next_token sees every entry exactly once, also while volumes and
snapshots are deleted and created between its pages; foreign tokens are
refused; the entries carry the published nodes and the volume condition.
"""

from __future__ import annotations

from crust.api import csi_pb2
from tests.harness.driver_controller_calls import (
    MISSING_SNAPSHOT,
    StatusCode,
    create,
    failure,
    publish_req,
    snapshot,
    volume_file,
)
from tests.harness.daemons import MIB

# -- calls ------------------------------------------------------------------------


def walk(list_call, request_cls, entry_id, max_entries: int, between_pages=None) -> tuple[list[str], int]:
    """Follow next_token to the end; returns the ids seen and the page count.
    between_pages(page_ids) runs after every page but the last."""
    seen, token, pages = [], "", 0
    while True:
        resp = list_call(request_cls(max_entries=max_entries, starting_token=token), timeout=30)
        page = [entry_id(e) for e in resp.entries]
        assert len(page) <= max_entries
        seen += page
        pages += 1
        assert pages < 50, "the walk does not end"
        if not resp.next_token:
            return seen, pages
        if between_pages:
            between_pages(page)
        token = resp.next_token


def volume_ids(e) -> str:
    return e.volume.volume_id


def snapshot_ids(e) -> str:
    return e.snapshot.snapshot_id


# =============================================================================
# ListVolumes / ListSnapshots
# =============================================================================


def test_list_volumes_pages_cover_every_volume_exactly_once(driver):
    made = [create(driver, f"v{i}", required=16 * MIB).volume_id for i in range(5)]
    seen, pages = walk(driver.controller.ListVolumes, csi_pb2.ListVolumesRequest, volume_ids, 2)
    assert sorted(seen) == sorted(made) and len(seen) == 5
    assert pages == 3
    everything = driver.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=30)
    assert len(everything.entries) == 5 and everything.next_token == ""


def test_list_volumes_with_a_foreign_token_is_aborted(driver):
    create(driver, "v", required=16 * MIB)
    err = failure(driver.controller.ListVolumes, csi_pb2.ListVolumesRequest(starting_token="page-2"))
    assert err.code() == StatusCode.ABORTED
    assert "starting_token" in err.details()


def test_list_volumes_negative_max_entries_is_invalid_argument(driver):
    err = failure(driver.controller.ListVolumes, csi_pb2.ListVolumesRequest(max_entries=-1))
    assert err.code() == StatusCode.INVALID_ARGUMENT
    assert "max_entries" in err.details()


def test_list_volumes_walk_survives_deleting_the_last_item_of_a_page(driver):
    made = [create(driver, f"v{i}", required=16 * MIB).volume_id for i in range(5)]
    deleted = []

    def delete_last(page):
        if not deleted:
            driver.delete(page[-1])
            deleted.append(page[-1])

    seen, _ = walk(driver.controller.ListVolumes, csi_pb2.ListVolumesRequest, volume_ids, 2, delete_last)
    assert len(seen) == len(set(seen)) == 5
    assert sorted(seen) == sorted(made)  # the deleted one had been returned before it was deleted
    assert deleted and not volume_file(driver, deleted[0]).exists()


def test_list_volumes_walk_sees_new_volumes_at_the_end(driver):
    made = [create(driver, f"v{i}", required=16 * MIB).volume_id for i in range(4)]
    added = []

    def add_one(page):
        if not added:
            added.append(create(driver, "late", required=16 * MIB).volume_id)

    seen, _ = walk(driver.controller.ListVolumes, csi_pb2.ListVolumesRequest, volume_ids, 2, add_one)
    assert seen == made + added


def test_list_volumes_reports_published_nodes_and_condition(driver):
    attached = create(driver, "attached", required=16 * MIB)
    idle = create(driver, "idle", required=16 * MIB)
    driver.controller.ControllerPublishVolume(publish_req(attached.volume_id), timeout=30)
    resp = driver.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=30)
    status = {e.volume.volume_id: e.status for e in resp.entries}
    assert list(status[attached.volume_id].published_node_ids) == ["node-a"]
    assert list(status[idle.volume_id].published_node_ids) == []
    assert not status[idle.volume_id].volume_condition.abnormal


def test_list_snapshots_pages_filters_and_rejects_foreign_tokens(driver):
    a = create(driver, "a", required=16 * MIB)
    b = create(driver, "b", required=16 * MIB)
    of_a = [snapshot(driver, a.volume_id, f"a{i}").snapshot_id for i in range(3)]
    of_b = snapshot(driver, b.volume_id, "b0").snapshot_id
    seen, pages = walk(driver.controller.ListSnapshots, csi_pb2.ListSnapshotsRequest, snapshot_ids, 3)
    assert sorted(seen) == sorted(of_a + [of_b]) and len(seen) == 4 and pages == 2
    only_a = driver.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(source_volume_id=a.volume_id), timeout=30)
    assert sorted(e.snapshot.snapshot_id for e in only_a.entries) == sorted(of_a)
    one = driver.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(snapshot_id=of_b), timeout=30)
    assert [e.snapshot.source_volume_id for e in one.entries] == [b.volume_id]
    none = driver.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(snapshot_id=MISSING_SNAPSHOT), timeout=30)
    assert list(none.entries) == []
    err = failure(driver.controller.ListSnapshots, csi_pb2.ListSnapshotsRequest(starting_token="bogus"))
    assert err.code() == StatusCode.ABORTED


def test_list_snapshots_walk_survives_deleting_the_last_item_of_a_page(driver):
    vol = create(driver, "v", required=16 * MIB)
    made = [snapshot(driver, vol.volume_id, f"s{i}").snapshot_id for i in range(4)]

    def delete_last(page):
        driver.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=page[-1]), timeout=30)

    seen, pages = walk(driver.controller.ListSnapshots, csi_pb2.ListSnapshotsRequest, snapshot_ids, 1,
                       delete_last)
    assert seen == made and pages == 4
