#!/usr/bin/env python3
"""Many idle pods on one node: what each costs the host in memory and CPU.

The node of tests/harness/cri.py (a private containerd with crust's shim v2
and `crust kata handler`, --vm-template unless --vm-source boot): --pods
busybox pods of RuntimeClass crust-microvm, each with a deferred ext4
volume of its own, started through CRI one after another, each container
writing into its volume and then sleeping; beside them as many pods of
RuntimeClass runc (the same image and command, no volume: runc has no
deferred one), started after them.

With every pod running and --settle seconds passed, counted per pod:
- memory: the PSS (/proc/PID/smaps_rollup) of every process the pod adds
  on the host: its QEMU and virtiofsd daemons (found by the pod's run
  directory in their command lines) and its shim (a shim shared by several
  pods, --shim-group node, divided among them), plus the handler's PSS
  divided among the pods; for runc, its shim and the container's processes.
  A VM's guest RAM (a memfd, mapped by QEMU and its virtiofsd daemons) is
  counted as the memory the memfd holds, instead of its mapped share: a
  restored VM holds pages its QEMU has not mapped yet. Two parts of a
  QEMU's PSS are also shown apart: TCG's translation buffer (QEMU's one
  anonymous mapping that is writable and executable: the code it
  translated), which a KVM node would not pay, and the guest's root image
  where the VMs map one (its pages counted once among the VMs that map
  them, as PSS does);
- CPU: the same processes' CPU time over --seconds, and the whole machine's.
Reported: the median per pod (min-max) and the sum over the pods, for each
runtime; and the node's daemons (handler, containerd) apart.

    .venv/bin/python bench/runtime/pod_density.py [--pods 20] [--settle 10] [--seconds 20] [--vm-source template|boot]
        [--shim-group pod|node] [--handler-arg=ARG ...] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from crust.kata.vmm.qemu import qemu_pids_under  # noqa: E402
from crust.kubelet import Container, Pod, VolumeMount  # noqa: E402
from tests.harness.cri import container_log, cri_microvm_node, shim_pids  # noqa: E402
from tests.harness.template_log import wait_for_template  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402
from tests.harness.daemons import wait_until

IDLE = "trap 'exit 0' TERM; {write}echo up; sleep 100000 & wait"
START_TIMEOUT = 300.0


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def mapping_pss_kib(pid: int, chosen) -> int:
    """The PSS of pid's mappings for which chosen(fields of the mapping's
    first line in smaps) is true."""
    total, inside = 0, False
    try:
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            fields = line.split()
            if fields and not fields[0].endswith(":"):   # a mapping's first line
                inside = chosen(fields)
            elif inside and fields[0] == "Pss:":
                total += int(fields[1])
    except OSError:
        pass
    return total


def memfd_pss_kib(pid: int) -> int:
    """The PSS of pid's mappings of memfds (a VM's guest RAM)."""
    return mapping_pss_kib(pid, lambda f: len(f) >= 6 and f[5].startswith("/memfd:"))


def tcg_buffer_kib(pid: int) -> int:
    """The PSS of TCG's translation buffer in a QEMU: its anonymous mapping
    that is readable, writable and executable."""
    return mapping_pss_kib(pid, lambda f: f[1] == "rwxp" and len(f) == 5)


def root_image_kib(pid: int) -> int:
    """The PSS of a QEMU's mapping of the guest's root image."""
    return mapping_pss_kib(pid, lambda f: len(f) >= 6 and f[5].endswith("/root.img"))


def memfd_held_kib(pids: list[int]) -> int:
    """The memory held by the memfds the processes have open (a QEMU's
    guest RAM; its virtiofsd may hold it too), each counted once, mapped
    or not."""
    held, seen = 0, set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                if not str(fd.readlink()).startswith("/memfd:"):
                    continue
                st = fd.stat()
            except OSError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                held += st.st_blocks * 512 // 1024
    return held


def pod_kib(pids: list[int]) -> int:
    """A pod's processes' PSS, their memfds counted by what they hold."""
    return sum(pss_kib(p) - memfd_pss_kib(p) for p in pids) + memfd_held_kib(pids)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """pid's children, theirs, and so on (not pid)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def vm_groups(root: Path) -> list[list[int]]:
    """Each microVM pod's host processes: its QEMU, and every process whose
    command line names the QEMU's run directory (its virtiofsd daemons)."""
    groups = []
    others = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    for vm in qemu_pids_under(root):
        inside = [part.split("/kata-state/run/", 1)[1] for part in cmdline(vm).split() if "/kata-state/run/" in part]
        run_dirs = {path.split("/", 1)[0] for path in inside}
        members = [vm] + [pid for pid in others if pid != vm and any(f"/kata-state/run/{d}/" in cmdline(pid)
                                                                     for d in run_dirs)]
        groups.append(members)
    return groups


