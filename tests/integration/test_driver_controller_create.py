"""CreateVolume and DeleteVolume of the real `crust driver`.

Sizes (rounding, minimums, limits), invalid requests naming their field,
idempotency by name, thin and thick provisioning, a failed create leaving
nothing behind; deletes and what they refuse, the required ids of every
Controller RPC, and the controller's state across a restart.

Every test talks to real driver processes over their unix sockets and checks
what can be observed from outside: gRPC status codes and messages, backing
files in the node pools (sizes, allocated blocks, bytes) and the controller's
JSON records under <data-dir>/controller/.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from crust.api import csi_pb2
from tests.harness.driver_controller_calls import (
    MISSING_VOLUME,
    POOL_CAPACITY,
    TOPOLOGY_KEY,
    StatusCode,
    allocated,
    capacity,
    code_of_get,
    create,
    create_req,
    expand_req,
    failure,
    get_volume,
    publish_req,
    record,
    record_keys,
    snapshot,
    snapshot_file,
    snapshot_source,
    unpublish_req,
    volume_file,
    volume_source,
)
from tests.harness.daemons import GIB, MIB, AccessMode, block_cap, code_of, mount_cap

# -- what is on disk ------------------------------------------------------------------


def partial_files(d, node: str = "node-a") -> list[Path]:
    pool = d.data_dir / "pools" / node
    return sorted(pool.glob("*/.*.partial"))


# =============================================================================
# CreateVolume: sizes
# =============================================================================


def test_create_without_capacity_range_makes_a_1gib_sparse_file_and_ready_record(driver):
    vol = create(driver, "default-size")
    path = volume_file(driver, vol.volume_id)
    assert vol.capacity_bytes == GIB
    assert path.stat().st_size == GIB
    assert allocated(path) < MIB  # thin: nothing reserved
    rec = record(driver, "volumes", vol.volume_id)
    assert rec["state"] == "ready" and rec["capacity_bytes"] == GIB and rec["node"] == "node-a"
    assert vol.volume_context["provisioning"] == "thin"
    assert [dict(t.segments) for t in vol.accessible_topology] == [{TOPOLOGY_KEY: "node-a"}]


def test_create_rounds_required_bytes_up_to_whole_mib(driver):
    vol = create(driver, "rounded", required=20 * MIB + 1)
    assert vol.capacity_bytes == 21 * MIB
    assert volume_file(driver, vol.volume_id).stat().st_size == 21 * MIB


def test_create_small_request_gets_the_16mib_minimum(driver):
    vol = create(driver, "tiny", required=4096, caps=[block_cap()])
    assert vol.capacity_bytes == 16 * MIB
    assert volume_file(driver, vol.volume_id).stat().st_size == 16 * MIB


def test_create_with_only_an_unaligned_limit_stays_within_it(driver):
    vol = create(driver, "limit-only", limit=100 * MIB + 1)
    assert vol.capacity_bytes == 100 * MIB
    assert volume_file(driver, vol.volume_id).stat().st_size == 100 * MIB


def test_create_for_xfs_is_at_least_300mib(driver):
    by_capability = create(driver, "xfs-cap", required=64 * MIB, caps=[mount_cap("xfs")])
    by_parameter = create(driver, "xfs-param", required=64 * MIB, parameters={"fsType": "xfs"})
    assert by_parameter.volume_context["fsType"] == "xfs"
    for vol in (by_capability, by_parameter):
        assert vol.capacity_bytes == 300 * MIB
        assert volume_file(driver, vol.volume_id).stat().st_size == 300 * MIB


def test_create_with_limit_below_the_minimum_is_out_of_range(driver):
    for limit, caps in [(8 * MIB, None), (200 * MIB, [mount_cap("xfs")])]:
        err = failure(driver.controller.CreateVolume, create_req("too-small", limit=limit, caps=caps))
        assert err.code() == StatusCode.OUT_OF_RANGE, limit
        assert "limit_bytes" in err.details()
    assert record_keys(driver, "volumes") == set()
    assert list((driver.data_dir / "pools" / "node-a" / "volumes").iterdir()) == []


# =============================================================================
# CreateVolume: invalid requests
# =============================================================================


INVALID_CREATES = {
    "missing-name": (lambda: create_req(""), "name"),
    "missing-capabilities": (lambda: create_req("v", caps=[]), "volume_capabilities"),
    "multi-node-mode": (lambda: create_req("v", caps=[mount_cap(mode=AccessMode.MULTI_NODE_MULTI_WRITER)]),
                        "access_mode"),
    "no-access-type": (lambda: create_req("v", caps=[csi_pb2.VolumeCapability(
        access_mode=AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))]), "access_type"),
    "unknown-fs-type": (lambda: create_req("v", caps=[mount_cap("btrfs")]), "fs_type"),
    "unknown-parameter": (lambda: create_req("v", parameters={"colour": "blue"}), "'colour'"),
    "unknown-mutable-parameter": (lambda: create_req("v", mutable_parameters={"iops": "100"}), "'iops'"),
    "bad-provisioning": (lambda: create_req("v", parameters={"provisioning": "fat"}), "provisioning"),
    "required-above-limit": (lambda: create_req("v", required=64 * MIB, limit=32 * MIB), "required_bytes"),
    "negative-size": (lambda: create_req("v", required=-MIB), "negative"),
    "content-source-without-type": (
        lambda: create_req("v", volume_content_source=csi_pb2.VolumeContentSource()), "volume_content_source"),
}


def test_create_rejects_invalid_requests_naming_the_field(driver):
    for case, (build, field) in INVALID_CREATES.items():
        err = failure(driver.controller.CreateVolume, build())
        assert err.code() == StatusCode.INVALID_ARGUMENT, case
        assert field in err.details(), f"{case}: {err.details()!r} does not name {field!r}"
    assert record_keys(driver, "volumes") == set()


# =============================================================================
# CreateVolume: idempotency
# =============================================================================


def test_create_repeat_returns_the_same_volume(driver):
    first = create(driver, "again", required=20 * MIB + 1, parameters={"provisioning": "thin"})
    second = create(driver, "again", required=20 * MIB + 1, parameters={"provisioning": "thin"})
    assert second.volume_id == first.volume_id
    assert second.capacity_bytes == first.capacity_bytes == 21 * MIB
    assert record_keys(driver, "volumes") == {first.volume_id}
    assert len(list(volume_file(driver, first.volume_id).parent.iterdir())) == 1


def test_create_same_name_with_larger_capacity_is_already_exists(driver):
    create(driver, "sized", required=32 * MIB)
    err = failure(driver.controller.CreateVolume, create_req("sized", required=64 * MIB))
    assert err.code() == StatusCode.ALREADY_EXISTS
    assert "capacity_range" in err.details()


def test_create_same_name_with_different_parameters_is_already_exists(driver):
    create(driver, "params", required=32 * MIB, parameters={"provisioning": "thin"})
    err = failure(driver.controller.CreateVolume,
                  create_req("params", required=32 * MIB, parameters={"provisioning": "thick"}))
    assert err.code() == StatusCode.ALREADY_EXISTS
    assert "parameters" in err.details()


def test_create_same_name_with_different_content_source_is_already_exists(driver):
    src = create(driver, "src", required=32 * MIB)
    create(driver, "sourced", required=32 * MIB)
    err = failure(driver.controller.CreateVolume,
                  create_req("sourced", required=32 * MIB, volume_content_source=volume_source(src.volume_id)))
    assert err.code() == StatusCode.ALREADY_EXISTS
    assert "volume_content_source" in err.details()


def test_create_same_name_needing_a_larger_file_system_is_already_exists(driver):
    create(driver, "blk", required=16 * MIB, caps=[block_cap()])
    err = failure(driver.controller.CreateVolume, create_req("blk", required=16 * MIB, caps=[mount_cap("xfs")]))
    assert err.code() == StatusCode.ALREADY_EXISTS
    assert "volume_capabilities" in err.details()


# =============================================================================
# CreateVolume: provisioning and failure atomicity
# =============================================================================


def test_thick_provisioning_allocates_every_block(driver):
    vol = create(driver, "thick", required=32 * MIB, parameters={"provisioning": "thick"})
    path = volume_file(driver, vol.volume_id)
    assert path.stat().st_size == 32 * MIB
    assert allocated(path) >= 32 * MIB
    assert vol.volume_context["provisioning"] == "thick"


def test_thin_provisioning_allocates_nothing(driver):
    vol = create(driver, "thin", required=32 * MIB, parameters={"provisioning": "thin"})
    path = volume_file(driver, vol.volume_id)
    assert path.stat().st_size == 32 * MIB
    assert allocated(path) < MIB


def test_failed_create_leaves_no_partial_file_and_no_record(driver):
    src = create(driver, "src", required=32 * MIB)
    snap = snapshot(driver, src.volume_id, "snap")
    snapshot_file(driver, snap.snapshot_id).unlink()  # the snapshot's data vanishes
    err = failure(driver.controller.CreateVolume,
                  create_req("restored", required=32 * MIB, volume_content_source=snapshot_source(snap.snapshot_id)))
    assert err.code() == StatusCode.FAILED_PRECONDITION
    assert partial_files(driver) == []
    assert record_keys(driver, "volumes") == {src.volume_id}
    assert [p.name for p in volume_file(driver, src.volume_id).parent.iterdir()] == [f"{src.volume_id}.img"]
    # The name is free again: a retry without the broken source succeeds.
    assert create(driver, "restored", required=32 * MIB).capacity_bytes == 32 * MIB


# =============================================================================
# DeleteVolume
# =============================================================================


def test_delete_volume_removes_file_and_record_and_is_idempotent(driver):
    vol = create(driver, "doomed", required=32 * MIB)
    path = volume_file(driver, vol.volume_id)
    assert path.exists()
    driver.delete(vol.volume_id)
    assert not path.exists()
    assert record(driver, "volumes", vol.volume_id) is None
    driver.delete(vol.volume_id)  # again: still OK
    driver.delete(MISSING_VOLUME)
    assert code_of_get(driver, vol.volume_id) == StatusCode.NOT_FOUND


def test_rpcs_without_a_required_id_are_invalid_argument_naming_the_field(driver):
    vol = create(driver, "v", required=16 * MIB)
    c, g = driver.controller, driver.group
    cases = [
        (c.DeleteVolume, csi_pb2.DeleteVolumeRequest(), "volume_id"),
        (c.ControllerGetVolume, csi_pb2.ControllerGetVolumeRequest(), "volume_id"),
        (c.ControllerPublishVolume, publish_req("", node="node-a"), "volume_id"),
        (c.ControllerPublishVolume, publish_req(vol.volume_id, node=""), "node_id"),
        (c.ControllerPublishVolume, csi_pb2.ControllerPublishVolumeRequest(
            volume_id=vol.volume_id, node_id="node-a"), "volume_capability"),
        (c.ControllerUnpublishVolume, csi_pb2.ControllerUnpublishVolumeRequest(), "volume_id"),
        (c.ValidateVolumeCapabilities, csi_pb2.ValidateVolumeCapabilitiesRequest(
            volume_id=vol.volume_id), "volume_capabilities"),
        (c.ControllerExpandVolume, expand_req("", 64 * MIB), "volume_id"),
        (c.ControllerModifyVolume, csi_pb2.ControllerModifyVolumeRequest(), "volume_id"),
        (c.CreateSnapshot, csi_pb2.CreateSnapshotRequest(name="s"), "source_volume_id"),
        (c.CreateSnapshot, csi_pb2.CreateSnapshotRequest(source_volume_id=vol.volume_id), "name"),
        (c.GetSnapshot, csi_pb2.GetSnapshotRequest(), "snapshot_id"),
        (c.DeleteSnapshot, csi_pb2.DeleteSnapshotRequest(), "snapshot_id"),
        (c.ControllerGetNodeInfo, csi_pb2.ControllerGetNodeInfoRequest(), "node_id"),
        (g.CreateVolumeGroupSnapshot, csi_pb2.CreateVolumeGroupSnapshotRequest(name="g"), "source_volume_ids"),
        (g.CreateVolumeGroupSnapshot, csi_pb2.CreateVolumeGroupSnapshotRequest(
            name="g", source_volume_ids=[vol.volume_id, vol.volume_id]), "source_volume_ids"),
        (g.GetVolumeGroupSnapshot, csi_pb2.GetVolumeGroupSnapshotRequest(), "group_snapshot_id"),
        (g.DeleteVolumeGroupSnapshot, csi_pb2.DeleteVolumeGroupSnapshotRequest(), "group_snapshot_id"),
    ]
    for call, request, field in cases:
        err = failure(call, request)
        what = f"{request.__class__.__name__} without {field}"
        assert err.code() == StatusCode.INVALID_ARGUMENT, what
        assert field in err.details(), f"{what}: {err.details()!r}"
    assert record_keys(driver, "snapshots") == set() and record_keys(driver, "groups") == set()


def test_delete_of_controller_published_volume_is_failed_precondition(driver):
    vol = create(driver, "attached", required=32 * MIB)
    driver.controller.ControllerPublishVolume(publish_req(vol.volume_id), timeout=30)
    err = failure(driver.controller.DeleteVolume, csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
    assert err.code() == StatusCode.FAILED_PRECONDITION
    assert "node-a" in err.details()
    assert volume_file(driver, vol.volume_id).exists()
    driver.controller.ControllerUnpublishVolume(unpublish_req(vol.volume_id), timeout=30)
    driver.delete(vol.volume_id)
    assert not volume_file(driver, vol.volume_id).exists()


# =============================================================================
# Persistence
# =============================================================================


def test_controller_state_survives_a_driver_restart(driver):
    vol = create(driver, "v", required=32 * MIB)
    driver.controller.ControllerPublishVolume(publish_req(vol.volume_id), timeout=30)
    snap = snapshot(driver, vol.volume_id, "s")
    driver.restart()
    assert list(get_volume(driver, vol.volume_id).status.published_node_ids) == ["node-a"]
    assert create(driver, "v", required=32 * MIB).volume_id == vol.volume_id
    assert snapshot(driver, vol.volume_id, "s").snapshot_id == snap.snapshot_id
    assert capacity(driver).available_capacity == POOL_CAPACITY - 64 * MIB


def test_delete_refuses_a_volume_still_staged_on_this_machine(driver, root):
    """A CO that never called ControllerPublishVolume may still have the
    volume staged: deleting it then would pull the file from under a mount."""
    vol = driver.create("staged-then-deleted", 64 * MIB)
    staging = root.path / "staged-then-deleted"
    driver.stage(vol.volume_id, staging)
    code = code_of(driver.controller.DeleteVolume, csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    backing = driver.data_dir / "pools" / "node-a" / "volumes" / f"{vol.volume_id}.img"
    assert backing.exists()
    driver.unstage(vol.volume_id, staging)
    driver.delete(vol.volume_id)
    assert not backing.exists()
