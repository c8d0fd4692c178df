"""What the tests of the Node service of `crust driver` share.

The tests/integration/test_driver_node_*.py modules build their requests,
make their calls and check the kernel and the disk with these: loop devices
in /sys/block, mounts in /proc/self/mountinfo, bytes in a volume's backing
file and the node's JSON records.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness.daemons import MIB, mount_cap

Code = grpc.StatusCode
Usage = csi_pb2.VolumeUsage

# Smallest volumes the controller makes for each file system (xfs needs 300 MiB).
SIZE = {"ext4": 32 * MIB, "xfs": 300 * MIB, "block": 16 * MIB}


# -- helpers ---------------------------------------------------------------------


def backing_file(driver, volume_id: str) -> Path:
    return driver.data_dir / "pools" / driver.node_id / "volumes" / f"{volume_id}.img"


def record_file(driver, volume_id: str) -> Path:
    return driver.data_dir / "node" / driver.node_id / "volumes" / f"{volume_id}.json"


def record(driver, volume_id: str) -> dict:
    return json.loads(record_file(driver, volume_id).read_text())


def loop_devices(driver, volume_id: str) -> list[str]:
    """Every loop device the kernel has attached to the volume's backing file."""
    return sysloop.devices_for(backing_file(driver, volume_id))


def only_device(driver, volume_id: str) -> str:
    devices = loop_devices(driver, volume_id)
    assert len(devices) == 1, f"expected exactly one loop device for {volume_id}, got {devices}"
    return devices[0]


def majmin(device: str) -> tuple[int, int]:
    st = os.stat(device)
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def mounts_at(path: Path) -> list[sysmount.MountEntry]:
    return [m for m in sysmount.mounts() if m.mount_point == str(path)]


def assert_fs_mount_of(path: Path, device: str, fs_type: str) -> sysmount.MountEntry:
    entry = sysmount.at(str(path))
    assert entry is not None, f"nothing mounted at {path}"
    assert (entry.major, entry.minor) == majmin(device), (entry, device)
    assert entry.fs_type == fs_type
    return entry


def fails(call, request, code: grpc.StatusCode, *fragments: str) -> str:
    """Make a call that must fail with `code`; the message must contain every fragment."""
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=60)
    err = info.value
    assert err.code() == code, f"expected {code}, got {err.code()}: {err.details()}"
    for fragment in fragments:
        assert fragment in err.details(), f"{fragment!r} not in {err.details()!r}"
    return err.details()


def publish_req(volume_id, staging, target, cap=None, readonly=False) -> csi_pb2.NodePublishVolumeRequest:
    return csi_pb2.NodePublishVolumeRequest(volume_id=volume_id, staging_target_path=str(staging),
                                            target_path=str(target), readonly=readonly,
                                            volume_capability=cap if cap is not None else mount_cap())


def stats(driver, volume_id, path) -> csi_pb2.NodeGetVolumeStatsResponse:
    return driver.node.NodeGetVolumeStats(
        csi_pb2.NodeGetVolumeStatsRequest(volume_id=volume_id, volume_path=str(path)), timeout=60)


def stats_req(volume_id, path) -> csi_pb2.NodeGetVolumeStatsRequest:
    return csi_pb2.NodeGetVolumeStatsRequest(volume_id=volume_id, volume_path=str(path))


def expand_req(volume_id, path, required=0, cap=None) -> csi_pb2.NodeExpandVolumeRequest:
    kw = {"capacity_range": csi_pb2.CapacityRange(required_bytes=required)} if required else {}
    return csi_pb2.NodeExpandVolumeRequest(volume_id=volume_id, volume_path=str(path), **kw,
                                           volume_capability=cap if cap is not None else mount_cap())


def controller_expand(driver, volume_id, size) -> None:
    resp = driver.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
        volume_id=volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=size)), timeout=60)
    assert resp.capacity_bytes == size and resp.node_expansion_required
    assert os.path.getsize(backing_file(driver, volume_id)) == size


def unknown_id() -> str:
    return "vol-" + "0" * 24  # well formed, never created


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def assert_write_refused(path: Path, *, block: bool = False) -> None:
    """Writing through a read-only publish fails with EROFS (or EPERM/EACCES from a read-only device)."""
    allowed = {errno.EROFS, errno.EPERM, errno.EACCES} if block else {errno.EROFS}
    fd = -1
    try:
        if block:
            fd = os.open(path, os.O_RDWR)
            os.pwrite(fd, b"W" * 4096, 0)
            os.fsync(fd)
        else:
            write_synced(path / "must-not-exist", b"x")
    except OSError as exc:
        assert exc.errno in allowed, f"unexpected error {exc!r}"
    else:
        raise AssertionError(f"a write through the read-only publish at {path} succeeded")
    finally:
        if fd >= 0:
            os.close(fd)