def by_kind(pids: list[int]) -> dict[str, list[int]]:
    """A pod's processes by what they run (the program's name; crust's shim
    by its module)."""
    kinds: dict[str, list[int]] = {}
    for pid in pids:
        argv = cmdline(pid).split()
        name = "crust shim" if "crust.containerd_shim" in argv else Path(argv[0]).name if argv else "?"
        kinds.setdefault(name, []).append(pid)
    return kinds


def shim_of(shims: list[int], sandbox_id: str) -> int:
    for pid in shims:
        if f"-id {sandbox_id}" in cmdline(pid):
            return pid
    raise RuntimeError(f"no shim names sandbox {sandbox_id}")


def shim_serving(shims: list[int], task_dir: Path, sandbox_id: str) -> int:
    """The crust shim that serves the pod: the one listening at the address
    containerd keeps in the pod's bundle."""
    address = (task_dir / sandbox_id / "address").read_text().strip().removeprefix("unix://")
    for pid in shims:
        argv = cmdline(pid).split()
        if "-socket" in argv and argv[argv.index("-socket") + 1] == address:
            return pid
    raise RuntimeError(f"no shim listens at {address}, pod {sandbox_id}'s address")


def pod(n: int, runtime_class: str, image: str, pv=None) -> Pod:
    write = "echo written > /data/idle && sync && " if pv is not None else ""
    return Pod(uid=f"uid-{runtime_class}-{n}", name=f"{runtime_class}-{n}", host_network=True,
               runtime_class_name=runtime_class, restart_policy="Never", termination_grace_period_seconds=2,
               volumes={"data": pv} if pv is not None else {},
               containers=[Container("idle", image, command=["/bin/sh", "-c", IDLE.format(write=write)],
                                     volume_mounts=[VolumeMount("data", "/data")] if pv is not None else [])])


