"""ControllerPublishVolume, ControllerUnpublishVolume, ValidateVolumeCapabilities
and ControllerGetVolume of the real `crust driver`.

Which node a volume is attached to (the attach limit, readonly, idempotent
repeats), which capabilities a volume is confirmed for, and the condition
ControllerGetVolume reports when the backing file is gone or truncated.
"""

from __future__ import annotations

import os

from crust.api import csi_pb2
from tests.harness.driver_controller_calls import (
    MISSING_VOLUME,
    StatusCode,
    code_of_get,
    create,
    failure,
    get_volume,
    limited,  # noqa: F401 - a fixture
    publish_req,
    record,
    unpublish_req,
    volume_file,
)
from tests.harness.daemons import MIB, AccessMode, block_cap, mount_cap

# =============================================================================
# ControllerPublishVolume / ControllerUnpublishVolume
# =============================================================================


def test_publish_unknown_volume_is_not_found(driver):
    err = failure(driver.controller.ControllerPublishVolume, publish_req(MISSING_VOLUME))
    assert err.code() == StatusCode.NOT_FOUND
    assert MISSING_VOLUME in err.details()


def test_publish_to_unknown_node_is_not_found(driver):
    vol = create(driver, "v", required=32 * MIB)
    err = failure(driver.controller.ControllerPublishVolume, publish_req(vol.volume_id, node="node-zz"))
    assert err.code() == StatusCode.NOT_FOUND
    assert "node-zz" in err.details()
    assert record(driver, "volumes", vol.volume_id)["published"] == {}


def test_publish_records_the_node_and_repeat_is_idempotent(driver):
    vol = create(driver, "v", required=32 * MIB)
    first = driver.controller.ControllerPublishVolume(publish_req(vol.volume_id), timeout=30)
    second = driver.controller.ControllerPublishVolume(publish_req(vol.volume_id), timeout=30)
    assert first.publish_context == second.publish_context
    published = record(driver, "volumes", vol.volume_id)["published"]
    assert list(published) == ["node-a"] and published["node-a"]["readonly"] is False
    assert list(get_volume(driver, vol.volume_id).status.published_node_ids) == ["node-a"]


def test_publish_with_incompatible_readonly_is_already_exists(driver):
    vol = create(driver, "v", required=32 * MIB)
    driver.controller.ControllerPublishVolume(publish_req(vol.volume_id, readonly=False), timeout=30)
    err = failure(driver.controller.ControllerPublishVolume, publish_req(vol.volume_id, readonly=True))
    assert err.code() == StatusCode.ALREADY_EXISTS
    assert "readonly" in err.details()
    assert record(driver, "volumes", vol.volume_id)["published"]["node-a"]["readonly"] is False


def test_publish_beyond_the_attach_limit_is_resource_exhausted(limited):
    vols = [create(limited, f"v{i}", required=16 * MIB) for i in range(3)]
    for v in vols[:2]:
        limited.controller.ControllerPublishVolume(publish_req(v.volume_id), timeout=30)
    err = failure(limited.controller.ControllerPublishVolume, publish_req(vols[2].volume_id))
    assert err.code() == StatusCode.RESOURCE_EXHAUSTED
    assert "limit 2" in err.details()
    assert record(limited, "volumes", vols[2].volume_id)["published"] == {}
    # Re-publishing an attached volume is not a new attachment.
    limited.controller.ControllerPublishVolume(publish_req(vols[0].volume_id), timeout=30)
    limited.controller.ControllerUnpublishVolume(unpublish_req(vols[0].volume_id), timeout=30)
    limited.controller.ControllerPublishVolume(publish_req(vols[2].volume_id), timeout=30)


def test_unpublish_is_idempotent(driver):
    vol = create(driver, "v", required=32 * MIB)
    driver.controller.ControllerPublishVolume(publish_req(vol.volume_id), timeout=30)
    for _ in range(2):
        driver.controller.ControllerUnpublishVolume(unpublish_req(vol.volume_id), timeout=30)
        assert record(driver, "volumes", vol.volume_id)["published"] == {}
    driver.controller.ControllerUnpublishVolume(unpublish_req(MISSING_VOLUME), timeout=30)
    driver.controller.ControllerUnpublishVolume(unpublish_req(vol.volume_id, node="node-zz"), timeout=30)


