"""The guest's disks, found by the serial the host gave QEMU, waited for on
the kernel's device events (crust.guest.uevents).

A virtio-blk disk shows its serial in sysfs (block/vdX/serial); a disk on
crust's virtio-scsi controller shows its unit serial, VPD page 0x80 (four
bytes of header, then the serial), and its address in the name of its
device (host:channel:target:lun). A disk counts once the kernel made its
node in /dev: the event that announces it comes after that.
"""

from __future__ import annotations

import os
import re
import stat

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.guest.errors import AgentError
from crust.guest.uevents import DeviceEvents

SYS_BLOCK = "/sys/block"
DEV = "/dev"
SERIAL = re.compile(r"[A-Za-z0-9_.-]{1,20}")
VPD_HEADER = 4


def check_disk(field: str, disk: agent_pb2.Disk) -> None:
    if not SERIAL.fullmatch(disk.serial):
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field}.serial: {disk.serial!r} is not 1..20 characters of "
                                                "[A-Za-z0-9_.-]")


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


class Disks:
    def __init__(self, events: DeviceEvents, sys_block: str = SYS_BLOCK, dev: str = DEV):
        self.events = events
        self.sys_block = sys_block
        self.dev = dev

    def serial_of(self, name: str) -> str | None:
        serial = _read(f"{self.sys_block}/{name}/serial")
        if serial is None:
            page = _read(f"{self.sys_block}/{name}/device/vpd_pg80")
            serial = page[VPD_HEADER:] if page is not None and len(page) > VPD_HEADER else None
        return serial.rstrip(b"\0\n").decode(errors="replace") if serial is not None else None

    def _at_address(self, name: str, scsi: agent_pb2.ScsiAddress) -> bool:
        address = os.path.basename(os.path.realpath(f"{self.sys_block}/{name}/device")).split(":")
        return address[1:] == [str(scsi.channel), str(scsi.target), str(scsi.lun)]

    def _present(self, name: str) -> bool:
        try:
            return stat.S_ISBLK(os.stat(f"{self.dev}/{name}").st_mode)
        except OSError:
            return False

    def find(self, disk: agent_pb2.Disk) -> str | None:
        """The kernel's name of the disk (vda, sdb) if the guest has it now."""
        try:
            names = sorted(os.listdir(self.sys_block))
        except OSError:
            return None
        for name in names:
            if self.serial_of(name) == disk.serial and self._present(name) and \
                    (not disk.HasField("scsi") or self._at_address(name, disk.scsi)):
                return name
        return None

    async def wait_present(self, field: str, disk: agent_pb2.Disk, timeout: float) -> str:
        name = await self.events.wait_until(lambda: self.find(disk), timeout)
        if name is None:
            where = f" at SCSI {disk.scsi.channel}:{disk.scsi.target}:{disk.scsi.lun}" if disk.HasField("scsi") else ""
            raise AgentError(ttrpc.DEADLINE_EXCEEDED, f"{field}.serial: no disk with serial {disk.serial!r}{where} "
                                                     f"within {timeout:.0f}s")
        return name

    async def wait_gone(self, field: str, disk: agent_pb2.Disk, timeout: float) -> None:
        gone = await self.events.wait_until(lambda: True if self.find(disk) is None else None, timeout)
        if gone is None:
            raise AgentError(ttrpc.DEADLINE_EXCEEDED, f"{field}.serial: the disk with serial {disk.serial!r} "
                                                     f"({self.find(disk)}) is still there after {timeout:.0f}s")
