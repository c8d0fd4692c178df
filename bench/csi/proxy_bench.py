#!/usr/bin/env python3
"""What `crust proxy` costs, measured side by side in one run.

Parts 1 and 2 use the REAL stack: `crust driver` -> `crust shim` -> `crust
proxy` (tests/harness/daemons.py Root.stack(), unix sockets in a temporary root).
Part 3 uses a FAKE CSI plugin behind the proxy (a small gRPC server that
this script runs in its own process: Identity.GetPluginInfo,
Node.NodeGetCapabilities advertising STAGE_UNSTAGE_VOLUME and DEFER_FS_OPS
7/8/9, NodePublishVolume answering a DeferredMount of /dev/fake,
NodeUnpublishVolume answering OK), so that it measures the proxy's own cost
and not mkfs, loop devices or the shim.

1. Added latency per CSI call: the same RPC sent to the shim directly and
   through the proxy, interleaved (the order alternates every round):
   GetPluginInfo, Probe, ControllerGetCapabilities, ListVolumes, NodeGetInfo,
   NodeGetCapabilities (byte-level passthrough in the proxy), and
   NodeGetVolumeStats of a host-published (not deferred) ext4 volume, which
   the proxy intercepts, checks against its recorded decisions and forwards.
   Median, p90 and the added median. Target: added median under 1 ms.
2. Stats of a deferred volume: RuntimeGetVolumeStats on the proxy's runtime
   socket for (a) a volume claimed by a registered handler (a minimal
   crust.handler.v1.Handler server run by this script, answering fixed
   numbers over its unix socket) and (b) an unclaimed volume whose entry
   directory holds a `runtime-cli` file naming a `#!/bin/sh` printf script
   that prints the same numbers as JSON (the proxy runs it as
   `<cli> crust stats <target>`). Both entries are made with
   RuntimeStageVolume on the runtime socket. Interleaved; medians and the
   ratio. Target: the handler socket at least 10x faster. For scale only,
   (c) the same JSON from a `python -S` script (an interpreter's start-up)
   is measured alongside. The handler runs in its own process, not in
   threads of this script, so it does not share the timing client's GIL.
3. Many deferred volumes (FAKE plugin, see above): one proxy per count in
   --volumes (default 10 and 1000), each filled to its count by deferred
   NodePublishVolume calls (defer_fs_ops=True) on its kubelet-facing CSI
   socket: the proxy records its decision, forwards, stages the entry
   (mountInfo.json, the Kata mirror, its record) and answers. Reported:
   - the fill of the largest proxy, timed per call: at each count N, the
     --batch publishes that brought it to N (at 10: the first 10, at 1000:
     the 991st to the 1000th); and its drain at the end (everything
     unpublished, newest first): the --batch unpublishes starting at N
     (at 1000: the first 10, at 10: the last 10);
   - "churn", interleaved across the proxies: one publish then one
     unpublish of an extra volume on each proxy per round, so the proxies
     holding 10 and 1000 volumes are measured in the same seconds;
   - the CPU time each proxy process used per churn round (what it
     computes, as opposed to what it waits for: fsync, the plugin);
   - the proxy's RSS (VmRSS of /proc/<pid>/status) with the volumes present.
   Every time includes the fake plugin's answer (the same at every count).
   NodeUnpublishVolume is sent without defer_fs_ops, as an unmodified
   kubelet sends it: the proxy finds the deferral in its recorded decision.
   Target directories are made (and written back with sync) before any
   proxy call is timed. Targets: cost at 1000 within 1.5x of the cost at
   10; RSS under 100 MB.

Each part also reports how many cores other processes on the machine kept
busy meanwhile (from /proc/stat, less this script and its daemons), to judge
a run on a shared machine.

Everything lives under one temporary root. On exit, also on Ctrl-C, SIGTERM
or failure, the real volume is unpublished, unstaged and deleted through the
proxy and driver, every process this script started is stopped, any mount
below the root is unmounted and any loop device over a file below it is
detached, and the root is removed. The daemons run in their own session (a
Ctrl-C at the terminal reaches this script only, which then tears down in
order) and get SIGTERM if this script dies.

Run from the project root as root (the real stack makes loop devices and
mounts):

    .venv/bin/python bench/csi/proxy_bench.py [--rounds 300] [--volumes 10,1000] [--churn 200] [--json OUT]

A full run with the defaults takes about half a minute on 2 cores; the JSON
(written only when the run completed) holds every summary and the per-call
samples of the fill and the drain.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: bench, crust, tests

import grpc  # noqa: E402

from bench.lib.benchlib import (  # noqa: E402
    add_parts_option,
    close_and_report,
    code_label,
    cpu_sample,
    file_text,
    guarded_run_then_write,
    machine,
    machine_summary,
    not_root,
    print_log_tails,
    quantiles,
    raise_on_signals,
    report_failure,
    report_targets,
    rotated,
    run_header,
    summary,
    timed,
    with_others_cores,
)
from bench.lib.fakes import ServerProcess, serve  # noqa: E402
from bench.lib.fleet import churn_rounds, drain_all, fill_up, rss_mib, start_fleets  # noqa: E402
from bench.lib.proxy import RealStack, StatsEntries, StatsVolume  # noqa: E402
from bench.lib.stack import project_on_pythonpath  # noqa: E402
from crust.api import csi_pb2  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402

# p50 to max of a set of times, in ms (4 decimals), as this benchmark reports them.
summary_ms = functools.partial(summary, digits=4, names=("p50", "p90", "min", "max"), unit="_ms")


# -- part 1: added latency per CSI call --------------------------------------------------


def part1(shim, proxy, volume: StatsVolume, rounds: int) -> dict:
    """Each RPC sent to the shim directly and through the proxy, interleaved."""
    volume.set_up()
    stats_req = csi_pb2.NodeGetVolumeStatsRequest(volume_id=volume.volume_id, volume_path=str(volume.target))

    probes = {
        "GetPluginInfo": lambda p: p.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=30),
        "Probe": lambda p: p.identity.Probe(csi_pb2.ProbeRequest(), timeout=30),
        "ControllerGetCapabilities": lambda p: p.controller.ControllerGetCapabilities(
            csi_pb2.ControllerGetCapabilitiesRequest(), timeout=30),
        "ListVolumes": lambda p: p.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=30),
        "NodeGetInfo": lambda p: p.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=30),
        "NodeGetCapabilities": lambda p: p.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(),
                                                                    timeout=30),
        "NodeGetVolumeStats (host)": lambda p: p.node.NodeGetVolumeStats(stats_req, timeout=30),
    }
    # The same answer both ways (the stats of the real mounted ext4 file system).
    direct, through = probes["NodeGetVolumeStats (host)"](shim), probes["NodeGetVolumeStats (host)"](proxy)
    if not direct.usage or direct.usage[0].total != through.usage[0].total:
        raise RuntimeError(f"NodeGetVolumeStats differs: direct {direct} / through the proxy {through}")
    os.sync()  # what setting up the volume dirtied is not written back during the measurement
    # Warm both channels and code paths so connection set-up is not measured.
    for call in probes.values():
        for _ in range(20):
            call(shim)
            call(proxy)

    out = {}
    print(f"\n[1] Added latency per CSI call: shim directly vs through the proxy "
          f"({rounds} calls each, interleaved, order alternating)", flush=True)
    print(f"  {'RPC':<27}{'direct p50':>11}{'proxy p50':>11}{'added p50':>11}{'direct p90':>12}{'proxy p90':>11}"
          "   (ms)")
    for name, call in probes.items():
        samples = {"direct": [], "proxy": []}
        for i in range(rounds):
            for path, server in rotated([("direct", shim), ("proxy", proxy)], i):
                samples[path].append(timed(lambda c=call, s=server: c(s)))
        d50, d90 = quantiles(samples["direct"])
        p50, p90 = quantiles(samples["proxy"])
        out[name] = {"direct_p50_ms": d50, "direct_p90_ms": d90, "proxy_p50_ms": p50, "proxy_p90_ms": p90,
                     "added_p50_ms": p50 - d50}
        print(f"  {name:<27}{d50:>11.3f}{p50:>11.3f}{p50 - d50:>11.3f}{d90:>12.3f}{p90:>11.3f}", flush=True)
    return {"rpcs": out, "rounds": rounds}


# -- part 2: stats through the handler socket vs the runtime-cli ----------------------------


def part2(root: Path, proxy, handler: ServerProcess, rounds: int) -> dict:
    """RuntimeGetVolumeStats of a handler's volume and of runtime-cli volumes, interleaved."""
    entries = StatsEntries(root, proxy, handler)
    try:
        entries.stage()
        entries.check_and_warm_up()

        samples: dict[str, list[float]] = {label: [] for label, _, _ in entries.paths}
        for i in range(rounds):
            entries.keep_lease()
            for label, target, _ in rotated(entries.paths, i):
                samples[label].append(timed(lambda t=target: entries.stats(t)))
        (s50, s90), (c50, c90), (p50, p90) = (quantiles(samples[label]) for label, _, _ in entries.paths)
        print(f"\n[2] Stats of a deferred volume: RuntimeGetVolumeStats on the proxy's runtime socket "
              f"({rounds} each, interleaved, order rotating)", flush=True)
        print(f"  (a) claimed by a registered handler (gRPC on its socket)  p50 {s50:8.3f} ms   p90 {s90:8.3f} ms")
        print(f"  (b) unclaimed, runtime-cli: /bin/sh printf script         p50 {c50:8.3f} ms   p90 {c90:8.3f} ms")
        print(f"  (b) / (a)                                                 {c50 / s50:8.1f}x")
        print(f"  for scale only: (c) runtime-cli as a `python -S` script   p50 {p50:8.3f} ms   p90 {p90:8.3f} ms"
              f"   (c) / (a) {p50 / s50:.1f}x", flush=True)
        entries.unstage()
        return {"handler_socket": summary_ms(samples["handler"]), "runtime_cli": summary_ms(samples["runtime-cli sh"]),
                "cli_over_socket": c50 / s50,
                "for_scale_runtime_cli_python_S": summary_ms(samples["runtime-cli python"]),
                "python_cli_over_socket": p50 / s50}
    finally:
        entries.close()


