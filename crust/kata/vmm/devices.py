"""What a running VM is given and loses while it runs: disks hot-plugged
(virtio-blk devices, or LUNs of its virtio-scsi controller), grown and
unplugged, a shared directory (a virtiofsd and a vhost-user-fs device)
and the pod's NIC, all through QMP; and its file servers (one virtiofsd
per share: their sockets and QEMU arguments, a dead one found and its VM
killed, those an earlier handler recorded stopped). The half of crust.kata.vmm.qemu.Vm that
is about devices (a mixin: the QMP client, config and tables are Vm's).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from crust.common.errors import CrustError
from crust.kata.agent import volume_calls
from crust.kata.vmm.qmp import QmpError
from crust.kata.vmm.virtiofsd import Virtiofsd, VirtiofsdError

log = logging.getLogger("crust.kata.vmm.qemu")

# The virtio-scsi controller's QMP id; its LUNs are on bus scsi0.0, target 0.
SCSI_CONTROLLER = "scsi0"
# Linux's virtio_scsi takes LUNs below 16384.
MAX_LUN = 16383
# virtio-blk serials are at most 20 bytes; the same word names the QMP nodes.
SERIAL = re.compile(r"^[A-Za-z0-9_.-]{1,20}$")


class VmError(Exception):
    pass


class VmHung(VmError):
    """QEMU runs but does not answer on its monitor."""


class GuestSilent(VmError):
    """QEMU runs but its guest's agent did not answer in time."""


@dataclass(frozen=True)
class Nic:
    """A virtio-net NIC on a tap device QEMU takes by its descriptor (made
    in the pod's network namespace; QEMU itself stays in the host's)."""
    tap_fd: int
    mac: str


# The tags a VM's shares may have (adopt() looks for their daemons).
SHARE_TAGS = ("crust", "crust-live")


@dataclass(frozen=True)
class SharedDir:
    tag: str           # what the guest mounts (mount -t virtiofs <tag>)
    source: Path
    cache: str = "auto"   # virtiofsd's cache mode (crust.kata.vmm.virtiofsd says which and why)

    @property
    def suffix(self) -> str:
        """What names its socket and daemon files: nothing for tag crust (the
        names a VM of one share always had), -live for crust-live."""
        rest = self.tag.removeprefix("crust").lstrip("-")
        return f"-{rest}" if rest else ""


@dataclass
class Disk:
    serial: str
    host_device: str
    node: str          # QMP block node (blockdev-add)
    device_id: str     # QMP device (device_add)
    readonly: bool
    lun: int | None = None   # its LUN on the virtio-scsi controller; None: a virtio-blk disk


