"""QEMU's command line for a VM (crust.kata.vmm.qemu), without starting it."""

from __future__ import annotations

import pytest


def test_a_vm_on_the_scsi_bus_boots_with_its_controller_and_says_so_to_the_guest(tmp_path):
    """virtio-scsi: one controller on QEMU's command line, and the guest's
    kernel told to load its SCSI modules and scan nothing at boot;
    virtio-blk (the default): neither. An unknown bus is refused."""
    from crust.kata.vmm.qemu import Vm, VmConfig

    def vm(**settings) -> Vm:
        return Vm("crust-units", tmp_path / "vm", VmConfig(kernel=tmp_path / "k", initrd=tmp_path / "i", **settings))

    scsi, blk = vm(disk_bus="virtio-scsi"), vm()
    argv = scsi.argv()
    assert argv[argv.index("virtio-scsi-pci,id=scsi0") - 1] == "-device"
    append = argv[argv.index("-append") + 1].split()
    assert "crust.disks=scsi" in append and "scsi_mod.scan=none" in append and "console=ttyS0" in append
    plain = blk.argv()
    assert "virtio-scsi-pci,id=scsi0" not in plain
    assert not any("scsi" in word for word in plain[plain.index("-append") + 1].split())
    with pytest.raises(ValueError, match="disk bus 'ide'"):
        vm(disk_bus="ide")
