"""What QEMU is asked to run for a VM: its config (kernel, initramfs,
accelerator, memory, disk bus, shares, NIC) and the guest kernel's command
line. crust.kata.vmm.qemu runs it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from crust.kata.vmm.devices import Nic, SharedDir

ACCELERATORS = ("tcg", "kvm")
DISK_BUSES = ("virtio-blk", "virtio-scsi")
# What the guest's /init reads on its command line to load the SCSI modules
# (the image lists them, crust.kata.image.build), and the SCSI layer's boot scan
# switched off: with nothing attached at boot it would probe 256 targets.
SCSI_CMDLINE = "scsi_mod.scan=none crust.disks=scsi"
# The devices every VM has, beyond its config (a saved VM loads only into
# the same set: crust.kata.supply.template keys its saves with this).
DEVICE_LAYOUT = "uart-console,virtio-serial-agent"
MIB = 1024 * 1024
# The guest kernel's memory block on x86-64 (/sys/devices/system/memory/
# block_size_bytes): memory is plugged in whole blocks (crust.kata.pod.guest_memory).
BLOCK_MIB = 128


# The guest kernel's command line. Past the console and the panic policy,
# each setting skips work a pod's VM has no use for, which under software
# emulation is a good part of a boot to the agent:
# - cryptomgr.notests: no self-test of every crypto algorithm at boot (the
#   largest of them); the algorithms a volume uses are still Debian's;
# - i8042.*: no probe for a PS/2 keyboard and mouse (the VM has none: its
#   console and agent are serial ports);
# - noreplace-smp, rcupdate.rcu_expedited=1: no patching of the kernel's SMP
#   instructions for one CPU, shorter RCU grace periods at boot;
# - pci=lastbus=0: every device the VM gets (disks hot-plugged included) is
#   on the machine's one PCI bus, so no other bus is scanned;
# - memhp_default_state=online: memory hot-plugged for a pod bigger than
#   the floor (crust.kata.pod.guest_memory) is onlined by the kernel itself.
# And one that costs a little work: init_on_free=1, every page the guest
# frees is cleared, so the free memory of a saved guest is zeros, which its
# RAM file leaves as holes (crust.kata.vmm.saved_ram), the initramfs it freed
# after unpacking it included.
# Kata's QEMU guests boot with these among their defaults (and with
# tsc=reliable and no_timer_check, which saved nothing here).
GUEST_CMDLINE = ("console=ttyS0 quiet panic=-1 cryptomgr.notests i8042.direct=1 i8042.dumbkbd=1 i8042.nopnp=1 "
                 "i8042.noaux=1 noreplace-smp rcupdate.rcu_expedited=1 pci=lastbus=0 init_on_free=1 "
                 "memhp_default_state=online")


@dataclass
class VmConfig:
    kernel: Path
    initrd: Path
    accel: str = "tcg"
    memory_mib: int = 256
    # The most the guest may have once a pod's DIMM is plugged
    # (crust.kata.pod.guest_memory); not above memory_mib: no room for one.
    max_memory_mib: int = 0
    cpus: int = 1
    cmdline: str = GUEST_CMDLINE
    qemu_binary: str = "qemu-system-x86_64"
    extra_args: tuple[str, ...] = ()
    # Host directories the guest mounts with virtio-fs, each served by a
    # virtiofsd of this VM's own (a pod's shares: crust.kata.vmm.share).
    shared_dirs: tuple[SharedDir, ...] = ()
    # The pod's network: a tap in its network namespace (crust.sys.podnet).
    nic: Nic | None = None
    # Guest RAM shareable with a file server even without shared_dirs: a
    # VM booted ahead of its pod (crust.kata.supply.pool) gets its shares later.
    shared_memory: bool = False
    # Guest RAM (shared) in a memfd of crust's own, left out of a saved
    # state and saved beside it: a VM saved or restored (crust.kata.vmm.saved_ram).
    ram_apart: bool = False
    # QEMU's nice value: a VM booted ahead runs at 10 until a pod takes it
    # (renice), so its boot yields the CPU to pods starting meanwhile.
    nice: int = 0
    # How disks reach the guest (DISK_BUSES; the module docstring compares).
    disk_bus: str = "virtio-blk"


def memory_arg(memory_mib: int, max_memory_mib: int) -> str:
    """QEMU's -m: the boot memory, and room for one DIMM when the ceiling is above it."""
    if max_memory_mib > memory_mib:
        return f"{memory_mib}M,slots=1,maxmem={max_memory_mib}M"
    return str(memory_mib)
