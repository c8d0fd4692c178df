"""What the benchmarks in bench/ share: one copy of each helper.

- the command line: add_parts_option();
- the run's record (machine, commit, accelerator, load; bench/lib/run_record.py,
  whose names the benches take from here): machine(), machine_summary(),
  run_header(), loadavg(), write_json();
- clock ticks, to tell this run's CPU from other people's work on the
  machine: TICK, machine_ticks(), own_ticks(), proc_ticks(), cores(), and
  cpu_sample() with others_cores(), pid_cores(), iowait_cores() between two
  samples, with_others_cores() around a part; cpu_ns(), a process's CPU
  time from its threads' schedstat;
- statistics: pct() (nearest rank), quantiles() (median and p90),
  summary(), timed(), median_ms(), rotated() (the order of interleaved
  calls);
- signals and the run itself: SIGNALS, Interrupted, raise_on_signals(),
  ignore_signals(), guarded_run(), report_failure();
- the end of a run: left_below(), close_and_report(), print_log_tails(),
  report_targets().

Each benchmark keeps what is its own (its tables, its extra machine keys);
this module only holds what behaves the same in all of them. Starting
daemons and the real stack the benchmarks share are in harness_stack.py,
each benchmark's own machinery in its harness_*.py modules. The
benchmarks put the project root on sys.path before importing it (they run
as scripts, `.venv/bin/python bench/NAME.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

# The run's record is its own module (bench/lib/render.py reads it back); the
# benches import all they share from here.
from bench.lib.run_record import (  # noqa: F401
    NOT_RECORDED,
    PROJECT,
    code_label,
    file_text,
    loadavg,
    machine,
    machine_summary,
    portable_command,
    run_header,
    write_json,
)
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount

# -- the command line ----------------------------------------------------------------------


def add_parts_option(parser: argparse.ArgumentParser, count: int, note: str = "") -> None:
    """--parts N,M,...: which of the benchmark's numbered parts run (args.part_set)."""
    allowed = set(range(1, count + 1))
    names = ",".join(map(str, sorted(allowed)))

    def parse(text: str) -> set[int]:
        try:
            chosen = {int(x) for x in text.split(",") if x.strip()}
        except ValueError:
            raise argparse.ArgumentTypeError(f"comma-separated part numbers, e.g. {names}") from None
        if not chosen or not chosen <= allowed:
            raise argparse.ArgumentTypeError(f"a subset of {names}")
        return chosen

    parser.add_argument("--parts", dest="part_set", type=parse, default=allowed, metavar=names,
                        help=f"which parts to run (default {names}{note})")


# -- clock ticks ----------------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """The whole machine's busy and iowait clock ticks since boot (busy: user
    nice system irq softirq steal; neither idle nor iowait)."""
    ticks = [int(x) for x in file_text("/proc/stat").splitlines()[0].split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], ticks[4]


def own_ticks(with_children: bool = True) -> int:
    """This process's CPU in clock ticks (+ the children it reaped)."""
    t = os.times()
    seconds = t.user + t.system + (t.children_user + t.children_system if with_children else 0)
    return round(seconds * TICK)


def proc_ticks(pid: int, with_children: bool = False) -> int:
    """utime + stime (+ cutime + cstime: children it reaped) of one process, 0 if gone."""
    try:
        fields = file_text(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15 if with_children else 13])
    except (IndexError, ValueError):
        return 0


