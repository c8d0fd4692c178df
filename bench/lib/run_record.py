"""What every result file in bench/results/ records of its run, and how it
is read back.

A bench's results start with run_header(): the benchmark's name, the
command that reproduces it, the date, the machine, the commit (and whether
the work tree differed from it), the accelerator its VMs ran under ("none"
for a bench that starts no VM) and the load before the run; write_json()
adds the load after it. describe() reads these back, also from the older
files that named them differently or lacked them (bench/lib/render.py, the
tables of docs/performance.md).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
NOT_RECORDED = "not recorded"
NO_VM = "none (no VM)"


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


def machine_summary(info: dict) -> str:
    """How the benchmarks' first lines name the machine machine() described."""
    return (f"{info['cpus']} CPUs {info['cpu_model']}, {info['memory']}, kernel {info['kernel']}, "
            f"Python {info['python']}")


def _git(*args: str) -> str:
    # --no-optional-locks: a bench must not refresh the index of a tree
    # someone is working in.
    return subprocess.run(["git", "--no-optional-locks", "-C", str(PROJECT), *args],
                          capture_output=True, text=True, timeout=10).stdout


def commit_fields() -> dict:
    """{"commit": HEAD's full hash, "dirty": whether tracked files differ
    from it, "dirty_paths": the first 20 of them}; "unknown" outside git.
    Untracked files do not count: a run's own logs and results are some."""
    try:
        head = _git("rev-parse", "HEAD").strip()
        changed = _git("status", "--porcelain", "--untracked-files=no").splitlines()
    except (OSError, subprocess.SubprocessError):
        head, changed = "", []
    if not head:
        return {"commit": "unknown", "dirty": None, "dirty_paths": []}
    return {"commit": head, "dirty": bool(changed), "dirty_paths": [line[3:] for line in changed[:20]]}


def code_label(results: dict) -> str:
    """The commit of a run as its first printed line names it."""
    info = describe(results)
    return info["commit"] + (" + uncommitted changes" if info["dirty"] == "yes" else "")


def script_of(benchmark: str) -> str:
    """A benchmark's script, as a command line names it from the project's
    root: bench/GROUP/NAME.py (a result recorded before the benchmarks were
    grouped names bench/NAME.py, read as the same script)."""
    found = sorted((PROJECT / "bench").glob(f"*/{benchmark}.py"))
    return str(found[0].relative_to(PROJECT)) if found else f"bench/{benchmark}.py"


def portable_command(benchmark: str, argv: list[str]) -> str:
    """The command line as a result file keeps it: an absolute path (where
    the results or logs went) by its file name, naming nothing of the
    machine it ran on."""
    words = [Path(a).name if a.startswith("/") else a for a in argv]
    return " ".join([script_of(benchmark), *words])


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


def run_header(benchmark: str, argv: list[str] | None, machine_info: dict, vm: bool = False) -> dict:
    """The first keys of a benchmark's results: its name, the command line
    (argv None: this process's), the date (UTC), the machine, the commit,
    the accelerator and the load now. A bench that starts VMs (vm) sets
    "accelerator" itself once it knows; until then it is not recorded."""
    return {
        "benchmark": benchmark,
        "command": portable_command(benchmark, sys.argv[1:] if argv is None else list(argv)),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info,
        **commit_fields(),
        "accelerator": NOT_RECORDED if vm else NO_VM,
        "load_before": loadavg(),
    }


def write_json(path: Path, results: dict) -> None:
    """The results as indented JSON, in path (its directory made if needed)
    or, if path is "-", on stdout; a run's results get the load at its end
    unless the bench recorded it."""
    if "benchmark" in results and not any(k in results for k in _LOAD_AFTER):
        results["load_after"] = loadavg()
    text = json.dumps(results, indent=1) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)


# -- reading a result back ---------------------------------------------------------------------

# The names older results gave the same things.
_LOAD_BEFORE = ("load_before", "loadavg_start", "load_start")
_LOAD_AFTER = ("load_after", "loadavg_end", "load")
_ACCEL = ("accelerator", "accel")


def _first(results: dict, keys: tuple[str, ...]):
    return next((results[k] for k in keys if isinstance(results.get(k), str) and results[k]), None)


def describe(results: dict) -> dict:
    """machine, accelerator, load, commit, dirty and date of a result, as
    short strings; what the result lacks is NOT_RECORDED."""
    m = results.get("machine")
    if isinstance(m, dict):
        mach = f"{m.get('cpus', '?')} CPUs {m.get('cpu_model', '?')}, {m.get('memory', '?')}, " \
               f"kernel {m.get('kernel', '?')}"
    else:
        mach = m if isinstance(m, str) and m else NOT_RECORDED
    accel = _first(results, _ACCEL) or NOT_RECORDED
    # The accelerator's probe explains itself at length; the table keeps its verdict.
    accel = accel.split(" (", 1)[0] if accel != NO_VM else accel
    # Some benches kept /proc/loadavg whole: its runnable/total tasks and last pid are no load.
    before, after = (re.sub(r"^([\d.]+ [\d.]+ [\d.]+) \d+/\d+ \d+", r"\1", text) if text else text
                     for text in (_first(results, _LOAD_BEFORE), _first(results, _LOAD_AFTER)))
    if before or after:
        # An older pod_share.py kept the 1 minute average alone.
        span = "(1 min)" if all(len((t or "").split(",")[0].split()) == 1 for t in (before, after) if t) \
            else "(1, 5, 15 min)"
        load = f"{before or NOT_RECORDED} before, {after or NOT_RECORDED} after {span}"
    else:
        load = NOT_RECORDED
    if isinstance(results.get("commit"), str):
        commit = results["commit"][:12]
        dirty = {True: "yes", False: "no"}.get(results.get("dirty"), NOT_RECORDED)
    elif isinstance(results.get("code"), str) and results["code"] != "unknown":
        # Older files: "<short hash>[ + uncommitted changes in N crust/ files]".
        commit = results["code"].split()[0]
        dirty = "yes" if "uncommitted" in results["code"] else "no"
    else:
        commit, dirty = NOT_RECORDED, NOT_RECORDED
    return {"machine": mach, "accelerator": accel, "load": load, "commit": commit, "dirty": dirty,
            "date": results.get("date") or NOT_RECORDED}
