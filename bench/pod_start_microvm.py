#!/usr/bin/env python3
"""Pod start through containerd with RuntimeClass crust-microvm: kubelet ->
containerd -> containerd-shim-crust-v2 -> microVM handler -> guest.

The node is the tests' (tests/cri_harness.py, cri_microvm_node): crust
driver -> shim -> proxy (serving kubelet's registration), `crust kata
handler`, a private containerd 1.6 whose runtime `crust` is crust's shim v2,
and kubelet's CSI and CRI sides replayed from kubelet's source.

One deferred volume (--fs, --mib) is created and staged once. Each round
publishes it for a new pod (kubelet's volume manager, not timed) and times,
from just before RunPodSandbox, the container's first write in the volume
(the timestamp containerd gave the line the container printed right after
the write: the CRI log's own clock), the CRI calls on the way (RunPodSandbox
boots the VM; StartContainer is where containerd 1.6 creates the task: the
rootfs reaches the guest, the volume is claimed, hot-plugged and mounted),
and StopPodSandbox (the VM stopped, the claim released). One uncounted
warm-up round, then --rounds (median of 5 by default). The accelerator the
handler chose (kvm, or tcg where KVM does not work) is reported.

    .venv/bin/python bench/pod_start_microvm.py [--rounds 5] [--fs ext4] [--mib 128] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import benchlib  # noqa: E402
from bench.pod_start import log_time  # noqa: E402
from crust.kata.qemu import qemu_pids_under  # noqa: E402
from crust.kubelet import Container, Pod, VolumeMount  # noqa: E402
from tests.cri_harness import cri_microvm_node  # noqa: E402
from tests.harness import Root  # noqa: E402

WORKLOAD = "echo x > /data/first-write && echo written && trap 'exit 0' TERM; while true; do sleep 1; done"
CALLS = ("RunPodSandbox", "CreateContainer", "StartContainer", "StopPodSandbox")


def accelerator(root: Root) -> str:
    """What the handler logged when it chose its accelerator."""
    for line in (root.path / "kata.sock.log").read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("msg") == "accelerator":
            return f"{entry.get('accel')} ({entry.get('reason', '')})"
    return "unknown"


def start_one(node, root: Root, pv, name: str) -> dict:
    pod = Pod(uid=f"uid-{name}", name=name, fs_group=2000, host_network=True, runtime_class_name="crust-microvm",
              volumes={"data": pv}, restart_policy="Never", termination_grace_period_seconds=2,
              containers=[Container("app", node.image.name, command=["/bin/sh", "-c", WORKLOAD],
                                    volume_mounts=[VolumeMount("data", "/data")])])
    node.kubelet.retried(node.kubelet.set_up, pv, pod)
    node.runtime.timings.clear()
    started = time.time()
    node.runtime.run_pod(pod)
    container = node.runtime.pod_status(pod).latest("app")
    deadline = time.monotonic() + 300
    written = None
    while written is None:
        if time.monotonic() > deadline:
            raise TimeoutError("the container did not write within 300 s")
        path = Path(container.log_path)
        text = path.read_text(errors="replace") if path.exists() else ""
        written = next((line for line in text.splitlines() if line.endswith(" written")), None)
        if written is None:
            time.sleep(0.01)
    result = {"to_first_write_ms": (log_time(written) - started) * 1e3}
    stopping = time.monotonic()
    node.runtime.kill_pod(pod)
    while qemu_pids_under(root.path):
        time.sleep(0.01)
    result["stop_to_vm_gone_ms"] = (time.monotonic() - stopping) * 1e3
    for method, ms in node.runtime.timings:
        if method in CALLS:
            result[method + "_ms"] = result.get(method + "_ms", 0.0) + ms
    node.runtime.remove_pod(pod)
    node.kubelet.retried(node.kubelet.tear_down, pv, pod)
    assert not node.claims(), "a claim was left after the pod"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fs", default="ext4", choices=["xfs", "ext4"])
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--json", help="write the results here ('-' for stdout)")
    args = parser.parse_args(argv)
    if benchlib.not_root("bench/pod_start_microvm.py", "loop devices, QEMU, containerd"):
        return 2
    benchlib.raise_on_signals()
    results = benchlib.run_header("pod_start_microvm", argv, benchlib.machine())
    root = Root()

    def body() -> None:
        began = time.monotonic()
        load_before = benchlib.loadavg()
        with cri_microvm_node(root) as node:
            version = node.runtime.runtime_version
            results["containerd"] = version.runtime_version if version else ""
            results["accelerator"] = accelerator(root)
            pv = node.pv("pv-bench", args.fs, size=args.mib * 1024**2)
            node.kubelet.retried(node.kubelet.mount_device, pv, Pod(uid="uid-stage", name="stage"))
            samples = []
            for turn in range(args.rounds + 1):
                one = start_one(node, root, pv, f"microvm-{turn}")
                if turn:  # round 0 warms up
                    samples.append(one)
                print(f"round {turn}/{args.rounds}: {one['to_first_write_ms']:.0f} ms to the first write"
                      + (" (warm-up)" if not turn else ""), file=sys.stderr)
            node.kubelet.retried(node.kubelet.unmount_device, pv)
            node.proxy.delete(pv.volume_handle)
        keys = ["to_first_write_ms"] + [c + "_ms" for c in CALLS] + ["stop_to_vm_gone_ms"]
        rows = {key: benchlib.summary([s[key] for s in samples if key in s], 1) for key in keys}
        results.update({"fs_type": args.fs, "volume_mib": args.mib, "rounds": args.rounds, "results": rows,
                        "wall_seconds": round(time.monotonic() - began, 1), "load_before": load_before,
                        "load": benchlib.loadavg()})
        print(f"\nPod start through containerd {results['containerd']} with crust-microvm, {args.fs} "
              f"{args.mib} MiB, accelerator {results['accelerator']}, median of {args.rounds} (min-max); "
              f"{benchlib.machine_summary(results['machine'])}")
        for key in keys:
            s = rows[key]
            cell = f"{s['median']:.0f} ms ({s['min']:.0f}-{s['max']:.0f})" if s["n"] else "-"
            print(f"{key.removesuffix('_ms'):<24}{cell:>26}")
        print(f"load {load_before} before, {results['load']} after")

    def cleanup() -> bool:
        return benchlib.close_and_report(root, [], root.close)

    return benchlib.guarded_run_then_write(body, cleanup, benchlib.report_failure, args.json, results)


if __name__ == "__main__":
    sys.exit(main())
