"""The guest part 4 of bench/microvm/kata_bench.py drives directly, and the host
objects behind it.

- IoVm: one microVM (crust.kata.vmm.qemu.Vm and its Python agent, reached
  through its port) with two ext4 file systems on loop devices: one
  hot-plugged as virtio-blk and mounted by the guest's agent, one mounted
  on the host and shared over virtio-9p; a file written and read back cold
  on either side, or on the host; everything stopped and removed again;
- GuestIo: commands in the guest (processes of the guest itself, not of a
  container), timed inside it;
- host_dd(): the same dd on the host, for reference;
- run_then(): the part run so that a signal still lets the VM power off.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench.lib.benchlib import SIGNALS, Interrupted
from crust.kata.agent import calls, volume_calls
from crust.kata.agent.client import AgentClient
from crust.kata.vmm.qemu import Vm, VmConfig, qemu_pids_under
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness.daemons import MIB

BLKFLSBUF = 0x1261
MEMORY_MIB = 512
FS_MIB = 640
# The guest's own processes get this PATH (its busybox applets and tools).
GUEST_PATH = "PATH=/usr/sbin:/usr/bin:/sbin:/bin"
# How long the agent's port is waited for when its connection is not open.
PORT_WAIT = 30.0
STAMP = "adjtimex | awk '/tv_sec/ {s = $2} /tv_usec/ {u = $2} END {printf \"%d.%06d\", s, u}'"


def evict_file(path: Path) -> None:
    """Drop this file's pages from the host's page cache (after writing them back)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict_block_device(device: str) -> None:
    """Write back and drop the host's buffer cache of one block device (ours)."""
    fd = os.open(device, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, BLKFLSBUF, 0)
    finally:
        os.close(fd)


def host_dd(argv: list[str]) -> float:
    """Seconds one dd on the host took."""
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, timeout=600)
    return time.perf_counter() - t0


async def stop_or_kill(vm: Vm | None) -> None:
    """Power a benchmark's VM off; kill it when that does not end it."""
    if vm is not None:
        try:
            await asyncio.wait_for(vm.stop(timeout=30), 60)
        except Exception:  # noqa: BLE001 - the forced cleanup follows
            await vm.kill()


class GuestIo:
    """Timed commands in the guest: `sh -c` as processes of the guest's
    Python agent, their stdout read back through its port."""

    def __init__(self, vm: Vm):
        self.vm = vm
        self.n = 0

    async def client(self) -> AgentClient:
        client = await self.vm.port.ready(wait=PORT_WAIT)
        if client is None:
            raise RuntimeError(f"the guest's agent does not answer on its port\n{self.vm.console_tail(6)}")
        return client

    async def output(self, command: str, timeout: float = 600) -> tuple[int, str, str, float]:
        """(exit code, stdout, stderr, seconds from asking for its start to
        its exit seen on the host)."""
        self.n += 1
        exec_id = f"kb-{self.n}"
        client = await self.client()
        process = {"args": ["/bin/sh", "-c", command], "env": [GUEST_PATH], "cwd": "/"}
        streams = {calls.Stream.STDOUT: b"", calls.Stream.STDERR: b""}
        started = time.monotonic()
        await calls.exec_process(client, "", exec_id, process, stdin=False)
        try:
            answer = await asyncio.wait_for(calls.wait_process(client, "", exec_id), timeout)
            host = time.monotonic() - started
            async for chunk in calls.read_output(client, "", exec_id, 0, 0, cut=RuntimeError):
                streams[chunk.stream] += chunk.data
        except BaseException:
            # The VM is stopped after a failure; what matters is the error that got here.
            with contextlib.suppress(Exception):
                await calls.signal_process(client, "", exec_id, signal.SIGKILL)
            raise
        await calls.remove_process(client, "", exec_id)
        out, err = (streams[s].decode(errors="replace") for s in (calls.Stream.STDOUT,
                                                                   calls.Stream.STDERR))
        return answer.exit_code, out, err, host

    async def run(self, command: str, timeout: float = 600) -> int:
        return (await self.output(command, timeout))[0]

    async def timed(self, command: str, timeout: float = 600) -> tuple[float, float]:
        """(seconds the command took inside the guest, seconds seen from the host)."""
        script = (f"t0=$({STAMP}); {command} 2>/tmp/kb.err; rc=$?; t1=$({STAMP}); "
                  f"echo \"KB rc=$rc t0=$t0 t1=$t1\"; [ $rc = 0 ] || cat /tmp/kb.err >&2; exit $rc")
        code, out, err, host = await self.output(script, timeout)
        m = re.search(r"^KB rc=(\d+) t0=([0-9.]+) t1=([0-9.]+)$", out, re.M)
        if code != 0 or m is None:
            raise RuntimeError(f"guest command failed ({code}): {command}\n{(out + err)[-2000:]}")
        return float(m.group(3)) - float(m.group(2)), host


