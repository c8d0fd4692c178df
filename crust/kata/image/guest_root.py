"""The guest's root file system: one read-only ext4 image per guest image,
shared by every VM.

The files a guest runs (python3 and the agent, crun, the file system
tools, the modules) are written once, at build time, into `root.img`, an
ext4 file system beside the kernel. Each VM maps that file as a
virtio-pmem device (crust.kata.vmm.config: a `memory-backend-file` opened
read-only), and its guest mounts /dev/pmem0 read-only with DAX: a read of
a guest file is a read of the host's page cache through the VM's memory
map, so the image's pages are in the host's memory once for every VM on
the node, and never copied into any guest's RAM (no guest page cache for
them either). Before this, the same files were unpacked from the
initramfs into each guest's RAM.

Why this shape:
- virtio-pmem rather than an emulated NVDIMM: the guest's virtio_pmem
  driver gives its region struct pages (ND_REGION_PAGEMAP), which DAX
  needs; a label-less NVDIMM's raw namespace has none, and making one
  (an fsdax info block) writes to the device.
- ext4: built into the guest kernel, and mounted with dax=always from a
  4 KiB-block file system. No journal: nothing writes it.
- The initramfs keeps only what mounts the root: busybox, the modules
  of virtio-pmem (ROOT_MODULES and what they need) and its /init
  (crust/guest/files/mountroot.sh), which then switches to the root's own /init.
- The root the guest runs on is a tmpfs of empty directories with the
  image's /bin, /sbin, /usr, /lib, /lib64 and /etc bound over it
  read-only: a volume may be mounted at any path (/data), and the files
  are still read from the device.
- The image's size is rounded up to ALIGN: the guest maps device memory
  in sections of 2 MiB.
- A VM never writes the image: QEMU opens the file read-only and maps it
  read-only (a guest's write to its device goes nowhere), the guest mounts
  it read-only, and everything the guest writes is under /run, /tmp and
  the mounts of its pods.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from crust.kata.image import cpio
from crust.kata.image.packages import command

ROOT_IMAGE = "root.img"
MIB = 1024 * 1024
ALIGN = 2 * MIB
BLOCK = 4096
# The modules that show the guest its root (loaded by the initramfs's
# /init, with what they need): the PCI transport, the virtio-pmem driver
# and the block driver of its namespace (/dev/pmem0).
ROOT_MODULES = ("virtio_pci", "virtio_pmem", "nd_pmem")
# The applets the initramfs's /init runs.
BOOT_APPLETS = ("sh", "mount", "umount", "insmod", "sleep", "switch_root", "poweroff", "cat", "echo", "mkdir",
                "chmod", "cp")
# Fixed so that two builds of the same inputs make the same image.
UUID = "c2757374-726f-4f74-8000-000000000001"
LABEL = "crust-root"


def image_size(entries: list[cpio.Entry]) -> int:
    """Bytes enough for entries in an ext4 of 4 KiB blocks (their blocks,
    one per directory, inode tables and group metadata), rounded up to ALIGN."""
    blocks = sum(-(-len(e.data) // BLOCK) for e in entries if stat.S_ISREG(e.mode))
    blocks += sum(1 for e in entries if stat.S_ISDIR(e.mode) or len(e.data) > 60)
    size = int(blocks * BLOCK * 1.1) + len(entries) * 256 + 8 * MIB
    return -(-size // ALIGN) * ALIGN


def stage(entries: list[cpio.Entry], top: Path) -> None:
    """entries as files below top (owner root, time 0: mke2fs -d copies both)."""
    made = []
    for e in sorted(entries, key=lambda e: e.path):
        path = top / e.path
        path.parent.mkdir(parents=True, exist_ok=True)
        kind = stat.S_IFMT(e.mode)
        if kind == stat.S_IFDIR:
            path.mkdir(exist_ok=True)
        elif kind == stat.S_IFREG:
            path.write_bytes(e.data)
        elif kind == stat.S_IFLNK:
            os.symlink(e.data.decode(), path)
        elif kind == stat.S_IFCHR:
            os.mknod(path, e.mode, os.makedev(*e.rdev))
        else:
            raise ValueError(f"{e.path}: file type {kind:o} not supported in the guest root")
        if kind != stat.S_IFLNK:
            os.chmod(path, stat.S_IMODE(e.mode))
        made.append(path)
    for path in [*made, *(p for p in top.rglob("*") if p.is_dir() and not p.is_symlink()), top]:
        os.utime(path, (0, 0), follow_symlinks=False)


def make_image(entries: list[cpio.Entry], out: Path) -> int:
    """The ext4 image of entries written to out (a new file); its size."""
    size = image_size(entries)
    with tempfile.TemporaryDirectory(prefix=".root-", dir=out.parent) as tmp:
        top = Path(tmp) / "root"
        top.mkdir()
        stage(entries, top)
        # Every file, the directories stage() made on the way included,
        # and the inodes ext4 keeps for itself.
        inodes = sum(1 for _ in top.rglob("*")) + 128
        command(["mke2fs", "-q", "-F", "-t", "ext4", "-b", str(BLOCK), "-O", "^has_journal,^resize_inode",
                 "-m", "0", "-N", str(inodes), "-L", LABEL, "-U", UUID,
                 "-E", f"hash_seed={UUID},root_owner=0:0,lazy_itable_init=0,nodiscard",
                 "-d", str(top), str(out), f"{size // 1024}k"],
                env={"E2FSPROGS_FAKE_TIME": "1"})
    os.chmod(out, 0o644)
    return size


def boot_entries(busybox: bytes, modules: list[tuple[str, bytes]], init: bytes) -> list[cpio.Entry]:
    """The initramfs: busybox with BOOT_APPLETS, the modules that show the
    root (guest path, contents; in load order, listed in
    etc/crust/root-modules) and the /init that mounts it."""
    entries = [cpio.directory(d) for d in ("bin", "dev", "proc", "pmem", "root", "etc", "etc/crust")]
    entries += [cpio.chardev("dev/console", 5, 1), cpio.regular("init", init, 0o755),
                cpio.regular("bin/busybox", busybox, 0o755)]
    entries += [cpio.symlink(f"bin/{applet}", "busybox") for applet in BOOT_APPLETS]
    entries += [cpio.regular(path.lstrip("/"), data) for path, data in modules]
    entries.append(cpio.regular("etc/crust/root-modules", "".join(p + "\n" for p, _ in modules).encode()))
    return entries
