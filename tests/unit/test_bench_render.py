"""docs/performance.md and docs/performance-microvm.md hold what
bench/lib/render.py makes of the committed results (bench/results/): a result
committed without rendering, or a table edited by hand, fails here."""

from __future__ import annotations

import json

from bench.lib import render


def test_the_performance_pages_are_what_the_committed_results_render():
    current = render.current_pages()
    rendered = render.render_pages(current, render.load_results())
    for path in render.DOCS:
        assert rendered[path] == current[path], f"{path.name} is stale: run `{render.COMMAND}` and commit it"


def test_every_scenario_is_on_exactly_one_page():
    shown = [m["id"] for text in render.current_pages().values() for m in render._MARK.finditer(text)]
    assert sorted(shown) == sorted(s.id for s in render.SCENARIOS)


def test_the_performance_pages_stay_short_and_their_cells_readable():
    for path in render.DOCS:
        lines = path.read_text().splitlines()
        assert len(lines) < 600, path.name
        cells = [c for line in lines if line.startswith("|") for c in line.strip("|").split(" | ")]
        assert max(map(len, cells)) <= render.MAX_CELL


def test_every_committed_result_names_its_benchmark_and_command():
    for path in sorted(render.RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        assert isinstance(result.get("benchmark"), str) and isinstance(result.get("command"), str), path.name


def test_a_new_result_becomes_its_scenarios_table_and_the_old_one_is_listed(tmp_path):
    old = {"benchmark": "pod_idle_cpu", "command": "bench/runtime/pod_idle_cpu.py", "date": "2026-01-01T00:00:00+00:00",
           "columns": {"floor: a VM alone": {"qemu_cores": {"median": 0.5, "min": 0.4, "max": 0.6}}}}
    new = {**old, "date": "2026-02-01T00:00:00+00:00", "commit": "a" * 40, "dirty": False,
           "columns": {"floor: a VM alone": {"qemu_cores": {"median": 0.25, "min": 0.2, "max": 0.3}}}}
    for name, result in (("a_old.json", old), ("b_new.json", new)):
        (tmp_path / name).write_text(json.dumps(result))
    doc = render.render("", render.load_results(tmp_path))
    block = doc.split("<!-- bench:table pod-idle-cpu -->")[1].split("<!-- bench:end pod-idle-cpu -->")[0]
    assert "0.25 (0.2–0.3)" in block and "0.5 (" not in block
    assert "Older results: `a_old.json`" in block
    assert "accelerator: not recorded" in block and "at commit aaaaaaaaaaaa" in block
    # Rendering is a fixed point: what it wrote renders to itself.
    assert render.render(doc, render.load_results(tmp_path)) == doc
