"""What a bench's result file records of the run (bench/benchlib.py)."""

from __future__ import annotations

import json

from bench.benchlib import PROJECT, portable_command


def test_a_results_command_names_files_not_the_machines_paths():
    assert portable_command("pod_logs", ["--rounds", "5", "--json", "/srv/runs/b5/A.json"]) == \
        "bench/pod_logs.py --rounds 5 --json A.json"
    assert portable_command("pod_start_microvm", ["--keep-log", "/var/tmp/logs", "--pools", "0,1"]) == \
        "bench/pod_start_microvm.py --keep-log logs --pools 0,1"


def test_no_committed_result_names_a_path_of_the_machine_it_ran_on():
    commands = {}
    for path in sorted((PROJECT / "bench" / "results").glob("*.json")):
        command = json.loads(path.read_text()).get("command")
        if isinstance(command, str):
            commands[path.name] = command
    assert commands
    named = {name: c for name, c in commands.items() if any(word.startswith("/") for word in c.split())}
    assert named == {}
