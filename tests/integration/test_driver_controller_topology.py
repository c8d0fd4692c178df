"""Capacity and topology in the real `crust driver`.

GetCapacity of the pool and per node; ControllerGetNodeInfo and the
Controller capabilities (with and without the alpha ones); a cluster of two
node-mode drivers and a controller-mode one sharing a data dir: each serves
only its services, volumes go where requisite and preferred topology say,
clones follow their source, and the controller never makes a loop device.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from crust.api import csi_pb2
from crust.sys import loop as sysloop
from tests.harness.driver_controller_calls import (
    OFFSET,
    PATTERN,
    POOL_CAPACITY,
    TOPOLOGY_KEY,
    StatusCode,
    capacity,
    create,
    create_req,
    expand_req,
    failure,
    limited,  # noqa: F401 - a fixture
    publish_req,
    read_at,
    record,
    record_keys,
    snapshot,
    snapshot_source,
    topology,
    volume_file,
    volume_source,
    write_pattern,
)
from tests.harness.daemons import MIB, AccessMode, loops_left_under, mount_cap, mounted_at

RPC = csi_pb2.ControllerServiceCapability.RPC


# -- what is on disk ------------------------------------------------------------------


def loops_under(root) -> dict[str, str]:
    """Loop devices whose backing file lives under the test's root."""
    prefix = str(root.path.resolve()) + "/"
    return {dev: backing for dev, backing in sysloop.attached().items() if backing.startswith(prefix)}


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture
def cluster(root):
    """Two node-mode drivers (node-a, node-b) and one controller-mode driver
    sharing the same data dir."""
    drivers = [root.driver(node_id="node-a", mode="node", endpoint_name="node-a.sock"),
               root.driver(node_id="node-b", mode="node", endpoint_name="node-b.sock"),
               root.driver(node_id="ctl", mode="controller", endpoint_name="ctl.sock")]
    with ThreadPoolExecutor(len(drivers)) as pool:  # start-up dominates; overlap it
        a, b, ctl = pool.map(lambda d: d.start(), drivers)
    return ctl, a, b


# =============================================================================
# GetCapacity
# =============================================================================


def test_get_capacity_total_and_per_topology(driver):
    total = capacity(driver)
    assert total.available_capacity == POOL_CAPACITY
    assert total.maximum_volume_size.value == POOL_CAPACITY
    assert total.minimum_volume_size.value == 16 * MIB
    assert capacity(driver, "node-a").available_capacity == POOL_CAPACITY


def test_get_capacity_decreases_after_create_and_snapshot(driver):
    vol = create(driver, "v", required=64 * MIB)
    assert capacity(driver).available_capacity == POOL_CAPACITY - 64 * MIB
    snapshot(driver, vol.volume_id, "s")
    assert capacity(driver, "node-a").available_capacity == POOL_CAPACITY - 128 * MIB
    driver.delete(vol.volume_id)
    assert capacity(driver).available_capacity == POOL_CAPACITY - 64 * MIB


def test_get_capacity_is_zero_where_nothing_can_be_provisioned(driver):
    assert capacity(driver, "node-zz").available_capacity == 0
    multi_node = driver.controller.GetCapacity(csi_pb2.GetCapacityRequest(
        volume_capabilities=[mount_cap(mode=AccessMode.MULTI_NODE_MULTI_WRITER)]), timeout=30)
    assert multi_node.available_capacity == 0
    assert capacity(driver).available_capacity == POOL_CAPACITY  # the pool itself is there


# =============================================================================
# ControllerGetNodeInfo and capabilities
# =============================================================================


def test_controller_get_node_info(limited):
    resp = limited.controller.ControllerGetNodeInfo(csi_pb2.ControllerGetNodeInfoRequest(node_id="node-a"),
                                                    timeout=30)
    assert dict(resp.accessible_topology.segments) == {TOPOLOGY_KEY: "node-a"}
    assert resp.max_volumes_per_node == 2
    err = failure(limited.controller.ControllerGetNodeInfo, csi_pb2.ControllerGetNodeInfoRequest(node_id="node-zz"))
    assert err.code() == StatusCode.NOT_FOUND and "node-zz" in err.details()


def controller_caps(d) -> set[int]:
    resp = d.controller.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest(), timeout=30)
    return {c.rpc.type for c in resp.capabilities}


