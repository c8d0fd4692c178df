#!/usr/bin/env python3
"""Many pods asked for at once, as a scheduler's burst gives a node.

The node of tests/harness/cri.py (a private containerd with crust's shim v2
and `crust kata handler`, run once per --settings entry: `template`, each
pod's VM restored from the handler's saved VM; `poolN`, N VMs booted ahead;
`boot`, neither). Each of --pods pods has a volume of its own, published
first (kubelet's volume manager, not timed): a deferred ext4 volume for the
crust-microvm pods; for the runc pods beside them (the same node, after the
microVM pods are gone), a volume of the same driver mounted on the host.
Then every pod's sync (RunPodSandbox, CreateContainer, StartContainer) is
asked for at once, one thread per pod, and each pod is timed from its
request to its container's first write in its volume (the timestamp
containerd gave the line the container printed right after the write: the
CRI log's own clock). Reported per runtime and setting: p50, p99 (nearest
rank) and max, how long until every pod was running, and the machine's CPU
time until then divided among the pods (on a shared machine, other work
too). For the microVM pods, the CPU their processes took by then, per pod:
each QEMU's main thread (its start, the restore's load, device emulation,
QMP) apart from its other threads (the vCPU: the guest's own work, under
tcg its code's translation included), its virtiofsd daemons, its shim, and
the handler's and containerd's CPU over the burst divided among the pods;
their sum is what a pod's start costs the machine. From the handler's log (each "vm up" and how long that VM took to
restore or boot): how many VMs were being started at the same moment at
most, which is 1 if the handler started them one after another.

    .venv/bin/python bench/runtime/pod_burst.py [--pods 20] [--settings template,pool4] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from bench.runtime.pod_density import by_kind, vm_groups  # noqa: E402
from bench.runtime.pod_start import first_write  # noqa: E402
from crust.kubelet import Container, Pod, VolumeMount  # noqa: E402
from tests.harness.cri import cri_microvm_node, shim_pids  # noqa: E402
from tests.harness.template_log import wait_for_template  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402
from tests.harness.daemons import wait_until

WORKLOAD = "echo x > /data/first-write && sync && echo written && trap 'exit 0' TERM; sleep 100000 & wait"
WRITE_TIMEOUT = 600.0


def handler_args(setting: str) -> tuple[str, ...]:
    if setting == "template":
        return ("--vm-template",)
    if setting.startswith("pool"):
        return ("--vm-pool", str(int(setting[4:])))
    if setting == "boot":
        return ()
    raise ValueError(f"--settings: {setting!r} is none of template, poolN, boot")


def vm_starts(log_path: Path, since: float) -> dict:
    """The handler's VM starts (restore or boot) logged after since, each
    the interval its "vm up" line closes: how many there were, the most
    under way at one moment, and their durations."""
    intervals = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or entry.get("msg") != "vm up":
            continue
        end = dt.datetime.strptime(entry["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.timezone.utc).timestamp()
        if end >= since:
            intervals.append((end - float(entry["boot_s"]), end))
    under_way = most = 0
    for _, change in sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals]):
        under_way += change
        most = max(most, under_way)
    durations = [end - start for start, end in intervals]
    return {"vm_starts": len(intervals), "at_once_max": most,
            "start_s": benchlib.summary(durations, 2, ("p50", "min", "max")) if durations else {}}


def thread_cpu_s(pid: int, tid: int) -> float:
    """One thread's CPU time so far (0 once it is gone)."""
    text = benchlib.file_text(f"/proc/{pid}/task/{tid}/schedstat")
    return int(text.split()[0]) / 1e9 if text else 0.0


def microvm_cpu(root: Path, node, daemons_before: dict[str, float], pods: int) -> dict:
    """The CPU seconds per pod of the microVM pods' processes (alive: their
    totals since they started) and of the node's daemons since the burst."""
    parts: dict[str, float] = {"qemu main thread": 0.0, "qemu vCPU and other threads": 0.0}
    for group in vm_groups(root):
        qemu = group[0]
        main = thread_cpu_s(qemu, qemu)
        parts["qemu main thread"] += main
        parts["qemu vCPU and other threads"] += benchlib.cpu_ns(qemu) / 1e9 - main
        for kind, pids in by_kind(group[1:]).items():
            parts[kind] = parts.get(kind, 0.0) + sum(benchlib.cpu_ns(p) for p in pids) / 1e9
    shims = by_kind(shim_pids(node.containerd)).get("crust shim", [])
    parts["crust shim"] = sum(benchlib.cpu_ns(p) for p in shims) / 1e9
    for name, pid in daemon_pids(node).items():
        parts[name] = benchlib.cpu_ns(pid) / 1e9 - daemons_before[name]
    row = {kind: round(seconds / pods, 3) for kind, seconds in parts.items()}
    row["sum"] = round(sum(parts.values()) / pods, 3)
    return row


def daemon_pids(node) -> dict[str, int]:
    return {"handler": node.env.handler.proc.pid, "containerd": node.containerd.process.pid}


