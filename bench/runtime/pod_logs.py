#!/usr/bin/env python3
"""A container's logs at speed, crust-microvm beside runc in one run: both
nodes up at once (tests/harness/pod_nodes.py pod_node: a private containerd
each, the crust stack for the microVM), and each round runs, in turns, a
pod per runtime whose one container writes 50 MiB of lines to its stdout
(`yes` of a 1000-byte line through `head`) and exits.

Per round and runtime, from the container's CRI log (containerd stamps
each line as it takes it from the runtime):
- the rate: MiB between the first line's and the last line's stamps;
- the whole: from the pod's start returning to the container reported
  exited with every line in its log.
Every line is checked there, whole and in order. For crust-microvm also
the CPU its QEMU process spent from the pod's start returning to the
exit (the guest's vCPU: the writer and the agent), as MiB per CPU second:
what the VM moves where a host CPU is its own, whatever else runs.

    .venv/bin/python bench/runtime/pod_logs.py [--rounds 3] [--mib 50] [--cpus 1] [--busy 0] [--json OUT.json]

--busy N keeps N host CPUs busy for the whole run (a process spinning on
each, started before the nodes): the machine as a loaded node has it.

Median, min and max per figure and runtime, the machine, its accelerator
and its load before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from crust.api import cri_pb2 as cri  # noqa: E402
from crust.kata.vmm.qemu import qemu_pids_under  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402
from tests.harness.daemons import wait_until
from tests.harness.pod_nodes import pod_node  # noqa: E402

RUNTIMES = ("runc", "crust-microvm")
LINE = "x" * 999   # with its newline, 1000 bytes


def stamp(text: bytes) -> float:
    """Seconds of a CRI log line's RFC 3339 stamp (nanoseconds cut to micro)."""
    found = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", text.decode())
    if found is None:
        raise ValueError(f"not a CRI log stamp: {text[:40]!r}")
    fraction = (found[2] or "0")[:6].ljust(6, "0")
    zone = "+00:00" if found[3] == "Z" else found[3]
    return dt.datetime.fromisoformat(f"{found[1]}.{fraction}{zone}").timestamp()


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def one_pod(node, root: Path, name: str, lines: int) -> tuple[float, float, float]:
    """(MiB/s between the first and last line's stamps, ms from the pod's
    start to its container exited with every line logged, CPU seconds of
    the pod's QEMU meanwhile: 0 without one)."""
    pod = node.pod(name, volumes={}, containers=[node.container("writer", f"yes {LINE} | head -n {lines}")])
    with node.running(pod):
        started = time.monotonic()
        vms = qemu_pids_under(root)
        cpu_before = cpu_seconds(vms)
        wait_until(lambda: node.status(pod, "writer").state == cri.CONTAINER_EXITED, timeout=600,
                   what=f"{name}'s writer to exit")
        whole_ms = (time.monotonic() - started) * 1e3
        vm_cpu = cpu_seconds(vms) - cpu_before
        status = node.status(pod, "writer")
        first = last = None
        count = 0
        with open(status.log_path, "rb") as log:
            for entry in log:
                when, stream, tag, text = entry.rstrip(b"\n").split(b" ", 3)
                if stream != b"stdout" or tag != b"F" or text != LINE.encode():
                    raise RuntimeError(f"{name}: log line {count + 1} is not the writer's whole line: {entry[:120]!r}")
                first = first if first is not None else stamp(when)
                last = stamp(when)
                count += 1
        if status.exit_code != 0 or count != lines:
            raise RuntimeError(f"{name}: exit {status.exit_code}, {count} of {lines} lines logged")
    return lines * (len(LINE) + 1) / 2**20 / max(last - first, 1e-6), whole_ms, vm_cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=50)
    parser.add_argument("--cpus", type=int, default=1, help="the microVM handler's --cpus (the guest's vCPUs)")
    parser.add_argument("--busy", type=int, default=0, help="host CPUs kept busy by a spinning process each")
    parser.add_argument("--json", help="write the results there (- for stdout)")
    args = parser.parse_args(argv)
    if benchlib.not_root("pod_logs.py", "pods, containerd, QEMU"):
        return 1
    benchlib.raise_on_signals()
    results = benchlib.run_header("pod_logs", argv, benchlib.machine(), vm=True)
    roots = {name: Root() for name in RUNTIMES}
    lines = args.mib * 2**20 // (len(LINE) + 1)

    def body() -> None:
        rates: dict[str, list[float]] = {name: [] for name in RUNTIMES}
        wholes: dict[str, list[float]] = {}
        per_cpu: list[float] = []
        with contextlib.ExitStack() as stack:
            benchlib.keep_cpus_busy(stack, args.busy)
            nodes = {name: stack.enter_context(pod_node(
                name, roots[name], handler_extra=("--cpus", str(args.cpus)) if name == "crust-microvm" else ()))
                for name in RUNTIMES}
            results["load_before"] = benchlib.loadavg()
            for turn in range(args.rounds):
                for name in benchlib.rotated(list(RUNTIMES), turn):
                    rate, whole, vm_cpu = one_pod(nodes[name], roots[name].path,
                                                  f"logs-{turn}-{name.replace('crust-', '')}", lines)
                    rates[name].append(rate)
                    wholes.setdefault(f"{name}: {args.mib} MiB logged", []).append(whole)
                    if vm_cpu:
                        per_cpu.append(args.mib / vm_cpu)
                    print(f"round {turn + 1}/{args.rounds} {name}: {rate:.1f} MiB/s, {whole:.0f} ms to the exit"
                          + (f", {args.mib / vm_cpu:.1f} MiB per CPU second of its VM" if vm_cpu else ""),
                          flush=True)
            results["load_after"] = benchlib.loadavg()
            # The accelerator the handler's VM runs under, as its log says it.
            found = re.search(r"agent ready [0-9.]+s after start \(pid \d+, (\w+)\)",
                              nodes["crust-microvm"].handler_log.read_text(errors="replace"))
            results["accelerator"] = found[1] if found else "unknown"
        results["lines"], results["line_bytes"], results["guest_cpus"] = lines, len(LINE) + 1, args.cpus
        results["busy_host_cpus"] = args.busy
        results["rate_mib_per_s"] = {name: {"median": round(statistics.median(v), 1), "min": round(min(v), 1),
                                            "max": round(max(v), 1), "samples": [round(x, 1) for x in v]}
                                     for name, v in rates.items()}
        results["figures"] = benchlib.ms_rows(wholes)
        if per_cpu:
            results["microvm_mib_per_vm_cpu_s"] = {"median": round(statistics.median(per_cpu), 1),
                                                   "min": round(min(per_cpu), 1), "max": round(max(per_cpu), 1),
                                                   "samples": [round(x, 1) for x in per_cpu]}
        print(f"\n{args.mib} MiB of a container's logs, median of {args.rounds} (min-max), {results['accelerator']}; "
              f"{benchlib.machine_summary(results['machine'])}")
        for name, rate in results["rate_mib_per_s"].items():
            whole = results["figures"][f"{name}: {args.mib} MiB logged"]
            print(f"  {name:14} {rate['median']:6.1f} MiB/s ({rate['min']}-{rate['max']}) between the first and "
                  f"last line; {whole['median_ms']} ms ({whole['min_ms']}-{whole['max_ms']}) to the exit")
        if per_cpu:
            moved = results["microvm_mib_per_vm_cpu_s"]
            print(f"  crust-microvm  {moved['median']:6.1f} MiB per CPU second of its VM ({moved['min']}-{moved['max']})")
        print(f"load {results['load_before']} before, {results['load_after']} after")

    return benchlib.guarded_run_then_write(body, benchlib.roots_cleanup(roots), benchlib.report_failure, args.json, results)


if __name__ == "__main__":
    sys.exit(main())
