#!/usr/bin/env python3
"""Where crust's daemons spend CPU on served calls: py-spy on each daemon.

Starts a target (`driver`, `shim` -> driver, or `proxy` -> shim -> driver,
as tests/harness/csi_sanity.py starts them for the conformance suite) in a
temporary root, attaches `py-spy record` to every daemon of it, runs a
workload against its front socket, then prints per daemon the functions
holding the most samples, by their own time ("self") and with what they
call ("total"), and the share of the samples in crust's code, in gRPC's
and asyncio's Python, and in the rest.

Workloads:

    sanity   one csi-sanity run (docs/conformance.md's mount-access flags),
             csi-sanity taken from $PATH or --csi-sanity
    hop      --calls passthrough calls (Probe and ListVolumes, alternating),
             one at a time, as bench/csi/hop_cost.py sends them

py-spy is not a dependency of crust: `.venv/bin/pip install py-spy`. It
samples from outside the process (no change to the daemons' code); only
threads running Python are counted (gRPC's C core appears under the
Python frame that called into it). Run from the project root as root:

    .venv/bin/python bench/csi/profile_daemons.py [--target proxy] [--workload sanity] \\
        [--calls 3000] [--rate 250] [--top 25] [--keep DIR]

With --keep DIR, py-spy's raw stacks (one file per daemon, the collapsed
format flame-graph tools read) are kept there. Everything else lives in a
temporary root removed at the end, also on Ctrl-C, SIGTERM or failure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: bench, crust, tests

from bench.lib.benchlib import (  # noqa: E402
    TICK,
    close_and_report,
    cpu_sample,
    guarded_run,
    loadavg,
    machine,
    machine_summary,
    not_root,
    raise_on_signals,
)
from bench.lib.stack import project_on_pythonpath, stop_process  # noqa: E402
from crust.api import csi_pb2  # noqa: E402
from tests.harness.csi_sanity import DRIVER_FLAGS, MUTABLE_YAML, sanity_argv, start_target  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402

DAEMONS = ("driver", "shim", "proxy")
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def where(path: str) -> str:
    """Which code a frame's file belongs to."""
    if "/crust/" in path or path.startswith("crust/"):
        return "crust"
    for part, name in (("grpc", "grpc"), ("asyncio", "asyncio"), ("logging", "logging"),
                       ("google/protobuf", "protobuf"), ("pydantic", "pydantic"), ("prometheus", "prometheus")):
        if part in path:
            return name
    return "other"


def frame_name(frame: str) -> tuple[str, str]:
    """(function (file), the code it belongs to) of a py-spy raw frame, line number dropped."""
    m = FRAME.match(frame)
    if m is None:
        return frame, "other"
    path = m.group("file")
    short = path.split("/site-packages/")[-1].split("/lib/python3")[-1]
    if "/crust/" in short:
        short = "crust/" + short.split("/crust/", 1)[1]
    return f"{m.group('func')} ({short})", where(path)


def digest(raw: Path) -> dict:
    """Samples per function (own and total) and per code, from py-spy's raw output."""
    own: Counter = Counter()
    total: Counter = Counter()
    code: Counter = Counter()
    samples = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";") if f.endswith(")") and " (" in f]
        if not frames:
            continue
        samples += n
        own[frames[-1][0]] += n
        code[frames[-1][1]] += n
        for name in {f[0] for f in frames}:
            total[name] += n
    return {"samples": samples, "own": own, "total": total, "code": code}


def report(name: str, found: dict, cpu_s: float, top: int) -> None:
    samples = max(1, found["samples"])
    shares = ", ".join(f"{k} {100 * v / samples:.0f}%" for k, v in found["code"].most_common())
    print(f"\n== {name}: {cpu_s:.2f} s CPU, {found['samples']} samples; own time by code: {shares}")
    print(f"  {'self %':>7} {'total %':>8}  function")
    for func, n in found["own"].most_common(top):
        print(f"  {100 * n / samples:7.1f} {100 * found['total'][func] / samples:8.1f}  {func}")
    crust_total = [(f, n) for f, n in found["total"].most_common() if "(crust/" in f][:top]
    print("  -- crust's functions by total time (with what they call) --")
    for func, n in crust_total:
        print(f"  {100 * found['own'][func] / samples:7.1f} {100 * n / samples:8.1f}  {func}")