def row(values: list[float], digits: int = 1) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "sum": round(sum(values), digits), "n": len(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=20, help="pods of each runtime")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after the last start before counting")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long CPU is counted")
    parser.add_argument("--vm-source", choices=("template", "boot"), default="template",
                        help="each pod's VM restored from the handler's template, or booted for it")
    parser.add_argument("--max-memory", type=int, default=0, metavar="MIB",
                        help="the handler's --max-memory (its VMs then boot with room for a DIMM, as a node's "
                             "do by default; 0: not passed)")
    parser.add_argument("--shim-group", choices=("pod", "node"), default="",
                        help="which pods share a crust shim process (default: the shim's own default)")
    parser.add_argument("--handler-arg", action="append", default=[],
                        help="one more argument of the handler (e.g. --handler-arg=--tcg-tb-mib=64)")
    parser.add_argument("--json", help="write the results there (- for stdout)")
    args = parser.parse_args(argv)
    if benchlib.not_root("pod_density.py", "loop devices, QEMU, containerd"):
        return 1
    benchlib.raise_on_signals()
    results = benchlib.run_header("pod_density", argv, benchlib.machine(), vm=True)
    roots: list[Root] = []

    def body() -> None:
        results["load_before"] = benchlib.loadavg()
        roots.append(Root())
        root = roots[0]
        template = args.vm_source == "template"
        extra = ((("--vm-template",) if template else ()) + (("--max-memory", str(args.max_memory))
                                                               if args.max_memory else ()) + tuple(args.handler_arg))
        with cri_microvm_node(root, handler_extra=extra, shim_group=args.shim_group) as node:
            if template:
                wait_for_template(node.env.handler)
                record = json.loads((node.env.handler.state_dir / "template" / "template.json").read_text())
                results["template"] = {k: record.get(k) for k in ("saved_bytes", "ram_bytes", "boot_s")}
                print(f"template: state {record['saved_bytes']} B, RAM file {record.get('ram_bytes', 0)} B of data",
                      flush=True)
            image = node.image.name
            pods = {"crust-microvm": [], "runc": []}
            started = time.monotonic()
            for n in range(args.pods):
                pv = node.pv(f"pv-density-{n}", "ext4", size=64 * 1024**2)
                made = pod(n, "crust-microvm", image, pv)
                node.kubelet.start_pod(pv, made)
                pods["crust-microvm"].append((made, pv, node.runtime.run_pod(made)))
            for n in range(args.pods):
                made = pod(n, "runc", image)
                pods["runc"].append((made, None, node.runtime.run_pod(made)))
            for made, _, _ in pods["crust-microvm"] + pods["runc"]:
                status = node.runtime.pod_status(made).latest("idle")
                wait_until(lambda s=status: "up" in container_log(s), timeout=START_TIMEOUT, what=f"{made.name} to run")
            results["start_seconds"] = round(time.monotonic() - started, 1)
            print(f"{args.pods} microVM pods and {args.pods} runc pods running after "
                  f"{results['start_seconds']} s; load {benchlib.loadavg()}", flush=True)
            time.sleep(args.settle)
            handler = node.env.handler.proc.pid
            shims = shim_pids(node.containerd)
            groups = {"crust-microvm": [], "runc": []}
            vms = vm_groups(root.path)
            if len(vms) != args.pods:
                raise RuntimeError(f"expected {args.pods} VMs, found {len(vms)}")
            results["accelerator"] = "kvm" if "-accel kvm" in cmdline(vms[0][0]) else "tcg"
            # A pod's shim: its own, or its share of one that serves several.
            pod_shims: dict[str, list[int]] = {"crust-microvm": [], "runc": []}
            for _, _, sandbox_id in pods["crust-microvm"]:
                (vm,) = [g for g in vms if f"crust-{sandbox_id}" in cmdline(g[0])]
                groups["crust-microvm"].append(vm)
                pod_shims["crust-microvm"].append(shim_serving(shims, node.containerd.task_dir, sandbox_id))
            served = {pid: pod_shims["crust-microvm"].count(pid) for pid in pod_shims["crust-microvm"]}
            shared = any("-shared" in cmdline(pid).split() for pid in served)
            results["shims"] = {"group": "node" if shared else "pod", "crust-microvm": len(served),
                                "pods_per_shim": max(served.values())}
            for _, _, sandbox_id in pods["runc"]:
                shim = shim_of(shims, sandbox_id)
                groups["runc"].append([shim, *descendants(shim)])
            daemons = {"handler": [handler], "containerd": [node.containerd.process.pid]}
            every = [pid for g in groups.values() for members in g for pid in members]
            every += [*served, handler, node.containerd.process.pid]
            before, busy_before, at = {p: benchlib.cpu_ns(p) for p in every}, benchlib.machine_ticks()[0], \
                time.monotonic()
            time.sleep(args.seconds)
            after, busy_after = {p: benchlib.cpu_ns(p) for p in every}, benchlib.machine_ticks()[0]
            elapsed = time.monotonic() - at

            def cores(pids: list[int]) -> float:
                return sum(after[p] - before[p] for p in pids) / 1e9 / elapsed

            handler_pss = pss_kib(handler)
            shim_pss = {pid: pss_kib(pid) for pid in served}
            results["columns"] = {}
            for runtime, members in groups.items():
                share = handler_pss / args.pods if runtime == "crust-microvm" else 0
                shim_kib = [shim_pss[pid] / served[pid] for pid in pod_shims[runtime]] or [0.0] * len(members)
                shim_cores = [cores([pid]) / served[pid] for pid in pod_shims[runtime]] or [0.0] * len(members)
                memory = [(pod_kib(g) + share + s) / 1024 for g, s in zip(members, shim_kib)]
                tcg = [sum(tcg_buffer_kib(p) for p in g) / 1024 for g in members]
                cpu = [cores(g) + s for g, s in zip(members, shim_cores)]
                kinds: dict[str, list[float]] = {}
                for g, s in zip(members, shim_kib):
                    for kind, pids in by_kind(g).items():
                        kinds.setdefault(kind, []).append(sum(pss_kib(p) - memfd_pss_kib(p) for p in pids) / 1024)
                    if runtime == "crust-microvm":
                        kinds.setdefault("crust shim", []).append(s / 1024)
                        kinds.setdefault("guest RAM", []).append(memfd_held_kib(g) / 1024)
                        kinds.setdefault("TCG translation buffer", []).append(sum(tcg_buffer_kib(p) for p in g) / 1024)
                        kinds.setdefault("guest root image", []).append(sum(root_image_kib(p) for p in g) / 1024)
                results["columns"][runtime] = {"pss_mib": row(memory), "cores": row(cpu, 4),
                                               "pss_mib_without_tcg_buffer": row([m - t for m, t in zip(memory, tcg)]),
                                               "processes_per_pod": row([len(g) + (1 / served[pid] if pid else 0)
                                                                         for g, pid in zip(members, pod_shims[runtime]
                                                                                           or [0] * len(members))], 2),
                                               "pss_mib_by_process": {k: row(v) for k, v in sorted(kinds.items())}}
            results["daemons"] = {name: {"pss_mib": round(sum(pss_kib(p) for p in pids) / 1024, 1),
                                         "cores": round(cores(pids), 4)}
                                  for name, pids in daemons.items()}
            results["machine_cores"] = round((busy_after - busy_before) / benchlib.TICK / elapsed, 3)
            for made, pv, _ in pods["crust-microvm"] + pods["runc"]:
                node.runtime.kill_pod(made)
                node.runtime.remove_pod(made)
                if pv is not None:
                    node.kubelet.stop_pod(pv, made)
        results["load_after"] = benchlib.loadavg()
        print(f"\n{args.pods} idle pods of each runtime (microVMs: {args.vm_source}, {results['accelerator']}), "
              f"{benchlib.machine_summary(results['machine'])}; "
              f"counted {args.seconds:g} s after {args.settle:g} s")
        for runtime, column in results["columns"].items():
            m, c = column["pss_mib"], column["cores"]
            print(f"  {runtime:14s} PSS per pod {m['median']} MiB ({m['min']}-{m['max']}), {m['sum']} MiB in all; "
                  f"CPU per pod {c['median']} cores ({c['min']}-{c['max']}), {c['sum']} in all; "
                  f"without TCG's translation buffer {column['pss_mib_without_tcg_buffer']['median']} MiB")
            print("    of it: " + ", ".join(f"{kind} {r['median']} MiB"
                                        for kind, r in column["pss_mib_by_process"].items()))
        for name, row_ in results["daemons"].items():
            print(f"  {name:14s} PSS {row_['pss_mib']} MiB, CPU {row_['cores']} cores")
        print(f"  crust shims    {results['shims']['crust-microvm']} ({results['shims']['group']}), "
              f"at most {results['shims']['pods_per_shim']} pods each")
        print(f"  machine        {results['machine_cores']} cores busy")
        print(f"load {results['load_before']} before, {results['load_after']} after")

    return benchlib.guarded_run_then_write(body, benchlib.roots_cleanup(roots), benchlib.report_failure, args.json,
                                           results)


if __name__ == "__main__":
    sys.exit(main())