def test_unpublish_without_node_id_detaches_from_every_node(driver):
    vol = create(driver, "v", required=32 * MIB)
    driver.controller.ControllerPublishVolume(publish_req(vol.volume_id), timeout=30)
    driver.controller.ControllerUnpublishVolume(
        csi_pb2.ControllerUnpublishVolumeRequest(volume_id=vol.volume_id), timeout=30)
    assert record(driver, "volumes", vol.volume_id)["published"] == {}


# =============================================================================
# ValidateVolumeCapabilities
# =============================================================================


def test_validate_confirms_supported_capabilities(driver):
    vol = create(driver, "v", required=32 * MIB, parameters={"provisioning": "thin"})
    resp = driver.controller.ValidateVolumeCapabilities(csi_pb2.ValidateVolumeCapabilitiesRequest(
        volume_id=vol.volume_id, volume_capabilities=[mount_cap("ext4"), block_cap()],
        parameters={"provisioning": "thin"}), timeout=30)
    assert resp.HasField("confirmed")
    assert len(resp.confirmed.volume_capabilities) == 2
    assert dict(resp.confirmed.parameters) == {"provisioning": "thin"}


def test_validate_does_not_confirm_multi_node_access(driver):
    vol = create(driver, "v", required=32 * MIB)
    resp = driver.controller.ValidateVolumeCapabilities(csi_pb2.ValidateVolumeCapabilitiesRequest(
        volume_id=vol.volume_id, volume_capabilities=[mount_cap(mode=AccessMode.MULTI_NODE_MULTI_WRITER)]),
        timeout=30)
    assert not resp.HasField("confirmed")
    assert "access_mode" in resp.message and "MULTI_NODE_MULTI_WRITER" in resp.message


def test_validate_does_not_confirm_different_parameters(driver):
    vol = create(driver, "v", required=32 * MIB, parameters={"provisioning": "thin"})
    resp = driver.controller.ValidateVolumeCapabilities(csi_pb2.ValidateVolumeCapabilitiesRequest(
        volume_id=vol.volume_id, volume_capabilities=[mount_cap()], parameters={"provisioning": "thick"}),
        timeout=30)
    assert not resp.HasField("confirmed")
    assert "parameters" in resp.message


def test_validate_does_not_confirm_xfs_on_a_volume_too_small_for_it(driver):
    vol = create(driver, "blk", required=16 * MIB, caps=[block_cap()])
    resp = driver.controller.ValidateVolumeCapabilities(csi_pb2.ValidateVolumeCapabilitiesRequest(
        volume_id=vol.volume_id, volume_capabilities=[mount_cap("xfs")]), timeout=30)
    assert not resp.HasField("confirmed")
    assert "xfs" in resp.message and str(300 * MIB) in resp.message


def test_validate_unknown_volume_is_not_found(driver):
    err = failure(driver.controller.ValidateVolumeCapabilities, csi_pb2.ValidateVolumeCapabilitiesRequest(
        volume_id=MISSING_VOLUME, volume_capabilities=[mount_cap()]))
    assert err.code() == StatusCode.NOT_FOUND


# =============================================================================
# ControllerGetVolume and volume condition
# =============================================================================


def test_get_volume_reports_a_normal_condition(driver):
    vol = create(driver, "v", required=32 * MIB)
    resp = get_volume(driver, vol.volume_id)
    assert resp.volume.volume_id == vol.volume_id and resp.volume.capacity_bytes == 32 * MIB
    assert resp.status.volume_condition.abnormal is False


def test_get_volume_is_abnormal_when_the_backing_file_is_gone(driver):
    vol = create(driver, "v", required=32 * MIB)
    volume_file(driver, vol.volume_id).unlink()
    cond = get_volume(driver, vol.volume_id).status.volume_condition
    assert cond.abnormal is True
    assert "missing" in cond.message


def test_get_volume_is_abnormal_when_the_backing_file_is_truncated(driver):
    vol = create(driver, "v", required=32 * MIB)
    os.truncate(volume_file(driver, vol.volume_id), MIB)
    cond = get_volume(driver, vol.volume_id).status.volume_condition
    assert cond.abnormal is True
    assert str(MIB) in cond.message


def test_get_volume_unknown_is_not_found(driver):
    assert code_of_get(driver, MISSING_VOLUME) == StatusCode.NOT_FOUND
