"""docs/performance.md's tables, rendered from the committed results.

    ./run bench-docs            # rewrite docs/performance.md
    ./run bench-docs --check    # exit 1 if it is stale
    (or .venv/bin/python -m bench.lib.render [--check], once .venv exists)

Each scenario (bench/lib/scenarios.py) takes the newest result in bench/results/
that is one of its runs and renders one table: the figures, the anchor's
beside them where the bench measured one (runc, a floor), the command that
reproduces the run, and the run's machine, accelerator, load and commit.
The tables sit between markers in docs/performance.md,

    <!-- bench:table ID -->  ...  <!-- bench:end ID -->

and everything outside the markers (the notes) is written by hand and kept
as it is. A scenario whose markers are missing gets a section appended at
the end. The output depends on the committed files only, never on the
clock or the machine rendering it (tests/unit/test_bench_render.py holds the
document to that).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from bench.lib.run_record import PROJECT, describe, script_of
from bench.lib.scenarios import SCENARIOS as ONE_RUN
from bench.lib.scenarios import Scenario
from bench.lib.scenarios_pairs import PAIR_SCENARIOS
from bench.lib.targets import load as load_targets
from bench.lib.targets import verdict_line

SCENARIOS = (*ONE_RUN, *PAIR_SCENARIOS)

RESULTS = PROJECT / "bench" / "results"
DOC = PROJECT / "docs" / "performance.md"
# The microVM pods' scenarios have a page of their own: one page would be too
# long to read. A scenario on neither page is added to the first.
MICROVM_DOC = PROJECT / "docs" / "performance-microvm.md"
DOCS = (DOC, MICROVM_DOC)
COMMAND = "./run bench-docs"
MAX_CELL = 300

HEAD = """# Performance

