"""Restart safety of `crust driver` with real processes, loop devices and mounts.

- SIGKILL between the steps of a volume's life, restart on the same data dir,
  retry the last RPC and finish the life;
- the on-disk state a crash in the middle of an operation leaves, written by
  the test, then a start: interrupted creates are rolled back, interrupted
  deletes finished, temporaries and corrupt records put out of the way, and
  orphan loop devices of the pool detached (and nothing else);
- SIGKILL during a stream of CreateVolume calls;
- SIGTERM, stale and live sockets.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2
from crust.driver.backend import loop as backend
from crust.driver.records import GroupSnapshotRecord, Lifecycle, SnapshotRecord, VolumeRecord
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness import MIB, DriverProcess, Root, block_cap, loop_autoclear, loops_left_under, mount_cap, mounted_at

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


def snapshot_file(d: DriverProcess, snapshot_id: str) -> Path:
    return pool(d) / "snapshots" / f"{snapshot_id}.img"


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


def make_file(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


def losetup(path: Path) -> str:
    return subprocess.run(["losetup", "-f", "--show", str(path)], check=True, capture_output=True,
                          text=True).stdout.strip()


def detach_if_ours(device: str, path: Path) -> None:
    """Detach a loop device the test attached, only if it still serves our file."""
    if sysloop.attached().get(device) == os.path.realpath(path):
        subprocess.run(["losetup", "-d", device], capture_output=True)


def kill_and_restart(d: DriverProcess) -> None:
    d.kill()
    # A SIGKILLed driver leaves its socket file behind.
    assert stat.S_ISSOCK(os.lstat(d.socket).st_mode)
    d.start()


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


# -- SIGKILL between the steps of a volume's life ----------------------------------------


STEPS = ["create", "controller_publish", "stage", "publish", "unpublish", "unstage", "controller_unpublish",
         "delete"]


@pytest.mark.parametrize("kill_after", STEPS)
def test_sigkill_between_steps_then_restart_finishes_the_life(root, kill_after):
    d = root.driver().start()
    staging, target = root.path / "staging", root.path / "target"
    payloads: dict[str, bytes] = {}
    state = {"published_to_node": False, "staged": False, "published": False}
    vol_id = ""

    def create():
        nonlocal vol_id
        vol = d.create("pvc-restart", SIZE)
        assert vol.capacity_bytes == SIZE
        if vol_id:
            assert vol.volume_id == vol_id  # a retry by name finds the same volume
        vol_id = vol.volume_id

    def controller_publish():
        resp = d.controller.ControllerPublishVolume(csi_pb2.ControllerPublishVolumeRequest(
            volume_id=vol_id, node_id=NODE, volume_capability=mount_cap()), timeout=30)
        assert resp.publish_context["node"] == NODE
        state["published_to_node"] = True

    def stage():
        d.stage(vol_id, staging)
        state["staged"] = True

    def publish():
        d.publish(vol_id, staging, target)
        state["published"] = True

    def unpublish():
        d.unpublish(vol_id, target)
        state["published"] = False

    def unstage():
        d.unstage(vol_id, staging)
        state["staged"] = False

    def controller_unpublish():
        d.controller.ControllerUnpublishVolume(csi_pb2.ControllerUnpublishVolumeRequest(
            volume_id=vol_id, node_id=NODE), timeout=30)
        state["published_to_node"] = False

    def delete():
        d.delete(vol_id)

    def check(step: str) -> None:
        """The kernel and the records agree with the life so far."""
        path = backing(d, vol_id)
        if step == "delete":
            assert not path.exists()
            assert vol_id not in list_volume_ids(d)
            return
        assert path.stat().st_size == SIZE
        assert list_volume_ids(d) == [vol_id]
        devices = sysloop.devices_for(path)
        assert len(devices) == (1 if state["staged"] else 0), devices  # never a duplicate attach
        assert not any(loop_autoclear(dev) for dev in devices)
        assert (mounted_at(staging) is not None) == state["staged"]
        assert (mounted_at(target) is not None) == state["published"]
        if state["published"]:
            assert mounted_at(target).major == mounted_at(staging).major
        else:
            assert not target.exists()
        node_rec = node_records_dir(d) / f"{vol_id}.json"
        assert node_rec.exists() == state["staged"]
        if state["staged"]:
            assert list(json.loads(node_rec.read_text())["published"]) == ([str(target)] if state["published"] else [])
        ctrl = read_record(records_dir(d, "volumes"), vol_id)
        assert ctrl["state"] == "ready"
        assert list(ctrl["published"]) == ([NODE] if state["published_to_node"] else [])
        # Data written so far is readable wherever the volume shows it.
        for name, data in payloads.items():
            if state["published"]:
                assert (target / name).read_bytes() == data
            elif state["staged"]:
                assert (staging / name).read_bytes() == data
            else:
                assert data in path.read_bytes()

    actions = dict(create=create, controller_publish=controller_publish, stage=stage, publish=publish,
                   unpublish=unpublish, unstage=unstage, controller_unpublish=controller_unpublish, delete=delete)
    for step in STEPS:
        actions[step]()
        # Write while a file system is mounted, so every kill point after the
        # stage has data written before the kill.
        if state["published"]:
            payloads[f"after-{step}"] = f"written through the target after {step}".encode() * 3
            write_synced(target / f"after-{step}", payloads[f"after-{step}"])
        elif state["staged"]:
            payloads[f"after-{step}"] = f"written through the staging path after {step}".encode() * 3
            write_synced(staging / f"after-{step}", payloads[f"after-{step}"])
        check(step)
        if step == kill_after:
            kill_and_restart(d)
            check(step)  # the restart itself changed nothing
            actions[step]()  # the CO retries the RPC it saw no answer to
            actions[step]()  # and once more: idempotent
            check(step)
    d.delete(vol_id)  # deleting again is fine
    assert_nothing_left(d, root)
    assert d.stop() == 0


# -- crash in the middle of an operation: the state it leaves ------------------------------


def fresh(root: Root) -> DriverProcess:
    """A driver started once (data dir and pool laid out) and stopped again."""
    d = root.driver().start()
    assert d.stop() == 0
    return d


def test_interrupted_create_is_rolled_back(root):
    d = fresh(root)
    vols = records_dir(d, "volumes")
    # Killed while writing the backing file: CREATING record + partial file.
    early = backend.new_id("vol")
    put_record(vols, early, VolumeRecord(volume_id=early, name="pvc-early", node=NODE, capacity_bytes=SIZE,
                                         required_bytes=SIZE, state=Lifecycle.CREATING))
    partial = pool(d) / "volumes" / f".{early}.img.partial"
    partial.write_bytes(b"\xab" * 4096)
    # Killed after the rename, before the READY record: the file looks complete.
    late = backend.new_id("vol")
    put_record(vols, late, VolumeRecord(volume_id=late, name="pvc-late", node=NODE, capacity_bytes=SIZE,
                                        required_bytes=SIZE, state=Lifecycle.CREATING))
    make_file(backing(d, late), SIZE)
    # Killed before the file was begun: a CREATING record alone.
    bare = backend.new_id("vol")
    put_record(vols, bare, VolumeRecord(volume_id=bare, name="pvc-bare", node=NODE, capacity_bytes=SIZE,
                                        state=Lifecycle.CREATING))

    d.start()
    assert entries(vols) == []
    assert entries(pool(d) / "volumes") == []
    assert list_volume_ids(d) == []
    for name, old in (("pvc-early", early), ("pvc-late", late), ("pvc-bare", bare)):
        vol = d.create(name, SIZE)
        assert vol.volume_id != old
        assert backing(d, vol.volume_id).stat().st_size == SIZE
        assert read_record(vols, vol.volume_id)["state"] == "ready"
        assert d.create(name, SIZE).volume_id == vol.volume_id
    assert len(list_volume_ids(d)) == 3
    assert not any(n.endswith(".partial") for n in entries(pool(d) / "volumes"))
    for vid in list_volume_ids(d):
        d.delete(vid)
    assert_nothing_left(d, root)


def test_interrupted_delete_is_finished(root):
    d = root.driver().start()
    vol = d.create("pvc-del", SIZE)
    keep = d.create("pvc-keep", SIZE)
    d.stop()
    vols = records_dir(d, "volumes")
    rec = VolumeRecord.model_validate_json((vols / f"{vol.volume_id}.json").read_bytes())
    rec.state = Lifecycle.DELETING
    put_record(vols, vol.volume_id, rec)
    assert backing(d, vol.volume_id).exists()

    d.start()
    assert not (vols / f"{vol.volume_id}.json").exists()
    assert not backing(d, vol.volume_id).exists()
    assert list_volume_ids(d) == [keep.volume_id]
    assert backing(d, keep.volume_id).stat().st_size == SIZE
    d.delete(vol.volume_id)  # the CO's retry of the delete succeeds
    again = d.create("pvc-del", SIZE)  # and the name is free again
    assert again.volume_id != vol.volume_id
    for vid in (again.volume_id, keep.volume_id):
        d.delete(vid)
    assert_nothing_left(d, root)


def test_interrupted_snapshot_create_and_delete(root):
    d = root.driver().start()
    vol = d.create("pvc-src", SIZE)
    d.stop()
    snaps = records_dir(d, "snapshots")
    creating = backend.new_id("snap")
    put_record(snaps, creating, SnapshotRecord(snapshot_id=creating, name="snap-a", source_volume_id=vol.volume_id,
                                               node=NODE, size_bytes=SIZE, state=Lifecycle.CREATING))
    (pool(d) / "snapshots").mkdir(parents=True, exist_ok=True)
    partial = pool(d) / "snapshots" / f".{creating}.img.partial"
    partial.write_bytes(b"\xcd" * 8192)
    deleting = backend.new_id("snap")
    put_record(snaps, deleting, SnapshotRecord(snapshot_id=deleting, name="snap-b", source_volume_id=vol.volume_id,
                                               node=NODE, size_bytes=SIZE, state=Lifecycle.DELETING))
    make_file(snapshot_file(d, deleting), SIZE)

    d.start()
    assert entries(snaps) == []
    assert entries(pool(d) / "snapshots") == []
    assert list_snapshot_ids(d) == []
    assert list_volume_ids(d) == [vol.volume_id]  # the source is untouched
    snap = d.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(
        source_volume_id=vol.volume_id, name="snap-a"), timeout=30).snapshot
    assert snap.snapshot_id != creating and snap.ready_to_use and snap.size_bytes == SIZE
    assert snapshot_file(d, snap.snapshot_id).stat().st_size == SIZE
    assert read_record(snaps, snap.snapshot_id)["state"] == "ready"
    d.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=deleting), timeout=30)
    d.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id), timeout=30)
    d.delete(vol.volume_id)
    assert_nothing_left(d, root)


def test_interrupted_group_snapshot_is_removed_with_all_its_members(root):
    d = root.driver().start()
    a = d.create("pvc-ga", SIZE)
    b = d.create("pvc-gb", SIZE)
    d.stop()
    group_id = backend.new_id("grp")
    snaps = records_dir(d, "snapshots")
    (pool(d) / "snapshots").mkdir(parents=True, exist_ok=True)
    members = []
    for vol in (a, b):
        sid = backend.new_id("snap")
        put_record(snaps, sid, SnapshotRecord(snapshot_id=sid, name=f"grp-1-{vol.volume_id}",
                                              source_volume_id=vol.volume_id, node=NODE, size_bytes=SIZE,
                                              group_snapshot_id=group_id, state=Lifecycle.READY))
        make_file(snapshot_file(d, sid), SIZE)
        members.append(sid)
    # Killed after the second member was READY but before the group record
    # listed it: the group names only the first.
    put_record(records_dir(d, "groups"), group_id, GroupSnapshotRecord(
        group_snapshot_id=group_id, name="grp-1", source_volume_ids=[a.volume_id, b.volume_id],
        snapshot_ids=members[:1], state=Lifecycle.CREATING))

    d.start()
    assert entries(records_dir(d, "groups")) == []
    assert entries(snaps) == []
    assert entries(pool(d) / "snapshots") == []
    assert list_snapshot_ids(d) == []
    # The CO retries the group by name and gets a complete one.
    group = d.group.CreateVolumeGroupSnapshot(csi_pb2.CreateVolumeGroupSnapshotRequest(
        name="grp-1", source_volume_ids=[a.volume_id, b.volume_id]), timeout=30).group_snapshot
    assert group.group_snapshot_id != group_id and len(group.snapshots) == 2
    assert sorted(list_snapshot_ids(d)) == sorted(s.snapshot_id for s in group.snapshots)
    d.group.DeleteVolumeGroupSnapshot(csi_pb2.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=group.group_snapshot_id), timeout=30)
    d.delete(a.volume_id)
    d.delete(b.volume_id)
    assert_nothing_left(d, root)


def test_stray_temporary_records_are_removed(root):
    d = root.driver().start()
    vol = d.create("pvc-tmp", SIZE)
    d.stage(vol.volume_id, root.path / "staging")
    d.kill()
    vols = records_dir(d, "volumes")
    strays = [
        vols / f".{vol.volume_id}.json.k3j4h2ab.tmp",  # half-written replacement of a live record
        vols / f".{backend.new_id('vol')}.json.zz81x0qq.tmp",  # first write of a record never finished
        node_records_dir(d) / f".{vol.volume_id}.json.a1b2c3d4.tmp",
    ]
    for stray in strays:
        stray.write_bytes(b'{"volume_id": "vol-')
    for kind in ("snapshots", "groups"):
        stray = records_dir(d, kind) / f".{backend.new_id('snap')}.json.q9w8e7r6.tmp"
        stray.parent.mkdir(parents=True, exist_ok=True)
        stray.write_bytes(b"")
        strays.append(stray)

    d.start()
    for stray in strays:
        assert not stray.exists(), stray
    assert entries(vols) == [f"{vol.volume_id}.json"]
    assert entries(node_records_dir(d)) == [f"{vol.volume_id}.json"]
    assert list_volume_ids(d) == [vol.volume_id]
    got = d.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id), timeout=10)
    assert not got.status.volume_condition.abnormal
    d.stage(vol.volume_id, root.path / "staging")  # the node record still serves
    assert len(sysloop.devices_for(backing(d, vol.volume_id))) == 1
    d.unstage(vol.volume_id, root.path / "staging")
    d.delete(vol.volume_id)
    assert_nothing_left(d, root)


def test_corrupt_controller_record_is_kept_aside(root):
    d = root.driver().start()
    bad = d.create("pvc-bad", SIZE)
    good = d.create("pvc-good", SIZE)
    d.kill()
    vols = records_dir(d, "volumes")
    (vols / f"{bad.volume_id}.json").write_bytes(b'{"volume_id": "' + bad.volume_id.encode() + b'", "na')

    d.start()
    assert entries(vols) == sorted([f"{bad.volume_id}.corrupt", f"{good.volume_id}.json"])
    assert list_volume_ids(d) == [good.volume_id]
    # The data of the unreadable record is kept for a human, never deleted.
    assert backing(d, bad.volume_id).stat().st_size == SIZE
    assert (vols / f"{bad.volume_id}.corrupt").read_bytes().endswith(b'"na')
    # A second restart leaves the corrupt copy alone.
    d.restart()
    assert (vols / f"{bad.volume_id}.corrupt").exists()
    d.delete(good.volume_id)
    assert list_volume_ids(d) == []


def test_corrupt_node_record_never_detaches_a_mounted_volume(root):
    d = root.driver().start()
    vol = d.create("pvc-node", SIZE)
    staging, target = root.path / "staging", root.path / "target"
    d.stage(vol.volume_id, staging)
    d.publish(vol.volume_id, staging, target)
    write_synced(target / "data", b"still here")
    device = sysloop.devices_for(backing(d, vol.volume_id))[0]
    d.kill()
    rec = node_records_dir(d) / f"{vol.volume_id}.json"
    rec.write_bytes(b"\x00\x00garbage")

    d.start()
    assert entries(node_records_dir(d)) == [f"{vol.volume_id}.corrupt"]
    # The device is mounted, so the unexplained attach is left alone (not
    # even a deferred detach).
    assert sysloop.devices_for(backing(d, vol.volume_id)) == [device]
    assert not loop_autoclear(device)
    assert (target / "data").read_bytes() == b"still here"
    # The CO's retries adopt what is there and the life finishes.
    d.stage(vol.volume_id, staging)
    d.publish(vol.volume_id, staging, target)
    assert sysloop.devices_for(backing(d, vol.volume_id)) == [device]
    assert (target / "data").read_bytes() == b"still here"
    d.unpublish(vol.volume_id, target)
    d.unstage(vol.volume_id, staging)
    (node_records_dir(d) / f"{vol.volume_id}.corrupt").unlink()
    d.delete(vol.volume_id)
    assert_nothing_left(d, root)


def test_corrupt_node_record_never_detaches_a_published_raw_block_volume(root):
    d = root.driver().start()
    vol = d.create("pvc-raw", SIZE, cap=block_cap())
    staging, target = root.path / "staging", root.path / "dev-target"
    d.stage(vol.volume_id, staging, cap=block_cap())
    d.publish(vol.volume_id, staging, target, cap=block_cap())
    device = sysloop.devices_for(backing(d, vol.volume_id))[0]
    with open(target, "r+b") as f:
        f.write(b"raw block payload")
        os.fsync(f.fileno())
    d.kill()
    (node_records_dir(d) / f"{vol.volume_id}.json").write_bytes(b"{")

    d.start()
    # The device node is bind-mounted at the target: a workload uses it.
    assert sysloop.devices_for(backing(d, vol.volume_id)) == [device]
    assert not loop_autoclear(device)
    assert mounted_at(target) is not None
    with open(target, "rb") as f:
        assert f.read(17) == b"raw block payload"
    d.stage(vol.volume_id, staging, cap=block_cap())
    d.publish(vol.volume_id, staging, target, cap=block_cap())
    d.unpublish(vol.volume_id, target)
    d.unstage(vol.volume_id, staging)
    (node_records_dir(d) / f"{vol.volume_id}.corrupt").unlink()
    d.delete(vol.volume_id)
    assert_nothing_left(d, root)


def test_orphan_loop_devices_of_the_pool_are_detached_and_nothing_else(root):
    d = root.driver().start()
    vol = d.create("pvc-orphan", SIZE)
    d.stop()
    pool_file = backing(d, vol.volume_id)
    # Files that look close to the pool but are not this node's volumes.
    others = [
        root.path / "outside.img",
        d.data_dir / "pools" / "node-b" / "volumes" / f"{backend.new_id('vol')}.img",  # another node's pool
        pool(d) / "volumes-old" / f"{backend.new_id('vol')}.img",  # a sibling sharing the prefix
        pool(d) / "snapshots" / f"{backend.new_id('snap')}.img",  # this pool, but a snapshot
    ]
    for path in others:
        make_file(path, 16 * MIB)
    attached: list[tuple[str, Path]] = []
    try:
        # Killed between attach and the node record: an orphan attach.
        orphan = losetup(pool_file)
        attached.append((orphan, pool_file))
        second = losetup(pool_file)  # even twice
        attached.append((second, pool_file))
        keep = {}
        for path in others:
            device = losetup(path)
            keep[device] = path
            attached.append((device, path))

        d.start()
        assert sysloop.devices_for(pool_file) == []
        for device, path in keep.items():
            assert sysloop.attached().get(device) == os.path.realpath(path), path
        # The volume is fine to stage now, with exactly one device.
        d.stage(vol.volume_id, root.path / "staging")
        assert len(sysloop.devices_for(pool_file)) == 1
        d.unstage(vol.volume_id, root.path / "staging")
        assert sysloop.devices_for(pool_file) == []
        for device, path in keep.items():
            assert sysloop.attached().get(device) == os.path.realpath(path), path
    finally:
        for device, path in attached:
            detach_if_ours(device, path)
    d.delete(vol.volume_id)
    for path in others:
        path.unlink()
    assert loops_left_under(root.path) == {}


# -- SIGKILL during a stream of creates -----------------------------------------------------


def test_sigkill_during_create_stream(root):
    d = root.driver().start()
    requests = [
        csi_pb2.CreateVolumeRequest(
            name=f"pvc-stream-{i:02d}",
            capacity_range=csi_pb2.CapacityRange(required_bytes=(16 + i) * MIB),
            volume_capabilities=[mount_cap()],
            parameters={"provisioning": "thick"} if i % 2 else {})
        for i in range(32)
    ]
    futures = [d.controller.CreateVolume.future(r, timeout=30) for r in requests]
    deadline = time.monotonic() + 20
    while sum(f.done() for f in futures) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    # SIGKILL straight away: the harness would close the channel first, which
    # cancels the calls before the kill lands.
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    answered: dict[str, csi_pb2.Volume] = {}
    lost: dict[str, grpc.StatusCode] = {}
    for r, f in zip(requests, futures):
        try:
            answered[r.name] = f.result(timeout=30).volume
        except grpc.RpcError as exc:
            lost[r.name] = exc.code()
    assert answered, "no create finished before the kill"
    assert set(lost.values()) <= {grpc.StatusCode.UNAVAILABLE}, lost
    d.kill()  # close the channel; the process is already gone

    d.start()
    vols = records_dir(d, "volumes")
    by_name = {r.name: r for r in requests}
    # Everything the CO was told exists, complete and of the right size.
    for name, vol in answered.items():
        want = by_name[name].capacity_range.required_bytes
        assert vol.capacity_bytes == want
        path = backing(d, vol.volume_id)
        assert path.stat().st_size == want, name
        if by_name[name].parameters.get("provisioning") == "thick":
            assert backend.allocated_bytes(path) >= want, name
        assert read_record(vols, vol.volume_id)["state"] == "ready"
    # No half-made leftovers.
    assert not [n for n in entries(pool(d) / "volumes") if n.startswith(".")]
    assert all(n.endswith(".json") and not n.startswith(".") for n in entries(vols)), entries(vols)
    on_disk = {p.stem: json.loads(p.read_text()) for p in vols.glob("*.json")}
    assert all(r["state"] == "ready" for r in on_disk.values())
    # ListVolumes (walked in pages) is exactly the records on disk, and every
    # listed volume has its complete backing file.
    listed = list_volume_ids(d, page=5)
    assert len(listed) == len(set(listed))
    assert set(listed) == set(on_disk)
    assert {p.stem for p in (pool(d) / "volumes").glob("*.img")} == set(on_disk)
    for vid, rec in on_disk.items():
        assert backing(d, vid).stat().st_size == rec["capacity_bytes"]
    assert {v.volume_id for v in answered.values()} <= set(on_disk)
    # The CO retries everything: answered names keep their ids, the rest are made now.
    for r in requests:
        vol = d.controller.CreateVolume(r, timeout=30).volume
        if r.name in answered:
            assert vol.volume_id == answered[r.name].volume_id
        assert backing(d, vol.volume_id).stat().st_size == r.capacity_range.required_bytes
    assert len(list_volume_ids(d)) == len(requests)
    for vid in list_volume_ids(d):
        d.delete(vid)
    assert_nothing_left(d, root)


# -- signals and sockets --------------------------------------------------------------------------


def test_sigterm_exits_zero_promptly_and_removes_the_socket(root):
    d = root.driver().start()
    vol = d.create("pvc-term", SIZE)
    started = time.monotonic()
    assert d.stop(signal.SIGTERM) == 0
    assert time.monotonic() - started < 5
    assert not os.path.lexists(d.socket)
    d.start()
    assert list_volume_ids(d) == [vol.volume_id]
    d.delete(vol.volume_id)
    assert d.stop(signal.SIGINT) == 0
    assert not os.path.lexists(d.socket)


def test_stale_socket_of_a_killed_driver_is_replaced(root):
    d = root.driver().start()
    vol = d.create("pvc-stale", SIZE)
    d.kill()
    assert stat.S_ISSOCK(os.lstat(d.socket).st_mode)
    d.start()
    assert d.identity.Probe(csi_pb2.ProbeRequest(), timeout=5).ready.value
    assert d.create("pvc-stale", SIZE).volume_id == vol.volume_id
    d.delete(vol.volume_id)
    assert d.stop() == 0
    assert not os.path.lexists(d.socket)


def _run_driver(d: DriverProcess, log: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "crust", "driver", "--endpoint", f"unix://{d.socket}", "--node-id", d.node_id,
            "--data-dir", str(d.data_dir), "--capacity", "100Gi", "--log-format", "text"]
    with open(log, "wb") as err:
        return subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=err, timeout=30)


def test_second_driver_on_a_live_socket_fails_and_touches_nothing(root):
    first = root.driver().start()
    vol = first.create("pvc-live", SIZE)
    sock_ino = os.lstat(first.socket).st_ino
    # What the live driver may be in the middle of: a create whose file is
    # being written, and an attach whose node record is not written yet.
    busy = backend.new_id("vol")
    put_record(records_dir(first, "volumes"), busy, VolumeRecord(
        volume_id=busy, name="pvc-busy", node=NODE, capacity_bytes=SIZE, state=Lifecycle.CREATING))
    partial = pool(first) / "volumes" / f".{busy}.img.partial"
    partial.write_bytes(b"\x01" * 4096)
    device = losetup(backing(first, vol.volume_id))
    try:
        second = DriverProcess(root=root.path)  # same socket, same data dir
        log = root.path / "second.log"
        try:
            result = _run_driver(second, log)
        except subprocess.TimeoutExpired:
            pytest.fail("the second driver kept running on a socket that was in use")
        assert result.returncode != 0
        assert "another server" in log.read_text()
        # The first driver still owns and serves its socket.
        assert os.lstat(first.socket).st_ino == sock_ino
        assert first.identity.Probe(csi_pb2.ProbeRequest(), timeout=5).ready.value
        assert first.create("pvc-live", SIZE).volume_id == vol.volume_id
        # And the second one changed nothing of the first one's state.
        assert read_record(records_dir(first, "volumes"), busy)["state"] == "creating"
        assert partial.exists()
        assert sysloop.devices_for(backing(first, vol.volume_id)) == [device]
    finally:
        detach_if_ours(device, backing(first, vol.volume_id))
    (records_dir(first, "volumes") / f"{busy}.json").unlink()
    partial.unlink()
    first.delete(vol.volume_id)
    assert first.stop() == 0


def test_driver_refuses_to_replace_a_file_that_is_not_a_socket(root):
    d = DriverProcess(root=root.path)
    d.socket.write_text("precious")
    result = _run_driver(d, root.path / "refused.log")
    assert result.returncode != 0
    assert d.socket.read_text() == "precious"
    assert "not a socket" in (root.path / "refused.log").read_text()
