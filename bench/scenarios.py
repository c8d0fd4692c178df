"""The scenarios of docs/performance.md (bench/render.py): which committed
results are runs of each, and the table its newest run makes.

A scenario is one bench under one setting. Which runs belong to it is read
from the result itself (its benchmark, its command line, the settings its
figures are keyed by), so that a new result file of the same setting
becomes the scenario's current table without an edit here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

NR = "not recorded"


@dataclass(frozen=True)
class Scenario:
    id: str
    title: str
    benchmark: str
    table: Callable[[dict], tuple[list[str], list[list]]]
    command: str  # how to reproduce it when no result is committed
    anchor: str = ""  # what the figures are held against, when the table has no anchor column
    has: str = ""  # a key the result's "results" must hold
    flags: tuple[str, ...] = ()  # words its command line must hold
    without: tuple[str, ...] = ()  # words its command line must not hold

    def matches(self, name: str, result: dict) -> bool:
        if result.get("benchmark") != self.benchmark:
            return False
        words = str(result.get("command", "")).split()
        joined = " ".join(words)
        if any(flag not in joined for flag in self.flags) or any(w in words for w in self.without):
            return False
        return not self.has or self.has in result.get("results", {})


# -- how a figure reads -------------------------------------------------------------------------


def num(x) -> str:
    if isinstance(x, float):
        return f"{x:g}"
    return NR if x is None else str(x)


def spread(d: dict | None, suffix: str = "") -> str:
    """A summary (median or p50, p90, min, max, n) as "median (p90 x; min-max; n)"."""
    if not isinstance(d, dict):
        return NR
    mid = d.get("median", d.get("p50", d.get("median_ms")))
    lo, hi = d.get("min", d.get("min_ms")), d.get("max", d.get("max_ms"))
    extra = []
    if "p90" in d:
        extra.append(f"p90 {num(d['p90'])}")
    if "p99" in d:
        extra.append(f"p99 {num(d['p99'])}")
    if lo is not None and hi is not None:
        extra.append(f"{num(lo)}–{num(hi)}")
    if "n" in d:
        extra.append(f"n {d['n']}")
    return f"{num(mid)}{suffix}" + (f" ({'; '.join(extra)})" if extra else "")


def middle(d: dict | None) -> float | None:
    if not isinstance(d, dict):
        return None
    return d.get("median", d.get("p50", d.get("median_ms")))


def ratio(ours, anchor) -> str:
    return f"{ours / anchor:.2f}×" if isinstance(ours, (int, float)) and anchor else NR


# -- the tables ----------------------------------------------------------------------------------

POD_START_ROWS = ("to_first_write_ms", "RunPodSandbox_ms", "CreateContainer_ms", "StartContainer_ms",
                  "StopPodSandbox_ms", "stop_to_vm_gone_ms", "handler_CreatePod_ms", "handler_CreateContainer_ms",
                  "handler_StartProcess_ms", "handler_mount_ahead_ms")
FLOOR = "floor (bare boot to poweroff)"


def pod_start_microvm(setting: str):
    def make(result: dict):
        part = result["results"][setting]
        rows = [[key.removesuffix("_ms"), spread(part.get(key))] for key in POD_START_ROWS if key in part]
        floor = result["results"].get(FLOOR, {}).get("boot_to_exit_ms")
        rows.append(["anchor: a bare VM, boot to poweroff (same run)", spread(floor) if floor else NR])
        return ["step (ms)", f"crust-microvm, {setting}: median (p90; min–max; n)"], rows
    return make


def pod_start_buses(result: dict):
    settings = list(result["results"])
    keys = ("to_first_write_ms", "RunPodSandbox_ms", "StartContainer_ms", "handler_CreateContainer_ms",
            "handler_mount_ahead_ms")
    rows = [[key.removesuffix("_ms"), *(num(middle(result["results"][s].get(key))) for s in settings)]
            for key in keys]
    return ["step, median (ms)", *settings], rows


def runc_against_microvm(figures_key: str, unit: str):
    """Figures keyed "runc: X" and "crust-microvm: X": runc is the anchor."""
    def make(result: dict):
        figures = result[figures_key]
        names = [k.split(": ", 1)[1] for k in figures if k.startswith("runc: ")]
        rows = []
        for name in names:
            ours, anchor = figures.get(f"crust-microvm: {name}"), figures.get(f"runc: {name}")
            rows.append([name, spread(ours), spread(anchor), ratio(middle(ours), middle(anchor))])
        return [f"operation ({unit})", "crust-microvm", "anchor: runc", "crust-microvm / runc"], rows
    return make


def pod_logs(result: dict):
    header, rows = runc_against_microvm("figures", "ms")(result)
    rate = result.get("rate_mib_per_s", {})
    rows.append(["rate (MiB/s)", spread(rate.get("crust-microvm")), spread(rate.get("runc")),
                 ratio(middle(rate.get("crust-microvm")), middle(rate.get("runc")))])
    rows.append(["guest CPUs; busy host CPUs", f"{num(result.get('guest_cpus'))}; {num(result.get('busy_host_cpus'))}",
                 "", ""])
    return header, rows


def named_rows(key: str, label: str):
    def make(result: dict):
        return [label, "median (min–max)"], [[name, spread(d)] for name, d in result[key].items()]
    return make


def agent_port(result: dict):
    header, rows = named_rows("ways", "way (ms)")(result)
    for name, rate in result.get("output_mib_per_s", {}).items():
        rows.append([f"{name}: output (MiB/s)", num(rate)])
    for name, kib in result.get("agent_memory_kib", {}).items():
        rows.append([f"agent memory {name} (KiB)", num(kib)])
    return header, rows


def kata_bench(result: dict):
    p1, p2, p3 = result.get("part1", {}), result.get("part2", {}), result.get("part3", {})
    rows = [[f"1: {k.removesuffix('_ms')}", spread(p1.get(k))]
            for k in ("run_sandbox_ms", "boot_ms", "after_boot_ms", "delete_sandbox_ms") if k in p1]
    rows += [[f"2: {path.split(' (')[0]}", spread(d)] for path, d in p2.get("paths", {}).items()]
    rows += [[f"3: {k.removesuffix('_ms')}", spread(p3.get(k))]
             for k in ("controller_expand_ms", "node_expand_ms", "stats_seen_ms", "round_trip_ms") if k in p3]
    return ["part: step (ms)", "median (p90; min–max; n)"], rows


def pod_idle_cpu(result: dict):
    rows = [[name, spread(c.get("qemu_cores")), spread(c.get("machine_cores"))]
            for name, c in result["columns"].items()]
    return ["what runs", "QEMU (cores)", "the machine (cores)"], rows


def pod_density(result: dict):
    ours, anchor = result["columns"].get("crust-microvm", {}), result["columns"].get("runc", {})
    rows = []
    for key, label in (("pss_mib", "PSS per pod (MiB)"), ("cores", "CPU per idle pod (cores)"),
                       ("processes_per_pod", "processes per pod")):
        rows.append([label, spread(ours.get(key)), spread(anchor.get(key)),
                     ratio(middle(ours.get(key)), middle(anchor.get(key)))])
    for name, d in ours.get("pss_mib_by_process", {}).items():
        rows.append([f"  of which {name} (MiB)", num(middle(d)), "", ""])
    for name, d in result.get("daemons", {}).items():
        rows.append([f"node daemon {name}: PSS (MiB); cores", f"{num(d.get('pss_mib'))}; {num(d.get('cores'))}", "",
                     ""])
    return ["per pod (20 idle pods)", "crust-microvm", "anchor: runc", "crust-microvm / runc"], rows


def pod_burst(result: dict):
    rows = []
    for setting, part in result["results"].items():
        ours, anchor = part.get("crust-microvm", {}), part.get("runc", {})
        rows.append([f"{setting}: pod start (s)", spread(ours), spread(anchor), ratio(middle(ours), middle(anchor))])
        rows.append([f"{setting}: all running (s)", num(ours.get("all_running_s")), num(anchor.get("all_running_s")),
                     ratio(ours.get("all_running_s"), anchor.get("all_running_s"))])
        rows.append([f"{setting}: machine CPU per pod (s)", num(ours.get("machine_cpu_s_per_pod")),
                     num(anchor.get("machine_cpu_s_per_pod")),
                     ratio(ours.get("machine_cpu_s_per_pod"), anchor.get("machine_cpu_s_per_pod"))])
    return ["pods asked for at once", "crust-microvm", "anchor: runc", "crust-microvm / runc"], rows


def pod_churn(result: dict):
    rows = [[f"life, {kind} (s)", spread(d)] for kind, d in result.get("seconds_by_kind", {}).items()]
    growth = result.get("growth", {})
    for key, d in growth.items():
        if isinstance(d, dict):
            rows.append([f"{key}: lives {growth.get('early_lives', NR)} → last",
                         f"{num(d.get('early'))} → {num(d.get('last'))} (×{num(d.get('ratio'))})"])
    rows.append(["left on the node after the last life", ", ".join(sorted(result.get("left") or {})) or "nothing"])
    return ["measure", "value"], rows


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("pod-start-microvm-cold", "Pod start, crust-microvm, a VM booted per pod", "pod_start_microvm",
             pod_start_microvm("pool 0"), ".venv/bin/python bench/pod_start_microvm.py --pools 0",
             anchor="runc through the same containerd (bench/pod_start.py): not recorded in bench/results/.",
             has="pool 0", without=("--cpus", "--disk-buses")),
    Scenario("pod-start-microvm-template", "Pod start, crust-microvm, VMs cloned from a template",
             "pod_start_microvm", pod_start_microvm("template"),
             ".venv/bin/python bench/pod_start_microvm.py --pools template",
             anchor="runc through the same containerd (bench/pod_start.py): not recorded in bench/results/.",
             has="template", without=("--cpus", "--disk-buses")),
    Scenario("pod-start-microvm-pool", "Pod start, crust-microvm, a VM from a warm pool", "pod_start_microvm",
             pod_start_microvm("pool 1"), ".venv/bin/python bench/pod_start_microvm.py --pools 1",
             anchor="runc through the same containerd (bench/pod_start.py): not recorded in bench/results/.",
             has="pool 1", without=("--cpus", "--disk-buses")),
    Scenario("pod-start-microvm-buses", "Pod start on each disk bus", "pod_start_microvm", pod_start_buses,
             ".venv/bin/python bench/pod_start_microvm.py --pools 0,template,1 --disk-buses virtio-blk,virtio-scsi",
             flags=("--disk-buses",)),
    Scenario("pod-exec", "ExecSync into a running container", "pod_exec", runc_against_microvm("figures", "ms"),
             ".venv/bin/python bench/pod_exec.py --rounds 5"),
    Scenario("pod-logs", "A container's logs, host idle", "pod_logs", pod_logs,
             ".venv/bin/python bench/pod_logs.py --rounds 5 --busy 0", flags=("--busy 0",)),
    Scenario("pod-logs-busy", "A container's logs, both host CPUs busy", "pod_logs", pod_logs,
             ".venv/bin/python bench/pod_logs.py --rounds 5 --busy 2", flags=("--busy 2",)),
    Scenario("guest-crun", "The guest's OCI runtime", "guest_crun", named_rows("variants", "what runs (ms)"),
             ".venv/bin/python bench/guest_crun.py --rounds 5",
             anchor="no OCI runtime (`bench/guest_maker.c` doing the spec's parts) and `sh -c true`, rows of the "
                    "same run."),
    Scenario("agent-port", "The guest agent's transport", "agent_port", agent_port,
             ".venv/bin/python bench/agent_port.py --rounds 5"),
    Scenario("microvm-handler", "The microVM handler: sandboxes, stats, expansion", "kata_bench", kata_bench,
             ".venv/bin/python bench/kata_bench.py --parts 1,2,3 --runs 3 --stats-rounds 50"),
    Scenario("pod-idle-cpu", "An idle pod's CPU", "pod_idle_cpu", pod_idle_cpu,
             ".venv/bin/python bench/pod_idle_cpu.py",
             anchor="the floor row: a VM alone, with no pod in it (same run)."),
    Scenario("pod-density", "Idle pods on one node", "pod_density", pod_density,
             ".venv/bin/python bench/pod_density.py --pods 20"),
    Scenario("pod-burst", "Pods asked for at once", "pod_burst", pod_burst,
             ".venv/bin/python bench/pod_burst.py --pods 20 --settings template,pool4"),
    Scenario("pod-churn", "Pod lives one after another", "pod_churn", pod_churn,
             ".venv/bin/python bench/pod_churn.py --lives 1000",
             anchor="the issue's limit: no more than 5% growth of the daemons' memory and descriptors."),
)


# -- benches with no committed result yet ---------------------------------------------------------

_HEADER_KEYS = {"benchmark", "command", "date", "machine", "commit", "dirty", "dirty_paths", "code", "accelerator",
                "accel", "load_before", "load_after", "load", "loadavg_start", "loadavg_end", "load_start", "args"}


def flat(result: dict):
    """Any result: its figures, one row per summary or number, in the order
    the bench wrote them (at most 40 rows)."""
    rows: list[list] = []

    def walk(prefix: str, value) -> None:
        if len(rows) >= 40:
            return
        if isinstance(value, dict) and middle(value) is not None:
            rows.append([prefix, spread(value)])
        elif isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix} / {key}" if prefix else key, sub)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            rows.append([prefix, num(value)])

    for key, value in result.items():
        if key not in _HEADER_KEYS:
            walk(key, value)
    return ["figure", "value"], rows


def _pending(id: str, title: str, bench: str, command: str, anchor: str = "") -> Scenario:
    return Scenario(id, title, bench, flat, f".venv/bin/python bench/{bench}.py {command}".rstrip(), anchor=anchor)


SCENARIOS += (
    _pending("hop-cost", "What each hop costs: driver, shim, proxy", "hop_cost", "--rounds 500 --cpu-calls 3000 --bare",
             anchor="the driver alone, and `bench/bare_hop.py` forwarding raw bytes (`--bare`)."),
    _pending("shim-passthrough", "Passthrough against the driver", "shim_latency", "--rounds 300 --publishes 40",
             anchor="the same RPC sent straight to the driver, interleaved."),
    _pending("driver-lifecycle", "Driver lifecycle at 10 and 1,000 volumes", "driver_lifecycle", "--json OUT.json"),
    _pending("handler", "The mount-namespace runtime handler", "handler_bench", "--json OUT.json"),
    _pending("proxy", "The proxy", "proxy_bench", "--json OUT.json"),
    _pending("peer-gate", "The peer gate on the runtime socket", "peer_gate", "--calls 4000 --json OUT.json",
             anchor="the same server on a plain socket, interleaved."),
    _pending("large-requests", "Memory under large requests", "large_requests", "--json OUT.json"),
    _pending("luks-io", "Encrypted volumes in the guest", "luks_io", "--json OUT.json",
             anchor="the same volume unencrypted, in the same guest."),
    _pending("pod-start-runc", "Pod start through containerd, runc and crust-runc", "pod_start", "--json OUT.json",
             anchor="plain runc through the same containerd."),
    _pending("guest-boot", "The guest's boot", "guest_boot", "--json OUT.json"),
    _pending("pod-share", "The pod's shared directory", "pod_share", "--json OUT.json"),
    _pending("pod-network", "The pod's network", "pod_network", "--json OUT.json",
             anchor="runc's pod network on the same node, interleaved."),
    _pending("file-io", "Small files on the event loop", "file_io", "--json OUT.json"),
    _pending("scale-deferred", "1,000 deferred volumes", "scale_deferred", "--volumes 1000 --json OUT.json"),
    _pending("conformance", "The conformance suite against the Go reference", "conformance_ratio", "--json OUT.json",
             anchor="the Go hostpath plugin running the same suite."),
    _pending("call-cpu", "CPU per CSI call", "call_cpu", "--json OUT.json",
             anchor="`bench/bare_hop.py`, a hop that forwards raw bytes."),
)
