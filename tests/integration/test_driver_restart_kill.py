"""`crust driver` killed and restarted, with real processes, loop devices and mounts.

- SIGKILL between the steps of a volume's life, restart on the same data dir,
  retry the last RPC and finish the life;
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
from crust.driver.records import Lifecycle, VolumeRecord
from crust.sys import loop as sysloop
from tests.harness.driver_restart_calls import (
    NODE,
    SIZE,
    assert_nothing_left,
    backing,
    detach_if_ours,
    entries,
    list_volume_ids,
    losetup,
    node_records_dir,
    pool,
    put_record,
    read_record,
    records_dir,
    write_synced,
)
from tests.harness.daemons import MIB, DriverProcess, loop_autoclear, mount_cap, mounted_at, wait_until

# -- helpers ---------------------------------------------------------------------


def kill_and_restart(d: DriverProcess) -> None:
    d.kill()
    # A SIGKILLed driver leaves its socket file behind.
    assert stat.S_ISSOCK(os.lstat(d.socket).st_mode)
    d.start()


# -- SIGKILL between the steps of a volume's life ------------------------------------------


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
        if not state["staged"]:
            # A device another process holds open when it is detached (a
            # test beside this one reading every loop device's status) is
            # detached by the kernel as that process lets go, moments later.
            wait_until(lambda: not sysloop.devices_for(path), timeout=10, what="the volume's loop device to go")
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


# -- SIGKILL during a stream of creates ----------------------------------------------------


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


# -- signals and sockets -------------------------------------------------------------------


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
