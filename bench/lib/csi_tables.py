"""The tables of the storage path's benchmarks (bench/csi/). Each keeps to a
few rows (a page stays under 600 lines): a cell says what its figure is when
the row's label does not."""

from __future__ import annotations

from bench.lib.figures import NR, middle, num, p50_p90, p50_p99, ratio, sig, signed


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