# -- part 3: many deferred volumes (fake plugin) -------------------------------------------


def part3(root: Root, scales: list[int], batch: int, churn: int, warmup: int) -> dict:
    """Deferred publishes and unpublishes on proxies holding few and many volumes."""
    fleets = start_fleets(root, scales, churn, warmup)
    rss_empty = {f.count: rss_mib(f.pid) for f in fleets}

    print(f"\n[3] Deferred volumes, FAKE plugin behind `crust proxy` (the proxy's own cost): filling "
          f"{' and '.join(str(n) for n in scales)} volumes", flush=True)
    fill, fill_seconds = fill_up(fleets)  # the largest proxy's fill gives the ramp
    on_disk = fleets[-1].on_disk()
    churn_pub, churn_unpub, churn_cpu = churn_rounds(fleets, churn)
    rss_full = {f.count: rss_mib(f.pid) for f in fleets}
    drain, drain_seconds = drain_all(fleets)

    # Ramp of the largest proxy at each count: the `batch` publishes that
    # brought it to N (N-batch..N-1 existing), the `batch` unpublishes from N.
    big = fleets[-1].count
    ramp_pub = {n: fill[big][n - batch:n] for n in scales}
    ramp_unpub = {n: drain[big][big - n:big - n + batch] for n in scales}

    lo, hi = scales[0], scales[-1]
    print(f"  fill {sum(scales)} publishes in {fill_seconds:.1f}s, drain in {drain_seconds:.1f}s; at {big} volumes: "
          + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in on_disk.items()))
    print(f"\n  {'per call (ms)':<46}" + "".join(f"{f'at {n}':>18}" for n in scales) + f"{f'{hi}/{lo}':>9}")

    def ratio(by_n: dict[int, list[float]]) -> float:
        return quantiles(by_n[hi])[0] / quantiles(by_n[lo])[0]

    def row(label: str, by_n: dict[int, list[float]]) -> None:
        cells = ""
        for n in scales:
            p50, p90 = quantiles(by_n[n])
            cells += f"{p50:>9.3f} p90 {p90:>5.2f}" if p90 < 100 else f"{p50:>9.3f} p90 {p90:>5.0f}"
        print(f"  {label:<46}{cells}{ratio(by_n):>8.2f}x", flush=True)

    row(f"NodePublishVolume, fill of {big} ({batch} calls)", ramp_pub)
    row(f"NodeUnpublishVolume, drain of {big} ({batch} calls)", ramp_unpub)
    row(f"NodePublishVolume, churn ({churn}, interleaved)", churn_pub)
    row(f"NodeUnpublishVolume, churn ({churn}, interleaved)", churn_unpub)
    print(f"  {'proxy CPU per churn publish+unpublish, ms':<46}" + "".join(f"{churn_cpu[n]:>18.3f}" for n in scales)
          + f"{churn_cpu[hi] / churn_cpu[lo]:>8.2f}x")
    print(f"  {'proxy RSS, MiB, empty after warm-up':<46}" + "".join(f"{rss_empty[n]:>18.1f}" for n in scales))
    print(f"  {'proxy RSS, MiB, with the volumes present':<46}" + "".join(f"{rss_full[n]:>18.1f}" for n in scales)
          + f"   (+{(rss_full[hi] - rss_empty[hi]) * 1024 / max(1, hi):.1f} KiB per volume at {hi})", flush=True)

    return {
        "plugin": "fake (this script, --serve plugin): the proxy's own cost, no mkfs, loop device or shim",
        "scales": scales, "batch": batch, "churn_rounds": churn, "warmup_cycles": warmup,
        "fill_seconds": round(fill_seconds, 2), "drain_seconds": round(drain_seconds, 2),
        "on_disk_at_largest": on_disk,
        "ramp_publish": {str(n): summary_ms(ramp_pub[n]) for n in scales},
        "ramp_unpublish": {str(n): summary_ms(ramp_unpub[n]) for n in scales},
        "churn_publish": {str(n): summary_ms(churn_pub[n]) for n in scales},
        "churn_unpublish": {str(n): summary_ms(churn_unpub[n]) for n in scales},
        "ratios_largest_over_smallest": {"ramp_publish": ratio(ramp_pub), "ramp_unpublish": ratio(ramp_unpub),
                                         "churn_publish": ratio(churn_pub), "churn_unpublish": ratio(churn_unpub)},
        "churn_proxy_cpu_ms_per_round": {str(n): round(v, 3) for n, v in churn_cpu.items()},
        "rss_mib_empty": {str(n): round(v, 1) for n, v in rss_empty.items()},
        "rss_mib_full": {str(n): round(v, 1) for n, v in rss_full.items()},
        "fill_samples_ms": [round(x, 3) for x in fill[big]],
        "drain_samples_ms": [round(x, 3) for x in drain[big]],
    }


