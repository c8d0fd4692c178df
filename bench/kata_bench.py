#!/usr/bin/env python3
"""What the microVM handler costs: sandbox start, stats, expansion, and guest I/O.

Parts 1 to 3 use the REAL chain (tests/harness.py Root.stack(): crust driver
-> crust shim -> crust proxy, and `crust kata handler` registered with the
proxy). One deferred volume (--fs, default ext4, 256 MiB) is created, staged
and published with defer_fs_ops=True on the proxy's kubelet-facing CSI
socket, as kubelet would; an OCI bundle (process `sleep 3600`, mount source =
the CSI target path, destination /data) is run by the handler, whose sandbox
is a QEMU microVM with the cloud guest image (crust.kata.image, flavor
"cloud", the one the handler uses).

1. Sandbox start: the time from the client's RunSandbox call (gRPC, the
   handler's SandboxControl service) to its return. When it returns the VM
   has booted, the volume's loop device is hot-plugged as virtio-blk and
   mounted by the guest kernel, bound at /data and the process started.
   The boot part (QEMU spawned to the guest agent's first answer) is read
   from the handler's log (crust.kata.qemu logs it per VM); the rest is
   claim, hot-plug, guest mount, bind and process start. One warm-up start
   is not counted; each counted start is followed by DeleteSandbox (timed
   too: the guest unmounts and powers off), except the last, whose sandbox
   parts 2 and 3 use and which is deleted at the end.
2. Stats round trip: proxy NodeGetVolumeStats for the deferred volume
   (kubelet-facing proxy -> shim -> proxy Runtime API -> kata handler ->
   guest agent -> statfs in the guest), --stats-rounds rounds, alternating
   with the handler's GetVolumeStats alone (handler -> guest agent) to show
   where the time goes. Median, p90, min and max.
3. Expansion round trip: ControllerExpandVolume then NodeExpandVolume on the
   proxy (+64 MiB each time; the shim grows the loop device, the handler
   tells QEMU (block_resize), the guest's resize2fs/xfs_growfs grows the
   mounted file system), then proxy NodeGetVolumeStats until the guest
   reports the larger size. --runs expansions; each step and the whole
   round trip are timed.

Part 4 drives one microVM directly (crust.kata.qemu.Vm and its agent), with
the GENERIC guest image (Debian's full kernel, which has 9p) and 512 MiB of
guest memory, to compare two ways of giving a guest a file system:
  (a) virtio-blk: an ext4 file system on a loop device, hot-plugged as
      virtio-blk (as the handler does: QEMU without O_DIRECT on the host)
      and mounted by the guest kernel (agent `mount`);
  (b) virtio-9p: an ext4 file system on a loop device mounted on the HOST,
      that mount point shared into the guest with
      `-fsdev local,security_model=passthrough -device virtio-9p-pci` and
      mounted in the guest with
      `mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000`.
      The agent's `mount` command only mounts virtio disks (found by
      serial), so the guest loads the 9p modules the image lists in
      /etc/crust/modules.d/9p itself (insmod, as the agent does for disks).
Both file systems are made the same way (mkfs.ext4 with lazy init off, so
neither guest nor host initialises inode tables in the background). Each of
--runs runs does, for both sides and in two modes, in an order of sides and
of modes that alternates every run: write --mib MiB with busybox
`dd if=/dev/zero bs=1M conv=fsync` (the fsync is inside the timed span),
then evict the caches (in the guest: sync and
`echo 3 > /proc/sys/vm/drop_caches`; on the host, only for objects this
benchmark created: posix_fadvise(DONTNEED) on the backing files and on the
shared file, BLKFLSBUF on its loop devices), then read the file back with
`dd of=/dev/null bs=1M`. The modes: buffered (through the guest's page
cache) and direct (O_DIRECT in the guest: oflag=direct / iflag=direct,
still conv=fsync). The span is timed inside the guest (busybox
adjtimex, microseconds), around the dd alone; the cost of the two time
stamps themselves is measured and reported. For reference, the same write
and cold read are also run on the host, in the shared host mount.

Other people's work on the machine shows in the numbers: each part reports
how many cores other processes kept busy meanwhile.

Everything lives under temporary directories. On exit, also on Ctrl-C,
SIGTERM or failure: the sandbox is deleted and the volume unpublished,
unstaged and deleted through the chain, the daemons are stopped, QEMU
processes of this run (found by this run's directories in their command
line) are killed, and the part-4 VM is stopped, its host mount unmounted,
its loop devices detached; nothing this benchmark did not create is
touched.

Run from the project root as root:

    .venv/bin/python bench/kata_bench.py [--runs 5] [--json [OUT]]
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import functools
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project root: bench, crust, tests

import grpc  # noqa: E402

from bench.benchlib import (  # noqa: E402
    SIGNALS,
    Interrupted,
    add_parts_option,
    attempt,
    cores,
    file_text,
    ignore_signals,
    left_below,
    loadavg,
    machine,
    machine_ticks,
    own_session,
    own_ticks,
    pct,
    print_log_tails,
    proc_ticks,
    project_on_pythonpath,
    raise_on_signals,
    retry_failed_precondition,
    run_header,
    write_bundle,
    write_json,
)
from crust.api import csi_pb2, handler_pb2, handler_pb2_grpc  # noqa: E402
from crust.kata.image import DEFAULT_CACHE, build  # noqa: E402
from crust.kata.qemu import Vm, VmConfig, qemu_pids_under  # noqa: E402
from crust.sys import loop as sysloop  # noqa: E402
from crust.sys import mount as sysmount  # noqa: E402
from tests.harness import MIB, Root, mount_cap  # noqa: E402

VOLUME_MIB = 256
GROW_MIB = 64
HANDLER_NAME = "kata"
BLKFLSBUF = 0x1261
PART4_MEMORY_MIB = 512
PART4_FS_MIB = 640
# buffered: through the guest's page cache (write + fsync; caches dropped
# before reading); direct: O_DIRECT in the guest (still fsync'd).
MODES = ("buffered", "direct")


OUT = sys.stdout


def say(text: str = "") -> None:
    print(text, file=OUT, flush=True)


# -- statistics and machine ----------------------------------------------------------------------


def summary(samples: list[float], digits: int = 1) -> dict:
    if not samples:
        return {"n": 0}
    s = sorted(samples)
    return {"n": len(s), "median": round(statistics.median(s), digits), "p90": round(pct(s, 0.9), digits),
            "min": round(s[0], digits), "max": round(s[-1], digits)}


def fmt(s: dict, unit: str = "ms") -> str:
    if not s.get("n"):
        return "(none)"
    return f"median {s['median']:g} {unit} (min {s['min']:g}, max {s['max']:g}, n={s['n']})"


def kata_machine() -> dict:
    """The shared machine description with Debian's release (after the
    kernel's), QEMU's version and whether /dev/kvm exists."""
    try:
        qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True,
                              timeout=10).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        qemu = "unknown"
    info = machine(debian=file_text("/etc/debian_version"))
    info["python"] = info.pop("python")  # after "debian", where it stands in earlier results
    return {**info, "qemu": qemu, "kvm_device": os.path.exists("/dev/kvm")}


class CpuWatch:
    """How busy the rest of the machine (other people's work) kept its cores
    during a part: all busy ticks minus this run's own (this script and the
    children it reaped, the daemons and what they reaped, e.g. QEMU of a
    deleted sandbox, and the live QEMU processes of this run)."""

    def __init__(self, daemon_pids: list[int], dirs: list[Path]):
        self.daemon_pids, self.dirs = daemon_pids, dirs
        self.first = self._sample()

    def _sample(self) -> tuple[float, int, int]:
        busy = machine_ticks()[0]
        ours = own_ticks()
        ours += sum(proc_ticks(p, with_children=True) for p in self.daemon_pids)
        ours += sum(proc_ticks(p) for p in qemu_pids_under(*self.dirs) if p not in self.daemon_pids)
        return time.monotonic(), busy, ours

    def others_cores(self) -> float:
        t1, busy1, ours1 = self._sample()
        t0, busy0, ours0 = self.first
        return cores(max(0, (busy1 - busy0) - (ours1 - ours0)), t1 - t0)


# -- processes of this run --------------------------------------------------------------------------


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- parts 1 to 3: the chain ----------------------------------------------------------------------------


class Chain:
    """driver -> shim -> proxy + kata handler, one deferred volume, sandboxes."""

    def __init__(self, root: Root, fs: str, accel: str):
        self.root = root
        self.fs = fs
        self.accel = accel
        self.cap = mount_cap(fs)
        self.volume_id = ""
        self.staging = self.target = None
        self.staged = self.published = False
        self.sandbox_id = ""      # the running sandbox, if any
        self.handler_channel: grpc.Channel | None = None

    def up(self) -> None:
        with own_session():
            self.driver, self.shim, self.proxy = self.root.stack()
            self.handler = self.root.handler(self.proxy, name=HANDLER_NAME, endpoint_name="kata.sock",
                                             command=("kata", "handler"),
                                             extra=["--accel", self.accel,
                                                    "--kata-dir", str(self.root.path / "kata-direct")])
            self.handler.start(timeout=900)  # the guest image is checked (maybe rebuilt) first
        self.handler_channel = grpc.insecure_channel(f"unix://{self.handler.socket}")
        self.control = handler_pb2_grpc.SandboxControlStub(self.handler_channel)
        self.handler_stub = handler_pb2_grpc.HandlerStub(self.handler_channel)
        size = VOLUME_MIB * MIB
        vol = self.proxy.create("kb-vol", size, self.cap)
        self.volume_id, self.capacity = vol.volume_id, vol.capacity_bytes
        self.staging = self.proxy.staging("kb-vol")
        self.target = self.proxy.target("kb-pod", "kb-vol")
        self.proxy.stage(self.volume_id, self.staging, self.cap)
        self.staged = True
        rsp = self.proxy.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=self.volume_id, staging_target_path=str(self.staging), target_path=str(self.target),
            volume_capability=self.cap, defer_fs_ops=True), timeout=60)
        self.published = True
        if not rsp.HasField("deferred_mount"):
            raise RuntimeError("the proxy did not defer the publish")
        self.device = rsp.deferred_mount.device
        self.bundle = self.root.path / "bundle"
        write_bundle(self.bundle, self.target, 3600)

    def run_sandbox(self, sandbox_id: str) -> tuple[float, handler_pb2.SandboxInfo]:
        # Recorded first: if the call is interrupted, the handler may still
        # be creating it, and the teardown deletes it (DeleteSandbox is idempotent).
        self.sandbox_id = sandbox_id
        t0 = time.perf_counter()
        rsp = self.control.RunSandbox(handler_pb2.RunSandboxRequest(bundle=str(self.bundle), sandbox_id=sandbox_id),
                                      timeout=300)
        ms = (time.perf_counter() - t0) * 1e3
        info = rsp.sandbox
        if not info.volumes or info.volumes[0].target_path != str(self.target):
            raise RuntimeError(f"sandbox {sandbox_id} does not hold the volume: {info}")
        return ms, info

    def delete_sandbox(self) -> float:
        t0 = time.perf_counter()
        self.control.DeleteSandbox(handler_pb2.DeleteSandboxRequest(sandbox_id=self.sandbox_id), timeout=300)
        self.sandbox_id = ""
        return (time.perf_counter() - t0) * 1e3

    def boot_seconds(self, sandbox_id: str) -> float | None:
        """The VM's boot time as crust.kata.qemu logged it in the handler's log."""
        pattern = re.compile(rf"vm crust-{re.escape(sandbox_id)}: agent ready ([0-9.]+)s after start")
        found = None
        for line in self.handler.log_path.read_text(errors="replace").splitlines():
            try:
                msg = json.loads(line).get("msg", "")
            except ValueError:
                msg = line
            m = pattern.search(msg)
            if m:
                found = float(m.group(1))
        return found

    def stats_bytes(self) -> csi_pb2.VolumeUsage:
        rsp = self.proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
            volume_id=self.volume_id, volume_path=str(self.target)), timeout=60)
        if rsp.volume_condition.abnormal:
            raise RuntimeError(f"volume condition abnormal: {rsp.volume_condition.message}")
        return next(u for u in rsp.usage if u.unit == csi_pb2.VolumeUsage.BYTES)

    def teardown(self) -> list[str]:
        """Undo up() through the chain; returns the errors (forced cleanup follows)."""
        problems = []
        step = functools.partial(attempt, problems)
        handler = getattr(self, "handler", None)
        if handler is None or handler.proc is None or handler.proc.poll() is not None:
            if self.sandbox_id or self.published:
                problems.append("the handler is not running; forced cleanup only")
            return problems
        if self.sandbox_id:
            step("sandbox delete", self.delete_sandbox)
        if self.published and step("unpublish", lambda: self.proxy.unpublish(self.volume_id, self.target)):
            self.published = False
        if self.staged and not self.published and \
                step("unstage", lambda: self.proxy.unstage(self.volume_id, self.staging)):
            self.staged = False
        if self.volume_id and not self.staged and \
                step("delete", lambda: retry_failed_precondition(lambda: self.proxy.delete(self.volume_id))):
            self.volume_id = ""
        if self.handler_channel is not None:
            self.handler_channel.close()
            self.handler_channel = None
        return problems


def part1(chain: Chain, runs: int) -> dict:
    say(f"\n[1] sandbox start through the chain ({runs} runs + 1 warm-up; load {loadavg()})")
    warm_ms, _ = chain.run_sandbox("kb-warm")
    warm = {"run_sandbox_ms": round(warm_ms, 1), "boot_s": chain.boot_seconds("kb-warm"),
            "delete_ms": round(chain.delete_sandbox(), 1)}
    say(f"    warm-up: RunSandbox {warm_ms:.0f} ms (boot {warm['boot_s']} s), DeleteSandbox {warm['delete_ms']:.0f} ms")
    starts, boots, rest, deletes, per_run = [], [], [], [], []
    for i in range(1, runs + 1):
        sid = f"kb-{i}"
        ms, info = chain.run_sandbox(sid)
        boot = chain.boot_seconds(sid)
        starts.append(ms)
        run = {"sandbox": sid, "run_sandbox_ms": round(ms, 1), "boot_s": boot, "qemu_pid": info.pid,
               "mount_point": info.volumes[0].mount_point}
        if boot is not None:
            boots.append(boot * 1e3)
            rest.append(ms - boot * 1e3)
        if i < runs:
            run["delete_ms"] = round(chain.delete_sandbox(), 1)
            deletes.append(run["delete_ms"])
        per_run.append(run)
        say(f"    run {i}: RunSandbox {ms:.0f} ms (boot {boot} s)"
            + (f", DeleteSandbox {run['delete_ms']:.0f} ms" if "delete_ms" in run else ", kept for parts 2 and 3"))
    out = {"runs": per_run, "warm_up": warm, "run_sandbox_ms": summary(starts), "boot_ms": summary(boots),
           "after_boot_ms": summary(rest), "delete_sandbox_ms": summary(deletes), "loadavg": loadavg()}
    say(f"    RunSandbox (call to return: VM booted, volume mounted in the guest, process started): "
        f"{fmt(out['run_sandbox_ms'])}")
    say(f"      of which VM boot (QEMU start to the agent's first answer): {fmt(out['boot_ms'])}")
    say(f"      the rest (claim, virtio-blk hot-plug, guest mount, bind, process start): {fmt(out['after_boot_ms'])}")
    say(f"    DeleteSandbox: {fmt(out['delete_sandbox_ms'])}")
    return out


def part2(chain: Chain, rounds: int) -> dict:
    say(f"\n[2] NodeGetVolumeStats through the chain ({rounds} rounds; load {loadavg()})")
    d_req = csi_pb2.NodeGetVolumeStatsRequest(volume_id=chain.volume_id, volume_path=str(chain.target))
    h_req = handler_pb2.GetVolumeStatsRequest(target_path=str(chain.target), sandbox_id=chain.sandbox_id)
    paths = {
        "proxy NodeGetVolumeStats (proxy -> shim -> proxy runtime API -> handler -> guest agent)":
            lambda: chain.proxy.node.NodeGetVolumeStats(d_req, timeout=60),
        "handler GetVolumeStats alone (handler -> guest agent)":
            lambda: chain.handler_stub.GetVolumeStats(h_req, timeout=60),
    }
    names = list(paths)
    for _ in range(5):  # warm the channels and code paths
        for name in names:
            paths[name]()
    first = chain.stats_bytes()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % 2:] + names[:r % 2]:
            t0 = time.perf_counter()
            paths[name]()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    out = {"rounds": rounds, "paths": {n: summary(s, 2) for n, s in samples.items()},
           "bytes_total_reported": first.total, "loadavg": loadavg()}
    for name, s in out["paths"].items():
        say(f"    {name}:\n      median {s['median']:.1f} ms, p90 {s['p90']:.1f}, min {s['min']:.1f}, max {s['max']:.1f}")
    return out


def part3(chain: Chain, runs: int) -> dict:
    say(f"\n[3] expansion round trip ({runs} x +{GROW_MIB} MiB, {chain.fs}; load {loadavg()})")
    ctl_ms, node_ms, seen_ms, total_ms, sizes = [], [], [], [], []
    capacity = chain.capacity
    before = chain.stats_bytes().total
    for i in range(runs):
        new = capacity + GROW_MIB * MIB
        t0 = time.perf_counter()
        c = chain.proxy.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
            volume_id=chain.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=new)), timeout=120)
        t1 = time.perf_counter()
        n = chain.proxy.node.NodeExpandVolume(csi_pb2.NodeExpandVolumeRequest(
            volume_id=chain.volume_id, volume_path=str(chain.target),
            capacity_range=csi_pb2.CapacityRange(required_bytes=new)), timeout=300)
        t2 = time.perf_counter()
        # The guest must report (nearly) the whole step: a file system's
        # usable size grows by a little less than its device.
        polls, deadline = 0, time.monotonic() + 60
        while True:
            polls += 1
            total = chain.stats_bytes().total
            if total >= before + GROW_MIB * MIB * 0.9:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the guest still reports {total} bytes 60 s after NodeExpandVolume "
                                   f"(before: {before})")
            time.sleep(0.05)
        t3 = time.perf_counter()
        ctl_ms.append((t1 - t0) * 1e3)
        node_ms.append((t2 - t1) * 1e3)
        seen_ms.append((t3 - t2) * 1e3)
        total_ms.append((t3 - t0) * 1e3)
        sizes.append({"device_bytes": c.capacity_bytes, "node_reported_bytes": n.capacity_bytes,
                      "guest_fs_total_before": before, "guest_fs_total_after": total, "stats_polls": polls})
        say(f"    {i + 1}: {capacity // MIB} -> {c.capacity_bytes // MIB} MiB: controller {ctl_ms[-1]:.0f} ms, "
            f"node {node_ms[-1]:.0f} ms, stats shows it after {seen_ms[-1]:.0f} ms ({polls} call(s)); "
            f"guest fs {before / MIB:.1f} -> {total / MIB:.1f} MiB")
        capacity, before = c.capacity_bytes, total
    out = {"step_mib": GROW_MIB, "fs": chain.fs, "controller_expand_ms": summary(ctl_ms),
           "node_expand_ms": summary(node_ms), "stats_seen_ms": summary(seen_ms), "round_trip_ms": summary(total_ms),
           "sizes": sizes, "loadavg": loadavg()}
    say(f"    ControllerExpandVolume: {fmt(out['controller_expand_ms'])}")
    say(f"    NodeExpandVolume (through the handler into the guest): {fmt(out['node_expand_ms'])}")
    say(f"    then NodeGetVolumeStats showing the new size: {fmt(out['stats_seen_ms'])}")
    say(f"    whole round trip: {fmt(out['round_trip_ms'])}")
    return out


# -- part 4: virtio-blk against virtio-9p -----------------------------------------------------------------


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


STAMP = "adjtimex | awk '/tv_sec/ {s = $2} /tv_usec/ {u = $2} END {printf \"%d.%06d\", s, u}'"


class GuestIo:
    """Timed commands in the guest: output lines tagged and read back from
    the console log (the agent's `exec` sends a command's output there)."""

    def __init__(self, vm: Vm):
        self.vm = vm
        self.prefix = secrets.token_hex(3)
        self.n = 0

    async def run(self, command: str, timeout: float = 600) -> int:
        pid = await self.vm.agent.exec(command)
        return await self.vm.agent.wait_exit(pid, timeout=timeout, interval=0.05)

    async def timed(self, command: str, timeout: float = 600) -> tuple[float, float]:
        """(seconds the command took inside the guest, seconds seen from the host)."""
        self.n += 1
        tag = f"KB-{self.prefix}-{self.n}"
        script = (f"t0=$({STAMP}); {command} 2>/tmp/kb.err; rc=$?; t1=$({STAMP}); "
                  f"echo \"{tag} rc=$rc t0=$t0 t1=$t1\"; [ $rc = 0 ] || cat /tmp/kb.err; exit $rc")
        started = time.monotonic()
        code = await self.run(script, timeout)
        host = time.monotonic() - started
        pattern = re.compile(rf"^{tag} rc=(\d+) t0=([0-9.]+) t1=([0-9.]+)", re.M)
        deadline = time.monotonic() + 10
        while True:
            m = pattern.search(self.vm.console_log.read_text(errors="replace"))
            if m or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        if code != 0 or m is None:
            raise RuntimeError(f"guest command failed ({code}): {command}\n{self.vm.console_tail(6)}")
        return float(m.group(3)) - float(m.group(2)), host


def host_dd(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, timeout=600)
    return time.perf_counter() - t0


async def part4(args, live: dict) -> dict:
    say(f"\n[4] virtio-blk against virtio-9p in one generic-kernel guest ({args.runs} runs, {args.mib} MiB, "
        f"order alternating; load {loadavg()})")
    image = build(args.cache, "generic")
    say(f"    guest image generic {image.digest[:16]} ({image.manifest.get('kernel_release')}), "
        f"{'rebuilt' if image.rebuilt else 'up to date'}")
    base = live["p4_dir"] = Path(tempfile.mkdtemp(prefix="crust-kb-"))
    loops: list[str] = live.setdefault("p4_loops", [])
    files = {}
    for side in ("blk", "9p"):
        f = files[side] = base / f"{side}.img"
        with open(f, "wb") as fh:
            fh.truncate(PART4_FS_MIB * MIB)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(f)],
                       check=True, capture_output=True, timeout=120)
        loops.append(subprocess.run(["losetup", "--find", "--show", "--nooverlap", str(f)], check=True,
                                    capture_output=True, text=True, timeout=60).stdout.strip())
    blk_dev, p9_dev = loops
    share = base / "share"
    share.mkdir()
    subprocess.run(["mount", "-t", "ext4", p9_dev, str(share)], check=True, capture_output=True, timeout=60)
    live["p4_mount"] = share
    config = VmConfig(kernel=image.kernel, initrd=image.initrd, accel=args.accel, memory_mib=PART4_MEMORY_MIB,
                      extra_args=("-fsdev", f"local,id=kbfs,path={share},security_model=passthrough",
                                  "-device", "virtio-9p-pci,fsdev=kbfs,mount_tag=kbshare"))
    vm = live["p4_vm"] = Vm("crust-kb-io", base / "vm", config)
    watch = CpuWatch([], [base])
    boot = await vm.start()
    io = GuestIo(vm)
    await vm.attach_disk(blk_dev, "kbblk")
    guest_dev = await vm.agent.mount("kbblk", "ext4", [], False, "/mnt/blk")
    code = await io.run("grep -qw 9p /proc/filesystems || while read -r m; do insmod \"$m\" || exit 1; "
                        "done < /etc/crust/modules.d/9p; mkdir -p /mnt/9p && "
                        "mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 kbshare /mnt/9p", timeout=120)
    if code != 0:
        raise RuntimeError(f"9p mount in the guest failed ({code}): {vm.console_tail(6)}")
    stamp_s, _ = await io.timed(":")
    stamp_s = min([stamp_s] + [(await io.timed(":"))[0] for _ in range(4)])
    say(f"    VM booted in {boot:.1f} s; /dev/{guest_dev} (virtio-blk) on /mnt/blk, 9p tag kbshare on /mnt/9p; "
        f"the time stamps cost {stamp_s * 1e3:.1f} ms")

    def host_evict(side: str) -> None:
        if side == "9p":
            evict_file(share / "kb.dat")
        evict_block_device(blk_dev if side == "blk" else p9_dev)
        evict_file(files[side])

    count = args.mib
    mbps = lambda seconds: count * MIB / 1e6 / seconds  # noqa: E731
    sides = ("blk", "9p", "host")
    results = {side: {mode: {"write": [], "read": [], "write_host_seen": [], "read_host_seen": []}
                      for mode in MODES} for side in sides}
    for r in range(args.runs):
        order = ("blk", "9p") if r % 2 == 0 else ("9p", "blk")
        modes = MODES if r % 2 == 0 else MODES[::-1]
        line = []
        for side in order:
            f = f"/mnt/{side}/kb.dat"
            for mode in modes:
                wflag, rflag = ("", "") if mode == "buffered" else (" oflag=direct", " iflag=direct")
                await io.run(f"rm -f {f}; sync")
                w, wh = await io.timed(f"dd if=/dev/zero of={f} bs=1M count={count}{wflag} conv=fsync")
                await io.run("sync; echo 3 > /proc/sys/vm/drop_caches")
                host_evict(side)
                rd, rh = await io.timed(f"dd if={f} of=/dev/null bs=1M{rflag}")
                for k, v in (("write", w), ("read", rd), ("write_host_seen", wh), ("read_host_seen", rh)):
                    results[side][mode][k].append(mbps(v))
                line.append(f"{side} {mode[:3]} w {mbps(w):.0f} r {mbps(rd):.0f}")
        # Reference: the same on the host, in the shared mount (the guest's 9p file is removed first).
        await io.run("rm -f /mnt/9p/kb.dat; sync")
        href = share / "kb-host.dat"
        for mode in modes:
            wflag, rflag = ([], []) if mode == "buffered" else (["oflag=direct"], ["iflag=direct"])
            w = host_dd(["dd", "if=/dev/zero", f"of={href}", "bs=1M", f"count={count}", *wflag, "conv=fsync"])
            evict_file(href)
            evict_block_device(p9_dev)
            evict_file(files["9p"])
            rd = host_dd(["dd", f"if={href}", "of=/dev/null", "bs=1M", *rflag])
            href.unlink()
            results["host"][mode]["write"].append(mbps(w))
            results["host"][mode]["read"].append(mbps(rd))
            line.append(f"host {mode[:3]} w {mbps(w):.0f} r {mbps(rd):.0f}")
        say(f"    run {r + 1} ({' then '.join(order)}; MB/s): " + ", ".join(line))
    for side in ("blk", "9p"):
        await io.run(f"rm -f /mnt/{side}/kb.dat; sync")
    out = {"mib": count, "runs": args.runs, "guest_memory_mib": PART4_MEMORY_MIB, "fs_mib": PART4_FS_MIB,
           "accel": args.accel, "guest_kernel": image.manifest.get("kernel_release"), "boot_s": round(boot, 2),
           "stamp_overhead_ms": round(stamp_s * 1e3, 2), "loadavg": loadavg(),
           "other_processes_cpu_cores": watch.others_cores(),
           "mb_per_s": {side: {mode: {k: summary(v) for k, v in d.items() if v} for mode, d in per.items()}
                        for side, per in results.items()},
           "samples_mb_per_s": {side: {mode: {k: [round(x, 1) for x in v] for k, v in d.items() if v}
                                       for mode, d in per.items()} for side, per in results.items()}}
    mb = out["mb_per_s"]
    out["ratio_blk_over_9p"] = {mode: {k: round(mb["blk"][mode][k]["median"] / mb["9p"][mode][k]["median"], 2)
                                       for k in ("write", "read")} for mode in MODES}
    say(f"    {'side':<50}{'write MB/s: median (min-max)':>30}{'read MB/s: median (min-max)':>30}")
    for mode in MODES:
        for side, label in (("blk", "virtio-blk (guest ext4)"), ("9p", "virtio-9p (host ext4, shared)"),
                            ("host", "host, same ext4 on loop (reference)")):
            w, rd = mb[side][mode]["write"], mb[side][mode]["read"]
            say(f"    {mode + ', ' + label:<50}{w['median']:>16.0f} ({w['min']:.0f}-{w['max']:.0f})"
                f"{rd['median']:>18.0f} ({rd['min']:.0f}-{rd['max']:.0f})")
        ratio = out["ratio_blk_over_9p"][mode]
        say(f"    {mode}: blk/9p (medians) write {ratio['write']:.2f}x, read {ratio['read']:.2f}x")
    say(f"    other processes kept {out['other_processes_cpu_cores']:.2f} of {os.cpu_count()} cores busy meanwhile")
    return out


async def stop_part4_vm(live: dict) -> None:
    vm: Vm | None = live.get("p4_vm")
    if vm is not None:
        try:
            await asyncio.wait_for(vm.stop(timeout=30), 60)
        except Exception:  # noqa: BLE001 - the forced cleanup follows
            await vm.kill()


def cleanup_part4(live: dict) -> list[str]:
    """Forced cleanup of part 4's host objects, only those it made."""
    problems = []
    base: Path | None = live.get("p4_dir")
    if base is None:
        return problems
    # The VM's sockets live below base: its command line names it.
    kill_pids(qemu_pids_under(base))
    for _ in range(50):
        if not qemu_pids_under(base):
            break
        time.sleep(0.1)
    share = live.get("p4_mount")
    if share is not None and sysmount.at(str(share)) is not None:
        r = subprocess.run(["umount", str(share)], capture_output=True, text=True)
        if r.returncode != 0:
            problems.append(f"umount {share}: {r.stderr.strip()}")
            subprocess.run(["umount", "-l", str(share)], capture_output=True)
    prefix = str(base.resolve()) + "/"
    for device, backing in sysloop.attached().items():
        if backing.startswith(prefix):
            r = subprocess.run(["losetup", "-d", device], capture_output=True, text=True)
            if r.returncode != 0:
                problems.append(f"losetup -d {device}: {r.stderr.strip()}")
    shutil.rmtree(base, ignore_errors=True)
    return problems


