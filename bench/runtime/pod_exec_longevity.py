#!/usr/bin/env python3
"""Many execs into one long-lived container, crust-microvm beside runc in
the same containerd (tests/harness/pod_nodes.py pod_node: the microVM node runs
runc pods too), as an exec probe runs for weeks: `true` by ExecSync into
a container whose env is 40 KB (Kubernetes' service-link variables of a
namespace with a few hundred Services), the runtimes taking turns exec by
exec so that both see the same load.

Per block of --block execs and runtime: the median and p90 of the
latency (request to answer, as kubelet's probe sees it); at each block's
end the microVM handler's RSS and the size of its pod records. Then the
ratio of the last block's median to the first's, per runtime (the target:
within 10%).

    .venv/bin/python bench/runtime/pod_exec_longevity.py [--execs 10000] [--block 1000] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402
from tests.harness.pod_nodes import KEEP_RUNNING, pod_node  # noqa: E402
from tests.harness.churn import rss_kib  # noqa: E402
from tests.harness.pod_nodes import service_links  # noqa: E402

RUNTIMES = ("runc", "crust-microvm")
ENV_BYTES = 40 << 10


def timed_exec_ms(runtime, container_id: str) -> float:
    started = time.perf_counter()
    out = runtime.exec_sync(container_id, ["true"], timeout=60)
    took = (time.perf_counter() - started) * 1e3
    if out.exit_code != 0:
        raise RuntimeError(f"exec true: exit {out.exit_code}, {out.stderr[:200]!r}")
    return took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--execs", type=int, default=10000, help="execs per runtime")
    parser.add_argument("--block", type=int, default=1000, help="execs per reported block")
    parser.add_argument("--json", help="write the results there (- for stdout)")
    args = parser.parse_args(argv)
    if args.block < 1 or args.execs < 2 * args.block:
        parser.error("--execs must be at least two blocks")
    if benchlib.not_root("pod_exec_longevity.py", "pods, containerd, QEMU"):
        return 1
    benchlib.raise_on_signals()
    results = benchlib.run_header("pod_exec_longevity", argv, benchlib.machine(), vm=True)
    roots = {"node": Root()}

    def body() -> None:
        with pod_node("crust-microvm", roots["node"]) as node, contextlib.ExitStack() as stack:
            env = service_links(ENV_BYTES)
            targets = {}
            for name in RUNTIMES:
                pod = node.pod(f"longevity-{name.replace('crust-', '')}", volumes={}, runtime_class=name,
                               containers=[node.container("app", KEEP_RUNNING, env=env)])
                stack.enter_context(node.running(pod))
                targets[name] = node.status(pod, "app").id
            for name in RUNTIMES:   # warm: the first exec of each
                timed_exec_ms(node.runtime, targets[name])
            records = node.handler.state_dir / "pods"
            results["accelerator"] = benchlib.accelerator_in_log(node.handler_log)
            results["load_before"] = benchlib.loadavg()
            blocks: list[dict] = []
            samples: dict[str, list[float]] = {name: [] for name in RUNTIMES}
            for n in range(args.execs):
                for name in benchlib.rotated(list(RUNTIMES), n):
                    samples[name].append(timed_exec_ms(node.runtime, targets[name]))
                if (n + 1) % args.block == 0:
                    block = {"execs": n + 1,
                             "handler_rss_mb": round(rss_kib(node.handler.proc.pid) / 1024, 1),
                             "pod_record_bytes": sum(p.stat().st_size for p in records.glob("*.json")),
                             "load": benchlib.loadavg()}
                    for name in RUNTIMES:
                        block[name] = benchlib.summary(samples[name][-args.block:], 1, ("median", "p90"), "_ms")
                    blocks.append(block)
                    print(f"{n + 1:6d} execs: " + "   ".join(
                        f"{name} {block[name]['median_ms']} ms (p90 {block[name]['p90_ms']})" for name in RUNTIMES)
                        + f"   handler RSS {block['handler_rss_mb']} MB, pod record {block['pod_record_bytes']} B",
                        flush=True)
            results["load_after"] = benchlib.loadavg()
        results["blocks"] = blocks
        results["last_over_first"] = {
            name: round(statistics.median(samples[name][-args.block:]) /
                        statistics.median(samples[name][:args.block]), 3) for name in RUNTIMES}
        results["handler_rss_mb_first_last"] = [blocks[0]["handler_rss_mb"], blocks[-1]["handler_rss_mb"]]
        results["pod_record_bytes_first_last"] = [blocks[0]["pod_record_bytes"], blocks[-1]["pod_record_bytes"]]
        print(f"last block's median over the first's: {results['last_over_first']}; "
              f"{benchlib.machine_summary(results['machine'])}; load {results['load_before']} before, "
              f"{results['load_after']} after")

    return benchlib.guarded_run_then_write(body, benchlib.roots_cleanup(roots), benchlib.report_failure, args.json,
                                           results)


if __name__ == "__main__":
    sys.exit(main())
