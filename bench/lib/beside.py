#!/usr/bin/env python3
"""Two results of one bench, run back to back (the same commands, the
commit before a change in a work tree of its own, then the change), kept
as one file: the newer result with the older one under "before" (its
commit, date, load and figures), so that a table of docs/performance.md
puts each figure beside the one of the commit before.

    .venv/bin/python -m bench.lib.beside BEFORE.json AFTER.json --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.lib.run_record import describe

# What a result holds of its run rather than its figures (kept once, the newer run's).
RUN_KEYS = {"benchmark", "command", "date", "machine", "accelerator", "code", "commit", "dirty", "dirty_paths",
            "load_before", "load_after", "load", "wall_seconds", "containerd"}


def merge(before: dict, after: dict, before_ran: str = "just before") -> dict:
    if before.get("benchmark") != after.get("benchmark"):
        raise ValueError(f"results of two benches: {before.get('benchmark')!r} and {after.get('benchmark')!r}")
    info = describe(before)
    kept = {key: value for key, value in before.items() if key not in RUN_KEYS}
    merged = dict(after)
    merged["before"] = {"note": f"the same bench at the commit before, run {before_ran} this one",
                        "code": info["commit"], "date": info["date"], "command": before.get("command", ""),
                        "load_before": before.get("load_before", ""),
                        "load_after": before.get("load_after", before.get("load", "")), **kept}
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--json", required=True, type=Path)
    parser.add_argument("--before-ran-after", action="store_true",
                        help="the commit before's run came right after this one's, not before it")
    args = parser.parse_args(argv)
    merged = merge(json.loads(args.before.read_text()), json.loads(args.after.read_text()),
                   "just after" if args.before_ran_after else "just before")
    args.json.write_text(json.dumps(merged, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
