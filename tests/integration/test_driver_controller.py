"""Controller and GroupController RPCs of the real `crust driver`.

Every test talks to real driver processes over their unix sockets and checks
what can be observed from outside: gRPC status codes and messages, backing
files in the node pools (sizes, allocated blocks, bytes) and the controller's
JSON records under <data-dir>/controller/.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2
from crust.sys import loop as sysloop
from tests.harness import GIB, MIB, AccessMode, block_cap, code_of, loops_left_under, mount_cap, mounted_at

TOPOLOGY_KEY = "topology.loop.csi.crust.dev/node"
POOL_CAPACITY = 100 * GIB  # the harness starts every driver with --capacity 100Gi
MISSING_VOLUME = "vol-" + "0" * 24  # well-formed id that names nothing
MISSING_SNAPSHOT = "snap-" + "0" * 24
RPC = csi_pb2.ControllerServiceCapability.RPC
StatusCode = grpc.StatusCode


# -- request builders -----------------------------------------------------------


def create_req(name: str, required: int = 0, limit: int = 0, caps=None, **kw) -> csi_pb2.CreateVolumeRequest:
    rng = csi_pb2.CapacityRange(required_bytes=required, limit_bytes=limit) if (required or limit) else None
    return csi_pb2.CreateVolumeRequest(
        name=name, capacity_range=rng, volume_capabilities=[mount_cap()] if caps is None else caps, **kw)


def snapshot_source(snapshot_id: str) -> csi_pb2.VolumeContentSource:
    return csi_pb2.VolumeContentSource(snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snapshot_id))


def volume_source(volume_id: str) -> csi_pb2.VolumeContentSource:
    return csi_pb2.VolumeContentSource(volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=volume_id))


def topology(node: str) -> csi_pb2.Topology:
    return csi_pb2.Topology(segments={TOPOLOGY_KEY: node})


def publish_req(volume_id: str, node: str = "node-a", readonly: bool = False, cap=None):
    return csi_pb2.ControllerPublishVolumeRequest(
        volume_id=volume_id, node_id=node, volume_capability=cap or mount_cap(), readonly=readonly)


def unpublish_req(volume_id: str, node: str = "node-a"):
    return csi_pb2.ControllerUnpublishVolumeRequest(volume_id=volume_id, node_id=node)


def expand_req(volume_id: str, required: int = 0, limit: int = 0):
    return csi_pb2.ControllerExpandVolumeRequest(
        volume_id=volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=required, limit_bytes=limit))


# -- calls ------------------------------------------------------------------------


def failure(call, request) -> grpc.RpcError:
    """Run an RPC that must fail; return the error (code and message)."""
    try:
        call(request, timeout=30)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError(f"{request.__class__.__name__} succeeded but was expected to fail")


def create(d, name: str, **kw) -> csi_pb2.Volume:
    return d.controller.CreateVolume(create_req(name, **kw), timeout=60).volume


def snapshot(d, volume_id: str, name: str) -> csi_pb2.Snapshot:
    return d.controller.CreateSnapshot(
        csi_pb2.CreateSnapshotRequest(source_volume_id=volume_id, name=name), timeout=60).snapshot


def get_volume(d, volume_id: str) -> csi_pb2.ControllerGetVolumeResponse:
    return d.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=volume_id), timeout=30)


def capacity(d, node: str | None = None) -> csi_pb2.GetCapacityResponse:
    req = csi_pb2.GetCapacityRequest(volume_capabilities=[mount_cap()])
    if node is not None:
        req.accessible_topology.CopyFrom(topology(node))
    return d.controller.GetCapacity(req, timeout=30)


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


# -- what is on disk ------------------------------------------------------------------


def volume_file(d, volume_id: str, node: str = "node-a") -> Path:
    return d.data_dir / "pools" / node / "volumes" / f"{volume_id}.img"


def snapshot_file(d, snapshot_id: str, node: str = "node-a") -> Path:
    return d.data_dir / "pools" / node / "snapshots" / f"{snapshot_id}.img"


def record(d, kind: str, key: str) -> dict | None:
    """A controller record (kind: volumes, snapshots or groups), or None."""
    path = d.data_dir / "controller" / kind / f"{key}.json"
    return json.loads(path.read_text()) if path.exists() else None


def record_keys(d, kind: str) -> set[str]:
    directory = d.data_dir / "controller" / kind
    return {p.stem for p in directory.glob("*.json")} if directory.exists() else set()


def partial_files(d, node: str = "node-a") -> list[Path]:
    pool = d.data_dir / "pools" / node
    return sorted(pool.glob("*/.*.partial"))


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def write_pattern(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, offset) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_at(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def loops_under(root) -> dict[str, str]:
    """Loop devices whose backing file lives under the test's root."""
    prefix = str(root.path.resolve()) + "/"
    return {dev: backing for dev, backing in sysloop.attached().items() if backing.startswith(prefix)}


PATTERN = b"crust-pattern-" + bytes(range(256)) * 4
OFFSET = 7 * MIB + 4093  # not block aligned, not at the start


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture
def limited(root):
    """An all-in-one driver whose node accepts two attached volumes."""
    return root.driver(extra=["--max-volumes-per-node", "2"]).start()


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


def code_of_get(d, volume_id: str) -> grpc.StatusCode:
    return failure(d.controller.ControllerGetVolume, csi_pb2.ControllerGetVolumeRequest(volume_id=volume_id)).code()


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
