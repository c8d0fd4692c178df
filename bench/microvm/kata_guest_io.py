"""Part 4 of bench/microvm/kata_bench.py: virtio-blk against virtio-9p in one
generic-kernel guest (what the part measures, and how: kata_bench.py's
docstring), and on the host for reference."""

from __future__ import annotations

import os
from collections.abc import Callable

from bench.lib.benchlib import loadavg, others_cores, summary
from bench.lib.guest_io import FS_MIB, MEMORY_MIB, IoVm
from bench.lib.kata_chain import run_sample
from crust.kata.image.build import build
from tests.harness.daemons import MIB

# buffered: through the guest's page cache (write + fsync; caches dropped
# before reading); direct: O_DIRECT in the guest (still fsync'd).
MODES = ("buffered", "direct")


async def part4(args, io_vm: IoVm, say: Callable[[str], None]) -> dict:
    """Writes and cold reads through virtio-blk and virtio-9p in one guest, and on the host for reference."""
    say(f"\n[4] virtio-blk against virtio-9p in one generic-kernel guest ({args.runs} runs, {args.mib} MiB, "
        f"order alternating; load {loadavg()})")
    image = build(args.cache, "generic")
    say(f"    guest image generic {image.digest[:16]} ({image.manifest.get('kernel_release')}), "
        f"{'rebuilt' if image.rebuilt else 'up to date'}")
    io_vm.prepare(image, args.accel)
    sample = run_sample([], io_vm.base)
    before = sample()
    boot, guest_dev, stamp_s = await io_vm.boot()
    say(f"    VM booted in {boot:.1f} s; /dev/{guest_dev} (virtio-blk) on /mnt/blk, 9p tag kbshare on /mnt/9p; "
        f"the time stamps cost {stamp_s * 1e3:.1f} ms")

    mbps = lambda seconds: args.mib * MIB / 1e6 / seconds  # noqa: E731
    results = {side: {mode: {"write": [], "read": [], "write_host_seen": [], "read_host_seen": []}
                      for mode in MODES} for side in ("blk", "9p", "host")}
    for r in range(args.runs):
        order = ("blk", "9p") if r % 2 == 0 else ("9p", "blk")
        modes = MODES if r % 2 == 0 else MODES[::-1]
        line = []
        for side in order:
            for mode in modes:
                w, wh, rd, rh = await io_vm.guest_write_read(side, mode == "direct", args.mib)
                for k, v in (("write", w), ("read", rd), ("write_host_seen", wh), ("read_host_seen", rh)):
                    results[side][mode][k].append(mbps(v))
                line.append(f"{side} {mode[:3]} w {mbps(w):.0f} r {mbps(rd):.0f}")
        # Reference: the same on the host, in the shared mount (the guest's 9p file is removed first).
        await io_vm.remove_guest_files("9p")
        for mode in modes:
            w, rd = io_vm.host_write_read(mode == "direct", args.mib)
            results["host"][mode]["write"].append(mbps(w))
            results["host"][mode]["read"].append(mbps(rd))
            line.append(f"host {mode[:3]} w {mbps(w):.0f} r {mbps(rd):.0f}")
        say(f"    run {r + 1} ({' then '.join(order)}; MB/s): " + ", ".join(line))
    await io_vm.remove_guest_files("blk", "9p")
    out = {"mib": args.mib, "runs": args.runs, "guest_memory_mib": MEMORY_MIB, "fs_mib": FS_MIB,
           "accel": args.accel, "guest_kernel": image.manifest.get("kernel_release"), "boot_s": round(boot, 2),
           "stamp_overhead_ms": round(stamp_s * 1e3, 2), "loadavg": loadavg(),
           "other_processes_cpu_cores": others_cores(before, sample()),
           "mb_per_s": {side: {mode: {k: summary(v, 1) for k, v in d.items() if v} for mode, d in per.items()}
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
