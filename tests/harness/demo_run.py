"""`crust demo` run as a user runs it, for the tests of its CRI variants:
a child process with --json, its temporary root below the test's, and
what it must leave behind: nothing (its root, processes naming it, QEMU
processes below it, a VM socket directory of its own, its CRI-O's short
directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from crust.demo.crio import short_directory
from crust.kata.vmm.qemu import SHORT_SOCKET_ROOT, qemu_pids_under
from tests.harness.cri import processes_naming

PROJECT = Path(__file__).resolve().parents[2]


def short_socket_dirs() -> set[Path]:
    return set(SHORT_SOCKET_ROOT.iterdir()) if SHORT_SOCKET_ROOT.exists() else set()


def run_demo(root, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> dict:
    """`crust demo ARGS --json`: its result, after checking that every step
    held and that it left nothing."""
    tmp = root.path / "tmp"
    tmp.mkdir()
    sockets_before = short_socket_dirs()
    proc = subprocess.run([sys.executable, "-m", "crust", "demo", *args, "--json"], cwd=PROJECT,
                          env={**os.environ, **(env or {}), "TMPDIR": str(tmp)}, capture_output=True, text=True,
                          timeout=timeout)
    result = json.loads(proc.stdout) if proc.stdout.startswith("{") else {}
    failed = [(s["name"], s["detail"]) for s in result.get("steps", []) if not s["ok"]]
    assert proc.returncode == 0, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    assert result["ok"] is True and failed == []
    assert result["stats_match_df"] and result["data_verified"] and not result["host_mounted_during_sandbox"]
    assert result["size_after"] > result["size_before"]  # grown online where the pod mounts it
    assert len(result["cri"]["pod_sandbox_id"]) == 64 and result["cri"]["container_exit_code"] == 0
    assert list(tmp.iterdir()) == [] and processes_naming(str(tmp)) == [] and qemu_pids_under(tmp) == []
    # A VM's socket directory left is the demo's when no process names it
    # (one a test running beside made belongs to its live QEMU).
    assert [d for d in short_socket_dirs() - sockets_before if not processes_naming(str(d))] == []
    assert not short_directory(Path(result["root"]) / "cri-o").exists()
    return result
