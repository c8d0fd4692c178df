"""The benchmarks' targets as data (bench/GROUP/targets.toml, bench/lib/targets.py):
each names a scenario of its own group's benchmarks and a figure its results
hold, and a figure outside its bound is reported missed."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from bench.lib.render import load_results
from bench.lib.run_record import PROJECT
from bench.lib.scenarios import SCENARIOS
from bench.lib.targets import Target, load, main

SCENARIOS_BY_ID = {s.id: s for s in SCENARIOS}


def test_every_target_names_a_scenario_of_a_benchmark_in_its_group():
    groups = load()
    assert groups, "no bench/GROUP/targets.toml"
    for group, targets in groups.items():
        for target in targets:
            scenario = SCENARIOS_BY_ID.get(target.scenario)
            assert scenario, f"{group}: {target.what}: no scenario {target.scenario}"
            assert (PROJECT / "bench" / group / f"{scenario.benchmark}.py").exists(), (group, target.what)


def test_every_target_finds_its_figure_in_the_newest_committed_result():
    """A renamed key in a benchmark's JSON must not turn a target into one
    that is never checked."""
    results = load_results()
    for targets in load().values():
        for target in targets:
            runs = [r for n, r in results if SCENARIOS_BY_ID[target.scenario].matches(n, r)]
            if runs:
                assert target.value_in(runs[-1]) is not None, (target.scenario, target.figure)


def test_a_figure_outside_its_bound_is_missed_and_one_inside_is_met():
    most = Target(scenario="s", what="w", figure="a/b c/median", at_most=10, unit="ms", set_by="x")
    least = Target(scenario="s", what="w", figure="rate", at_least=10, set_by="x")
    assert most.outcome({"a": {"b c": {"median": 10}}}) == ("met", 10.0)
    assert most.outcome({"a": {"b c": {"median": 10.5}}}) == ("missed", 10.5)
    assert most.outcome({"a": {}}) == ("no figure", None)
    assert most.outcome({"a": {"b c": {"median": "10"}}}) == ("no figure", None)
    assert least.outcome({"rate": 9.9}) == ("missed", 9.9)
    assert least.bound == ">= 10" and most.bound == "<= 10 ms"


def test_a_target_needs_exactly_one_bound():
    with pytest.raises(ValidationError):
        Target(scenario="s", what="w", figure="f", set_by="x")
    with pytest.raises(ValidationError):
        Target(scenario="s", what="w", figure="f", at_most=1, at_least=0, set_by="x")


def test_a_result_file_outside_a_target_fails_the_check(tmp_path, capsys):
    target = next(t for targets in load().values() for t in targets)
    scenario = SCENARIOS_BY_ID[target.scenario]
    run = next(r for n, r in reversed(load_results()) if scenario.matches(n, r))
    path = tmp_path / "run.json"
    node = run
    keys = target.figure.split("/")
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = (target.at_most + 1) if target.at_most is not None else (target.at_least - 1)
    path.write_text(json.dumps(run))
    assert main([str(path)]) == 1
    (line,) = [line for line in capsys.readouterr().out.splitlines() if target.what in line]
    assert line.endswith(f"missed ({target.set_by})")
    node[keys[-1]] = target.at_most if target.at_most is not None else target.at_least
    path.write_text(json.dumps(run))
    main([str(path)])
    (line,) = [line for line in capsys.readouterr().out.splitlines() if target.what in line]
    assert line.endswith(f"met ({target.set_by})")
