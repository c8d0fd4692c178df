#!/usr/bin/env python3
"""What the microVM handler costs: sandbox start, stats, expansion, and guest I/O.

Parts 1 to 3 use the REAL chain (tests/harness/daemons.py Root.stack(): crust driver
-> crust shim -> crust proxy, and `crust kata handler` registered with the
proxy). One deferred volume (--fs, default ext4, 256 MiB) is created, staged
and published with defer_fs_ops=True on the proxy's kubelet-facing CSI
socket, as kubelet would; an OCI bundle (process `sleep 3600`, mount source =
the CSI target path, destination /data) is run by the handler, whose sandbox
is a QEMU microVM with the cloud guest image (crust.kata.image.build, flavor
"cloud", the one the handler uses).

1. Sandbox start: the time from the client's RunSandbox call (gRPC, the
   handler's SandboxControl service) to its return. When it returns the VM
   has booted, the volume's loop device is hot-plugged as virtio-blk and
   mounted by the guest kernel, bound at /data and the process started.
   The boot part (QEMU spawned to the guest agent's first answer) is read
   from the handler's log (crust.kata.vmm.qemu logs it per VM); the rest is
   claim, hot-plug, guest mount, bind and process start. One warm-up start
   is not counted; each counted start is followed by DeleteSandbox (timed
   too: the guest unmounts and powers off), except the last, whose sandbox
   parts 2 and 3 use and which is deleted at the end.
2. Stats round trip: proxy NodeGetVolumeStats for the deferred volume
   (kubelet-facing proxy -> shim -> proxy Runtime API -> kata handler ->
   guest agent -> statfs in the guest), --stats-rounds rounds, alternating
   with the handler's GetVolumeStats alone (handler -> guest agent) to show
   where the time goes. Median, p90, min and max. Measured once the guest's
   agent is connected (a VM is ready then: the wait reported is about
   nothing).
3. Expansion round trip: ControllerExpandVolume then NodeExpandVolume on the
   proxy (+64 MiB each time; the shim grows the loop device, the handler
   tells QEMU (block_resize), the guest's resize2fs/xfs_growfs grows the
   mounted file system), then proxy NodeGetVolumeStats until the guest
   reports the larger size. --runs expansions; each step and the whole
   round trip are timed.

Part 4 drives one microVM directly (crust.kata.vmm.qemu.Vm, its agent's port), with
the GENERIC guest image (Debian's full kernel, which has 9p) and 512 MiB of
guest memory, to compare two ways of giving a guest a file system:
  (a) virtio-blk: an ext4 file system on a loop device, hot-plugged as
      virtio-blk (as the handler does: QEMU without O_DIRECT on the host)
      and mounted by the guest kernel (the agent's MountVolume);
  (b) virtio-9p: an ext4 file system on a loop device mounted on the HOST,
      that mount point shared into the guest with
      `-fsdev local,security_model=passthrough -device virtio-9p-pci` and
      mounted in the guest with
      `mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000`.
      The agent's MountVolume only mounts disks (found by serial), so a
      process in the guest loads the 9p modules the image lists in
      /etc/crust/modules.d/9p (insmod) and mounts the share itself.
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

    .venv/bin/python bench/microvm/kata_bench.py [--runs 5] [--json [OUT]]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: bench, crust, tests

from bench.lib.benchlib import (  # noqa: E402
    add_parts_option,
    code_label,
    guarded_run_then_write,
    loadavg,
    not_root,
    print_log_tails,
    raise_on_signals,
    report_failure,
    rotated,
    run_header,
    summary,
    timed,
    with_others_cores,
)
from bench.lib.kata_chain import VOLUME_MIB, KataChain, kata_machine, run_sample  # noqa: E402
from bench.lib.guest_io import IoVm, run_then  # noqa: E402
from bench.microvm.kata_guest_io import part4  # noqa: E402
from bench.lib.stack import project_on_pythonpath  # noqa: E402
from crust.api import csi_pb2, handler_pb2  # noqa: E402
from crust.kata.image.build import DEFAULT_CACHE  # noqa: E402
from tests.harness.daemons import MIB, Root  # noqa: E402

GROW_MIB = 64
# The handler's log line once a VM's guest Python agent is connected (crust.kata.vmm.agent_port).
PORT_CONNECTED = " on its port, capabilities "

# Progress goes to stdout, unless the JSON does (--json without OUT).
OUT = sys.stdout


def say(text: str = "") -> None:
    print(text, file=OUT, flush=True)


def fmt(s: dict, unit: str = "ms") -> str:
    """A summary() as the progress lines show it."""
    if not s.get("n"):
        return "(none)"
    return f"median {s['median']:g} {unit} (min {s['min']:g}, max {s['max']:g}, n={s['n']})"


# -- parts 1 to 3: the chain ----------------------------------------------------------------------------


def part1(chain: KataChain, runs: int) -> dict:
    """Sandbox starts (and deletes) through the chain, after one warm-up."""
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
    out = {"runs": per_run, "warm_up": warm, "run_sandbox_ms": summary(starts, 1), "boot_ms": summary(boots, 1),
           "after_boot_ms": summary(rest, 1), "delete_sandbox_ms": summary(deletes, 1), "loadavg": loadavg()}
    say(f"    RunSandbox (call to return: VM booted, volume mounted in the guest, process started): "
        f"{fmt(out['run_sandbox_ms'])}")
    say(f"      of which VM boot (QEMU start to the agent's first answer): {fmt(out['boot_ms'])}")
    say(f"      the rest (claim, virtio-blk hot-plug, guest mount, bind, process start): {fmt(out['after_boot_ms'])}")
    say(f"    DeleteSandbox: {fmt(out['delete_sandbox_ms'])}")
    return out


def part2(chain: KataChain, rounds: int) -> dict:
    """The volume's stats along the whole chain and from the handler alone, alternating."""
    say(f"\n[2] NodeGetVolumeStats through the chain ({rounds} rounds; load {loadavg()})")
    d_req = csi_pb2.NodeGetVolumeStatsRequest(volume_id=chain.volume.volume_id, volume_path=str(chain.volume.target))
    h_req = handler_pb2.GetVolumeStatsRequest(target_path=str(chain.volume.target), sandbox_id=chain.sandbox_id)
    paths = {
        "proxy NodeGetVolumeStats (proxy -> shim -> proxy runtime API -> handler -> guest agent)":
            lambda: chain.proxy.node.NodeGetVolumeStats(d_req, timeout=60),
        "handler GetVolumeStats alone (handler -> guest agent)":
            lambda: chain.handler_stub.GetVolumeStats(h_req, timeout=60),
    }
    names = list(paths)
    for call in list(paths.values()) * 5:  # warm the channels and code paths
        call()
    # Measured once the guest's agent is connected (the handler logs it
    # when the VM becomes ready).
    agent_wait = time.monotonic()
    while PORT_CONNECTED not in chain.handler.log_path.read_text() and time.monotonic() - agent_wait < 60:
        paths[names[1]]()
        time.sleep(0.2)
    agent_wait_s = round(time.monotonic() - agent_wait, 2)
    say(f"    the guest's agent connected after {agent_wait_s} s more")
    first = chain.stats_bytes()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in rotated(names, r):
            samples[name].append(timed(paths[name]))
    out = {"rounds": rounds, "agent_port_wait_s": agent_wait_s, "paths": {n: summary(s, 2) for n, s in samples.items()},
           "bytes_total_reported": first.total, "loadavg": loadavg()}
    for name, s in out["paths"].items():
        say(f"    {name}:\n      median {s['median']:.1f} ms, p90 {s['p90']:.1f}, min {s['min']:.1f}, max {s['max']:.1f}")
    return out


