"""The scenarios of docs/performance.md (bench/lib/render.py): which committed
results are runs of each, and the table its newest run makes.

A scenario is one bench under one setting. Which runs belong to it is read
from the result itself (its benchmark, its command line, the settings its
figures are keyed by), so that a new result file of the same setting
becomes the scenario's current table without an edit here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.lib.run_record import script_of

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
# runc's pod start is a bench and a run of its own, a table further down.
RUNC_POD_START = ("runc through containerd, a run of its own: bench/runtime/pod_start.py, "
                  "\"Pod start through containerd, runc and crust-runc\" below.")


def pod_start_microvm(setting: str):
    def make(result: dict):
        part = result["results"][setting]
        rows = [[key.removesuffix("_ms"), spread(part.get(key))] for key in POD_START_ROWS if key in part]
        floor = result["results"].get(FLOOR, {}).get("boot_to_exit_ms")
        rows.append(["anchor: a bare VM, boot to poweroff (same run)", spread(floor) if floor else NR])
        return ["step (ms)", f"crust-microvm, {setting}: median (p90; min–max; n)"], rows
    return make


BESIDE_ROWS = ("RunPodSandbox_ms",)


def pod_start_beside(*settings: str):
    """Each setting's main steps now and at the commit before (the result's
    "before", bench/lib/beside.py); for a node's first pods, each one's
    RunPodSandbox in order, when the template was saved, and each run's load."""
    def make(result: dict):
        before = result.get("before", {})
        columns = []
        for setting in settings:
            for label, run in ((setting, result), (f"{setting}, before ({before.get('code', NR)})", before)):
                if setting in run.get("results", {}):
                    columns.append((label, run, run["results"][setting]))
        rows = [[key.removesuffix("_ms"), *(spread(c.get(key)) for _, _, c in columns)] for key in BESIDE_ROWS]
        rows.append(["the node's pods in order, RunPodSandbox (ms; * restored)",
                     *(", ".join(f"{p['RunPodSandbox_ms']:.0f}{'*' if p.get('template_saved') else ''}"
                                 for p in run.get("first_pods", [])) for _, run, _ in columns)])
        rows.append(["the template saved, seconds after the handler's start",
                     *(num(run.get("template_saved_after_s")) for _, run, _ in columns)])
        rows.append(["load (1, 5, 15 min) before; after",
                     *(f"{run.get('load_before', NR)}; {run.get('load_after') or run.get('load', NR)}"
                       for _, run, _ in columns)])
        return ["step (ms): median (p90; min–max; n)", *(label for label, _, _ in columns)], rows
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


def with_before(make):
    """make's table with a column of the crust-microvm figures the bench
    measured at the commit before (result["before"]: the same figures, run
    right after or before this one on the same machine), when it has them."""
    def wrapped(result: dict):
        header, rows = make(result)
        before = result.get("before")
        if not isinstance(before, dict) or "code" not in before:
            return header, rows
        _header, old = make({**result, **before})
        by_name = {row[0]: row[1] for row in old}
        return ([header[0], header[1], f"{header[1]} at {before['code']}", *header[2:]],
                [[row[0], row[1], by_name.get(row[0], ""), *row[2:]] for row in rows])
    return wrapped


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
    pods = middle(ours.get("pss_mib")) and ours["pss_mib"].get("n")
    return [f"per pod ({pods or NR} idle pods)", "crust-microvm", "anchor: runc", "crust-microvm / runc"], rows


def shim_memory(result: dict):
    """pod_density's rows that the shim moves: a pod's PSS and the shim's."""
    header, rows = pod_density(result)
    return header, [row for row in rows if row[0] in ("PSS per pod (MiB)", "  of which crust shim (MiB)")]