def test_controller_capabilities_without_alpha(driver):
    caps = controller_caps(driver)
    assert RPC.GET_NODE_INFO not in caps
    assert {RPC.CREATE_DELETE_VOLUME, RPC.PUBLISH_UNPUBLISH_VOLUME, RPC.LIST_VOLUMES, RPC.GET_CAPACITY,
            RPC.CREATE_DELETE_SNAPSHOT, RPC.LIST_SNAPSHOTS, RPC.CLONE_VOLUME, RPC.PUBLISH_READONLY,
            RPC.EXPAND_VOLUME, RPC.LIST_VOLUMES_PUBLISHED_NODES, RPC.VOLUME_CONDITION, RPC.GET_VOLUME,
            RPC.SINGLE_NODE_MULTI_WRITER, RPC.MODIFY_VOLUME, RPC.GET_SNAPSHOT} == caps


def test_controller_capabilities_with_alpha(root):
    d = root.driver(extra=["--advertise-alpha"]).start()
    caps = controller_caps(d)
    assert RPC.GET_NODE_INFO in caps and RPC.CREATE_DELETE_VOLUME in caps


# =============================================================================
# Modes and topology across several nodes
# =============================================================================


def test_controller_mode_serves_no_node_and_node_mode_no_controller(cluster):
    ctl, a, b = cluster
    assert failure(ctl.node.NodeGetInfo, csi_pb2.NodeGetInfoRequest()).code() == StatusCode.UNIMPLEMENTED
    for node in (a, b):
        err = failure(node.controller.ControllerGetCapabilities, csi_pb2.ControllerGetCapabilitiesRequest())
        assert err.code() == StatusCode.UNIMPLEMENTED
        err = failure(node.group.GroupControllerGetCapabilities, csi_pb2.GroupControllerGetCapabilitiesRequest())
        assert err.code() == StatusCode.UNIMPLEMENTED
    assert a.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=30).node_id == "node-a"
    assert controller_caps(ctl)  # the controller socket does serve Controller


def test_controller_sees_both_node_pools(cluster):
    ctl, _, _ = cluster
    assert capacity(ctl).available_capacity == 2 * POOL_CAPACITY
    for node in ("node-a", "node-b"):
        info = ctl.controller.ControllerGetNodeInfo(csi_pb2.ControllerGetNodeInfoRequest(node_id=node), timeout=30)
        assert dict(info.accessible_topology.segments) == {TOPOLOGY_KEY: node}
    assert not (ctl.data_dir / "pools" / "ctl").exists()  # a controller offers no pool


def test_requisite_topology_places_the_volume_on_that_node(cluster):
    ctl, _, _ = cluster
    vol = create(ctl, "on-b", required=32 * MIB,
                 accessibility_requirements=csi_pb2.TopologyRequirement(requisite=[topology("node-b")]))
    assert [dict(t.segments) for t in vol.accessible_topology] == [{TOPOLOGY_KEY: "node-b"}]
    assert volume_file(ctl, vol.volume_id, "node-b").stat().st_size == 32 * MIB
    assert not volume_file(ctl, vol.volume_id, "node-a").exists()
    assert record(ctl, "volumes", vol.volume_id)["node"] == "node-b"
    assert capacity(ctl, "node-b").available_capacity == POOL_CAPACITY - 32 * MIB
    assert capacity(ctl, "node-a").available_capacity == POOL_CAPACITY


def test_create_repeat_outside_the_requisite_topology_is_already_exists(cluster):
    ctl, _, _ = cluster

    def pinned_to(node):
        return create_req("pinned", required=32 * MIB, accessibility_requirements=csi_pb2.TopologyRequirement(
            requisite=[topology(node)]))

    vol = ctl.controller.CreateVolume(pinned_to("node-a"), timeout=30).volume
    assert ctl.controller.CreateVolume(pinned_to("node-a"), timeout=30).volume.volume_id == vol.volume_id
    err = failure(ctl.controller.CreateVolume, pinned_to("node-b"))
    assert err.code() == StatusCode.ALREADY_EXISTS
    assert "requisite" in err.details()
    assert not volume_file(ctl, vol.volume_id, "node-b").exists()