# -- main -------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kata_bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, metavar="N",
                   help="sandbox starts (part 1), expansions (part 3) and I/O runs per side (part 4) (default 5)")
    p.add_argument("--stats-rounds", type=int, default=100, metavar="N",
                   help="rounds of stats calls in part 2 (default 100)")
    p.add_argument("--mib", type=int, default=256, metavar="MIB",
                   help="MiB written and read per run and side in part 4 (default 256, at most 384)")
    p.add_argument("--fs", default="ext4", choices=["ext4", "xfs"], help="file system of the volume in parts 1-3")
    p.add_argument("--accel", default="tcg", choices=["tcg", "kvm"], help="QEMU accelerator (default tcg)")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"guest image cache (default {DEFAULT_CACHE})")
    add_parts_option(p, 4, "; 2 and 3 need 1")
    p.add_argument("--json", nargs="?", const="-", metavar="OUT",
                   help="write the results as JSON to OUT, or to stdout (progress then goes to stderr)")
    args = p.parse_args(argv)
    if args.part_set & {2, 3} and 1 not in args.part_set:
        p.error("parts 2 and 3 use the sandbox part 1 starts: add 1")
    if args.runs < 1 or args.stats_rounds < 1 or not 1 <= args.mib <= 384:
        p.error("--runs and --stats-rounds must be at least 1, --mib 1 to 384")
    return args


