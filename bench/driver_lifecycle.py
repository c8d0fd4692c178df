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
mountinfo, the loop devices and the records all grow). Each scale reports
median and p90 per step; the table shows the scales side by side with the
ratio largest/smallest.

Run from the project root as root (loop devices and mounts):

    .venv/bin/python bench/driver_lifecycle.py [--volumes 30] [--background 10,1000] [--json OUT]

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project root: bench, crust, tests

from bench.benchlib import (  # noqa: E402
    cpu_sample,
    file_text,
    guarded_run,
    iowait_cores,
    machine,
    others_cores,
    raise_on_signals,
    report_failure,
    run_header,
    write_json,
)
from bench.harness_driver import CO, Driver, Volume, tear_down  # noqa: E402
from bench.harness_kernel import LoopNodes, rss_mib, snapshot_env  # noqa: E402

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


def measure_scale(co: CO, pool: ThreadPoolExecutor, background: list[Volume], n: int, args,
                  loop_nodes: LoopNodes) -> dict:
    """Bring the background volumes up to n, then measure args.volumes lifecycles."""
    driver, root = co.d, co.d.root
    t0 = time.monotonic()
    todo = [Volume(f"bg-{i:05d}", "ext4", args.ext4_size * MIB, str(root / "bg" / f"{i:05d}" / "staging"),
                   str(root / "bg" / f"{i:05d}" / "target")) for i in range(len(background), n)]
    background.extend(todo)
    for fut in [pool.submit(co.bring_up, v) for v in todo]:
        fut.result()
    loop_nodes.note()
    built = time.monotonic() - t0
    # Start each measurement from a clean page cache: writeback of what
    # building the background dirtied would otherwise slow every fsync.
    t_sync = time.monotonic()
    os.sync()
    synced = time.monotonic() - t_sync
    env = snapshot_env(root, driver)
    env["sync_seconds_after_build"] = round(synced, 1)
    print(f"\n[{n} background volumes] ready (+{len(todo)} in {built:.1f}s); mountinfo {env['mountinfo_lines']} "
          f"lines, {env['loop_nodes_in_sys_block']} loop nodes; measuring {args.volumes} volumes",
          flush=True)
    ext4 = {s: [] for s in EXT4_STEPS + ["total", "NodeGetCapabilities"]}
    xfs = {s: [] for s in XFS_STEPS}
    t1 = time.monotonic()
    retries0 = dict(co.retries)
    driver_pids = [driver.proc.pid] if driver.proc else []
    cpu0 = cpu_sample(driver_pids)
    for i in range(args.volumes):
        te, tx = measure_one(co, root, f"{n}-{i:03d}", args)
        for k, v in te.items():
            ext4[k].append(v)
        for k, v in tx.items():
            xfs[k].append(v)
        if (i + 1) % 10 == 0:
            print(f"  {i + 1}/{args.volumes} (lifecycle median so far "
                  f"{statistics.median(ext4['total']):.0f} ms)", flush=True)
    loop_nodes.note()
    env["retries_while_measuring"] = {k: v - retries0.get(k, 0) for k, v in co.retries.items()
                                      if v - retries0.get(k, 0)}
    if env["retries_while_measuring"]:
        print(f"  retried (FAILED_PRECONDITION): {env['retries_while_measuring']}; last reason: "
              f"{co.last_retry_reason}", flush=True)
    env["loadavg_after"] = file_text("/proc/loadavg").split(" ")[0]
    if driver.proc is not None:
        env["driver_rss_mib"] = rss_mib(driver.proc.pid)
    cpu1 = cpu_sample(driver_pids)
    env.update({"other_processes_cpu_cores": others_cores(cpu0, cpu1), "iowait_cores": iowait_cores(cpu0, cpu1)})
    return {
        "background": n, "build_seconds": round(built, 1),
        "measure_seconds": round(time.monotonic() - t1, 1), "env": env,
        "steps": {"ext4": {k: summarize(v) for k, v in ext4.items()},
                  "xfs": {k: summarize(v) for k, v in xfs.items()}},
    }


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
    if os.geteuid() != 0:
        print("driver_lifecycle.py needs root (loop devices, mkfs, mount)", file=sys.stderr)
        return 2

    raise_on_signals()

    # Short path: unix socket paths must stay under 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="crust-bench-")).resolve()
    loop_nodes = LoopNodes(root)
    driver = Driver(root)
    co = CO(driver)
    pool = ThreadPoolExecutor(max_workers=max(1, args.jobs))
    result = {
        **run_header("driver_lifecycle", argv, machine(
            loop_max_loop=file_text("/sys/module/loop/parameters/max_loop"))),
        "config": {"volumes_per_scale": args.volumes, "background": args.scales, "ext4_mib": args.ext4_size,
                   "xfs_mib": args.xfs_size, "xfs_grown_mib": args.xfs_size + args.xfs_grow,
                   "access": "mount, SINGLE_NODE_WRITER", "jobs": args.jobs},
        "scales": [],
    }
    started = time.monotonic()

    def run() -> None:
        driver.start()
        print(f"crust driver ({result['code']}) up in {root} ({result['machine']['cpus']} CPUs, "
              f"kernel {result['machine']['kernel']})", flush=True)
        # One warm-up lifecycle (imports, first subprocesses, page cache), not counted.
        measure_one(co, root, "warmup", args)
        background: list[Volume] = []
        for n in args.scales:
            result["scales"].append(measure_scale(co, pool, background, n, args, loop_nodes))
        result["wall_seconds"] = round(time.monotonic() - started, 1)
        print()
        print(render_table(result))

    def failed(exc: Exception) -> None:
        why = ""
        if driver.proc is not None and driver.proc.poll() is not None:
            why = f"the driver exited (code {driver.proc.returncode}); "
        elif driver.proc is not None and not driver.socket.exists():
            why = "the driver's socket disappeared (something removed files under the root?); "
        report_failure(exc, why)
        print(f"--- driver log tail ---\n{driver.log_tail()}", file=sys.stderr, flush=True)

    cleanup: dict = {}

    def clean_up() -> bool:
        pool.shutdown(wait=True, cancel_futures=True)
        report, complete = tear_down(driver, co, root, args.jobs, loop_nodes, args.keep_loop_nodes)
        cleanup.update(report)
        return complete

    status = guarded_run(run, clean_up, failed)
    if args.json and result["scales"]:
        result["retries_total"] = co.retries
        result["cleanup"] = cleanup
        write_json(args.json, result)
    return status


if __name__ == "__main__":
    sys.exit(main())
