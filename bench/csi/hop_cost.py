#!/usr/bin/env python3
"""What each gRPC hop of the node chain costs: driver directly, through the
shim, through the proxy and the shim. One command, every variant side by side.

A variant is a whole real chain, `crust driver` -> `crust shim` -> `crust
proxy` (tests/harness/daemons.py Root.stack(), each in its own temporary root):

- `current`: this checkout's daemons, as they run anywhere;
- `baseline` (with --baseline DIR): the daemons of another checkout of
  crust, e.g. `git worktree add ../crust-before <commit>`, run from that
  directory with this virtual environment;
- `uvloop` (with --uvloop, if uvloop is installed): this checkout's daemons
  with uvloop's event loop policy installed before crust starts. For
  measurement only: crust does not run on uvloop (docs/performance.md, "What each
  hop costs", says why).

And with --bare, the floor under the shim's and the proxy's hops:

- `bare`: this checkout's `crust driver`, bench/lib/bare_hop.py in front of it
  and a second bare_hop.py in front of that one (grpc.aio servers that
  forward every unary call as raw bytes and do nothing else). Its doors
  keep the names of the real chain's, so that the rows line up: "driver"
  is the driver, "shim" the first bare hop, "proxy" the second. A bare hop
  keeps no answer and intercepts nothing: every RPC below is forwarded by
  both, so the hop costs of the RPCs the real hops keep or intercept show
  what that saves or costs against a plain forward. It publishes no volume
  (it has no proxy to publish through): ControllerGetVolume and
  ValidateVolumeCapabilities go to a volume it creates on its driver
  (created only, deleted at the end), NodeGetVolumeStats is not measured
  ('-').

1. Latency. Each RPC is sent to the driver, to the shim and to the proxy of
   every variant, --rounds times, interleaved (the order of the variants and
   of the three doors rotates every round, so all see the same machine).
   Passthrough RPCs (forwarded byte for byte by the shim and the proxy):
   Probe, ListVolumes, ControllerGetVolume; GetPluginInfo,
   ControllerGetCapabilities and NodeGetInfo are forwarded once, then
   answered by each hop from the backend's last answer (docs/csi-shim.md,
   "The plugin's own answers"). Intercepted ones: NodeGetCapabilities
   (answered by the shim, passed through by the proxy),
   ValidateVolumeCapabilities (parsed, translated to block and forwarded by
   the shim, passed through by the proxy) and NodeGetVolumeStats of an ext4
   volume published on the host through the proxy (checked against the
   proxy's decisions, answered by the shim from the mounted file system;
   the driver never saw that path, so it has no direct column).
   Reported per variant and RPC: median of each door, and the hop costs:
   shim - driver and proxy - shim (for `bare`: bare hop 1 - driver and
   bare hop 2 - bare hop 1).
2. CPU per forwarded call: blocks of Probe calls to each door of
   each variant (the blocks rotate), and the CPU time every daemon of the
   variant used meanwhile (all its threads, from /proc/PID/task/*/schedstat),
   divided by the calls.

Run from the project root as root (the stats volume is a real loop device
and mount):

    .venv/bin/python bench/csi/hop_cost.py [--rounds 500] [--cpu-calls 2000] \\
        [--baseline DIR] [--uvloop] [--bare] [--json OUT]

Everything lives under temporary roots removed at the end, also on Ctrl-C,
SIGTERM or failure (the volume unpublished, unstaged and deleted, the
daemons and bare hops stopped, leftovers unmounted and detached).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: bench, crust, tests

import grpc  # noqa: E402

from bench.lib.benchlib import (  # noqa: E402
    PROJECT,
    close_and_report,
    code_label,
    cpu_ns,
    cpu_sample,
    file_text,
    guarded_run_then_write,
    loadavg,
    machine,
    machine_summary,
    not_root,
    others_cores,
    print_log_tails,
    quantiles,
    raise_on_signals,
    rotated,
    run_header,
    timed,
)
from bench.lib.proxy import CreatedVolume, StatsVolume  # noqa: E402
from bench.lib.stack import BareHop, die_with_parent  # noqa: E402
from crust.api import csi_pb2  # noqa: E402
from tests.harness.daemons import Root, mount_cap  # noqa: E402

DOORS = ("driver", "shim", "proxy")
# `python -m crust ARGS`, with uvloop's loop under every asyncio.run().
UVLOOP_LAUNCH = ("import asyncio, runpy, uvloop; asyncio.set_event_loop_policy(uvloop.EventLoopPolicy()); "
                 "runpy.run_module('crust', run_name='__main__', alter_sys=True)")


@contextmanager
def daemons_from(code: Path, env: dict, uvloop: bool = False):
    """Daemons that tests/harness/daemons.py starts meanwhile import crust from
    `code` (it is their working directory, first on sys.path of `python -m
    crust`) with `env`, in their own session, ending if this script dies;
    with uvloop, on uvloop's event loop."""
    original = subprocess.Popen

    def popen(argv, *args, **kw):
        if uvloop and list(argv[1:3]) == ["-m", "crust"]:
            argv = [argv[0], "-c", UVLOOP_LAUNCH, *argv[3:]]
        kw.setdefault("cwd", str(code))
        kw.setdefault("env", env)
        kw.setdefault("start_new_session", True)
        return original(die_with_parent(argv), *args, **kw)

    subprocess.Popen = popen
    try:
        yield
    finally:
        subprocess.Popen = original