def main(argv=None) -> int:
    global OUT
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("kata_bench.py needs root (loop devices, mounts, QEMU)", file=sys.stderr)
        return 2
    if args.json == "-":
        OUT = sys.stderr

    raise_on_signals()
    project_on_pythonpath(os.environ)

    results: dict = {
        **run_header("kata_bench", argv, kata_machine()), "accel": args.accel, "loadavg_start": loadavg(),
    }
    m = results["machine"]
    say(f"crust microVM handler benchmark ({results['code']})\n"
        f"machine: {m['cpus']} CPUs {m['cpu_model']}, {m['memory']}, Linux {m['kernel']}, Debian {m['debian']}, "
        f"Python {m['python']}, {m['qemu']}; accelerator {args.accel}; load {results['loadavg_start']}")
    root: Root | None = None
    chain: Chain | None = None
    live: dict = {}
    status = 1
    started = time.monotonic()
    try:
        if 1 in args.part_set:
            root = Root()
            chain = Chain(root, args.fs, args.accel)
            t0 = time.monotonic()
            chain.up()
            say(f"\nchain up (driver, shim, proxy, kata handler registered), {VOLUME_MIB} MiB {args.fs} volume "
                f"published with deferral ({chain.device}) in {time.monotonic() - t0:.1f} s; root {root.path}")
            pids = [p.proc.pid for p in (chain.driver, chain.shim, chain.proxy, chain.handler)]
            for part, run in ((1, lambda: part1(chain, args.runs)), (2, lambda: part2(chain, args.stats_rounds)),
                              (3, lambda: part3(chain, args.runs))):
                if part in args.part_set:
                    watch = CpuWatch(pids, [root.path])
                    results[f"part{part}"] = run()
                    others = results[f"part{part}"]["other_processes_cpu_cores"] = watch.others_cores()
                    say(f"    other processes kept {others:.2f} of {os.cpu_count()} cores busy meanwhile")
            if chain.sandbox_id:
                results["part1"]["final_delete_ms"] = round(chain.delete_sandbox(), 1)
            problems = chain.teardown()
            if problems:
                results["teardown_problems"] = problems
                say(f"    teardown through the chain: {problems} (forced cleanup follows)")
            root.close()
            root = None
        if 4 in args.part_set:
            try:
                results["part4"] = asyncio.run(_part4_with_vm_stop(args, live))
            finally:
                problems = cleanup_part4(live)
                live.clear()
                if problems:
                    results.setdefault("teardown_problems", []).extend(problems)
        results["wall_seconds"] = round(time.monotonic() - started, 1)
        results["loadavg_end"] = loadavg()
        say(f"\nwhole run {results['wall_seconds']:.0f} s, load {results['loadavg_end']} at the end")
        status = 0
    except (KeyboardInterrupt, Interrupted) as exc:
        print(f"\ninterrupted ({str(exc) or 'SIGINT'}); cleaning up", file=sys.stderr, flush=True)
        status = 130
    except Exception as exc:  # noqa: BLE001 - report, then clean up
        print(f"\nbenchmark failed: {exc!r}", file=sys.stderr, flush=True)
        if root is not None:
            print_log_tails(root.path, "*.log")
        status = 1
    finally:
        ignore_signals()
        if root is not None:
            problems = chain.teardown() if chain is not None else []
            prefix = str(root.path.resolve()) + "/"
            path = root.path
            root.close()
            left_mounts, left_loops = left_below(prefix)
            if problems:
                print(f"cleanup: teardown errors (forced cleanup followed): {problems[:3]}", file=sys.stderr)
            if left_mounts or left_loops or qemu_pids_under(path) or path.exists():
                print(f"cleanup INCOMPLETE: mounts {left_mounts[:5]}, loop devices {left_loops[:5]}, "
                      f"root {path}", file=sys.stderr)
                status = status or 1
        if live:
            problems = cleanup_part4(live)
            if problems:
                print(f"cleanup of part 4: {problems}", file=sys.stderr)
                status = status or 1
        if args.json and status == 0:
            if args.json == "-":
                sys.stdout.write(json.dumps(results, indent=1) + "\n")
            else:
                write_json(Path(args.json), results)
    return status


async def _part4_with_vm_stop(args, live: dict) -> dict:
    """part4(), then the VM stopped whatever happens. A signal cancels only
    this task (a signal handler raising inside the event loop would make
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
            return await part4(args, live)
        except asyncio.CancelledError:
            if received:
                raise Interrupted(received[0]) from None
            raise
    finally:
        await stop_part4_vm(live)  # later signals are swallowed by on_signal
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
            signal.signal(sig, previous[sig])


if __name__ == "__main__":
    sys.exit(main())
