#!/usr/bin/env python3
"""Time every CSI lifecycle step of a volume on a real `crust driver`.

Starts `python -m crust driver --mode all` on a unix socket in a temporary
root, plays the CO over real gRPC, and times each RPC of a volume's life as
the client sees it:

    CreateVolume, ControllerPublishVolume, NodeStageVolume, NodePublishVolume,
    NodeGetVolumeStats, NodeUnpublishVolume, NodeUnstageVolume,
    ControllerUnpublishVolume, DeleteVolume      (mount access, ext4, 64 MiB)

    ControllerExpandVolume + NodeExpandVolume    (on a second volume per
    iteration, mount access, xfs 320 MiB -> 384 MiB, published: ext4 online
    grow is refused by some kernels, xfs grows online everywhere; that
    volume's other steps are timed too and reported separately)

It does so at several scales: with N "background" volumes already present
in the driver, each created, controller-published, staged and published (so
mountinfo, the loop devices and the records all grow). Each scale has a
driver of its own, and the measured lifecycles alternate between the
drivers (the order rotating every round), so that every scale meets the
same load on the machine. Each scale reports median and p90 per step; the
table shows the scales side by side with the ratio largest/smallest.

Run from the project root as root (loop devices and mounts):

    .venv/bin/python bench/csi/driver_lifecycle.py [--volumes 30] [--background 10,1000] [--json OUT]

The driver runs in a private mount namespace of its own (as a node plugin
does in its container): the benchmark's 2,000 mounts stay out of the host's
mount table, so mount namespaces other programs create meanwhile cannot copy
and pin them, and the host's mounts do not inflate the driver's mountinfo.

Everything it makes lives under one temporary root and is removed on exit,
also on Ctrl-C, SIGTERM or failure: volumes are unpublished, unstaged and
deleted through the driver, the driver is stopped (its namespace, and any
mount still in it, goes with it), any mount left below the root is unmounted
and any loop device over a file below it is detached; the loop device nodes
the run made the kernel create are removed again (unless --keep-loop-nodes),
so the next run starts from the same /sys/block.
"""


from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: bench, crust, tests

from bench.lib.benchlib import (  # noqa: E402
    code_label,
    cpu_sample,
    file_text,
    guarded_run,
    iowait_cores,
    machine,
    not_root,
    others_cores,
    raise_on_signals,
    report_failure,
    run_header,
    write_json,
)
from bench.lib.driver import CO, Driver, Volume, snapshot_env, tear_down  # noqa: E402
from bench.lib.kernel import LoopNodes, rss_mib  # noqa: E402

MIB = 1024**2

EXT4_STEPS = [
    "CreateVolume",
    "ControllerPublishVolume",
    "NodeStageVolume",
    "NodePublishVolume",
    "NodeGetVolumeStats",
    "NodeUnpublishVolume",
    "NodeUnstageVolume",
    "ControllerUnpublishVolume",
    "DeleteVolume",
]
XFS_STEPS = [
    "CreateVolume",
    "ControllerPublishVolume",
    "NodeStageVolume",
    "NodePublishVolume",
    "ControllerExpandVolume",
    "NodeExpandVolume",
    "NodeUnpublishVolume",
    "NodeUnstageVolume",
    "ControllerUnpublishVolume",
    "DeleteVolume",
]


# -- the measurements ------------------------------------------------------------------------


def measure_one(co: CO, root: Path, tag: str, args) -> tuple[dict, dict]:
    """One ext4 volume's whole life, with the expand step on an xfs volume in the middle: ms per step of each."""
    base = root / "m" / tag
    a = Volume(f"m-{tag}-ext4", "ext4", args.ext4_size * MIB, str(base / "e-staging"), str(base / "e-target"))
    b = Volume(f"m-{tag}-xfs", "xfs", args.xfs_size * MIB, str(base / "x-staging"), str(base / "x-target"))
    te: dict[str, float] = {}
    tx: dict[str, float] = {}
    co.round_trip(te)
    # The ext4 volume's life, in the order a CO calls it...
    co.create(a, te)
    co.controller_publish(a, te)
    co.stage(a, te)
    co.publish(a, te)
    co.stats(a, te)
    # ...the expand step on a published xfs volume, at the same point of the
    # life (same mounts and loop devices present, plus the ext4 volume's)...
    co.bring_up(b, tx)
    co.expand(b, (args.xfs_size + args.xfs_grow) * MIB, tx)
    co.tear_down(b, tx)
    # ...and the rest of the ext4 volume's life.
    co.tear_down(a, te)
    te["total"] = sum(te[s] for s in EXT4_STEPS)
    return te, tx


