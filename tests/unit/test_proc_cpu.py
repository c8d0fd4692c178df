"""crust.sys.proc.cpu_seconds: a process's CPU time from /proc, every thread counted."""

from __future__ import annotations

import subprocess
import sys

from crust.sys import proc

# Two threads that each spin until they have used 0.2 s of CPU, then wait to be read.
SPIN = """
import sys, threading, time
def spin():
    end = time.thread_time() + 0.2
    while time.thread_time() < end:
        pass
threads = [threading.Thread(target=spin) for _ in range(2)]
for t in threads: t.start()
for t in threads: t.join()
print("spun", flush=True)
sys.stdin.read()
"""


def test_a_process_cpu_time_counts_all_its_threads_and_a_gone_one_has_none():
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "spun\n"
        used = proc.cpu_seconds(child.pid)
        assert used is not None and used >= 0.35, used
    finally:
        child.communicate("")
    assert proc.cpu_seconds(child.pid) is None
    assert proc.cpu_seconds(0) is None
