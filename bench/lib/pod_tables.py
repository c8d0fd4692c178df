"""The tables of the pod benchmarks (bench/runtime/, bench/microvm/): what
a result of each makes in docs/performance.md and performance-microvm.md."""

from __future__ import annotations

from bench.lib.figures import NR, med_span, middle, num, ratio, sig, spread


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
    for key, label in (("pss_mib", "PSS per pod (MiB)"),
                       ("pss_mib_without_tcg_buffer", "PSS per pod without TCG's translation buffer (MiB)"),
                       ("cores", "CPU per idle pod (cores)"), ("processes_per_pod", "processes per pod")):
        if key == "pss_mib_without_tcg_buffer" and key not in ours:
            continue
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
        for part, seconds in (ours.get("cpu_s_per_pod_by_process") or {}).items():
            label = "its processes' CPU per pod (s)" if part == "sum" else f"  of which {part} (s)"
            rows.append([f"{setting}: {label}", num(seconds), "", ""])
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
