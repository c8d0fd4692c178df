#!/usr/bin/env python3
"""What the peer gate (crust/common/peergate.py) costs per call.

One server process serves the gRPC health service twice with crust's own
Daemon: on a plain unix socket, and behind a peer gate (every call's caller
checked, root allowed). A client process calls Health.Check on both,
interleaved (the order alternates every round), and reports per socket the
median and p90 latency and the server's CPU per call (from its clock ticks,
measured over each socket's own calls only: the two are timed in separate
blocks of --block calls, alternating). What the gate adds is the relay (one
extra pair of socket writes each way) and the policy check.

    .venv/bin/python bench/csi/peer_gate.py [--calls 4000] [--block 200] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib.benchlib import TICK, loadavg, machine, proc_ticks, quantiles, run_header, write_json  # noqa: E402

SERVER = r"""
import asyncio, sys
from crust.common.grpcserver import Daemon
from crust.common.peergate import PeerPolicy

async def main(root):
    plain = Daemon("plain", f"unix://{root}/plain.sock", [])
    gated = Daemon("gated", f"unix://{root}/gated.sock", [], peer_policy=PeerPolicy([0]))
    await plain.start()
    await gated.start()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await gated.stop(1)
    await plain.stop(1)

asyncio.run(main(sys.argv[1]))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=4000, help="calls per socket (default 4000)")
    parser.add_argument("--block", type=int, default=200, help="calls per timed block (default 200)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("peer_gate: run as root (the gate allows root)", file=sys.stderr)
        return 1

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    root = Path(tempfile.mkdtemp(prefix="crust-gate-"))
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert server.stdout.readline().strip() == "ready"
        stubs = {}
        channels = []
        for name in ("plain", "gated"):
            channel = grpc.insecure_channel(f"unix://{root}/{name}.sock")
            channels.append(channel)
            stubs[name] = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        for stub in stubs.values():
            for _ in range(200):  # warm-up
                stub.Check(request, timeout=10)
        latency = {name: [] for name in stubs}
        ticks = {name: 0 for name in stubs}
        load_before = loadavg()
        for turn in range(args.calls // args.block):
            order = list(stubs) if turn % 2 == 0 else list(reversed(stubs))
            for name in order:
                stub = stubs[name]
                before = proc_ticks(server.pid)
                for _ in range(args.block):
                    started = time.perf_counter()
                    stub.Check(request, timeout=10)
                    latency[name].append(time.perf_counter() - started)
                ticks[name] += proc_ticks(server.pid) - before
        results = {**run_header("peer_gate", None, machine()), "load_before": load_before, "load_after": loadavg(),
                   "calls_per_socket": len(latency["plain"])}
        for name in stubs:
            median, p90 = quantiles(latency[name])
            results[name] = {"median_ms": round(median * 1e3, 3), "p90_ms": round(p90 * 1e3, 3),
                             "server_cpu_ms_per_call": round(ticks[name] / TICK * 1e3 / len(latency[name]), 3)}
        results["added_median_ms"] = round(results["gated"]["median_ms"] - results["plain"]["median_ms"], 3)
        results["added_cpu_ms_per_call"] = round(results["gated"]["server_cpu_ms_per_call"]
                                                 - results["plain"]["server_cpu_ms_per_call"], 3)
        print(json.dumps(results, indent=1))
        if args.json:
            write_json(args.json, results)
        for channel in channels:
            channel.close()
        return 0
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        for name in ("plain.sock", "gated.sock", ".gated.sock.inner"):
            (root / name).unlink(missing_ok=True)
        root.rmdir()


if __name__ == "__main__":
    sys.exit(main())
