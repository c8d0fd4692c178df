"""The side-by-side scenarios of docs/performance.md (bench/lib/render.py):
benches run in one session against this commit and the one before a
change (bench/lib/side_by_side.py keeps the pairs as one result), each figure
beside the other run's."""

from __future__ import annotations

from bench.lib.figures import NR, middle, num
from bench.lib.scenarios import Scenario


def _pss(column: dict, key: str) -> float | None:
    return middle(column.get(key)) if key in column else None


def _density_rows(label: str, now: dict, before: dict) -> list[tuple[str, object, object]]:
    ours, theirs = now["columns"]["crust-microvm"], before["columns"]["crust-microvm"]
    n = now["columns"]["crust-microvm"]["pss_mib"].get("n")
    rows = [(f"{label}, {n} idle pods: PSS per pod (MiB)", _pss(ours, "pss_mib"), _pss(theirs, "pss_mib")),
            (f"{label}: the same without TCG's translation buffer (MiB)", _pss(ours, "pss_mib_without_tcg_buffer"),
             _pss(theirs, "pss_mib_without_tcg_buffer"))]
    parts = ("guest RAM", "qemu-system-x86_64", "TCG translation buffer", "guest root image", "crust shim")
    mine, other = ours.get("pss_mib_by_process", {}), theirs.get("pss_mib_by_process", {})
    rows.append((f"{label}: of it " + ", ".join(parts) + " (MiB)",
                 " / ".join(num(middle(mine.get(p))) for p in parts),
                 " / ".join(num(middle(other.get(p))) for p in parts)))
    if "template" in now or "template" in before:
        rows.append((f"{label}: the template's RAM file, data (MiB)",
                     _mib(now.get("template", {}).get("ram_bytes")), _mib(before.get("template", {}).get("ram_bytes"))))
    rows.append((f"{label}: CPU per idle pod (cores)", _pss(ours, "cores"), _pss(theirs, "cores")))
    return rows


def _mib(value) -> float | None:
    return round(value / 2**20, 1) if isinstance(value, (int, float)) else None


def _freed_rows(label: str, now: dict, before: dict) -> list[tuple[str, object, object]]:
    def path(result: dict, key: str) -> str:
        last = (result.get("after_removal") or [{}])[-1]
        return " → ".join(num(r.get(key)) for r in (result.get("before", {}), result.get("written", {}), last))
    return [(f"{label}: QEMU RSS before → written → {num((now.get('after_removal') or [{}])[-1].get('seconds'))} s "
             "after the removal (MiB)", path(now, "rss_mib"), path(before, "rss_mib"))]


# A figure's name in the table where its key does not say it.
NAMES = {"vm_up_qemu_cpu_ms": "QEMU's CPU time to the agent's answer"}


def _start_rows(label: str, now: dict, before: dict) -> list[tuple[str, object, object]]:
    rows = []
    for setting in now.get("results", {}):
        if setting not in before.get("results", {}) or not isinstance(now["results"][setting], dict):
            continue
        for key in ("RunPodSandbox_ms", "StartContainer_ms", "vm_up_qemu_cpu_ms"):
            if key in now["results"][setting]:
                rows.append((f"{label}, {setting}: {NAMES.get(key, key.removesuffix('_ms'))} (ms)",
                             middle(now["results"][setting][key]), middle(before["results"][setting].get(key))))
    return rows


ROWS = {"pod_density": _density_rows, "pod_freed_memory": _freed_rows, "pod_start_microvm": _start_rows}


def microvm_costs(result: dict):
    rows = []
    for label, pair in result.get("pairs", {}).items():
        make = ROWS.get(pair["now_run"].get("benchmark"))
        if make is None:
            continue
        for name, ours, theirs in make(label, pair["now"], pair["before"]):
            both = isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and theirs
            rows.append([name, num(ours) if ours is not None else NR, num(theirs) if theirs is not None else NR,
                         f"{ours / theirs:.2f}×" if both else ""])
    before = {pair["before_run"].get("commit", NR)[:12] for pair in result.get("pairs", {}).values()}
    for label, pair in result.get("pairs", {}).items():
        now, then = pair["now_run"], pair["before_run"]
        rows.append([f"{label}: load (1, 5, 15 min) at the run's start → end",
                     f"{now.get('load_before')} → {now.get('load_after')}",
                     f"{then.get('load_before')} → {then.get('load_after')}", ""])
    rows.append(["the commit before", "", ", ".join(sorted(before)), ""])
    return ["figure", "this commit", "the commit before (same session)", "this / before"], rows


PAIR_SCENARIOS = (
    Scenario("microvm-costs", "The guest root, freed memory and TCG's buffer, beside the commit before",
             "microvm_costs_side_by_side", microvm_costs,
             ".venv/bin/python bench/lib/side_by_side.py --pair ... (bench/runtime/pod_density.py, "
             "bench/runtime/pod_freed_memory.py, bench/runtime/pod_start_microvm.py, each run in this tree and in "
             "the commit before's)"),
)
