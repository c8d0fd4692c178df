#!/usr/bin/env python3
"""Memory a pod's container frees, seen from the host: does its VM give it
back (free page reporting, docs/microvm.md "Memory a guest frees")?

The node of tests/cri_harness.py (a private containerd with crust's shim v2
and `crust kata handler` with the node's defaults, --handler-arg adds to
them): one busybox pod of RuntimeClass crust-microvm whose container waits,
writes 100 MiB into the pod's /dev/shm (a tmpfs in the guest's RAM),
waits, removes it and waits again. Its QEMU's resident memory (VmRSS),
PSS (smaps_rollup) and the guest RAM its memfds hold (a VM restored from a
template) are read before the write, after it, and --after seconds after
the removal (the guest reports freed blocks about two seconds after).

    .venv/bin/python bench/runtime/pod_freed_memory.py [--mib 100] [--wait 15] [--after 15] [--handler-arg=ARG ...]
        [--json OUT.json]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from bench.runtime.pod_density import memfd_held_kib, pss_kib  # noqa: E402
from crust.kata.vmm.qemu import qemu_pids_under  # noqa: E402
from crust.kubelet import Container, Pod  # noqa: E402
from tests.harness.cri import container_log, cri_microvm_node  # noqa: E402
from tests.harness.template_log import wait_for_template  # noqa: E402
from tests.harness.daemons import Root, wait_until  # noqa: E402

SCRIPT = ("trap 'exit 0' TERM; echo ready; sleep {wait}; "
          "dd if=/dev/zero of=/dev/shm/fill bs=1048576 count={mib} 2>&1; echo filled; sleep {wait}; "
          "rm /dev/shm/fill; echo freed; sleep 100000 & wait")
START_TIMEOUT = 300.0


def rss_kib(pid: int) -> int:
    return int(re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))


def sample(pid: int) -> dict:
    return {"rss_mib": round(rss_kib(pid) / 1024, 1), "pss_mib": round(pss_kib(pid) / 1024, 1),
            "memfd_held_mib": round(memfd_held_kib([pid]) / 1024, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=100, help="MiB the container writes and removes")
    parser.add_argument("--wait", type=float, default=15.0, help="seconds before and after the write")
    parser.add_argument("--after", type=float, default=15.0, help="seconds after the removal before the last read")
    parser.add_argument("--handler-arg", action="append", default=[], help="one more argument of the handler")
    parser.add_argument("--json", help="write the results there (- for stdout)")
    args = parser.parse_args(argv)
    if benchlib.not_root("pod_freed_memory.py", "loop devices, QEMU, containerd"):
        return 1
    benchlib.raise_on_signals()
    results = benchlib.run_header("pod_freed_memory", argv, benchlib.machine(), vm=True)
    roots: list[Root] = []

    def body() -> None:
        results["load_before"] = benchlib.loadavg()
        roots.append(Root())
        with cri_microvm_node(roots[0], handler_extra=tuple(args.handler_arg)) as node:
            if "--vm-template" in args.handler_arg:
                wait_for_template(node.env.handler)
            made = Pod(uid="uid-freed", name="freed", host_network=True, runtime_class_name="crust-microvm",
                       restart_policy="Never", termination_grace_period_seconds=2,
                       containers=[Container("freed", node.image.name, command=[
                           "/bin/sh", "-c", SCRIPT.format(wait=args.wait, mib=args.mib)])])
            node.runtime.run_pod(made)

            def log() -> str:
                status = node.runtime.pod_status(made).latest("freed")
                return container_log(status) if status is not None else ""

            wait_until(lambda: "ready" in log(), timeout=START_TIMEOUT, what="the container to start")
            (qemu,) = qemu_pids_under(roots[0].path)
            results["accelerator"] = benchlib.accelerator_of(qemu)
            time.sleep(args.wait / 2)
            results["before"] = sample(qemu)
            wait_until(lambda: "filled" in log(), timeout=START_TIMEOUT, what="the write")
            time.sleep(min(3.0, args.wait / 2))
            results["written"] = sample(qemu)
            wait_until(lambda: "freed" in log(), timeout=START_TIMEOUT, what="the removal")
            freed_at = time.monotonic()
            results["after_removal"] = []
            while time.monotonic() - freed_at < args.after:
                time.sleep(min(5.0, args.after))
                results["after_removal"].append({"seconds": round(time.monotonic() - freed_at, 1), **sample(qemu)})
            results["container_log"] = log()[-400:]
            node.runtime.kill_pod(made)
            node.runtime.remove_pod(made)
        results["load_after"] = benchlib.loadavg()
        last = results["after_removal"][-1]
        print(f"\na pod's container wrote {args.mib} MiB to /dev/shm and removed it ({results['accelerator']}; "
              f"{benchlib.machine_summary(results['machine'])}); its QEMU:")
        for name, got in (("before", results["before"]), ("written", results["written"]),
                          (f"{last['seconds']} s after removal", last)):
            print(f"  {name:24s} RSS {got['rss_mib']} MiB, PSS {got['pss_mib']} MiB, "
                  f"memfd held {got['memfd_held_mib']} MiB")
        print(f"load {results['load_before']} before, {results['load_after']} after")

    return benchlib.guarded_run_then_write(body, benchlib.roots_cleanup(roots), benchlib.report_failure, args.json,
                                           results)


if __name__ == "__main__":
    sys.exit(main())
