"""ControllerExpandVolume and ControllerModifyVolume of the real `crust driver`.

Growing a volume's backing file (data kept, thick volumes allocated, never
shrunk, bounded by the pool) and changing its provisioning after the fact.
"""

from __future__ import annotations

from crust.api import csi_pb2
from tests.harness.driver_controller_calls import (
    MISSING_VOLUME,
    OFFSET,
    PATTERN,
    POOL_CAPACITY,
    StatusCode,
    allocated,
    create,
    expand_req,
    failure,
    get_volume,
    read_at,
    record,
    volume_file,
    write_pattern,
)
from tests.harness.daemons import MIB

# =============================================================================
# ControllerExpandVolume
# =============================================================================


def test_expand_grows_the_backing_file(driver):
    vol = create(driver, "v", required=64 * MIB)
    write_pattern(volume_file(driver, vol.volume_id), OFFSET, PATTERN)
    resp = driver.controller.ControllerExpandVolume(expand_req(vol.volume_id, 128 * MIB + 1), timeout=30)
    assert resp.capacity_bytes == 129 * MIB
    assert resp.node_expansion_required is True
    path = volume_file(driver, vol.volume_id)
    assert path.stat().st_size == 129 * MIB
    assert read_at(path, OFFSET, len(PATTERN)) == PATTERN  # data kept
    assert record(driver, "volumes", vol.volume_id)["capacity_bytes"] == 129 * MIB
    assert get_volume(driver, vol.volume_id).volume.capacity_bytes == 129 * MIB


def test_expand_of_thick_volume_allocates_the_new_blocks(driver):
    vol = create(driver, "v", required=32 * MIB, parameters={"provisioning": "thick"})
    driver.controller.ControllerExpandVolume(expand_req(vol.volume_id, 64 * MIB), timeout=30)
    assert allocated(volume_file(driver, vol.volume_id)) >= 64 * MIB


def test_expand_to_a_smaller_size_is_an_idempotent_no_op(driver):
    vol = create(driver, "v", required=64 * MIB)
    resp = driver.controller.ControllerExpandVolume(expand_req(vol.volume_id, 32 * MIB), timeout=30)
    assert resp.capacity_bytes == 64 * MIB
    assert volume_file(driver, vol.volume_id).stat().st_size == 64 * MIB
    again = driver.controller.ControllerExpandVolume(expand_req(vol.volume_id, 64 * MIB), timeout=30)
    assert again.capacity_bytes == 64 * MIB


def test_expand_beyond_the_pool_is_out_of_range(driver):
    vol = create(driver, "v", required=64 * MIB)
    err = failure(driver.controller.ControllerExpandVolume, expand_req(vol.volume_id, 2 * POOL_CAPACITY))
    assert err.code() == StatusCode.OUT_OF_RANGE
    assert "capacity_range" in err.details()
    assert volume_file(driver, vol.volume_id).stat().st_size == 64 * MIB
    assert record(driver, "volumes", vol.volume_id)["capacity_bytes"] == 64 * MIB


def test_expand_unknown_volume_is_not_found(driver):
    err = failure(driver.controller.ControllerExpandVolume, expand_req(MISSING_VOLUME, 64 * MIB))
    assert err.code() == StatusCode.NOT_FOUND


def test_expand_without_capacity_range_is_invalid_argument(driver):
    vol = create(driver, "v", required=64 * MIB)
    err = failure(driver.controller.ControllerExpandVolume,
                  csi_pb2.ControllerExpandVolumeRequest(volume_id=vol.volume_id))
    assert err.code() == StatusCode.INVALID_ARGUMENT
    assert "capacity_range" in err.details()


# =============================================================================
# ControllerModifyVolume
# =============================================================================


def test_modify_thin_to_thick_allocates_the_blocks(driver):
    vol = create(driver, "v", required=32 * MIB)
    path = volume_file(driver, vol.volume_id)
    write_pattern(path, OFFSET, PATTERN)
    assert allocated(path) < 2 * MIB
    driver.controller.ControllerModifyVolume(csi_pb2.ControllerModifyVolumeRequest(
        volume_id=vol.volume_id, mutable_parameters={"provisioning": "thick"}), timeout=30)
    assert allocated(path) >= 32 * MIB
    assert read_at(path, OFFSET, len(PATTERN)) == PATTERN
    assert record(driver, "volumes", vol.volume_id)["mutable_parameters"] == {"provisioning": "thick"}
    assert get_volume(driver, vol.volume_id).volume.volume_context["provisioning"] == "thick"


def test_modify_with_unknown_key_is_invalid_argument(driver):
    vol = create(driver, "v", required=32 * MIB)
    err = failure(driver.controller.ControllerModifyVolume, csi_pb2.ControllerModifyVolumeRequest(
        volume_id=vol.volume_id, mutable_parameters={"iops": "500"}))
    assert err.code() == StatusCode.INVALID_ARGUMENT
    assert "'iops'" in err.details() and "mutable_parameters" in err.details()
    assert record(driver, "volumes", vol.volume_id)["mutable_parameters"] == {}


def test_modify_unknown_volume_is_not_found(driver):
    err = failure(driver.controller.ControllerModifyVolume, csi_pb2.ControllerModifyVolumeRequest(
        volume_id=MISSING_VOLUME, mutable_parameters={"provisioning": "thick"}))
    assert err.code() == StatusCode.NOT_FOUND