def event_loop_of(pid: int) -> str:
    """Which event loop a daemon runs, from the libraries it mapped."""
    return "uvloop" if "/uvloop/" in file_text(f"/proc/{pid}/maps") else "asyncio"


class Variant:
    """One real chain of daemons, from a checkout and an environment."""

    def __init__(self, name: str, code: Path, env: dict, uvloop: bool = False):
        self.name, self.code, self.env, self.uvloop = name, code, env, uvloop
        self.root = Root()
        self.doors: dict = {}
        self.volume: StatsVolume | None = None
        self.loops: dict[str, str] = {}

    def start(self) -> None:
        with daemons_from(self.code, self.env, self.uvloop):
            driver, shim, proxy = self.root.stack()
        self.doors = {"driver": driver, "shim": shim, "proxy": proxy}
        self.loops = {door: event_loop_of(p.proc.pid) for door, p in self.doors.items()}
        self.volume = StatsVolume(driver, proxy)
        self.volume.set_up()

    def pids(self) -> list[int]:
        return [p.proc.pid for p in self.doors.values() if p.proc is not None]

    def close(self) -> bool:
        problems = self.volume.tear_down() if self.volume is not None else []
        return close_and_report(self.root, problems, self.root.close)


class BareVariant(Variant):
    """`crust driver` <- bare hop 1 (door "shim") <- bare hop 2 (door
    "proxy"): the least two Python gRPC hops cost, side by side with the
    real chain."""

    DOORS_ARE = {"driver": "crust driver", "shim": "bare_hop.py in front of the driver",
                 "proxy": "bare_hop.py in front of the first bare hop"}

    def start(self) -> None:
        with daemons_from(self.code, self.env):
            driver = self.root.driver().start()
            # In the root's list, so that Root.close() stops them (SIGTERM,
            # then SIGKILL), the outer one first, whatever failed meanwhile.
            first = BareHop(self.root.path / "hop1.sock", driver.socket)
            self.root.drivers.append(first)
            first.start()
            second = BareHop(self.root.path / "hop2.sock", first.socket)
            self.root.drivers.append(second)
            second.start()
        self.doors = {"driver": driver, "shim": first, "proxy": second}
        self.loops = {door: event_loop_of(p.proc.pid) for door, p in self.doors.items()}
        self.volume = CreatedVolume(driver)
        self.volume.set_up()


def probes(variant: Variant) -> dict:
    """name -> (kind, call(door process)) for part 1; the call returns None
    when a door cannot take it, and is None when no door of the variant can
    (NodeGetVolumeStats of the bare variant: no volume published)."""
    volume = variant.volume
    stats = csi_pb2.NodeGetVolumeStatsRequest(volume_id=volume.volume_id, volume_path=str(volume.target))
    validate = csi_pb2.ValidateVolumeCapabilitiesRequest(volume_id=volume.volume_id,
                                                         volume_capabilities=[mount_cap("ext4")])
    return {
        "GetPluginInfo": ("kept by the hops", lambda p: p.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(),
                                                                            timeout=30)),
        "Probe": ("passthrough", lambda p: p.identity.Probe(csi_pb2.ProbeRequest(), timeout=30)),
        "ControllerGetCapabilities": ("kept by the hops", lambda p: p.controller.ControllerGetCapabilities(
            csi_pb2.ControllerGetCapabilitiesRequest(), timeout=30)),
        "ListVolumes": ("passthrough", lambda p: p.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=30)),
        "ControllerGetVolume": ("passthrough", lambda p: p.controller.ControllerGetVolume(
            csi_pb2.ControllerGetVolumeRequest(volume_id=volume.volume_id), timeout=30)),
        "NodeGetInfo": ("kept by the hops", lambda p: p.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=30)),
        "NodeGetCapabilities": ("answered by the shim", lambda p: p.node.NodeGetCapabilities(
            csi_pb2.NodeGetCapabilitiesRequest(), timeout=30)),
        "ValidateVolumeCapabilities": ("translated by the shim", lambda p: p.controller.ValidateVolumeCapabilities(
            validate, timeout=30)),
        "NodeGetVolumeStats": ("intercepted by both", None if volume.target is None else
                               lambda p: None if p is variant.doors["driver"]
                               else p.node.NodeGetVolumeStats(stats, timeout=30)),
    }