class IoVm:
    """The guest of part 4 and the host objects it uses, all below one
    temporary directory (base): for each side ("blk", "9p") a backing file
    with ext4 on a loop device; the 9p side's file system mounted on the
    host at base/share."""

    def __init__(self):
        self.base: Path | None = None
        self.files: dict[str, Path] = {}
        self.devices: dict[str, str] = {}
        self.share: Path | None = None
        self.vm: Vm | None = None
        self.io: GuestIo | None = None

    def prepare(self, image, accel: str) -> None:
        """The file systems, loop devices and host mount, and the VM (not started)."""
        base = self.base = Path(tempfile.mkdtemp(prefix="crust-kb-"))
        for side in ("blk", "9p"):
            f = self.files[side] = base / f"{side}.img"
            with open(f, "wb") as fh:
                fh.truncate(FS_MIB * MIB)
            subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(f)],
                           check=True, capture_output=True, timeout=120)
            self.devices[side] = subprocess.run(["losetup", "--find", "--show", "--nooverlap", str(f)], check=True,
                                                capture_output=True, text=True, timeout=60).stdout.strip()
        share = base / "share"
        share.mkdir()
        subprocess.run(["mount", "-t", "ext4", self.devices["9p"], str(share)], check=True, capture_output=True,
                       timeout=60)
        self.share = share
        config = VmConfig(kernel=image.kernel, initrd=image.initrd, accel=accel, memory_mib=MEMORY_MIB,
                          extra_args=("-fsdev", f"local,id=kbfs,path={share},security_model=passthrough",
                                      "-device", "virtio-9p-pci,fsdev=kbfs,mount_tag=kbshare"))
        self.vm = Vm("crust-kb-io", base / "vm", config)

    async def boot(self) -> tuple[float, str, float]:
        """Start the VM, mount the blk side at /mnt/blk and the 9p side at
        /mnt/9p in the guest: (boot seconds, the guest's blk device, what a
        pair of time stamps costs in seconds: the least of 5)."""
        boot = await self.vm.start()
        io = self.io = GuestIo(self.vm)
        await self.vm.attach_disk(self.devices["blk"], "kbblk")
        blk = volume_calls.storage("kbblk", "ext4", [], False, "/mnt/blk", None)
        guest_dev = (await volume_calls.mount(await io.client(), blk)).device
        code, out, err, _ = await io.output(
            "grep -qw 9p /proc/filesystems || while read -r m; do insmod \"$m\" || exit 1; "
            "done < /etc/crust/modules.d/9p; mkdir -p /mnt/9p && "
            "mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 kbshare /mnt/9p", timeout=120)
        if code != 0:
            raise RuntimeError(f"9p mount in the guest failed ({code}): {(out + err)[-2000:]}")
        stamp_s, _ = await io.timed(":")
        stamp_s = min([stamp_s] + [(await io.timed(":"))[0] for _ in range(4)])
        return boot, guest_dev, stamp_s

    async def remove_guest_files(self, *sides: str) -> None:
        for side in sides:
            await self.io.run(f"rm -f /mnt/{side}/kb.dat; sync")

    async def guest_write_read(self, side: str, direct: bool, mib: int) -> tuple[float, float, float, float]:
        """Write mib MiB to a file on side (/mnt/blk or /mnt/9p) with busybox
        dd, fsync'd; evict the caches in the guest and on the host; read it
        back; with direct, both with O_DIRECT. (write, write seen from the
        host, read, read seen from the host), in seconds."""
        f = f"/mnt/{side}/kb.dat"
        wflag, rflag = (" oflag=direct", " iflag=direct") if direct else ("", "")
        await self.remove_guest_files(side)
        w, wh = await self.io.timed(f"dd if=/dev/zero of={f} bs=1M count={mib}{wflag} conv=fsync")
        await self.io.run("sync; echo 3 > /proc/sys/vm/drop_caches")
        self.evict(side, self.share / "kb.dat" if side == "9p" else None)
        rd, rh = await self.io.timed(f"dd if={f} of=/dev/null bs=1M{rflag}")
        return w, wh, rd, rh

    def host_write_read(self, direct: bool, mib: int) -> tuple[float, float]:
        """The same on the host, in the shared mount: (write, read) seconds."""
        path = self.share / "kb-host.dat"
        wflag, rflag = (["oflag=direct"], ["iflag=direct"]) if direct else ([], [])
        w = host_dd(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", *wflag, "conv=fsync"])
        self.evict("9p", path)
        rd = host_dd(["dd", f"if={path}", "of=/dev/null", "bs=1M", *rflag])
        path.unlink()
        return w, rd

    def evict(self, side: str, shared: Path | None = None) -> None:
        """Drop the host's caches of what is behind side: a file in the
        shared mount (shared), the loop device, the backing file."""
        if shared is not None:
            evict_file(shared)
        evict_block_device(self.devices[side])
        evict_file(self.files[side])

    async def stop_vm(self) -> None:
        await stop_or_kill(self.vm)

    def clean_up(self) -> list[str]:
        """Forced cleanup of the host objects, only those made here: QEMU
        processes naming base, the host mount, the loop devices over files
        below base, base itself. Returns the errors."""
        problems = []
        base = self.base
        if base is None:
            return problems
        # The VM's sockets live below base: its command line names it.
        for pid in qemu_pids_under(base):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for _ in range(50):
            if not qemu_pids_under(base):
                break
            time.sleep(0.1)
        if self.share is not None and sysmount.at(str(self.share)) is not None:
            r = subprocess.run(["umount", str(self.share)], capture_output=True, text=True)
            if r.returncode != 0:
                problems.append(f"umount {self.share}: {r.stderr.strip()}")
                subprocess.run(["umount", "-l", str(self.share)], capture_output=True)
        prefix = str(base.resolve()) + "/"
        for device, backing in sysloop.attached().items():
            if backing.startswith(prefix):
                r = subprocess.run(["losetup", "-d", device], capture_output=True, text=True)
                if r.returncode != 0:
                    problems.append(f"losetup -d {device}: {r.stderr.strip()}")
        shutil.rmtree(base, ignore_errors=True)
        self.base = None  # nothing left to undo
        return problems


async def run_then(work: Callable[[], Awaitable[dict]], finish: Callable[[], Awaitable[None]]) -> dict:
    """work(), then finish() whatever happens. A signal cancels only this
    task (a signal handler raising inside the event loop would make
    asyncio.run cancel every task, the agent's reader among them, and the
    VM could no longer be powered off through its agent)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    received: list[str] = []
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def on_signal(name: str) -> None:
        if not received:
            received.append(name)
            task.cancel()

    for sig in SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        try:
            return await work()
        except asyncio.CancelledError:
            if received:
                raise Interrupted(received[0]) from None
            raise
    finally:
        await finish()  # later signals are swallowed by on_signal
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
            signal.signal(sig, previous[sig])