What crust's benchmarks measure now: one table per scenario, from the newest
result of that scenario in `bench/results/`, with the command that reproduces
it. Each result file records its machine, accelerator, load and commit;
older results of a scenario stay there as files. The tables are rendered by
`{command}` (`.venv/bin/python -m bench.lib.render`); the notes around them are
written by hand. `tests/unit/test_bench_render.py` fails when a table is stale.
"""

_MARK = re.compile(r"<!-- bench:table (?P<id>[\w-]+) -->\n.*?<!-- bench:end (?P=id) -->", re.S)


def load_results(directory: Path = RESULTS) -> list[tuple[str, dict]]:
    """(file name, result) of every result file, oldest first (by the run's
    date, then the name: the same order on any machine)."""
    found = []
    for path in sorted(directory.glob("*.json")):
        result = json.loads(path.read_text())
        if isinstance(result, dict):
            found.append((path.name, result))
    return sorted(found, key=lambda item: (str(item[1].get("date", "")), item[0]))


def cell(value) -> str:
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= MAX_CELL else text[:MAX_CELL - 1] + "…"


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(cell(h) for h in header) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def reproduce(result: dict, name: str) -> str:
    """The run's recorded command, its --json naming the committed file
    (bench/results/NAME) whatever name the run wrote it under, so that the
    command reproduces the result where it is kept."""
    command = result.get("command")
    if not isinstance(command, str):
        return "not recorded"
    words, out = command.split(), f"bench/results/{name}"
    if words and words[0].startswith("bench/") and words[0].endswith(".py"):
        words[0] = script_of(Path(words[0]).stem)
    flag = next((i for i, w in enumerate(words) if w == "--json" or w.startswith("--json=")), None)
    if flag is None:
        words += ["--json", out]
    elif words[flag] == "--json" and flag + 1 < len(words) and not words[flag + 1].startswith("--"):
        words[flag + 1] = out
    else:
        words[flag] = f"--json {out}"
    return ".venv/bin/python " + " ".join(words)


def render_block(scenario: Scenario, results: list[tuple[str, dict]]) -> str:
    runs = [(name, r) for name, r in results if scenario.matches(name, r)]
    if not runs:
        # Where its result would be kept, as the Reproduce line of a committed one names it.
        words = scenario.command.split()
        if "--json" in words:
            del words[words.index("--json"):words.index("--json") + 2]
        command = " ".join([*words, "--json", f"bench/results/{scenario.benchmark}.json"])
        body = [f"No result of this scenario is committed. Reproduce: `{command}`"]
    else:
        name, newest = runs[-1]
        info = describe(newest)
        header, rows = scenario.table(newest)
        dirty = {"yes": ", uncommitted changes", "no": ""}.get(info["dirty"], ", tree state not recorded")
        body = table(header, rows) + [""]
        if scenario.anchor:
            body.append(f"- Anchor: {scenario.anchor}")
        for group, targets in load_targets().items():
            held = [verdict_line(t, newest) for t in targets if t.scenario == scenario.id]
            if held:
                body.append(f"- Targets (bench/{group}/targets.toml): " + "; ".join(held))
        # One line for the run (the document stays under 600 lines with a
        # table for every scenario).
        body.append(f"- Reproduce: `{reproduce(newest, name)}`; result `bench/results/{name}`, run {info['date']} at "
                    f"commit {info['commit']}{dirty}; machine: {info['machine']}; accelerator: "
                    f"{info['accelerator']}; load: {info['load']}")
        older = [n for n, _ in runs[:-1]]
        if older:
            body.append(f"- Older results: {', '.join(f'`{n}`' for n in reversed(older))}")
    text = _current_paths("\n".join(body))
    return f"<!-- bench:table {scenario.id} -->\n" + text + f"\n<!-- bench:end {scenario.id} -->"


def _current_paths(text: str) -> str:
    """A benchmark's file as the tree holds it now: results recorded before
    the benchmarks were grouped name bench/NAME.py (or .c)."""
    def current(match: re.Match) -> str:
        found = sorted((PROJECT / "bench").glob(f"*/{match.group(1)}"))
        return str(found[0].relative_to(PROJECT)) if found else match.group(0)
    return re.sub(r"\bbench/(\w+\.(?:py|c))\b", current, text)


def render(current: str, results: list[tuple[str, dict]], elsewhere: frozenset[str] = frozenset()) -> str:
    """current (the document as it is, "" if none) with every scenario's
    block rendered anew; sections appended for the scenarios it lacks that
    are not `elsewhere` (on another page)."""
    known = {s.id: s for s in SCENARIOS}
    text = current or HEAD.format(command=COMMAND)
    seen = set()

    def replace(match: re.Match) -> str:
        scenario = known.get(match["id"])
        if scenario is None:
            raise SystemExit(f"docs: no scenario {match['id']!r} in bench/lib/scenarios.py")
        seen.add(scenario.id)
        return render_block(scenario, results)

    text = _MARK.sub(replace, text)
    for scenario in SCENARIOS:
        if scenario.id not in seen and scenario.id not in elsewhere:
            text = text.rstrip("\n") + f"\n\n### {scenario.title}\n\n{render_block(scenario, results)}\n"
    return text.rstrip("\n") + "\n"


def render_pages(pages: dict[Path, str], results: list[tuple[str, dict]]) -> dict[Path, str]:
    """Every page (path -> its text as it is) rendered anew; a scenario no
    page shows yet is added to the first page."""
    shown = {path: set(m["id"] for m in _MARK.finditer(text)) for path, text in pages.items()}
    rendered, first = {}, next(iter(pages))
    for path, text in pages.items():
        others = frozenset().union(*(ids for p, ids in shown.items() if p != path))
        if path != first:
            others |= frozenset(s.id for s in SCENARIOS) - shown[path]
        rendered[path] = render(text, results, others)
    return rendered


def current_pages() -> dict[Path, str]:
    return {path: path.read_text() if path.exists() else "" for path in DOCS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1, changing nothing, if a page is stale")
    args = parser.parse_args(argv)
    current = current_pages()
    rendered = render_pages(current, load_results())
    stale = [path for path in DOCS if rendered[path] != current[path]]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(PROJECT)} is stale: run `{COMMAND}`", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(rendered[path])
        print(f"wrote {path.relative_to(PROJECT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