def hop_workload(front, calls: int) -> None:
    probe, listing = csi_pb2.ProbeRequest(), csi_pb2.ListVolumesRequest()
    for i in range(calls):
        if i % 2:
            front.controller.ListVolumes(listing, timeout=30)
        else:
            front.identity.Probe(probe, timeout=30)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="profile_daemons.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="proxy", choices=DAEMONS, help="the front daemon (default proxy)")
    p.add_argument("--workload", default="sanity", choices=("sanity", "hop"), help="what runs (default sanity)")
    p.add_argument("--calls", type=int, default=3000, metavar="N", help="calls of the hop workload (3000)")
    p.add_argument("--rate", type=int, default=250, metavar="HZ", help="py-spy's samples per second (250)")
    p.add_argument("--top", type=int, default=25, metavar="N", help="functions listed per daemon (25)")
    p.add_argument("--csi-sanity", metavar="PATH", help="csi-sanity (default: on $PATH)")
    p.add_argument("--keep", type=Path, metavar="DIR", help="keep py-spy's raw stacks in DIR")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.access(spy, os.X_OK):
        print("profile_daemons.py: py-spy is not installed (.venv/bin/pip install py-spy)", file=sys.stderr)
        return 2
    sanity = args.csi_sanity or shutil.which("csi-sanity")
    if args.workload == "sanity" and not sanity:
        print("profile_daemons.py: no csi-sanity (give --csi-sanity PATH; docs/conformance.md)", file=sys.stderr)
        return 2
    if not_root("profile_daemons.py", "loop devices, mkfs, mount"):
        return 2
    raise_on_signals()
    project_on_pythonpath(os.environ)
    root = Root()
    spies: list[subprocess.Popen] = []

    def body() -> None:
        print(f"{machine_summary(machine())}; load {loadavg(True)}", flush=True)
        chain = start_target(root, args.target, crust_extra=("--default-fs-type", "ext4"))
        names = DAEMONS[:len(chain)]
        pids = {n: d.proc.pid for n, d in zip(names, chain)}
        raws = {n: root.path / f"pyspy-{n}.txt" for n in names}
        for n in names:
            spies.append(subprocess.Popen([spy, "record", "--pid", str(pids[n]), "--rate", str(args.rate),
                                           "--format", "raw", "--output", str(raws[n]), "--nonblocking"],
                                          stdout=subprocess.DEVNULL, stderr=open(root.path / f"pyspy-{n}.log", "ab")))
        time.sleep(1.0)  # py-spy attached
        before = cpu_sample(pids.values())
        started = time.monotonic()
        if args.workload == "sanity":
            kube = root.path / "kubelet"
            kube.mkdir(exist_ok=True)
            (root.path / "mutable.yaml").write_text(MUTABLE_YAML)
            with open(root.path / "csi-sanity.log", "ab") as log:
                subprocess.run(sanity_argv(sanity, chain[-1].socket, kube, root.path / "mutable.yaml"),
                               stdout=log, stderr=subprocess.STDOUT, cwd=root.path, timeout=600, check=False)
        else:
            hop_workload(chain[-1], args.calls)
        wall = time.monotonic() - started
        after = cpu_sample(pids.values())
        for proc in spies:
            proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for proc in spies:
            proc.wait(60)
        print(f"{args.workload} against {args.target}: {wall:.1f} s wall; driver flags {DRIVER_FLAGS}", flush=True)
        for n in names:
            cpu_s = (after["pids"][pids[n]] - before["pids"][pids[n]]) / TICK
            if not raws[n].exists():
                print(f"\n== {n}: py-spy wrote nothing: {(root.path / f'pyspy-{n}.log').read_text()[-500:]}")
                continue
            report(n, digest(raws[n]), cpu_s, args.top)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(raws[n], args.keep / raws[n].name)

    def cleanup() -> bool:
        for proc in spies:
            stop_process(proc, 10)
        return close_and_report(root, [], root.close)

    return guarded_run(body, cleanup)


if __name__ == "__main__":
    sys.exit(main())