class VmDevices:
    # -- its file servers (a virtiofsd per share) -----------------------------------

    def fs_socket(self, shared: SharedDir) -> Path:
        return self.socket_dir / f"fs{shared.suffix}.sock"

    def _daemon(self, shared: SharedDir) -> Virtiofsd:
        return Virtiofsd(self.workdir, self.fs_socket(shared), shared.source, cache=shared.cache,
                         name=f"virtiofsd{shared.suffix}")

    def _shared_dir_args(self) -> list[str]:
        """vhost-user-fs needs the guest's RAM shareable with virtiofsd: a
        memfd backend for all of it, one NUMA node; a device per share."""
        if not self.config.shared_dirs and not self.config.shared_memory:
            return []
        if self.config.ram_apart:
            # crust's memfd, inherited under its number (crust.kata.vmm.saved_ram).
            backend = f"memory-backend-file,id=mem,size={self.config.memory_mib}M,share=on," \
                      f"mem-path=/proc/self/fd/{self.ram_fd}"
        else:
            backend = f"memory-backend-memfd,id=mem,size={self.config.memory_mib}M,share=on"
        args = ["-object", backend, "-numa", "node,memdev=mem"]
        for n, shared in enumerate(self.config.shared_dirs):
            args += ["-chardev", f"socket,id=vfs{n},path={self.fs_socket(shared)}",
                     "-device", f"vhost-user-fs-pci,chardev=vfs{n},tag={shared.tag}"]
        return args

    def dead_file_server(self) -> Virtiofsd | None:
        """A file server of this running VM that ended before it (killed):
        the guest's requests to its share then wait for ever."""
        if self.stopping or not self.alive():
            return None
        return next((d for d in self.virtiofsds.values() if not d.alive()), None)

    async def lose_file_server(self, daemon: Virtiofsd) -> str:
        """The VM of a file server that died is killed, as Kata stops a
        sandbox whose virtiofsd quit: its guest's processes would otherwise
        hang on the share, and no stop could reach them. Returns the reason
        the agent's calls now fail with."""
        await self.port.close(f"its virtiofsd ({daemon.name}, cache={daemon.cache}) {daemon.ending()}")
        log.error("vm %s: %s; the VM is killed", self.name, self.port.dead)
        await self.kill()
        return self.port.dead

    async def stop_recorded_shares(self) -> None:
        """The file servers an earlier handler process recorded for this VM
        (a VM killed from its record): each stopped if it still runs, its
        record and socket removed."""
        for tag in SHARE_TAGS:
            daemon = self._daemon(SharedDir(tag, Path(".")))
            daemon.adopt()
            await daemon.stop()

    async def _stop_virtiofsd(self) -> None:
        """Once QEMU is gone (it would lose its file server under it)."""
        for daemon in self.virtiofsds.values():
            await daemon.stop()

    # -- devices of a booted VM --------------------------------------------------------

    async def plug_shared_dir(self, shared: SharedDir) -> None:
        """A shared directory added to a running VM (booted with shared
        memory): its virtiofsd started, then a vhost-user-fs device on its
        socket; the guest sees the tag once the device is probed."""
        if not self.config.shared_memory:
            raise VmError(f"vm {self.name}: booted without shared memory, it cannot take a shared directory")
        if shared.tag in self.virtiofsds:
            return
        daemon = self._daemon(shared)
        try:
            await daemon.start()
        except (VirtiofsdError, OSError) as exc:
            raise VmError(f"vm {self.name}: its shared directory {shared.tag}: {exc}") from None
        chardev = f"vfs-{shared.tag}"
        try:
            await self.qmp.execute("chardev-add", {"id": chardev, "backend": {"type": "socket", "data": {
                "addr": {"type": "unix", "data": {"path": str(self.fs_socket(shared))}}, "server": False}}})
            await self.qmp.execute("device_add", {"driver": "vhost-user-fs-pci", "chardev": chardev,
                                                  "tag": shared.tag, "id": f"fs-{shared.tag}"})
        except BaseException:
            await daemon.stop()
            raise
        self.virtiofsds[shared.tag] = daemon
        self.config.shared_dirs = (*self.config.shared_dirs, shared)

    async def plug_nic(self, nic: Nic) -> None:
        """The pod's NIC added to a running VM: the tap's descriptor handed
        to QEMU over QMP (getfd), a tap netdev on it, a virtio-net device
        with the pod's MAC address. The caller keeps (and closes) its copy."""
        if self.config.nic is not None:
            raise VmError(f"vm {self.name} has a NIC already")
        await self.qmp.execute_with_fd("getfd", {"fdname": "pod-tap"}, nic.tap_fd)
        await self.qmp.execute("netdev_add", {"type": "tap", "id": "pod", "fd": "pod-tap", "vhost": False})
        await self.qmp.execute("device_add", {"driver": "virtio-net-pci", "netdev": "pod", "mac": nic.mac,
                                              "id": "pod-nic", "romfile": ""})
        self.config.nic = nic

    # ---------------------------------------------------------------- disks

    async def _peripherals(self) -> set[str]:
        """The ids of the devices added by id (-device id=, device_add)."""
        return {entry["name"] for entry in await self.qmp.execute("qom-list", {"path": "/machine/peripheral"})
                if entry.get("type", "").startswith("child<")}

    async def attach_disk(self, host_device: str, serial: str, readonly: bool = False,
                          direct: bool = False, kind: str = "host_device") -> Disk:
        """Hot-plug a host block device with this serial (the agent finds
        the guest disk by it), on the VM's disk bus: a virtio-blk device,
        or a LUN of the virtio-scsi controller. direct: O_DIRECT on the
        host. kind "file": a regular file holds the disk (the pool's warm-up
        image), not a block device."""
        if kind not in ("host_device", "file"):
            raise ValueError(f"disk kind {kind!r}: host_device or file")
        if not SERIAL.match(serial):
            raise ValueError(f"serial {serial!r}: 1-20 of [A-Za-z0-9_.-]")
        if serial in self.disks:
            raise VmError(f"vm {self.name}: a disk with serial {serial} is attached already")
        scsi = self.config.disk_bus == "virtio-scsi"
        disk = self._disk(serial, host_device, readonly, lun=self._next_lun if scsi else None)
        await self.qmp.execute("blockdev-add", {
            "driver": kind, "filename": host_device, "node-name": disk.node,
            "read-only": readonly, "cache": {"direct": direct}})
        try:
            if scsi:
                await self._add_lun(disk)
            else:
                await self.qmp.execute("device_add", {
                    "driver": "virtio-blk-pci", "id": disk.device_id, "drive": disk.node, "serial": serial})
        except BaseException:
            await self.qmp.execute("blockdev-del", {"node-name": disk.node})
            raise
        self.disks[serial] = disk
        return disk

    async def _add_lun(self, disk: Disk) -> None:
        """The disk as the next free LUN of the controller (a LUN an earlier
        handler process plugged is skipped: QEMU says it is in use)."""
        while True:
            if self._next_lun > MAX_LUN:
                raise VmError(f"vm {self.name}: no LUN left on its SCSI controller")
            disk.lun = self._next_lun
            self._next_lun += 1
            try:
                await self.qmp.execute("device_add", {
                    "driver": "scsi-hd", "id": disk.device_id, "drive": disk.node, "serial": disk.serial,
                    "bus": f"{SCSI_CONTROLLER}.0", "channel": 0, "scsi-id": 0, "lun": disk.lun})
                return
            except QmpError as exc:
                if "already used" not in exc.desc:
                    raise

    @staticmethod
    def _disk(serial: str, host_device: str, readonly: bool, lun: int | None = None) -> Disk:
        return Disk(serial, host_device, node=f"disk-{serial}",
                    device_id=f"vblk-{serial}" if lun is None else f"vscsi-{serial}", readonly=readonly, lun=lun)

    async def resize_disk(self, serial: str, size: int | None = None) -> int:
        """Tell the guest its disk grew (after the host device grew, e.g.
        losetup -c). size defaults to the host device's current size."""
        disk = self.disks[serial]
        if size is None:
            fd = os.open(disk.host_device, os.O_RDONLY)
            try:
                size = os.lseek(fd, 0, os.SEEK_END)
            finally:
                os.close(fd)
        await self.qmp.execute("block_resize", {"node-name": disk.node, "size": size})
        return size

    async def detach_disk(self, serial: str, timeout: float = 30.0) -> None:
        """Unplug (the guest must let go: unmount first), then drop the node.
        A virtio-blk disk goes once the guest ejects it; a LUN at once (QEMU
        tells the guest it went), and then this waits until the guest has
        removed its disk."""
        disk = self.disks[serial]
        mark = self.qmp.mark()
        try:
            await self.qmp.execute("device_del", {"id": disk.device_id})
            await self.qmp.wait_event("DEVICE_DELETED", mark, lambda d: d.get("device") == disk.device_id,
                                      timeout=timeout)
        except QmpError as exc:
            if exc.error_class != "DeviceNotFound":
                raise
        except asyncio.TimeoutError:
            raise VmError(f"vm {self.name}: the guest did not release disk {serial} within {timeout:.0f}s") from None
        await self.qmp.execute("blockdev-del", {"node-name": disk.node})
        del self.disks[serial]
        if disk.lun is not None:
            await self._lun_gone(serial, timeout)

    async def _lun_gone(self, serial: str, timeout: float) -> None:
        """Wait until the guest removed the disk of a LUN QEMU removed (it
        does so in the background): the same serial plugged again must be
        the new disk. A guest that is gone has no disk left to wait for."""
        client = await self.port.ready()
        if client is None:
            return
        try:
            await volume_calls.wait_disk_removed(client, serial, timeout)
        except CrustError as exc:
            if self.alive():
                raise VmError(f"vm {self.name}: disk {serial} unplugged, but the guest still has it: "
                              f"{exc.message}") from None
