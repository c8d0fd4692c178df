"""What QEMU is asked to run for a VM: its config (kernel, initramfs, the
guest's root, accelerator, memory, disk bus, shares, NIC) and the guest
kernel's command line. crust.kata.vmm.qemu runs it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from crust.kata.image.guest_root import ROOT_IMAGE
from crust.kata.vmm.devices import Nic, SharedDir

ACCELERATORS = ("tcg", "kvm")
DISK_BUSES = ("virtio-blk", "virtio-scsi")
# What the guest's /init reads on its command line to load the SCSI modules
# (the image lists them, crust.kata.image.build), and the SCSI layer's boot scan
# switched off: with nothing attached at boot it would probe 256 targets.
SCSI_CMDLINE = "scsi_mod.scan=none crust.disks=scsi"
# The devices every VM has, beyond its config (a saved VM loads only into
# the same set: crust.kata.supply.template keys its saves with this).
DEVICE_LAYOUT = "uart-console,virtio-serial-agent,virtio-pmem-root,virtio-balloon-reporting"
# QEMU's ids of the guest root's memory backend and device (ROOT_ARGS).
ROOT_BACKEND = "guest-root"
# TCG's translation buffer (MiB) a VM gets unless its config says:
# measured in bench/microvm/guest_boot.py and bench/runtime/pod_density.py (docs/microvm.md,
# "TCG's translation buffer"). QEMU's own default is a quarter of a
# gigabyte or more per VM on a 64-bit host (an eighth of the host's RAM,
# at most 1 GiB), much of it resident once the guest has run a while.
TCG_TB_MIB = 32
# The guest's CPU under tcg: QEMU's default model with RDRAND, which TCG
# emulates from the host's random source. The guest's kernel trusts the
# CPU's generator (Debian's default), so its generator is ready as it
# boots. Without it nothing seeds it until the first read of /dev/urandom
# (the agent's interpreter takes its hash seed from there as it starts),
# which then runs the kernel's jitter loop: about a second of the one vCPU
# under emulation, before the agent answers (bench/microvm/guest_boot.py).
# Under KVM the guest has the host's CPU, RDRAND with it.
TCG_CPU = "qemu64,+rdrand"
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
#   the floor (crust.kata.pod.guest_memory) is onlined by the kernel itself;
# - no_timer_check: no check at boot that the timer reaches the IO-APIC,
#   which spins ten ticks' time or more by the TSC (the host's clock under
#   emulation) and wants more than four ticks delivered meanwhile: a VM
#   the host starves of CPU (a template's, at nice 10 beside busy pods;
#   any VM on a loaded host) gets too few, and its kernel panics ("IO-APIC
#   + timer doesn't work!") before it is a tenth of a second old;
# - swiotlb=noforce: no bounce buffer for DMA above 4 GiB. The guest
#   root's device memory lies above 4 GiB (crust.kata.image.guest_root), which
#   would have the kernel set 64 MiB of the guest's RAM aside for one; no
#   device of the VM uses it (virtio devices hand the host guest-physical
#   addresses).
# - lockdown=confidentiality: the kernel's lockdown at its strictest level,
#   for what it leaves out: with tracefs locked down the kernel makes none
#   of its trace event files, whose inodes and dentries (about 10,000 of
#   each on Debian 12's 6.1, which makes them all at boot) held 9 MiB of
#   every guest's RAM, template and restored VMs included
#   (bench/runtime/pod_density.py; docs/guest-kernel.md, "Its
#   lockdown"). The rest of what it refuses (kprobes, perf, BPF reading
#   kernel memory, /dev/mem, /proc/kcore, unsigned modules, hibernation)
#   no pod's VM uses: the guest's modules are Debian's, signed.
# Nothing on it writes every page of the guest's RAM at boot (init_on_free
# would: the memory a guest frees goes back to the host by free page
# reporting instead, which also keeps a saved template's RAM file sparse).
# Kata's QEMU guests boot with these among their defaults (and with
# tsc=reliable, which saved nothing here).
GUEST_CMDLINE = ("console=ttyS0 quiet panic=-1 cryptomgr.notests i8042.direct=1 i8042.dumbkbd=1 i8042.nopnp=1 "
                 "i8042.noaux=1 noreplace-smp rcupdate.rcu_expedited=1 pci=lastbus=0 memhp_default_state=online "
                 "no_timer_check swiotlb=noforce lockdown=confidentiality")


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
    # The guest's root image (crust.kata.image.guest_root); None: the one beside
    # the initramfs, where the image builder puts it.
    root: Path | None = None
    # TCG's translation buffer in MiB (unused under KVM); None: TCG_TB_MIB,
    # 0: QEMU's own default (bench/microvm/tcg_buffer.py compares them).
    tcg_tb_mib: int | None = None

    @property
    def root_image(self) -> Path:
        return self.root if self.root is not None else self.initrd.with_name(ROOT_IMAGE)


def root_args(config: VmConfig, size: int) -> list[str]:
    """The guest's root (size bytes): its image file mapped read-only (QEMU
    opens it O_RDONLY and maps it PROT_READ: no guest write reaches the
    file) as a virtio-pmem device. Shared, so that every VM maps the same
    page cache pages and a saved VM leaves the device's memory out of its
    state (x-ignore-shared, crust.kata.vmm.saving). Device memory needs room
    above the guest's RAM (memory_arg)."""
    return ["-object", f"memory-backend-file,id={ROOT_BACKEND},mem-path={config.root_image},size={size},"
                       f"share=on,readonly=on",
            "-device", f"virtio-pmem-pci,memdev={ROOT_BACKEND},id={ROOT_BACKEND}-pmem"]


# Free page reporting: the pages the guest frees (in blocks of 2 MiB, a
# couple of seconds after) are handed back to the host, which drops them
# from QEMU's memory (and punches them out of a shared memfd). The
# balloon itself is never inflated.
BALLOON_ARGS = ["-device", "virtio-balloon-pci,id=balloon,free-page-reporting=on"]


def guest_cpu(config: VmConfig) -> str:
    """The guest's CPU model (-cpu): the host's under KVM, TCG_CPU under tcg."""
    return "host" if config.accel == "kvm" else TCG_CPU


def accel_args(config: VmConfig) -> list[str]:
    if config.accel == "kvm":
        return ["-accel", "kvm", "-cpu", guest_cpu(config)]
    tb = config.tcg_tb_mib if config.tcg_tb_mib is not None else TCG_TB_MIB
    return ["-accel", f"tcg,tb-size={tb}" if tb else "tcg", "-cpu", guest_cpu(config)]


def memory_arg(memory_mib: int, max_memory_mib: int, root_bytes: int = 0) -> str:
    """QEMU's -m: the boot memory, and room above it for one DIMM up to the
    ceiling and for the guest root's device (root_bytes, whole MiB)."""
    top = max(memory_mib, max_memory_mib) + -(-root_bytes // MIB)
    if top > memory_mib:
        return f"{memory_mib}M,slots=1,maxmem={top}M"
    return str(memory_mib)
