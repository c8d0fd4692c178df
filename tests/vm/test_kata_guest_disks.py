"""Disks hot-plugged into one microVM from the handler's image, outside any
handler (tests/harness/guest_vm.py): the pool's disk warm-up on each disk bus (an
image plugged, mounted, unmounted and unplugged, nothing left in the
guest), and on virtio-scsi each disk the next LUN, found by its serial
and never reused, kept on its controller by a process that takes the VM
over.
"""

from __future__ import annotations

import subprocess

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.common.errors import InvalidArgument
from crust.kata.agent import volume_calls
from crust.kata.vmm.qemu import Vm, VmConfig
from tests.harness.guest_vm import Guest, ScsiGuest, guest
from tests.harness.daemons import MIB
from tests.harness.kata_env import DISK_BUSES


@pytest.mark.parametrize("kind", [Guest, ScsiGuest], ids=DISK_BUSES)
def test_a_waiting_vm_plugs_mounts_and_unplugs_a_disk_of_its_own_once(root, kind):
    """The pool's disk warm-up: an image made once in the pool's directory
    (by mkfs only), hot-plugged read-only, mounted and unmounted by the
    guest, unplugged; the guest then holds no disk and no mount of it (a
    LUN's removal, which QEMU announces, within 2 s), and the image is kept
    for the next VM."""
    from crust.kata.supply.pool import WARM_DISK_IMAGE, WARM_DISK_MOUNT, VmPool, warm_disk

    pool = VmPool(0, root.path / "pool", None)
    pool.directory.mkdir()
    image = pool.directory / WARM_DISK_IMAGE

    async def run(g):
        # The guest's agent mounts it: connected and serving this bus.
        await g.port()
        assert volume_calls.serves(g.vm.port, g.vm.config.disk_bus, "ext4")
        await warm_disk(g.vm, await g.port(), pool.directory)
        made = image.stat().st_mtime_ns
        assert g.vm.disks == {}
        leftovers = ("i=0; while ls /sys/block | grep -q -e vd -e sd && [ $i -lt 40 ]; do usleep 50000; "
                     f"i=$((i + 1)); done; ls /sys/block | grep -e vd -e sd; grep {WARM_DISK_MOUNT} /proc/mounts; true")
        assert await g.sh(leftovers) == (0, "")
        await warm_disk(g.vm, await g.port(), pool.directory)
        assert image.stat().st_mtime_ns == made and g.vm.disks == {}
        assert await g.sh(leftovers) == (0, "")
        assert sorted(p.name for p in pool.directory.iterdir()) == [WARM_DISK_IMAGE]
    guest(root, run, kind)
    assert subprocess.run(["blkid", "-o", "value", "-s", "TYPE", str(image)], capture_output=True, text=True,
                          check=True).stdout.strip() == "ext4"