def cpu_ns(pid: int) -> int:
    """CPU time of all threads of pid so far, in ns (0 for a thread gone meanwhile)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = file_text(str(task / "schedstat"))
        total += int(text.split()[0]) if text else 0
    return total


def cores(ticks: float, seconds: float) -> float:
    """Clock ticks used over a span of seconds, as busy cores (2 decimals)."""
    return round(ticks / TICK / max(1e-6, seconds), 2)


def cpu_sample(pids: Iterable[int] = (), children: bool = True,
               strays: Callable[[], Iterable[int]] = tuple) -> dict:
    """One reading of the clock ticks: the machine's busy and iowait ticks,
    this process's ("own"), each of pids' ("pids"), and all of this run's
    ("ours": own, pids, and strays(), further processes of this run that are
    not pids, such as QEMU). With children, this process and pids count the
    children they reaped too; strays never do."""
    busy, iowait = machine_ticks()
    own = own_ticks(with_children=children)
    ticks = {pid: proc_ticks(pid, with_children=children) for pid in pids}
    ours = own + sum(ticks.values()) + sum(proc_ticks(pid) for pid in strays() if pid not in ticks)
    return {"t": time.monotonic(), "busy": busy, "iowait": iowait, "own": own, "ours": ours, "pids": ticks}


def others_cores(a: dict, b: dict) -> float:
    """Cores the rest of the machine (other people's work) kept busy between two samples."""
    return cores(max(0, (b["busy"] - a["busy"]) - (b["ours"] - a["ours"])), b["t"] - a["t"])


def pid_cores(a: dict, b: dict, pid: int) -> float:
    """Cores one of the sampled processes kept busy between two samples."""
    return cores(b["pids"].get(pid, 0) - a["pids"].get(pid, 0), b["t"] - a["t"])


def iowait_cores(a: dict, b: dict) -> float:
    """Cores the machine spent waiting for I/O between two samples."""
    return cores(b["iowait"] - a["iowait"], b["t"] - a["t"])


def with_others_cores(run: Callable[[], dict], sample: Callable[[], dict]) -> dict:
    """run()'s results, with the cores other processes kept busy meanwhile
    ("other_processes_cpu_cores", between a sample() before and one after)."""
    before = sample()
    out = run()
    out["other_processes_cpu_cores"] = others_cores(before, sample())
    return out


# -- the VMs -----------------------------------------------------------------------------------------


def accelerator_of(pid: int) -> str:
    """The accelerator a running QEMU was started with, from its command
    line (as bench/runtime/pod_density.py reads it): "kvm" or "tcg"; NOT_RECORDED
    if the process is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return NOT_RECORDED
    return "kvm" if "-accel kvm" in argv else "tcg"


def accelerator_under(*dirs: Path) -> str:
    """The accelerator of the QEMU processes made under dirs (running now),
    "kvm" or "tcg"; NOT_RECORDED if none runs, "a, b" if they differ."""
    from crust.kata.vmm.qemu import qemu_pids_under

    found = sorted({accelerator_of(pid) for pid in qemu_pids_under(*dirs)} - {NOT_RECORDED})
    return ", ".join(found) or NOT_RECORDED


def accelerator_in_log(log: Path) -> str:
    """The accelerator of the VMs a handler started, from its log (each VM's
    "agent ready ... (pid N, ACCEL)" line), for a bench whose VMs are gone
    before it can read their command lines; NOT_RECORDED if none is logged."""
    found = sorted(set(re.findall(r"\(pid \d+, (kvm|tcg)\)", file_text(str(log)))))
    return ", ".join(found) or NOT_RECORDED


# -- statistics -------------------------------------------------------------------------------------


def pct(ordered: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted samples (the convention of the benches)."""
    return ordered[int(q * (len(ordered) - 1))]


def quantiles(samples: list[float]) -> tuple[float, float]:
    """Median and p90 (nearest rank)."""
    ordered = sorted(samples)
    return statistics.median(ordered), pct(ordered, 0.9)


def ms_rows(samples: dict[str, list[float]]) -> dict[str, dict]:
    """Per name: median, min and max of its samples (ms), and the samples, rounded."""
    return {name: {"median_ms": round(statistics.median(s)), "min_ms": round(min(s)), "max_ms": round(max(s)),
                   "samples_ms": [round(x) for x in s]} for name, s in samples.items()}


def print_ms_rows(rows: dict[str, dict], width: int) -> None:
    """One line per name of ms_rows(): its median, then (min-max)."""
    for name, row in rows.items():
        print(f"  {name:{width}s} {row['median_ms']:6d} ms ({row['min_ms']}-{row['max_ms']})")


def vm_dir_cleanup(base: Path) -> Callable[[], bool]:
    """The cleanup of a bench whose VMs ran below base: base removed; True
    when no QEMU of it is left."""
    def cleanup() -> bool:
        from crust.kata.vmm.qemu import qemu_pids_under  # only the guest benches need it

        shutil.rmtree(base, ignore_errors=True)
        return not qemu_pids_under(base)
    return cleanup


def summary(samples: list[float], digits: int, names: Iterable[str] = ("median", "p90", "min", "max"),
            unit: str = "") -> dict:
    """{"n": how many samples, then each of names (median or p50, p90, p99:
    nearest rank, min, max) with unit after it, rounded to digits}."""
    if not samples:
        return {"n": 0}
    ordered = sorted(samples)
    median = statistics.median(ordered)
    values = {"median": median, "p50": median, "p90": pct(ordered, 0.9), "p99": pct(ordered, 0.99),
              "min": ordered[0], "max": ordered[-1]}
    return {"n": len(ordered), **{name + unit: round(values[name], digits) for name in names}}


def timed(call) -> float:
    """How long call() took, in ms."""
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1e3


def median_ms(call, times: int, digits: int = 3) -> float:
    """The median of `times` timed calls, in ms."""
    return round(statistics.median(timed(call) for _ in range(times)), digits)


def rotated(items: list, turn: int) -> list:
    """items starting at turn (modulo their number): interleaved calls take
    turns at going first, so that none always sees the state another left."""
    k = turn % len(items)
    return items[k:] + items[:k]


def keep_cpus_busy(stack: contextlib.ExitStack, count: int) -> None:
    """count host CPUs kept busy (a process spinning on each) until stack
    closes: the machine as a loaded node has it."""
    for _ in range(count):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        stack.callback(spinner.wait)
        stack.callback(spinner.kill)


# -- signals ----------------------------------------------------------------------------------------

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    """SIGTERM/SIGHUP turned into an exception so that `finally` runs."""


def _raise_interrupted(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def raise_on_signals() -> None:
    """Ctrl-C raises KeyboardInterrupt (even when started with SIGINT
    ignored, as background jobs of a non-interactive shell are), SIGTERM
    and SIGHUP raise Interrupted."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    signal.signal(signal.SIGHUP, _raise_interrupted)


def ignore_signals() -> None:
    """The cleanup must finish: ignore further Ctrl-C/SIGTERM/SIGHUP while it runs."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def report_failure(exc: Exception, cause: str = "") -> None:
    """How a failed benchmark says why (cause: what it found out, before the exception), before its cleanup."""
    print(f"\nbenchmark failed: {cause}{exc!r}", file=sys.stderr, flush=True)


def guarded_run(body: Callable[[], None], cleanup: Callable[[], bool],
                on_failure: Callable[[Exception], None] = report_failure) -> int:
    """body(), then cleanup() whatever happened, with further signals
    ignored; the exit status: 0 if body() returned, 130 if it was
    interrupted, 1 if it failed (after on_failure(exc) said why) or if
    cleanup() returned False (it left something behind)."""
    status = 1
    try:
        body()
        status = 0
    except (KeyboardInterrupt, Interrupted) as exc:
        print(f"\ninterrupted ({str(exc) or 'SIGINT'}); cleaning up", file=sys.stderr, flush=True)
        status = 130
    except Exception as exc:  # noqa: BLE001 - report, then clean up
        on_failure(exc)
        status = 1
    finally:
        ignore_signals()
        if not cleanup():
            status = status or 1
    return status


def guarded_run_then_write(body: Callable[[], None], cleanup: Callable[[], bool],
                           on_failure: Callable[[Exception], None], json_out, results: dict) -> int:
    """guarded_run(), then the results written to json_out (a path, "-" for
    stdout, or None for nowhere) when the run succeeded; its exit status."""
    status = guarded_run(body, cleanup, on_failure)
    if json_out and status == 0:
        write_json(Path(json_out), results)
    return status


def not_root(script: str, why: str) -> bool:
    """True, after saying so on stderr, when this benchmark does not run as root."""
    if os.geteuid() == 0:
        return False
    print(f"{script} needs root ({why})", file=sys.stderr)
    return True


# -- the end of a run -----------------------------------------------------------------------------------


def left_below(prefix: str) -> tuple[list[str], list[str]]:
    """What the cleanup left: the mount points below prefix (a directory
    path ending in "/") and the loop devices over a file below it."""
    mounts = [e.mount_point for e in sysmount.mounts() if (e.mount_point + "/").startswith(prefix)]
    loops = [dev for dev, backing in sysloop.attached().items() if backing.startswith(prefix)]
    return mounts, loops


def close_and_report(root, problems: list[str], close: Callable[[], None]) -> bool:
    """close() a tests/harness/daemons.py Root (its daemons stopped, what is below it
    unmounted and detached, the directory removed), then print the teardown
    errors and what is left below it, on stderr; True if nothing is left."""
    prefix = str(root.path.resolve()) + "/"
    close()
    left_mounts, left_loops = left_below(prefix)
    if problems:
        print(f"cleanup: {len(problems)} teardown errors (forced cleanup followed): {problems[:3]}", file=sys.stderr)
    if left_mounts or left_loops or root.path.exists():
        print(f"cleanup INCOMPLETE: mounts {left_mounts[:5]}, loop devices {left_loops[:5]}, "
              f"root {root.path} {'still there' if root.path.exists() else 'removed'}", file=sys.stderr)
        return False
    return True


def roots_cleanup(roots) -> Callable[[], bool]:
    """A cleanup for guarded_run_then_write: every Root in roots (a list or
    a dict, as it is when the cleanup runs) closed and reported, even after
    one that left something; True if nothing is left."""
    def cleanup() -> bool:
        clean = True
        for root in list(roots.values() if isinstance(roots, dict) else roots):
            clean = close_and_report(root, [], root.close) and clean
        return clean
    return cleanup


def print_log_tails(base: Path, *patterns: str) -> None:
    """The last 1500 characters of every log matching patterns below base, on stderr."""
    for pattern in patterns:
        for log in sorted(base.glob(pattern)):
            print(f"--- {log.relative_to(base)} (tail) ---\n{log.read_text(errors='replace')[-1500:]}",
                  file=sys.stderr)


def report_targets(results: dict, verdicts: list[tuple[str, bool, str]], load: str, met: str) -> None:
    """Keep the verdicts (target, met or not, value) as results["targets"]
    and print them under the run's wall time and the load at its end; met
    is how a met target is marked (each benchmark pads it its own way)."""
    results["targets"] = [{"target": t, "met": ok, "value": v} for t, ok, v in verdicts]
    print(f"\nTargets ({results['wall_seconds']:.0f}s run, load {load} at the end):")
    for target in results["targets"]:
        print(f"  {met if target['met'] else 'MISSED'}  {target['target']}: {target['value']}")


def print_rows(rows: dict[str, dict], indent: str = "") -> None:
    """One line per row of summary() values: its name, then `key value` pairs."""
    width = max(map(len, rows), default=0) + 2
    for name, row in rows.items():
        print(f"{indent}{name:<{width}}" + "  ".join(f"{k} {v}" for k, v in row.items() if k != "n"))
