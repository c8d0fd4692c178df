#!/usr/bin/env python3
"""How long a pod's writes stop while a snapshot of its deferred volume is
taken through the shim, with the freeze (`crust.dev/freeze: best-effort`)
and without (`never`), for the light handler and the microVM handler.

    .venv/bin/python bench/csi/snapshot_freeze.py [--snapshots 20] [--runtimes light,microvm] [--json OUT]

The pod appends 32-byte records, each fsync'd, each holding the pod's
clock (CLOCK_REALTIME) when its write began. Snapshots are taken one by
one, 1.5 s apart, the frozen ones first, then (after a pause) the
unfrozen ones. Afterwards the pod is stopped and the record file read from
the volume's image on the host; a snapshot's write stop is the longest gap
between two consecutive records that overlaps its call (the host's clock
window, widened by 0.25 s; the guest's clock is set from the host's at
boot). Quoted: median and p99 (nearest rank) of those stops, and of the
CreateSnapshot call itself, per runtime and mode (benchlib.pct).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib.benchlib import accelerator_under, machine, pct, run_header, write_json  # noqa: E402
from crust.api import csi_pb2  # noqa: E402
from tests.harness.freeze_images import volume_image  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402

RECORD = 32
WRITER = ("import os, sys, time\n"
          "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)\n"
          "while True:\n"
          "    os.write(fd, b\"%031.6f\\n\" % time.time())\n"
          "    os.fsync(fd)\n")
SLACK = 0.25
SPACING = 1.5


def writer_script(path: str) -> str:
    return f"P=$(command -v python3 || command -v python3.11) && exec $P -S -c '{WRITER}' {path}"


def stamps(image: Path, fs: str) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="crust-bench-") as mnt:
        subprocess.run(["mount", "-o", "loop,ro" + (",nouuid" if fs == "xfs" else ""), str(image), mnt],
                       check=True)
        try:
            data = (Path(mnt) / "records").read_bytes()
        finally:
            subprocess.run(["umount", "-d", mnt], check=True)
    whole = len(data) // RECORD
    return [float(data[i * RECORD:(i + 1) * RECORD]) for i in range(whole)]


def stop_in(times: list[float], start: float, end: float) -> float:
    """The longest gap between consecutive records overlapping [start, end]."""
    longest = 0.0
    for a, b in zip(times, times[1:]):
        if b >= start - SLACK and a <= end + SLACK:
            longest = max(longest, b - a)
    return longest


def ms_summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"p50_ms": round(pct(ordered, 0.5) * 1000, 1), "p99_ms": round(pct(ordered, 0.99) * 1000, 1),
            "max_ms": round(ordered[-1] * 1000, 1), "count": len(ordered)}


@contextlib.contextmanager
def environment(runtime: str, root: Root):
    if runtime == "light":
        from tests.harness.handler_env import Env
        env = Env(root)
        try:
            yield env
        finally:
            env.delete_sandboxes()
    else:
        from tests.harness.kata_env import kata_env
        made = kata_env(root)
        env = next(made)
        try:
            yield env
        finally:
            made.close()


def measure(runtime: str, snapshots: int, fs: str) -> dict:
    root = Root()
    try:
        with environment(runtime, root) as env:
            v = env.volume("pv-bench", fs)
            env.run_ok(env.bundle("bench", writer_script("/data/records"), [("/data", str(v.target))]), "sb-bench")
            time.sleep(3 if runtime == "light" else 20)  # the pod writing steadily (a VM boots first)
            accelerator = accelerator_under(root.path) if runtime != "light" else "none (no VM)"
            windows: dict[str, list[tuple[float, float]]] = {"freeze": [], "no freeze": []}
            for mode, value in (("freeze", "best-effort"), ("no freeze", "never")):
                for i in range(snapshots):
                    start = time.time()
                    snap = env.shim.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(
                        name=f"b-{value}-{i}", source_volume_id=v.volume_id,
                        parameters={"crust.dev/freeze": value}), timeout=120).snapshot
                    windows[mode].append((start, time.time()))
                    env.shim.controller.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(
                        snapshot_id=snap.snapshot_id), timeout=60)
                    time.sleep(SPACING)
                time.sleep(3)
            env.delete("sb-bench")
            times = stamps(volume_image(env.driver.data_dir, v.volume_id), fs)
    finally:
        root.close()
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    out = {"accelerator": accelerator, "records": len(times), "write_gap_p50_ms": round(pct(gaps, 0.5) * 1000, 2)}
    for mode, spans in windows.items():
        out[mode] = {"write_stop": ms_summary([stop_in(times, s, e) for s, e in spans]),
                     "create_snapshot": ms_summary([e - s for s, e in spans])}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--snapshots", type=int, default=20, help="snapshots per mode (default 20)")
    parser.add_argument("--runtimes", default="light,microvm")
    parser.add_argument("--fs", default="ext4", choices=["ext4", "xfs"])
    parser.add_argument("--json", type=Path, default=Path("-"))
    args = parser.parse_args()
    results = run_header("snapshot_freeze", None, machine(), vm="microvm" in args.runtimes)
    results["fs_type"] = args.fs
    results["snapshots_per_mode"] = args.snapshots
    for runtime in args.runtimes.split(","):
        results[runtime] = measure(runtime, args.snapshots, args.fs)
        if runtime != "light":
            results["accelerator"] = results[runtime]["accelerator"]
        print(f"{runtime}: {results[runtime]}", file=sys.stderr)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
