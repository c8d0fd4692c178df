"""What a bench's result file records of the run (bench/lib/benchlib.py)."""

from __future__ import annotations

import json

from bench.lib.benchlib import PROJECT, portable_command


def test_a_results_command_names_files_not_the_machines_paths():
    assert portable_command("pod_logs", ["--rounds", "5", "--json", "/srv/runs/b5/A.json"]) == \
        "bench/runtime/pod_logs.py --rounds 5 --json A.json"
    assert portable_command("pod_start_microvm", ["--keep-log", "/var/tmp/logs", "--pools", "0,1"]) == \
        "bench/runtime/pod_start_microvm.py --keep-log logs --pools 0,1"


def test_no_committed_result_names_a_path_of_the_machine_it_ran_on():
    commands = {}
    for path in sorted((PROJECT / "bench" / "results").glob("*.json")):
        command = json.loads(path.read_text()).get("command")
        if isinstance(command, str):
            commands[path.name] = command
    assert commands
    named = {name: c for name, c in commands.items() if any(word.startswith("/") for word in c.split())}
    assert named == {}


def test_a_results_header_names_the_commit_the_accelerator_and_the_load():
    from bench.lib.run_record import machine, run_header

    header = run_header("pod_logs", ["--rounds", "5"], machine(), vm=True)
    assert len(header["commit"]) == 40 and isinstance(header["dirty"], bool)
    assert header["accelerator"] == "not recorded"  # a VM bench sets it once its VM says
    assert run_header("file_io", [], machine())["accelerator"] == "none (no VM)"
    assert len(header["load_before"].split()) == 3


def test_an_older_result_reads_back_with_what_it_lacks_not_recorded():
    from bench.lib.run_record import describe

    old = describe({"machine": {"cpus": 2, "cpu_model": "AMD EPYC", "memory": "23.5 GiB", "kernel": "6.18"},
                    "code": "e2e1c83 + uncommitted changes in 1 crust/ files", "accel": "tcg"})
    assert (old["commit"], old["dirty"], old["accelerator"], old["load"]) == ("e2e1c83", "yes", "tcg", "not recorded")
    assert describe({})["machine"] == "not recorded"
