"""The guest agent's volume calls (MountVolume, VolumeStats, GrowVolume,
UnmountVolume, WaitDiskRemoved) run on the host without a VM: the agent's
service served over ttrpc on a unix socket, the host's AgentClient, real
loop devices with real file systems. The only stand-in is the directory the
agent reads disks' serials from (a loop device has none): a tree of
block/<loopN>/serial files; the kernel's device events are real (a
"change" written to the loop device's uevent file)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.common.ttrpc import TtrpcError
from crust.guest.disks import Disks
from crust.guest.service import AgentService
from crust.guest.uevents import DeviceEvents
from crust.guest.volumes import Volumes
from crust.sys import caps
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness import loops
from tests.harness.guest_serving import serving

MiB = 1 << 20


@pytest.fixture
def disks(tmp_path):
    """make(fs_type, size, serial): a loop device with that file system whose
    serial the agent reads; everything mounted below tmp_path and every
    loop device made is gone after the test."""
    sys_block = tmp_path / "block"
    sys_block.mkdir()
    made: list[tuple[str, Path]] = []

    def make(fs_type: str, size: int = 64 * MiB, serial: str | None = None) -> tuple[str, Path]:
        image = tmp_path / f"disk{len(made)}.img"
        with open(image, "wb") as f:
            f.truncate(size)
        subprocess.run([f"mkfs.{fs_type}", "-q", *(["-F"] if fs_type == "ext4" else []), str(image)], check=True)
        device = sysloop.attach_sync(image)
        made.append((device, image))
        if serial is not None:
            name_serial(sys_block, device, serial)
        return device, image

    yield sys_block, make
    try:
        for entry in reversed(sysmount.mounts()):
            if entry.mount_point.startswith(str(tmp_path) + "/"):
                sysmount.unmount_all(entry.mount_point)
    finally:
        # Also when an unmount failed; a device that does not go fails the
        # test, naming what holds it.
        loops.release_each(made)


def name_serial(sys_block: Path, device: str, serial: str) -> None:
    entry = sys_block / os.path.basename(device)
    entry.mkdir(exist_ok=True)
    (entry / "serial").write_text(serial)


def announce(device: str) -> None:
    """A real uevent for the device, as the kernel sends for a hot-plug."""
    Path(f"/sys/block/{os.path.basename(device)}/uevent").write_text("change")


def storage(volume_id: str, serial: str, fs_type: str, mount_point: Path, **extra) -> agent_pb2.Storage:
    return agent_pb2.Storage(volume_id=volume_id, disk=agent_pb2.Disk(serial=serial), fs_type=fs_type,
                             mount_point=str(mount_point), **extra)


async def mount(client, s: agent_pb2.Storage, timeout: float = 20) -> agent_pb2.MountVolumeResponse:
    return await client.call("MountVolume", agent_pb2.MountVolumeRequest(storage=s), timeout=timeout)


async def refused(call) -> TtrpcError:
    with pytest.raises(TtrpcError) as caught:
        await call
    return caught.value


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_a_volume_is_mounted_measured_grown_and_unmounted_by_its_id(tmp_path, disks, fs_type):
    sys_block, make = disks
    device, image = make(fs_type, 320 * MiB, serial="v-grow")
    target = tmp_path / "volumes" / "v1"

    async def scenario():
        async with serving(tmp_path, AgentService(volumes=Volumes(Disks(DeviceEvents(), sys_block=str(sys_block))))) as (client, details):
            assert {"disk.virtio-blk", "volume.grow", f"fs.{fs_type}"} <= set(details.capabilities)
            answer = await mount(client, storage("v1", "v-grow", fs_type, target,
                                                 options=["nouuid"] if fs_type == "xfs" else []))
            assert (answer.device, answer.mount_point) == (os.path.basename(device), str(target))
            entry = sysmount.at(str(target))
            assert entry is not None and entry.fs_type == fs_type and not entry.readonly
            assert (os.major(os.stat(device).st_rdev), os.minor(os.stat(device).st_rdev)) == (entry.major,
                                                                                             entry.minor)
            # A retry answers the same; other parameters for the id are refused.
            again = await mount(client, storage("v1", "v-grow", fs_type, target,
                                                options=["nouuid"] if fs_type == "xfs" else []))
            assert again.mount_point == str(target) and len(sysmount.mounts(containing=str(target))) == 1
            other = await refused(mount(client, storage("v1", "v-grow", fs_type, target, readonly=True)))
            assert other.code == ttrpc.ALREADY_EXISTS and "storage.volume_id" in other.message

            (target / "data").write_bytes(os.urandom(16 * MiB))
            os.sync()
            stats = await client.call("VolumeStats", agent_pb2.VolumeStatsRequest(volume_id="v1"), timeout=10)
            st = os.statvfs(target)
            assert stats.total_bytes == st.f_frsize * st.f_blocks
            assert stats.used_bytes == stats.total_bytes - stats.free_bytes
            assert stats.used_bytes >= 16 * MiB
            assert stats.available_bytes <= stats.free_bytes
            assert stats.inodes_used == stats.inodes_total - stats.inodes_free > 0
            assert stats.device_bytes == 320 * MiB and stats.fs_type == fs_type
            assert not stats.readonly and not stats.condition.abnormal

            os.truncate(image, 640 * MiB)
            await sysloop.refresh_capacity(device)
            if fs_type == "ext4" and not caps.effective(caps.CAP_SYS_RESOURCE):
                # The kernel grows a mounted ext4 only for CAP_SYS_RESOURCE,
                # which a guest's agent has and some hosts' root lacks.
                denied = await refused(client.call("GrowVolume", agent_pb2.GrowVolumeRequest(volume_id="v1"),
                                                   timeout=60))
                assert denied.code == ttrpc.FAILED_PRECONDITION and "CAP_SYS_RESOURCE" in denied.message
                assert os.statvfs(target).f_blocks * os.statvfs(target).f_frsize == stats.total_bytes
                await client.call("UnmountVolume", agent_pb2.UnmountVolumeRequest(volume_id="v1"), timeout=30)
                return
            grown = await client.call("GrowVolume", agent_pb2.GrowVolumeRequest(volume_id="v1"), timeout=60)
            assert grown.device_bytes == 640 * MiB and grown.total_bytes > stats.total_bytes
            assert os.statvfs(target).f_blocks * os.statvfs(target).f_frsize == grown.total_bytes
            same = await client.call("GrowVolume", agent_pb2.GrowVolumeRequest(volume_id="v1"), timeout=60)
            assert same.total_bytes == grown.total_bytes

            gone = await client.call("UnmountVolume", agent_pb2.UnmountVolumeRequest(volume_id="v1"), timeout=30)
            assert gone.unmounted and gone.known and sysmount.at(str(target)) is None
            again = await client.call("UnmountVolume", agent_pb2.UnmountVolumeRequest(volume_id="v1"), timeout=30)
            assert not again.unmounted and not again.known
            missing = await refused(client.call("VolumeStats", agent_pb2.VolumeStatsRequest(volume_id="v1"),
                                                timeout=10))
            assert missing.code == ttrpc.NOT_FOUND and "v1" in missing.message

    asyncio.run(scenario())


def test_a_disk_plugged_while_the_mount_waits_is_mounted_on_its_event_and_one_never_plugged_times_out(
        tmp_path, disks):
    sys_block, make = disks
    device, _ = make("ext4")
    target = tmp_path / "late"

    async def scenario():
        async with serving(tmp_path, AgentService(volumes=Volumes(Disks(DeviceEvents(), sys_block=str(sys_block))))) as (client, _):
            waiting = asyncio.create_task(mount(client, storage("late", "v-late", "ext4", target), timeout=30))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            name_serial(sys_block, device, "v-late")
            announce(device)
            answer = await asyncio.wait_for(waiting, 20)
            assert answer.device == os.path.basename(device) and sysmount.at(str(target)) is not None

            never = await refused(mount(client, storage("never", "v-never", "ext4", tmp_path / "never"), timeout=2))
            assert never.code == ttrpc.DEADLINE_EXCEEDED
            assert "storage.disk.serial" in never.message and "v-never" in never.message
            assert sysmount.at(str(tmp_path / "never")) is None

            stays = await refused(client.call(
                "WaitDiskRemoved", agent_pb2.WaitDiskRemovedRequest(disk=agent_pb2.Disk(serial="v-late")),
                timeout=2))
            assert stays.code == ttrpc.DEADLINE_EXCEEDED and "v-late" in stays.message
            # A removed disk: the wait ends on the event that announces it.
            await client.call("UnmountVolume", agent_pb2.UnmountVolumeRequest(volume_id="late"), timeout=30)
            removal = asyncio.create_task(client.call(
                "WaitDiskRemoved", agent_pb2.WaitDiskRemovedRequest(disk=agent_pb2.Disk(serial="v-late")),
                timeout=30))
            await asyncio.sleep(0.5)
            assert not removal.done()
            (sys_block / os.path.basename(device) / "serial").unlink()
            announce(device)
            await asyncio.wait_for(removal, 20)
            await client.call("WaitDiskRemoved", agent_pb2.WaitDiskRemovedRequest(
                disk=agent_pb2.Disk(serial="v-late")), timeout=5)

    asyncio.run(scenario())


def test_fs_group_read_only_and_busy_volumes_behave_as_kubernetes_expects(tmp_path, disks):
    sys_block, make = disks
    make("ext4", serial="v-group")
    make("ext4", serial="v-ro")
    group_at, ro_at = tmp_path / "group", tmp_path / "ro"

    async def scenario():
        async with serving(tmp_path, AgentService(volumes=Volumes(Disks(DeviceEvents(), sys_block=str(sys_block))))) as (client, _):
            answer = await mount(client, storage("g", "v-group", "ext4", group_at, fs_group=agent_pb2.FsGroup(
                gid=4321, policy=agent_pb2.FsGroup.ON_ROOT_MISMATCH)))
            assert answer.fs_group_walked
            st = os.stat(group_at / "lost+found")
            assert st.st_gid == 4321 and st.st_mode & 0o2070 == 0o2070

            await mount(client, storage("r", "v-ro", "ext4", ro_at, readonly=True))
            assert sysmount.at(str(ro_at)).readonly
            with pytest.raises(OSError):
                (ro_at / "x").write_text("no")
            stats = await client.call("VolumeStats", agent_pb2.VolumeStatsRequest(volume_id="r"), timeout=10)
            assert stats.readonly and not stats.condition.abnormal

            held = os.open(group_at / "lost+found", os.O_RDONLY)
            try:
                busy = await refused(client.call("UnmountVolume", agent_pb2.UnmountVolumeRequest(volume_id="g"),
                                                 timeout=30))
                assert busy.code == ttrpc.FAILED_PRECONDITION and "g" in busy.message
                assert sysmount.at(str(group_at)) is not None
            finally:
                os.close(held)
            done = await client.call("UnmountVolume", agent_pb2.UnmountVolumeRequest(volume_id="g"), timeout=30)
            assert done.unmounted and sysmount.at(str(group_at)) is None

    asyncio.run(scenario())


@pytest.mark.parametrize("change, code, field", [
    ({"volume_id": "../x"}, ttrpc.INVALID_ARGUMENT, "storage.volume_id"),
    ({"mount_point": "relative/path"}, ttrpc.INVALID_ARGUMENT, "storage.mount_point"),
    ({"mount_point": "/proc/crust"}, ttrpc.INVALID_ARGUMENT, "storage.mount_point"),
    ({"mount_point": "/a/../b"}, ttrpc.INVALID_ARGUMENT, "storage.mount_point"),
    ({"fs_type": "ntfs"}, ttrpc.INVALID_ARGUMENT, "storage.fs_type"),
    ({"options": ["ro"]}, ttrpc.INVALID_ARGUMENT, "storage.options[0]"),
    ({"options": ["noatime", "a,b"]}, ttrpc.INVALID_ARGUMENT, "storage.options[1]"),
    ({"serial": "bad serial!"}, ttrpc.INVALID_ARGUMENT, "storage.disk.serial"),
    ({"encrypted": "crypt-none"}, ttrpc.NOT_FOUND, "storage.encrypted"),
    ({"encrypted": "../mapper"}, ttrpc.INVALID_ARGUMENT, "storage.encrypted"),
])
def test_bad_storage_gets_its_code_and_the_field_and_nothing_is_mounted(tmp_path, disks, change, code, field):
    sys_block, make = disks
    make("ext4", serial="v-ok")
    fields = {"volume_id": "v", "mount_point": str(tmp_path / "m"), "fs_type": "ext4", "options": []}
    fields.update({k: v for k, v in change.items() if k not in ("serial", "encrypted")})
    s = agent_pb2.Storage(**fields)
    if "encrypted" in change:
        s.encrypted = change["encrypted"]
    else:
        s.disk.serial = change.get("serial", "v-ok")

    async def scenario():
        async with serving(tmp_path, AgentService(volumes=Volumes(Disks(DeviceEvents(), sys_block=str(sys_block))))) as (client, _):
            error = await refused(mount(client, s, timeout=5))
            assert error.code == code and field in error.message, error.message
            for method, request in (("VolumeStats", agent_pb2.VolumeStatsRequest(volume_id="v")),
                                    ("GrowVolume", agent_pb2.GrowVolumeRequest(volume_id="v"))):
                unknown = await refused(client.call(method, request, timeout=5))
                assert unknown.code == ttrpc.NOT_FOUND

    asyncio.run(scenario())
    assert not any(e.mount_point.startswith(str(tmp_path)) for e in sysmount.mounts())