def pod_density_beside(result: dict):
    """crust-microvm's idle pods now and at the commit before (the result's
    "before", bench/beside.py), runc of the newer run as the anchor."""
    before = result.get("before", {})
    runs = [("crust-microvm", result["columns"].get("crust-microvm", {})),
            (f"crust-microvm, before ({before.get('code', NR)})", before.get("columns", {}).get("crust-microvm", {})),
            ("anchor: runc", result["columns"].get("runc", {}))]
    rows = [[label, *(spread(c.get(key)) for _, c in runs)]
            for key, label in (("pss_mib", "PSS per pod (MiB)"), ("cores", "CPU per idle pod (cores)"))]
    names = sorted({n for _, c in runs[:2] for n in c.get("pss_mib_by_process", {})})
    rows += [[f"  of which {n} (MiB)", *(num(middle(c.get("pss_mib_by_process", {}).get(n))) for _, c in runs[:2]),
              ""] for n in names]
    rows.append(["load (1, 5, 15 min) before; after", f"{result.get('load_before')}; {result.get('load_after')}",
                 f"{before.get('load_before', NR)}; {before.get('load_after', NR)}", ""])
    return ["per idle pod", *(label for label, _ in runs)], rows


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


def pod_exec_longevity(result: dict):
    """One row per block of execs, then the last block's median over the first's."""
    rows = []
    for block in result.get("blocks", []):
        rows.append([f"up to {block.get('execs')}",
                     *(f"{num(block.get(name, {}).get('median_ms'))} (p90 {num(block.get(name, {}).get('p90_ms'))})"
                       for name in ("runc", "crust-microvm")),
                     num(block.get("handler_rss_mb")), num(block.get("pod_record_bytes"))])
    ratios = result.get("last_over_first", {})
    rows.append(["last block / first", f"×{num(ratios.get('runc'))}", f"×{num(ratios.get('crust-microvm'))}",
                 "", ""])
    return ["execs", "runc: median ms", "crust-microvm: median ms", "handler RSS (MB)", "pod record (bytes)"], rows


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("pod-start-microvm-cold", "Pod start, crust-microvm, a VM booted per pod", "pod_start_microvm",
             pod_start_microvm("pool 0"), ".venv/bin/python bench/runtime/pod_start_microvm.py --pools 0",
             anchor=RUNC_POD_START,
             has="pool 0", without=("--cpus", "--disk-buses")),
    Scenario("pod-start-microvm-template", "Pod start, crust-microvm, VMs cloned from a template",
             "pod_start_microvm", pod_start_microvm("template"),
             ".venv/bin/python bench/runtime/pod_start_microvm.py --pools template",
             anchor=RUNC_POD_START,
             has="template", without=("--cpus", "--disk-buses")),
    Scenario("pod-start-microvm-first-pods",
             "Pod start, crust-microvm, a node's first pods beside the template's making",
             "pod_start_microvm", pod_start_beside("template-first", "template"),
             ".venv/bin/python bench/runtime/pod_start_microvm.py --pools template-first,template --floor-boots 0",
             has="template-first", without=("--cpus", "--disk-buses")),
    Scenario("pod-start-microvm-pool", "Pod start, crust-microvm, a VM from a warm pool", "pod_start_microvm",
             pod_start_microvm("pool 1"), ".venv/bin/python bench/runtime/pod_start_microvm.py --pools 1",
             anchor=RUNC_POD_START,
             has="pool 1", without=("--cpus", "--disk-buses")),
    Scenario("pod-start-microvm-buses", "Pod start on each disk bus", "pod_start_microvm", pod_start_buses,
             ".venv/bin/python bench/runtime/pod_start_microvm.py --pools 0,template,1 --disk-buses virtio-blk,virtio-scsi",
             flags=("--disk-buses",)),
    Scenario("pod-exec", "ExecSync into a running container", "pod_exec",
             with_before(runc_against_microvm("figures", "ms")),
             ".venv/bin/python bench/runtime/pod_exec.py --rounds 5"),
    Scenario("pod-exec-longevity", "Many execs into one container (an exec probe for weeks)", "pod_exec_longevity",
             pod_exec_longevity, ".venv/bin/python bench/runtime/pod_exec_longevity.py --execs 10000 --block 1000",
             anchor="the first block of the same run: the last within 10% of it, for both runtimes."),
    Scenario("pod-logs", "A container's logs, host idle", "pod_logs", with_before(pod_logs),
             ".venv/bin/python bench/runtime/pod_logs.py --rounds 5 --busy 0", flags=("--busy 0",)),
    Scenario("pod-logs-busy", "A container's logs, both host CPUs busy", "pod_logs", with_before(pod_logs),
             ".venv/bin/python bench/runtime/pod_logs.py --rounds 5 --busy 2", flags=("--busy 2",)),
    Scenario("guest-crun", "The guest's OCI runtime", "guest_crun", named_rows("variants", "what runs (ms)"),
             ".venv/bin/python bench/microvm/guest_crun.py --rounds 5",
             anchor="no OCI runtime (`bench/microvm/guest_maker.c` doing the spec's parts) and `sh -c true`, rows of the "
                    "same run."),
    Scenario("agent-port", "The guest agent's transport", "agent_port", agent_port,
             ".venv/bin/python bench/microvm/agent_port.py --rounds 5"),
    Scenario("microvm-handler", "The microVM handler: sandboxes, stats, expansion", "kata_bench", kata_bench,
             ".venv/bin/python bench/microvm/kata_bench.py --parts 1,2,3 --runs 3 --stats-rounds 50"),
    Scenario("pod-idle-cpu", "An idle pod's CPU", "pod_idle_cpu", pod_idle_cpu,
             ".venv/bin/python bench/runtime/pod_idle_cpu.py",
             anchor="the floor row: a VM alone, with no pod in it (same run)."),
    Scenario("pod-density", "Idle pods on one node", "pod_density", pod_density,
             ".venv/bin/python bench/runtime/pod_density.py --pods 20", flags=("--pods 20",)),
    Scenario("pod-density-shim", "The shim's memory: ttrpc to the handler against gRPC (a few idle pods)",
             "pod_density", with_before(shim_memory), ".venv/bin/python bench/runtime/pod_density.py --pods 4",
             flags=("--pods 4",)),
    Scenario("pod-density-beside", "Idle pods restored from the template, beside the commit before",
             "pod_density", pod_density_beside,
             ".venv/bin/python bench/runtime/pod_density.py --pods 5 --vm-source template", flags=("--pods 5",)),
    Scenario("pod-burst", "Pods asked for at once", "pod_burst", pod_burst,
             ".venv/bin/python bench/runtime/pod_burst.py --pods 20 --settings template,pool4"),
    Scenario("pod-churn", "Pod lives one after another", "pod_churn", pod_churn,
             ".venv/bin/python bench/runtime/pod_churn.py --lives 1000",
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
    return Scenario(id, title, bench, lambda result: TABLES.get(bench, flat)(result),
                    f".venv/bin/python {script_of(bench)} {command}".rstrip(), anchor=anchor)


# -- the tables of the CSI path's benches ---------------------------------------------------------
# Each keeps to a few rows (docs/performance.md stays under 600 lines): a
# cell says what its figure is when the row's label does not.


def sig(x, digits: int = 3) -> str:
    """A figure to `digits` significant digits (at least the units)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return NR if x is None else str(x)
    if isinstance(x, int) or abs(x) >= 10 ** digits:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def signed(x) -> str:
    """A difference, its sign always shown; "-" if there is none."""
    return f"{x:+.3g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def p50_p90(d: dict | None, stem: str = "", n: bool = True) -> str:
    """"median (p90 x)" of a dict keyed STEM_p50_ms / STEM_p90_ms, or of a
    summary (median / p50 / median_ms / p50_ms; p90 / p90_ms; n)."""
    if not isinstance(d, dict):
        return NR
    pre = f"{stem}_" if stem else ""
    mid = next((d[k] for k in (f"{pre}p50_ms", f"{pre}median_ms", f"{pre}median", f"{pre}p50") if k in d), None)
    if mid is None:
        return NR
    extra = [f"p90 {sig(d[k])}" for k in (f"{pre}p90_ms", f"{pre}p90") if k in d][:1]
    if not stem and n and "n" in d:
        extra.append(f"n {d['n']}")
    return sig(mid) + (f" ({'; '.join(extra)})" if extra else "")


def hop_cost(result: dict):
    part1, part2 = result.get("part1", {}), result.get("part2", {})
    variants = list(result.get("variants", {}))
    rpcs = list(part1)
    rows = []
    for v in variants:
        doors = []
        for rpc in rpcs:
            d = part1[rpc].get(v, {})
            doors.append(" → ".join(sig(d.get(f"{door}_p50_ms", "-")) for door in ("driver", "shim", "proxy"))
                         if "not_measured" not in d else "-")
        rows.append([f"{v}: driver → shim → proxy, median", *doors])
        hops = []
        for rpc in rpcs:
            d = part1[rpc].get(v, {})
            hops.append(f"{signed(d.get('shim_hop_ms'))}; {signed(d.get('proxy_hop_ms'))}"
                        if "not_measured" not in d and "proxy_hop_ms" in d else "-")
        rows.append([f"{v}: shim hop; proxy hop", *hops])
    for v in variants:
        doors = part2.get(v, {})
        if doors:
            cells = [f"sent to the {door}: " + " + ".join(f"{k} {sig(c.get(k))}" for k in ("driver", "shim", "proxy"))
                     + f" = {sig(c.get('chain'))}" for door, c in doors.items()]
            rows.append([f"{v}: CPU per Probe (ms), every daemon's", *cells, *[""] * (len(rpcs) - len(cells))])
    return ["ms", *rpcs], rows


def shim_latency(result: dict):
    through = result.get("passthrough", {})
    rpcs = list(through)
    rows = [["direct to the driver, median (p90)", *(p50_p90(through[r], "direct") for r in rpcs)],
            ["through the shim, median (p90)", *(p50_p90(through[r], "shim") for r in rpcs)],
            ["added by the shim, median", *(signed(through[r].get("added_p50_ms")) for r in rpcs)]]
    pub = result.get("publish", {})
    if pub:
        cells = [f"deferred: {p50_p90(pub, 'deferred')}", f"host mount: {p50_p90(pub, 'host')}",
                 f"host / deferred: {sig(pub.get('host_over_deferred'))}×"]
        rows.append([f"NodePublishVolume through the shim ({pub.get('fs', NR)}, {pub.get('n', NR)} each)", *cells,
                     *[""] * (len(rpcs) - len(cells))])
    return ["ms", *rpcs], rows


def proxy_bench(result: dict):
    part1, part2, part3 = result.get("part1", {}), result.get("part2", {}), result.get("part3", {})
    rpcs = part1.get("rpcs", {})
    names = list(rpcs)
    width = len(names)

    def pad(cells: list) -> list:
        return [*cells, *[""] * (width - len(cells))]

    rows = [["shim, direct: median (p90)", *(p50_p90(rpcs[n], "direct") for n in names)],
            ["through the proxy: median (p90)", *(p50_p90(rpcs[n], "proxy") for n in names)],
            ["added by the proxy, median", *(signed(rpcs[n].get("added_p50_ms")) for n in names)]]
    if part2:
        rows.append(["deferred volume's stats (RuntimeGetVolumeStats)", *pad([
            f"handler socket: {p50_p90(part2.get('handler_socket'))}",
            f"runtime-cli (sh): {p50_p90(part2.get('runtime_cli'))}",
            f"runtime-cli / handler: {sig(part2.get('cli_over_socket'))}×",
            f"for scale, runtime-cli (python -S): {p50_p90(part2.get('for_scale_runtime_cli_python_S'))}"])])
    for n in part3.get("scales", []):
        key = str(n)

        def at(name: str) -> str:
            return p50_p90(part3.get(name, {}).get(key))

        rows.append([f"fake plugin, {n} deferred volumes", *pad([
            f"publish (fill): {at('ramp_publish')}", f"unpublish (drain): {at('ramp_unpublish')}",
            f"publish (churn): {at('churn_publish')}", f"unpublish (churn): {at('churn_unpublish')}",
            f"proxy CPU per churn round: {sig(part3.get('churn_proxy_cpu_ms_per_round', {}).get(key))}",
            f"proxy RSS: {sig(part3.get('rss_mib_full', {}).get(key))} MiB"])])
    return ["ms", *names], rows


def peer_gate(result: dict):
    rows = [[f"{name} socket", p50_p90(result.get(name)), sig(result.get(name, {}).get("server_cpu_ms_per_call"))]
            for name in ("plain", "gated")]
    rows.append(["added by the gate", signed(result.get("added_median_ms")),
                 signed(result.get("added_cpu_ms_per_call"))])
    return [f"Health.Check, {result.get('calls_per_socket', NR)} calls per socket",
            "latency, ms: median (p90)", "server CPU per call (ms)"], rows


def large_requests(result: dict):
    rows = []
    for name, d in result.get("sockets", {}).items():
        codes = ", ".join(f"{code} {n}" for code, n in d.get("codes", {}).items())
        rows.append([name, sig(d.get("rss_before_mib")), sig(d.get("rss_max_mib")), sig(d.get("rss_last_round_mib")),
                     sig(d.get("rss_settled_mib")), codes])
    return [f"{result.get('rounds', NR)} rounds of {result.get('concurrency', NR)} requests of "
            f"{sig(result.get('size_bytes'))} bytes, to", "RSS before (MiB)", "RSS max", "RSS after the last round",
            "RSS 2 s later", "answers"], rows


def driver_lifecycle(result: dict):
    scales = result.get("scales", [])
    cfg = result.get("config", {})
    ext4 = f"ext4 {cfg.get('ext4_mib', NR)} MiB"
    xfs = f"xfs {cfg.get('xfs_mib', NR)} → {cfg.get('xfs_grown_mib', NR)} MiB"

    def step(scale: dict, fs: str, name: str) -> dict:
        return scale.get("steps", {}).get(fs, {}).get(name, {})

    def row(label: str, fs: str, name: str) -> list:
        cells = [p50_p90(step(s, fs, name), n=False) for s in scales]
        first, last = (middle(step(s, fs, name)) for s in (scales[0], scales[-1])) if scales else (None, None)
        return [label, *cells, ratio(last, first)]

    rows = [row(f"whole lifecycle ({ext4}, sum of 9 steps)", "ext4", "total"),
            row(f"NodeStageVolume ({ext4}), the longest step", "ext4", "NodeStageVolume"),
            row(f"NodeGetVolumeStats ({ext4})", "ext4", "NodeGetVolumeStats"),
            row(f"ControllerExpandVolume ({xfs})", "xfs", "ControllerExpandVolume"),
            row(f"NodeExpandVolume ({xfs})", "xfs", "NodeExpandVolume")]
    env = [s.get("env", {}) for s in scales]
    rows.append(["mountinfo lines; driver RSS (MiB); other processes (cores)",
                 *(f"{e.get('mountinfo_lines', NR)}; {sig(e.get('driver_rss_mib'))}; "
                   f"{sig(e.get('other_processes_cpu_cores'))}" for e in env), ""])
    header = [f"ms, median (p90; n {cfg.get('volumes_per_scale', NR)})",
              *(f"{s.get('background', NR)} background volumes" for s in scales), "largest / smallest"]
    return header, rows




def p50_p99(d: dict | None) -> str:
    """"median (p90 x; p99 y)" of a summary keyed p50_ms, p90_ms, p99_ms."""
    if not isinstance(d, dict):
        return NR
    extra = [f"{q} {sig(d[f'{q}_ms'])}" for q in ("p90", "p99") if f"{q}_ms" in d]
    return sig(d.get("p50_ms")) + (f" ({'; '.join(extra)})" if extra else "")


def handler_bench(result: dict):
    runs = result.get("part1", {}).get("runs", {})
    kinds = ("create", "update", "remove")
    rows = []
    for name, run in runs.items():
        cells = []
        for kind in kinds:
            k = run.get("kinds", {}).get(kind, {})
            cells.append(f"{p50_p99(k.get('indexed'))}; missed {num(k.get('missed'))}")
        rows.append([f"index sees an entry ({name})", *cells])
    part2 = result.get("part2", {})
    paths = part2.get("paths", {})
    if paths:
        names = list(paths)
        label = f"NodeGetVolumeStats ({part2.get('fs', NR)}, {part2.get('rounds', NR)} rounds)"
        rows.append([f"{label}, through the proxy",
                     *(f"{n.removeprefix('proxy NodeGetVolumeStats, ')}: {p50_p99(paths[n])}" for n in names[:2]), ""])
        rows.append(["the deferred chain's inner hops", *(f"{n}: {p50_p99(paths[n])}" for n in names[2:5]),
                     *[""] * (3 - len(names[2:5]))])
    return ["ms: median (p90; p99)", *kinds], rows


def file_io(result: dict):
    ways = ("on the loop", "one thread hop", "aiofiles")

    def cell(d: dict | None) -> str:
        if not isinstance(d, dict):
            return ""
        return f"{sig(d.get('p50'))} (p90 {sig(d.get('p90'))}; p99 {sig(d.get('p99'))}; n {d.get('n', NR)})"

    rows = [[label, *(cell(result.get(key, {}).get(way)) for way in ways)]
            for key, label in (("write_ms", "an atomic 1 KiB write (ms)"), ("loop_held_ms", "the loop held (ms)"),
                               ("read_us", "a read (µs)"))]
    return ["median (p90; p99; n)", *ways], rows


def call_cpu(result: dict):
    calls = result.get("calls", {})
    targets = list(next(iter(calls.values()), {}))
    rows = []
    for name, by in calls.items():
        cells = []
        for t in targets:
            d = by.get(t, {})
            times = f" ({sig(d.get('cpu_ratio_to_reference'))}×)" if "cpu_ratio_to_reference" in d else ""
            cells.append(f"{sig(d.get('cpu_ms'))}{times}; {sig(d.get('wall_ms_median'))}")
        rows.append([name, *cells])
    header = [f"call ({result.get('config', {}).get('calls', NR)} of each)"]
    header += [f"{t}{' (anchor)' if t == 'reference' else ''}: CPU ms per call (× reference); wall ms, median"
               for t in targets]
    return header, rows


def pod_start(result: dict):
    parts = result.get("results", {})
    ours, anchor = parts.get("crust-runc", {}), parts.get("runc", {})
    rows = []
    for key in ("to_first_write_ms", "RunPodSandbox_ms", "CreateContainer_ms", "StartContainer_ms"):
        rows.append([key.removesuffix("_ms").replace("to_first_write", "RunPodSandbox to the first write"),
                     spread(ours.get(key)), spread(anchor.get(key)),
                     ratio(middle(ours.get(key)), middle(anchor.get(key)))])
    inner = [(label, ours.get(key)) for key, label in (("handler_prepare_ms", "handler prepare"),
                                                     ("runc_create_ms", "runc create"),
                                                     ("handler_created_ms", "handler created"))]
    rows.append(["  of StartContainer, crust's create: " + ", ".join(label for label, _ in inner),
                 "; ".join(num(middle(d)) for _, d in inner), "", ""])
    fs = f"{result.get('fs_type', NR)} {result.get('volume_mib', NR)} MiB"
    return [f"ms, {fs}, containerd {result.get('containerd', NR)}", "crust-runc (deferred)",
            "anchor: runc (host mount)", "crust-runc / runc"], rows


def conformance_ratio(result: dict):
    targets = result.get("summary", {}).get("targets", {})
    runs = result.get("runs", [])
    rows = []
    for name, t in targets.items():
        mine = [r.get("ms_per_spec") for r in runs if r.get("target") == name and r.get("ms_per_spec") is not None]
        around = f" ({sig(min(mine))}–{sig(max(mine))})" if mine else ""
        counts = "/".join(str(max(t.get(k) or [0])) for k in ("ran", "passed", "failed", "skipped"))
        cpu = "; ".join(f"{d} {sig(c)}" for d, c in t.get("daemon_cpu_seconds", {}).items())
        rows.append([name, counts, f"{sig(t.get('ms_per_spec'))}{around}",
                     f"{sig(t['ratio_to_reference'])}×" if "ratio_to_reference" in t else "(anchor)",
                     f"{sig(t.get('daemons_cpu_seconds'))} ({cpu})",
                     f"{sig(t['cpu_ratio_to_reference'])}×" if "cpu_ratio_to_reference" in t else "(anchor)"])
    rounds = result.get("config", {}).get("rounds", NR)
    return [f"target ({rounds} rounds)", "specs ran/passed/failed/skipped", "ms per run spec, median (min–max)",
            "/ reference", "daemons' CPU per suite (s), median", "/ reference"], rows



def med_span(median, span) -> str:
    """"median (min–max)" of a median kept beside its runs' [min, max]."""
    if isinstance(span, (list, tuple)) and len(span) == 2:
        return f"{sig(median)} ({sig(span[0])}–{sig(span[1])})"
    return sig(median)


def pod_share(result: dict):
    create, create_mm = result.get("create_s", {}), result.get("create_s_min_max", {})
    io, io_mm = result.get("io_mib_per_s", {}), result.get("io_mib_per_s_min_max", {})
    look, look_mm = result.get("lookups_s", {}), result.get("lookups_s_min_max", {})
    rows = []
    for name, label in (("busybox", "busybox rootfs"), ("big", f"+ {result.get('big_mib', NR)} MiB of files")):
        sides = create.get(name, {})
        rows.append([f"create a container (s), {label}: the copy made before → the share",
                     " → ".join(med_span(sides.get(k), create_mm.get(name, {}).get(k)) for k in ("copy", "share"))])
    rows.append(["first output, busybox, create + start (s)",
                 med_span(result.get("first_output_s"), result.get("first_output_s_min_max"))])
    for kind, label in (("write", "write, fsync'd"), ("read", "cold read")):
        rows.append([f"guest {label}, {result.get('mib', NR)} MiB (MiB/s): virtio-fs; virtio-blk",
                     "; ".join(med_span(io.get(side, {}).get(kind), io_mm.get(side, {}).get(kind))
                               for side in ("virtio-fs", "virtio-blk"))])
    rows.append(["path lookups in the root (s): 20 × ls -lL /bin; 100 × /bin/true",
                 "; ".join(med_span(look.get(k), look_mm.get(k)) for k in ("ls_lL_bin_x20", "exec_true_x100"))])
    rows.append(["the pod VM's boot (s)", sig(result.get("pod_boot_s"))])
    return [f"median (min–max) of {result.get('runs', NR)} runs", "value"], rows


def pod_network(result: dict):
    parts = result.get("results", {})
    ours, anchor = parts.get("crust-microvm", {}), parts.get("runc", {})

    def cell(d: dict, key: str, p90: str = "") -> str:
        extra = [f"p90 {sig(d[p90])}"] if p90 and p90 in d else []
        mm = d.get(f"{key.removesuffix('_median')}_min_max")
        if isinstance(mm, list) and len(mm) == 2:
            extra.append(f"{sig(mm[0])}–{sig(mm[1])}")
        return sig(d.get(key)) + (f" ({'; '.join(extra)})" if extra else "")

    args = result.get("args", {})
    rows = []
    for key, label, p90 in (("host_to_pod_ms_median", f"host → pod GET, ms ({args.get('requests', NR)})",
                             "host_to_pod_ms_p90"),
                            ("host_to_pod_mib_s", f"host → pod, {args.get('mib', NR)} MiB file, MiB/s", ""),
                            ("pod_to_pod_ms", "pod → pod wget, ms (mean in the client)", ""),
                            ("pod_to_pod_mib_s", f"pod → pod, {args.get('mib', NR)} MiB file, MiB/s", "")):
        rows.append([label, cell(ours, key, p90), cell(anchor, key, p90), ratio(ours.get(key), anchor.get(key))])
    return [f"median (p90; min–max), {args.get('runs', NR)} runs of a file", "crust-microvm", "anchor: runc",
            "crust-microvm / runc"], rows



def luks_io(result: dict):
    io = result.get("io", result)  # the figures sit under "io"
    mb = io.get("mb_per_s", {})
    sides = list(mb)
    modes = list(next(iter(mb.values()), {}))

    def cell(d: dict | None) -> str:
        if not isinstance(d, dict):
            return NR
        return f"{sig(d.get('median'))} ({sig(d.get('min'))}–{sig(d.get('max'))})"

    rows = [[f"{mode}, {kind}", *(cell(mb[side].get(mode, {}).get(kind)) for side in sides)]
            for mode in modes for kind in ("write", "read")]
    rows.append(["luksFormat + open + mkfs.ext4; close + open (s)",
                 *(f"{sig(io.get(f'{side}_format_and_mkfs_s'))}; {sig(io.get(f'{side}_close_and_reopen_s'))}"
                   if f"{side}_format_and_mkfs_s" in io else "-" for side in sides)])
    return [f"MB/s, {io.get('mib', NR)} MiB in the guest: median (min–max) of {io.get('runs', NR)} runs",
            *(f"{side} (anchor)" if side == "plain" else side for side in sides)], rows



def scale_deferred(result: dict):
    per_call = result.get("per_call", {})
    scales = list(next(iter(per_call.values()), {})) or ["10"]

    def row(label: str, of: dict, extra=p50_p90) -> list:
        cells = [extra(of.get(n)) for n in scales]
        first, last = ((of.get(n) or {}).get("p50_ms") for n in (scales[0], scales[-1]))
        return [label, *cells, ratio(last, first)]

    rows = [row("CreateVolume (fill)", per_call.get("create", {})),
            row("NodeStageVolume (fill)", per_call.get("stage", {})),
            row("deferred NodePublishVolume until the index holds it (fill; at N its last 10)",
                per_call.get("publish_indexed", {})),
            row("RunSandbox of up to 100 volumes (the stack at 10: one of 10)", per_call.get("run_sandbox", {})),
            row(f"NodeGetVolumeStats through the chain, sandbox's statvfs ({result.get('host_mounts', NR)} host "
                "mounts)", result.get("stats", {}), p50_p99),
            row("… 50 at once: each call's latency", {n: (result.get("burst", {}).get(n) or {}).get("latency")
                                                     for n in scales}, p50_p99),
            row(f"… {result.get('fanout', {}).get('calls_per_stack', NR)} spread over "
                f"{sig(result.get('fanout', {}).get('seconds'))} s, both stacks at once",
                result.get("fanout", {}), p50_p99),
            row("churn: RunSandbox over one volume", per_call.get("churn_run_sandbox", {})),
            row("churn: DeleteSandbox", per_call.get("churn_delete_sandbox", {})),
            ["RSS full (MiB): driver; shim; proxy; handler",
             *("; ".join(sig(v) for v in (result.get("rss", {}).get("full", {}).get(n) or {}).values())
               for n in scales), ""]]
    return ["ms: median (p90; p99)", *(f"stack at {n} volumes" for n in scales), f"{scales[-1]} / {scales[0]}"], rows


def snapshot_freeze(result: dict):
    rows = []
    for runtime in ("light", "microvm"):
        part = result.get(runtime, {})
        stop = {mode: part.get(mode, {}).get("write_stop", {}) for mode in ("freeze", "no freeze")}
        call = {mode: part.get(mode, {}).get("create_snapshot", {}) for mode in ("freeze", "no freeze")}
        rows.append([runtime, *(f"{num(stop[m].get('p50_ms'))} / {num(stop[m].get('p99_ms'))}" for m in stop),
                     *(num(call[m].get("p50_ms")) for m in call)])
    return ["runtime", "writes stopped, freeze: p50 / p99 (ms)", "no freeze: p50 / p99",
            "CreateSnapshot p50, freeze (ms)", "no freeze"], rows


TABLES = {"hop_cost": hop_cost, "shim_latency": shim_latency, "proxy_bench": proxy_bench,
          "peer_gate": peer_gate, "large_requests": large_requests, "driver_lifecycle": driver_lifecycle,
          "handler_bench": handler_bench, "file_io": file_io, "call_cpu": call_cpu, "pod_start": pod_start,
          "conformance_ratio": conformance_ratio, "guest_boot": named_rows("ways", "way (ms)"),
          "pod_share": pod_share, "pod_network": pod_network, "luks_io": luks_io, "scale_deferred": scale_deferred,
          "snapshot_freeze": snapshot_freeze}

SCENARIOS += (
    _pending("hop-cost", "What each hop costs: driver, shim, proxy", "hop_cost", "--rounds 500 --cpu-calls 3000 --bare",
             anchor="the driver alone, and `bench/lib/bare_hop.py` forwarding raw bytes (`--bare`)."),
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
             anchor="runc's pod network on the same node, in the same run (measured first)."),
    _pending("file-io", "Small files on the event loop", "file_io", "--json OUT.json"),
    _pending("scale-deferred", "1,000 deferred volumes", "scale_deferred", "--volumes 1000 --json OUT.json"),
    _pending("conformance", "The conformance suite against the Go reference", "conformance_ratio", "--json OUT.json",
             anchor="the Go hostpath plugin running the same suite."),
    _pending("call-cpu", "CPU per CSI call", "call_cpu", "--json OUT.json",
             anchor="the Go hostpath plugin (csi-driver-host-path) sent the same calls, by turns."),
    _pending("snapshot-freeze", "A pod's writes during a snapshot, with and without the freeze", "snapshot_freeze",
             "--snapshots 20 --json OUT.json", anchor="the same pod's snapshots with `crust.dev/freeze: never`."),
)
