"""The guest agent's FreezeVolume and ThawVolume on the host without a VM:
the agent's service over ttrpc on a unix socket, real loop devices with
ext4 and xfs. A writer process shows the freeze: its write and fsync do
not return while the file system is frozen and do once it thawed."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.common.ttrpc import TtrpcError
from crust.guest.disks import Disks
from crust.guest.service import AgentService
from crust.guest.uevents import DeviceEvents
from crust.guest.volumes import Volumes
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness.guest_serving import serving

MiB = 1 << 20
SIZE = {"ext4": 64 * MiB, "xfs": 320 * MiB}
# Says "ready" once started (the file exists already), then writes.
WRITER = "import os, sys\nf = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)\nprint('ready', flush=True)\n" \
         "os.write(f, b'record\\n')\nos.fsync(f)\n"


@pytest.fixture
def disks(tmp_path):
    """make(fs_type, size, serial): a loop device with that file system,
    whose serial the agent reads from a stand-in of /sys/block (a loop
    device has none); unmounted and detached after the test."""
    sys_block = tmp_path / "block"
    sys_block.mkdir()
    made: list[str] = []

    def make(fs_type: str, size: int, serial: str) -> str:
        image = tmp_path / f"disk{len(made)}.img"
        with open(image, "wb") as f:
            f.truncate(size)
        subprocess.run([f"mkfs.{fs_type}", "-q", *(["-F"] if fs_type == "ext4" else []), str(image)], check=True)
        device = sysloop.attach_sync(image)
        made.append(device)
        (sys_block / Path(device).name).mkdir()
        (sys_block / Path(device).name / "serial").write_text(serial)
        return device

    yield sys_block, make
    for entry in reversed(sysmount.mounts()):
        if entry.mount_point.startswith(str(tmp_path) + "/"):
            thaw_on_host(Path(entry.mount_point))
            sysmount.unmount_all(entry.mount_point)
    for device in made:
        sysloop.detach_sync(device)


def storage(volume_id: str, serial: str, fs_type: str, mount_point: Path) -> agent_pb2.Storage:
    return agent_pb2.Storage(volume_id=volume_id, disk=agent_pb2.Disk(serial=serial), fs_type=fs_type,
                             mount_point=str(mount_point), options=["nouuid"] if fs_type == "xfs" else [])


async def mount(client, s: agent_pb2.Storage) -> agent_pb2.MountVolumeResponse:
    return await client.call("MountVolume", agent_pb2.MountVolumeRequest(storage=s), timeout=20)


async def refused(call) -> TtrpcError:
    with pytest.raises(TtrpcError) as caught:
        await call
    return caught.value


def writer(path: Path) -> subprocess.Popen:
    """A process appending a record to path (made before any freeze)."""
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)


async def blocked(proc: subprocess.Popen, for_seconds: float = 1.0) -> bool:
    """Whether the writer, once started, is still in its write for_seconds later."""
    if not hasattr(proc, "started"):
        proc.started = await asyncio.to_thread(proc.stdout.readline) == "ready\n"
    await asyncio.sleep(for_seconds)
    return proc.started and proc.poll() is None


async def finishes(proc: subprocess.Popen, within: float = 20) -> bool:
    for _ in range(int(within / 0.05)):
        if proc.poll() is not None:
            return proc.returncode == 0
        await asyncio.sleep(0.05)
    return False


def thaw_on_host(target: Path) -> None:
    """Whatever a failed test left frozen is thawed before the fixture unmounts."""
    subprocess.run(["fsfreeze", "--unfreeze", str(target)], capture_output=True)


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_a_frozen_volume_holds_writes_until_its_last_thaw(tmp_path, disks, fs_type):
    sys_block, make = disks
    make(fs_type, SIZE[fs_type], serial="v-freeze")
    target = tmp_path / "volumes" / "v1"

    async def scenario():
        service = AgentService(volumes=Volumes(Disks(DeviceEvents(), sys_block=str(sys_block))))
        async with serving(tmp_path, service) as (client, details):
            assert "volume.freeze" in details.capabilities
            await mount(client, storage("v1", "v-freeze", fs_type, target))
            (target / "records").touch()
            call = client.call
            first = await call("FreezeVolume", agent_pb2.FreezeVolumeRequest(volume_id="v1", timeout_seconds=60),
                               timeout=30)
            assert first.depth == 1
            proc = writer(target / "records")
            try:
                assert await blocked(proc), "a write went through a frozen file system"
                second = await call("FreezeVolume", agent_pb2.FreezeVolumeRequest(volume_id="v1"), timeout=30)
                assert second.depth == 2
                one = await call("ThawVolume", agent_pb2.ThawVolumeRequest(volume_id="v1"), timeout=30)
                assert (one.depth, one.was_frozen) == (1, True)
                assert await blocked(proc, 1.0), "the first of two thaws let the write through"
                last = await call("ThawVolume", agent_pb2.ThawVolumeRequest(volume_id="v1"), timeout=30)
                assert (last.depth, last.was_frozen) == (0, True)
                assert await finishes(proc), "the write did not proceed after the last thaw"
                assert (target / "records").read_bytes() == b"record\n"
                again = await call("ThawVolume", agent_pb2.ThawVolumeRequest(volume_id="v1"), timeout=30)
                assert (again.depth, again.was_frozen) == (0, False)

                bad = await refused(call("FreezeVolume", agent_pb2.FreezeVolumeRequest(
                    volume_id="v1", timeout_seconds=601), timeout=30))
                assert bad.code == ttrpc.INVALID_ARGUMENT and "timeout_seconds" in bad.message
                unknown = await refused(call("FreezeVolume", agent_pb2.FreezeVolumeRequest(volume_id="v9"),
                                             timeout=30))
                assert unknown.code == ttrpc.NOT_FOUND and "v9" in unknown.message

                # Unmounting a frozen volume thaws it first (no hung sync).
                await call("FreezeVolume", agent_pb2.FreezeVolumeRequest(volume_id="v1"), timeout=30)
                gone = await call("UnmountVolume", agent_pb2.UnmountVolumeRequest(volume_id="v1"), timeout=30)
                assert gone.unmounted
            finally:
                thaw_on_host(target)
                proc.kill()
                proc.wait()

    asyncio.run(scenario())


def test_a_freeze_whose_thaw_never_comes_ends_by_its_timeout_and_says_so(tmp_path, disks, caplog):
    sys_block, make = disks
    make("ext4", SIZE["ext4"], serial="v-timeout")
    target = tmp_path / "volumes" / "v1"
    caplog.set_level(logging.INFO)

    async def scenario():
        service = AgentService(volumes=Volumes(Disks(DeviceEvents(), sys_block=str(sys_block))))
        async with serving(tmp_path, service) as (client, _):
            await mount(client, storage("v1", "v-timeout", "ext4", target))
            (target / "records").touch()
            frozen = await client.call("FreezeVolume", agent_pb2.FreezeVolumeRequest(
                volume_id="v1", timeout_seconds=4), timeout=30)
            assert frozen.depth == 1
            proc = writer(target / "records")
            try:
                assert await blocked(proc, 0.2)
                assert await finishes(proc, 15), "the freeze outlived its timeout"
                late = await client.call("ThawVolume", agent_pb2.ThawVolumeRequest(volume_id="v1"), timeout=30)
                assert (late.depth, late.was_frozen) == (0, False)
            finally:
                thaw_on_host(target)
                proc.kill()
                proc.wait()
            await client.call("UnmountVolume", agent_pb2.UnmountVolumeRequest(volume_id="v1"), timeout=30)

    asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records if "thawed by itself" in r.getMessage()]
    assert said == ["v1: file system thawed by itself after its freeze timed out (no thaw came)"], said
