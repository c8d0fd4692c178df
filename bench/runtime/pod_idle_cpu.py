#!/usr/bin/env python3
"""What a microVM pod costs the host while its containers do nothing.

The node of tests/harness/cri.py (cri_microvm_node: crust's stack, `crust
kata handler`, a private containerd 1.6 with crust's shim v2, kubelet's CRI
side replayed). Each round starts one pod whose container prints a line and
sleeps (containerd's shim then keeps a ReadOutput stream and a GetProcess
wait on it, as for any running container), waits --settle seconds, and
counts the CPU its QEMU used over the next --seconds, and the whole
machine's; then stops the pod. Beside it, the floor: the same guest image's
VM booted alone (crust.kata.vmm.qemu.Vm, no pod, no container, nobody asking
anything), its QEMU's CPU over the same seconds.

    .venv/bin/python bench/runtime/pod_idle_cpu.py [--rounds 3] [--seconds 10] [--settle 3] [--json OUT.json]

Cores (CPU seconds per second of wall time): median (min-max) per column,
the machine and its load before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from crust.kata.image import build as kata_image
from crust.kata.vmm.qemu import Vm, VmConfig, qemu_pids_under  # noqa: E402
from crust.kubelet import Container, Pod  # noqa: E402
from tests.harness.cri import cri_microvm_node  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402


def qemu_cores(pid: int, seconds: float) -> tuple[float, float]:
    """(QEMU's cores, the machine's busy cores) over seconds from now."""
    before, machine_before = benchlib.proc_ticks(pid), benchlib.machine_ticks()
    time.sleep(seconds)
    after, machine_after = benchlib.proc_ticks(pid), benchlib.machine_ticks()
    busy = machine_after[0] - machine_before[0]
    return (after - before) / benchlib.TICK / seconds, busy / benchlib.TICK / seconds


def idle_pod_round(node, root: Root, name: str, settle: float, seconds: float) -> dict:
    pod = Pod(uid=f"uid-{name}", name=name, host_network=True, runtime_class_name="crust-microvm",
              restart_policy="Never", termination_grace_period_seconds=2,
              containers=[Container("idle", node.image.name, command=["/bin/sh", "-c", "echo up; exec sleep 3600"])])
    node.runtime.run_pod(pod)
    try:
        pids = [int(p.read_text()) for p in (root.path / "kata-state" / "run").glob("*/qemu.pid")]
        if len(pids) != 1:
            raise RuntimeError(f"expected the pod's one VM, found QEMU pids {pids}")
        time.sleep(settle)
        vm, machine = qemu_cores(pids[0], seconds)
        return {"qemu_cores": vm, "machine_cores": machine, "accelerator": benchlib.accelerator_of(pids[0])}
    finally:
        node.runtime.kill_pod(pod)
        node.runtime.remove_pod(pod)


async def bare_vm_round(work: Path, settle: float, seconds: float) -> dict:
    built = kata_image.build()
    vm = Vm("crust-idle-floor", work, VmConfig(kernel=built.kernel, initrd=built.initrd))
    try:
        await vm.start(ready_timeout=120)
        await asyncio.sleep(settle)
        cores, machine = await asyncio.to_thread(qemu_cores, vm.pid, seconds)
        return {"qemu_cores": cores, "machine_cores": machine, "accelerator": benchlib.accelerator_of(vm.pid)}
    finally:
        await vm.kill()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each VM's CPU is counted")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after the start before counting")
    parser.add_argument("--json", help="write the results there (- for stdout)")
    args = parser.parse_args(argv)
    if benchlib.not_root("pod_idle_cpu.py", "loop devices, QEMU, containerd"):
        return 1
    benchlib.raise_on_signals()
    results = benchlib.run_header("pod_idle_cpu", argv, benchlib.machine(), vm=True)
    base = Path(tempfile.mkdtemp(prefix="crust-idle-"))
    roots: list[Root] = []

    def body() -> None:
        results["load_before"] = benchlib.loadavg()
        samples: dict[str, list[dict]] = {"pod with an idle container": [], "floor: a VM alone": []}
        roots.append(Root())
        with cri_microvm_node(roots[0], vm_pool=0) as node:
            for turn in range(args.rounds):
                one = idle_pod_round(node, roots[0], f"idle-{turn}", args.settle, args.seconds)
                samples["pod with an idle container"].append(one)
                floor = asyncio.run(bare_vm_round(base / f"floor-{turn}", args.settle, args.seconds))
                samples["floor: a VM alone"].append(floor)
                print(f"round {turn + 1}/{args.rounds}: pod's QEMU {one['qemu_cores']:.3f} cores, "
                      f"a VM alone {floor['qemu_cores']:.3f}", flush=True)
        results["load_after"] = benchlib.loadavg()
        # What the pods' and the floor's VMs ran under, read from their QEMU's command line.
        results["accelerator"] = ", ".join(sorted({s["accelerator"] for rows in samples.values() for s in rows}))
        results["columns"] = {
            name: {key: {"median": round(statistics.median(s[key] for s in rows), 3),
                         "min": round(min(s[key] for s in rows), 3), "max": round(max(s[key] for s in rows), 3)}
                   for key in ("qemu_cores", "machine_cores")}
            for name, rows in samples.items()}
        print(f"\nidle for {args.seconds:g} s after {args.settle:g} s, median of {args.rounds} (min-max), cores; "
              f"{benchlib.machine_summary(results['machine'])}")
        for name, row in results["columns"].items():
            q, m = row["qemu_cores"], row["machine_cores"]
            print(f"  {name:28s} QEMU {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f}), "
                  f"machine {m['median']:.3f} ({m['min']:.3f}-{m['max']:.3f})")
        print(f"load {results['load_before']} before, {results['load_after']} after")

    def cleanup() -> bool:
        clean = True
        for root in roots:
            clean = benchlib.close_and_report(root, [], root.close) and clean
        shutil.rmtree(base, ignore_errors=True)
        return clean and not qemu_pids_under(base)

    return benchlib.guarded_run_then_write(body, cleanup, benchlib.report_failure, args.json, results)


if __name__ == "__main__":
    sys.exit(main())