def part1(variants: list[Variant], rounds: int) -> dict:
    calls = {v.name: probes(v) for v in variants}
    names = list(calls[variants[0].name])
    # Warm every channel and code path: connection set-up is not measured.
    for v in variants:
        for _, call in calls[v.name].values():
            for _ in range(30 if call is not None else 0):
                for door in v.doors.values():
                    call(door)
    os.sync()
    out: dict = {}
    print(f"\n[1] Latency, median ms ({rounds} calls per RPC, door and variant, interleaved)", flush=True)
    print(f"  {'RPC':<28}{'variant':<10}{'driver':>8}{'shim':>8}{'proxy':>8}{'shim hop':>10}{'proxy hop':>10}"
          f"{'proxy p90':>10}")
    for name in names:
        samples = {v.name: {door: [] for door in DOORS} for v in variants}
        for i in range(rounds):
            for v in rotated(variants, i):
                call = calls[v.name][name][1]
                for door in rotated(list(DOORS), i) if call is not None else ():
                    process = v.doors[door]
                    if door == "driver" and name == "NodeGetVolumeStats":
                        continue
                    samples[v.name][door].append(timed(lambda c=call, p=process: c(p)))
        out[name] = {"kind": calls[variants[0].name][name][0]}
        for v in variants:
            label = name if v is variants[0] else ""
            if calls[v.name][name][1] is None:
                out[name][v.name] = {"not_measured": "no volume published (no proxy to publish through)"}
                print(f"  {label:<28}{v.name:<10}" + f"{'-':>8}" * 3 + f"{'-':>10}" * 3, flush=True)
                continue
            row = {}
            for door in DOORS:
                if samples[v.name][door]:
                    row[f"{door}_p50_ms"], row[f"{door}_p90_ms"] = (round(x, 4) for x in
                                                                    quantiles(samples[v.name][door]))
            if "driver_p50_ms" in row:
                row["shim_hop_ms"] = round(row["shim_p50_ms"] - row["driver_p50_ms"], 4)
            row["proxy_hop_ms"] = round(row["proxy_p50_ms"] - row["shim_p50_ms"], 4)
            out[name][v.name] = row
            cells = "".join(f"{row[f'{d}_p50_ms']:>8.3f}" if f"{d}_p50_ms" in row else f"{'-':>8}" for d in DOORS)
            hop = f"{row['shim_hop_ms']:>10.3f}" if "shim_hop_ms" in row else f"{'-':>10}"
            print(f"  {label:<28}{v.name:<10}{cells}{hop}{row['proxy_hop_ms']:>10.3f}{row['proxy_p90_ms']:>10.3f}",
                  flush=True)
    return out


