#!/usr/bin/env python3
"""The daemons' memory under bursts of large requests.

A real driver -> shim -> proxy stack (tests/harness/daemons.py). Each socket gets
--rounds rounds of --concurrency concurrent requests of --size bytes (just
under gRPC's default 4 MiB message limit): a CreateVolumeRequest carrying
one unknown field of that size, which each hop forwards or reads as it
would any request (the proxy forwards CreateVolume as raw bytes to the
shim, whose 1 MiB request limit refuses it; the driver parses and refuses
it). After each round the daemon's RSS is read from /proc/PID/status, and
once more two seconds after the last round.

    .venv/bin/python bench/csi/large_requests.py [--rounds 20] [--concurrency 14] [--size 4194048]
        [--sockets proxy,shim,driver] [--json FILE]

The stack runs from this checkout, so running it at two commits compares
them (docs/performance.md, "Memory under large requests").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib.benchlib import loadavg, machine, run_header, write_json  # noqa: E402
from tests.harness.large_requests import burst, large_request  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=14)
    parser.add_argument("--size", type=int, default=4 * 1024 * 1024 - 256,
                        help="bytes per request (default: just under gRPC's 4 MiB limit)")
    parser.add_argument("--sockets", default="proxy,shim,driver",
                        help="which sockets, each on a fresh stack, in this order (default proxy,shim,driver)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("large_requests: run as root (the driver attaches loop devices)", file=sys.stderr)
        return 1

    from tests.harness.daemons import Root

    data = large_request(args.size)
    results = {**run_header("large_requests", None, machine()),
               "rounds": args.rounds, "concurrency": args.concurrency, "size_bytes": args.size, "sockets": {}}
    for name in args.sockets.split(","):
        root = Root()
        try:
            driver, shim, proxy = root.stack()
            daemon = {"proxy": proxy, "shim": shim, "driver": driver}[name]
            results["sockets"][name] = burst(daemon.socket, daemon.proc.pid, data, args.rounds, args.concurrency)
        finally:
            root.close()
    results["load_after"] = loadavg()
    print(json.dumps(results, indent=1))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