def part3(chain: KataChain, runs: int) -> dict:
    """Expansions of the volume in use, until the guest reports the new size."""
    say(f"\n[3] expansion round trip ({runs} x +{GROW_MIB} MiB, {chain.fs}; load {loadavg()})")
    ctl_ms, node_ms, seen_ms, total_ms, sizes = [], [], [], [], []
    capacity = chain.volume.capacity
    before = chain.stats_bytes().total
    for i in range(runs):
        new = capacity + GROW_MIB * MIB
        t0 = time.perf_counter()
        c = chain.controller_expand(new)
        t1 = time.perf_counter()
        n = chain.node_expand(new)
        t2 = time.perf_counter()
        # The guest must report (nearly) the whole step: a file system's
        # usable size grows by a little less than its device.
        total, polls = chain.wait_for_guest_size(before, GROW_MIB * MIB * 0.9)
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
    out = {"step_mib": GROW_MIB, "fs": chain.fs, "controller_expand_ms": summary(ctl_ms, 1),
           "node_expand_ms": summary(node_ms, 1), "stats_seen_ms": summary(seen_ms, 1),
           "round_trip_ms": summary(total_ms, 1), "sizes": sizes, "loadavg": loadavg()}
    say(f"    ControllerExpandVolume: {fmt(out['controller_expand_ms'])}")
    say(f"    NodeExpandVolume (through the handler into the guest): {fmt(out['node_expand_ms'])}")
    say(f"    then NodeGetVolumeStats showing the new size: {fmt(out['stats_seen_ms'])}")
    say(f"    whole round trip: {fmt(out['round_trip_ms'])}")
    return out


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
    if not_root("kata_bench.py", "loop devices, mounts, QEMU"):
        return 2
    if args.json == "-":
        OUT = sys.stderr

    raise_on_signals()
    project_on_pythonpath(os.environ)

    results: dict = {**run_header("kata_bench", argv, kata_machine(), vm=True), "accelerator": args.accel,
                     "loadavg_start": loadavg()}
    m = results["machine"]
    say(f"crust microVM handler benchmark ({code_label(results)})\n"
        f"machine: {m['cpus']} CPUs {m['cpu_model']}, {m['memory']}, Linux {m['kernel']}, Debian {m['debian']}, "
        f"Python {m['python']}, {m['qemu']}; accelerator {args.accel}; load {results['loadavg_start']}")
    chain: KataChain | None = None
    io_vm = IoVm()
    started = time.monotonic()

    def run() -> None:
        nonlocal chain
        if 1 in args.part_set:
            chain = KataChain(Root(), args.fs, args.accel)
            t0 = time.monotonic()
            chain.up()
            say(f"\nchain up (driver, shim, proxy, kata handler registered), {VOLUME_MIB} MiB {args.fs} volume "
                f"published with deferral ({chain.device}) in {time.monotonic() - t0:.1f} s; root {chain.root.path}")
            sample = run_sample(chain.pids, chain.root.path)
            for part, measure in ((1, lambda: part1(chain, args.runs)), (2, lambda: part2(chain, args.stats_rounds)),
                                  (3, lambda: part3(chain, args.runs))):
                if part in args.part_set:
                    out = results[f"part{part}"] = with_others_cores(measure, sample)
                    say(f"    other processes kept {out['other_processes_cpu_cores']:.2f} of {os.cpu_count()} "
                        "cores busy meanwhile")
            if chain.sandbox_id:
                results["part1"]["final_delete_ms"] = round(chain.delete_sandbox(), 1)
            problems = chain.teardown()
            if problems:
                results["teardown_problems"] = problems
                say(f"    teardown through the chain: {problems} (forced cleanup follows)")
            chain.root.close()
            chain = None
        if 4 in args.part_set:
            try:
                results["part4"] = asyncio.run(run_then(lambda: part4(args, io_vm, say), io_vm.stop_vm))
            finally:
                problems = io_vm.clean_up()
                if problems:
                    results.setdefault("teardown_problems", []).extend(problems)
        results["wall_seconds"] = round(time.monotonic() - started, 1)
        results["loadavg_end"] = loadavg()
        say(f"\nwhole run {results['wall_seconds']:.0f} s, load {results['loadavg_end']} at the end")

    def failed(exc: Exception) -> None:
        report_failure(exc)
        if chain is not None:
            print_log_tails(chain.root.path, "*.log")

    def clean_up() -> bool:
        complete = chain.close() if chain is not None else True
        if io_vm.base is not None:
            problems = io_vm.clean_up()
            if problems:
                print(f"cleanup of part 4: {problems}", file=sys.stderr)
                complete = False
        return complete

    return guarded_run_then_write(run, clean_up, failed, args.json, results)


if __name__ == "__main__":
    sys.exit(main())
