"""The benchmarks' targets, kept beside them as data (bench/GROUP/targets.toml)
and held against their results: each a figure of a scenario's newest result
(a path into its JSON) and the bound it must keep.

    python -m bench.lib.targets [RESULT.json ...]

With result files, each is checked against the targets of its benchmark;
without, the newest committed result of every scenario is. A figure outside
its bound is reported, and the exit status is 1 (as a CI gate would use it);
docs/performance.md shows the verdicts under each scenario's table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bench.lib.run_record import PROJECT

GROUPS = PROJECT / "bench"
Outcome = Literal["met", "missed", "no figure"]


class Target(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    scenario: str = Field(description="the docs/performance.md scenario whose result it is held against")
    what: str
    figure: str = Field(description="the figure's path in the result's JSON, keys joined by '/'")
    at_most: float | None = None
    at_least: float | None = None
    unit: str = ""
    set_by: str = Field(description="who asked for it: an issue, a page")

    @model_validator(mode="after")
    def _one_bound(self) -> "Target":
        if (self.at_most is None) == (self.at_least is None):
            raise ValueError(f"target {self.what!r}: give exactly one of at_most, at_least")
        return self

    @property
    def bound(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return f"<= {self.at_most:g}{unit}" if self.at_most is not None else f">= {self.at_least:g}{unit}"

    def value_in(self, result: dict) -> float | None:
        node = result
        for key in self.figure.split("/"):
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None

    def outcome(self, result: dict) -> tuple[Outcome, float | None]:
        value = self.value_in(result)
        if value is None:
            return "no figure", None
        ok = value <= self.at_most if self.at_most is not None else value >= self.at_least
        return ("met" if ok else "missed"), value


def load(groups: Path = GROUPS) -> dict[str, list[Target]]:
    """Each group's targets (bench/GROUP/targets.toml), by group."""
    found = {}
    for path in sorted(groups.glob("*/targets.toml")):
        data = tomllib.loads(path.read_text())
        found[path.parent.name] = [Target(**entry) for entry in data.get("target", [])]
    return found


def all_targets() -> list[Target]:
    return [t for targets in load().values() for t in targets]


def verdict_line(target: Target, result: dict) -> str:
    outcome, value = target.outcome(result)
    shown = "" if value is None else f": {value:g}"
    return f"{target.what} {target.bound}{shown}, {outcome} ({target.set_by})"


def main(argv: list[str] | None = None) -> int:
    from bench.lib.render import load_results
    from bench.lib.scenarios import SCENARIOS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="*", type=Path)
    args = parser.parse_args(argv)
    scenarios = {s.id: s for s in SCENARIOS}
    if args.results:
        checked = [(p.name, json.loads(p.read_text())) for p in args.results]
    else:
        checked = load_results()
    missed = 0
    for target in all_targets():
        scenario = scenarios[target.scenario]
        runs = [(n, r) for n, r in checked if scenario.matches(n, r)]
        if not runs:
            if not args.results:
                print(f"{target.scenario}: {target.what} {target.bound}: no result")
            continue
        name, newest = runs[-1]
        outcome, _ = target.outcome(newest)
        missed += outcome == "missed"
        print(f"{target.scenario} ({name}): {verdict_line(target, newest)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
