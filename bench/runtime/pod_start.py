#!/usr/bin/env python3
"""Pod start through containerd: crust-runc with a deferred volume, against
plain runc with the same volume mounted on the host.

The node is the tests' (tests/harness/cri.py): crust driver -> shim ->
proxy (serving kubelet's registration) and the mount-namespace handler, a
private containerd 1.6 (its own root, state, socket and config) whose
runtime handlers are `runc` (the stock runc shim) and `crust-runc` (the
same shim with crust's OCI runtime as BinaryName), and kubelet's CSI and
CRI sides replayed from kubelet's source (crust/kubelet/).

One volume (--fs, --mib) is created and staged once. Each round starts one
pod per variant, in an order that alternates every round:

- crust-runc: the volume published for the pod with deferral (the proxy's
  StorageClass parameter), the pod's RuntimeClass crust-runc: crust's
  runtime claims the volume through the handler and runc mounts the device
  inside the container;
- runc: the same volume published for the pod without deferral (kubelet's
  volume context without the parameter), so the shim mounts it on the host
  and runc binds it, the pod's RuntimeClass runc.

The publish is kubelet's volume manager's work before the pod starts, so it
is not timed. Timed, per pod: from just before RunPodSandbox to the
container's first write in the volume, whose moment is the timestamp
containerd gave the line the container printed right after the write
(the CRI log's own clock, no polling); and the CRI calls on the way
(RunPodSandbox, CreateContainer, StartContainer, which is where containerd
1.6 runs the OCI runtime's create and start). One uncounted warm-up round,
then --rounds rounds (median of 10 by default). Each pod is stopped and
removed, and its volume unpublished, before the next.

Other work on the machine shows in the numbers: the load average before and
after, and the cores the whole machine kept busy during the run, are
reported. Everything is cleaned up on exit,
Ctrl-C or failure (the pods through CRI, containerd, the daemons, the
volume, every mount and loop device below the run's directories).

    .venv/bin/python bench/runtime/pod_start.py [--rounds 10] [--fs xfs] [--mib 320] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from crust.kubelet import PersistentVolume  # noqa: E402
from tests.harness.cri import cri_node  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402

VARIANTS = ("crust-runc", "runc")
WORKLOAD = "echo x > /data/first-write && echo written && trap 'exit 0' TERM; sleep infinity & wait"
CALLS = ("RunPodSandbox", "CreateContainer", "StartContainer")


def log_time(line: str) -> float:
    """The wall-clock time containerd gave a CRI log line (RFC 3339, ns)."""
    stamp = line.split(" ", 1)[0]
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    seconds = dt.datetime.fromisoformat(whole).replace(tzinfo=dt.timezone.utc).timestamp()
    return seconds + float("0." + (fraction or "0"))


def first_write(log_path: str, timeout: float, what: str = "the container", poll: float = 0.005) -> float:
    """The CRI log's time of the container's `written` line (WORKLOAD's), once
    it is there; TimeoutError naming what after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = Path(log_path).read_text(errors="replace")
        except OSError:
            text = ""
        line = next((line for line in text.splitlines() if line.endswith(" written")), None)
        if line is not None:
            return log_time(line)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not write within {timeout:g} s")
        time.sleep(poll)


STEP = re.compile(r"crust: create took (\d+) ms: start and imports (\d+), handler prepare (\d+), "
                  r"runc create (\d+), handler created (\d+)")
STEPS = ("runtime_create_ms", "runtime_start_and_imports_ms", "handler_prepare_ms", "runc_create_ms",
         "handler_created_ms")


def runtime_steps(log_json: Path) -> dict:
    """What crust's runtime wrote in runc's log about its create (nothing for
    plain runc)."""
    try:
        lines = log_json.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in lines:
        try:
            match = STEP.search(json.loads(line).get("msg", ""))
        except ValueError:
            continue
        if match:
            return {name: float(value) for name, value in zip(STEPS, match.groups())}
    return {}


def start_one(node, pv: PersistentVolume, variant: str, name: str) -> dict:
    pod = node.pod(name, pv, WORKLOAD, runtime_class=variant)
    node.kubelet.retried(node.kubelet.set_up, pv, pod)
    node.runtime.timings.clear()
    started = time.time()
    node.runtime.run_pod(pod)
    container = node.container(pod)
    written = first_write(container.log_path, 30, f"{variant}: the container")
    result = {"to_first_write_ms": (written - started) * 1e3}
    result.update(runtime_steps(node.containerd.task_dir / container.id / "log.json"))
    for method, ms in node.runtime.timings:
        if method in CALLS:
            result[method + "_ms"] = result.get(method + "_ms", 0.0) + ms
    node.runtime.kill_pod(pod)
    node.runtime.remove_pod(pod)
    node.kubelet.retried(node.kubelet.tear_down, pv, pod)
    assert not node.claims(), f"{variant}: a claim was left after the pod"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--fs", default="xfs", choices=["xfs", "ext4"])
    parser.add_argument("--mib", type=int, default=320)
    parser.add_argument("--json", help="write the results here ('-' for stdout)")
    args = parser.parse_args(argv)
    if benchlib.not_root("bench/runtime/pod_start.py", "loop devices, mounts, containerd"):
        return 2
    benchlib.raise_on_signals()
    results = benchlib.run_header("pod_start", argv, benchlib.machine())
    root = Root()
    stack = {}

    def body() -> None:
        began = time.monotonic()
        load_before = benchlib.loadavg()
        sample = benchlib.cpu_sample()
        with cri_node(root) as node:
            stack["node"] = node
            version = node.runtime.runtime_version
            results["containerd"] = version.runtime_version if version else ""
            deferred = node.pv("pv-bench", args.fs, size=args.mib * 1024**2)
            host = PersistentVolume(name=deferred.name, volume_handle=deferred.volume_handle, fs_type=args.fs,
                                    attributes={k: v for k, v in deferred.attributes.items() if k != "crust.dev/defer"})
            volumes = {"crust-runc": deferred, "runc": host}
            # Staged once, as kubelet stages a volume once per node.
            node.kubelet.retried(node.kubelet.mount_device, deferred, node.pod("stage", deferred, ""))
            samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for turn in range(args.rounds + 1):
                for variant in benchlib.rotated(list(VARIANTS), turn):
                    one = start_one(node, volumes[variant], variant, f"{variant}-{turn}")
                    if turn:  # round 0 warms up
                        samples[variant].append(one)
                print(f"round {turn}/{args.rounds}: " + ", ".join(
                    f"{v} {samples[v][-1]['to_first_write_ms']:.0f} ms" for v in VARIANTS if turn), file=sys.stderr)
            node.kubelet.retried(node.kubelet.unmount_device, deferred)
            node.proxy.delete(deferred.volume_handle)
        rows = {}
        for variant in VARIANTS:
            rows[variant] = {key: benchlib.summary([s[key] for s in samples[variant] if key in s], 1)
                             for key in ["to_first_write_ms"] + [c + "_ms" for c in CALLS] + list(STEPS)}
        results.update({"fs_type": args.fs, "volume_mib": args.mib, "rounds": args.rounds, "results": rows,
                        "wall_seconds": round(time.monotonic() - began, 1),
                        "machine_busy_cores": round(benchlib.cores(benchlib.cpu_sample()["busy"] - sample["busy"],
                                                                   time.monotonic() - sample["t"]), 2),
                        "load_before": load_before, "load": benchlib.loadavg()})
        print(f"\nPod start through containerd {results['containerd']}, {args.fs} {args.mib} MiB, "
              f"median of {args.rounds} (min-max); {benchlib.machine_summary(results['machine'])}")
        print(f"{'':<28}{'crust-runc (deferred)':>26}{'runc (host mount)':>26}")
        labels = [("to_first_write_ms", "RunPodSandbox -> 1st write")] + [(c + "_ms", c) for c in CALLS] + [
            ("runtime_create_ms", "  crust runtime's create"), ("runtime_start_and_imports_ms", "    start, imports"),
            ("handler_prepare_ms", "    handler prepare (claim)"), ("runc_create_ms", "    runc create"),
            ("handler_created_ms", "    handler created (fsGroup)")]
        for key, label in labels:
            cells = []
            for variant in VARIANTS:
                s = rows[variant][key]
                cells.append(f"{s['median']:.0f} ms ({s['min']:.0f}-{s['max']:.0f})" if s["n"] else "-")
            print(f"{label:<28}{cells[0]:>26}{cells[1]:>26}")
        a, b = rows["crust-runc"]["to_first_write_ms"]["median"], rows["runc"]["to_first_write_ms"]["median"]
        print(f"\ncrust-runc takes {a - b:+.0f} ms ({a / b:.2f}x) to the first write; the machine's busy cores "
              f"during the run (this run's daemons and containerd included): {results['machine_busy_cores']}; load "
              f"{load_before} before, {results['load']} after")

    def cleanup() -> bool:
        return benchlib.close_and_report(root, [], root.close)

    return benchlib.guarded_run_then_write(body, cleanup, benchlib.report_failure, args.json, results)


if __name__ == "__main__":
    sys.exit(main())