def build_scale(co: CO, pool: ThreadPoolExecutor, n: int, args, loop_nodes: LoopNodes) -> dict:
    """Bring a driver's background volumes up to n; what it walks over then."""
    root = co.d.root
    t0 = time.monotonic()
    todo = [Volume(f"bg-{i:05d}", "ext4", args.ext4_size * MIB, str(root / "bg" / f"{i:05d}" / "staging"),
                   str(root / "bg" / f"{i:05d}" / "target")) for i in range(n)]
    for fut in [pool.submit(co.bring_up, v) for v in todo]:
        fut.result()
    loop_nodes.note()
    built = time.monotonic() - t0
    print(f"[{n} background volumes] ready in {built:.1f}s", flush=True)
    return {"background": n, "build_seconds": round(built, 1), "driver": co.d}


def measure_interleaved(cos: dict[int, CO], scales: dict[int, dict], args) -> None:
    """args.volumes lifecycles on each driver, alternating between them (the
    order rotating every round), so every scale meets the same machine."""
    # Start from a clean page cache: writeback of what building the
    # background dirtied would otherwise slow every fsync.
    os.sync()
    for n, scale in scales.items():
        scale["env"] = snapshot_env(cos[n].d.root, cos[n].d)
        scale["samples"] = ({s: [] for s in EXT4_STEPS + ["total", "NodeGetCapabilities"]},
                            {s: [] for s in XFS_STEPS})
    pids = [co.d.proc.pid for co in cos.values() if co.d.proc]
    cpu0, retries0, t1 = cpu_sample(pids), {n: dict(co.retries) for n, co in cos.items()}, time.monotonic()
    order = list(scales)
    for i in range(args.volumes):
        for n in order[i % len(order):] + order[:i % len(order)]:
            te, tx = measure_one(cos[n], cos[n].d.root, f"{n}-{i:03d}", args)
            for k, v in te.items():
                scales[n]["samples"][0][k].append(v)
            for k, v in tx.items():
                scales[n]["samples"][1][k].append(v)
        if (i + 1) % 10 == 0:
            print(f"  {i + 1}/{args.volumes} rounds (lifecycle medians so far: " + ", ".join(
                f"{n} bg {statistics.median(scales[n]['samples'][0]['total']):.0f} ms" for n in order) + ")",
                flush=True)
    cpu1 = cpu_sample(pids)
    for n, scale in scales.items():
        co, env = cos[n], scale["env"]
        env["retries_while_measuring"] = {k: v - retries0[n].get(k, 0) for k, v in co.retries.items()
                                          if v - retries0[n].get(k, 0)}
        env["loadavg_after"] = file_text("/proc/loadavg").split(" ")[0]
        if co.d.proc is not None:
            env["driver_rss_mib"] = rss_mib(co.d.proc.pid)
        env.update({"other_processes_cpu_cores": others_cores(cpu0, cpu1), "iowait_cores": iowait_cores(cpu0, cpu1)})
        ext4, xfs = scale.pop("samples")
        scale.pop("driver")
        scale["measure_seconds"] = round(time.monotonic() - t1, 1)
        scale["steps"] = {"ext4": {k: summarize(v) for k, v in ext4.items()},
                          "xfs": {k: summarize(v) for k, v in xfs.items()}}


# -- statistics and output ------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q quantile, interpolated between the two nearest ranks (nan without values)."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(samples: list[float]) -> dict:
    """A step's median, p90, min and max at one scale, and every sample (ms, 2 decimals)."""
    return {
        "n": len(samples),
        "median_ms": round(percentile(samples, 0.5), 2),
        "p90_ms": round(percentile(samples, 0.9), 2),
        "min_ms": round(min(samples), 2) if samples else None,
        "max_ms": round(max(samples), 2) if samples else None,
        "samples_ms": [round(x, 2) for x in samples],
    }


