#!/usr/bin/env python3
"""Pod lives one after another on a microVM node, and what they leave.

The node of tests/harness/cri.py (a private containerd with crust's shim v2
and `crust kata handler --vm-template`, a pod network of its own), one
deferred ext4 volume, and --lives lives as tests/harness/churn.py lives them
(published, run, written, read by ExecSync, killed, removed, unpublished;
every tenth a container crashed and restarted in its sandbox, every tenth
QEMU SIGKILLed). Reported: each life's time, the handler's RSS and
descriptors after each life and the shim's while each life's pod ran (the
node's shared shim, kept by a pod that runs all along beside the lives), the
medians over lives --early (the first few fill caches) against the last as
many (the issue's limit: no more than 5% growth), and whatever the node
holds after the last life that it did not hold before the first.

    .venv/bin/python bench/runtime/pod_churn.py [--lives 1000] [--early 100:200] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from tests.harness import churn  # noqa: E402
from tests.harness.cri import cri_microvm_node  # noqa: E402
from tests.harness.template_log import wait_for_template  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402

FIELDS = ("handler_rss_kib", "handler_fds", "shim_rss_kib", "shim_fds")


def early_range(text: str) -> range:
    first, _, last = text.partition(":")
    return range(int(first), int(last))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lives", type=int, default=1000)
    parser.add_argument("--early", type=early_range, default=None,
                        help="FIRST:END, the lives the last ones are held against (default: the second tenth)")
    parser.add_argument("--json", help="write the results there (- for stdout)")
    args = parser.parse_args(argv)
    if benchlib.not_root("pod_churn.py", "loop devices, QEMU, containerd"):
        return 1
    early = args.early or range(args.lives // 10, 2 * args.lives // 10)
    if not early or early.stop > args.lives:
        parser.error(f"--early {early.start}:{early.stop} is not within the {args.lives} lives")
    benchlib.raise_on_signals()
    results = benchlib.run_header("pod_churn", argv, benchlib.machine(), vm=True)
    roots: list[Root] = []

    def body() -> None:
        results["load_before"] = benchlib.loadavg()
        roots.append(Root())
        started = time.monotonic()
        with cri_microvm_node(roots[0], pod_network=True, handler_extra=("--vm-template",)) as node:
            wait_for_template(node.env.handler)
            pv = node.pv("pv-churn", "ext4", size=64 * 1024**2)
            lives = churn.Lives(node, pv, node.image.name)
            lived = []
            for n in range(args.lives):
                lived.append(life := lives.live(n))
                if n % 50 == 49 or n == args.lives - 1:
                    print(f"life {n + 1}/{args.lives}: {life.seconds:.1f} s, handler {life.handler_rss_kib} KiB "
                          f"{life.handler_fds} fds, shim {life.shim_rss_kib} KiB {life.shim_fds} fds, "
                          f"load {benchlib.loadavg()}", flush=True)
            left = lives.left_once_settled()
            lives.end_anchor()
            left = {**left, **{f"{kind} (the anchor gone)": items
                               for kind, items in lives.left_once_settled().items()}}
            # The VMs live inside lives.live() only: their accelerator is read
            # from the handler's log of them (the way it logs each VM's start).
            results["accelerator"] = benchlib.accelerator_in_log(node.env.handler.log_path)
        results["wall_seconds"] = round(time.monotonic() - started, 1)
        results["load_after"] = benchlib.loadavg()
        # About a hundred lives' figures: every life's, or every n-th's of a longer run.
        step = max(1, len(lived) // 100)
        rows = [dataclasses.asdict(life) for life in lived[::step]]
        results["lives"] = {"every": step, **{key: [row[key] for row in rows] for key in rows[0]}}
        results["left"] = {kind: sorted(map(str, items)) for kind, items in left.items()}
        results["seconds_by_kind"] = {
            kind: benchlib.summary([x.seconds for x in lived if x.kind == kind], 2)
            for kind in sorted({x.kind for x in lived})}
        growth = {}
        for field in FIELDS:
            first, last = churn.growth(lived, early, field)
            growth[field] = {"early": first, "last": last, "ratio": round(last / first, 3) if first else None}
        results["growth"] = {"early_lives": f"{early.start}:{early.stop}", **growth}
        print(f"\n{args.lives} pod lives, {benchlib.machine_summary(results['machine'])}; "
              f"{results['wall_seconds']} s in all")
        for kind, row in results["seconds_by_kind"].items():
            print(f"  a {kind} life: {row['median']} s median ({row['min']}-{row['max']})")
        for field, row in growth.items():
            verdict = "ok" if row["ratio"] is not None and row["ratio"] <= churn.GROWTH_ALLOWED else "GROWS"
            print(f"  {field:16s} lives {early.start}-{early.stop - 1}: {row['early']:g}, "
                  f"the last {len(early)}: {row['last']:g} (x{row['ratio']}) {verdict}")
        named = "; ".join(f"{kind}: {sorted(map(str, items))[:5]}" for kind, items in left.items())
        print(f"  left after the last life: {named or 'nothing'}")
        print(f"load {results['load_before']} before, {results['load_after']} after")

    return benchlib.guarded_run_then_write(body, benchlib.roots_cleanup(roots), benchlib.report_failure, args.json,
                                           results)


if __name__ == "__main__":
    sys.exit(main())