def part2(variants: list[Variant], calls: int, blocks: int = 10) -> dict:
    """CPU ms per Probe of every daemon, by door and variant (Probe: the
    shim and the proxy forward it every time; they answer GetPluginInfo
    from the backend's last answer, docs/csi-shim.md)."""
    per_block = max(1, calls // blocks)
    used = {v.name: {door: {d: 0 for d in DOORS} for door in DOORS} for v in variants}
    made = {v.name: {door: 0 for door in DOORS} for v in variants}
    request = csi_pb2.ProbeRequest()
    for b in range(blocks):
        for v in rotated(variants, b):
            for door in rotated(list(DOORS), b):
                process = v.doors[door]
                before = {d: cpu_ns(v.doors[d].proc.pid) for d in DOORS}
                for _ in range(per_block):
                    process.identity.Probe(request, timeout=30)
                after = {d: cpu_ns(v.doors[d].proc.pid) for d in DOORS}
                for d in DOORS:
                    used[v.name][door][d] += after[d] - before[d]
                made[v.name][door] += per_block
    out: dict = {}
    print(f"\n[2] CPU per Probe, ms, every thread of each daemon ({per_block * blocks} calls per door "
          f"and variant, in {blocks} rotating blocks)", flush=True)
    print(f"  {'variant':<10}{'door':<8}" + "".join(f"{d:>9}" for d in DOORS) + f"{'chain':>9}")
    for v in variants:
        out[v.name] = {}
        for door in DOORS:
            row = {d: round(used[v.name][door][d] / made[v.name][door] / 1e6, 4) for d in DOORS}
            row["chain"] = round(sum(row.values()), 4)
            out[v.name][door] = row
            print(f"  {v.name:<10}{door:<8}" + "".join(f"{row[d]:>9.3f}" for d in (*DOORS, "chain")), flush=True)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hop_cost.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=500, metavar="N", help="calls per RPC, door and variant (500)")
    p.add_argument("--cpu-calls", type=int, default=2000, metavar="N",
                   help="Probe calls per door and variant in part 2 (2000; 0 skips part 2)")
    p.add_argument("--uvloop", action="store_true",
                   help="also run this checkout's daemons on uvloop's event loop (measurement only)")
    p.add_argument("--baseline", type=Path, metavar="DIR",
                   help="also run the daemons of the crust checkout in DIR (e.g. a git worktree of an "
                        "earlier commit)")
    p.add_argument("--bare", action="store_true",
                   help="also run the bare variant: crust driver behind two bench/lib/bare_hop.py hops (doors "
                        "shim and proxy), the least two Python gRPC hops cost")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.uvloop:
        try:
            import uvloop  # noqa: F401
        except ImportError:
            p.error("--uvloop: uvloop is not installed (.venv/bin/pip install uvloop)")
    if args.baseline is not None and not (args.baseline / "crust" / "__main__.py").exists():
        p.error(f"--baseline {args.baseline}: no crust checkout there")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not_root("hop_cost.py", "its stats volume is a loop device and a mount"):
        return 2
    raise_on_signals()
    results: dict = {**run_header("hop_cost", argv, machine(grpc=grpc.__version__)), "load_start": loadavg()}
    variants = []
    if args.baseline is not None:
        code = args.baseline.resolve()
        variants.append(Variant("baseline", code, {**os.environ, "PYTHONPATH": str(code)}))
    current = {**os.environ, "PYTHONPATH": str(PROJECT)}
    variants.append(Variant("current", PROJECT, current))
    if args.uvloop:
        variants.append(Variant("uvloop", PROJECT, current, uvloop=True))
    if args.bare:
        variants.append(BareVariant("bare", PROJECT, current))
    print(f"crust hop cost ({code_label(results)})\nmachine: {machine_summary(results['machine'])}, "
          f"load {results['load_start']}", flush=True)
    started = time.monotonic()

    def run() -> None:
        for v in variants:
            v.start()
            # The checkout by its role, not its path (a result names nothing of the machine).
            code = "this checkout" if v.code == PROJECT else f"baseline checkout {v.code.name}"
            results.setdefault("variants", {})[v.name] = {"code": code, "event_loops": v.loops}
            print(f"  {v.name:<10} {v.code}: event loop {', '.join(f'{d} {l}' for d, l in v.loops.items())}",
                  flush=True)
            if isinstance(v, BareVariant):
                results["variants"][v.name]["doors"] = v.DOORS_ARE
                print(f"  {'':<10} doors: " + "; ".join(f"{d} = {what}" for d, what in v.DOORS_ARE.items())
                      + " (every RPC forwarded by both hops)", flush=True)
        pids = [pid for v in variants for pid in v.pids()]
        before = cpu_sample(pids)
        results["part1"] = part1(variants, args.rounds)
        if args.cpu_calls > 0:
            results["part2"] = part2(variants, args.cpu_calls)
        results["other_processes_cpu_cores"] = others_cores(before, cpu_sample(pids))
        results["wall_seconds"] = round(time.monotonic() - started, 1)
        results["load_end"] = loadavg()
        print(f"\n{results['wall_seconds']:.0f}s; other processes kept {results['other_processes_cpu_cores']:.2f} "
              f"of {os.cpu_count()} cores busy meanwhile; load {results['load_end']} at the end", flush=True)

    def failed(exc: Exception) -> None:
        print(f"\nbenchmark failed: {exc!r}", file=sys.stderr, flush=True)
        for v in variants:
            print_log_tails(v.root.path, "*.log")

    def clean_up() -> bool:
        closed = [v.close() for v in variants]  # every one, even after a failure
        return all(closed)

    return guarded_run_then_write(run, clean_up, failed, args.json, results)


if __name__ == "__main__":
    sys.exit(main())
