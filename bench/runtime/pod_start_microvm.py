#!/usr/bin/env python3
"""Pod start through containerd with RuntimeClass crust-microvm: kubelet ->
containerd -> containerd-shim-crust-v2 -> microVM handler -> guest.

The node is the tests' (tests/harness/cri.py, cri_microvm_node): crust
driver -> shim -> proxy (serving kubelet's registration), `crust kata
handler`, a private containerd 1.6 whose runtime `crust` is crust's shim v2,
and kubelet's CSI and CRI sides replayed from kubelet's source.

One deferred volume (--fs, --mib) is created and staged once. Each round
publishes it for a new pod (kubelet's volume manager, not timed) and times,
from just before RunPodSandbox, the container's first write in the volume
(the timestamp containerd gave the line the container printed right after
the write: the CRI log's own clock), the CRI calls on the way (RunPodSandbox
boots the VM, then the handler mounts the pod's volume ahead in the
background: claimed, hot-plugged, mounted in the guest, its time reported;
StartContainer is where containerd 1.6 creates the task: the rootfs reaches
the guest, the volume is bound, waited for when its mount ahead still runs),
and StopPodSandbox (the VM stopped, the claim released), and QEMU's CPU
time from its start to the agent's first answer (vm_up_qemu_cpu: the
boot's work, which a busy machine stretches less than its wall time; a
booted or restored VM only). One uncounted
warm-up round, then --rounds (median of 5 by default). The accelerator the
handler chose (kvm, or tcg where KVM does not work) is reported.

--pools 0,1 runs the rounds once per handler setting, one after the other
in the same run: 0, each pod boots its VM; 1, the handler keeps one VM
booted ahead (crust.kata.supply.pool) and each pod takes it (a round starts once
the pool has refilled, as when pods come slower than boots). Beside them,
the floor: --floor-boots boots of the same kernel, with a tiny initramfs
whose /init powers off at once, same accelerator and memory, from QEMU's
start to its exit. And a pooled VM's memory while it waits (its QEMU's
RSS and PSS, the guest's RAM a shared memfd). A setting `template` runs
the handler with --vm-template and no pool: each pod's VM is restored from
the VM the handler saved (crust.kata.supply.template; the rounds start once it is
saved). A setting `template-first` runs the same handler but starts its
rounds at once, while the handler is still saving its template (a node's
first pods after its start): every round is counted, and each says
whether the template was saved when it began (the pods before it boot
their VMs), with the seconds from the handler's start to the save.

    .venv/bin/python bench/runtime/pod_start_microvm.py [--rounds 5] [--pools 0,1,template] [--floor-boots 5] [--fs ext4]
        [--mib 128] [--disk-buses virtio-blk] [--cpus 1] [--agent-times] [--keep-log DIR] [--json OUT.json]

--disk-buses virtio-blk,virtio-scsi runs each pool setting once per disk
bus of the handler (--disk-bus): the volume a PCI device hot-plugged for
the pod, or a LUN of the controller the VM booted with.

--agent-times runs the handler at --log-level debug and adds, per round,
each guest agent request's round trip summed by the handler RPC it served
and its call ("agent CreateContainer MountVolume"): where the calls' time goes
in the guest.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from bench.runtime.pod_start import first_write  # noqa: E402
from crust.kata.image import cpio
from crust.kata.image import build as kata_image
from crust.kata.vmm.qemu import qemu_pids_under  # noqa: E402
from crust.kata.vmm.config import GUEST_CMDLINE  # noqa: E402
from crust.kubelet import Container, Pod, VolumeMount  # noqa: E402
from crust.kubelet import image as images  # noqa: E402
from tests.harness.cri import cri_microvm_node  # noqa: E402
from tests.harness.template_log import wait_for_template  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402

WORKLOAD = "echo x > /data/first-write && echo written && trap 'exit 0' TERM; while true; do sleep 1; done"
CALLS = ("RunPodSandbox", "CreateContainer", "StartContainer", "StopPodSandbox")
# PodRuntime's calls (the handler's log), inside RunPodSandbox and StartContainer.
HANDLER_CALLS = ("CreatePod", "CreateContainer", "StartProcess")


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


def pooled_ready(root: Root) -> list[int]:
    """QEMU pids of the VMs the pool holds, their agent answered (the handler logs it)."""
    pool = root.path / "kata-state" / "pool"
    ready = []
    for line in (root.path / "kata.sock.log").read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("msg") == "pooled VM ready" and (pool / entry["vm"]).is_dir():
            ready.append(int(entry["pid"]))
    return [pid for pid in ready if pid in qemu_pids_under(pool)]


def memory_of(pid: int) -> dict:
    """A process's resident memory (kB): RSS, its shared part (the guest's memfd), PSS."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    rollup = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
                  if ":" in line)
    kb = lambda text: int(text.split()[0])  # noqa: E731
    return {"rss_kb": kb(status["VmRSS"]), "rss_shmem_kb": kb(status["RssShmem"]), "pss_kb": kb(rollup["Pss"])}


