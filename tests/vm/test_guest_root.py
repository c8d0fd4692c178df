"""The guest's root and its memory: every VM's root is the one read-only
image on a virtio-pmem device, mounted with DAX (read from the host's
page cache, not copied into the guest's), which no VM can write and whose
pages two VMs share; what a guest frees goes back to the host (free page
reporting)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
from pathlib import Path

from crust.common import ttrpc
from tests.harness.guest_vm import Guest, guest_config

MIB = 1024 * 1024
ROOT_MOUNT = re.compile(r"^/dev/pmem0 /usr ext4 (\S+) ", re.M)


def root_mapping_kib(pid: int, root: Path) -> dict[str, int]:
    """Rss, Pss and Private_Dirty (KiB) of pid's mappings of the root image."""
    totals = {"Rss": 0, "Pss": 0, "Private_Dirty": 0}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and not fields[0].endswith(":"):
            inside = len(fields) >= 6 and fields[5] == str(root)
        elif inside and fields[0].rstrip(":") in totals:
            totals[fields[0].rstrip(":")] += int(fields[1])
    return totals


def meminfo_kib(text: str, key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1))


def rss_kib(pid: int) -> int:
    return int(re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))


def test_every_vm_mounts_the_one_read_only_root_with_dax_and_shares_its_pages(root):
    """Two VMs: each has /dev/pmem0's /usr (ext4, read-only, dax=always);
    reading the agent's interpreter and the tools leaves the guest's page
    cache empty; the kernel's tracefs is empty (locked down) and its slab
    holds no trace event files; a file write fails (read-only file system); both QEMUs map
    the image file itself, read-only, and the image's pages are counted
    once between them (their PSS of it about half their RSS); a raw write
    to the device reaches neither the host's file nor the other VM."""
    config = guest_config()
    image = config.root_image
    digest = hashlib.sha256(image.read_bytes()).hexdigest()

    async def main():
        async with Guest(root.path / "a", "root-a", config=config) as a, \
                Guest(root.path / "b", "root-b", config=config) as b:
            read = ("cat /proc/mounts; grep -E '^(Cached|MemTotal|Slab):' /proc/meminfo; "
                    "mkdir -p /tmp/trace; mount -t tracefs tracefs /tmp/trace 2>/dev/null; "
                    "echo \"trace files: $(ls /tmp/trace | wc -l)\"; umount /tmp/trace 2>/dev/null; "
                    "cat /usr/bin/python3.11 /sbin/* /lib/x86_64-linux-gnu/* >/dev/null 2>&1; "
                    "grep -E '^Cached:' /proc/meminfo | sed 's/Cached/After/'")
            (code, out), _ = await asyncio.gather(a.sh(read), b.sh(read))
            assert code == 0, out
            options = ROOT_MOUNT.search(out)
            assert options is not None, out
            assert {"ro", "dax=always"} <= set(options.group(1).split(",")), out
            # DAX: the files were read straight from the device's memory.
            assert meminfo_kib(out, "After") - meminfo_kib(out, "Cached") < 1024, out
            # Nothing of the image went into guest RAM: at most the kernel's own share is missing.
            assert meminfo_kib(out, "MemTotal") > 200 * 1024, out
            # The kernel is locked down: tracefs holds nothing, the kernel made
            # none of its trace event files, whose inodes and dentries would
            # hold 9 MiB of the slab (17.6 MiB with them).
            assert "trace files: 0\n" in out, out
            assert meminfo_kib(out, "Slab") < 12 * 1024, out

            code, out = await a.sh("echo x > /usr/crust-written")
            assert code != 0 and "Read-only file system" in out, out
            mapped = [root_mapping_kib(vm.pid, image) for vm in (a.vm, b.vm)]
            for m in mapped:
                assert m["Rss"] > 4096 and m["Private_Dirty"] == 0, mapped
            # Both read the same files: the pages both map count half to each.
            assert sum(m["Pss"] for m in mapped) < 0.75 * sum(m["Rss"] for m in mapped), mapped
            for vm in (a.vm, b.vm):
                maps = Path(f"/proc/{vm.pid}/maps").read_text()
                assert any(line.endswith(str(image)) and line.split()[1].startswith("r-") and
                           "w" not in line.split()[1] for line in maps.splitlines()), maps

            # A raw write to the device: the guest that writes sees its own
            # kernel's buffers of it change (its file system may break under
            # it, and its kernel stop: its own doing); the image does not.
            with contextlib.suppress(ttrpc.TtrpcError, ConnectionError):
                await a.sh("dd if=/dev/zero of=/dev/pmem0 bs=4096 count=256 conv=fsync", timeout=60)
            # B still reads the image's superblock (its magic at 1080) from its own device.
            code, out = await b.sh("dd if=/dev/pmem0 bs=1024 skip=1 count=1 iflag=direct 2>/dev/null "
                                   "| od -An -tx1 -j56 -N2")
            assert (code, out.split()) == (0, ["53", "ef"]), out

    asyncio.run(main())
    assert hashlib.sha256(image.read_bytes()).hexdigest() == digest


def test_memory_a_guest_frees_goes_back_to_the_host(root):
    """A guest process writes 100 MiB and holds it: QEMU's resident memory
    grows by about that; once it exits, the guest reports the freed pages
    and QEMU's resident memory falls back within seconds."""
    script = ("python3.11 -S -c \"import time; b = b'x' * (100 << 20); open('/run/held', 'w').close(); "
              "time.sleep(600)\" >/dev/null 2>&1 & echo $! > /run/holder; "
              "while [ ! -e /run/held ]; do sleep 0.1; done")

    async def main():
        async with Guest(root.path, "freed") as g:
            await g.sh("sleep 3")    # what the boot freed, reported
            before = rss_kib(g.vm.pid)
            code, out = await g.sh(script)
            assert code == 0, out
            held = rss_kib(g.vm.pid)
            assert held - before > 90 * 1024, (before, held)
            code, out = await g.sh("kill $(cat /run/holder)")
            assert code == 0, out
            deadline = time.monotonic() + 60
            while rss_kib(g.vm.pid) > held - 80 * 1024:
                assert time.monotonic() < deadline, (before, held, rss_kib(g.vm.pid))
                await asyncio.sleep(0.5)
            return before, held, rss_kib(g.vm.pid)

    before, held, after = asyncio.run(main())
    assert after < before + 20 * 1024, (before, held, after)