def burst(node, runtime_class: str, pods: int, defer: bool, tag: str, root: Path | None = None) -> dict:
    """pods pods of runtime_class asked for at once; each one's seconds to its first write."""
    made = []
    for n in range(pods):
        pv = node.pv(f"pv-{tag}-{n}", "ext4", size=64 * 1024**2, defer=defer)
        pod = Pod(uid=f"uid-{tag}-{n}", name=f"{tag}-{n}", host_network=True, runtime_class_name=runtime_class,
                  restart_policy="Never", termination_grace_period_seconds=2, volumes={"data": pv},
                  containers=[Container("app", node.image.name, command=["/bin/sh", "-c", WORKLOAD],
                                        volume_mounts=[VolumeMount("data", "/data")])])
        node.kubelet.start_pod(pv, pod)
        made.append((pod, pv))
    asked: dict[str, float] = {}
    errors: list[str] = []

    def sync(pod: Pod) -> None:
        asked[pod.name] = time.time()
        try:
            node.runtime.run_pod(pod)
        except Exception as exc:  # noqa: BLE001 - every pod's failure is reported, none stops the others
            errors.append(f"{pod.name}: {exc}")

    threads = [threading.Thread(target=sync, args=(pod,)) for pod, _ in made]
    daemons_before = {name: benchlib.cpu_ns(pid) / 1e9 for name, pid in daemon_pids(node).items()}
    busy_before = benchlib.machine_ticks()[0]
    started = time.time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError("; ".join(errors[:5]))
    seconds = []
    for pod, _ in made:
        container = node.runtime.pod_status(pod).latest("app")
        seconds.append(first_write(container.log_path, WRITE_TIMEOUT, pod.name, poll=0.02) - asked[pod.name])
    all_running = max(s + asked[pod.name] for s, (pod, _) in zip(seconds, made, strict=True)) - started
    # The whole machine's CPU until the last pod ran (read after it: a few
    # polls of the logs more), per pod.
    cpu_per_pod = (benchlib.machine_ticks()[0] - busy_before) / benchlib.TICK / pods
    by_process = microvm_cpu(root, node, daemons_before, pods) if runtime_class == "crust-microvm" else None
    for pod, pv in made:
        node.runtime.kill_pod(pod)
        node.runtime.remove_pod(pod)
        node.kubelet.stop_pod(pv, pod)
    row = benchlib.summary(seconds, 2, ("p50", "p99", "min", "max"))
    row["all_running_s"] = round(all_running, 2)
    row["machine_cpu_s_per_pod"] = round(cpu_per_pod, 2)
    if runtime_class == "crust-microvm":
        row["handler"] = vm_starts(node.env.handler.log_path, started)
        row["cpu_s_per_pod_by_process"] = by_process
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--settings", default="template,pool4",
                        help="the handler's settings to run, in turn: template, poolN, boot")
    parser.add_argument("--json", help="write the results there (- for stdout)")
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    for setting in settings:
        try:
            handler_args(setting)
        except ValueError as exc:
            parser.error(str(exc))
    if benchlib.not_root("pod_burst.py", "loop devices, QEMU, containerd"):
        return 1
    benchlib.raise_on_signals()
    results = benchlib.run_header("pod_burst", argv, benchlib.machine(), vm=True)
    results["results"] = {}
    roots: list[Root] = []

    def body() -> None:
        results["load_before"] = benchlib.loadavg()
        for setting in settings:
            roots.append(root := Root())
            with cri_microvm_node(root, handler_extra=handler_args(setting)) as node:
                if setting == "template":
                    wait_for_template(node.env.handler)
                elif setting.startswith("pool"):
                    wanted = int(setting[4:])
                    log = node.env.handler.log_path
                    wait_until(lambda log=log, wanted=wanted:
                               log.read_text(errors="replace").count('"msg": "pooled VM ready"') >= wanted,
                               timeout=600, interval=0.5, what=f"the pool's {wanted} VMs")
                load = benchlib.loadavg()
                vm = burst(node, "crust-microvm", args.pods, True, f"vm-{setting}", root.path)
                print(f"{setting}: {args.pods} microVM pods at once: p50 {vm['p50']} s, p99 {vm['p99']} s "
                      f"(load {load}); VMs started by the handler {vm['handler']['vm_starts']}, at most "
                      f"{vm['handler']['at_once_max']} at once, each {vm['handler']['start_s']}; CPU s per pod by "
                      f"process {vm['cpu_s_per_pod_by_process']}", flush=True)
                runc = burst(node, "runc", args.pods, False, f"runc-{setting}")
                print(f"{setting}: {args.pods} runc pods at once: p50 {runc['p50']} s, p99 {runc['p99']} s",
                      flush=True)
                results["results"][setting] = {"crust-microvm": vm, "runc": runc, "load_at_start": load}
                results["accelerator"] = benchlib.accelerator_in_log(node.env.handler.log_path)
        results["load_after"] = benchlib.loadavg()
        print(f"\n{args.pods} pods at once, seconds from the request to the container's first write in its volume; "
              f"{benchlib.machine_summary(results['machine'])}")
        for setting, row in results["results"].items():
            for runtime in ("crust-microvm", "runc"):
                r = row[runtime]
                print(f"  {setting:10s} {runtime:14s} p50 {r['p50']}, p99 {r['p99']} (min {r['min']}, max "
                      f"{r['max']}); all running after {r['all_running_s']} s")
        print(f"load {results['load_before']} before, {results['load_after']} after")

    return benchlib.guarded_run_then_write(body, benchlib.roots_cleanup(roots), benchlib.report_failure, args.json,
                                           results)


if __name__ == "__main__":
    sys.exit(main())
