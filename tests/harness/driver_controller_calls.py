"""What the tests of the Controller and GroupController services of `crust driver` share.

The tests/integration/test_driver_controller_*.py modules build their requests,
make their calls and look at the disk with these: the backing files in the
node pools (sizes, allocated blocks, bytes) and the controller's JSON records
under <data-dir>/controller/. `limited` is a fixture: import it into a module
that uses it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2
from tests.harness.daemons import GIB, MIB, mount_cap

TOPOLOGY_KEY = "topology.loop.csi.crust.dev/node"
POOL_CAPACITY = 100 * GIB  # the harness starts every driver with --capacity 100Gi
MISSING_VOLUME = "vol-" + "0" * 24  # well-formed id that names nothing
MISSING_SNAPSHOT = "snap-" + "0" * 24
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


def code_of_get(d, volume_id: str) -> grpc.StatusCode:
    return failure(d.controller.ControllerGetVolume, csi_pb2.ControllerGetVolumeRequest(volume_id=volume_id)).code()


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


PATTERN = b"crust-pattern-" + bytes(range(256)) * 4
OFFSET = 7 * MIB + 4093  # not block aligned, not at the start


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture
def limited(root):
    """An all-in-one driver whose node accepts two attached volumes."""
    return root.driver(extra=["--max-volumes-per-node", "2"]).start()
