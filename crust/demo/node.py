"""`crust node` as the demo runs it: a child process with the demo's config
and its own log, serving once it says every component is."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from crust.demo.microvm import accelerator
from crust.demo.steps import StepFailed, check


class NodeProcess:
    """`crust node` with the demo's config, as a child process with its own log."""

    def __init__(self, root: Path, config: Path, ready_seconds: float):
        self.root, self.config, self.ready_seconds = root, config, ready_seconds
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        self.proc = subprocess.Popen([sys.executable, "-m", "crust", "node", "--config", str(self.config)],
                                     stdout=open(self.root / "node.out", "wb"), stderr=open(self.root / "node.log", "ab"))
        deadline = time.monotonic() + self.ready_seconds
        while time.monotonic() < deadline:
            check(self.proc.poll() is None, f"crust node exited with {self.proc.returncode}; see node.log")
            out = (self.root / "node.out").read_text(errors="replace")
            if "every component is serving" in out:
                status = json.loads((self.root / "run" / "node" / "status.json").read_text())
                children = ", ".join(f"{c['name']} {c['pid']}" for c in status["children"])
                return f"pid {self.proc.pid}; children: {children}" + accelerator(self.root / "node.log")
            time.sleep(0.05)
        raise StepFailed(f"crust node did not come up within {self.ready_seconds:g} s")

    def stop(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode if self.proc is not None else None