def ms_text(x: float) -> str:
    """A time in ms as the table shows it: 1 decimal below 100, none above; "-" for none."""
    if x != x:  # nan
        return "-"
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def render_table(result: dict) -> str:
    """The steps (rows) at each scale (columns), then what the driver walked over at each scale."""
    scales = [s["background"] for s in result["scales"]]
    by = {s["background"]: s for s in result["scales"]}
    lo, hi = scales[0], scales[-1]
    head = ["step"] + [f"{n} bg: median / p90 ms" for n in scales]
    if len(scales) > 1:
        head.append(f"ratio {hi}/{lo} (median)")
    rows = []

    def add(label: str, group: str, step: str) -> None:
        row = [label]
        for n in scales:
            st = by[n]["steps"][group].get(step)
            row.append(f"{ms_text(st['median_ms'])} / {ms_text(st['p90_ms'])}" if st else "-")
        if len(scales) > 1:
            a, b = by[lo]["steps"][group].get(step), by[hi]["steps"][group].get(step)
            row.append(f"{b['median_ms'] / a['median_ms']:.2f}x" if a and b and a["median_ms"] > 0 else "-")
        rows.append(row)

    size = result["config"]
    ext4 = f"ext4 {size['ext4_mib']} MiB"
    add("gRPC round trip, no work (NodeGetCapabilities)", "ext4", "NodeGetCapabilities")
    for step in EXT4_STEPS:
        add(f"{step} ({ext4})", "ext4", step)
    add(f"whole lifecycle ({ext4}, sum)", "ext4", "total")
    xfs = f"xfs {size['xfs_mib']}->{size['xfs_grown_mib']} MiB"
    add(f"ControllerExpandVolume ({xfs})", "xfs", "ControllerExpandVolume")
    add(f"NodeExpandVolume ({xfs})", "xfs", "NodeExpandVolume")
    rows.append(["(the expand step's xfs volume, other steps)"] + [""] * (len(head) - 1))
    for step in XFS_STEPS:
        if "Expand" not in step:
            add(f"{step} (xfs {size['xfs_mib']} MiB)", "xfs", step)

    widths = [max(len(head[i]), *(len(r[i]) for r in rows if r)) for i in range(len(head))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                          for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    out = [line(head), "|" + "|".join(("-" * (w + 2)) if i == 0 else ("-" * (w + 1) + ":")
                                    for i, w in enumerate(widths)) + "|"]
    for r in rows:
        out.append(line(r))
    env_keys = [("mountinfo_lines", "mountinfo lines (driver's namespace)"),
                ("loop_nodes_in_sys_block", "/sys/block/loop* nodes"),
                ("loop_devices_attached", "attached loop devices (all users)"),
                ("node_records", "node records on disk"),
                ("ms_read_mountinfo", "one raw read of the driver's /proc/PID/mountinfo, ms"),
                ("ms_mount_mounts", "one crust.sys.mount.mounts() (read + parse), ms"),
                ("ms_mount_at", "one crust.sys.mount.at(), ms"),
                ("ms_loop_devices_for", "one crust.sys.loop.devices_for() scan, ms"),
                ("driver_rss_mib", "the driver's resident memory (VmRSS) after measuring, MiB"),
                ("other_processes_cpu_cores", "CPU used by other processes while measuring, cores"),
                ("iowait_cores", "iowait while measuring, cores")]
    out.append("")
    out.append("| state during the measurement | " + " | ".join(f"{n} bg" for n in scales) + " |")
    out.append("|---|" + "---:|" * len(scales))
    for key, label in env_keys:
        out.append(f"| {label} | " + " | ".join(str(by[n]["env"].get(key, "-")) for n in scales) + " |")
    return "\n".join(out)


# -- the benchmark ------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="driver_lifecycle.py",
        description="Time each CSI lifecycle RPC of a volume on a real `crust driver --mode all` (loop backend), "
                    "with N pre-existing staged and published volumes, at several N. Needs root.")
    p.add_argument("--volumes", type=int, default=30, metavar="N",
                   help="measured volumes per scale (each goes through the whole lifecycle; default 30)")
    p.add_argument("--background", default="10,1000", metavar="N,M,...",
                   help="pre-existing (created, controller-published, staged, published) volume counts, "
                        "ascending; default 10,1000")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write every sample and the environment as JSON")
    p.add_argument("--jobs", type=int, default=4,
                   help="parallel CO calls while building/removing background volumes (never while measuring; "
                        "default 4)")
    p.add_argument("--ext4-size", type=int, default=64, metavar="MIB",
                   help="size of the measured ext4 volumes and the background volumes (default 64)")
    p.add_argument("--xfs-size", type=int, default=320, metavar="MIB",
                   help="size of the xfs volume of the expand step before growth (default 320; mkfs.xfs "
                        "needs 300)")
    p.add_argument("--xfs-grow", type=int, default=64, metavar="MIB", help="growth of the expand step (default 64)")
    p.add_argument("--keep-loop-nodes", action="store_true",
                   help="do not remove the (detached) loop device nodes this run made the kernel create")
    args = p.parse_args(argv)
    try:
        args.scales = sorted({int(x) for x in args.background.split(",") if x.strip()})
    except ValueError:
        p.error("--background takes comma-separated integers, e.g. 10,500")
    if not args.scales or args.scales[0] < 0:
        p.error("--background needs at least one count >= 0")
    if args.volumes < 1:
        p.error("--volumes must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not_root("driver_lifecycle.py", "loop devices, mkfs, mount"):
        return 2

    raise_on_signals()

    # One driver per scale, each in its own root and mount namespace. Short
    # paths: unix socket paths must stay under 108 bytes.
    roots = {n: Path(tempfile.mkdtemp(prefix="crust-bench-")).resolve() for n in args.scales}
    loop_nodes = {n: LoopNodes(r) for n, r in roots.items()}
    cos = {n: CO(Driver(r)) for n, r in roots.items()}
    pool = ThreadPoolExecutor(max_workers=max(1, args.jobs))
    result = {
        **run_header("driver_lifecycle", argv, machine(
            loop_max_loop=file_text("/sys/module/loop/parameters/max_loop"))),
        "config": {"volumes_per_scale": args.volumes, "background": args.scales, "ext4_mib": args.ext4_size,
                   "xfs_mib": args.xfs_size, "xfs_grown_mib": args.xfs_size + args.xfs_grow,
                   "access": "mount, SINGLE_NODE_WRITER", "jobs": args.jobs, "interleaved": True},
        "scales": [],
    }
    started = time.monotonic()

    def run() -> None:
        for n, co in cos.items():
            co.d.start()
            print(f"crust driver for {n} background volumes ({code_label(result)}) up in {co.d.root} "
                  f"({result['machine']['cpus']} CPUs, kernel {result['machine']['kernel']})", flush=True)
            # One warm-up lifecycle (imports, first subprocesses, page cache), not counted.
            measure_one(co, co.d.root, "warmup", args)
        scales = {n: build_scale(co, pool, n, args, loop_nodes[n]) for n, co in cos.items()}
        print(f"measuring {args.volumes} lifecycles on each driver, interleaved", flush=True)
        measure_interleaved(cos, scales, args)
        result["scales"] = [scales[n] for n in args.scales]
        result["wall_seconds"] = round(time.monotonic() - started, 1)
        print()
        print(render_table(result))

    def failed(exc: Exception) -> None:
        report_failure(exc, "")
        for co in cos.values():
            d = co.d
            if d.proc is not None and d.proc.poll() is not None:
                print(f"the driver in {d.root} exited (code {d.proc.returncode})", file=sys.stderr)
            print(f"--- driver log tail ({d.root}) ---\n{d.log_tail()}", file=sys.stderr, flush=True)

    cleanup: dict = {}

    def clean_up() -> bool:
        pool.shutdown(wait=True, cancel_futures=True)
        complete = True
        for n, co in cos.items():
            report, done = tear_down(co.d, co, roots[n], args.jobs, loop_nodes[n], args.keep_loop_nodes)
            cleanup[str(n)] = report
            complete = complete and done
        return complete

    status = guarded_run(run, clean_up, failed)
    if args.json and result["scales"]:
        result["retries_total"] = {str(n): co.retries for n, co in cos.items()}
        result["cleanup"] = cleanup
        write_json(args.json, result)
    return status


if __name__ == "__main__":
    sys.exit(main())
