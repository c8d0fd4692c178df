"""What the benchmarks in bench/ share: one copy of each helper.

- the command line: add_parts_option();
- the run's description: machine(), code_version(), run_header(), loadavg();
- clock ticks, to tell this run's CPU from other people's work on the
  machine: TICK, machine_ticks(), own_ticks(), proc_ticks(), cores();
- statistics: pct() (nearest rank), quantiles() (median and p90), timed();
- daemons: die_with_parent(), own_session(), stop_process(), and
  project_on_pythonpath() so that they import crust from this checkout;
- signals: Interrupted, raise_on_signals(), ignore_signals();
- the volume and sandbox steps the real-stack benchmarks repeat: attempt(),
  retry_failed_precondition(), write_bundle();
- the end of a run: left_below(), report_leftovers(), print_log_tails(),
  write_json().

Each benchmark keeps what is its own (its summaries, its CPU accounting, its
extra machine keys); this module only holds what behaves the same in all of
them. The benchmarks put the project root on sys.path before importing it
(they run as scripts, `.venv/bin/python bench/NAME.py`).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import grpc

from crust.sys import loop as sysloop
from crust.sys import mount as sysmount

PROJECT = Path(__file__).resolve().parent.parent

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


# -- the run ----------------------------------------------------------------------------------


def file_text(path: str) -> str:
    """A file's text, stripped; "" if it cannot be read."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def machine(**extra) -> dict:
    """CPUs, CPU model, memory, kernel and Python, then what the benchmark adds."""
    cpu = next((line.split(":", 1)[1].strip() for line in file_text("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), "")
    mem = next((f"{int(line.split()[1]) / 1024**2:.1f} GiB" for line in file_text("/proc/meminfo").splitlines()
                if line.startswith("MemTotal")), "")
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "memory": mem, "kernel": platform.release(),
            "python": platform.python_version(), **extra}


def code_version() -> str:
    """HEAD and whether crust/ differs from it (read-only git; no index refresh)."""
    try:
        head = subprocess.run(["git", "--no-optional-locks", "-C", str(PROJECT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "--no-optional-locks", "-C", str(PROJECT), "status", "--porcelain",
                                "--", "crust"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not head:
        return "unknown"
    return head + (f" + uncommitted changes in {len(dirty)} crust/ files" if dirty else "")


def run_header(benchmark: str, argv: list[str] | None, machine_info: dict) -> dict:
    """The first keys of a benchmark's results: its name, the command line
    (argv None: this process's), the date (UTC), the machine and the code."""
    return {
        "benchmark": benchmark,
        "command": " ".join([f"bench/{benchmark}.py"] + (sys.argv[1:] if argv is None else list(argv))),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info,
        "code": code_version(),
    }


def loadavg(pressure: bool = False) -> str:
    """The 1, 5 and 15 minute load averages; with pressure, also the
    kernel's CPU and I/O pressure (share of the last 10 s in which some task
    waited for a CPU / for I/O), when available."""
    text = " ".join(file_text("/proc/loadavg").split()[:3])
    if pressure:
        for kind in ("cpu", "io"):
            line = file_text(f"/proc/pressure/{kind}").splitlines()[:1]
            if line and "avg10=" in line[0]:
                text += f", {kind} pressure {line[0].split('avg10=')[1].split()[0]}%"
    return text


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


def cores(ticks: float, seconds: float) -> float:
    """Clock ticks used over a span of seconds, as busy cores (2 decimals)."""
    return round(ticks / TICK / max(1e-6, seconds), 2)


# -- statistics -------------------------------------------------------------------------------------


def pct(ordered: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted samples (the convention of the benches)."""
    return ordered[int(q * (len(ordered) - 1))]


def quantiles(samples: list[float]) -> tuple[float, float]:
    """Median and p90 (nearest rank)."""
    ordered = sorted(samples)
    return statistics.median(ordered), pct(ordered, 0.9)


def timed(call) -> float:
    """How long call() took, in ms."""
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1e3


# -- daemons ----------------------------------------------------------------------------------------


def die_with_parent() -> None:
    """preexec_fn of a daemon started in its own session (a Ctrl-C at the
    terminal must not stop it before the orderly teardown): it gets SIGTERM
    if the benchmark is killed."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort
        pass


@contextmanager
def own_session():
    """Make the daemons tests/harness.py starts run in their own session
    (a Ctrl-C at the terminal reaches the benchmark only, which then tears
    down in order) and end if the benchmark is killed. The harness calls
    subprocess.Popen; it is wrapped only while the daemons start."""
    original = subprocess.Popen

    def popen(*args, **kw):
        kw.setdefault("start_new_session", True)
        kw.setdefault("preexec_fn", die_with_parent)
        return original(*args, **kw)

    subprocess.Popen = popen
    try:
        yield
    finally:
        subprocess.Popen = original


def stop_process(proc: subprocess.Popen | None, timeout: float) -> None:
    """SIGTERM, and SIGKILL if it has not ended within timeout seconds (None: nothing to stop)."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def project_on_pythonpath(env) -> None:
    """Put this checkout first on env's PYTHONPATH (os.environ or a copy):
    the daemons import crust from it."""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT), env.get("PYTHONPATH", "")]))


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


# -- volume and sandbox steps ---------------------------------------------------------------------------


def attempt(problems: list[str], what: str, call) -> bool:
    """call(); on failure add "what: why" to problems and go on (False)."""
    try:
        call()
        return True
    except Exception as exc:  # noqa: BLE001 - go on with the rest
        problems.append(f"{what}: {exc.details() if isinstance(exc, grpc.RpcError) else exc}")
        return False


def retry_failed_precondition(call, patience: float = 15.0):
    """call() (a DeleteVolume), retried every 0.5 s for up to patience
    seconds while it fails with FAILED_PRECONDITION: the driver still sees
    the volume's loop device attached (`losetup --detach` of a device that
    something else still holds, a mount in another mount namespace or udev
    probing it, only marks it for autoclear)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def write_bundle(bundle: Path, target: Path, seconds: int) -> None:
    """An OCI bundle: an empty rootfs, process `sleep SECONDS`, the volume's
    CSI target path bind-mounted at /data."""
    (bundle / "rootfs").mkdir(parents=True, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "root": {"path": "rootfs"},
        "process": {"args": ["sleep", str(seconds)], "env": ["PATH=/usr/bin:/bin"], "cwd": "/"},
        "mounts": [{"destination": "/data", "source": str(target), "type": "bind", "options": ["rbind"]}],
    }))


# -- the end of a run -----------------------------------------------------------------------------------


def left_below(prefix: str) -> tuple[list[str], list[str]]:
    """What the cleanup left: the mount points below prefix (a directory
    path ending in "/") and the loop devices over a file below it."""
    mounts = [e.mount_point for e in sysmount.mounts() if (e.mount_point + "/").startswith(prefix)]
    loops = [dev for dev, backing in sysloop.attached().items() if backing.startswith(prefix)]
    return mounts, loops


def report_leftovers(prefix: str, root: Path, problems: list[str]) -> bool:
    """After the forced cleanup of a root: print the teardown errors and what
    is left below prefix (the resolved root with a "/"), on stderr; True if
    the cleanup is incomplete."""
    left_mounts, left_loops = left_below(prefix)
    if problems:
        print(f"cleanup: {len(problems)} teardown errors (forced cleanup followed): {problems[:3]}", file=sys.stderr)
    if left_mounts or left_loops or root.exists():
        print(f"cleanup INCOMPLETE: mounts {left_mounts[:5]}, loop devices {left_loops[:5]}, "
              f"root {root} {'still there' if root.exists() else 'removed'}", file=sys.stderr)
        return True
    return False


def print_log_tails(base: Path, *patterns: str) -> None:
    """The last 1500 characters of every log matching patterns below base, on stderr."""
    for pattern in patterns:
        for log in sorted(base.glob(pattern)):
            print(f"--- {log.relative_to(base)} (tail) ---\n{log.read_text(errors='replace')[-1500:]}",
                  file=sys.stderr)


def write_json(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