# -- output ----------------------------------------------------------------------------------


def verdicts(results: dict) -> list[tuple[str, bool, str]]:
    out = []
    if "part1" in results:
        worst = max(results["part1"]["rpcs"].items(), key=lambda kv: kv[1]["added_p50_ms"])
        out.append(("[1] proxy adds < 1 ms (median) to every CSI call", worst[1]["added_p50_ms"] < 1.0,
                    f"largest added median {worst[1]['added_p50_ms']:.3f} ms ({worst[0]})"))
    if "part2" in results:
        r = results["part2"]["cli_over_socket"]
        out.append(("[2] handler socket >= 10x faster than runtime-cli", r >= 10, f"{r:.1f}x"))
    if "part3" in results:
        p3 = results["part3"]
        hi, lo = p3["scales"][-1], p3["scales"][0]
        batch = p3["batch"]
        for key, label in (("ramp_publish", f"publish (fill, {batch} calls each, not interleaved)"),
                           ("ramp_unpublish", f"unpublish (drain, {batch} calls each, not interleaved)"),
                           ("churn_publish", f"publish (churn, {p3['churn_rounds']} interleaved)"),
                           ("churn_unpublish", f"unpublish (churn, {p3['churn_rounds']} interleaved)")):
            r = p3["ratios_largest_over_smallest"][key]
            out.append((f"[3] {label} at {hi} within 1.5x of at {lo}", r <= 1.5, f"{r:.2f}x"))
        rss = p3["rss_mib_full"][str(hi)]
        out.append((f"[3] proxy RSS with {hi} deferred volumes < 100 MB", rss * 1.048576 < 100,
                    f"{rss:.1f} MiB = {rss * 1.048576:.1f} MB"))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="proxy_bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=300, metavar="N",
                   help="calls per RPC and path in parts 1 and 2 (default 300)")
    p.add_argument("--volumes", default="10,1000", metavar="N,M,...",
                   help="deferred volume counts of part 3, one proxy each (default 10,1000)")
    p.add_argument("--batch", type=int, default=10, metavar="N",
                   help="calls per count taken from the fill/drain of the largest count (default 10)")
    p.add_argument("--churn", type=int, default=200, metavar="N",
                   help="interleaved publish+unpublish rounds on every proxy of part 3 (default 200)")
    p.add_argument("--warmup", type=int, default=20, metavar="N",
                   help="untimed publish+unpublish cycles per proxy of part 3 before it fills (default 20)")
    add_parts_option(p, 3)
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the results as JSON here")
    p.add_argument("--serve", choices=["plugin", "handler"], help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return args
    try:
        args.scales = sorted({int(x) for x in args.volumes.split(",") if x.strip()})
    except ValueError:
        p.error("--volumes takes comma-separated integers, e.g. 10,1000")
    if args.rounds < 1 or args.churn < 1 or args.batch < 1 or args.warmup < 0:
        p.error("--rounds, --churn and --batch must be at least 1, --warmup at least 0")
    if len(args.scales) < 2 or args.scales[0] < args.batch:
        p.error(f"--volumes needs at least two counts, each at least --batch ({args.batch})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args.serve, args.socket)
    if not_root("proxy_bench.py", "the real driver makes loop devices and mounts"):
        return 2

    raise_on_signals()
    project_on_pythonpath(os.environ)

    results: dict = {
        **run_header("proxy_bench", argv, machine(grpc=grpc.__version__)),
        "loadavg_start": file_text("/proc/loadavg"),
        "setup": {"parts 1-2": "real crust driver -> crust shim -> crust proxy (tests/harness/daemons.py Root.stack())",
                  "part 3": "fake CSI plugin (this script) -> crust proxy, to isolate the proxy's own cost"},
    }
    root = Root()
    stack = RealStack(root)
    started = time.monotonic()
    print(f"crust proxy benchmark ({code_label(results)}), root {root.path}\n"
          f"machine: {machine_summary(results['machine'])}, load {results['loadavg_start'].split(' ')[0]}\n"
          "parts 1-2: the real stack (crust driver -> crust shim -> crust proxy); "
          "part 3: a FAKE CSI plugin behind crust proxy, to isolate the proxy's own cost", flush=True)

    def measured(part: str, run) -> None:
        results[part] = with_others_cores(run, lambda: cpu_sample(p.proc.pid for p in root.drivers
                                                                  if p.proc is not None))
        print(f"  (other processes on this machine kept {results[part]['other_processes_cpu_cores']:.2f} of "
              f"{os.cpu_count()} cores busy meanwhile)", flush=True)

    def run() -> None:
        if args.part_set & {1, 2}:
            _, shim, proxy = stack.start()
            if 1 in args.part_set:
                measured("part1", lambda: part1(shim, proxy, stack.volume, args.rounds))
            problems = stack.volume.tear_down()
            if problems:  # the measurements stand; the forced cleanup at the end releases what is left
                print(f"  warning: tearing down the part-1 volume: {problems}", file=sys.stderr, flush=True)
                results["teardown_problems"] = problems
            if 2 in args.part_set:
                handler = stack.start_handler()
                measured("part2", lambda: part2(root.path, proxy, handler, args.rounds))
                handler.stop()
            stack.stop()  # part 3 runs without the real stack
        if 3 in args.part_set:
            measured("part3", lambda: part3(root, args.scales, args.batch, args.churn, args.warmup))
        results["wall_seconds"] = round(time.monotonic() - started, 1)
        results["loadavg_end"] = file_text("/proc/loadavg")
        report_targets(results, verdicts(results), results["loadavg_end"].split(" ")[0], "MET ")

    def failed(exc: Exception) -> None:
        report_failure(exc)
        print_log_tails(root.path, "*.log", "p*/*.log")

    def clean_up() -> bool:
        # Root.close() stops every process (proxies, servers, shim, driver), unmounts, detaches, removes.
        return close_and_report(root, stack.tear_down(), root.close)

    return guarded_run_then_write(run, clean_up, failed, args.json, results)


if __name__ == "__main__":
    sys.exit(main())