def test_scsi_luns_are_found_by_serial_never_reused_and_a_taken_over_vm_keeps_its_bus(root):
    """On the virtio-scsi bus each disk is the next LUN (one just unplugged
    is not announced again), the agent finds each by its serial, whatever
    its LUN; an unplug returns once the guest removed the disk, so the same
    serial plugged again at once finds the new one; a VM taken over by a
    process set to virtio-blk keeps its disks on the controller (their LUNs
    read back from QEMU) and plugs its next disk there too, past the LUNs
    in use."""
    images = []
    for name in "abcd":
        image = root.path / f"{name}.img"
        with open(image, "wb") as f:
            f.truncate(16 * MIB)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-L", f"disk-{name}", str(image)], check=True)
        images.append(image)

    async def where(g, serial: str, target: str) -> tuple[int, str]:
        """(LUN, label) of the disk the agent mounted at target."""
        client = await g.port()
        answer = await volume_calls.mount(client, volume_calls.storage(serial, "ext4", [], True, target, None))
        device = answer.device
        assert device.startswith("sd") and answer.mount_point == target, answer
        code, out = await g.sh(f"readlink /sys/block/{device}/device; cat /sys/block/{device}/ro; "
                               f"blkid -s LABEL -o value /dev/{device}")
        address, ro, label = out.split()
        assert code == 0 and ro == "0", out     # read-only is the mount's, not the disk's
        assert await volume_calls.unmount(client, target)
        return int(address.rsplit(":", 1)[1]), label

    async def luns(g) -> list[int]:
        """The LUNs of the guest's SCSI disks."""
        code, out = await g.sh("ls /sys/class/scsi_disk")
        assert code == 0, out
        return sorted(int(address.rsplit(":", 1)[1]) for address in out.split())

    async def run(g):
        for serial, image in zip(("lun-a", "lun-b"), images):
            await g.attach(image, serial)
        assert [(d.lun, d.device_id) for d in g.vm.disks.values()] == [(0, "vscsi-lun-a"), (1, "vscsi-lun-b")]
        assert await where(g, "lun-b", "/run/b") == (1, "disk-b")
        assert await where(g, "lun-a", "/run/a") == (0, "disk-a")
        await g.vm.detach_disk("lun-a")
        # No wait here: detach_disk returns once the guest removed the disk.
        assert await luns(g) == [1]
        # The same serial plugged again at once is a new LUN, and the one found.
        await g.vm.attach_disk(g.loops["lun-a"], "lun-a")
        assert g.vm.disks["lun-a"].lun == 2
        assert await where(g, "lun-a", "/run/a") == (2, "disk-a")
        await g.vm.detach_disk("lun-a")
        await g.attach(images[2], "lun-c")
        assert g.vm.disks["lun-c"].lun == 3
        assert await where(g, "lun-c", "/run/c") == (3, "disk-c")
        # The unplugged serial is not found: the mount waits for it until
        # its deadline, then names it; nothing is mounted.
        with pytest.raises(ttrpc.TtrpcError) as refused:
            await (await g.port()).call("MountVolume", agent_pb2.MountVolumeRequest(
                storage=volume_calls.storage("lun-a", "ext4", [], True, "/run/a", None)), timeout=5)
        assert refused.value.code == ttrpc.DEADLINE_EXCEEDED and "'lun-a'" in refused.value.message, refused.value
        assert await g.sh("grep -c ' /run/a ' /proc/mounts") == (1, "0\n")

        # A new process takes the VM over, set to the other bus: this one's
        # connections go first, as its exit would close them.
        identity = g.vm.identity
        await g.vm.port.close()
        await g.vm.qmp.close()
        config = VmConfig(kernel=g.vm.config.kernel, initrd=g.vm.config.initrd)
        taken = Vm(g.vm.name, g.vm.workdir, config, socket_dir=g.vm.socket_dir)
        await taken.adopt(identity, [(g.loops["lun-b"], "lun-b"), (g.loops["lun-c"], "lun-c")])
        g.vm = taken   # stopped by the guest's teardown
        assert taken.config.disk_bus == "virtio-scsi" and config.disk_bus == "virtio-blk"
        assert {s: (d.lun, d.device_id) for s, d in taken.disks.items()} == {
            "lun-b": (1, "vscsi-lun-b"), "lun-c": (3, "vscsi-lun-c")}
        await g.attach(images[3], "lun-d")
        assert taken.disks["lun-d"].lun == 4
        assert await where(g, "lun-d", "/run/d") == (4, "disk-d")
        # The agent's WaitDiskRemoved answers once the guest removed a LUN QEMU dropped.
        mark = taken.qmp.mark()
        await taken.qmp.execute("device_del", {"id": "vscsi-lun-b"})
        await volume_calls.wait_disk_removed(await g.port(), "lun-b", timeout=60)
        assert await luns(g) == [3, 4]
        # QEMU lets go of the LUN's node only when it reports the device
        # deleted, which may come after the guest removed the disk.
        await taken.qmp.wait_event("DEVICE_DELETED", mark, lambda d: d.get("device") == "vscsi-lun-b", timeout=30)
        await taken.detach_disk("lun-b")   # its device gone already: the node goes all the same
        assert "lun-b" not in taken.disks
        with pytest.raises(InvalidArgument, match="'no/such' is not 1..20 characters"):
            await volume_calls.wait_disk_removed(await g.port(), "no/such", timeout=60)
    guest(root, run, ScsiGuest)