def boot_floor(work: Path, boots: int, accel: str, memory_mib: int) -> list[float]:
    """The same kernel, on the same command line as a pod's VM, to a tiny
    initramfs whose /init powers off: QEMU's start to its exit, each boot."""
    kernel, _ = kata_image.image_paths()
    busybox = images.find_busybox()
    initrd = work / "floor.cpio"
    initrd.write_bytes(cpio.archive([
        cpio.directory("bin"), cpio.directory("dev"), cpio.chardev("dev/console", 5, 1),
        cpio.regular("bin/busybox", busybox.read_bytes(), 0o755),
        cpio.regular("init", b"#!/bin/busybox sh\n/bin/busybox poweroff -f\n", 0o755)]))
    accel_args = ["-accel", "kvm", "-cpu", "host"] if accel == "kvm" else ["-accel", "tcg"]
    seconds = []
    for _ in range(boots):
        started = time.monotonic()
        subprocess.run(["qemu-system-x86_64", "-machine", "pc", *accel_args, "-m", str(memory_mib), "-smp", "1",
                        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-kernel", str(kernel),
                        "-initrd", str(initrd), "-append", GUEST_CMDLINE, "-serial", "null"],
                       check=True, timeout=120, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        seconds.append((time.monotonic() - started) * 1e3)
    return seconds


def start_one(node, root: Root, pv, name: str) -> dict:
    pod = Pod(uid=f"uid-{name}", name=name, fs_group=2000, host_network=True, runtime_class_name="crust-microvm",
              volumes={"data": pv}, restart_policy="Never", termination_grace_period_seconds=2,
              containers=[Container("app", node.image.name, command=["/bin/sh", "-c", WORKLOAD],
                                    volume_mounts=[VolumeMount("data", "/data")])])
    node.kubelet.retried(node.kubelet.set_up, pv, pod)
    handler_log = root.path / "kata.sock.log"
    log_offset = handler_log.stat().st_size
    node.runtime.timings.clear()
    started = time.time()
    node.runtime.run_pod(pod)
    container = node.runtime.pod_status(pod).latest("app")
    written = first_write(container.log_path, 300, poll=0.01)
    result = {"to_first_write_ms": (written - started) * 1e3}
    # The pod's VM, by the pid file in its work directory (the pool's VMs run beside it).
    pod_vms = {int(p.read_text()) for p in (root.path / "kata-state" / "run").glob("*/qemu.pid")}
    stopping = time.monotonic()
    node.runtime.kill_pod(pod)
    while pod_vms & set(qemu_pids_under(root.path)):
        time.sleep(0.01)
    result["stop_to_vm_gone_ms"] = (time.monotonic() - stopping) * 1e3
    for method, ms in node.runtime.timings:
        if method in CALLS:
            result[method + "_ms"] = result.get(method + "_ms", 0.0) + ms
    # The handler's own part of RunPodSandbox and StartContainer (the rest is
    # containerd and the shim): its last answer to each call.
    for line in (root.path / "kata.sock.log").read_text(errors="replace").splitlines():
        for rpc in HANDLER_CALLS:
            if f'"rpc": "{rpc}"' in line and '"msg": "ok"' in line:
                result[f"handler_{rpc}_ms"] = json.loads(line)["ms"]
        # The pod's volume mounted in the guest at CreatePod, in the background.
        if '"msg": "volumes mounted ahead"' in line:
            result["handler_mount_ahead_ms"] = json.loads(line)["seconds"] * 1e3
        # QEMU's CPU time from its start to the agent's answer (the boot's work, whatever the load).
        if '"msg": "vm up"' in line and json.loads(line).get("cpu_s") is not None:
            result["vm_up_qemu_cpu_ms"] = json.loads(line)["cpu_s"] * 1e3
    with handler_log.open("rb") as f:   # this round's agent requests (a handler at --log-level debug)
        f.seek(log_offset)
        for line in f.read().decode(errors="replace").splitlines():
            if '"msg": "agent request"' in line:
                entry = json.loads(line)
                key = f"agent {entry.get('rpc', '-')} {entry['command']}_ms"
                result[key] = result.get(key, 0.0) + entry["ms"]
    node.runtime.remove_pod(pod)
    node.kubelet.retried(node.kubelet.tear_down, pv, pod)
    assert not node.claims(), "a claim was left after the pod"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fs", default="ext4", choices=["xfs", "ext4"])
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--pools", default="0,1",
                        help="the handler's --vm-pool settings to run, in turn; `template`: no pool, "
                             "--vm-template (default: 0,1)")
    parser.add_argument("--disk-buses", default="virtio-blk",
                        help="the handler's --disk-bus settings to run, in turn, for each pool setting "
                             "(default: virtio-blk)")
    parser.add_argument("--floor-boots", type=int, default=5, help="bare boots of the floor (0: none)")
    parser.add_argument("--cpus", type=int, default=1, help="the handler's --cpus (the guest's vCPUs; default: 1)")
    parser.add_argument("--agent-times", action="store_true",
                        help="the handler at --log-level debug: each guest agent request's time, summed per CRI "
                             "call's handler RPC and command, beside the calls")
    parser.add_argument("--keep-log", metavar="DIR",
                        help="copy each node's handler and containerd logs here (handler-pool<N>[-<bus>].log, "
                             "containerd-pool<N>[-<bus>].log), for a timeline of the rounds")
    parser.add_argument("--json", help="write the results here ('-' for stdout)")
    args = parser.parse_args(argv)
    if benchlib.not_root("bench/runtime/pod_start_microvm.py", "loop devices, QEMU, containerd"):
        return 2
    benchlib.raise_on_signals()
    results = benchlib.run_header("pod_start_microvm", argv, benchlib.machine(), vm=True)
    roots: list[Root] = []   # one per handler setting (each its own node)

    def body() -> None:
        began = time.monotonic()
        load_before = benchlib.loadavg()
        keys = (["to_first_write_ms"] + [c + "_ms" for c in CALLS] + [f"handler_{c}_ms" for c in HANDLER_CALLS]
                + ["handler_mount_ahead_ms", "vm_up_qemu_cpu_ms", "stop_to_vm_gone_ms"])
        columns: dict[str, dict] = {}
        buses = [b.strip() for b in args.disk_buses.split(",") if b.strip()]
        settings = [(p.strip(), bus) for p in args.pools.split(",") if p.strip() for bus in buses]
        for setting, bus in settings:
            first = setting == "template-first"
            template = setting in ("template", "template-first")
            pool = 0 if template else int(setting)
            roots.append(Root())
            root = roots[-1]
            # The column's name says the bus only when the run compares buses.
            column = (setting if template else f"pool {pool}") + (f", {bus}" if len(buses) > 1 else "")
            label = (setting if template else f"pool{pool}") + (f"-{bus}" if len(buses) > 1 else "")
            extra = ("--disk-bus", bus, "--cpus", str(args.cpus),
                     *(("--log-level", "debug") if args.agent_times else ()),
                     *(("--vm-template",) if template else ()))
            with cri_microvm_node(root, vm_pool=pool, handler_extra=extra) as node:
                node_started = time.time()
                saved_file = node.env.handler.state_dir / "template" / "template.json"
                version = node.runtime.runtime_version
                results["containerd"] = version.runtime_version if version else ""
                results["accelerator"] = accelerator(root)
                pv = node.pv(f"pv-bench-{pool}", args.fs, size=args.mib * 1024**2)
                node.kubelet.retried(node.kubelet.mount_device, pv, Pod(uid=f"uid-stage-{pool}", name="stage"))
                samples = []
                for turn in range(args.rounds + 1):
                    deadline = time.monotonic() + 300
                    while pool and len(pooled_ready(root)) < pool:   # the pool refilled
                        if time.monotonic() > deadline:
                            raise TimeoutError("the pool did not refill within 300 s")
                        time.sleep(0.05)
                    if template and not first:
                        wait_for_template(node.env.handler, timeout=max(1.0, deadline - time.monotonic()))
                    if pool and turn == 1:
                        results["pooled_vm_memory"] = memory_of(pooled_ready(root)[0])
                    was_saved = saved_file.exists()
                    one = start_one(node, root, pv, f"microvm-{pool}-{turn}")
                    if first:
                        first_pods = results.setdefault("first_pods", [])
                        first_pods.append({"round": turn, "template_saved": was_saved,
                                           **{k: one[k] for k in ("to_first_write_ms", "RunPodSandbox_ms")}})
                    if turn or first:  # round 0 warms up, but for a node's first pods
                        samples.append(one)
                    print(f"{column}, round {turn}/{args.rounds}: {one['to_first_write_ms']:.0f} ms to the "
                          f"first write" + (" (warm-up)" if not turn and not first else ""), file=sys.stderr)
                if first:
                    # None: its making failed (its error is in the handler's log).
                    try:
                        wait_for_template(node.env.handler)
                        results["template_saved_after_s"] = round(saved_file.stat().st_mtime - node_started, 1)
                    except AssertionError:
                        results["template_saved_after_s"] = None
                node.kubelet.retried(node.kubelet.unmount_device, pv)
                node.proxy.delete(pv.volume_handle)
                if args.keep_log:
                    Path(args.keep_log).mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(root.path / "kata.sock.log", Path(args.keep_log) / f"handler-{label}.log")
                    # containerd's, with the shims' lines
                    shutil.copyfile(node.containerd.log_path, Path(args.keep_log) / f"containerd-{label}.log")
            agent_keys = sorted({k for s in samples for k in s if k.startswith("agent ")})
            columns[column] = {key: benchlib.summary([s[key] for s in samples if key in s], 1)
                                       for key in keys + agent_keys}
        accel = results.get("accelerator", "tcg").split()[0]
        if args.floor_boots:
            roots.append(Root())
            columns["floor (bare boot to poweroff)"] = {"boot_to_exit_ms": benchlib.summary(
                boot_floor(roots[-1].path, args.floor_boots, accel, 256), 1)}
        results.update({"fs_type": args.fs, "volume_mib": args.mib, "rounds": args.rounds, "results": columns,
                        "wall_seconds": round(time.monotonic() - began, 1), "load_before": load_before,
                        "load": benchlib.loadavg()})
        print(f"\nPod start through containerd {results['containerd']} with crust-microvm, {args.fs} "
              f"{args.mib} MiB, accelerator {results['accelerator']}, median of {args.rounds} (min-max); "
              f"{benchlib.machine_summary(results['machine'])}")
        for column, rows in columns.items():
            print(column)
            for key, row in rows.items():
                cell = f"{row['median']:.0f} ms ({row['min']:.0f}-{row['max']:.0f})" if row["n"] else "-"
                print(f"  {key.removesuffix('_ms'):<40}{cell:>26}")
        if "pooled_vm_memory" in results:
            m = results["pooled_vm_memory"]
            print(f"a pooled VM waiting: QEMU RSS {m['rss_kb'] / 1024:.0f} MiB (shared memfd "
                  f"{m['rss_shmem_kb'] / 1024:.0f} MiB), PSS {m['pss_kb'] / 1024:.0f} MiB")
        print(f"load {load_before} before, {results['load']} after")

    return benchlib.guarded_run_then_write(body, benchlib.roots_cleanup(roots), benchlib.report_failure, args.json, results)


if __name__ == "__main__":
    sys.exit(main())
