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


def test_every_vm_maps_its_guest_root_read_only_reports_free_pages_and_bounds_tcgs_buffer(tmp_path):
    """The guest's root: the image beside the initramfs (or the config's),
    a read-only shared file backend of its size on a virtio-pmem device,
    device memory above the RAM for it; a balloon with free page reporting;
    TCG's translation buffer at the config's size, crust's default, or
    QEMU's (0), and nothing of it under KVM. No init_on_free at boot."""
    from crust.kata.vmm.qemu import Vm, VmConfig
    from crust.kata.vmm.config import TCG_TB_MIB
    from crust.node.config import KataSection

    (tmp_path / "root.img").write_bytes(bytes(3 * 1024 * 1024))

    def argv(**settings) -> list[str]:
        config = VmConfig(kernel=tmp_path / "k", initrd=tmp_path / "i", **settings)
        return Vm("crust-units", tmp_path / "vm", config).argv()

    plain = argv()
    backend = plain[plain.index("-object") + 1]
    assert backend == (f"memory-backend-file,id=guest-root,mem-path={tmp_path / 'root.img'},size={3 * 1024 * 1024},"
                       "share=on,readonly=on")
    assert plain[plain.index("-m") + 1] == "256M,slots=1,maxmem=259M"
    assert "virtio-pmem-pci,memdev=guest-root,id=guest-root-pmem" in plain
    assert "virtio-balloon-pci,id=balloon,free-page-reporting=on" in plain
    assert plain[plain.index("-accel") + 1] == f"tcg,tb-size={TCG_TB_MIB}"
    append = plain[plain.index("-append") + 1].split()
    assert "swiotlb=noforce" in append and not any(w.startswith("init_on_free") for w in append)
    assert "lockdown=confidentiality" in append
    assert KataSection().tcg_tb_mib == TCG_TB_MIB

    other = tmp_path / "other.img"
    other.write_bytes(b"")
    assert f"mem-path={other}," in " ".join(argv(root=other))
    assert argv(tcg_tb_mib=64)[plain.index("-accel") + 1] == "tcg,tb-size=64"
    assert argv(tcg_tb_mib=0)[plain.index("-accel") + 1] == "tcg"
    kvm = argv(accel="kvm", tcg_tb_mib=64)
    assert kvm[kvm.index("-accel") + 1] == "kvm" and not any("tb-size" in word for word in kvm)
    # The guest's CPU: RDRAND under tcg (its generator seeded as it boots), the host's under KVM.
    assert plain[plain.index("-cpu") + 1] == "qemu64,+rdrand" and kvm[kvm.index("-cpu") + 1] == "host"


def test_the_guest_root_image_is_sized_to_its_files_and_the_initramfs_only_mounts_it():
    """The image's size: its files' blocks and some room, a multiple of
    2 MiB; the initramfs: busybox, its applets, the listed modules in load
    order and the /init given."""
    from crust.kata.image import cpio, guest_root

    entries = [cpio.directory("usr"), cpio.regular("usr/a", bytes(5000)), cpio.symlink("usr/b", "a")]
    size = guest_root.image_size(entries)
    assert size % guest_root.ALIGN == 0 and size >= 3 * guest_root.BLOCK + 8 * guest_root.MIB
    assert guest_root.image_size(entries + [cpio.regular("big", bytes(20 * guest_root.MIB))]) >= size + 20 * guest_root.MIB

    boot = {e.path: e for e in guest_root.boot_entries(b"bb", [("/lib/modules/r/x.ko", b"x"), ("/lib/modules/r/y.ko", b"y")],
                                                       b"#!/bin/sh\n")}
    assert boot["etc/crust/root-modules"].data == b"/lib/modules/r/x.ko\n/lib/modules/r/y.ko\n"
    assert boot["init"].data == b"#!/bin/sh\n" and boot["bin/busybox"].data == b"bb"
    assert {p for p in boot if p.startswith("bin/")} == {"bin/busybox", *(f"bin/{a}" for a in guest_root.BOOT_APPLETS)}
    assert not any(p.startswith("usr/") for p in boot)
