"""What the restart tests of `crust driver` share.

The tests/integration/test_driver_restart_*.py modules look with these at what
lives under the test's root (loop devices, mounts, the pool's files, the
controller's and the node's records), write records the way a crash would
leave them, and check that nothing is left when a test is done.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from crust.api import csi_pb2
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness.daemons import MIB, DriverProcess, Root, loops_left_under

NODE = "node-a"
SIZE = 64 * MIB


# -- what lives under the test's root ---------------------------------------------------


def _prefix(root: Root) -> str:
    return str(root.path.resolve()) + "/"


def loops_under(root: Root) -> dict[str, str]:
    return {dev: b for dev, b in sysloop.attached().items() if b.startswith(_prefix(root))}


def mounts_under(root: Root) -> list[str]:
    return [m.mount_point for m in sysmount.mounts() if (m.mount_point + "/").startswith(_prefix(root))]


def pool(d: DriverProcess) -> Path:
    return d.data_dir / "pools" / d.node_id


def backing(d: DriverProcess, volume_id: str) -> Path:
    return pool(d) / "volumes" / f"{volume_id}.img"


def records_dir(d: DriverProcess, kind: str) -> Path:
    return d.data_dir / "controller" / kind


def node_records_dir(d: DriverProcess) -> Path:
    return d.data_dir / "node" / d.node_id / "volumes"


def entries(directory: Path) -> list[str]:
    """Every name in a directory, hidden ones included."""
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def put_record(directory: Path, key: str, record) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    path.write_text(record.model_dump_json(indent=1))
    return path


def read_record(directory: Path, key: str) -> dict:
    return json.loads((directory / f"{key}.json").read_text())


def list_volume_ids(d: DriverProcess, page: int = 0) -> list[str]:
    ids, token = [], ""
    while True:
        resp = d.controller.ListVolumes(csi_pb2.ListVolumesRequest(max_entries=page, starting_token=token), timeout=10)
        ids += [e.volume.volume_id for e in resp.entries]
        token = resp.next_token
        if not token:
            return ids


def list_snapshot_ids(d: DriverProcess) -> list[str]:
    resp = d.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest(), timeout=10)
    return [e.snapshot.snapshot_id for e in resp.entries]


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def losetup(path: Path) -> str:
    return subprocess.run(["losetup", "-f", "--show", str(path)], check=True, capture_output=True,
                          text=True).stdout.strip()


def detach_if_ours(device: str, path: Path) -> None:
    """Detach a loop device the test attached, only if it still serves our file."""
    if sysloop.attached().get(device) == os.path.realpath(path):
        subprocess.run(["losetup", "-d", device], capture_output=True)


def assert_nothing_left(d: DriverProcess, root: Root) -> None:
    assert loops_left_under(root.path) == {}
    assert mounts_under(root) == []
    for kind in ("volumes", "snapshots", "groups"):
        assert entries(records_dir(d, kind)) == [], kind
    assert entries(node_records_dir(d)) == []
    assert entries(pool(d) / "volumes") == []
    assert entries(pool(d) / "snapshots") == []
    assert list_volume_ids(d) == []
    assert list_snapshot_ids(d) == []
