#!/usr/bin/env python3
"""The containerd shim's `start`, timed: containerd 1.6 runs
`containerd-shim-crust-v2 ... start` for every container of a pod, inside
StartContainer, and waits for the address it prints.

Each round runs `start` for a container whose shim already answers (the
node's shared shim, the default: a listening socket at its address, made
here, so no daemon is started): what every container after the node's
first costs. With several
--binary, the binaries take turns in each round (the order alternating),
so that they are measured side by side. Reported per binary: the median
wall time (min-max) and the median CPU time (user + system) of a call.

    .venv/bin/python bench/microvm/shim_start.py [--rounds 20] [--binary PATH ...] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from crust.containerd_shim.main import group_of, socket_path  # noqa: E402
from crust.containerd_shim.options import ENV_SHIM_GROUP, NODE, handler_endpoint  # noqa: E402

POD = "shim-start-bench"
NAMESPACE = "k8s.io"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--binary", action="append", default=[],
                        help="a containerd-shim-crust-v2 to time (again for more); default: this venv's")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    binaries = [str(Path(b).absolute()) for b in args.binary] or \
        [str(Path(sys.executable).parent / "containerd-shim-crust-v2")]

    bundle = Path(tempfile.mkdtemp(prefix="crust-shim-start-"))
    address = str(bundle / "containerd.sock")   # never dialled by start
    path = socket_path(address, NAMESPACE, group_of(bundle, "ctr", shared=True, endpoint=handler_endpoint()))
    env = {**os.environ, ENV_SHIM_GROUP: NODE}
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    wall: dict[str, list[float]] = {b: [] for b in binaries}
    cpu: dict[str, list[float]] = {b: [] for b in binaries}
    load_before = benchlib.loadavg()
    try:
        (bundle / "config.json").write_text(json.dumps({"annotations": {
            "io.kubernetes.cri.sandbox-id": POD, "io.kubernetes.cri.container-type": "container"}}))
        listener.bind(str(path))
        listener.listen(128)
        listener.setblocking(False)
        for n in range(args.rounds):
            for binary in binaries if n % 2 == 0 else list(reversed(binaries)):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                started = time.monotonic()
                out = subprocess.run([binary, "-namespace", NAMESPACE, "-address", address, "-id", f"ctr{n}",
                                      "start"], cwd=bundle, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                     timeout=60, check=True).stdout.decode()
                wall[binary].append((time.monotonic() - started) * 1e3)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu[binary].append((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1e3)
                if out != f"unix://{path}":
                    raise SystemExit(f"{binary} printed {out!r}, not the shim's address")
                while True:   # the liveness checks' connections
                    try:
                        listener.accept()[0].close()
                    except BlockingIOError:
                        break
    finally:
        listener.close()
        path.unlink(missing_ok=True)
        shutil.rmtree(bundle, ignore_errors=True)

    results = {b: {"wall_ms": benchlib.summary(wall[b], 1), "cpu_ms": benchlib.summary(cpu[b], 1)} for b in binaries}
    info = benchlib.machine()
    print(f"containerd-shim-crust-v2 start, {args.rounds} rounds, {benchlib.machine_summary(info)}")
    for binary in binaries:
        w, c = results[binary]["wall_ms"], results[binary]["cpu_ms"]
        print(f"  {binary}: wall {w['median']:.1f} ms ({w['min']:.1f}-{w['max']:.1f}), cpu {c['median']:.1f} ms")
    load = benchlib.loadavg()
    print(f"load {load_before} before, {load} after")
    if args.json:
        Path(args.json).write_text(json.dumps({
            **benchlib.run_header("shim_start", argv, info), "rounds": args.rounds,
            "results": results, "load_before": load_before, "load": load}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
