"""A benchmark run as its users run it: `.venv/bin/python bench/GROUP/NAME.py`,
from the project's root, its JSON result read back. Tests that check a
benchmark end to end run it this way and never import its script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, out: Path, timeout: float = 600) -> dict:
    """The result `script` (bench/GROUP/NAME.py) wrote to `out`; its output
    in the failure's message when it exits non-zero."""
    done = subprocess.run([sys.executable, str(PROJECT / script), *args, "--json", str(out)],
                          cwd=PROJECT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return json.loads(out.read_text())
