#!/usr/bin/env python3
"""Time per csi-sanity spec: crust against the Go reference driver.

Runs csi-sanity, with the mount-access flags of docs/conformance.md, against
six targets, each started afresh in a temporary root for every run:

    reference  csi-driver-host-path (hostpathplugin), every optional feature on
    driver     crust driver
    shim       crust shim -> crust driver
    proxy      crust proxy -> crust shim -> crust driver
    bare-hop   bare hop -> crust driver
    bare-hops  bare hop -> bare hop -> crust driver

A bare hop is bench/lib/bare_hop.py: a grpc.aio server forwarding every call as
raw bytes and doing nothing else, the least a hop written in Python costs.
The two bare targets put a floor under the shim and proxy targets: what the
same suite costs through one and two hops of grpcio's asyncio stack with
none of crust's code in them.

A round runs the targets in turn (the order rotating from round to round),
all with the same ginkgo seed, hence the same order of specs. From
csi-sanity's JUnit report: the specs run, passed, failed, skipped, pending,
and each spec's time; from /proc/PID/stat, before and after csi-sanity,
the CPU each daemon of the target used (utime + stime of its threads, plus
cutime + cstime of the commands it ran and reaped: mkfs, mount, ...).
Reported: per target, medians over the rounds of the time per run spec and
of each daemon's CPU per suite, each crust target's ratio to the reference
for both; the 10 specs with the largest crust driver minus reference time.
--targets runs some of the targets only.

csi-sanity and hostpathplugin are not part of crust: they are found as the
tests find them (tests/harness/upstream.py: CSI_SANITY and HOSTPATHPLUGIN, else
PATH) unless given. Run from the project root as root (loop devices, mkfs,
mount):

    .venv/bin/python bench/csi/conformance_ratio.py [--rounds 3] [--fs ext4] [--targets T,T] \\
        [--bare-stack aio|sync] [--json OUT]

What a run makes lives below its temporary root and is removed when the
run ends, also on Ctrl-C, SIGTERM or failure: processes stopped, mounts
below the root unmounted, loop devices over files below it detached, the
loop device nodes the run made the kernel create removed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: bench, crust, tests

from bench.lib.benchlib import (  # noqa: E402
    PROJECT,
    TICK,
    close_and_report,
    code_label,
    cpu_sample,
    guarded_run,
    loadavg,
    machine,
    machine_summary,
    not_root,
    others_cores,
    proc_ticks,
    raise_on_signals,
    rotated,
    run_header,
    write_json,
)
from bench.lib.kernel import LoopNodes, loop_names  # noqa: E402
from bench.lib.stack import (  # noqa: E402
    BareHop,
    die_with_parent,
    own_session,
    project_on_pythonpath,
    stop_process,
)
from crust.sys import loop as sysloop  # noqa: E402
from crust.sys import mount as sysmount  # noqa: E402
from tests.harness.csi_sanity import (  # noqa: E402 - the flags, targets and invocation tests/integration/test_conformance.py runs
    DRIVER_FLAGS,
    MUTABLE_YAML,
    REFERENCE_FLAGS,
    SHIM_FLAGS,
    sanity_argv,
    start_target,
)
from tests.harness.daemons import Root  # noqa: E402
from tests.harness.upstream import CSI_SANITY, HOSTPATHPLUGIN, Found, Program, find, usable  # noqa: E402

TARGETS = ("reference", "driver", "shim", "proxy", "bare-hop", "bare-hops")
# Each target's daemons, backend first: the CPU table's columns are the
# driver, the first hop in front of it and the second.
DAEMONS = {"reference": ("reference",), "driver": ("driver",), "shim": ("driver", "shim"),
           "proxy": ("driver", "shim", "proxy"), "bare-hop": ("driver", "bare hop"),
           "bare-hops": ("driver", "bare hop", "bare hop 2")}
BARE_HOPS = {"bare-hop": 1, "bare-hops": 2}
LABELS = {"reference": "csi-driver-host-path (Go reference)", "driver": "crust driver",
          "shim": "crust shim -> crust driver", "proxy": "crust proxy -> crust shim -> crust driver",
          "bare-hop": "bare hop -> crust driver", "bare-hops": "bare hop -> bare hop -> crust driver"}
COUNTS = ("ran", "passed", "failed", "skipped", "pending")


def crust_digest() -> str:
    """A digest of crust/'s sources as they are now: the working tree may be
    edited while the benchmark runs; equal digests mark runs of the same code."""
    digest = hashlib.sha256()
    for path in sorted((PROJECT / "crust").rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def kill_stragglers(root: Path) -> list[int]:
    """Kill what is left of a run that names its root on its command line:
    a daemon's child that deadlocked between fork and exec outlives the
    daemon, holding its descriptors (the root is this run's own mkdtemp)."""
    mark, killed = (str(root) + "/").encode(), []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
        except OSError:
            continue
    return killed


def read_junit(path: Path) -> dict:
    """Counts by status, and the seconds of each spec that ran (passed or failed)."""
    counts: Counter = Counter()
    specs: dict[str, float] = {}
    failed: list[str] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        status, name = case.get("status", ""), case.get("name", "").removeprefix("[It] ")
        counts[status] += 1
        if status in ("passed", "failed"):
            while name in specs:  # never merge two specs that share a name
                name += " #"
            specs[name] = float(case.get("time", "0"))
            failed += [name] if status == "failed" else []
    return {"ran": counts["passed"] + counts["failed"], **{k: counts[k] for k in COUNTS[1:]},
            "failed_specs": failed, "specs": specs}


class Run:
    """One target in one temporary root, and csi-sanity against it."""

    def __init__(self, target: str, args: argparse.Namespace):
        self.target, self.args = target, args
        self.root = Root()
        self.loop_nodes = LoopNodes(self.root.path)
        self.procs: list[subprocess.Popen] = []  # csi-sanity; the harness owns the daemons

    def start(self) -> tuple[Path, list[int]]:
        """The target up; its socket and the daemons' pids (backend first)."""
        crust_target = "driver" if self.target in BARE_HOPS else self.target
        with own_session():  # a Ctrl-C reaches this script only, which then tears down in order
            chain = start_target(self.root, crust_target, hostpath=self.args.hostpath,
                                 crust_extra=("--default-fs-type", self.args.fs))
            for n in range(BARE_HOPS.get(self.target, 0)):
                hop = BareHop(self.root.path / f"bare-hop-{n + 1}.sock", chain[-1].socket, self.args.bare_stack)
                self.root.drivers.append(hop)  # stopped with the daemons below, the front first
                chain.append(hop.start())
        return chain[-1].socket, [d.proc.pid for d in chain]

    def daemon_names(self, pids: list[int]) -> list[str]:
        """Each daemon's name, backend first."""
        return list(DAEMONS[self.target][:len(pids)])

    def sanity(self, seed: int) -> dict:
        """csi-sanity against the target; its report and what the run cost."""
        code = crust_digest()
        socket, pids = self.start()
        path, kube, junit = self.root.path, self.root.path / "kubelet", self.root.path / "junit.xml"
        kube.mkdir(exist_ok=True)
        (path / "mutable.yaml").write_text(MUTABLE_YAML)
        argv = sanity_argv(self.args.csi_sanity, socket, kube, path / "mutable.yaml", "mount",
                           extra=(f"--ginkgo.junit-report={junit}", f"--ginkgo.seed={seed}"))
        # The host's mount table and loop devices, which the drivers' node
        # calls and their tools read, hold everyone's: keep their size.
        walked = {"loadavg_before": loadavg(), "mountinfo_lines": len(sysmount.mounts()),
                  "loop_nodes": len(loop_names()), "loop_devices_attached": len(sysloop.attached())}
        before = cpu_sample(pids)
        before_own = {p: proc_ticks(p) for p in pids}
        started = time.monotonic()
        with open(path / "csi-sanity.log", "ab") as log:
            proc = subprocess.Popen(die_with_parent(argv), stdout=log, stderr=subprocess.STDOUT, cwd=path,
                                    start_new_session=True)
        self.procs.append(proc)
        try:
            proc.wait(self.args.timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"csi-sanity against {LABELS[self.target]} still running after {self.args.timeout:.0f}"
                               f" s (a daemon wedged?): {self.log_tail('csi-sanity.log')}") from None
        wall = time.monotonic() - started
        after = cpu_sample(pids)
        # Per daemon: its own threads (utime + stime) and the commands it
        # ran and reaped meanwhile (cutime + cstime: mkfs, blkid, ...).
        own = {n: (proc_ticks(p) - before_own[p]) / TICK for n, p in zip(self.daemon_names(pids), pids)}
        whole = {n: (after["pids"][p] - before["pids"][p]) / TICK for n, p in zip(self.daemon_names(pids), pids)}
        if not junit.exists():
            raise RuntimeError(f"csi-sanity wrote no report (exit {proc.returncode}): "
                               f"{self.log_tail('csi-sanity.log')}")
        report = read_junit(junit)
        spent = sum(report["specs"].values())
        return {"target": self.target, "crust_digest": code, **{k: v for k, v in report.items() if k != "specs"},
                "sanity_exit": proc.returncode, "ms_per_spec": round(1e3 * spent / max(1, report["ran"]), 2),
                "spec_seconds": round(spent, 3), "sanity_wall_seconds": round(wall, 3),
                "daemons_cpu_seconds": round(sum(after["pids"][p] - before["pids"][p] for p in pids) / TICK, 2),
                "daemon_cpu_seconds": {n: round(v, 2) for n, v in whole.items()},
                "daemon_own_cpu_seconds": {n: round(v, 2) for n, v in own.items()},
                "sanity_cpu_seconds": round((after["own"] - before["own"]) / TICK, 2),
                "other_processes_cpu_cores": others_cores(before, after), **walked,
                "spec_ms": {k: round(v * 1e3, 2) for k, v in report["specs"].items()}}

    def log_tail(self, name: str) -> str:
        log = self.root.path / name
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"

    def close(self) -> bool:
        """Stop csi-sanity and the daemons, release what is below the root; True if nothing is left."""
        for proc in reversed(self.procs):
            stop_process(proc, 20)
        for daemon in reversed(self.root.drivers):
            daemon.stop()
        stragglers = kill_stragglers(self.root.path)
        if stragglers:
            print(f"killed {len(stragglers)} leftover processes of the run: {stragglers}", file=sys.stderr)
        self.loop_nodes.note()
        self.loop_nodes.note_logged(self.root.path / "csi.sock.log")
        complete = close_and_report(self.root, [], self.root.close)
        self.loop_nodes.remove()
        return complete


def summarize(runs: list[dict]) -> dict:
    """Per target: the medians over the rounds and the ratio to the reference;
    the 10 specs with the largest driver minus reference median time."""
    def median(values: list[float]) -> float:
        return round(statistics.median(values), 2)
    by = {t: [r for r in runs if r["target"] == t] for t in TARGETS}
    out: dict = {"targets": {}, "slowest_specs": []}
    for t, rs in ((t, rs) for t, rs in by.items() if rs):
        out["targets"][t] = {**{k: sorted({r[k] for r in rs}) for k in COUNTS},
                             **{k: median([r[k] for r in rs]) for k in ("ms_per_spec", "spec_seconds",
                                "sanity_wall_seconds", "daemons_cpu_seconds", "other_processes_cpu_cores")},
                             "rounds": len(rs)}
    for t, rs in ((t, rs) for t, rs in by.items() if rs):
        row = out["targets"][t]
        for key in ("daemon_cpu_seconds", "daemon_own_cpu_seconds"):
            row[key] = {n: median([r[key][n] for r in rs]) for n in rs[0][key]}
    ref = out["targets"].get("reference")
    for t, row in out["targets"].items():
        if ref and t != "reference":
            row["ratio_to_reference"] = round(row["ms_per_spec"] / ref["ms_per_spec"], 2)
            row["cpu_ratio_to_reference"] = round(row["daemons_cpu_seconds"] / ref["daemons_cpu_seconds"], 2)
    # Per spec, the median over the rounds of the specs every round of a target ran.
    spec_medians = {t: {n: median([r["spec_ms"][n] for r in rs])
                        for n in (set.intersection(*(set(r["spec_ms"]) for r in rs)) if rs else ())}
                    for t, rs in by.items()}
    common = set(spec_medians["driver"]) & set(spec_medians["reference"])
    worst = sorted(common, key=lambda n: spec_medians["driver"][n] - spec_medians["reference"][n], reverse=True)
    for name in worst[:10]:
        out["slowest_specs"].append({"spec": name, **{t: spec_medians[t].get(name) for t in TARGETS},
                                     "driver_minus_reference": round(spec_medians["driver"][name]
                                                                     - spec_medians["reference"][name], 2)})
    out["driver_only_specs"] = sorted(set(spec_medians["driver"]) - set(spec_medians["reference"]))
    return out


def render(summary: dict) -> str:
    lines = [("| target | specs run | passed | failed | skipped | pending | time per run spec, median (ms) "
              "| crust / reference | suite (sum of specs), median (s) | daemons' CPU, median (s) |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t, row in summary["targets"].items():
        counts = ["-".join(map(str, sorted({row[k][0], row[k][-1]}))) for k in COUNTS]
        ratio = f"{row['ratio_to_reference']}x" if "ratio_to_reference" in row else "(base)"
        lines.append(f"| {LABELS[t]} | " + " | ".join(counts) + f" | {row['ms_per_spec']} | {ratio} "
                     f"| {row['spec_seconds']} | {row['daemons_cpu_seconds']} |")
    lines += ["", "| target | daemons' CPU per suite, median (s) | / reference | driver | first hop (shim or bare) "
              "| second hop (proxy or bare) | of which their own threads, backend first |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for t, row in summary["targets"].items():
        ratio = f"{row['cpu_ratio_to_reference']}x" if "cpu_ratio_to_reference" in row else "(base)"
        names = DAEMONS[t] if t != "reference" else ()
        each = [str(row["daemon_cpu_seconds"][names[i]]) if i < len(names) else "-" for i in range(3)]
        own = " / ".join(str(row["daemon_own_cpu_seconds"][n]) for n in DAEMONS[t])
        lines.append(f"| {LABELS[t]} | {row['daemons_cpu_seconds']} | {ratio} | " + " | ".join(each) + f" | {own} |")
    lines += ["", ("| spec (10 largest crust driver minus reference, medians) | reference (ms) | driver | shim "
                   "| proxy | bare hop | bare hops | driver - reference |"), "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary["slowest_specs"]:
        times = " | ".join("-" if s[t] is None else str(s[t]) for t in TARGETS)
        lines.append(f"| {s['spec']} | {times} | {s['driver_minus_reference']} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="conformance_ratio.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--csi-sanity", metavar="PATH", help="the csi-sanity binary (default: $CSI_SANITY, else csi-sanity on $PATH)")
    p.add_argument("--hostpath", metavar="PATH",
                   help="the reference driver's hostpathplugin binary (default: $HOSTPATHPLUGIN, else on $PATH)")
    p.add_argument("--rounds", type=int, default=3, metavar="N", help="runs per target (default 3)")
    p.add_argument("--fs", default="ext4", choices=["ext4", "xfs"],
                   help="crust's file system for mount volumes (csi-sanity names none; default ext4, "
                        "as in docs/conformance.md)")
    p.add_argument("--targets", default=",".join(TARGETS), metavar="T,T",
                   help=f"which targets run (default {','.join(TARGETS)}; ratios need the reference)")
    p.add_argument("--bare-stack", choices=["aio", "sync"], default="aio",
                   help="the grpcio stack of the bare hops (bench/lib/bare_hop.py --stack; default aio)")
    p.add_argument("--timeout", type=float, default=300, metavar="S",
                   help="longest one csi-sanity run may take (default 300)")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write every run's numbers as JSON ('-': stdout)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.targets = [t for t in TARGETS if t in args.targets.split(",")]
    if not args.targets:
        p.error(f"--targets: some of {','.join(TARGETS)}")
    return args


def find_tool(given: str | None, program: Program) -> str | None:
    """given, or the program as the tests find it; None (and why, on
    stderr) if there is none."""
    found = usable(Found(program, path=Path(given)) if given and os.access(given, os.X_OK)
                   else Found(program, unusable=f"{given} is not executable") if given else find(program))
    if found.path is None:
        print(f"conformance_ratio.py: {found.absent or found.unusable}. {program.name} ({program.project}, "
              f"{program.command}) is not part of crust: see docs/conformance.md.", file=sys.stderr)
        return None
    return str(found.path)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.csi_sanity = find_tool(args.csi_sanity, CSI_SANITY)
    args.hostpath = find_tool(args.hostpath, HOSTPATHPLUGIN)
    if args.csi_sanity is None or args.hostpath is None:
        return 2
    if not_root("conformance_ratio.py", "loop devices, mkfs, mount"):
        return 2
    raise_on_signals()
    project_on_pythonpath(os.environ)
    version = subprocess.run([args.hostpath, "-version"], capture_output=True, text=True, check=False).stdout.strip()
    results: dict = {**run_header("conformance_ratio", argv, machine(hostpathplugin=version)),
                     "config": {"rounds": args.rounds, "fs": args.fs, "bare_stack": args.bare_stack,
                                "reference_flags": REFERENCE_FLAGS,
                                "driver_flags": DRIVER_FLAGS, "shim_flags": SHIM_FLAGS,
                                "access_type": "mount"}, "runs": []}
    current: list[Run] = []
    started = time.monotonic()

    def body() -> None:
        print(f"{machine_summary(results['machine'])}; code {code_label(results)}; load {loadavg(True)}", flush=True)
        for rnd in range(args.rounds):
            for target in rotated(args.targets, rnd):
                current.append(Run(target, args))
                run = current[-1].sanity(seed=rnd + 1)
                run["round"] = rnd + 1
                # Closed while still current: if a signal cuts the close
                # short, the final cleanup closes it again.
                if not current[-1].close():
                    raise RuntimeError(f"the cleanup of {target} left something behind")
                finished = current.pop()
                run["unexpected_errors"] = len(finished.root.unexpected)
                results["runs"].append(run)
                counts = ", ".join(f"{k} {run[k]}" for k in COUNTS)
                print(f"round {rnd + 1}/{args.rounds} {LABELS[target]}: {counts}; {run['ms_per_spec']} ms/spec "
                      f"(csi-sanity {run['sanity_wall_seconds']} s); CPU {run['daemon_cpu_seconds']}; "
                      f"load {run['loadavg_before']}; others {run['other_processes_cpu_cores']} cores, "
                      f"{run['mountinfo_lines']} mounts, {run['loop_devices_attached']} loop devices"
                      + (f"; FAILED: {run['failed_specs']}" if run["failed"] else ""), flush=True)
        results["summary"] = summarize(results["runs"])
        results["wall_seconds"] = round(time.monotonic() - started, 1)
        results["loadavg_end"] = loadavg(True)
        digests = sorted({r["crust_digest"] for r in results["runs"]})
        print(f"\n{args.rounds} rounds in {results['wall_seconds']} s, load {results['loadavg_end']} at the end; "
              + ("crust/ unchanged throughout" if len(digests) == 1 else f"crust/ CHANGED during the run: {digests}"))
        print("\n" + render(results["summary"]))

    def cleanup() -> bool:
        return all([run.close() for run in current])  # noqa: C419 - close every run, even after a failed one

    status = guarded_run(body, cleanup)
    if args.json and results["runs"]:
        write_json(args.json, results)
    return status


if __name__ == "__main__":
    sys.exit(main())
