#!/usr/bin/env python3
"""A sandbox start that waits for its volume's entry: from the proxy writing
mountInfo.json to the waiting start going on, by the index's event (what the
handler does now) against a 20 ms poll of the index (what it did before).

    .venv/bin/python bench/csi/entry_wait.py [--rounds 200] [--json OUT]

Both waiters run in one process on one VolumeIndex (watchdog) over a real
directory, interleaved round by round; the writer is the proxy's own
(VolumesDir.write). The rest of a sandbox start (claim, mount, process) is
the same either way, so this difference is what a start that has to wait
gains.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib.benchlib import machine, print_rows, run_header, summary, write_json  # noqa: E402
from crust.contract.mountinfo import MountInfo, digest  # noqa: E402
from crust.contract.volumes_dir import VolumesDir  # noqa: E402
from crust.runtime_handler.index import VolumeIndex  # noqa: E402

POLL_SECONDS = 0.02  # the interval of the polling wait this replaced


async def by_event(index: VolumeIndex, name: str) -> None:
    woken = index.awaiting([name])
    try:
        if index.get(name) is None:
            await asyncio.wait_for(woken, 5)
    finally:
        index.forget([name], woken)


async def by_poll(index: VolumeIndex, name: str) -> None:
    def poll() -> None:
        deadline = time.monotonic() + 5
        while index.get(name) is None and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
    await asyncio.to_thread(poll)


async def measure(root: Path, rounds: int) -> dict:
    index = VolumeIndex(root).start()
    writer = VolumesDir(root)
    waits = {"event": by_event, "poll (20 ms)": by_poll}
    seen: dict[str, list[float]] = {way: [] for way in waits}
    try:
        for i in range(rounds):
            for way in (list(waits) if i % 2 == 0 else list(reversed(waits))):
                target = f"/var/lib/kubelet/pods/bench/volumes/kubernetes.io~csi/pv-{way[:5]}-{i}/mount"
                waiter = asyncio.create_task(waits[way](index, digest(target)))
                await asyncio.sleep(0.005)  # the start is waiting before the entry comes
                started = time.perf_counter()
                await writer.write(MountInfo(device="/dev/loop0", fstype="ext4", target_path=target))
                await waiter
                seen[way].append((time.perf_counter() - started) * 1e3)
    finally:
        index.stop()
    return {"from_write_to_start_ms": {way: summary(v, 2, ("p50", "p90", "p99", "max")) for way, v in seen.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200, help="waits of each kind (default: 200)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = run_header("entry_wait", None, machine())
    with tempfile.TemporaryDirectory(prefix="crust-wait-") as directory:
        results.update(asyncio.run(measure(Path(directory), args.rounds)))
    print_rows(results["from_write_to_start_ms"])
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