def test_preferred_topology_order_is_respected(cluster):
    ctl, _, _ = cluster
    both = [topology("node-a"), topology("node-b")]
    b_first = create(ctl, "b-first", required=32 * MIB, accessibility_requirements=csi_pb2.TopologyRequirement(
        requisite=both, preferred=[topology("node-b"), topology("node-a")]))
    assert volume_file(ctl, b_first.volume_id, "node-b").exists()
    # node-a has more room now, but preference still wins over free space.
    b_again = create(ctl, "b-again", required=32 * MIB, accessibility_requirements=csi_pb2.TopologyRequirement(
        preferred=[topology("node-b")]))
    assert volume_file(ctl, b_again.volume_id, "node-b").exists()
    a_first = create(ctl, "a-first", required=32 * MIB, accessibility_requirements=csi_pb2.TopologyRequirement(
        requisite=both, preferred=[topology("node-a"), topology("node-b")]))
    assert volume_file(ctl, a_first.volume_id, "node-a").exists()


def test_requisite_topology_of_unknown_node_is_resource_exhausted(cluster):
    ctl, _, _ = cluster
    err = failure(ctl.controller.CreateVolume, create_req(
        "nowhere", required=32 * MIB,
        accessibility_requirements=csi_pb2.TopologyRequirement(requisite=[topology("node-zz")])))
    assert err.code() == StatusCode.RESOURCE_EXHAUSTED
    assert record_keys(ctl, "volumes") == set()


def test_clone_follows_its_source_node(cluster):
    ctl, _, _ = cluster
    src = create(ctl, "src", required=32 * MIB,
                 accessibility_requirements=csi_pb2.TopologyRequirement(requisite=[topology("node-b")]))
    write_pattern(volume_file(ctl, src.volume_id, "node-b"), OFFSET, PATTERN)
    clone = create(ctl, "clone", required=32 * MIB, volume_content_source=volume_source(src.volume_id))
    assert [dict(t.segments) for t in clone.accessible_topology] == [{TOPOLOGY_KEY: "node-b"}]
    assert read_at(volume_file(ctl, clone.volume_id, "node-b"), OFFSET, len(PATTERN)) == PATTERN


def test_volume_on_node_b_stages_only_on_node_b(cluster, root):
    ctl, a, b = cluster
    vol = create(ctl, "on-b", required=64 * MIB,
                 accessibility_requirements=csi_pb2.TopologyRequirement(requisite=[topology("node-b")]))
    staging = root.path / "staging"
    err = failure(a.node.NodeStageVolume, csi_pb2.NodeStageVolumeRequest(
        volume_id=vol.volume_id, staging_target_path=str(staging), volume_capability=mount_cap()))
    assert err.code() == StatusCode.NOT_FOUND
    assert "node-a" in err.details()
    assert loops_under(root) == {}
    b.stage(vol.volume_id, staging)
    assert mounted_at(staging) is not None
    backing = str(volume_file(ctl, vol.volume_id, "node-b").resolve())
    assert list(loops_under(root).values()) == [backing]
    b.unstage(vol.volume_id, staging)
    assert mounted_at(staging) is None and loops_left_under(root.path) == {}


def test_publish_to_a_node_other_than_the_volume_pool_is_failed_precondition(cluster):
    ctl, _, _ = cluster
    vol = create(ctl, "on-a", required=32 * MIB,
                 accessibility_requirements=csi_pb2.TopologyRequirement(requisite=[topology("node-a")]))
    err = failure(ctl.controller.ControllerPublishVolume, publish_req(vol.volume_id, node="node-b"))
    assert err.code() == StatusCode.FAILED_PRECONDITION
    assert "node-a" in err.details() and "node-b" in err.details()
    assert record(ctl, "volumes", vol.volume_id)["published"] == {}
    ctl.controller.ControllerPublishVolume(publish_req(vol.volume_id, node="node-a"), timeout=30)
    assert list(record(ctl, "volumes", vol.volume_id)["published"]) == ["node-a"]


def test_controller_mode_never_creates_loop_devices(cluster, root):
    ctl, _, _ = cluster
    vol = create(ctl, "v", required=32 * MIB, parameters={"provisioning": "thick"})
    snap = snapshot(ctl, vol.volume_id, "s")
    create(ctl, "r", required=32 * MIB, volume_content_source=snapshot_source(snap.snapshot_id))
    create(ctl, "c", required=32 * MIB, volume_content_source=volume_source(vol.volume_id))
    ctl.controller.ControllerExpandVolume(expand_req(vol.volume_id, 48 * MIB), timeout=30)
    ctl.controller.ControllerPublishVolume(publish_req(vol.volume_id), timeout=30)
    assert len(record_keys(ctl, "volumes")) == 3
    assert loops_under(root) == {}
