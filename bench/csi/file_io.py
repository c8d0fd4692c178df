#!/usr/bin/env python3
"""Small files on a daemon's event loop: what each way of writing and
reading a record costs, and how long it holds the loop.

    .venv/bin/python bench/csi/file_io.py [--rounds 300] [--size 1024] [--dir /var/lib/crust] [--json OUT]

A record or mountInfo.json is a ~1 KiB file written atomically (temporary
file, fsync, rename, fsync of the directory). Three ways, interleaved round
by round:
- on the loop: the whole write runs on the event loop;
- one thread hop: asyncio.to_thread of the whole write;
- aiofiles: the whole write in one trip to aiofiles' threads, what the
  daemons use (crust.common.atomicfile).
For each: the write's latency, and the loop's lag, measured by a task that
yields to the loop in a tight cycle while the writes run (the longest time
the loop could not serve anything else). Reads: a synchronous read on the
loop against aiofiles.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiofiles  # noqa: E402

from bench.lib.benchlib import machine, print_rows, run_header, summary, write_json  # noqa: E402
from crust.common.atomicfile import write_atomic, write_atomic_async  # noqa: E402

WAYS = {
    "on the loop": lambda path, data: _now(write_atomic, path, data),
    "one thread hop": lambda path, data: asyncio.to_thread(write_atomic, path, data),
    "aiofiles": lambda path, data: write_atomic_async(path, data),
}


async def _now(fn, *args):
    fn(*args)


async def _lag_watch(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        await asyncio.sleep(0)
        lags.append(time.perf_counter() - started)


async def measure(directory: Path, rounds: int, size: int) -> dict:
    data = os.urandom(size)
    path = directory / "record.json"
    latency = {way: [] for way in WAYS}
    lag = {way: [] for way in WAYS}
    for i in range(rounds):
        order = list(WAYS)[i % len(WAYS):] + list(WAYS)[:i % len(WAYS)]  # rotated: no way always goes first
        for way in order:
            lags: list[float] = []
            stop = asyncio.Event()
            watcher = asyncio.create_task(_lag_watch(stop, lags))
            await asyncio.sleep(0)
            started = time.perf_counter()
            await WAYS[way](path, data)
            latency[way].append(time.perf_counter() - started)
            stop.set()
            await watcher
            lag[way].append(max(lags, default=0.0))
    reads = {"on the loop": [], "aiofiles": []}
    for i in range(rounds):
        started = time.perf_counter()
        path.read_bytes()
        reads["on the loop"].append(time.perf_counter() - started)
        started = time.perf_counter()
        async with aiofiles.open(path, "rb") as f:
            await f.read()
        reads["aiofiles"].append(time.perf_counter() - started)
    ms = 1e3
    return {
        "write_ms": {way: summary([s * ms for s in v], 3, ("p50", "p90", "p99", "max")) for way, v in latency.items()},
        "loop_held_ms": {way: summary([s * ms for s in v], 3, ("p50", "p90", "p99", "max")) for way, v in lag.items()},
        "read_us": {way: summary([s * 1e6 for s in v], 1, ("p50", "p90", "p99")) for way, v in reads.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300, help="writes of each way (default: 300)")
    parser.add_argument("--size", type=int, default=1024, help="bytes per record (default: 1024)")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                        help="file system to write on (default: /var/tmp; use the daemons' state dir's)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = run_header("file_io", None, machine())
    with tempfile.TemporaryDirectory(prefix="crust-fileio-", dir=args.dir) as directory:
        results.update(asyncio.run(measure(Path(directory), args.rounds, args.size)))
    for table in ("write_ms", "loop_held_ms", "read_us"):
        print(table)
        print_rows(results[table], indent="  ")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
