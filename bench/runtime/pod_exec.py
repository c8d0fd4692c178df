#!/usr/bin/env python3
"""ExecSync into a running container, crust-microvm beside runc, in one run:
both nodes up at once (tests/harness/pod_nodes.py pod_node: a private
containerd each, the crust stack for the microVM), a busybox pod in each,
and every round measures both, in turns, so that both see the same load.

Per round and runtime:
- `true`: one ExecSync, request to answer (CRI's time, as kubelet's exec
  probe sees it);
- 300 KiB of arguments: `sh -c : sh <100 KiB> <100 KiB> <100 KiB>`, a
  command of that size;
- ten at once: ten ExecSync of `echo N` asked together, until the last
  answered;
- 10 MiB out: one ExecSync printing 10 MiB, MiB/s to the whole answer.

    .venv/bin/python bench/runtime/pod_exec.py [--rounds 7] [--busy 0] [--keep-log DIR] [--json OUT.json]

--busy N keeps N host CPUs busy for the whole run (a process spinning on
each, started before the nodes): the machine as a loaded node has it.

Median, min and max per figure and runtime, the ratio of the medians, the
machine, its accelerator and its load before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402
from tests.harness.pod_nodes import KEEP_RUNNING, pod_node  # noqa: E402

RUNTIMES = ("runc", "crust-microvm")
BIG_ARGUMENT = 300 << 10
OUTPUT = 10 << 20


def timed_ms(call) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1e3


def checked(runtime, container_id: str, cmd: list[str], timeout: int = 60, length: int = -1) -> None:
    out = runtime.exec_sync(container_id, cmd, timeout=timeout)
    if out.exit_code != 0 or (length >= 0 and len(out.stdout) != length):
        raise RuntimeError(f"exec {cmd[:2]}: exit {out.exit_code}, {len(out.stdout)} bytes out, {out.stderr[:200]!r}")


def round_of(runtime, container_id: str, samples: dict[str, list[float]], name: str) -> None:
    def add(figure: str, ms: float) -> None:
        samples.setdefault(f"{name}: {figure}", []).append(ms)

    add("true", timed_ms(lambda: checked(runtime, container_id, ["true"])))
    # Three arguments of 100 KiB: one argument may not pass 128 KiB (Linux's MAX_ARG_STRLEN).
    add("300 KiB of arguments", timed_ms(lambda: checked(runtime, container_id,
                                                         ["sh", "-c", ":", "sh", *["x" * (BIG_ARGUMENT // 3)] * 3])))
    with ThreadPoolExecutor(10) as pool:
        add("ten at once", timed_ms(lambda: list(pool.map(
            lambda i: checked(runtime, container_id, ["echo", str(i)]), range(10)))))
    add("10 MiB out", timed_ms(lambda: checked(runtime, container_id, ["head", "-c", str(OUTPUT), "/dev/zero"],
                                               timeout=300, length=OUTPUT)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="write the results there (- for stdout)")
    parser.add_argument("--keep-log", metavar="DIR", help="copy the microVM handler's log there")
    parser.add_argument("--busy", type=int, default=0, help="host CPUs kept busy by a spinning process each")
    args = parser.parse_args(argv)
    if benchlib.not_root("pod_exec.py", "pods, containerd, QEMU"):
        return 1
    benchlib.raise_on_signals()
    results = benchlib.run_header("pod_exec", argv, benchlib.machine(), vm=True)
    roots = {name: Root() for name in RUNTIMES}

    def body() -> None:
        samples: dict[str, list[float]] = {}
        with contextlib.ExitStack() as stack:
            benchlib.keep_cpus_busy(stack, args.busy)
            targets, logs = {}, []
            for name in RUNTIMES:
                node = stack.enter_context(pod_node(name, roots[name]))
                logs += [node.handler_log] if node.handler_log else []
                pod = node.pod(f"exec-{name}", volumes={}, containers=[node.container("app", KEEP_RUNNING)])
                stack.enter_context(node.running(pod))
                targets[name] = (node.runtime, node.status(pod, "app").id)
            for runtime, container_id in targets.values():   # warm: the first exec of each
                checked(runtime, container_id, ["true"])
            results["load_before"] = benchlib.loadavg()
            for turn in range(args.rounds):
                for name in benchlib.rotated(list(RUNTIMES), turn):
                    round_of(*targets[name], samples, name)
            results["load_after"] = benchlib.loadavg()
            # The accelerator the handler's VM runs under, as its log says it.
            found = re.search(r"agent ready [0-9.]+s after start \(pid \d+, (\w+)\)", logs[0].read_text())
            results["accelerator"] = found[1] if found else "unknown"
            if args.keep_log:
                Path(args.keep_log).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(logs[0], Path(args.keep_log) / "handler-crust-microvm.log")
        results["busy_host_cpus"] = args.busy
        results["figures"] = benchlib.ms_rows(samples)
        figures = results["figures"]
        results["ratios"] = {}
        print(f"\nExecSync, median of {args.rounds} rounds (min-max); {benchlib.machine_summary(results['machine'])}")
        for figure in ("true", "300 KiB of arguments", "ten at once", "10 MiB out"):
            runc, vm = figures[f"runc: {figure}"], figures[f"crust-microvm: {figure}"]
            ratio = round(vm["median_ms"] / max(runc["median_ms"], 1), 1)
            results["ratios"][figure] = ratio
            print(f"{figure:22} runc {runc['median_ms']:6} ms ({runc['min_ms']}-{runc['max_ms']})   "
                  f"crust-microvm {vm['median_ms']:6} ms ({vm['min_ms']}-{vm['max_ms']})   x{ratio}")
        out_ms = figures["crust-microvm: 10 MiB out"]["median_ms"]
        results["microvm_output_mib_per_s"] = round(OUTPUT / 2**20 / (out_ms / 1e3), 1)
        print(f"crust-microvm output: {results['microvm_output_mib_per_s']} MiB/s")
        print(f"load {results['load_before']} before, {results['load_after']} after")

    return benchlib.guarded_run_then_write(body, benchlib.roots_cleanup(roots), benchlib.report_failure, args.json, results)


if __name__ == "__main__":
    sys.exit(main())
