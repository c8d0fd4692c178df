#!/usr/bin/env python3
"""Results of benches run in one session against two commits (this one and
the one before a change: a second worktree of it), kept as one result for
docs/performance.md (bench/lib/render.py, scenario "microvm-costs"): for each
pair, the figures of each run under "now" and "before" and each run's
header (commit, date, accelerator, load) beside them; the header of the
whole is the first pair's run of this commit.

    .venv/bin/python bench/lib/side_by_side.py --pair LABEL NOW.json BEFORE.json [--pair ...] \\
        --json bench/results/NAME.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib.run_record import write_json  # noqa: E402

HEADER = ("benchmark", "command", "date", "machine", "commit", "dirty", "dirty_paths", "accelerator",
          "load_before", "load_after")
RUN = ("benchmark", "command", "commit", "dirty", "date", "accelerator", "load_before", "load_after", "load")
BENCHMARK = "microvm_costs_side_by_side"


def _run(result: dict) -> dict:
    """A run's header; its load at the end under one name ("load" in some benches)."""
    run = {key: result.get(key) for key in RUN if key != "load"}
    run["load_after"] = result.get("load_after") or result.get("load")
    return run


def pairs(given: list[tuple[str, dict, dict]]) -> dict:
    if not given:
        raise ValueError("no pair given")
    first = given[0][1]
    merged = {key: first[key] for key in HEADER if key in first}
    merged["benchmark"] = BENCHMARK
    merged["command"] = "bench/lib/side_by_side.py " + " ".join(f"--pair {label!r} ..." for label, _, _ in given)
    merged["pairs"] = {}
    for label, now, before in given:
        if now.get("benchmark") != before.get("benchmark"):
            raise ValueError(f"{label}: results of two benches, {now.get('benchmark')} and {before.get('benchmark')}")
        merged["pairs"][label] = {
            "now_run": _run(now), "before_run": _run(before),
            "now": {key: value for key, value in now.items() if key not in HEADER},
            "before": {key: value for key, value in before.items() if key not in HEADER}}
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", nargs=3, action="append", metavar=("LABEL", "NOW", "BEFORE"), required=True)
    parser.add_argument("--json", required=True, help="write the pairs there")
    args = parser.parse_args(argv)
    given = [(label, json.loads(Path(now).read_text()), json.loads(Path(before).read_text()))
             for label, now, before in args.pair]
    write_json(Path(args.json), pairs(given))
    return 0


if __name__ == "__main__":
    sys.exit(main())
