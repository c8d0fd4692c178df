#!/usr/bin/env python3
"""Sequential write and read throughput in the microVM guest: an encrypted
(LUKS2, dm-crypt in the guest) volume, and an authenticated one (LUKS2
with integrity: dm-integrity under dm-crypt, HMAC-SHA256, what
crust.dev/integrity: hmac-sha256 makes), against a plain one, side by side.

    sudo .venv/bin/python bench/microvm/luks_io.py [--runs 3] [--mib 128] [--accel tcg] [--json [OUT]]

One guest (the handler's cloud image, as sandboxes run it), three volumes
with room for the same file system, on loop devices over sparse files,
hot-plugged as virtio-blk: "plain" (ext4 made on the host, as the shim
does), "luks2" and "luks2-hmac" (blank; OpenEncrypted of the guest's
Python agent, through its port, formats them with LUKS2, with integrity
for the second, and makes ext4 inside, as a sandbox does), each mounted by
the agent's MountVolume. Per run and volume (order alternating): busybox dd of
--mib MiB from /dev/zero, fsync'd, buffered and O_DIRECT; the caches in the
guest and on the host dropped; the file read back. Times are taken inside
the guest. Everything made is removed at the end, also on a signal.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib.benchlib import (
    code_label,
    guarded_run_then_write,
    loadavg,
    not_root,
    raise_on_signals,
    report_failure,
    run_header,
    summary,
)
from bench.lib.kata_chain import kata_machine
from bench.lib.guest_io import GuestIo, evict_block_device, evict_file, run_then, stop_or_kill
from crust.contract import encryption
from crust.kata.agent import volume_calls
from crust.kata.image.build import DEFAULT_CACHE, build
from crust.kata.vmm.qemu import Vm, VmConfig, qemu_pids_under
from crust.sys import loop as sysloop
from tests.harness.daemons import MIB

MODES = ("buffered", "direct")
SIDES = ("plain", "luks2", "luks2-hmac")
INTEGRITY = {"luks2": "", "luks2-hmac": encryption.HMAC_SHA256}  # the encrypted sides
MEMORY_MIB = 512
KEY = os.urandom(32)
OUT = sys.stdout


def say(text: str = "") -> None:
    print(text, file=OUT, flush=True)


class LuksVm:
    def __init__(self, mib: int):
        self.base = Path(tempfile.mkdtemp(prefix="crust-lb-"))
        self.fs_mib = mib * 2 + 64
        self.files: dict[str, Path] = {}
        self.devices: dict[str, str] = {}
        self.vm: Vm | None = None
        self.io: GuestIo | None = None

    def prepare(self, image, accel: str) -> None:
        for side in SIDES:
            f = self.files[side] = self.base / f"{side}.img"
            size = self.fs_mib * MIB
            if side in INTEGRITY:   # the same room for the file system inside
                size += encryption.room_inside(size, INTEGRITY[side])
            with open(f, "wb") as fh:
                fh.truncate(size)
            if side == "plain":
                subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(f)],
                               check=True, capture_output=True, timeout=120)
            self.devices[side] = subprocess.run(["losetup", "--find", "--show", "--nooverlap", str(f)],
                                                check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        self.vm = Vm("crust-lb-io", self.base / "vm", VmConfig(kernel=image.kernel, initrd=image.initrd,
                                                                 accel=accel, memory_mib=MEMORY_MIB))

    async def boot(self) -> dict:
        boot = await self.vm.start()
        self.io = GuestIo(self.vm)
        for side in SIDES:
            await self.vm.attach_disk(self.devices[side], f"lb{side}")
        client = await self.io.client()
        await volume_calls.mount(client, volume_calls.storage("lbplain", "ext4", [], False, "/mnt/plain", None))
        timings = {"boot_s": round(boot, 2)}
        for side, integrity in INTEGRITY.items():
            name = f"crypt-lb-{side}"
            size = os.stat(self.files[side]).st_size
            volume = volume_calls.storage(name, "ext4", [], False, f"/mnt/{side}", None)
            t0 = time.monotonic()
            await volume_calls.open_encrypted(client, f"lb{side}", "ext4", name, bytearray(KEY),
                                              integrity=integrity, size_bytes=size)
            timings[f"{side}_format_and_mkfs_s"] = round(time.monotonic() - t0, 2)
            await volume_calls.mount(client, volume)
            t0 = time.monotonic()
            await volume_calls.unmount(client, volume.mount_point)
            await volume_calls.close_encrypted(client, name)
            await volume_calls.open_encrypted(client, f"lb{side}", "ext4", name, bytearray(KEY),
                                              integrity=integrity, size_bytes=size)
            timings[f"{side}_close_and_reopen_s"] = round(time.monotonic() - t0, 2)
            await volume_calls.mount(client, volume)
        return timings

    async def write_read(self, side: str, direct: bool, mib: int) -> tuple[float, float]:
        f = f"/mnt/{side}/lb.dat"
        wflag, rflag = (" oflag=direct", " iflag=direct") if direct else ("", "")
        await self.io.run(f"rm -f {f}; sync")
        w, _ = await self.io.timed(f"dd if=/dev/zero of={f} bs=1M count={mib}{wflag} conv=fsync")
        await self.io.run("sync; echo 3 > /proc/sys/vm/drop_caches")
        evict_block_device(self.devices[side])
        evict_file(self.files[side])
        rd, _ = await self.io.timed(f"dd if={f} of=/dev/null bs=1M{rflag}")
        return w, rd

    async def stop_vm(self) -> None:
        await stop_or_kill(self.vm)

    def clean_up(self) -> list[str]:
        """Only what this run made: its QEMU, its loop devices, its directory."""
        problems = []
        for pid in qemu_pids_under(self.base):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        for _ in range(50):
            if not qemu_pids_under(self.base):
                break
            time.sleep(0.1)
        prefix = str(self.base.resolve()) + "/"
        for device, backing in sysloop.attached().items():
            if backing.startswith(prefix):
                r = subprocess.run(["losetup", "-d", device], capture_output=True, text=True)
                if r.returncode != 0:
                    problems.append(f"losetup -d {device}: {r.stderr.strip()}")
        shutil.rmtree(self.base, ignore_errors=True)
        return problems


async def measure(args, lvm: LuksVm) -> dict:
    image = build(args.cache, "cloud")
    lvm.prepare(image, args.accel)
    setup = await lvm.boot()
    say(f"guest image {image.digest[:16]} ({image.manifest.get('kernel_release')}); VM up in {setup['boot_s']} s; "
        + "; ".join(f"{side}: luksFormat + open + mkfs.ext4 {setup[side + '_format_and_mkfs_s']} s, close + open "
                    f"{setup[side + '_close_and_reopen_s']} s" for side in INTEGRITY))
    mbps = lambda seconds: args.mib * MIB / 1e6 / seconds
    samples = {side: {mode: {"write": [], "read": []} for mode in MODES} for side in SIDES}
    for r in range(args.runs):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        line = []
        for side in order:
            for mode in MODES:
                w, rd = await lvm.write_read(side, mode == "direct", args.mib)
                samples[side][mode]["write"].append(mbps(w))
                samples[side][mode]["read"].append(mbps(rd))
                line.append(f"{side} {mode[:3]} w {mbps(w):.0f} r {mbps(rd):.0f}")
        say(f"run {r + 1} (MB/s): " + ", ".join(line))
    mb = {side: {mode: {k: summary(v, 1) for k, v in d.items()} for mode, d in per.items()}
          for side, per in samples.items()}
    def ratio_of(side: str, base: str) -> dict:
        return {mode: {k: round(mb[side][mode][k]["median"] / mb[base][mode][k]["median"], 2)
                       for k in ("write", "read")} for mode in MODES}
    ratios = {"luks2_over_plain": ratio_of("luks2", "plain"), "luks2-hmac_over_luks2": ratio_of("luks2-hmac", "luks2"),
              "luks2-hmac_over_plain": ratio_of("luks2-hmac", "plain")}
    say(f"{'volume':<28}{'write MB/s: median (min-max)':>30}{'read MB/s: median (min-max)':>30}")
    for mode in MODES:
        for side in SIDES:
            w, rd = mb[side][mode]["write"], mb[side][mode]["read"]
            say(f"{mode + ', ' + side:<28}{w['median']:>16.0f} ({w['min']:.0f}-{w['max']:.0f})"
                f"{rd['median']:>18.0f} ({rd['min']:.0f}-{rd['max']:.0f})")
        say(f"{mode} (medians): " + ", ".join(f"{name.replace('_over_', '/')} write {r[mode]['write']:.2f}x, "
                                               f"read {r[mode]['read']:.2f}x" for name, r in ratios.items()))
    return {**setup, "mib": args.mib, "runs": args.runs, "accel": args.accel, "guest_memory_mib": MEMORY_MIB,
            "guest_kernel": image.manifest.get("kernel_release"), "mb_per_s": mb, "ratios": ratios,
            "samples_mb_per_s": {s: {m: {k: [round(x, 1) for x in v] for k, v in d.items()}
                                     for m, d in per.items()} for s, per in samples.items()}}


def main(argv=None) -> int:
    global OUT
    p = argparse.ArgumentParser(prog="luks_io.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, metavar="N", help="runs per volume and mode (default 3)")
    p.add_argument("--mib", type=int, default=128, metavar="MIB", help="MiB written and read per run (default 128)")
    p.add_argument("--accel", default="tcg", choices=["tcg", "kvm"], help="QEMU accelerator (default tcg)")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"guest image cache (default {DEFAULT_CACHE})")
    p.add_argument("--json", nargs="?", const="-", metavar="OUT",
                   help="write the results as JSON to OUT, or to stdout (progress then goes to stderr)")
    args = p.parse_args(argv)
    if args.runs < 1 or not 1 <= args.mib <= 1024:
        p.error("--runs must be at least 1, --mib 1 to 1024")
    if not_root("luks_io.py", "loop devices, QEMU"):
        return 2
    if args.json == "-":
        OUT = sys.stderr
    raise_on_signals()
    results: dict = {**run_header("luks_io", argv, kata_machine(), vm=True), "accelerator": args.accel}
    m = results["machine"]
    say(f"crust encrypted volume I/O in the guest ({code_label(results)})\nmachine: {m['cpus']} CPUs {m['cpu_model']}, "
        f"{m['memory']}, Linux {m['kernel']}, {m['qemu']}; accelerator {args.accel}; load {results['load_before']}")
    lvm = LuksVm(args.mib)

    def run() -> None:
        try:
            results["io"] = asyncio.run(run_then(lambda: measure(args, lvm), lvm.stop_vm))
        finally:
            problems = lvm.clean_up()
            if problems:
                results["teardown_problems"] = problems
        results["loadavg_end"] = loadavg()

    def clean_up() -> bool:
        return not lvm.clean_up()

    return guarded_run_then_write(run, clean_up, report_failure, args.json, results)


if __name__ == "__main__":
    sys.exit(main())
